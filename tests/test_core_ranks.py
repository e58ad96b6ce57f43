"""The page protocol between a scheduler and its ranks, on real CPU virtual ranges.

Each "rank" is a real `RankPages` over its own `kvcached._vmm.VirtualRange`s; the channel
hands every request to every rank in order, as vLLM's ``collective_rpc`` does. Refusals are
real: a rank whose physical budget is smaller runs out of memory first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvcached import _vmm
from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import DriverError, InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FailingRange
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool, PageSpace, PoolHealth
from kvcached.ranks import PageRequest, RankedPageSpace, RankLayout, RankPages, RankReply, check_layouts
from kvcached.space import plan_geometry

PAGE = 64 << 10
STRIDES = (16 << 10, 32 << 10)  # two backings: 4 and 2 blocks per VMM page
NUM_BLOCKS = 64


class InOrderChannel:
    """Every request to every rank, one after the other (what collective_rpc guarantees)."""

    def __init__(self, ranks: list[RankPages]) -> None:
        self.ranks = ranks
        self.log: list[PageRequest] = []

    def call(self, request: PageRequest) -> list[RankReply]:
        self.log.append(request)
        return [r.handle(request) for r in self.ranks]

    def call_later(self, request: PageRequest) -> object:
        """Delivered now, in order; the replies wait for ``result()``."""
        replies = self.call(request)
        return type("Done", (), {"result": lambda self: replies, "done": lambda self: True})()


def _rank(rank: int, budget_bytes: int | None = None) -> RankPages:
    geometry = plan_geometry(STRIDES, NUM_BLOCKS, PAGE)
    budget = LocalBudget(budget_bytes) if budget_bytes is not None else None
    ranges = tuple(_vmm.VirtualRange("cpu", size, PAGE) for size in geometry.reserved_bytes)
    return RankPages(rank, PageSpace(ranges, geometry.vmm_pages, geometry.num_kv_pages, budget), geometry)


def _kv_page_bytes() -> int:
    g = plan_geometry(STRIDES, NUM_BLOCKS, PAGE)
    return sum(g.vmm_pages) * PAGE


def _engine(*budgets: int | None) -> tuple[RankedPageSpace, list[RankPages], InOrderChannel]:
    ranks = [_rank(i, b) for i, b in enumerate(budgets)]
    channel = InOrderChannel(ranks)
    geometry, premapped, _ = check_layouts([r.layout() for r in ranks])
    assert not premapped
    return RankedPageSpace(geometry, channel, len(ranks)), ranks, channel


def test_a_batch_is_mapped_on_every_rank() -> None:
    space, ranks, channel = _engine(None, None)
    space.map_pages([0, 1, 2])
    assert all(r.mapped == {0, 1, 2} for r in ranks)
    space.unmap_pages([1])
    assert all(r.mapped == {0, 2} for r in ranks)
    assert dict(space.calls) == {"map": 1, "unmap": 1}
    assert [req.op for req in channel.log] == ["map", "unmap"]


def test_a_rank_that_runs_out_refuses_and_the_others_undo() -> None:
    kv = _kv_page_bytes()
    space, ranks, channel = _engine(None, 2 * kv)  # rank 1 can hold two kv pages only
    space.map_pages([0, 1])
    with pytest.raises(PhysicalMemoryExhausted, match="rank 1"):
        space.map_pages([2, 3])
    # Nothing of the refused batch survives on either rank; the earlier batch is intact.
    assert ranks[0].mapped == ranks[1].mapped == {0, 1}
    undo = channel.log[-1]
    assert undo.op == "unmap" and undo.ranks == frozenset({0}) and undo.pages == (2, 3)
    assert space.physical_available() == 0  # the smallest rank's capacity


def test_the_pool_turns_a_refusal_into_a_miss_and_maps_later() -> None:
    kv = _kv_page_bytes()
    space, ranks, _ = _engine(None, 3 * kv)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=0))
    pool.acquire([0, 1, 2])
    with pytest.raises(PhysicalMemoryExhausted):
        pool.acquire([3])
    assert pool.mapped == {0, 1, 2} and all(r.mapped == {0, 1, 2} for r in ranks)
    assert pool.counters().map_failures == 1
    pool.release([2])
    pool.collect()  # no fence step pending: page 2 goes back on every rank
    pool.acquire([3])
    assert all(r.mapped == {0, 1, 3} for r in ranks)
    pool.close()
    assert all(not r.mapped for r in ranks)


def test_ranks_must_agree_on_the_layout() -> None:
    a, b = _rank(0), _rank(1)
    check_layouts([a.layout(), b.layout()])
    other = RankLayout(1, {**b.layout().geometry, "num_blocks": NUM_BLOCKS + 4}, (), 0)
    with pytest.raises(InvariantError, match="rank 1 reserved another KV geometry"):
        check_layouts([a.layout(), other])
    with pytest.raises(InvariantError, match="ranks"):
        check_layouts([a.layout(), RankLayout(2, a.layout().geometry, (), 0)])


def test_misuse_is_reported_by_the_rank_not_raised_through_the_channel() -> None:
    rank = _rank(0)
    assert rank.handle(PageRequest("map", (1,))).ok
    reply = rank.handle(PageRequest("map", (1,)))
    assert not reply.ok and reply.refusal == "driver" and "already mapped" in reply.message
    assert rank.mapped == {1} and reply.held == (), "the refused map left nothing behind"
    reply = rank.handle(PageRequest("unmap", (1, 5)))
    assert not reply.ok and "[5] are not mapped" in reply.message
    assert rank.mapped == {1} and reply.held == (1,), "the refused unmap unmapped nothing: page 1 is still held"
    assert rank.handle(PageRequest("unmap", (1,), frozenset({5}))).ok  # not addressed to rank 0
    assert rank.mapped == {1}
    rank.close()
    assert not rank.mapped


def test_an_injected_refusal_on_one_rank_is_undone_on_the_others() -> None:
    from kvcached.faults import FaultInjector

    space, ranks, channel = _engine(None, None)
    ranks[1].faults = FaultInjector.from_plans([{"site": "rank1_map", "skip": 1, "fail_next": 1}])
    space.map_pages([0])
    with pytest.raises(PhysicalMemoryExhausted, match="rank 1: InjectedFault"):
        space.map_pages([1, 2])
    assert ranks[0].mapped == ranks[1].mapped == {0}
    assert [(r.op, r.ranks) for r in channel.log[-2:]] == [("map", frozenset()), ("unmap", frozenset({0}))]
    space.map_pages([1, 2])  # the plan is spent: the next request maps on both
    assert ranks[0].mapped == ranks[1].mapped == {0, 1, 2}
    assert ranks[1].faults.fired("rank1_map") == 1


def test_the_reserve_is_refilled_ahead_of_demand_without_waiting() -> None:
    """A take from the reserve sends its refill at once and confirms it at the next decision;
    a step whose demand the reserve covers waits for no round trip."""
    from kvcached.faults import FaultInjector

    space, ranks, _ = _engine(None, None)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=1, max_reserve_pages=4))
    pool.acquire([0])  # blocking: nothing was mapped yet; then a deferred refill of 1 page
    assert dict(space.calls) == {"map": 1} and space.deferred == 1
    assert set(pool.pending) == {1} and all(r.mapped == {0, 1} for r in ranks)
    assert pool.counters().mapped_pages == 2  # pending pages count as mapped
    for page in (1, 2, 3):  # each take is covered by the reserve: no blocking request
        pool.acquire([page])
    assert dict(space.calls) == {"map": 1} and space.deferred == 4
    # A refill refused by rank 1 is undone on rank 0 and never handed out.
    ranks[1].faults = FaultInjector.from_plans([{"site": "rank1_map", "fail_next": 1}])
    pool.acquire([4])  # page 4 was pending: confirmed, then a refill of page 5 that rank 1 refuses
    assert set(pool.pending) == {5}
    assert pool.mapped == {0, 1, 2, 3, 4}  # settling it: refused, undone
    assert ranks[0].mapped == ranks[1].mapped == {0, 1, 2, 3, 4} and pool.counters().map_failures == 1
    pool.close()
    assert all(not r.mapped for r in ranks) and not pool.pending


def test_an_admission_beyond_the_reserve_costs_one_round_trip() -> None:
    """Backing blocks beyond the reserve maps every page the demand needs, and the reserve's
    refill, in one batch: one blocking request, however many pages (it was one per page),
    and the takes that follow find the reserve full (no refill sent right behind them)."""
    from kvcached.fence import StepFence
    from kvcached.ledger import BlockLedger

    space, ranks, channel = _engine(None, None)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=2, max_reserve_pages=4), fence=StepFence())
    ledger = BlockLedger(NUM_BLOCKS, space.geometry.blocks_per_page, pool)
    per_page = space.geometry.blocks_per_page
    assert ledger.ensure_backed(3 * per_page) == 5 * per_page  # 3 pages of demand + 2 of reserve
    maps = [r.pages for r in channel.log if r.op == "map"]
    assert space.calls["map"] == 1 and maps == [(0, 1, 2, 3, 4)]  # the first capacity query aside
    ledger.allocate(3 * per_page)  # takes pages 0-2; the reserve (3, 4) is at its target
    assert space.calls["map"] == 1 and space.deferred == 0 and not pool.pending
    assert all(r.mapped == {0, 1, 2, 3, 4} for r in ranks)
    pool.close()


class LaterChannel(InOrderChannel):
    """A request sent without waiting is applied when its result is asked for (a background
    thread that has not run yet); one that waits is applied at once."""

    def call_later(self, request: PageRequest) -> object:
        channel, replies = self, []

        class Later:
            def done(self) -> bool:
                return bool(replies)

            def result(self) -> list[RankReply]:
                if not replies:
                    replies.extend(channel.call(request))
                return replies

        return Later()


def test_a_busy_step_gives_pages_back_without_waiting_for_the_ranks() -> None:
    """A step's end sends its unmaps and waits for none, busy or idle: the pages leave the
    reserve and are never offered again until the ranks confirmed; a page wanted again
    meanwhile is waited for, then mapped; a snapshot of the books waits for what is left."""
    ranks = [_rank(0), _rank(1)]
    channel = LaterChannel(ranks)
    geometry, _, _ = check_layouts([r.layout() for r in ranks])
    space = RankedPageSpace(geometry, channel, 2)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0),
                    fence=StepFence())
    pool.acquire([0, 1, 2, 3])
    pool.release([1, 2, 3])
    pool.collect(busy=True)  # above the reserve: 3 pages to give back
    assert set(pool.draining) == {1, 2, 3} and pool.mapped == {0} and space.deferred_unmaps == 1
    assert "unmap" not in space.calls and all(r.mapped == {0, 1, 2, 3} for r in ranks), "nothing waited for"
    assert pool.lowest_unmapped(2, skip_pending=True) == pool.lowest_unmapped(2) == [4, 5], "never offered"
    counters = pool.counters()
    assert counters.mapped_pages == 4 and counters.unmaps == 0 and counters.blocking_unmaps == 0
    pool.acquire([2])  # wanted again while it drains: its unmap is waited for, then it is mapped
    assert not pool.draining and all(r.mapped == {0, 2} for r in ranks)
    assert pool.counters().blocking_unmaps == 3 and pool.counters().unmaps == 3
    pool.release([2])
    pool.collect(busy=False)  # idle: the unmap is sent, and not waited for either
    assert set(pool.draining) == {2} and all(r.mapped == {0, 2} for r in ranks)
    assert pool.counters().blocking_unmaps == 3 and pool.counters().mapped_pages == 2
    pool.settle(wait=True)  # a snapshot's wait (kvcached.stats()): settled, and not on the scheduler's path
    assert not pool.draining and all(r.mapped == {0} for r in ranks)
    assert pool.counters().blocking_unmaps == 3 and pool.counters().mapped_pages == 1
    pool.close()
    assert all(not r.mapped for r in ranks)


def test_a_busy_step_gives_back_one_batch_and_the_next_steps_the_rest() -> None:
    """A busy engine whose hold window forgot its peak gives its excess back one batch of
    `UNMAP_BATCH_PAGES` a step (12-05: 462 pages in one step of 266 ms); idle, all at once
    (sent, in batches, and waited for by nobody: the ranks apply them in order)."""
    from kvcached.pages import UNMAP_BATCH_PAGES as BATCH

    geometry = plan_geometry(STRIDES, 4 * (2 * BATCH + 8), PAGE)  # 2 batches and some, in kv pages
    ranks = []
    for i in range(2):
        ranges = tuple(_vmm.VirtualRange("cpu", size, PAGE) for size in geometry.reserved_bytes)
        ranks.append(RankPages(i, PageSpace(ranges, geometry.vmm_pages, geometry.num_kv_pages), geometry))
    space = RankedPageSpace(geometry, LaterChannel(ranks), 2)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0),
                    fence=StepFence())
    pages = list(range(2 * BATCH + 4))
    pool.acquire(pages)
    pool.release(pages)
    pool.collect(busy=True)
    assert len(pool.draining) == BATCH and len(pool.reserve) == BATCH + 4
    pool.collect(busy=True)
    assert len(pool.draining) == 2 * BATCH and len(pool.reserve) == 4
    pool.collect(busy=False)
    assert len(pool.draining) == len(pages) and not pool.reserve, "every page sent"
    assert all(r.mapped for r in ranks), "and none waited for"
    pool.settle(wait=True)
    assert not pool.draining and all(not r.mapped for r in ranks)
    pool.close()


def test_a_lowered_limit_is_met_on_the_ranks_when_the_pool_sheds() -> None:
    """A busy engine over a lowered limit gives its idle pages back without waiting at the
    step's end; shedding (what the block pool does for a limit) waits for every unmap in
    flight, so the memory is free on the ranks when the limiter hears of it."""
    from test_core_policies import FixedLimiter

    ranks = [_rank(0), _rank(1)]
    geometry, _, _ = check_layouts([r.layout() for r in ranks])
    space = RankedPageSpace(geometry, LaterChannel(ranks), 2)
    limiter = FixedLimiter(None)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=4, capacity_ttl_s=0.0),
                    fence=StepFence(), limiter=limiter)
    pool.acquire([0, 1, 2, 3])
    pool.release([2, 3])
    limiter.limit = 2
    pool.collect(busy=True)  # reads the limit: pages 2 and 3 go, sent without waiting
    assert set(pool.draining) == {2, 3} and all(r.mapped == {0, 1, 2, 3} for r in ranks)
    assert pool.over_limit() == 0
    pool.shed()
    assert not pool.draining and all(r.mapped == {0, 1} for r in ranks)
    assert limiter.told[-1][0] == 2
    pool.close()


def test_an_unmap_failure_on_one_rank_quarantines_the_page_until_the_retry() -> None:
    space, ranks, _ = _engine(None, None)
    backing = FailingRange(ranks[1].space.ranges[0])
    ranks[1].space = PageSpace((backing, *ranks[1].space.ranges[1:]),  # type: ignore[arg-type]
                               ranks[1].space.vmm_pages_per_kv_page, ranks[1].space.num_kv_pages)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=0))
    pool.acquire([0, 1])
    pool.release([1])
    backing.fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
    pool.collect()  # rank 1 refuses the unmap (its first backing): reported, not raised
    assert pool.quarantined == {1} and pool.mapped == {0} and pool.counters().unmap_failures == 1
    assert ranks[0].mapped == {0} and ranks[1].mapped == {0, 1}  # rank 1 still holds page 1
    assert pool.lowest_unmapped(1) == [2], "page 1 is not handed out again while quarantined"
    pool.collect()  # the retry: rank 1 unmaps what its backings still map of page 1
    assert pool.quarantined == set() and ranks[1].mapped == {0}
    pool.acquire([1])
    assert all(r.mapped == {0, 1} for r in ranks)
    pool.close()


# ---- double failures on the rank path (issue 31, item 5) ------------------------------------------
def _failing_engine(ranks: int) -> tuple[RankedPageSpace, list[RankPages], list[list[FailingRange]],
                                         list[LocalBudget]]:
    """``ranks`` ranks whose backings are real CPU ranges behind the backend fault seam, each
    rank charging its own budget (so what a failed undo leaves mapped is seen charged)."""
    geometry = plan_geometry(STRIDES, NUM_BLOCKS, PAGE)
    pages, backings, budgets = [], [], []
    for rank in range(ranks):
        failing = [FailingRange(_vmm.VirtualRange("cpu", size, PAGE)) for size in geometry.reserved_bytes]
        budget = LocalBudget(None)
        space = PageSpace(tuple(failing), geometry.vmm_pages, geometry.num_kv_pages, budget)  # type: ignore[arg-type]
        pages.append(RankPages(rank, space, geometry))
        backings.append(failing)
        budgets.append(budget)
    return RankedPageSpace(geometry, InOrderChannel(pages), ranks), pages, backings, budgets


def _error() -> DriverError:
    return DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999)


def _held(backings: Sequence[Any], geometry_vmm: tuple[int, ...]) -> set[int]:
    """kv pages some backing of one rank maps (any of their VMM pages)."""
    return {v // k for r, k in zip(backings, geometry_vmm, strict=True) for v in r.mapped_pages()}


def _assert_books_match(pool: PagePool, ranks: list[RankPages], backings: Sequence[Sequence[Any]],
                        budgets: list[LocalBudget]) -> None:
    """What every rank's backings hold is the rank's books, the pool's usable mapped set plus
    its quarantine, and exactly what the rank is charged for."""
    vmm = ranks[0].geometry.vmm_pages
    for rank, failing, budget in zip(ranks, backings, budgets, strict=True):
        held = _held(failing, vmm)
        assert held == rank.mapped
        assert pool.mapped <= held <= pool.mapped | pool.quarantined
        assert budget.used == sum(r.num_mapped for r in failing) * PAGE


def _pool(space: RankedPageSpace) -> PagePool:
    return PagePool(space, KvcachedConfig(min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0,
                                          map_retries=0), fence=StepFence())


def test_the_pool_gets_stuck() -> None:
    """(a) At TP=1, a map batch fails on the rank and the rank's own undo fails in another
    backing: page 2 stays mapped (and charged) in backing 0. The rank must report it, the
    pool quarantine it, later batches map other pages, and the retry heal it. (Before: the
    rank's books did not list it, nothing was quarantined, and every later batch began with
    page 2 and was refused "already mapped": the pool never mapped another page.)"""
    space, ranks, backings, budgets = _failing_engine(1)
    pool = _pool(space)
    ledger = BlockLedger(NUM_BLOCKS, space.geometry.blocks_per_page, pool)
    per_page = space.geometry.blocks_per_page
    held = ledger.allocate(2 * per_page)  # pages 0 and 1
    backings[0][1].fail_call("map", 1, _error())  # page 2 fails in backing 1 ...
    backings[0][0].fail_call("unmap", 1, _error())  # ... and the rank's undo in backing 0
    with pytest.raises(DriverError):
        ledger.allocate(per_page)
    assert pool.quarantined == {2} and pool.health is PoolHealth.DEGRADED
    assert _held(backings[0], space.geometry.vmm_pages) == {0, 1, 2} and budgets[0].used > 2 * _kv_page_bytes()
    _assert_books_match(pool, ranks, backings, budgets)
    more = ledger.allocate(per_page)  # the next batch maps another page
    assert {b // per_page for b in more} == {3}
    assert ledger.ensure_backed(2 * per_page) == 2 * per_page, "admissions beyond the pool's size are served"
    pool.collect()  # the retry unmaps what backing 0 still holds of page 2
    assert pool.quarantined == set() and pool.health is PoolHealth.HEALTHY
    _assert_books_match(pool, ranks, backings, budgets)
    ledger.release(held + more)
    ledger.check()
    pool.close()
    assert not ranks[0].mapped and budgets[0].used == 0


def test_the_pool_gets_stuck_on_a_refill_sent_ahead() -> None:
    """(a), for a refill sent without waiting: its confirmation fails the same way, and the
    page the rank's undo left behind is quarantined when the pool settles it (it was
    dropped, and the next refill began with it again)."""
    space, ranks, backings, budgets = _failing_engine(1)
    pool = PagePool(space, KvcachedConfig(min_reserve_pages=1, max_reserve_pages=2, capacity_ttl_s=0.0,
                                          map_retries=0), fence=StepFence())
    backings[0][1].fail_call("map", 2, _error())  # the refill of page 1 fails in backing 1 ...
    backings[0][0].fail_call("unmap", 1, _error())  # ... and its undo in backing 0
    pool.acquire([0])  # page 0 blocking, then the refill of page 1 sent ahead
    pool.settle()
    assert pool.quarantined == {1} and pool.counters().map_failures == 1
    _assert_books_match(pool, ranks, backings, budgets)
    pool.acquire([2])  # the next refill maps another page
    pool.settle()
    assert set(pool.reserve) == {3} and pool.counters().map_failures == 1
    pool.collect()
    assert pool.quarantined == set() and pool.health is PoolHealth.HEALTHY
    _assert_books_match(pool, ranks, backings, budgets)
    pool.close()
    assert not ranks[0].mapped and budgets[0].used == 0


def _double_failure_in_one_process() -> tuple[PagePool, list[FailingRange]]:
    """The control of (b): the same kv pages in this process's ranges, the map failing in
    backing 1 and its undo in backing 0."""
    geometry = plan_geometry(STRIDES, NUM_BLOCKS, PAGE)
    failing = [FailingRange(_vmm.VirtualRange("cpu", size, PAGE)) for size in geometry.reserved_bytes]
    pool = _pool(PageSpace(tuple(failing), geometry.vmm_pages, geometry.num_kv_pages))  # type: ignore[arg-type]
    failing[1].fail_call("map", 1, _error())
    failing[0].fail_call("unmap", 1, _error())
    return pool, failing


def test_invariant_error_into_engine_core() -> None:
    """(b) A map refused on rank 1 whose undo fails on rank 0: the admission check must
    not raise (it raised InvariantError into EngineCore). The pages the undo left on rank 0
    are quarantined and the pool is DEGRADED, as the same double failure in one process is
    (the control), and a retry on rank 0 heals it."""
    space, ranks, backings, budgets = _failing_engine(2)
    control, _ = _double_failure_in_one_process()
    pool = _pool(space)
    per_page = space.geometry.blocks_per_page
    pools = (pool, control)
    ledgers = [BlockLedger(NUM_BLOCKS, per_page, p) for p in pools]
    backings[1][1].fail_call("map", 1, _error())  # rank 1 refuses the batch
    backings[0][0].fail_call("unmap", 1, _error())  # rank 0's undo fails in backing 0
    for p, ledger in zip(pools, ledgers, strict=True):
        ledger.ensure_backed(3 * per_page)  # the admission check: a miss at worst, never an exception
        assert p.counters().map_failures >= 1 and p.quarantined and p.health is PoolHealth.DEGRADED
        assert p.quarantined.isdisjoint(p.mapped) and p.quarantined.isdisjoint(p.lowest_unmapped(4))
    assert pool.quarantined == {0, 1, 2} == ranks[0].mapped and not ranks[1].mapped
    _assert_books_match(pool, ranks, backings, budgets)
    for p, ledger in zip(pools, ledgers, strict=True):
        assert ledger.ensure_backed(3 * per_page) >= 3 * per_page, "the next admission maps other pages"
        p.collect()  # the retry, on the ranks that still hold the pages
        assert p.quarantined == set() and p.health is PoolHealth.HEALTHY
        ledger.check()
    _assert_books_match(pool, ranks, backings, budgets)
    for p in pools:
        p.close()
    assert all(not r.mapped for r in ranks) and all(b.used == 0 for b in budgets)


def test_a_quarantine_that_never_heals() -> None:
    """(c) Page 1 is quarantined on rank 0, page 2 on rank 1; their joint retry succeeds on
    rank 0 and fails on rank 1. Page 1 is free again at once (the space forgot it already:
    keeping it quarantined made every later retry of it "not mapped" on every rank, and the
    pool FAILED with healthy backends); page 2 heals at its own retry."""
    space, ranks, backings, budgets = _failing_engine(2)
    pool = _pool(space)
    pool.acquire([0, 1, 2])
    pool.release([1])
    backings[0][0].fail_call("unmap", 1, _error())
    pool.collect()  # page 1: unmapped on rank 1, refused on rank 0
    assert pool.quarantined == {1}
    pool.release([2])
    backings[0][0].fail_call("unmap", 1, _error())  # page 1's first retry fails again
    backings[1][0].fail_call("unmap", 1, _error())  # page 2: refused on rank 1
    pool.collect()
    assert pool.quarantined == {1, 2}
    backings[1][0].fail_call("unmap", 1, _error())  # the joint retry: fails on rank 1 only
    for _ in range(4):  # the retry is due 2 steps after the failed one
        pool.collect()
        if ranks[0].mapped == {0}:
            break
    assert pool.quarantined == {2}, "page 1 left the quarantine with its successful unmap"
    assert 1 in pool.lowest_unmapped(2)
    _assert_books_match(pool, ranks, backings, budgets)
    for _ in range(64):  # the backends are healthy from now on
        pool.collect()
        if pool.health is PoolHealth.HEALTHY:
            break
    assert pool.health is PoolHealth.HEALTHY and pool.quarantined == set()
    pool.acquire([1, 2])
    _assert_books_match(pool, ranks, backings, budgets)
    pool.close()
    assert all(not r.mapped for r in ranks) and all(b.used == 0 for b in budgets)
