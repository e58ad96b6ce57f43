"""Stateful property tests of the elastic core on the real CPU backend.

`ElasticCoreMachine`: a model of the state (which blocks are held, what byte each held
block carries) is driven with random allocate / free / shrink / step / inject-fault
operations against a real `BlockLedger` + `PagePool` over a memfd-backed `VirtualRange`
with a physical budget.

`RankedFaultsMachine`: the production path (`RankedPageSpace` over `RankPages`, two ranks
of two backings) with failures planned on every backing of every rank (maps, undos,
unmaps, retries) and on a rank, and the backends' recovery (issue 31, item 5).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import DriverError, InjectedFault, PhysicalMemoryExhausted
from kvcached.faults import FailingRange, FaultInjector
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool, PageSpace, PoolHealth
from kvcached.ranks import PageRequest, RankedPageSpace, RankPages, RankReply
from kvcached.space import plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 64 << 10
STRIDE = 16 << 10  # 4 blocks per page
NUM_BLOCKS = 37  # last page is partial on purpose
BUDGET_PAGES = 6


class _SteppedMachine(RuleBasedStateMachine):
    """Engine steps as rules: a step begins on the fence, and one in flight ends (the pool then
    collects what the step released). Subclasses set ``fence``, ``pool`` and ``in_flight``."""

    fence: Any
    pool: Any
    in_flight: int

    @rule()
    def begin_step(self) -> None:
        self.fence.begin_step()
        self.in_flight += 1

    @precondition(lambda self: self.in_flight > 0)
    @rule(busy=st.booleans())
    def end_step(self, busy: bool) -> None:
        self.fence.end_step()
        self.in_flight -= 1
        self.pool.collect(busy=busy)  # busy: the reserve policy may hold pages (hold_steps)


class ElasticCoreMachine(_SteppedMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = KvcachedConfig(page_size=PAGE, min_reserve_pages=1, max_reserve_pages=2,
                                     capacity_ttl_s=0.0, map_retries=0, hold_steps=3)
        geometry = plan_geometry([STRIDE], NUM_BLOCKS, PAGE)
        self.budget = LocalBudget(BUDGET_PAGES * PAGE)
        self.vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
        from kvcached.pages import PageSpace

        self.faults = FaultInjector.from_plans([])
        self.fence = StepFence()
        self.pool = PagePool(PageSpace((self.vrange,), geometry.vmm_pages, geometry.num_kv_pages, self.budget),
                             self.config, fence=self.fence, faults=self.faults)
        self.pool.set_step_pages(4)  # a busy reserve may refill past max_reserve_pages (2)
        self.ledger = BlockLedger(NUM_BLOCKS, geometry.blocks_per_page, self.pool)
        self.held: dict[int, int] = {}  # block -> signature byte
        self.next_sig = 1
        self.in_flight = 0

    def teardown(self) -> None:
        self.pool.close()
        self.vrange.close()

    # ---- helpers -------------------------------------------------------------------
    def _write(self, block: int, sig: int) -> None:
        ctypes.memset(self.vrange.address + block * STRIDE, sig, STRIDE)

    def _read(self, block: int) -> bytes:
        return ctypes.string_at(self.vrange.address + block * STRIDE, STRIDE)

    # ---- rules ---------------------------------------------------------------------
    @rule(n=st.integers(min_value=1, max_value=9))
    def allocate(self, n: int) -> None:
        if n > self.ledger.num_free:
            return
        before = (set(self.pool.mapped), self.ledger.num_held, self.budget.used)
        best = self.ledger.choose(n)
        try:
            blocks = self.ledger.allocate(n)
        except (PhysicalMemoryExhausted, InjectedFault):
            # Rollback: nothing held, nothing new mapped, no budget leaked.
            assert (set(self.pool.mapped), self.ledger.num_held, self.budget.used) == before
            return
        assert blocks == best, "allocate holds exactly the blocks choose names (its fast paths included)"
        assert len(set(blocks)) == n
        assert not set(blocks) & set(self.held), "a block was handed out twice"
        for b in blocks:
            sig = self.next_sig % 250 + 1
            self.next_sig += 1
            self._write(b, sig)
            self.held[b] = sig

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        for b in victims:
            assert self._read(b) == bytes([self.held[b]]) * STRIDE, f"block {b} lost its bytes"
            del self.held[b]
        self.ledger.release(victims)

    @rule()
    def shrink(self) -> None:
        self.pool.trim()
        # Only pages whose ticket has not passed may stay idle-mapped after a trim.
        for page, ticket in self.pool.reserve.items():
            assert not self.fence.passed(ticket), f"page {page} survived trim with a passed ticket"

    @rule(skip=st.integers(min_value=0, max_value=2), fail=st.integers(min_value=1, max_value=2))
    def inject_fault(self, skip: int, fail: int) -> None:
        self.faults.add_plan({"site": "map", "skip": skip, "fail_next": fail})

    @rule(n=st.integers(min_value=1, max_value=12))
    def ensure_backed(self, n: int) -> None:
        got = self.ledger.ensure_backed(n)
        assert got == self.ledger.backed_free_count()

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def accounting(self) -> None:
        assert self.ledger.num_free + self.ledger.num_held == NUM_BLOCKS
        assert self.ledger.num_held == len(self.held)
        self.ledger.check()

    @invariant()
    def mapping_follows_blocks(self) -> None:
        live_pages = {self.ledger.page_of(b) for b in self.held}
        assert self.pool.in_use == live_pages
        assert self.pool.mapped == live_pages | set(self.pool.reserve)
        assert not live_pages & set(self.pool.reserve)
        assert sorted(self.vrange.mapped_pages()) == sorted(self.pool.mapped)

    @invariant()
    def choice_is_page_aware(self) -> None:
        """The incremental order equals the definition: mapped pages with a free block,
        most held first (lowest index on ties), then unmapped pages ascending."""
        bpp = self.ledger.blocks_per_page
        held = [0] * self.ledger.num_pages
        for b in self.held:
            held[b // bpp] += 1
        size = [min(bpp, NUM_BLOCKS - p * bpp) for p in range(self.ledger.num_pages)]
        mapped = self.pool.mapped
        open_ = sorted((p for p in mapped if held[p] < size[p]), key=lambda p: (-held[p], p))
        unmapped = [p for p in range(self.ledger.num_pages) if p not in mapped]
        assert self.ledger.page_order() == open_ + unmapped
        assert self.pool.lowest_unmapped(3) == unmapped[:3]
        assert self.ledger.backed_free_count() == sum(size[p] - held[p] for p in mapped)

    @invariant()
    def within_budget(self) -> None:
        assert self.budget.used == self.vrange.num_mapped * PAGE
        assert self.budget.used <= BUDGET_PAGES * PAGE


TestElasticCore = ElasticCoreMachine.TestCase
TestElasticCore.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- double failures on every backing and every rank (issue 31, item 5) ---------------------------
R_PAGE = 4096
R_STRIDES = (1024, 2048)  # two backings: 4 blocks per kv page, 1 and 2 VMM pages of it
R_BLOCKS = 37  # 10 kv pages, the last partial
R_RANKS = 2
R_BUDGET_PAGES = 7  # rank 1's budget, in kv pages: exhaustion is real there


class _InOrder:
    """Every request to every rank, one after the other (what collective_rpc guarantees);
    a map sent ahead is delivered at once and its replies wait for ``result()``."""

    def __init__(self, ranks: list[RankPages]) -> None:
        self.ranks = ranks

    def call(self, request: PageRequest) -> list[RankReply]:
        replies = [r.handle(request) for r in self.ranks]
        # A rank refuses a misuse (a page mapped twice, one unmapped that it does not map)
        # as an InvariantError: the scheduler's books and the rank's disagree. Never expected.
        misuse = [r.message for r in replies if not r.ok and r.message.startswith("InvariantError")]
        assert not misuse, f"{request.op} {request.pages}: {misuse}"
        return replies

    def call_later(self, request: PageRequest) -> object:
        replies = self.call(request)
        return type("Done", (), {"result": lambda self: replies, "done": lambda self: True})()


class RankedFaultsMachine(_SteppedMachine):
    """A ledger and pool over `RankedPageSpace` on two ranks of two real CPU backings each,
    every backing behind the backend fault seam. Rules plan failing maps and unmaps on any
    backing of any rank (so undos, unmaps and retries fail too, and retries partly succeed),
    refusals on a rank, and the backends' recovery; invariants after every step hold the
    books of every rank to what its backings map."""

    def __init__(self) -> None:
        super().__init__()
        geometry = plan_geometry(R_STRIDES, R_BLOCKS, R_PAGE)
        self.geometry = geometry
        self.kv_bytes = sum(geometry.vmm_pages) * R_PAGE
        self.backings: list[list[Any]] = []  # FailingRange: delegates the rest to the real range
        self.budgets: list[LocalBudget] = []
        self.ranks: list[RankPages] = []
        self.injectors: list[FaultInjector] = []
        for rank in range(R_RANKS):
            failing = [FailingRange(_vmm.VirtualRange("cpu", size, R_PAGE)) for size in geometry.reserved_bytes]
            budget = LocalBudget(R_BUDGET_PAGES * self.kv_bytes if rank == 1 else None)
            space = PageSpace(tuple(failing), geometry.vmm_pages, geometry.num_kv_pages, budget)  # type: ignore[arg-type]
            self.injectors.append(FaultInjector.from_plans([]))
            self.ranks.append(RankPages(rank, space, geometry, faults=self.injectors[rank]))
            self.backings.append(failing)
            self.budgets.append(budget)
        self.space = RankedPageSpace(geometry, _InOrder(self.ranks), R_RANKS, capacity_ttl_s=0.0)
        config = KvcachedConfig(page_size=R_PAGE, min_reserve_pages=1, max_reserve_pages=2, capacity_ttl_s=0.0,
                                map_retries=1, retry_backoff_s=0.0, hold_steps=3)
        self.fence = StepFence()
        self.pool = PagePool(self.space, config, fence=self.fence)
        self.pool.set_step_pages(3)  # a busy reserve may refill past max_reserve_pages (2)
        self.ledger = BlockLedger(R_BLOCKS, geometry.blocks_per_page, self.pool)
        self.held: set[int] = set()
        self.in_flight = 0

    def teardown(self) -> None:
        self._recover()
        self.pool.close()
        assert all(not r.mapped for r in self.ranks) and all(b.used == 0 for b in self.budgets)
        for failing in self.backings:
            for backing in failing:
                backing.inner.close()

    # ---- helpers -------------------------------------------------------------------
    def _recover(self) -> None:
        for failing in self.backings:
            for backing in failing:
                backing.recover()
        for rank in self.ranks:
            self.injectors[rank.rank] = rank.faults = FaultInjector.from_plans([])

    def _typed(self, action: Callable[[], object]) -> bool:
        """Run ``action``: a failure must be a scheduling miss or a documented driver error,
        with nothing held or taken. Returns whether it succeeded."""
        before = (self.ledger.num_held, set(self.pool.in_use))
        try:
            action()
        except (PhysicalMemoryExhausted, DriverError):
            assert (self.ledger.num_held, set(self.pool.in_use)) == before, "a failed call changed the books"
            return False
        return True

    def _held_by(self, rank: int) -> set[int]:
        """kv pages some backing of ``rank`` maps (any of their VMM pages)."""
        return {v // k for r, k in zip(self.backings[rank], self.geometry.vmm_pages, strict=True)
                for v in r.mapped_pages()}

    # ---- rules ---------------------------------------------------------------------
    @rule(n=st.integers(min_value=1, max_value=9), wait=st.booleans())
    def allocate(self, n: int, wait: bool) -> None:
        if n > self.ledger.num_free:
            return
        blocks: list[int] = []
        if self._typed(lambda: blocks.extend(self.ledger.allocate(n, wait=wait))):
            assert len(blocks) == n and not self.held & set(blocks), "a block was handed out twice"
            self.held.update(blocks)

    @rule(data=st.data())
    def hold_one(self, data: st.DataObject) -> None:
        """vLLM's touch of a free block: any one, a quarantined page's included."""
        free = [b for b in range(R_BLOCKS) if b not in self.held]
        if free:
            block = data.draw(st.sampled_from(free))
            quarantined = block // self.geometry.blocks_per_page in self.pool.quarantined
            if self._typed(lambda: self.ledger.hold([block])):
                assert not quarantined, "a block of a quarantined page was handed out"
                self.held.add(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        self.ledger.release(victims)
        self.held.difference_update(victims)

    @rule(n=st.integers(min_value=1, max_value=16))
    def admission_check(self, n: int) -> None:
        """`ensure_backed` is the admission check: never an exception, whatever fails."""
        assert self.ledger.ensure_backed(min(n, self.ledger.num_free)) == self.ledger.backed_free_count()

    @rule(busy=st.booleans())
    def step(self, busy: bool) -> None:
        """A step that ran and ended: the reserve is trimmed (held while busy), the quarantine
        retried if due."""
        self.fence.begin_step()
        self.fence.end_step()
        self.pool.collect(busy=busy)

    @rule()
    def trim(self) -> None:
        self.pool.trim()

    @rule(rank=st.integers(0, R_RANKS - 1), backing=st.integers(0, 1), op=st.sampled_from(["map", "unmap"]),
          nth=st.integers(1, 3), exhausted=st.booleans())
    def backend_fails(self, rank: int, backing: int, op: str, nth: int, exhausted: bool) -> None:
        error = PhysicalMemoryExhausted("out of memory") if exhausted else \
            DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999)
        self.backings[rank][backing].fail_call(op, nth, error)

    @rule(rank=st.integers(0, R_RANKS - 1), backing=st.integers(0, 1), times=st.integers(1, 6))
    def backend_keeps_refusing_unmaps(self, rank: int, backing: int, times: int) -> None:
        """The next ``times`` unmaps of one backing fail (first tries, undos and retries)."""
        for nth in range(1, times + 1):
            self.backings[rank][backing].fail_call("unmap", nth, DriverError("CUDA_ERROR_UNKNOWN",
                                                                             "CUDA_ERROR_UNKNOWN", 999))

    @precondition(lambda self: self.pool.quarantined)
    @rule()
    def next_retry(self) -> None:
        """Steps pass until the quarantine's backoff allows its next retry, which runs."""
        quarantine = self.pool.policies.quarantine
        while not quarantine.due():
            quarantine.end_step()
        self.pool.collect()

    @rule(rank=st.integers(0, R_RANKS - 1))
    def rank_refuses(self, rank: int) -> None:
        self.injectors[rank].add_plan({"site": f"rank{rank}_map", "fail_next": 1})

    @rule()
    def backends_recover(self) -> None:
        """Once the backends behave, the next due retry empties the quarantine: HEALTHY."""
        self._recover()
        quarantine = self.pool.policies.quarantine
        while quarantine.pages and not quarantine.due():
            quarantine.end_step()  # steps pass until the backoff allows the retry
        self.pool.collect()
        assert self.pool.quarantined == set() and self.pool.health is PoolHealth.HEALTHY

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def backings_hold_the_books(self) -> None:
        """On every rank: what its backings map is its books, and what it is charged for."""
        pending = set(self.pool.pending)
        assert not pending & set(self.pool.draining)
        for rank in range(R_RANKS):
            held = self._held_by(rank)
            assert held == self.ranks[rank].mapped
            in_flight = pending | set(self.pool.draining)  # sent, perhaps not applied yet
            assert self.pool.mapped <= held <= self.pool.mapped | self.pool.quarantined | in_flight
            for r, k in zip(self.backings[rank], self.geometry.vmm_pages, strict=True):
                assert all(r.is_mapped(p * k + i) for p in self.pool.mapped for i in range(k))
            assert self.budgets[rank].used == sum(r.num_mapped for r in self.backings[rank]) * R_PAGE

    @invariant()
    def free_pages_are_free(self) -> None:
        """No page is both free and mapped: what the pool would map next no rank maps."""
        free = self.pool.lowest_unmapped(self.geometry.num_kv_pages, skip_pending=True)
        assert not set(free) & (self.pool.mapped | self.pool.quarantined)
        for rank in range(R_RANKS):
            assert not set(free) & self._held_by(rank)

    @invariant()
    def quarantine_is_known_and_unused(self) -> None:
        """The space names exactly the quarantined pages as held somewhere; none holds a
        block, none counts among the usable free blocks; health follows the quarantine."""
        quarantined = self.pool.quarantined
        assert self.space.still_mapped(range(self.geometry.num_kv_pages)) == sorted(quarantined)
        assert not quarantined & self.pool.mapped and not quarantined & self.pool.in_use
        assert not {b // self.geometry.blocks_per_page for b in self.held} & quarantined
        on_quarantined = sum(1 for b in range(R_BLOCKS) if b // self.geometry.blocks_per_page in quarantined)
        assert self.ledger.usable_free == self.ledger.num_free - on_quarantined
        assert (self.pool.health is PoolHealth.HEALTHY) == (not quarantined)
        self.ledger.check()
        assert self.ledger.num_held == len(self.held)


TestRankedFaults = RankedFaultsMachine.TestCase
TestRankedFaults.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _Later:
    """The replies of a request sent without waiting, once `_Deferred` delivered it."""

    def __init__(self, channel: _Deferred, request: PageRequest) -> None:
        self.channel, self.request = channel, request
        self.replies: list[RankReply] | None = None

    def done(self) -> bool:
        return self.replies is not None

    def result(self) -> list[RankReply]:
        while self.replies is None:  # what was sent before it is delivered first
            self.channel.deliver(1)
        return self.replies


class _Deferred(_InOrder):
    """An in-process engine's channel with its background thread: a request that waits runs
    at once, on the caller's path; one sent without waiting is applied later, in the order
    sent, and possibly after requests that waited (the thread and the caller do not keep
    order between them)."""

    def __init__(self, ranks: list[RankPages]) -> None:
        super().__init__(ranks)
        self.queue: list[_Later] = []

    def call_later(self, request: PageRequest) -> object:
        later = _Later(self, request)
        self.queue.append(later)
        return later

    def deliver(self, n: int) -> None:
        for later in self.queue[:n]:
            later.replies = self.call(later.request)
        del self.queue[:n]


class RankedDeferredMachine(RankedFaultsMachine):
    """`RankedFaultsMachine` with refills and unmaps sent without waiting and applied by a
    background thread at any later point (`_Deferred`): pages being unmapped are never
    handed out or mapped before their unmap is settled, whatever fails, and a page wanted
    again while it drains is waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.space.channel = _Deferred(self.ranks)

    @rule(n=st.integers(min_value=1, max_value=4))
    def background_runs(self, n: int) -> None:
        """The background thread applies the ``n`` oldest requests sent without waiting."""
        channel = self.space.channel
        assert isinstance(channel, _Deferred)
        channel.deliver(n)

    @rule()
    def a_busy_step_gives_pages_back_without_waiting(self) -> None:
        """A busy step's end sends its unmaps and applies none of them."""
        channel = self.space.channel
        assert isinstance(channel, _Deferred)
        queued, waited = len(channel.queue), self.pool.counters().blocking_unmaps
        self.fence.begin_step()
        self.fence.end_step()
        self.pool.collect(busy=True)
        assert self.pool.counters().blocking_unmaps == waited
        assert len(channel.queue) >= queued, "the step's end applied requests sent without waiting"

    @rule()
    def an_idle_step_waits_for_no_unmap(self) -> None:
        """An idle engine's step end sends its unmaps and applies none of them either (its
        outputs are the burst's last tokens); a snapshot of the books then settles them all."""
        channel = self.space.channel
        assert isinstance(channel, _Deferred)
        queued, waited = len(channel.queue), self.pool.counters().blocking_unmaps
        self.fence.begin_step()
        self.fence.end_step()
        self.pool.collect(busy=False)
        assert self.pool.counters().blocking_unmaps == waited
        assert len(channel.queue) >= queued, "the idle step's end applied requests sent without waiting"
        self.ledger.pool_stats()
        assert not self.pool.draining and not self.pool.pending, "a snapshot leaves nothing in flight"
        assert self.pool.counters().blocking_unmaps == waited, "a snapshot's wait is not the scheduler's"


TestRankedDeferred = RankedDeferredMachine.TestCase
TestRankedDeferred.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_an_allocation_waits_for_the_unmaps_in_flight_it_needs() -> None:
    """Hypothesis's find (12-07), kept as a fixed case: maps failed on one rank while a busy
    step's unmaps were in flight, so the free blocks an allocation needed sat on draining
    pages, which the page choice is never offered; `allocate` raised `InvariantError`. It now
    waits for those unmaps (`PagePool.drain`) and allocates."""
    machine = RankedDeferredMachine()

    def check() -> None:
        machine.backings_hold_the_books()
        machine.free_pages_are_free()
        machine.quarantine_is_known_and_unused()

    steps = [lambda: machine.admission_check(n=5), machine.a_busy_step_gives_pages_back_without_waiting,
             lambda: machine.allocate(n=8, wait=False), *[machine.a_busy_step_gives_pages_back_without_waiting] * 3,
             lambda: machine.backend_keeps_refusing_unmaps(backing=0, rank=1, times=4),
             lambda: machine.backend_fails(backing=0, exhausted=False, nth=1, op="map", rank=0),
             lambda: machine.backend_fails(backing=0, exhausted=False, nth=2, op="map", rank=0),
             lambda: machine.admission_check(n=1), lambda: machine.admission_check(n=5),
             machine.a_busy_step_gives_pages_back_without_waiting,
             lambda: machine.allocate(n=5, wait=False), lambda: machine.allocate(n=5, wait=False)]
    try:
        for step in steps:
            step()
            check()
        assert len(machine.held) >= 8 + 5, "the allocations after the failed maps got their blocks"
    finally:
        machine.teardown()
