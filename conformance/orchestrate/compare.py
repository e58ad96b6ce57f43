"""Comparator: one reference result and one other result (candidate or control) -> ParityRow.

Rules (``ParityRow.passed``):

* Every request of both engines completes (finished, ``max_tokens`` tokens, reason
  "length") and no engine reported an error.
* Token IDs are identical for every request. This holds whatever the schedule was.
* If both engines ran the same schedule (identical per-step request/token fingerprints),
  KV bytes of every block both hold under the same prefix hash and every top-k logprob are
  exactly equal. If the schedule differed (a fault plan refused an allocation, a budget
  forced preemption), differences are allowed but reported with their size and the step
  where the schedules parted: CPU kernels block their loops by batch shape, so the same
  token can get last-bit-different values in a different batch.
* Fault plans must fire exactly as planned; a budget plan must cause preemptions; a partial
  prefix pattern must make copy-on-write copies; an async case must really have run the
  async scheduler (when the harness override is on).
* Negative controls invert the verdict: they pass only when a mismatch is detected.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conformance.cases import Case, Control, Scheduling
from conformance.orchestrate.parity import KvComparison, LogprobComparison, ParityRow, RequestParity


def _complete(req: dict[str, Any], max_tokens: int) -> bool:
    return bool(req["finished"]) and req["finish_reason"] == "length" and len(req["token_ids"]) == max_tokens


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_logprobs(a: list[list[list[float]]], b: list[list[list[float]]], upto: int) -> LogprobComparison:
    """Compare top-k logprobs position by position up to ``upto`` (the first token divergence)."""
    out = LogprobComparison()
    for pa, pb in zip(a[:upto], b[:upto], strict=False):
        out.positions += 1
        ids_a = [(int(t), int(r)) for t, _, r in pa]
        ids_b = [(int(t), int(r)) for t, _, r in pb]
        if ids_a != ids_b:
            out.equal = False
            out.topk_set_differs += 1
        vb = {int(t): lp for t, lp, _ in pb}
        for t, lp, _ in pa:
            if int(t) in vb:
                d = abs(lp - vb[int(t)])
                if d != 0.0 or math.copysign(1.0, lp) != math.copysign(1.0, vb[int(t)]):
                    out.equal = False
                out.max_abs_diff = max(out.max_abs_diff, d)
    if len(a) != len(b) and upto > min(len(a), len(b)):
        out.equal = False
    return out


def _arr(npz: Any, name: str) -> np.ndarray:
    return np.asarray(npz[name])


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return math.inf
    d = float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
    return math.inf if math.isnan(d) else d


def _content_sets(
    ref_arrays: list[tuple[int, np.ndarray]], oth_arrays: list[tuple[int, np.ndarray]], tdim: int | None
) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Group the blocks of one (key, layer, state) into comparable (reference, other) lists.

    Attention: every block is cut to the token slots all of them cover. Recurrent states
    (and unknown layouts) are only comparable between blocks captured at the same prefix
    length, so they are grouped by that length.
    """
    if tdim is not None:
        v = min(a.shape[tdim] for _, a in ref_arrays + oth_arrays)
        return [
            (
                [np.take(a, range(v), axis=tdim) for _, a in ref_arrays],
                [np.take(a, range(v), axis=tdim) for _, a in oth_arrays],
            )
        ]
    lens = sorted({n for n, _ in ref_arrays} & {n for n, _ in oth_arrays})
    return [([a for n, a in ref_arrays if n == L], [a for n, a in oth_arrays if n == L]) for L in lens]


def compare_kv(ref_meta: dict[str, Any], ref_npz: Any, oth_meta: dict[str, Any], oth_npz: Any) -> KvComparison:
    """Compare the KV content of every (hash key, layer) both engines cache.

    Block IDs are engine-private (kvcached may place blocks differently), so blocks are not
    paired by ID: an entry is identical when the set of distinct contents held under the
    key is the same in both engines. ``variants`` counts keys under which one engine itself
    holds blocks with different contents (reported, since it is vLLM's own behaviour).
    """
    out = KvComparison()
    rk, ok = ref_meta["keys"], oth_meta["keys"]
    out.only_reference = len(set(rk) - set(ok))
    out.only_other = len(set(ok) - set(rk))
    tdims = {**ref_meta.get("token_dims", {}), **oth_meta.get("token_dims", {})}
    for key in sorted(set(rk) & set(ok)):
        ra, oa = rk[key], ok[key]
        key_has_variants = False
        for layer in ra["layers"]:
            entry_ok = True
            entry_compared = False
            for si in _state_indices(ref_npz, ra["blocks"], layer):
                ref_arrays = [(n, _arr(ref_npz, f"b{b}|{layer}|{si}")) for b, n in ra["blocks"]]
                oth_arrays = [(n, _arr(oth_npz, f"b{b}|{layer}|{si}")) for b, n in oa["blocks"]]
                groups = _content_sets(ref_arrays, oth_arrays, tdims.get(f"{layer}|{si}"))
                if not groups:
                    out.not_comparable += 1
                    continue
                for ref_list, oth_list in groups:
                    entry_compared = True
                    rset = {a.tobytes(): a for a in ref_list}
                    oset = {a.tobytes(): a for a in oth_list}
                    key_has_variants |= len(rset) > 1 or len(oset) > 1
                    if rset.keys() != oset.keys():
                        entry_ok = False
                        # Distance of each content to the nearest content of the other engine.
                        for a in list(rset.values()) + list(oset.values()):
                            others = oset.values() if a.tobytes() in rset else rset.values()
                            out.max_abs_diff = max(out.max_abs_diff, min(_max_abs(a, b) for b in others))
                        if not out.first_mismatch:
                            out.first_mismatch = f"{key[:16]}…/{layer}/{si}"
            if entry_compared:
                out.compared += 1
                out.identical += int(entry_ok)
        out.variants += int(key_has_variants)
    return out


def _state_indices(npz: Any, blocks: list[list[int]], layer: str) -> list[int]:
    b = blocks[0][0]
    out = []
    si = 0
    while f"b{b}|{layer}|{si}" in npz.files:
        out.append(si)
        si += 1
    if not out:
        raise KeyError(f"KV snapshot lacks arrays for block {b} layer {layer}")
    return out


def _sched_name(s: dict[str, Any] | None) -> str:
    if not s:
        return "?"
    name = s["scheduler_type"]
    if s.get("batch_queue"):
        name += "+batch_queue"
    return name


def _schedule_divergence(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def comparison_label(case: Case, other_engine: str) -> str:
    if case.control is Control.NONE:
        return f"{other_engine} vs native"
    if case.control is Control.BASELINE:
        return "native vs native (noise baseline)"
    return f"negative control: {case.control.value}"


def compare_results(
    case: Case,
    ref: dict[str, Any],
    other: dict[str, Any],
    ref_npz_path: Path | None,
    other_npz_path: Path | None,
    async_override: bool,
) -> tuple[ParityRow, list[RequestParity]]:
    problems: list[str] = []
    explanations: list[str] = []
    for side, res in (("reference", ref), ("other", other)):
        if res.get("error"):
            problems.append(f"{side} error: {res['error']}")
    seam = str(other.get("fault_seam") or "")
    row = ParityRow(
        case_id=case.case_id,
        comparison=comparison_label(case, str(other.get("engine", "?"))),
        archetype=case.archetype.name,
        scheduling=case.scheduling.value,
        pattern=case.pattern.value,
        lengths=case.lengths.value,
        prefix_caching=case.prefix_caching,
        fault_plan=case.fault.name,
        control=case.control.value,
        fault_seam=seam,
        scheduler_reference=_sched_name(ref.get("scheduler")),
        scheduler_other=_sched_name(other.get("scheduler")),
        async_scheduling_reference=(ref.get("scheduler") or {}).get("async_scheduling"),
        async_scheduling_other=(other.get("scheduler") or {}).get("async_scheduling"),
        requests=0,
        complete_reference=0,
        complete_other=0,
        output_tokens_reference=0,
        output_tokens_other=0,
        expected_output_tokens=0,
        exact_matches=0,
        first_divergence="",
        kv_blocks_compared=0,
        kv_blocks_identical=0,
        kv_only_reference=0,
        kv_only_other=0,
        kv_max_abs_diff=0.0,
        kv_key_variants=0,
        native_unstable_requests=0,
        logprobs_equal=False,
        logprob_max_abs_diff=0.0,
        prefix_hit_tokens_reference=0,
        prefix_hit_tokens_other=0,
        partial_prefix_hits_other=0,
        cow_copies_reference=0,
        cow_copies_other=0,
        injected_failures_fired="",
        injected_failures_expected=case.fault.expected_fired,
        preemptions_reference=0,
        preemptions_other=0,
        peak_mapped_bytes_reference=int(ref.get("mapped_bytes_peak") or 0),
        peak_mapped_bytes_other=int(other.get("mapped_bytes_peak") or 0),
        final_mapped_bytes_reference=int(ref.get("mapped_bytes_final") or 0),
        final_mapped_bytes_other=int(other.get("mapped_bytes_final") or 0),
        same_schedule=False,
        schedule_divergence_step=None,
        verdict="error",
        passed=False,
        wall_s_reference=float(ref.get("t_total") or 0.0),
        wall_s_other=float(other.get("t_total") or 0.0),
    )
    per_req: list[RequestParity] = []
    if problems or "requests" not in ref or "requests" not in other:
        if not problems:
            problems.append("missing request results")
        row.problems = problems
        return row, per_req

    # -- requests, tokens, logprobs -------------------------------------------------------
    mt = case.max_tokens
    ref_reqs, oth_reqs = ref["requests"], other["requests"]
    if [r["rid"] for r in ref_reqs] != [r["rid"] for r in oth_reqs]:
        problems.append("request lists differ between engines")
    lp_equal = True
    lp_max = 0.0
    divergences: list[tuple[str, int]] = []
    for a, b in zip(ref_reqs, oth_reqs, strict=False):
        fd = _first_divergence(a["token_ids"], b["token_ids"])
        # The distribution at the first divergent position is still conditioned on identical
        # context, so it is compared too; later positions are not comparable.
        upto = fd + 1 if fd is not None else len(a["token_ids"])
        lpc = compare_logprobs(a["logprobs"], b["logprobs"], upto)
        lp_equal &= lpc.equal
        lp_max = max(lp_max, lpc.max_abs_diff)
        if fd is not None:
            divergences.append((a["rid"], fd))
        per_req.append(
            RequestParity(
                rid=a["rid"],
                label=a["label"],
                pass_no=int(a["pass"]),
                prompt_len=int(a["prompt_len"]),
                ref_tokens=len(a["token_ids"]),
                other_tokens=len(b["token_ids"]),
                exact=fd is None,
                first_divergence=fd,
                ref_cached=int(a["num_cached_tokens"]),
                other_cached=int(b["num_cached_tokens"]),
                ref_complete=_complete(a, mt),
                other_complete=_complete(b, mt),
                logprobs_equal=lpc.equal,
                logprob_max_abs_diff=lpc.max_abs_diff,
                topk_set_differs=lpc.topk_set_differs,
            )
        )
    row.requests = len(ref_reqs)
    row.complete_reference = sum(p.ref_complete for p in per_req)
    row.complete_other = sum(p.other_complete for p in per_req)
    row.output_tokens_reference = sum(len(r["token_ids"]) for r in ref_reqs)
    row.output_tokens_other = sum(len(r["token_ids"]) for r in oth_reqs)
    row.expected_output_tokens = mt * len(ref_reqs)
    row.exact_matches = sum(p.exact for p in per_req)
    # Requests whose native output is history-dependent (reference replay oracle, see
    # engine_worker._replay_uncacheable) cannot be held to token parity.
    own = {r["rid"]: r["token_ids"] for r in ref_reqs}
    unstable = {rid for rid, reps in (ref.get("replay") or {}).items() if any(x != own.get(rid) for x in reps)}
    for p in per_req:
        p.native_history_dependent = p.rid in unstable
    explained_div = [(rid, pos) for rid, pos in divergences if rid in unstable]
    if explained_div:
        explanations.append(
            f"{len(explained_div)} request(s) ({', '.join(r for r, _ in explained_div)}) differ where native vLLM "
            "itself is history-dependent: replaying these short prompts in the reference engine gave other tokens "
            f"(e.g. {own[explained_div[0][0]][:4]} then {ref['replay'][explained_div[0][0]][0][:4]})"
        )
    row.native_unstable_requests = len(unstable)
    if divergences:
        rid, pos = min(divergences, key=lambda x: x[1])
        row.first_divergence = f"{rid}@{pos} ({len(divergences)} req)"
    row.logprobs_equal = lp_equal
    row.logprob_max_abs_diff = lp_max
    row.prefix_hit_tokens_reference = sum(int(r["num_cached_tokens"]) for r in ref_reqs)
    row.prefix_hit_tokens_other = sum(int(r["num_cached_tokens"]) for r in oth_reqs)

    # -- engine counters ------------------------------------------------------------------
    rp, op = ref["probe"], other["probe"]
    row.cow_copies_reference = int(rp["copies_total"])
    row.cow_copies_other = int(op["copies_total"])
    row.partial_prefix_hits_other = int(op["partial_prefix_hits"])
    row.preemptions_reference = int(ref["metrics"]["preemptions"])
    row.preemptions_other = int(other["metrics"]["preemptions"])
    div = _schedule_divergence(rp["schedule_fingerprint"], op["schedule_fingerprint"])
    row.same_schedule = div is None
    row.schedule_divergence_step = div

    # -- KV content -----------------------------------------------------------------------
    kvc = KvComparison()
    if ref.get("kv_status") == "ok" and other.get("kv_status") == "ok" and ref_npz_path and other_npz_path:
        with np.load(ref_npz_path) as rn, np.load(other_npz_path) as on:
            kvc = compare_kv(ref["kv"], rn, other["kv"], on)
    else:
        problems.append(f"KV snapshot missing (reference {ref.get('kv_status')}, other {other.get('kv_status')})")
    row.kv_blocks_compared = kvc.compared
    row.kv_blocks_identical = kvc.identical
    row.kv_only_reference = kvc.only_reference
    row.kv_only_other = kvc.only_other
    row.kv_max_abs_diff = kvc.max_abs_diff
    row.kv_key_variants = kvc.variants
    if kvc.variants:
        explanations.append(
            f"{kvc.variants} prefix-hash key(s) map to blocks whose KV differs inside one engine (vLLM's own "
            "partial-prefix bookkeeping); compared as sets of contents per key"
        )

    # -- faults ---------------------------------------------------------------------------
    fired = other.get("fault_fired")
    if case.fault.rules and case.control is Control.NONE:
        if fired is None:
            row.injected_failures_fired = "no fired file"
            problems.append("fault plan: the seam wrote no fired counts (plan never loaded?)")
        else:
            total = sum(fired.values())
            row.injected_failures_fired = str(total)
            if total == 0:
                problems.append("fault plan never fired")
            elif total != case.fault.expected_fired:
                problems.append(f"fault plan fired {total}x, planned {case.fault.expected_fired}x")
        if case.fault.needs_partial_hits:
            if row.partial_prefix_hits_other == 0:
                problems.append("no real partial-prefix hit, so the trigger could not arm")
            if "partial_prefix_hit" not in (other.get("fault_triggers") or []):
                problems.append("the seam never saw the partial_prefix_hit trigger")
    if case.fault.physical_budget and case.control is Control.NONE:
        stats_end = other.get("kvcached_stats_end")
        misses = sum(int(s.get("admission_misses", 0)) for s in stats_end.values()) if stats_end else None
        refusals = sum(int(s.get("map_failures", 0)) for s in stats_end.values()) if stats_end else None
        row.injected_failures_fired = (
            f"budget: {misses} admission misses, {refusals} map refusals, {row.preemptions_other} preemptions"
            if stats_end
            else f"budget: {row.preemptions_other} preemptions"
        )
        if row.preemptions_other <= 0:
            problems.append("physical budget caused no preemption (engine metrics)")
        budget = int(((other.get("plan") or {}).get("budget") or {}).get("kvcached_budget_bytes", 0))
        if stats_end is not None and budget and row.peak_mapped_bytes_other > budget:
            problems.append(f"kvcached mapped {row.peak_mapped_bytes_other} bytes, over its {budget}-byte budget")

    # -- kvcached's own counters ----------------------------------------------------------
    kc = other.get("kvcached_copy_stats")
    if kc is not None and int(kc.get("block_copies", -1)) != row.cow_copies_other:
        problems.append(
            f"kvcached copied {kc.get('block_copies')} block pair(s) but the scheduler asked for {row.cow_copies_other}"
        )

    # -- scheduler that ran ---------------------------------------------------------------
    if case.scheduling is Scheduling.ASYNC:
        for side, res in (("reference", ref), ("other", other)):
            s = res.get("scheduler") or {}
            ran_async = s.get("scheduler_type") == "AsyncScheduler" and s.get("batch_queue")
            if not ran_async:
                msg = f"{side}: asked async, ran {_sched_name(s)}"
                (problems if async_override else explanations).append(msg)

    # -- pattern coverage -----------------------------------------------------------------
    if case.pattern.value == "partial" and row.cow_copies_reference == 0:
        problems.append("partial-prefix pattern made no copy-on-write copy")
    if case.prefix_caching and kvc.compared == 0 and not problems:
        problems.append("no KV block compared")

    # -- verdict --------------------------------------------------------------------------
    # Only requests on which native vLLM is self-consistent count (see the replay oracle).
    stable = [p for p in per_req if p.rid not in unstable]
    tokens_exact = row.requests > 0 and all(p.exact for p in stable)
    lp_stable = all(p.logprobs_equal for p in stable)
    lp_topk = sum(p.topk_set_differs for p in stable)
    kv_exact = kvc.compared == kvc.identical
    all_complete = row.complete_reference == row.requests and row.complete_other == row.requests
    mismatch_found = not tokens_exact or not kv_exact or not lp_stable
    row.logprobs_equal = lp_stable  # native-unstable requests are reported separately
    if case.control.expects_mismatch:
        infra = [p for p in problems if "error" in p or "missing" in p]
        if infra:
            row.verdict = "error"
        elif mismatch_found:
            row.verdict = "mismatch detected (expected)"
            row.passed = True
            what = []
            if not tokens_exact:
                what.append(f"{row.requests - row.exact_matches} requests' tokens differ")
            if not kv_exact:
                what.append(f"{kvc.compared - kvc.identical} KV blocks differ (max |Δ| {kvc.max_abs_diff:.3g})")
            if not lp_stable:
                what.append(f"logprobs differ (max |Δ| {lp_max:.3g}, top-k sets differ at {lp_topk} positions)")
            explanations.append("negative control caught: " + ", ".join(what))
            problems = []
        else:
            row.verdict = "NOT DETECTED"
            problems.append("negative control was not reported as a mismatch")
        row.problems, row.explanations = problems, explanations
        return row, per_req

    if not all_complete:
        problems.append(
            f"incomplete requests: reference {row.complete_reference}, other {row.complete_other} of {row.requests}"
        )
    if not tokens_exact:
        bad = [p for p in stable if not p.exact]
        first = min(bad, key=lambda p: p.first_divergence or 0)
        problems.append(f"token mismatch in {len(bad)} request(s), first {first.rid}@{first.first_divergence}")
    if row.same_schedule:
        if not kv_exact:
            problems.append(f"same schedule but KV differs ({kvc.first_mismatch}, max |Δ| {kvc.max_abs_diff:.3g})")
        if not lp_stable:
            problems.append(
                f"same schedule but logprobs differ (max |Δ| {lp_max:.3g} over shared top-k tokens; "
                f"top-k sets differ at {lp_topk} positions)"
            )
    else:
        if not kv_exact or not lp_stable:
            explanations.append(
                f"schedule diverged at step {div} ({case.fault.name if not case.fault.is_none else 'batching'}); "
                f"largest |ΔKV| {kvc.max_abs_diff:.3g}, |Δlogprob| {lp_max:.3g}: the same tokens computed in "
                "differently shaped batches can differ in the last bits on CPU"
            )
        else:
            explanations.append(f"schedule diverged at step {div}, yet KV and logprobs are bit-identical")
    row.problems, row.explanations = problems, explanations
    row.passed = not problems
    if row.passed and unstable and row.exact_matches < row.requests:
        row.verdict = "exact where native is self-consistent"
    elif row.passed:
        row.verdict = "exact" if (kv_exact and lp_stable) else "tokens exact, numeric diff explained"
    else:
        row.verdict = "error" if any("error" in p for p in problems) else "MISMATCH"
    return row, per_req
