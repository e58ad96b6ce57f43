"""Comparator: one reference result and one other result (candidate or control) -> ParityRow.

The comparison is a pipeline of small named stages, each testable alone:

1. `token_parity`: every request's token IDs (with the reference's replay oracle for
   requests on which native vLLM itself is history-dependent);
2. `logprob_parity`: top-k logprobs up to and including each request's first divergence;
3. `kv_parity`: the KV bytes of every block both engines hold under the same prefix hash;
4. `schedule_parity`: whether both engines ran the same per-step schedule;
5. `fact_checks`: fault plans fired as planned, the budget forced preemption, kvcached
   copied what the scheduler asked, the scheduler that ran is the one asked for, the
   pattern covered what it exists for;
6. `control_verdict` / `candidate_verdict`: negative controls pass only when a mismatch is
   detected; everything else passes only when tokens are exact and, with the same schedule,
   KV and logprobs are bit-identical (a changed schedule explains numeric differences, since
   CPU kernels block their loops by batch shape).

Rules (``ParityRow.passed``): every request of both engines completes and no engine
reported an error; token IDs are identical for every request whatever the schedule was.

A plan that fails the worker's block copy (`conformance.cases.FaultPlan.ends_in_engine_error`)
is judged by `engine_error_verdict` instead: the client must get the error, the passes before
it must match native's tokens, and the engine must leave nothing behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from conformance.cases import Case, Control, Scheduling, measures_native_floor
from conformance.orchestrate.parity import (
    KvComparison,
    LogprobComparison,
    ParityRow,
    Problem,
    ProblemKind,
    RequestParity,
    RowCounts,
    RowIdentity,
    RowVerdict,
    assemble,
)
from conformance.results import CaseResult, EngineErrorRecord, KvSnapshotMeta, RequestRecord, SchedulerRan
from kvcached.errors import InvariantError
from kvcached.pages import PoolHealth


@dataclass
class Findings:
    """What a stage found: problems fail the comparison, explanations are reported."""

    problems: list[Problem] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)

    def add(self, kind: ProblemKind, text: str) -> None:
        self.problems.append(Problem(kind, text))

    def extend(self, other: Findings) -> None:
        self.problems += other.problems
        self.explanations += other.explanations


@dataclass(frozen=True)
class Pair:
    """The inputs of one comparison."""

    case: Case
    ref: CaseResult
    other: CaseResult
    ref_kv: Path | None
    other_kv: Path | None
    async_override: bool


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- stage 1: tokens ---------------------------------------------------------------------
@dataclass
class TokenParity:
    requests: list[RequestParity]
    unstable: set[str]  # rids on which native vLLM is history-dependent (replay oracle)
    findings: Findings

    @property
    def stable(self) -> list[RequestParity]:
        return [p for p in self.requests if p.rid not in self.unstable]

    @property
    def exact(self) -> bool:
        return bool(self.requests) and all(p.exact for p in self.stable)

    @property
    def divergences(self) -> list[RequestParity]:
        return [p for p in self.requests if not p.exact]


def _request_parity(a: RequestRecord, b: RequestRecord, max_tokens: int) -> RequestParity:
    fd = _first_divergence(a.token_ids, b.token_ids)
    return RequestParity(
        rid=a.rid, label=a.label, pass_no=a.pass_no, prompt_len=a.prompt_len,
        ref_tokens=len(a.token_ids), other_tokens=len(b.token_ids), exact=fd is None, first_divergence=fd,
        ref_cached=a.num_cached_tokens, other_cached=b.num_cached_tokens,
        ref_complete=a.complete(max_tokens), other_complete=b.complete(max_tokens),
        logprobs_equal=True, logprob_max_abs_diff=0.0,
    )  # fmt: skip


def _unstable(ref: CaseResult) -> set[str]:
    own = {r.rid: r.token_ids for r in ref.requests or []}
    return {rid for rid, reps in ref.replay.items() if any(x != own.get(rid) for x in reps)}


def token_parity(case: Case, ref: CaseResult, other: CaseResult) -> TokenParity:
    """Per-request token parity; divergences on native-unstable requests are explained."""
    ref_reqs, oth_reqs = ref.requests or [], other.requests or []
    out = TokenParity([], _unstable(ref), Findings())
    if [r.rid for r in ref_reqs] != [r.rid for r in oth_reqs]:
        out.findings.add(ProblemKind.CHECK, "request lists differ between engines")
    out.requests = [_request_parity(a, b, case.max_tokens) for a, b in zip(ref_reqs, oth_reqs, strict=False)]
    for p in out.requests:
        p.native_history_dependent = p.rid in out.unstable
    explained = [p.rid for p in out.divergences if p.rid in out.unstable]
    if explained:
        own = {r.rid: r.token_ids for r in ref_reqs}
        out.findings.explanations.append(
            f"{len(explained)} request(s) ({', '.join(explained)}) differ where native vLLM itself is "
            "history-dependent: replaying these short prompts in the reference engine gave other tokens "
            f"(e.g. {own[explained[0]][:4]} then {ref.replay[explained[0]][0][:4]})"
        )
    return out


# ---- stage 2: logprobs -------------------------------------------------------------------
def compare_logprobs(a: list[Any], b: list[Any], upto: int) -> LogprobComparison:
    """Compare top-k logprobs position by position up to ``upto`` (the first token divergence)."""
    out = LogprobComparison()
    for pa, pb in zip(a[:upto], b[:upto], strict=False):
        out.positions += 1
        if [(int(t), int(r)) for t, _, r in pa] != [(int(t), int(r)) for t, _, r in pb]:
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


@dataclass(frozen=True)
class LogprobParity:
    equal: bool  # over native-stable requests
    max_abs_diff: float  # over every request
    topk_set_differs: int  # over native-stable requests


def logprob_parity(ref: CaseResult, other: CaseResult, tokens: TokenParity) -> LogprobParity:
    """Fill each request's logprob fields; the distribution at the first divergent position
    is still conditioned on identical context, so it is compared too."""
    for p, a, b in zip(tokens.requests, ref.requests or [], other.requests or [], strict=False):
        upto = p.first_divergence + 1 if p.first_divergence is not None else len(a.token_ids)
        lpc = compare_logprobs(a.logprobs, b.logprobs, upto)
        p.logprobs_equal, p.logprob_max_abs_diff, p.topk_set_differs = lpc.equal, lpc.max_abs_diff, lpc.topk_set_differs
    stable = tokens.stable
    return LogprobParity(
        equal=all(p.logprobs_equal for p in stable),
        max_abs_diff=max((p.logprob_max_abs_diff for p in tokens.requests), default=0.0),
        topk_set_differs=sum(p.topk_set_differs for p in stable),
    )


# ---- stage 2b: near-tie flips ---------------------------------------------------------------
@dataclass(frozen=True)
class TieFlip:
    """A request whose greedy token flipped where native's own choice was a near-tie."""

    rid: str
    position: int  # the first differing output token; its context is identical on both sides
    reference_token: int
    other_token: int
    margin: float  # the reference's logprob of its token over the other's token there
    noise: float  # the largest logprob shift the case measured on identical context

    def __str__(self) -> str:
        return (f"{self.rid}@{self.position} ({self.reference_token} vs {self.other_token}, native's margin "
                f"{self.margin:.3g} <= shift {self.noise:.3g})")


def _bf16_spacing(x: float) -> float:
    """The distance between neighbouring bfloat16 numbers (8 significant bits) at |x|."""
    return 2.0 ** (math.frexp(x)[1] - 8) if x else 0.0


def _tie_flip(p: RequestParity, a: RequestRecord, b: RequestRecord, noise: float) -> TieFlip | None:
    i = p.first_divergence
    if i is None or i >= min(len(a.token_ids), len(b.token_ids), len(a.logprobs), len(b.logprobs)):
        return None  # a length difference is no flip
    ta, tb = a.token_ids[i], b.token_ids[i]
    ref_lp = {int(t): lp for t, lp, _ in a.logprobs[i]}
    oth_lp = {int(t): lp for t, lp, _ in b.logprobs[i]}
    if not {ta, tb} <= ref_lp.keys() & oth_lp.keys():
        return None  # a shift of the other token is not measured: no evidence of a tie
    margin = ref_lp[ta] - ref_lp[tb]
    if margin > noise or noise > 2 * _bf16_spacing(ref_lp[ta]):
        return None
    return TieFlip(p.rid, i, ta, tb, margin, noise)


def tie_flips(tokens: TokenParity, logprobs: LogprobParity, ref: CaseResult, other: CaseResult) -> list[TieFlip]:
    """The token differences that batching explains, when the two schedules diverged.

    Kernels round by batch shape, so the same context scores a little differently in another
    batch; where native's greedy choice is a near-tie that can flip it, and the outputs go
    apart from there. A difference is such a flip only when, at its first differing position
    (the context still identical), both tokens are in both sides' top-k, native's margin of its
    token over the other's is within the largest logprob shift this case measured on identical
    context, and that shift is itself last-bits noise: at most two bfloat16 spacings at that
    logprob. A corrupted KV block or a wrong prefix moves logprobs by far more, and stays a
    mismatch (the negative controls and `tests/test_conformance_compare.py` show it).
    """
    recs = {r.rid: (r, o) for r, o in zip(ref.requests or [], other.requests or [], strict=False)}
    flips = (_tie_flip(p, *recs[p.rid], logprobs.max_abs_diff)
             for p in tokens.stable if not p.exact and p.rid in recs)
    return [f for f in flips if f is not None]


# ---- stage 3: KV bytes through the prefix-hash map ----------------------------------------
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
        cut = [np.take(a, range(v), axis=tdim) for _, a in ref_arrays], [
            np.take(a, range(v), axis=tdim) for _, a in oth_arrays
        ]
        return [cut]
    lens = sorted({n for n, _ in ref_arrays} & {n for n, _ in oth_arrays})
    return [([a for n, a in ref_arrays if n == L], [a for n, a in oth_arrays if n == L]) for L in lens]


def _state_indices(npz: Any, name: str) -> list[int]:
    """``name`` is ``<rank prefix>b<block>|<layer>``; the states stored for it."""
    out: list[int] = []
    while f"{name}|{len(out)}" in npz.files:
        out.append(len(out))
    if not out:
        raise KeyError(f"KV snapshot lacks arrays for {name}")
    return out


def _compare_sets(out: KvComparison, groups: list[tuple[list[np.ndarray], list[np.ndarray]]], where: str) -> tuple[bool, bool]:
    """Compare grouped contents; returns (identical, some engine holds several variants)."""
    ok, variants = True, False
    for ref_list, oth_list in groups:
        rset = {a.tobytes(): a for a in ref_list}
        oset = {a.tobytes(): a for a in oth_list}
        variants |= len(rset) > 1 or len(oset) > 1
        if rset.keys() != oset.keys():
            ok = False
            # Distance of each content to the nearest content of the other engine.
            for a in list(rset.values()) + list(oset.values()):
                others = oset.values() if a.tobytes() in rset else rset.values()
                out.max_abs_diff = max(out.max_abs_diff, min(_max_abs(a, b) for b in others))
            out.first_mismatch = out.first_mismatch or where
    return ok, variants


def compare_kv(ref_meta: KvSnapshotMeta, ref_npz: Any, oth_meta: KvSnapshotMeta, oth_npz: Any) -> KvComparison:
    """Compare the KV content of every (hash key, layer, rank) both engines cache.

    Block IDs are engine-private (kvcached may place blocks differently), so blocks are not
    paired by ID: an entry is identical when the set of distinct contents held under the
    key is the same in both engines. ``variants`` counts keys under which one engine itself
    holds blocks with different contents (reported, since it is vLLM's own behaviour).
    """
    out = KvComparison()
    rk, ok = ref_meta.keys, oth_meta.keys
    out.only_reference, out.only_other = len(set(rk) - set(ok)), len(set(ok) - set(rk))
    if ref_meta.ranks != oth_meta.ranks:
        out.first_mismatch = f"ranks differ: {ref_meta.ranks} != {oth_meta.ranks}"
        return out
    tdims = {**ref_meta.token_dims, **oth_meta.token_dims}
    for key in sorted(set(rk) & set(ok)):
        key_variants = False
        for layer in rk[key].layers:
            for rank in range(ref_meta.ranks):
                prefix = f"r{rank}:" if rank else ""
                entry = _compare_entry(out, (rk[key], ref_npz), (ok[key], oth_npz), prefix, layer, tdims, key)
                key_variants |= entry
        out.variants += int(key_variants)
    return out


def _compare_entry(out: KvComparison, ref: tuple[Any, Any], oth: tuple[Any, Any], prefix: str, layer: str,
                   tdims: dict[str, int | None], key: str) -> bool:
    """One (key, layer, rank) entry; counts it in ``out``; returns whether it has variants."""
    (ra, rn), (oa, on) = ref, oth
    entry_ok, compared, variants = True, False, False
    for si in _state_indices(rn, f"{prefix}b{ra.blocks[0][0]}|{layer}"):
        ref_arrays = [(n, np.asarray(rn[f"{prefix}b{b}|{layer}|{si}"])) for b, n in ra.blocks]
        oth_arrays = [(n, np.asarray(on[f"{prefix}b{b}|{layer}|{si}"])) for b, n in oa.blocks]
        groups = _content_sets(ref_arrays, oth_arrays, tdims.get(f"{layer}|{si}"))
        if not groups:
            out.not_comparable += 1
            continue
        compared = True
        ok, v = _compare_sets(out, groups, f"{key[:16]}…/{prefix}{layer}/{si}")
        entry_ok, variants = entry_ok and ok, variants or v
    if compared:
        out.compared += 1
        out.identical += int(entry_ok)
    return variants


def kv_parity(pair: Pair) -> tuple[KvComparison, Findings]:
    found = Findings()
    ref, oth = pair.ref, pair.other
    if not (ref.kv_status == "ok" and oth.kv_status == "ok" and ref.kv and oth.kv and pair.ref_kv and pair.other_kv):
        found.add(ProblemKind.MISSING, f"KV snapshot missing (reference {ref.kv_status}, other {oth.kv_status})")
        return KvComparison(), found
    with np.load(pair.ref_kv) as rn, np.load(pair.other_kv) as on:
        kvc = compare_kv(ref.kv, rn, oth.kv, on)
    if kvc.variants:
        found.explanations.append(
            f"{kvc.variants} prefix-hash key(s) map to blocks whose KV differs inside one engine (vLLM's own "
            "partial-prefix bookkeeping); compared as sets of contents per key"
        )
    return kvc, found


# ---- stage 4: schedule ---------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleParity:
    same: bool
    divergence_step: int | None


def schedule_parity(ref: CaseResult, other: CaseResult) -> ScheduleParity:
    a = ref.probe.schedule_fingerprint if ref.probe else []
    b = other.probe.schedule_fingerprint if other.probe else []
    step = _first_divergence(a, b)  # type: ignore[arg-type]
    return ScheduleParity(step is None, step)


#: The seam writes its fired counts at each firing (`kvcached.faults`), so no file means no firing.
NEVER_FIRED_NO_FILE = "fault plan never fired (the seam writes its fired counts at each firing: none were written)"


# ---- stage 5: facts the case exists to exercise --------------------------------------------
def _fault_plan_checks(case: Case, other: CaseResult, probe_partial_hits: int) -> tuple[str, Findings]:
    """A fault plan must fire exactly as planned (and see its trigger, if it has one)."""
    found = Findings()
    fired = other.fault.fired if other.fault else None
    if fired is None:
        found.add(ProblemKind.CHECK, NEVER_FIRED_NO_FILE)
        text = "no fired file"
    else:
        total = sum(fired.values())
        text = str(total)
        if total == 0:
            found.add(ProblemKind.CHECK, "fault plan never fired")
        elif total != case.fault.expected_fired:
            found.add(ProblemKind.CHECK, f"fault plan fired {total}x, planned {case.fault.expected_fired}x")
    if case.fault.needs_partial_hits:
        if probe_partial_hits == 0:
            found.add(ProblemKind.CHECK, "no real partial-prefix hit, so the trigger could not arm")
        if "partial_prefix_hit" not in ((other.fault.triggers if other.fault else None) or []):
            found.add(ProblemKind.CHECK, "the seam never saw the partial_prefix_hit trigger")
    return text, found


def _idle_checks(other: CaseResult) -> Findings:
    """Once the requests are done and the prefix cache is reset, kvcached holds the null
    block's page and its reserve, nothing else, and no page is quarantined (a fault, injected
    or real, leaked nothing)."""
    found = Findings()
    facts = other.kvcached
    if facts is None:
        return found
    if facts.idle_reset_refused:
        found.add(ProblemKind.CHECK, "reset_prefix_cache refused after the requests finished: blocks still in use")
    for name, pool in (facts.pools_idle or {}).items():
        beyond = (pool.mapped_bytes - pool.reserved_idle_bytes) // pool.kv_page_bytes - 1
        if pool.live_blocks != 1 or beyond != 0:
            found.add(ProblemKind.CHECK, f"pool {name} idle: {pool.live_blocks} live block(s) and {beyond} kv page(s) "
                                  "mapped beyond the null block's page and the reserve (a leak)")
        health = PoolHealth(pool.health)  # the enum, also where a test built the facts from a str
        if pool.quarantined_pages or health is not PoolHealth.HEALTHY:
            found.add(ProblemKind.CHECK, f"pool {name} idle: {pool.quarantined_pages} quarantined page(s), {health.value}")
    return found


def _budget_checks(other: CaseResult, preemptions: int, peak: int) -> tuple[str, Findings]:
    """A physical budget must force preemption, and kvcached must stay within it."""
    found = Findings()
    facts = other.kvcached
    if facts is not None:
        text = f"budget: {facts.admission_misses} admission misses, {facts.map_failures} map refusals, {preemptions} preemptions"
    else:
        text = f"budget: {preemptions} preemptions"
    if preemptions <= 0:
        found.add(ProblemKind.CHECK, "physical budget caused no preemption (engine metrics)")
    budget = other.plan.budget.kvcached_budget_bytes if other.plan and other.plan.budget else 0
    if facts is not None and budget and peak > budget:
        found.add(ProblemKind.CHECK, f"kvcached mapped {peak} bytes, over its {budget}-byte budget")
    return text, found


def _scheduler_checks(case: Case, pair: Pair) -> Findings:
    """An async case must really have run the async scheduler (when the override is on)."""
    found = Findings()
    if case.scheduling is not Scheduling.ASYNC:
        return found
    for side, res in (("reference", pair.ref), ("other", pair.other)):
        if res.scheduler is None or not res.scheduler.ran_async:
            msg = f"{side}: asked async, ran {_sched_name(res.scheduler)}"
            if pair.async_override:
                found.add(ProblemKind.CHECK, msg)
            else:
                found.explanations.append(msg)
    return found


def _prefix_hit_checks(pair: Pair, counts: RowCounts) -> Findings:
    """Prefix hits per request: equal to native's under native-equivalent caching, fewer
    (reported, not a fault) when the case caps kvcached's cached blocks.

    Cases whose plan evicts on purpose (a physical budget reclaims cached blocks) and the
    controls are not judged here.
    """
    case, found = pair.case, Findings()
    if case.control is not Control.NONE or case.fault.physical_budget:
        return found
    ref_hits = {r.rid: r.num_cached_tokens for r in pair.ref.requests or []}
    differ = [(r.rid, ref_hits.get(r.rid), r.num_cached_tokens) for r in pair.other.requests or []
              if ref_hits.get(r.rid) != r.num_cached_tokens]
    native, other = counts.prefix_hit_tokens_reference, counts.prefix_hit_tokens_other
    if case.fault.cached_cap is None:
        if differ:
            rid, a, b = differ[0]
            found.add(ProblemKind.CHECK,
                      f"prefix hits differ from native on {len(differ)} request(s) (first {rid}: {a} vs {b} tokens)")
    elif pair.other.engine == "kvcached":
        if other >= native:
            found.add(ProblemKind.CHECK, f"the cap of {case.fault.cached_cap} cached blocks evicted no prefix hit "
                                         f"({native} native vs {other} hit tokens): the case tested nothing")
        else:
            found.explanations.append(f"prefix hits differ by design (cap of {case.fault.cached_cap} cached blocks): "
                                      f"{native} native vs {other} hit tokens on {len(differ)} request(s)")
    return found


@dataclass(frozen=True)
class Facts:
    """Stage 5's result: what the plan's seam counted (or the budget's effects), and the findings."""

    fired: str
    findings: Findings


def fact_checks(pair: Pair, counts: RowCounts) -> Facts:
    """Stage 5: fault plans, budget, prefix hits, kvcached's copy counters, scheduler, pattern coverage."""
    case, other, found, fired = pair.case, pair.other, Findings(), ""
    if case.fault.rules and case.control is Control.NONE:
        fired, f = _fault_plan_checks(case, other, counts.partial_prefix_hits_other)
        found.extend(f)
    if case.fault.physical_budget and case.control is Control.NONE:
        fired, f = _budget_checks(other, counts.preemptions_other, other.mapped_bytes_peak)
        found.extend(f)
    if other.kvcached is not None:
        per_rank = [c.block_copies for c in other.kvcached.copies]
        if not per_rank or any(n != counts.cow_copies_other for n in per_rank):
            found.add(ProblemKind.CHECK, f"kvcached copied {per_rank} block pair(s) per rank but the scheduler "
                                         f"asked for {counts.cow_copies_other} on every rank")
    found.extend(_idle_checks(other))
    found.extend(_prefix_hit_checks(pair, counts))
    found.extend(_scheduler_checks(case, pair))
    found.extend(_layout_checks(case, pair))
    if case.pattern.value == "partial" and counts.cow_copies_reference == 0:
        found.add(ProblemKind.CHECK, "partial-prefix pattern made no copy-on-write copy")
    return Facts(fired, found)


# ---- stage 6: verdicts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Evidence:
    """What the verdict stages weigh."""

    tokens: TokenParity
    logprobs: LogprobParity
    kv: KvComparison
    schedule: ScheduleParity
    flips: list[TieFlip] = field(default_factory=list)  # only where the schedules diverged

    @property
    def kv_exact(self) -> bool:
        return self.kv.compared == self.kv.identical

    @property
    def mismatch_found(self) -> bool:
        return not self.tokens.exact or not self.kv_exact or not self.logprobs.equal


def control_verdict(counts: RowCounts, ev: Evidence, found: Findings) -> tuple[str, bool]:
    """Negative controls invert the verdict: they pass only when a mismatch is detected.
    Returns (verdict, passed)."""
    if any(p.kind in (ProblemKind.ERROR, ProblemKind.MISSING) for p in found.problems):
        return "error", False
    if not ev.mismatch_found:
        found.add(ProblemKind.CHECK, "negative control was not reported as a mismatch")
        return "NOT DETECTED", False
    what = []
    if not ev.tokens.exact:
        what.append(f"{counts.requests - counts.exact_matches} requests' tokens differ")
    if not ev.kv_exact:
        what.append(f"{ev.kv.compared - ev.kv.identical} KV blocks differ (max |Δ| {ev.kv.max_abs_diff:.3g})")
    if not ev.logprobs.equal:
        what.append(
            f"logprobs differ (max |Δ| {ev.logprobs.max_abs_diff:.3g}, top-k sets differ at "
            f"{ev.logprobs.topk_set_differs} positions)"
        )
    found.explanations.append("negative control caught: " + ", ".join(what))
    found.problems = []
    return "mismatch detected (expected)", True


def _numeric_findings(case: Case, ev: Evidence, found: Findings) -> None:
    """With the same schedule KV and logprobs must be bit-identical; otherwise explained."""
    lp, kv, step = ev.logprobs, ev.kv, ev.schedule.divergence_step
    if ev.schedule.same:
        if not ev.kv_exact:
            found.add(ProblemKind.NUMERIC,
                      f"same schedule but KV differs ({kv.first_mismatch}, max |Δ| {kv.max_abs_diff:.3g})")
        if not lp.equal:
            found.add(ProblemKind.NUMERIC,
                      f"same schedule but logprobs differ (max |Δ| {lp.max_abs_diff:.3g} over shared top-k tokens; "
                      f"top-k sets differ at {lp.topk_set_differs} positions)")
    elif not ev.kv_exact or not lp.equal:
        cause = case.fault.name if not case.fault.is_none else "batching"
        found.explanations.append(
            f"schedule diverged at step {step} ({cause}); largest |ΔKV| {kv.max_abs_diff:.3g}, "
            f"|Δlogprob| {lp.max_abs_diff:.3g}: the same tokens computed in differently shaped batches can "
            "differ in the last bits (CPU and GPU kernels alike)"
        )
    else:
        found.explanations.append(f"schedule diverged at step {step}, yet KV and logprobs are bit-identical")


def candidate_verdict(case: Case, counts: RowCounts, ev: Evidence, found: Findings) -> tuple[str, bool]:
    """Tokens exact always; KV and logprobs exact under the same schedule. Returns (verdict, passed)."""
    if not (counts.complete_reference == counts.requests and counts.complete_other == counts.requests):
        found.add(ProblemKind.CHECK, f"incomplete requests: reference {counts.complete_reference}, other "
                                     f"{counts.complete_other} of {counts.requests}")
    flipped = {f.rid for f in ev.flips}
    if bad := [p for p in ev.tokens.stable if not p.exact and p.rid not in flipped]:
        first = min(bad, key=lambda p: p.first_divergence or 0)
        found.add(ProblemKind.NUMERIC, f"token mismatch in {len(bad)} request(s), first {first.rid}@{first.first_divergence}")
    if ev.flips:
        found.explanations.append(
            f"{len(ev.flips)} request(s) flipped a near-tie of native's after the schedules diverged: "
            + "; ".join(map(str, ev.flips))
        )
    _numeric_findings(case, ev, found)
    if found.problems:
        # A KV snapshot that is missing is a mismatch here (the case ran), but an error for a
        # negative control (it cannot have caught anything without it).
        return ("error" if any(p.kind is ProblemKind.ERROR for p in found.problems) else "MISMATCH"), False
    if ev.flips:
        return "exact up to near-tie flips (batching)", True
    if ev.tokens.unstable and counts.exact_matches < counts.requests:
        return "exact where native is self-consistent", True
    return ("exact" if (ev.kv_exact and ev.logprobs.equal) else "tokens exact, numeric diff explained"), True


# ---- the pipeline ----------------------------------------------------------------------------------
def _sched_name(s: SchedulerRan | None) -> str:
    return s.name if s is not None else "?"


def _layout_ran(s: SchedulerRan | None) -> str:
    if s is None:
        return "?"
    where = {True: ", EngineCore process", False: ", in-process", None: ""}[s.engine_core_separate]
    runner = f", Model Runner {s.runner}" if s.runner else ""
    return f"{s.executor} x{s.world_size}{where}{runner}"


def _layout_checks(case: Case, pair: Pair) -> Findings:
    """The engine must really have run the layout the case asks for, on both sides."""
    found = Findings()
    want_mp, want_ranks = case.layout.multiprocess, case.layout.tensor_parallel
    for side, res in (("reference", pair.ref), ("other", pair.other)):
        s = res.scheduler
        if s is None:
            continue
        separate = s.engine_core_separate if s.engine_core_separate is not None else s.executor != "UniProcExecutor"
        if separate != want_mp or s.world_size != want_ranks:
            found.add(ProblemKind.CHECK, f"{side}: asked layout {case.layout.value}, ran {_layout_ran(s)}")
    runners = {side: res.scheduler.runner for side, res in (("reference", pair.ref), ("other", pair.other))
               if res.scheduler is not None and res.scheduler.runner is not None}
    if len(set(runners.values())) > 1:  # vLLM decides per engine; both sides must have run the same runner
        found.add(ProblemKind.CHECK, "model runners differ: " + ", ".join(f"{k} {v}" for k, v in runners.items()))
    return found


def comparison_label(case: Case, other_engine: str) -> str:
    if case.control is Control.NONE:
        return f"{other_engine} vs native"
    if case.control is Control.BASELINE:
        return "native vs native (noise baseline)"
    if case.control is Control.EQUAL_POOL:
        return "native at the candidate's pool vs native"
    return f"negative control: {case.control.value}"


def _identity(pair: Pair) -> RowIdentity:
    """What the row compares and what really ran."""
    case, ref, other = pair.case, pair.ref, pair.other
    return RowIdentity(
        case_id=case.case_id, comparison=comparison_label(case, other.engine), archetype=case.archetype.name,
        scheduling=case.scheduling.value, pattern=case.pattern.value, lengths=case.lengths.value,
        prefix_caching=case.prefix_caching, fault_plan=case.fault.name, control=case.control.value,
        fault_seam=other.fault_seam or "", scheduler_reference=_sched_name(ref.scheduler),
        scheduler_other=_sched_name(other.scheduler),
        async_scheduling_reference=ref.scheduler.async_scheduling if ref.scheduler else None,
        async_scheduling_other=other.scheduler.async_scheduling if other.scheduler else None,
        layout=case.layout.value, layout_reference=_layout_ran(ref.scheduler), layout_other=_layout_ran(other.scheduler),
        injected_failures_expected=case.fault.expected_fired,
        peak_mapped_bytes_reference=ref.mapped_bytes_peak, peak_mapped_bytes_other=other.mapped_bytes_peak,
        final_mapped_bytes_reference=ref.mapped_bytes_final, final_mapped_bytes_other=other.mapped_bytes_final,
        wall_s_reference=ref.t_total or 0.0, wall_s_other=other.t_total or 0.0,
        native_defect_reference=ref.native_defect or "",
    )  # fmt: skip


def _first_divergence_text(tokens: TokenParity) -> str:
    if not (divs := tokens.divergences):
        return ""
    first = min(divs, key=lambda p: p.first_divergence or 0)
    return f"{first.rid}@{first.first_divergence} ({len(divs)} req)"


def _counts(pair: Pair, ev: Evidence) -> RowCounts:
    """Stages 1-4 counted: requests and tokens, KV, logprobs, prefix hits, copies, preemptions."""
    ref, other, reqs, kv = pair.ref, pair.other, ev.tokens.requests, ev.kv
    ref_reqs, oth_reqs = ref.requests or [], other.requests or []
    if ref.probe is None or other.probe is None or ref.metrics is None or other.metrics is None:
        raise InvariantError("counts of a comparison whose engines did not both run (see _ran)")
    return RowCounts(
        requests=len(ref_reqs), complete_reference=sum(p.ref_complete for p in reqs),
        complete_other=sum(p.other_complete for p in reqs),
        output_tokens_reference=sum(len(r.token_ids) for r in ref_reqs),
        output_tokens_other=sum(len(r.token_ids) for r in oth_reqs),
        expected_output_tokens=pair.case.max_tokens * len(ref_reqs), exact_matches=sum(p.exact for p in reqs),
        first_divergence=_first_divergence_text(ev.tokens),
        kv_blocks_compared=kv.compared, kv_blocks_identical=kv.identical, kv_only_reference=kv.only_reference,
        kv_only_other=kv.only_other, kv_max_abs_diff=kv.max_abs_diff, kv_key_variants=kv.variants,
        native_unstable_requests=len(ev.tokens.unstable),
        logprobs_equal=ev.logprobs.equal, logprob_max_abs_diff=ev.logprobs.max_abs_diff,
        prefix_hit_tokens_reference=sum(r.num_cached_tokens for r in ref_reqs),
        prefix_hit_tokens_other=sum(r.num_cached_tokens for r in oth_reqs),
        partial_prefix_hits_other=other.probe.partial_prefix_hits,
        cow_copies_reference=ref.probe.copies_total, cow_copies_other=other.probe.copies_total,
        preemptions_reference=int(ref.metrics.preemptions), preemptions_other=int(other.metrics.preemptions),
        same_schedule=ev.schedule.same, schedule_divergence_step=ev.schedule.divergence_step,
    )  # fmt: skip


def _ran(res: CaseResult) -> bool:
    return res.error is None and res.requests is not None and res.probe is not None and res.metrics is not None


# ---- plans that end in an engine error ------------------------------------------------------------
def _fired_as_planned(case: Case, other: CaseResult) -> tuple[str, Findings]:
    """Every rank checks the ``copy`` site, so a TP engine may fire once per rank (the ranks
    that reached the copy before the engine stopped them): 1 to ranks x planned."""
    found = Findings()
    fired = other.fault.fired if other.fault else None
    if fired is None:
        found.add(ProblemKind.CHECK, NEVER_FIRED_NO_FILE)
        return "no fired file", found
    total, most = sum(fired.values()), case.fault.expected_fired * case.layout.tensor_parallel
    if total == 0:
        found.add(ProblemKind.CHECK, "fault plan never fired")
    elif total > most:
        found.add(ProblemKind.CHECK, f"fault plan fired {total}x, planned at most {most}x")
    return str(total), found


def _teardown_checks(other: CaseResult) -> Findings:
    """After the engine error and the shutdown, nothing of the engine is left."""
    found, t = Findings(), other.teardown
    if t is None:
        found.add(ProblemKind.CHECK, "no teardown facts recorded")
        return found
    if other.engine == "kvcached":
        if t.record_live_slots is None:
            found.add(ProblemKind.CHECK, "the case's budget record was never written (kvcached not running?)")
        elif t.record_live_slots or t.record_charged_bytes:
            found.add(ProblemKind.CHECK, f"memory not returned: {t.record_live_slots} live budget slot(s) holding "
                                         f"{t.record_charged_bytes} bytes after shutdown")
    if t.registered_spaces:
        found.add(ProblemKind.CHECK, f"{t.registered_spaces} kvcached KV space(s) still registered after shutdown")
    if t.memfds_after > t.memfds_before:
        found.add(ProblemKind.CHECK, f"memfds leaked: {t.memfds_before} before the engine, {t.memfds_after} after shutdown")
    if t.live_children:
        found.add(ProblemKind.CHECK, f"engine processes survived shutdown: {', '.join(t.live_children)}")
    elif t.settle_s >= 0.1:
        found.explanations.append(f"the engine's processes and budget slots were gone {t.settle_s:.1f} s after "
                                  "shutdown returned")
    return found


def _sides_failed(pair: Pair) -> Findings:
    found = Findings()
    for side, res in (("reference", pair.ref), ("other", pair.other)):
        if res.error:
            found.add(ProblemKind.ERROR, f"{side} error: {res.error}")
    return found


@dataclass(frozen=True)
class BeforeTheError:
    """What the passes before a planned engine error showed: the error the client got, and
    the parity of the requests that had finished."""

    engine_error: str
    counts: RowCounts
    requests: list[RequestParity]
    findings: Findings


def before_the_error(pair: Pair, err: EngineErrorRecord, ref_requests: list[RequestRecord]) -> BeforeTheError:
    found = Findings()
    text = f"pass {err.pass_no}: {err.error_type}"
    before = pair.ref.model_copy(update={"requests": [r for r in ref_requests if r.pass_no < err.pass_no]})
    if not (before.requests or pair.other.requests):
        found.explanations.append("the engine error came in pass 1: no request had finished before it")
        return BeforeTheError(text, RowCounts(), [], found)
    tokens = token_parity(pair.case, before, pair.other)
    counts = RowCounts(requests=len(before.requests or []), exact_matches=sum(p.exact for p in tokens.requests))
    if not tokens.exact:
        found.add(ProblemKind.NUMERIC, f"tokens before the engine error differ on "
                                       f"{counts.requests - counts.exact_matches} request(s)")
    found.extend(tokens.findings)
    return BeforeTheError(text, counts, tokens.requests, found)


def engine_error_verdict(pair: Pair) -> tuple[ParityRow, list[RequestParity]]:
    """The client got the planned error, the passes before it gave native's tokens, the fault
    fired as planned, and the engine returned everything (`_teardown_checks`)."""
    case, ref, other = pair.case, pair.ref, pair.other
    found = _sides_failed(pair)
    err, before = other.engine_error, BeforeTheError("", RowCounts(), [], Findings())
    if err is None:
        found.add(ProblemKind.CHECK, "the plan should end in an engine error, but every pass completed")
    elif ref.requests is not None and not found.problems:
        before = before_the_error(pair, err, ref.requests)
        found.extend(before.findings)
    fired, f = _fired_as_planned(case, other)
    for stage in (f, _teardown_checks(other), _scheduler_checks(case, pair), _layout_checks(case, pair)):
        found.extend(stage)
    passed = not found.problems
    verdict = RowVerdict("engine error as planned" if passed else "error", passed, found.problems,
                         found.explanations, injected_failures_fired=fired, engine_error=before.engine_error)
    return assemble(_identity(pair), before.counts, verdict), before.requests


def compare(pair: Pair) -> tuple[ParityRow, list[RequestParity]]:
    """Run every stage on one pair of results; the row is assembled once, from their parts."""
    if pair.case.fault.ends_in_engine_error and pair.case.control is Control.NONE:
        return engine_error_verdict(pair)
    found = _sides_failed(pair)
    if found.problems or not (_ran(pair.ref) and _ran(pair.other)):
        problems = found.problems or [Problem(ProblemKind.MISSING, "missing request results")]
        return assemble(_identity(pair), RowCounts(), RowVerdict(problems=problems)), []
    tokens = token_parity(pair.case, pair.ref, pair.other)
    logprobs = logprob_parity(pair.ref, pair.other, tokens)
    kv, kv_found = kv_parity(pair)
    schedule = schedule_parity(pair.ref, pair.other)
    flips = [] if schedule.same else tie_flips(tokens, logprobs, pair.ref, pair.other)
    ev = Evidence(tokens, logprobs, kv, schedule, flips)
    counts = _counts(pair, ev)
    facts = fact_checks(pair, counts)
    for f in (tokens.findings, kv_found, facts.findings):
        found.extend(f)
    if pair.case.prefix_caching and kv.compared == 0 and not found.problems:
        found.add(ProblemKind.CHECK, "no KV block compared")
    if pair.case.control.expects_mismatch:
        verdict, passed = control_verdict(counts, ev, found)
    else:
        verdict, passed = candidate_verdict(pair.case, counts, ev, found)
    judged = RowVerdict(verdict, passed, found.problems, found.explanations, injected_failures_fired=facts.fired)
    return assemble(_identity(pair), counts, judged), tokens.requests


# ---- stage 7, over a whole run: native's own floor ------------------------------------------------
def _numeric(p: Problem) -> bool:
    """Only problems saying that the two sides computed differently are what a native floor
    measures; anything else (errors, incomplete requests, facts) fails a row whatever native does."""
    return p.kind is ProblemKind.NUMERIC


def _differing(row: ParityRow) -> int:
    return row.requests - row.exact_matches


def judge_against_native_floor(rows: list[ParityRow], cases: dict[str, Case]) -> list[ParityRow]:
    """A row is exact only where native was exact; where native is not, its baseline is the floor.

    A baseline control runs a case again on native (native vs native). For a case on an
    attention backend whose native engine is known to be history-dependent
    (`conformance.cases.NATIVE_FLOOR_BACKENDS`: FlashAttention 3 with prefix hits on CUDA), for
    a case native was measured not to repeat (`conformance.cases.NATIVE_FLOOR_CASES`), and
    for native at the candidate's pool (`Control.EQUAL_POOL`: a budget that evicts prefixes
    native's own output depends on), a baseline that differs is not a harness failure but a
    measurement: it passes as the floor, and every row of the same case is judged against it.
    Such a row passes when it differs from native in no more requests than native differed from
    itself, and is never called exact. Everywhere else a baseline must be exact (a differing
    one fails, as before).

    Returns the rows, those re-judged replaced by new rows (the given ones are left as they are).
    """
    out = list(rows)
    for i, floor in enumerate(rows):
        case = cases[floor.case_id]
        if not measures_native_floor(case) or floor.verdict == "exact" or any(not _numeric(p) for p in floor.problems):
            continue
        out[i] = floor = replace(
            floor, problems=[], passed=True, explanations=floor.explanations + [f"native floor: {p}" for p in floor.problems],
            verdict=f"native floor: {_differing(floor)} of {floor.requests} requests differ")  # fmt: skip
        base = replace(case, control=Control.NONE).case_id
        out = [_against_floor(row, floor) if row.case_id == base else row for row in out]
    return out


def _against_floor(row: ParityRow, floor: ParityRow) -> ParityRow:
    """``row`` judged against its case's native floor (`judge_against_native_floor`)."""
    numeric = all(_numeric(p) for p in row.problems)
    if row.passed or (numeric and _differing(row) <= _differing(floor)):
        return replace(
            row, problems=[], passed=True,
            explanations=row.explanations + [f"within native's floor ({floor.verdict}): {p}" for p in row.problems],
            verdict=f"within native's floor ({_differing(row)} of {row.requests} requests differ)")  # fmt: skip
    return replace(row, problems=row.problems + [Problem(
        ProblemKind.CHECK, f"beyond native's floor: {_differing(row)} requests differ, native's own baseline "
                           f"{_differing(floor)}")])  # fmt: skip


def compare_results(
    case: Case,
    ref: CaseResult,
    other: CaseResult,
    ref_npz_path: Path | None,
    other_npz_path: Path | None,
    async_override: bool,
) -> tuple[ParityRow, list[RequestParity]]:
    return compare(Pair(case, ref, other, ref_npz_path, other_npz_path, async_override))
