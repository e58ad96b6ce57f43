"""The coordinator seam: vLLM's own coordinator builds an `ElasticBlockPool` with the
native constructor arguments, and bad hash granularity stops it before kvcached starts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

import kvcached
from kvcached.config import KvcachedConfig
from kvcached.errors import IntegrationError, InvariantError
from kvcached.integration.vllm import capabilities, scheduler
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
NUM_BLOCKS = 32


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)


def config(*specs: object) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]  # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def coordinator(cfg: KVCacheConfig, *, caching: bool = True, scheduler_block_size: int = 16,
                hash_block_size: object = 16, device: bool = True) -> kv_cache_coordinator.KVCacheCoordinator:
    """Built as `KVCacheManager` builds the device pool's (``device``: through the manager
    module's name, which the seam marks), else as another user of the class does."""
    build = kv_cache_manager.get_kv_cache_coordinator if device else get_kv_cache_coordinator
    return build(
        kv_cache_config=cfg, max_model_len=1024, max_in_flight_tokens=1024, use_eagle=False,
        enable_caching=caching, enable_kv_cache_events=True, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,  # type: ignore[arg-type]
    )


class Attached(list):
    """Pools the test built, attached to ``space`` as the EngineCore seam would (and closed after)."""

    def __init__(self, space: KvSpace, pools: list[ElasticBlockPool]) -> None:
        super().__init__(pools)
        self.space = space

    def append(self, pool: ElasticBlockPool) -> None:  # type: ignore[override]
        if not pool.attached:
            pool.attach(self.space)
        super().append(pool)


@pytest.fixture
def published():
    """Scheduler seams installed and a worker-side KV space published, as at TP=1."""
    geometry = plan_geometry([1024], NUM_BLOCKS, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    space = KvSpace(geometry, (vrange,), config=KvcachedConfig(page_size=PAGE))
    scheduler.install(capabilities.detect(), enabled=True)
    pools: list[ElasticBlockPool] = []
    attached = Attached(space, pools)
    yield attached
    scheduler.uninstall()
    for pool in attached:
        pool.close()
    vrange.close()


def test_coordinator_builds_an_elastic_pool_with_native_arguments(published) -> None:
    coord = coordinator(config(full()))
    pool = coord.block_pool
    published.append(pool)
    assert isinstance(pool, ElasticBlockPool)
    assert (pool.num_gpu_blocks, pool.enable_caching, pool.hash_block_size, pool.enable_kv_cache_events) == (
        NUM_BLOCKS, True, 16, True)
    assert coord.single_type_managers[0].block_pool is pool


def test_hybrid_coordinator_keeps_a_hash_granularity_finer_than_the_block(published) -> None:
    cfg = config(full(16), SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                             sliding_window=32))
    coord = coordinator(cfg, hash_block_size=4)
    published.append(coord.block_pool)
    assert isinstance(coord.block_pool, ElasticBlockPool)
    assert coord.block_pool.hash_block_size == 4  # never the 16-token allocation block


def test_uncached_coordinator_passes_its_hash_granularity_through(published) -> None:
    coord = coordinator(config(full()), caching=False, hash_block_size=8)
    published.append(coord.block_pool)
    assert coord.block_pool.hash_block_size == 8 and coord.block_pool.enable_caching is False


@pytest.mark.parametrize("bad", [True, 4.0, 16.0])
def test_invalid_hash_granularity_propagates_out_of_the_coordinator(published, bad: object) -> None:
    before = set(kvcached.stats())
    with pytest.raises(RuntimeError, match="hash_block_size"):
        coordinator(config(full()), hash_block_size=bad)
    assert set(kvcached.stats()) == before, "kvcached must not initialize on bad metadata"


@pytest.mark.parametrize("kwargs", [
    {},  # absent
    {"hash_block_size": None},
    {"hash_block_size": 0},
    {"hash_block_size": -4},
    {"hash_block_size": "4"},
])
def test_absent_or_invalid_hash_granularity_raises_at_the_seam(published, kwargs: dict) -> None:
    seam = kv_cache_coordinator.BlockPool  # what the coordinator calls
    with pytest.raises(IntegrationError) as info, scheduler.building_device_pool():
        seam(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=False, **kwargs)
    assert isinstance(info.value, RuntimeError)
    assert "hash_block_size" in str(info.value)


def test_the_coordinator_builds_the_pool_detached_and_the_engine_attaches_it(published) -> None:
    pool = coordinator(config(full())).block_pool
    assert isinstance(pool, ElasticBlockPool) and not pool.attached and not pool.closed
    before = set(kvcached.stats())
    published.append(pool)
    assert pool.attached and set(kvcached.stats()) - before
    with pytest.raises(InvariantError, match="already attached"):
        pool.attach(published.space)
    other = KvSpace(plan_geometry([1024], NUM_BLOCKS + 4, PAGE), published.space.ranges,
                    config=published.space.config)
    fresh = coordinator(config(full())).block_pool
    with pytest.raises(IntegrationError, match="blocks but the pool has"):
        fresh.attach(other)
    fresh.close()
    assert fresh.closed


def test_another_coordinator_gets_a_native_pool(published) -> None:
    """``SimpleCPUOffloadConnector`` builds its CPU pool with vLLM's coordinator, calling
    ``kv_cache_coordinator.get_kv_cache_coordinator`` itself: before, that pool became an
    elastic one claiming the device KV space (start-up failed with a geometry error)."""
    from vllm.v1.core.block_pool import BlockPool

    other = coordinator(config(full()), device=False)
    assert type(other.block_pool) is BlockPool
    device = coordinator(config(full()))
    published.append(device.block_pool)
    assert isinstance(device.block_pool, ElasticBlockPool)


def _running_request(published: Attached) -> tuple[Any, ElasticBlockPool, Any, list[str]]:
    """vLLM's real `KVCacheManager` over an elastic pool, and a request it admitted (20 prompt
    tokens, now RUNNING); the list records each admission the pool begins, as "admission"."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    manager = KVCacheManager(config(full()), max_model_len=1024, scheduler_block_size=16, hash_block_size=16)
    pool = manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    published.append(pool)
    pool.running_block_sizes = (16,)
    asked: list[str] = []
    begin = pool.begin_admission
    pool.begin_admission = lambda *a, **k: asked.append("admission") or begin(*a, **k)  # type: ignore[method-assign]
    init_none_hash(sha256)
    request = Request("r", list(range(3, 23)), SamplingParams(max_tokens=400), None,
                      block_hasher=get_request_block_hasher(16, sha256))
    assert manager.allocate_slots(request, 20) is not None and asked == ["admission"], "a new request is admitted"
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = 20
    return manager, pool, request, asked


def test_the_decode_path_skips_admission_exactly_when_admit_running_says_so(published) -> None:
    """The exhaustion seam asks `ElasticBlockPool.admit_running`, the one definition of the
    decode path's gate: on the real manager and pool, a running request's call goes without
    admission work exactly when the method, asked on the same state just before, says it may."""
    manager, pool, request, admissions = _running_request(published)
    seen = set()
    for n in (1, 1, 40, 1, 90, 1, 16, 200, 1, 31, 1, 32, 1, 33, 1):
        expected = pool.admit_running(n)
        pool.end_admission(None)  # drop the marker the question left
        before = len(admissions)
        manager.allocate_slots(request, n)
        request.num_computed_tokens += n
        seen.add(expected)
        assert (len(admissions) == before) == expected, f"{n} new tokens, {pool.ledger.backed_free} backed free"
    assert seen == {True, False}, "both branches were taken"


def test_an_open_schedule_call_skips_the_gate_and_admission_for_running_requests(published) -> None:
    """`ElasticBlockPool.begin_schedule` on the real manager and pool: while every CLEAN block
    is backed, a running request's calls neither ask `admit_running` nor admit, and take the
    blocks native would count; after `end_schedule` the gate is asked again."""
    manager, pool, request, asked = _running_request(published)
    gate = pool.admit_running
    pool.admit_running = lambda n: asked.append("gate") or gate(n)  # type: ignore[method-assign]
    pool.ledger.ensure_backed(pool.ledger.num_free)
    pool.begin_schedule()
    assert pool.running_open
    for n in (1, 40, 1, 90):
        free = pool.free_block_queue.num_free_blocks
        new = manager.allocate_slots(request, n)
        assert new is not None and pool.free_block_queue.num_free_blocks == free - len(new.blocks[0])
        request.num_computed_tokens += n
    assert asked == ["admission"], "no gate, no admission while open"
    pool.end_schedule()
    manager.allocate_slots(request, 1)
    assert asked == ["admission", "gate"]
    pool.check()
