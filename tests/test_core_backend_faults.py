"""Every backend call that fails leaves the pool, the ledger and every backing consistent.

Real CPU ranges behind the backend fault seam (`kvcached.faults.FailingRange`): one call of
one backing fails, everything else is the real path. Two backings per kv page, as a model
with K and V in separate tensors has (three where a failure needs a backing on each side).
A batch of kv pages is one map call per backing (`PageSpace.map_pages`), so the nth map
call of a backing is its nth batch, not its nth page.
"""

from __future__ import annotations

import pytest

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import DriverError, InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FailingRange
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import FAILED_AFTER, PagePool, PageSpace, PoolHealth

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
PAGES = 8


def pool_over(backings: int = 2) -> tuple[PagePool, list[FailingRange], LocalBudget]:
    ranges = [FailingRange(_vmm.VirtualRange("cpu", PAGES * PAGE, PAGE)) for _ in range(backings)]
    budget = LocalBudget(None)
    space = PageSpace(tuple(ranges), (1,) * backings, PAGES, budget)  # type: ignore[arg-type]
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0,
                            map_retries=0)
    return PagePool(space, config, fence=StepFence()), ranges, budget


def consistent(pool: PagePool, ranges: list[FailingRange], budget: LocalBudget) -> None:
    """Every backing maps exactly the pool's mapped pages, and the charge is what they hold."""
    for r in ranges:
        assert set(r.mapped_pages()) == pool.mapped - pool.quarantined
    assert budget.used == sum(r.num_mapped for r in ranges) * PAGE


@pytest.mark.parametrize("error", [DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999),
                                   PhysicalMemoryExhausted("out of memory")])
def test_a_failure_in_the_middle_of_a_multi_page_map_maps_nothing(error: Exception) -> None:
    pool, ranges, budget = pool_over(backings=3)
    ranges[1].fail_call("map", 1, error)  # the batch fails in the middle backing, after the first mapped it
    with pytest.raises(type(error)):
        pool.acquire([1, 2, 3])
    assert [r.calls["map"] for r in ranges] == [1, 1, 0] and ranges[0].calls["unmap"] == 1
    assert pool.mapped == set() and pool.in_use == set()
    consistent(pool, ranges, budget)
    pool.acquire([1, 2, 3])  # the same pages map afterwards: nothing was left behind
    consistent(pool, ranges, budget)


# ---- PageSpace.map_pages alone: one map call per backing for the whole batch ----------------
KS = (2, 1, 2)  # VMM pages per kv page of each backing: the middle one differs


def space_over() -> tuple[PageSpace, list[FailingRange], LocalBudget]:
    ranges = [FailingRange(_vmm.VirtualRange("cpu", PAGES * k * PAGE, PAGE)) for k in KS]
    budget = LocalBudget(None)
    return PageSpace(tuple(ranges), KS, PAGES, budget), ranges, budget  # type: ignore[arg-type]


def vmm(kv_pages: list[int], k: int) -> list[int]:
    return [v for p in kv_pages for v in range(p * k, (p + 1) * k)]


@pytest.mark.parametrize("error", [DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999),
                                   PhysicalMemoryExhausted("out of memory"), KeyboardInterrupt()])
def test_a_batch_that_fails_in_its_middle_backing_leaves_nothing_mapped_anywhere(error: BaseException) -> None:
    space, ranges, budget = space_over()
    batch = [5, 1, 6]
    ranges[1].fail_call("map", 1, error)
    with pytest.raises(type(error)):
        space.map_pages(batch)
    assert [r.calls["map"] for r in ranges] == [1, 1, 0], "one call per backing for the whole batch"
    assert [r.mapped_pages() for r in ranges] == [[], [], []] and space.still_mapped(batch) == []
    assert budget.used == 0 == space.mapped_bytes(), "the charge is refunded whole"
    space.map_pages(batch)  # the real path: the same batch maps, one call per backing
    assert [r.calls["map"] for r in ranges] == [2, 2, 1]
    assert [r.mapped_pages() for r in ranges] == [sorted(vmm(batch, k)) for k in KS]
    assert budget.used == space.mapped_bytes() == len(batch) * sum(KS) * PAGE
    space.unmap_pages(batch)
    assert [r.num_mapped for r in ranges] == [0, 0, 0] and budget.used == 0


def test_a_failed_undo_is_raised_chained_to_the_map_failure_and_the_charge_follows_the_ranges() -> None:
    space, ranges, budget = space_over()
    batch = [2, 3]
    first = DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999)
    ranges[1].fail_call("map", 1, first)  # the batch, in the middle backing
    ranges[0].fail_call("unmap", 1, PhysicalMemoryExhausted("out of memory"))  # the undo, in the first
    with pytest.raises(PhysicalMemoryExhausted) as raised:
        space.map_pages(batch)
    assert raised.value.__context__ is first
    assert [r.mapped_pages() for r in ranges] == [vmm(batch, KS[0]), [], []]
    assert space.still_mapped(batch) == batch
    assert budget.used == space.mapped_bytes() == len(batch) * KS[0] * PAGE, "what is left stays charged"
    space.unmap_pages(batch, strict=False)  # the retry
    assert [r.num_mapped for r in ranges] == [0, 0, 0] and budget.used == 0
    space.map_pages(batch)  # the real path
    assert [r.mapped_pages() for r in ranges] == [vmm(batch, k) for k in KS]
    assert budget.used == space.mapped_bytes()


def test_a_batch_a_backing_refuses_unmaps_only_what_this_call_mapped() -> None:
    """The middle backing already maps a page of the batch (left over, uncharged): its real
    map refuses the whole list before mapping anything (InvariantError). The undo unmaps the
    batch in the first backing, and leaves the middle backing's page alone: not this call's."""
    space, ranges, budget = space_over()
    ranges[1].inner.map([4])
    with pytest.raises(InvariantError, match="already mapped"):
        space.map_pages([1, 4])
    assert [r.mapped_pages() for r in ranges] == [[], [4], []] and budget.used == 0
    assert [r.calls["map"] for r in ranges] == [1, 1, 0] and ranges[0].calls["unmap"] == 1


def test_an_unmap_failure_in_one_backing_quarantines_the_page_until_a_retry_succeeds() -> None:
    pool, ranges, budget = pool_over()
    pool.acquire([1, 2])
    pool.release([1, 2])
    ranges[1].fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
    pool.collect()  # the unmap of pages 1 and 2 fails in backing 1 only: reported, not raised
    assert pool.quarantined == {1, 2} and not pool.reserve
    assert ranges[0].mapped_pages() == [] and ranges[1].mapped_pages() == [1, 2]
    assert budget.used == 2 * PAGE, "what is still mapped stays charged"
    assert pool.lowest_unmapped(2) == [0, 3], "a quarantined page is never handed out"
    assert pool.counters().unmap_failures == 1
    pool.collect()  # the retry unmaps what is left, in the backing that still maps it
    assert pool.quarantined == set() and ranges[1].mapped_pages() == [] and budget.used == 0
    pool.acquire([1, 2])
    consistent(pool, ranges, budget)


def test_the_ledger_never_chooses_a_block_on_a_quarantined_page() -> None:
    pool, ranges, _ = pool_over()
    ledger = BlockLedger(PAGES * 4, 4, pool, pinned=[0])
    blocks = ledger.allocate(7)  # pages 0 and 1 (0 holds the pinned block)
    ledger.release(blocks)
    ranges[0].fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
    pool.collect()
    assert pool.quarantined == {1}
    assert {b // 4 for b in ledger.allocate(6)} == {0, 2}, "page 1 is skipped while quarantined"
    ledger.check()


def test_a_driver_error_while_mapping_ahead_is_a_shortfall_not_an_exception() -> None:
    pool, ranges, budget = pool_over()
    for nth in (1, 3):  # the batch, then page 2 alone (page 1 alone was call 2)
        ranges[0].fail_call("map", nth, DriverError("CUDA_ERROR_ILLEGAL_STATE", "CUDA_ERROR_ILLEGAL_STATE", 401))
    assert pool.prefetch([1, 2, 3]) == 1  # the batch fails, then page 1 alone maps, page 2 fails again
    assert pool.counters().map_failures == 2
    consistent(pool, ranges, budget)


def test_a_map_whose_undo_fails_too_quarantines_what_is_left_mapped() -> None:
    """The undo of a failed batch fails in another backing: the page it left mapped there
    must never look free (it would be mapped again: 'page is already mapped' forever after)."""
    pool, ranges, budget = pool_over()
    ranges[1].fail_call("map", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))  # the batch
    ranges[0].fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))  # its undo
    with pytest.raises(DriverError):
        pool.acquire([1, 2])
    assert pool.quarantined == {1, 2} and ranges[0].mapped_pages() == [1, 2] and ranges[1].mapped_pages() == []
    assert budget.used == 2 * PAGE and pool.lowest_unmapped(2) == [0, 3]
    pool.collect()  # the retry
    assert pool.quarantined == set()
    pool.acquire([1, 2])  # mapped again, no 'already mapped'
    consistent(pool, ranges, budget)


def test_a_quarantine_that_keeps_failing_backs_off_marks_the_pool_failed_and_recovers() -> None:
    """Retries back off (2, 4, 8, ... steps); `FAILED_AFTER` failures in a row make the pool
    FAILED; a retry that succeeds makes it HEALTHY again. Control: a pool whose unmaps work
    stays HEALTHY through the same steps."""
    pool, ranges, budget = pool_over()
    control, _, _ = pool_over()
    for p in (pool, control):
        assert p.health is PoolHealth.HEALTHY
        p.acquire([1])
        p.release([1])
    error = DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999)
    for nth in range(1, FAILED_AFTER + 2):  # the first unmap and FAILED_AFTER retries fail
        ranges[1].fail_call("unmap", nth, error)
    pool.collect()
    control.collect()
    assert pool.health is PoolHealth.DEGRADED and pool.quarantined == {1}
    before, steps = ranges[1].calls["unmap"], 0
    while pool.health is not PoolHealth.FAILED:
        pool.collect()
        control.collect()
        steps += 1
        assert steps < 100, "never marked FAILED"
    assert ranges[1].calls["unmap"] - before == FAILED_AFTER, "one failing call per retry"
    assert steps == 1 + 2 + 4 + 8 + 16, "retries back off: 2**k steps after the k-th failure"
    assert pool.counters().health is PoolHealth.FAILED and control.health is PoolHealth.HEALTHY
    assert budget.used == PAGE, "the stuck page stays charged"
    for _ in range(2 ** FAILED_AFTER):  # the backend recovers; the next retry is 32 steps later
        pool.collect()
    assert pool.health is PoolHealth.HEALTHY and pool.quarantined == set() and budget.used == 0
    pool.acquire([1])
    consistent(pool, ranges, budget)


def test_a_map_whose_undo_fails_is_not_retried_as_exhaustion() -> None:
    """A waiting map runs out of memory in backing 1 and its undo fails in backing 0 (with
    exhaustion too): the pages left there are quarantined and the error is a DriverError,
    not retried: the retry would map the same batch onto its own leftovers ('already
    mapped', an InvariantError into the caller)."""
    pool, ranges, budget = pool_over()
    pool = PagePool(pool.space, KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0,
                                               capacity_ttl_s=0.0, map_retries=2, retry_backoff_s=0.0),
                    fence=StepFence())
    ranges[1].fail_call("map", 1, PhysicalMemoryExhausted("out of memory"))  # the batch
    ranges[0].fail_call("unmap", 1, PhysicalMemoryExhausted("out of memory"))  # its undo
    with pytest.raises(DriverError, match="quarantined"):
        pool.acquire([1, 2], wait=True)
    assert pool.quarantined == {1, 2} and pool.in_use == set() and ranges[0].calls["map"] == 1
    pool.collect()
    pool.acquire([1, 2], wait=True)
    consistent(pool, ranges, budget)


def test_quarantined_blocks_still_counted_as_free() -> None:
    """(d) Every page but a quarantined one is in use: the quarantined page's blocks are
    free in the ledger's count but cannot be handed out. An allocation the count allows
    must be a scheduling miss (`PhysicalMemoryExhausted`, nothing changed), not the
    InvariantError of a choice that finds too few blocks; holding a block of that page
    (vLLM's touch of a CLEAN block) is refused the same way."""
    pool, ranges, budget = pool_over()
    ledger = BlockLedger(PAGES * 4, 4, pool)
    blocks = ledger.allocate(PAGES * 4)
    on_page_1 = [b for b in blocks if b // 4 == 1]
    ledger.release(on_page_1)
    ranges[1].fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
    pool.collect()
    assert pool.quarantined == {1} and ledger.num_free == 4 and ledger.backed_free_count() == 0
    before = (ledger.num_held, set(pool.mapped), budget.used)
    with pytest.raises(PhysicalMemoryExhausted, match="quarantined"):
        ledger.allocate(1)
    with pytest.raises(PhysicalMemoryExhausted, match="quarantined"):
        ledger.hold([on_page_1[0]])
    assert (ledger.num_held, set(pool.mapped), budget.used) == before
    assert ledger.usable_free == 0, "blocks on a quarantined page are not usable"
    ledger.check()
    pool.collect()  # the retry frees the page: its blocks are usable again
    assert ledger.usable_free == 4 and len(ledger.allocate(4)) == 4
    consistent(pool, ranges, budget)
