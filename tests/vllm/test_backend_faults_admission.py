"""A backend failure other than out-of-memory during admission is a scheduling miss in
vLLM's pool, never an exception into EngineCore, and the pool stays consistent."""

from __future__ import annotations

import pytest

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import DriverError, PhysicalMemoryExhausted
from kvcached.faults import FailingRange
from kvcached.fence import StepFence
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096


def test_a_driver_error_in_an_admission_map_is_a_scheduling_miss() -> None:
    geometry = plan_geometry([1024, 1024], 32, PAGE)  # two backings, 4 blocks per kv page
    ranges = [FailingRange(_vmm.VirtualRange("cpu", size, PAGE)) for size in geometry.reserved_bytes]
    budget = LocalBudget(None)
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0,
                            map_retries=0, max_cached_blocks=-1)
    pool = ElasticBlockPool(32, True, 16, kv_space=KvSpace(geometry, tuple(ranges), charger=budget),  # type: ignore[arg-type]
                            config=config, fence=StepFence(), name="faults")
    try:
        ranges[1].fail_call("map", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
        ranges[1].fail_call("map", 2, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
        with pool.admission(watermark=0, reserved=0, site="admission", new=True):
            pool.note_demand(8)
            assert pool.get_num_free_blocks() < 8  # a miss: vLLM's allocate_slots returns None
        assert pool.ledger.pool_stats().admission_misses == 1
        pool.check()
        assert all(r.mapped_pages() == [0] for r in ranges) and budget.used == 2 * PAGE
        with pool.admission(watermark=0, reserved=0, site="admission", new=True):
            pool.note_demand(8)
            assert pool.get_num_free_blocks() >= 8  # the next attempt maps
        assert pool.get_new_blocks(8) and pool.check() is None
    finally:
        pool.close()


def test_get_new_blocks_beyond_the_usable_free_blocks_is_a_scheduling_miss() -> None:
    """Issue 31, item 5d, at vLLM's seam: every page but a quarantined one (its unmap failed
    in one backing) holds live blocks; the quarantined page's four blocks are CLEAN in vLLM's
    free queue. A get_new_blocks within the free count raises PhysicalMemoryExhausted (the
    scheduling-miss error) with the free queue unchanged, not InvariantError."""
    geometry = plan_geometry([1024, 1024], 32, PAGE)
    ranges = [FailingRange(_vmm.VirtualRange("cpu", size, PAGE)) for size in geometry.reserved_bytes]
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0,
                            map_retries=0, max_cached_blocks=-1)
    pool = ElasticBlockPool(32, False, 16, kv_space=KvSpace(geometry, tuple(ranges)),  # type: ignore[arg-type]
                            config=config, fence=StepFence(), name="quarantined")
    try:
        blocks = pool.get_new_blocks(31)  # every block but the null block
        pool.free_blocks([b for b in blocks if b.block_id // 4 == 1])
        ranges[1].fail_call("unmap", 1, DriverError("CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN", 999))
        pool.collect()
        assert pool.page_pool.quarantined == {1} and pool.get_num_free_blocks() == 0
        with pytest.raises(PhysicalMemoryExhausted, match="quarantined"):
            pool.get_new_blocks(1)
        assert pool.free_block_queue.num_free_blocks == 4
        pool.check()
        pool.collect()  # the retry: page 1's blocks can be handed out again
        assert len(pool.get_new_blocks(4)) == 4
        pool.check()
    finally:
        pool.close()
