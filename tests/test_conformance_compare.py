"""The comparator on synthetic engine results (the real-engine test is test_conformance_engine.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance import cases as C
from conformance.orchestrate.compare import NEVER_FIRED_NO_FILE, compare_kv, compare_logprobs, compare_results
from conformance.orchestrate.parity import ProblemKind
from conformance.results import CaseResult, FaultRecord, KvSnapshotMeta

MT = 4


def _meta(keys: dict[str, Any], token_dims: dict[str, Any]) -> KvSnapshotMeta:
    full = {k: {"group": 0, "block_size": 4, **v} for k, v in keys.items()}
    return KvSnapshotMeta(keys=full, token_dims=token_dims, whole_block_layers=[], num_arrays=0)


def _result(
    tokens: list[list[int]], *, engine: str = "native", schedule: Any = None, kv: bool = True
) -> CaseResult:
    return CaseResult.model_validate(_result_dict(tokens, engine=engine, schedule=schedule, kv=kv))


def _result_dict(tokens: list[list[int]], *, engine: str, schedule: Any, kv: bool) -> dict[str, Any]:
    reqs = []
    for i, toks in enumerate(tokens):
        reqs.append(
            {
                "rid": f"p1-{i:02d}",
                "label": "x",
                "pass_no": 1,
                "prompt_len": 5,
                "token_ids": list(toks),
                "logprobs": [[[t, -1.0 - 0.1 * j, 1], [t + 1, -2.0, 2]] for j, t in enumerate(toks)],
                "num_cached_tokens": 0,
                "finish_reason": "length",
                "finished": True,
            }
        )
    return {
        "case": C.Case(C.ARCHETYPES["llama"]).to_json(),
        "side": "candidate",
        "engine": engine,
        "error": None,
        "requests": reqs,
        "kv_status": "ok" if kv else "pending",
        "kv": {"keys": {}, "token_dims": {}, "whole_block_layers": [], "num_arrays": 0},
        "probe": {
            "steps": [], "schedule_fingerprint": schedule or [[[0, 5]]], "copies_total": 0, "copy_batches": 0,
            "preemptions_counted": 0, "partial_prefix_hits": 0, "prefix_hit_admissions": 0,
        },
        "metrics": {"preemptions": 0.0, "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0},
        "scheduler": {
            "scheduler_type": "Scheduler", "batch_queue": False, "async_scheduling": False,
            "executor": "UniProcExecutor", "world_size": 1,
        },
        "mapped_bytes_peak": 1,
        "mapped_bytes_final": 1,
        "t_total": 1.0,
    }  # fmt: skip


def _kv_files(tmp_path: Path, name: str, arrays: dict[str, np.ndarray]) -> Path:
    p = tmp_path / f"{name}.npz"
    np.savez(p, **arrays)
    return p


def _with_kv(res: CaseResult, blocks: list[tuple[int, int]]) -> CaseResult:
    keys = {"aa" * 4: {"kind": "FullAttentionSpec", "layers": ["L"], "blocks": [list(b) for b in blocks]}}
    res.kv = _meta(keys, {"L|0": 2, "L|1": 1})
    return res


CASE = C.Case(C.ARCHETYPES["llama"], max_tokens=MT)
NOPC = C.Case(C.ARCHETYPES["llama"], prefix_caching=False, max_tokens=MT)


def test_exact_results_pass(tmp_path: Path) -> None:
    k = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
    arrays = {"b1|L|0": k, "b1|L|1": k.transpose(0, 2, 1).copy()}
    ref = _with_kv(_result([[1, 2, 3, 4], [5, 6, 7, 8]]), [(1, 4)])
    oth = _with_kv(_result([[1, 2, 3, 4], [5, 6, 7, 8]], engine="kvcached"), [(1, 4)])
    row, reqs = compare_results(
        CASE, ref, oth, _kv_files(tmp_path, "r", arrays), _kv_files(tmp_path, "o", arrays), True
    )
    assert row.passed and row.verdict == "exact", row.problems
    assert row.kv_blocks_compared == row.kv_blocks_identical == 1
    assert all(r.exact for r in reqs) and row.comparison == "kvcached vs native"


def test_token_mismatch_fails_and_names_first_divergence(tmp_path: Path) -> None:
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 9, 4]])
    row, reqs = compare_results(CASE, ref, oth, None, None, True)
    assert not row.passed and row.verdict == "MISMATCH"
    assert reqs[0].first_divergence == 2 and row.first_divergence.startswith("p1-00@2")
    # The distribution at the divergent position (same context) is compared, and differs.
    assert not reqs[0].logprobs_equal and not row.logprobs_equal


def _no_kv(tmp_path: Path) -> tuple[Path, Path]:
    """Empty KV snapshots: a case without prefix caching compares no block."""
    return _kv_files(tmp_path, "r", {}), _kv_files(tmp_path, "o", {})


def _flip(native_margin: float, *, same_schedule: bool) -> tuple[CaseResult, CaseResult]:
    """Native chose token 3 at position 2 by `native_margin` over token 9; the candidate chose 9.
    Every logprob on identical context shifts by 0.0156 (one bfloat16 spacing at 2-4): the
    rounding that another batch shape gives, as measured on the H200 (run-12-04c, qwen3 mp graphs)."""
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 9, 5]], engine="kvcached",
                                                schedule=None if same_schedule else [[[0, 5]], [[0, 1]]])
    shift = 0.015625
    ref.requests[0].logprobs[2] = [(3, -2.5, 1), (9, -2.5 - native_margin, 2)]
    oth.requests[0].logprobs[2] = [(9, -2.5 - native_margin + shift, 1), (3, -2.5 - shift, 2)]
    oth.requests[0].logprobs[0] = [(t, lp + shift, r) for t, lp, r in ref.requests[0].logprobs[0]]
    return ref, oth


def test_a_near_tie_flipped_by_another_batch_shape_is_explained(tmp_path: Path) -> None:
    """Native's margin within the shift the case measured: the outputs part there, and pass."""
    row, reqs = compare_results(NOPC, *_flip(0.0, same_schedule=False), *_no_kv(tmp_path), True)
    assert row.passed and row.verdict == "exact up to near-tie flips (batching)", row.problems
    assert not reqs[0].exact and any("p1-00@2 (3 vs 9" in e for e in row.explanations), row.explanations
    from conformance.orchestrate.report.build import _who_and_match

    # The summary table says how it passed, not "mismatch".
    assert _who_and_match(row, "KVCached") == ("KVCached", "Exact up to near-tie flips (batching) (0/1 exact)")


@pytest.mark.parametrize(
    ("margin", "same_schedule"),
    [(0.25, False),  # negative control: an ordinary margin is no tie, whatever the schedule
     (0.0, True)],  # the same schedule must give the same bits, ties included
)
def test_a_flip_is_a_mismatch_unless_a_tie_and_another_schedule(tmp_path: Path, margin: float,
                                                                 same_schedule: bool) -> None:
    row, _ = compare_results(NOPC, *_flip(margin, same_schedule=same_schedule), *_no_kv(tmp_path), True)
    assert not row.passed and row.verdict == "MISMATCH"
    assert any("token mismatch in 1 request(s), first p1-00@2" in p for p in row.problems), row.problems


def test_a_flip_is_no_tie_where_the_shift_is_more_than_last_bits(tmp_path: Path) -> None:
    """A shift of 0.5 (a wrong KV block, not rounding) explains no flip, even of an exact tie."""
    ref, oth = _flip(0.0, same_schedule=False)
    oth.requests[0].logprobs[0] = [(t, lp + 0.5, r) for t, lp, r in ref.requests[0].logprobs[0]]
    row, _ = compare_results(NOPC, ref, oth, *_no_kv(tmp_path), True)
    assert not row.passed and row.verdict == "MISMATCH"


def test_a_missing_kv_snapshot_is_an_error_for_a_negative_control_only() -> None:
    """Verdicts decide by a problem's kind: a missing snapshot (MISSING) leaves a case's tokens
    judged (MISMATCH), but a negative control cannot have caught anything without it."""
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 4]], kv=False)
    row, _ = compare_results(CASE, ref, oth, None, None, True)
    assert row.verdict == "MISMATCH" and [p.kind for p in row.problems] == [ProblemKind.MISSING]
    neg = C.Case(C.ARCHETYPES["llama"], control=C.Control.NEG_KV, max_tokens=MT)
    row, _ = compare_results(neg, ref, oth, None, None, True)
    assert row.verdict == "error" and not row.passed
    ref_failed = ref.model_copy(update={"error": "RuntimeError: boom"})
    row, _ = compare_results(CASE, ref_failed, oth, None, None, True)
    assert row.verdict == "error" and [p.kind for p in row.problems] == [ProblemKind.ERROR]


def test_same_schedule_kv_difference_is_unexplained(tmp_path: Path) -> None:
    a = np.zeros((1, 4, 4), np.float32)
    b = a.copy()
    b[0, 0, 0] = 1e-6
    ref = _with_kv(_result([[1, 2, 3, 4]]), [(1, 4)])
    oth = _with_kv(_result([[1, 2, 3, 4]]), [(7, 4)])
    rp = _kv_files(tmp_path, "r", {"b1|L|0": a, "b1|L|1": a})
    op = _kv_files(tmp_path, "o", {"b7|L|0": b, "b7|L|1": a})
    row, _ = compare_results(CASE, ref, oth, rp, op, True)
    assert not row.passed and any("same schedule but KV differs" in p for p in row.problems)
    assert row.kv_max_abs_diff == pytest.approx(1e-6)
    # The same difference under a different schedule is reported and explained.
    oth2 = oth.model_copy(deep=True)
    assert oth2.probe is not None
    oth2.probe.schedule_fingerprint = [[(0, 3)], [(0, 2)]]
    row2, _ = compare_results(CASE, ref, oth2, rp, op, True)
    assert row2.passed and row2.verdict.startswith("tokens exact") and "schedule diverged" in row2.explanations[0]


def test_kv_sets_ignore_block_ids_and_cut_to_common_tokens() -> None:
    # Engine A holds the key in two blocks (one covering only 2 token slots), engine B in one.
    full = np.arange(8, dtype=np.float32).reshape(1, 2, 4)  # K: (heads, head, tokens)
    half = full[:, :, :2].copy()
    ra = _meta({"k": {"kind": "FullAttentionSpec", "layers": ["L"], "blocks": [[3, 4], [9, 2]]}}, {"L|0": 2})
    oa = _meta({"k": {"kind": "FullAttentionSpec", "layers": ["L"], "blocks": [[5, 4]]}}, {"L|0": 2})

    class Npz(dict):
        @property
        def files(self) -> list[str]:
            return list(self)

    out = compare_kv(ra, Npz({"b3|L|0": full, "b9|L|0": half}), oa, Npz({"b5|L|0": full}))
    assert (out.compared, out.identical, out.variants) == (1, 1, 0)
    bad = full.copy()
    bad[0, 1, 0] += 3
    out = compare_kv(ra, Npz({"b3|L|0": full, "b9|L|0": half}), oa, Npz({"b5|L|0": bad}))
    assert (out.compared, out.identical) == (1, 0) and out.max_abs_diff == 3


def test_recurrent_states_compare_only_at_equal_fill() -> None:
    s = np.ones((2, 3), np.float32)
    meta = lambda n: _meta({"k": {"kind": "MambaSpec", "layers": ["M"], "blocks": [[1, n]]}}, {"M|0": None})

    class Npz(dict):
        @property
        def files(self) -> list[str]:
            return list(self)

    out = compare_kv(meta(32), Npz({"b1|M|0": s}), meta(48), Npz({"b1|M|0": s * 2}))
    assert out.compared == 0 and out.not_comparable == 1


def test_logprob_comparison_exact_and_diff() -> None:
    a = [[[1, -0.5, 1], [2, -1.5, 2]]]
    assert compare_logprobs(a, copy.deepcopy(a), 1).equal
    b = [[[1, -0.5000001, 1], [2, -1.5, 2]]]
    res = compare_logprobs(a, b, 1)
    assert not res.equal and res.max_abs_diff == pytest.approx(1e-7)
    c = [[[2, -0.5, 1], [1, -1.5, 2]]]
    assert compare_logprobs(a, c, 1).topk_set_differs == 1


def test_negative_control_inverts_the_verdict(tmp_path: Path) -> None:
    neg = C.Case(C.ARCHETYPES["llama"], control=C.Control.NEG_WEIGHTS, max_tokens=MT)
    empty = _kv_files(tmp_path, "empty", {})
    row, _ = compare_results(neg, _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 5]]), empty, empty, True)
    assert row.passed and row.verdict == "mismatch detected (expected)"
    row, _ = compare_results(neg, _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 4]]), empty, empty, True)
    assert not row.passed and row.verdict == "NOT DETECTED"
    # A control whose KV snapshot is missing is an error, never a detection.
    row, _ = compare_results(neg, _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 5]]), None, None, True)
    assert not row.passed and row.verdict == "error"


def test_fault_plan_must_fire_and_async_must_run() -> None:
    case = C.Case(
        C.ARCHETYPES["nemotron_h"],
        C.Scheduling.ASYNC,
        pattern=C.PrefixPattern.PARTIAL_COW,
        fault=C.COW_ADMISSION_X2,
        max_tokens=MT,
    )
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 4]])
    row, _ = compare_results(case, ref, oth, None, None, True)
    problems = " | ".join(row.problems)
    assert NEVER_FIRED_NO_FILE in problems
    assert "asked async, ran Scheduler" in problems
    assert "no copy-on-write copy" in problems
    oth.fault = FaultRecord(fired={"cow_admission": 0}, triggers=[])
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert "never fired" in " | ".join(row.problems)
    # Without the override, asked-async-ran-sync is reported, not failed.
    row, _ = compare_results(case, ref, oth, None, None, False)
    assert any("asked async" in e for e in row.explanations)


def test_replay_oracle_explains_only_native_history_dependent_requests(tmp_path: Path) -> None:
    empty = _kv_files(tmp_path, "empty", {})
    ref, oth = _result([[1, 2, 3, 4], [5, 6, 7, 8]]), _result([[9, 2, 3, 4], [5, 6, 7, 8]])
    # The reference itself gave other tokens when the short prompt p1-00 was replayed.
    ref.replay = {"p1-00": [[7, 7, 7, 7], [1, 2, 3, 4]], "p1-01": [[5, 6, 7, 8], [5, 6, 7, 8]]}
    row, reqs = compare_results(NOPC, ref, oth, empty, empty, True)
    assert row.passed and row.verdict == "exact where native is self-consistent", row.problems
    assert row.native_unstable_requests == 1 and reqs[0].native_history_dependent
    assert "history-dependent" in " ".join(row.explanations)
    # A stable replay explains nothing: the same mismatch fails.
    ref.replay = {"p1-00": [[1, 2, 3, 4], [1, 2, 3, 4]]}
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert not row.passed and row.verdict == "MISMATCH"


def test_every_rank_must_copy_what_the_scheduler_asked(tmp_path: Path) -> None:
    from conformance.results import CopyFacts, KvcachedFacts

    empty = _kv_files(tmp_path, "empty", {})
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 4]], engine="kvcached")
    for res in (ref, oth):
        assert res.probe is not None
        res.probe.copies_total = 3
    copies = lambda *n: [CopyFacts(batches=1, block_copies=k, runs_copied=k) for k in n]
    oth.kvcached = KvcachedFacts(pools_start={}, pools_end={}, copies=copies(3, 3))  # two ranks, same pairs
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert row.passed, row.problems
    oth.kvcached = KvcachedFacts(pools_start={}, pools_end={}, copies=copies(3, 2))  # rank 1 missed one
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert not row.passed and "[3, 2] block pair(s) per rank" in " ".join(row.problems)


def test_prefix_hits_must_match_native_unless_the_case_caps_cached_blocks(tmp_path: Path) -> None:
    """Native-equivalent caching: per-request prefix hits equal native's (a difference fails,
    the negative control). With the cap: fewer hits are reported, equal hits mean the cap
    never acted (fails: the case tested nothing)."""
    empty = _kv_files(tmp_path, "empty", {})
    ref, oth = _result([[1, 2, 3, 4], [5, 6, 7, 8]]), _result([[1, 2, 3, 4], [5, 6, 7, 8]], engine="kvcached")
    assert ref.requests is not None and oth.requests is not None
    ref.requests[1].num_cached_tokens = oth.requests[1].num_cached_tokens = 16
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert row.passed, row.problems
    oth.requests[1].num_cached_tokens = 0  # kvcached lost a hit native had
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert not row.passed and "prefix hits differ from native on 1 request(s) (first p1-01: 16 vs 0" in \
        " ".join(row.problems)
    capped = C.Case(C.ARCHETYPES["llama"], prefix_caching=False, fault=C.CACHED_CAP, max_tokens=MT)
    row, _ = compare_results(capped, ref, oth, empty, empty, True)
    assert row.passed, row.problems
    assert "prefix hits differ by design (cap of 2 cached blocks): 16 native vs 0" in " ".join(row.explanations)
    oth.requests[1].num_cached_tokens = 16
    row, _ = compare_results(capped, ref, oth, empty, empty, True)
    assert not row.passed and "evicted no prefix hit" in " ".join(row.problems)


def _pool(**changes: Any) -> Any:
    from conformance.results import PoolFacts

    page = 64 << 10
    facts = {"mapped_bytes": 5 * page, "peak_mapped_bytes": 9 * page, "reserved_idle_bytes": 4 * page, "live_blocks": 1,
                 "capacity_blocks": 100, "kv_page_bytes": page, "vmm_page_bytes": page, "rank_round_trips": 0, "maps": 9, "unmaps": 4,
                 "map_failures": 1, "admission_misses": 1, "page_takes": 5, "reserve_hits": 5, "blocking_maps": 0, "unmap_failures": 0,
                 "quarantined_pages": 0, "health": "healthy"}
    facts.update(changes)
    return PoolFacts(**facts)


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"mapped_bytes": 6 * (64 << 10)}, "1 kv page(s) mapped beyond"),
    ({"live_blocks": 2}, "2 live block(s)"),
    ({"quarantined_pages": 1, "health": "degraded"}, "1 quarantined page(s), degraded"),
])
def test_an_idle_pool_holds_the_null_page_and_the_reserve_only(tmp_path: Path, changes: dict[str, Any],
                                                                problem: str | None) -> None:
    """After the requests and a prefix-cache reset, anything beyond the null block's page and
    the reserve is a leak (the fault sweep's "nothing leaked"); the first row is the control."""
    from conformance.results import CopyFacts, KvcachedFacts

    empty = _kv_files(tmp_path, "empty", {})
    ref, oth = _result([[1, 2, 3, 4]]), _result([[1, 2, 3, 4]], engine="kvcached")
    copies = [CopyFacts(batches=0, block_copies=0, runs_copied=0)]
    oth.kvcached = KvcachedFacts(pools_start={}, pools_end={}, copies=copies, pools_idle={"vllm": _pool(**changes)})
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    if problem is None:
        assert row.passed, row.problems
    else:
        assert not row.passed and problem in " ".join(row.problems), row.problems
    oth.kvcached = KvcachedFacts(pools_start={}, pools_end={}, copies=copies, idle_reset_refused=True)
    row, _ = compare_results(NOPC, ref, oth, empty, empty, True)
    assert not row.passed and "reset_prefix_cache refused" in " ".join(row.problems)


def _copy_fault_pair(layout: C.Layout = C.Layout.INPROC) -> tuple[C.Case, CaseResult, CaseResult]:
    """A copy-site sweep point: the reference ran two passes; the candidate's client got the
    engine error in pass 2, its fault fired once, and its engine left nothing behind."""
    from conformance.results import EngineErrorRecord, TeardownFacts

    case = C.Case(C.ARCHETYPES["nemotron_h"], C.Scheduling.SYNC, pattern=C.PrefixPattern.PARTIAL_COW,
                  fault=C.sweep_plan("copy", 1), max_tokens=MT, layout=layout)
    ref = _result([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert ref.requests is not None
    ref.requests[1].pass_no = 2
    oth = _result([[1, 2, 3, 4]], engine="kvcached")
    oth.engine_error = EngineErrorRecord(pass_no=2, error_type="InjectedFault", message="injected failure at site 'copy'")
    oth.fault = FaultRecord(fired={"copy": 1}, triggers=[])
    oth.teardown = TeardownFacts(record_live_slots=0, record_charged_bytes=0, registered_spaces=0,
                                 memfds_before=2, memfds_after=2, live_children=[], settle_s=0.0)
    return case, ref, oth


@pytest.mark.parametrize(("change", "problem"), [
    ({}, None),
    ({"engine_error": None}, "every pass completed"),
    ({"fault": FaultRecord(fired={"copy": 0}, triggers=[])}, "never fired"),
    ({"fault": FaultRecord(fired={"copy": 2}, triggers=[])}, "planned at most 1x"),
    ({"fault": None}, NEVER_FIRED_NO_FILE),
    ({"teardown": None}, "no teardown facts"),
    ({"teardown.record_live_slots": 1, "teardown.record_charged_bytes": 4096}, "1 live budget slot(s) holding 4096"),
    ({"teardown.record_live_slots": None}, "never written"),
    ({"teardown.registered_spaces": 1}, "still registered"),
    ({"teardown.memfds_after": 3}, "memfds leaked"),
    ({"teardown.live_children": ["EngineCore_DP0 (pid 7)"]}, "survived shutdown"),
    ({"tokens": [9, 9, 9, 9]}, "tokens before the engine error differ"),
    ({"error": "RuntimeError: boom"}, "other error"),
])
def test_a_copy_fault_must_end_in_a_clean_engine_error(change: dict[str, Any], problem: str | None) -> None:
    """The first row is the control: the planned engine error with native's tokens before it
    and nothing left behind passes; every other row is one way it can go wrong."""
    case, ref, oth = _copy_fault_pair()
    for key, value in change.items():
        if key == "tokens":
            assert oth.requests is not None
            oth.requests[0].token_ids = value
        elif key.startswith("teardown."):
            assert oth.teardown is not None
            setattr(oth.teardown, key.split(".", 1)[1], value)
        else:
            setattr(oth, key, value)
    row, _ = compare_results(case, ref, oth, None, None, True)
    if problem is None:
        assert row.passed and row.verdict == "engine error as planned", row.problems
        assert row.engine_error == "pass 2: InjectedFault" and row.exact_matches == row.requests == 1
    else:
        assert not row.passed and problem in " | ".join(row.problems), row.problems


def test_a_copy_fault_at_tp2_may_fire_once_per_rank() -> None:
    case, ref, oth = _copy_fault_pair(C.Layout.TP2)
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert "asked layout tp2, ran UniProcExecutor x1" in " | ".join(row.problems)
    for res in (ref, oth):
        res.scheduler = res.scheduler.model_copy(update={"executor": "MultiprocExecutor", "world_size": 2})  # type: ignore[union-attr]
    oth.fault = FaultRecord(fired={"copy": 2}, triggers=[])
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert row.passed, row.problems
    oth.fault = FaultRecord(fired={"copy": 3}, triggers=[])
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert "planned at most 2x" in " | ".join(row.problems)


def test_a_copy_fault_in_the_first_pass_has_no_tokens_to_compare() -> None:
    case, ref, oth = _copy_fault_pair()
    assert oth.engine_error is not None and oth.requests is not None
    oth.engine_error.pass_no, oth.requests = 1, []
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert row.passed and "no request had finished" in " ".join(row.explanations), row.problems
    oth.requests = _result([[1, 2, 3, 4]]).requests  # a request recorded in the failing pass is not native's
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert not row.passed and "request lists differ" in " | ".join(row.problems)


def test_the_summary_names_a_planned_engine_error() -> None:
    from conformance.orchestrate.report.build import _who_and_match

    case, ref, oth = _copy_fault_pair()
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert _who_and_match(row, "KVCached") == ("KVCached", "Engine error as planned (pass 2: InjectedFault)")
    oth.teardown.live_children = ["EngineCore_DP0 (pid 7)"]  # type: ignore[union-attr]
    row, _ = compare_results(case, ref, oth, None, None, True)
    assert _who_and_match(row, "KVCached") == ("KVCached", "error")


def test_a_row_is_exactly_its_three_parts() -> None:
    """Every ParityRow field lives in one part (RowIdentity, RowCounts, RowVerdict), so a new
    field is added where the stage that knows it builds its part, and nowhere else."""
    from dataclasses import fields

    from conformance.orchestrate.parity import ParityRow, RowCounts, RowIdentity, RowVerdict

    parts = [f.name for part in (RowIdentity, RowCounts, RowVerdict) for f in fields(part)]
    assert len(parts) == len(set(parts)) and set(parts) == {f.name for f in fields(ParityRow)}
