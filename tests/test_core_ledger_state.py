"""Stateful property test of the elastic core on the real CPU backend.

A model of the state (which blocks are held, what byte each held block carries) is driven
with random allocate / free / shrink / step / inject-fault operations against a real
`BlockLedger` + `PagePool` over a memfd-backed `VirtualRange` with a physical budget.
"""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import InjectedFault, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool
from kvcached.space import plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 64 << 10
STRIDE = 16 << 10  # 4 blocks per page
NUM_BLOCKS = 37  # last page is partial on purpose
BUDGET_PAGES = 6


class ElasticCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = KvcachedConfig(page_size=PAGE, min_reserve_pages=1, max_reserve_pages=2,
                                     capacity_ttl_s=0.0, map_retries=0)
        geometry = plan_geometry([STRIDE], NUM_BLOCKS, PAGE)
        self.budget = LocalBudget(BUDGET_PAGES * PAGE)
        self.vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
        from kvcached.pages import PageSpace

        self.faults = FaultInjector.from_plans([])
        self.fence = StepFence()
        self.pool = PagePool(PageSpace((self.vrange,), geometry.vmm_pages, geometry.num_kv_pages, self.budget),
                             self.config, fence=self.fence, faults=self.faults)
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
    def begin_step(self) -> None:
        self.fence.begin_step()
        self.in_flight += 1

    @precondition(lambda self: self.in_flight > 0)
    @rule()
    def end_step(self) -> None:
        self.fence.end_step()
        self.in_flight -= 1
        self.pool.collect()

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
