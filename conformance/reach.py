"""Whether a fault plan's site is reached by the workload planned for it, and the pass that makes it so.

A fault plan fails the n-th check of a site. A workload that makes fewer than n checks
tests nothing: the case then fails as "fault never fired", which says nothing about
kvcached (mamba2 in bf16 on an AMX CPU: 64 blocks per kv page, 24 blocks held at the
peak, no page mapped after start-up). So the reference plans each fault case's workload
from the geometry and the scheduler of its running engine by the rule here, and refuses,
naming the case, a plan it cannot show to be reached.

The rule models the site ``map`` (kvcached's page pool: one check per kv page it maps,
reserve refills and the pages of new blocks alike):

* the blocks the workload is certain to hold at one moment (`held_blocks_lower_bound`)
  occupy at least ``ceil(held / blocks_per_page)`` kv pages, all mapped at that moment;
* one of those pages, the null block's, is mapped by the worker before the pool exists
  and adopted by it without a check (`PREMAPPED_PAGES`); every other one went through a
  check (a failed check maps nothing, so a page mapped after a fault took another check);
* so ``ceil(held / blocks_per_page) - PREMAPPED_PAGES`` map checks are certain
  (`map_checks_lower_bound`), whatever the reserve policy maps on top of them. Until the
  plan's first failure the candidate schedules as native does, so the bound, computed
  from what native vLLM must do, holds for the candidate up to the check that fails.

Held blocks come only from what vLLM's scheduler must do, never from timing:

* one request: at its last step it has computed its prompt and all but its last token
  (``ignore_eos``: exactly ``max_tokens``), so it holds every block of those tokens in a
  full-attention group and at least one block in any other group (a Mamba state);
* a pass whose requests are admitted in one step: the sum of what each holds at
  admission. That is certain only when every request reaches the scheduler before its
  first step (the EngineCore runs in the harness's process: ``LLM.generate`` adds them all
  first), the pass fits one step (``max_num_seqs``, the step's token budget, the long
  prefill threshold, the pool's blocks), and no request can hit a block of another
  (`_may_hit`: a hit moves blocks between requests, and a Mamba request that hits a block
  cached in the same step is held back). At admission a Mamba model may stop a prompt's
  first chunk at any cacheable boundary, so only its first token is certain there.

When the case's own passes fall short, a *fill* pass is put first (`plan_fill`): fresh
prompts of one length, as few and as short as reach the plan's check, admitted together
where the engine allows it, else one long prompt. Put first, it leaves the case's own
passes, their prefix hits and the reference's replay of the last pass as they were.

Other sites (admission, copy-on-write admission, rank map requests, block copies) are not
modelled: `required_map_checks` is 0 for them and nothing is planned or refused.

Invariants:
* `plan_fault_reach` returns a workload whose `map_checks_lower_bound` is at least
  `required_map_checks` of the case's plan, or raises `FaultSiteUnreachable` naming the case.
* The case's own passes are the builder's, unchanged; only a leading fill pass is added.
* Every bound here is a lower bound: a pass is credited with concurrency only when vLLM's
  admission rules guarantee it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conformance.cases import Case, FaultPlan
from conformance.geometry import Geometry
from conformance.workload import FillPass, Prompt, Workload
from kvcached.space import plan_geometry

#: vLLM's null block: pinned (held) for the engine's whole life.
NULL_BLOCKS = 1
#: The null block's kv page: the worker maps it with the KV tensors (warm-up may read block
#: 0 before the pool exists) and the pool adopts it without a map check.
PREMAPPED_PAGES = 1
#: The KV spec whose groups keep every block of a request's tokens (vLLM's class name).
FULL_ATTENTION = "FullAttentionSpec"
MAP_SITE = "map"


class FaultSiteUnreachable(ValueError):
    """A fault plan's site is not certain to be reached by the workload planned for it."""


@dataclass(frozen=True)
class SchedulerLimits:
    """What the running engine's scheduler admits in one step (vLLM's ``SchedulerConfig``),
    and whether every request of one ``generate`` call reaches it before its first step."""

    max_num_seqs: int
    step_token_budget: int  # max_num_batched_tokens (or max_num_scheduled_tokens when set)
    long_prefill_token_threshold: int  # 0: none
    requests_arrive_together: bool  # the EngineCore runs in the caller's process


@dataclass(frozen=True)
class MapReach:
    """What the rule found for one workload: its figures, for messages and reports."""

    needed_checks: int
    held_blocks: int
    blocks_per_page: int
    checks: int

    @property
    def reached(self) -> bool:
        return self.checks >= self.needed_checks


def required_map_checks(plan: FaultPlan) -> int:
    """The map checks the plan must see: the most any of its ``map`` rules lets pass and
    then fails (rules waiting for a trigger are not modelled: 0)."""
    return max((r.skip + r.fail_next for r in plan.rules if r.site == MAP_SITE and r.after_trigger is None),
               default=0)


def blocks_per_page(geo: Geometry) -> int:
    """Blocks of one kv page, as kvcached plans its pages (`kvcached.space.plan_geometry`)."""
    return plan_geometry(geo.block_strides, geo.num_blocks, geo.page_size_bytes).blocks_per_page


def blocks_for_tokens(geo: Geometry, tokens: int) -> int:
    """Blocks a request holds once it has computed ``tokens`` tokens: every block of them in
    a full-attention group, at least one in any other group."""
    return sum(_cdiv(tokens, size) if kind == FULL_ATTENTION else 1
               for size, kind in zip(geo.group_block_sizes, geo.group_kinds, strict=True))


def blocks_at_admission(geo: Geometry, prompt_len: int) -> int:
    """Blocks a request of ``prompt_len`` tokens holds after the step that admits it with its
    whole prompt in the budget; a model with non-attention groups may stop that first chunk
    at any cacheable boundary (Mamba align mode), so only one token is certain there."""
    pure_attention = all(kind == FULL_ATTENTION for kind in geo.group_kinds)
    return blocks_for_tokens(geo, prompt_len if pure_attention else 1)


def held_blocks_lower_bound(workload: Workload, geo: Geometry, limits: SchedulerLimits, max_tokens: int) -> int:
    """Blocks the workload is certain to hold at one moment, the null block included."""
    best = 0
    earlier: list[Prompt] = []
    for prompts in workload.passes:
        best = max(best, _pass_bound(prompts, earlier, geo, limits, max_tokens))
        earlier.extend(prompts)
    return NULL_BLOCKS + best


def map_checks_lower_bound(held_blocks: int, per_page: int) -> int:
    """Map checks certain once ``held_blocks`` blocks are held at one moment."""
    return max(0, _cdiv(held_blocks, per_page) - PREMAPPED_PAGES)


def map_reach(case: Case, workload: Workload, geo: Geometry, limits: SchedulerLimits) -> MapReach:
    held, per_page = held_blocks_lower_bound(workload, geo, limits, case.max_tokens), blocks_per_page(geo)
    return MapReach(required_map_checks(case.fault), held, per_page, map_checks_lower_bound(held, per_page))


def check_fault_reach(case: Case, workload: Workload, geo: Geometry, limits: SchedulerLimits) -> MapReach:
    """The planning-time check: `FaultSiteUnreachable`, naming the case, unless the plan's
    map checks are certain to happen in ``workload``."""
    reach = map_reach(case, workload, geo, limits)
    if not reach.reached:
        raise FaultSiteUnreachable(
            f"{case.case_id}: fault plan {case.fault.name!r} fails map check #{reach.needed_checks}, but its "
            f"workload is certain to hold only {reach.held_blocks} blocks at once ({reach.blocks_per_page} per "
            f"{geo.page_size_bytes}-byte kv page): {reach.checks} page map(s) after start-up"
        )
    return reach


def plan_fill(case: Case, geo: Geometry, limits: SchedulerLimits, max_prompt_len: int) -> FillPass | None:
    """The shortest prompts, as few as suffice, whose pass alone makes the plan's map checks
    certain (None: no such pass fits this engine): requests admitted together where the
    engine guarantees it, else one request."""
    # Held blocks must overflow the premapped pages and all but one of the pages behind the
    # checks (`map_checks_lower_bound`); the null block is one of them.
    pages = required_map_checks(case.fault) + PREMAPPED_PAGES
    want = (pages - 1) * blocks_per_page(geo) + 1 - NULL_BLOCKS
    for n in range(1, max_prompt_len + 1):
        if limits.requests_arrive_together:
            requests = _cdiv(want, blocks_at_admission(geo, n))
            if _fits_one_step([n] * requests, geo, limits):
                return FillPass(requests, n)
        if blocks_for_tokens(geo, n + case.max_tokens - 1) >= want:
            return FillPass(1, n)
    return None


def plan_fault_reach(
    case: Case,
    geo: Geometry,
    limits: SchedulerLimits,
    max_prompt_len: int,
    build: Callable[[FillPass | None], Workload],
) -> Workload:
    """The case's workload (``build(None)``), with a leading fill pass when its own passes
    do not make the plan's map checks certain; `FaultSiteUnreachable` when no fill does."""
    workload = build(None)
    if required_map_checks(case.fault) == 0 or map_reach(case, workload, geo, limits).reached:
        return workload
    fill = plan_fill(case, geo, limits, max_prompt_len)
    if fill is not None:
        workload = build(fill)
    check_fault_reach(case, workload, geo, limits)  # without a fill: raises, with the figures
    return workload


# ---- one pass ---------------------------------------------------------------------------------
def _pass_bound(prompts: Sequence[Prompt], earlier: Sequence[Prompt], geo: Geometry, limits: SchedulerLimits,
                max_tokens: int) -> int:
    lens = [len(p.tokens) for p in prompts]
    single = max(blocks_for_tokens(geo, n + max_tokens - 1) for n in lens)
    if limits.requests_arrive_together and _fits_one_step(lens, geo, limits) \
            and not _may_hit(prompts, earlier, geo.hash_block_size):
        return max(single, sum(blocks_at_admission(geo, n) for n in lens))
    return single


def _fits_one_step(lens: Sequence[int], geo: Geometry, limits: SchedulerLimits) -> bool:
    """Whether vLLM's scheduler admits all these fresh prompts, whole, in the first step."""
    threshold = limits.long_prefill_token_threshold
    return (
        len(lens) <= limits.max_num_seqs
        and sum(lens) <= limits.step_token_budget
        and (threshold <= 0 or max(lens) <= threshold)
        and sum(blocks_at_admission(geo, n) for n in lens) <= geo.num_blocks - NULL_BLOCKS
    )


def _may_hit(prompts: Sequence[Prompt], earlier: Sequence[Prompt], hash_block: int) -> bool:
    """Whether some prompt may hit a block of another prompt of its pass or of an earlier
    one. A hit needs a whole hash block before the prompt's last token, and blocks chain
    from the first, so two prompts can share one only if they agree on their first
    ``hash_block`` tokens (a shorter earlier prompt's block continues with its outputs:
    agreeing on its prompt is enough to count)."""
    others = [*earlier, *prompts]
    for p in prompts:
        if len(p.tokens) <= hash_block:
            continue
        for q in others:
            if q is not p and p.tokens[: min(hash_block, len(q.tokens))] == q.tokens[:hash_block]:
                return True
    return False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

