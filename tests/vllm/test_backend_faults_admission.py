"""A backend failure other than out-of-memory during admission is a scheduling miss in
vLLM's pool, never an exception into EngineCore, and the pool stays consistent."""

from __future__ import annotations

import pytest

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import DriverError
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
