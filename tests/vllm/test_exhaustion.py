"""Physical exhaustion is a scheduling miss: a real `KVCacheManager` on the elastic pool,
with a physical budget far below the logical block count.

``allocate_slots`` must return None (never raise), leak nothing (ledger, mapped pages,
ref counts, free queue, events unchanged), and succeed once capacity comes back. The
same holds for injected admission failures, including the copy-on-write admission of a
request whose prefix hit ends inside a block.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm_requests import make_request

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.integration.vllm import capabilities, scheduler
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
NUM_BLOCKS = 32  # 8 kv pages of 4 blocks
BLOCK = 16

_plan_ids = itertools.count()





class Engine:
    """A KVCacheManager built by vLLM's own code path, on a budgeted published space."""

    def __init__(self, tmp: Path, budget_pages: int, plans: list[dict[str, object]] | None = None) -> None:
        # The worker resolves the engine's config (fault plan included) from the environment
        # and publishes it with the space; the pool reads no environment of its own.
        self._env = pytest.MonkeyPatch()
        self._env.setenv("KVCACHED_PAGE_SIZE", str(PAGE))
        self._env.setenv("KVCACHED_MIN_RESERVE_PAGES", "0")
        self._env.setenv("KVCACHED_MAX_RESERVE_PAGES", "0")
        self._env.setenv("KVCACHED_CAPACITY_TTL_MS", "0")
        self._env.setenv("KVCACHED_MAP_RETRIES", "0")
        if plans is None:
            self._env.delenv("KVCACHED_FAULT_PLAN", raising=False)
        else:  # the core's fault seam: a plan file, as the conformance harness drives it
            plan = tmp / f"faults-{next(_plan_ids)}.json"
            plan.write_text(json.dumps({"plans": plans}))
            self._env.setenv("KVCACHED_FAULT_PLAN", str(plan))
        geometry = plan_geometry([1024], NUM_BLOCKS, PAGE)
        self.budget = LocalBudget(budget_pages * PAGE)
        self.vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
        # No cached-block cap: idle cache is what reclaim must give up (the default cap would
        # already have cleaned most of it).
        self.space = KvSpace(geometry, (self.vrange,), config=KvcachedConfig.resolve(max_cached_blocks=-1),
                             charger=self.budget)
        scheduler.install(capabilities.detect(), enabled=True)
        cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                                          dtype=torch.float32))])
        self.manager = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                      enable_caching=True, enable_kv_cache_events=True)
        pool = self.manager.block_pool
        assert isinstance(pool, ElasticBlockPool)
        pool.attach(self.space)  # as the EngineCore seam does with the ranks' space
        assert pool.config is self.space.config, "the published config, not a second resolution"
        self.pool = pool
        self.faults = pool.faults

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (pool.ledger.num_held, self.vrange.mapped_pages(), sorted(pool.page_pool.mapped),
                [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
                pool.free_block_queue.num_free_blocks, len(pool.kv_event_queue), self.budget.used)

    def admit(self, request: Request) -> KVCacheBlocks | None:
        blocks, hit_tokens, _ = self.manager.get_computed_blocks(request)
        return self.manager.allocate_slots(request, request.num_tokens - hit_tokens, hit_tokens, blocks)

    def close(self) -> None:
        self._env.undo()
        scheduler.uninstall()
        self.pool.close()
        self.vrange.close()


@pytest.fixture
def engines(tmp_path: Path):
    made: list[Engine] = []

    def make(**kwargs: object) -> Engine:
        made.append(Engine(tmp_path, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_exhaustion_is_a_miss_that_leaks_nothing_and_recovers(engines) -> None:
    eng = engines(budget_pages=2)  # 8 blocks of memory for 32 logical blocks
    first = make_request(list(range(100)), BLOCK, max_tokens=16)  # 7 blocks: the whole budget (the null block has one)
    assert eng.admit(first) is not None
    second = make_request(list(range(1000, 1020)), BLOCK, max_tokens=16)
    before = eng.snapshot()
    assert eng.pool.ledger.pool_stats().admission_misses == 0
    assert eng.admit(second) is None  # native would admit: 24 logical blocks are free
    assert eng.snapshot() == before
    assert eng.pool.ledger.pool_stats().admission_misses == 1  # the miss is counted
    eng.pool.check()
    eng.budget.limit = 4 * PAGE  # another tenant gave memory back
    assert eng.admit(second) is not None
    stats = eng.pool.ledger.pool_stats()
    assert stats.admission_misses == 1 and stats.kv_page_bytes == PAGE
    eng.pool.check()


def test_a_check_beyond_the_native_free_count_is_not_kvcacheds_miss(engines) -> None:
    eng = engines(budget_pages=8)
    too_long = make_request(list(range(40 * BLOCK)), BLOCK, max_tokens=16)  # 40 blocks > 32 logical
    assert eng.admit(too_long) is None  # native refuses this too
    assert eng.pool.ledger.pool_stats().admission_misses == 0


def test_idle_cache_is_reclaimed_before_admission_fails(engines) -> None:
    eng = engines(budget_pages=2)
    first = make_request(list(range(112)), BLOCK, max_tokens=16)  # 7 full blocks, all cached when freed
    assert eng.admit(first) is not None
    eng.manager.free(first)
    assert eng.pool.get_num_free_blocks() == 0
    second = make_request(list(range(5000, 5040)), BLOCK, max_tokens=16)
    blocks = eng.admit(second)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 3
    eng.pool.check()


def test_injected_admission_failure_is_a_miss_then_succeeds(engines) -> None:
    eng = engines(budget_pages=8, plans=[{"site": "admission", "fail_next": 1}])
    faults = eng.faults
    assert faults is not None
    request = make_request(list(range(40)), BLOCK, max_tokens=16)
    before = eng.snapshot()
    assert eng.admit(request) is None
    assert eng.snapshot() == before and faults.fired("admission") == 1
    assert eng.pool.ledger.pool_stats().admission_misses == 1
    assert eng.admit(request) is not None


def test_partial_prefix_hit_uses_the_cow_admission_site(engines) -> None:
    eng = engines(budget_pages=8, plans=[{"site": "cow_admission", "after_trigger": "partial_prefix_hit",
                                          "fail_next": 2}])
    faults = eng.faults
    assert faults is not None
    owner = make_request(list(range(32)), BLOCK, max_tokens=16)
    assert eng.admit(owner) is not None
    eng.manager.free(owner)  # two full blocks, cached
    hit = eng.manager.block_pool.get_cached_block(owner.block_hashes[1], [0])
    assert hit is not None
    source = [eng.manager.block_pool.get_cached_block(h, [0])[0] for h in owner.block_hashes[:2]]  # type: ignore[index]
    reader = make_request(list(range(24)) + [999] * 16, BLOCK, max_tokens=16)
    # A prefix hit that ends inside block 1 (24 tokens): vLLM copies the shared tail block.
    computed = eng.manager.create_kv_cache_blocks((source,))
    before = eng.snapshot()
    for _ in range(2):
        assert eng.manager.allocate_slots(reader, reader.num_tokens - 24, 24, computed) is None
        assert eng.snapshot() == before
    assert faults.triggered("partial_prefix_hit") and faults.fired("cow_admission") == 2
    assert faults.fired("admission") == 0
    assert eng.manager.allocate_slots(reader, reader.num_tokens - 24, 24, computed) is not None
    copies, retained = eng.manager.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(source[1].block_id, copies[0].dst_block_id)]
    assert all(eng.pool.ledger.is_backed(b) for c in copies for b in (c.src_block_id, c.dst_block_id))
    eng.pool.free_blocks(retained)
    eng.pool.check()


def test_scheduler_estimates_outside_admission_map_nothing(engines) -> None:
    eng = engines(budget_pages=2)  # 8 blocks of memory: the 13-block estimate could not be backed
    request = make_request(list(range(200)), BLOCK, max_tokens=16)
    # The scheduler asks the coordinator for estimates of its own (async-load reservations).
    estimate = eng.manager.coordinator.get_num_blocks_to_allocate(
        request_id=request.request_id, num_tokens=200, new_computed_blocks=eng.manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0, total_computed_tokens=0, num_local_computed_tokens=0, num_tokens_main_model=200)
    assert estimate == 13
    before = eng.vrange.mapped_pages()
    eng.pool.get_num_free_blocks()
    assert eng.vrange.mapped_pages() == before
    assert eng.pool.ledger.pool_stats().admission_misses == 0  # an estimate is not an admission
