"""`ElasticBlockPool` behaviour that the differential test cannot show: physical limits,
the cached cap, STRANDED blocks, reclaim, the fence, foreign queue pops, injected faults.

Every pool runs on a real CPU `VirtualRange` (memfd-backed) with a physical `Budget`.
Geometry: 4 blocks per kv page; block 0 is the null block, pinned on page 0.
"""

from __future__ import annotations

import gc
import queue

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm_requests import make_request

from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry
from kvcached.stats import stats

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
STRIDE = 1024  # 4 blocks per kv page
BLOCK = 16





class Rig:
    """An elastic pool over a budgeted CPU range (closed by the fixture)."""

    def __init__(self, num_blocks: int = 16, budget_pages: int | None = None, hash_block_size: int = BLOCK,
                 faults: FaultInjector | None = None, **cfg: object) -> None:
        geometry = plan_geometry([STRIDE], num_blocks, PAGE)
        assert geometry.blocks_per_page == 4
        self.budget = LocalBudget(budget_pages * PAGE) if budget_pages is not None else None
        self.vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
        # No cached-block cap unless a test asks (native-equivalent caching): default=True
        # keeps the library default (10% of the pool).
        defaults = {} if cfg.pop("default_cap", False) else {"max_cached_blocks": -1}
        config = KvcachedConfig(page_size=PAGE, **{"min_reserve_pages": 0, "max_reserve_pages": 0,
                                                   "capacity_ttl_s": 0.0, "map_retries": 0, **defaults, **cfg})
        self.fence = StepFence()
        self.pool = ElasticBlockPool(num_gpu_blocks=num_blocks, enable_caching=True,
                                     hash_block_size=hash_block_size, enable_kv_cache_events=True,
                                     kv_space=KvSpace(geometry, (self.vrange,), charger=self.budget), config=config,
                                     faults=faults, fence=self.fence, name="test")

    def mapped(self) -> list[int]:
        return self.vrange.mapped_pages()

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (pool.free_block_queue.num_free_blocks, pool.ledger.num_held, self.mapped(),
                [b.ref_cnt for b in pool.blocks], [pool.state_of(b.block_id) for b in pool.blocks],
                len(pool.kv_event_queue))

    def close(self) -> None:
        self.pool.close()
        self.vrange.close()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(**kwargs: object) -> Rig:
        made.append(Rig(**kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def cached_request(pool: BlockPool, num_blocks: int, first_token: int = 1) -> list:
    """Allocate, fill and cache ``num_blocks`` full blocks of a fresh request."""
    request = make_request(list(range(first_token, first_token + num_blocks * BLOCK)), BLOCK)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks, BLOCK, 0)
    return blocks


def test_partial_entry_promotion_with_hash_granularity_4() -> None:
    """hash_block_size=4 < block size 16: native partial entry, then partial -> full promotion."""
    rig = Rig(hash_block_size=4)
    native = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4, enable_kv_cache_events=True)
    try:
        request = make_request(list(range(100, 124)), 4)  # 24 tokens, 6 fine hashes
        pools = (native, rig.pool)
        blocks = [pool.get_new_blocks(2) for pool in pools]
        for pool, bl in zip(pools, blocks, strict=True):
            pool.cache_full_blocks(request, bl, 0, 1, BLOCK, 0)
            pool.cache_partial_block(request, bl[1], 20, 0, BLOCK)  # ends inside block 1
            assert bl[1].block_hash_num_tokens == 20
            assert pool.get_cached_block(request.block_hashes[4], [0]) == [bl[1]]
        request.append_output_token_ids(list(range(8)))  # 32 tokens: block 1 is full
        for pool, bl in zip(pools, blocks, strict=True):
            pool.cache_full_blocks(request, bl, 1, 2, BLOCK, 0)  # promotion
            assert bl[1].block_hash_num_tokens == 32
            assert pool.get_cached_block(request.block_hashes[4], [0]) is None
            assert pool.get_cached_block(request.block_hashes[7], [0]) == [bl[1]]
            pool.free_blocks(reversed(bl))
        assert native.take_events() == rig.pool.take_events()
        assert [rig.pool.state_of(b.block_id) for b in blocks[1]] == ["cached", "cached"]
        rig.pool.check()
    finally:
        rig.close()


def test_get_new_blocks_that_must_map_and_cannot_changes_nothing(rigs) -> None:
    rig = rigs(budget_pages=2)
    pool = rig.pool
    first = pool.get_new_blocks(7)  # pages 0 (with the null block) and 1: the whole budget
    assert rig.mapped() == [0, 1]
    before = rig.snapshot()
    with pytest.raises(PhysicalMemoryExhausted):
        pool.get_new_blocks(1)
    assert rig.snapshot() == before
    pool.check()
    pool.free_blocks(first)
    assert len(pool.get_new_blocks(1)) == 1


def test_free_count_reports_only_backable_blocks(rigs) -> None:
    rig = rigs(budget_pages=2)
    pool = rig.pool
    native_free = pool.free_block_queue.num_free_blocks
    assert native_free == 15
    assert pool.get_num_free_blocks() == 3  # only page 0 is mapped (null block pinned)
    pool.note_demand(5)
    assert pool.get_num_free_blocks() == 7  # mapped one more page for the demand
    assert rig.mapped() == [0, 1]
    pool.note_demand(10)
    assert pool.get_num_free_blocks() == 7  # the budget allows no more: a scheduling miss
    pool.note_demand(pool.num_gpu_blocks + 1)  # MambaManager's "not this step" sentinel
    rig.budget.limit = 8 * PAGE
    assert pool.get_num_free_blocks() == 7 and rig.mapped() == [0, 1]  # sentinel maps nothing
    pool.note_demand(15)
    assert pool.get_num_free_blocks() == 15 == native_free  # all CLEAN blocks backed: native count


def test_cached_cap_evicts_page_aware_and_gives_pages_back(rigs) -> None:
    rig = rigs(max_cached_blocks=2)
    pool = rig.pool
    blocks = cached_request(pool, 4)  # ids 1, 2, 3 on page 0 and 4 on page 1
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    pool.take_events()
    pool.free_blocks(reversed(blocks))
    # While the engine is busy, freed blocks stay cached as native keeps them.
    pool.collect(busy=True)
    assert {pool.state_of(b.block_id) for b in blocks} == {"cached"}
    assert rig.mapped() == [0, 1] and pool.take_events() == []
    pool.check()
    # Going idle applies the cap. Page 1 holds only one free cached block: evicting it
    # empties the page, so it goes first, and back to the device in the same pass.
    pool.collect()
    states = {b.block_id: pool.state_of(b.block_id) for b in blocks}
    assert list(states.values()).count("cached") == 2
    assert states[4] == "clean"
    events = pool.take_events()
    assert len(events) == 2 and all(type(e).__name__ == "BlockRemoved" for e in events)
    assert rig.mapped() == [0]
    pool.check()


def test_an_idle_grace_defers_the_cap_to_the_engines_thread_and_a_step_cancels_it(rigs) -> None:
    rig = rigs(max_cached_blocks=2, idle_grace_s=0.01)
    pool = rig.pool
    posted: queue.Queue = queue.Queue()  # the engine's idle loop: its thread (this one) runs what is posted
    pool.set_idle_post(posted.put)
    blocks = cached_request(pool, 4)  # ids 1, 2, 3 on page 0 and 4 on page 1
    pool.free_blocks(reversed(blocks))
    cached = lambda: [pool.state_of(b.block_id) for b in blocks].count("cached")
    pool.collect()  # the idle step: the cap waits for the grace
    assert cached() == 4 and rig.mapped() == [0, 1] and pool.idle_grace.armed
    give_back = posted.get(timeout=30)
    assert cached() == 4, "the timer's thread only posts"
    pool.collect(busy=True)  # a request came first
    give_back()
    assert cached() == 4 and rig.mapped() == [0, 1] and not pool.idle_grace.armed
    pool.collect()
    pool.collect()  # an async engine's second idle step keeps the first one's deadline
    posted.get(timeout=30)()  # idle through the grace: the cap, then the give-back
    assert cached() == 2 and pool.state_of(4) == "clean" and rig.mapped() == [0]
    assert posted.empty()
    pool.check()


def test_a_give_back_posted_before_the_pool_closed_does_nothing(rigs) -> None:
    rig = rigs(max_cached_blocks=0, idle_grace_s=0.01)
    pool = rig.pool
    posted: queue.Queue = queue.Queue()
    pool.set_idle_post(posted.put)
    pool.free_blocks(reversed(cached_request(pool, 4)))
    pool.collect()
    give_back = posted.get(timeout=30)
    pool.close()  # the engine stopped while the give-back waited for its thread
    cap_runs = []
    pool._enforce_cap = lambda: cap_runs.append(1)  # type: ignore[method-assign]
    give_back()
    assert cap_runs == [] and not pool.idle_grace.armed and pool.closed


def test_an_in_process_engine_applies_the_cap_at_once(rigs) -> None:
    rig = rigs(max_cached_blocks=2, idle_grace_s=1.0)
    pool = rig.pool
    pool.set_idle_post(None)  # no engine thread to post to (``LLM`` without multiprocessing)
    assert pool.idle_grace is None
    pool.free_blocks(reversed(cached_request(pool, 4)))
    pool.collect()
    assert rig.mapped() == [0]


@pytest.mark.parametrize(("setting", "kept"), [("default", 4), ("25%", 10), (-1, 16), (0, 0)])
def test_cached_cap_default_and_percentages(rigs, setting: object, kept: int) -> None:
    """The cap in blocks an idle engine keeps: by default a tenth of the pool, ``P%`` of it,
    -1 none, N blocks."""
    if setting == "default":
        rig = rigs(num_blocks=40, default_cap=True)
    else:
        rig = rigs(num_blocks=40, max_cached_blocks=KvcachedConfig.resolve(
            env={"KVCACHED_MAX_CACHED_BLOCKS": str(setting)}).max_cached_blocks)
    pool = rig.pool
    blocks = cached_request(pool, 16)
    pool.free_blocks(reversed(blocks))
    pool.collect()
    states = [pool.state_of(b.block_id) for b in blocks]
    assert states.count("cached") == kept and states.count("clean") == 16 - kept
    pool.check()


def test_stranded_block_keeps_its_page_until_taken_or_reset(rigs) -> None:
    rig = rigs()
    pool = rig.pool
    blocks = cached_request(pool, 4)
    pool.free_blocks(reversed(blocks))
    pool.evict_blocks({4})
    assert pool.state_of(4) == "stranded"
    pool.collect()
    assert rig.mapped() == [0, 1], "a STRANDED block keeps its page mapped"
    pool.check()
    assert pool.reset_prefix_cache() is True
    assert {pool.state_of(b.block_id) for b in blocks} == {"clean"}
    pool.collect()
    assert rig.mapped() == [0]
    pool.check()


def test_positional_take_reuses_stranded_and_cached_blocks_in_native_order(rigs) -> None:
    rig = rigs(num_blocks=8)
    native = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    pools = (native, rig.pool)
    held = [cached_request(pool, 7) for pool in pools]
    for pool, blocks in zip(pools, held, strict=True):
        pool.free_blocks(reversed(blocks))
        pool.evict_blocks({blocks[-1].block_id})  # first in LRU order: now STRANDED in elastic
    taken = [pool.get_new_blocks(3) for pool in pools]
    assert [b.block_id for b in taken[0]] == [b.block_id for b in taken[1]]  # same ids: no CLEAN block left
    assert native.take_events() == rig.pool.take_events()
    rig.pool.check()


def test_reclaim_turns_idle_cache_into_room_when_memory_is_short(rigs) -> None:
    rig = rigs(budget_pages=2)
    pool = rig.pool
    blocks = cached_request(pool, 7)  # fills pages 0 and 1: the whole budget
    hit = blocks[0]
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    assert pool.get_num_free_blocks() == 0  # every CLEAN block is on an unmapped page
    pool.note_demand(3, ([hit],))  # the admission would touch `hit`: it must survive
    assert pool.get_num_free_blocks() == 3
    new = pool.get_new_blocks(3)
    assert hit.block_hash is not None and pool.state_of(hit.block_id) == "cached"
    assert len(pool.take_events()) == 3  # three cached blocks were evicted natively
    assert rig.mapped() == [0, 1]
    assert all(pool.ledger.is_backed(b.block_id) for b in new)
    pool.check()


def test_unmap_waits_for_steps_in_flight(rigs) -> None:
    rig = rigs()
    pool = rig.pool
    blocks = pool.get_new_blocks(7)
    rig.fence.begin_step()  # a step that may use these blocks is scheduled...
    pool.free_blocks(blocks)  # ...and they are freed (e.g. CoW retention released) before it runs
    assert pool.collect() == 0
    assert rig.mapped() == [0, 1]
    rig.fence.end_step()
    assert pool.collect() == 1
    assert rig.mapped() == [0]


def test_blocks_popped_behind_the_pools_back_are_adopted(rigs) -> None:
    rig = rigs()
    pool = rig.pool
    sink = pool.free_block_queue.popleft_n(2)  # as SinkFullAttentionManager does
    assert pool.get_num_free_blocks() <= pool.free_block_queue.num_free_blocks
    assert all(pool.ledger.is_held(b.block_id) and pool.ledger.is_backed(b.block_id) for b in sink)
    assert all(pool.state_of(b.block_id) == "live" for b in sink)
    pool.check()


def test_injected_admission_fault_is_a_scheduling_miss(rigs) -> None:
    faults = FaultInjector.from_plans([{"site": "admission", "fail_next": 1}])
    rig = rigs(faults=faults, min_reserve_pages=2, max_reserve_pages=2)
    pool = rig.pool
    with pool.admission(watermark=0, reserved=0, site="admission"):
        pool.note_demand(2)
        assert pool.get_num_free_blocks() < 2  # backed blocks exist, yet the attempt misses
    assert faults.fired("admission") == 1
    with pool.admission(watermark=0, reserved=0, site="admission"):
        pool.note_demand(2)
        assert pool.get_num_free_blocks() >= 2


def test_instance_dict_holds_only_vllms_attributes(rigs) -> None:
    """kvcached's state is in slots: with it in the dict, CPython (3.11+) passes its 30 shared
    keys, materializes the dict and drops the specialized attribute and method lookups on
    the pool, in vLLM's code and ours (the decode path pays it for every running request)."""
    pool = rigs().pool
    native = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    assert set(vars(pool)) <= set(vars(native))


def test_caching_off_pool_reuses_and_returns_pages() -> None:
    native = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=BLOCK)
    geometry = plan_geometry([STRIDE], 16, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0)
    pool = ElasticBlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=BLOCK,
                            kv_space=KvSpace(geometry, (vrange,)), config=config, fence=StepFence(), name="test")
    try:
        for n in (5, 9, 15, 2):
            for p in (native, pool):
                p.free_blocks(reversed(p.get_new_blocks(n)))
            assert pool.free_block_queue.num_free_blocks == native.get_num_free_blocks() == 15
            pool.check()
        pool.collect()
        assert vrange.mapped_pages() == [0]
    finally:
        pool.close()
        vrange.close()


def test_hashing_a_free_clean_block_is_refused(rigs) -> None:
    pool = rigs().pool
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    request = make_request(list(range(16)), BLOCK)
    with pytest.raises(InvariantError, match="hashed free block"):
        pool.cache_full_blocks(request, [block], 0, 1, BLOCK, 0)
    assert block.block_hash is None
    pool.check()


def test_prefix_cache_reset_gives_pages_back_at_once(rigs) -> None:
    rig = rigs()
    pool = rig.pool
    pool.free_blocks(reversed(cached_request(pool, 7)))
    pool.collect()
    assert rig.mapped() == [0, 1], "cached blocks keep their pages"
    assert pool.reset_prefix_cache() is True
    assert rig.mapped() == [0], "no executed step needed to unmap after a reset"
    pool.check()


def _pool_over(vrange: object, geometry: object, premapped: frozenset[int] = frozenset()) -> ElasticBlockPool:
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0)
    return ElasticBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK,
                            kv_space=KvSpace(geometry, (vrange,), premapped), config=config, name="lifecycle")


def test_null_page_mapped_by_the_worker_is_adopted_and_teardown_is_idempotent() -> None:
    geometry = plan_geometry([STRIDE], 8, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    vrange.map([0])  # what the worker does at allocation, before any pool exists
    pool = _pool_over(vrange, geometry, frozenset({0}))
    (key,) = [k for k in stats() if k.startswith("lifecycle")]
    assert vrange.mapped_pages() == [0] and pool.ledger.is_held(0)
    assert stats()[key].mapped_bytes == stats()[key].peak_mapped_bytes == PAGE
    assert (stats()[key].maps, stats()[key].unmaps) == (1, 0), "adopted: the pool owns the page now"
    pool.free_blocks(reversed(pool.get_new_blocks(6)))
    counters = pool.page_pool.counters()
    pool.close()
    assert pool.page_pool.counters().unmaps - counters.unmaps == counters.maps - counters.unmaps == 2
    assert pool.closed and vrange.num_mapped == 0 and key not in stats()
    pool.close()  # idempotent
    vrange.close()


def test_a_pool_never_shut_down_is_closed_when_collected() -> None:
    geometry = plan_geometry([STRIDE], 8, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    pool = _pool_over(vrange, geometry)
    pool.get_new_blocks(5)
    assert vrange.num_mapped == 2
    del pool
    gc.collect()
    assert vrange.num_mapped == 0
    assert not [k for k in stats() if k.startswith("lifecycle")]
    vrange.close()


def test_a_running_request_covered_by_mapped_blocks_skips_admission(rigs) -> None:
    """`admit_running`: yes only when free blocks on mapped pages cover ``n // block + 2``
    per full-attention group, and then the next free count is the native one (the marker is
    used once); no while faults are injected or before the engine seam set the groups."""
    pool = rigs().pool
    assert pool.ledger.backed_free == 3 and pool.free_block_queue.num_free_blocks == 15
    assert not pool.admit_running(1), "no group block sizes yet (set by the engine seam)"
    pool.running_block_sizes = (BLOCK,)
    assert not pool.admit_running(BLOCK * 2), "2 + 2 blocks needed, 3 mapped: admission work"
    assert pool.get_num_free_blocks() == 3, "nothing was marked: the physical count"
    assert pool.admit_running(BLOCK - 1)  # 0 + 2 blocks <= 3 mapped
    assert pool.get_num_free_blocks() == 15, "covered: the native count"
    assert pool.get_num_free_blocks() == 3, "the marker is used once"
    pool.running_block_sizes = (BLOCK, BLOCK)
    assert not pool.admit_running(1), "two groups: 4 blocks"
    faulty = rigs(faults=FaultInjector.from_plans([])).pool
    faulty.running_block_sizes = (BLOCK,)
    assert faulty.ledger.backed_free == 3 and not faulty.admit_running(1)


def test_a_full_steps_pages_follow_the_token_budget_of_full_attention_groups(rigs) -> None:
    """`set_step_tokens`: each group's blocks for the tokens plus a boundary block, in pages
    plus one for straddling, at most the space; 0 without full-attention groups. The pages
    follow both settings, in either order."""
    pool = rigs().pool
    bpp, pages = pool.ledger.blocks_per_page, pool.page_pool.space.num_kv_pages
    pool.set_step_tokens(BLOCK * bpp)  # no group block sizes yet: unknown
    assert pool.page_pool.policies.reserve.step_pages == 0
    pool.running_block_sizes = (BLOCK,)  # bpp + 1 blocks: 2 pages, and 1 for straddling
    assert pool.page_pool.policies.reserve.step_pages == min(3, pages)
    pool.running_block_sizes = (BLOCK, BLOCK)
    pool.set_step_tokens(1 << 20)
    assert pool.page_pool.policies.reserve.step_pages == pages
    pool.running_block_sizes = ()  # a group that is not full attention: the watermarks only
    assert pool.page_pool.policies.reserve.step_pages == 0
    with pytest.raises(ValueError, match="step tokens must be >= 0, got -1"):
        pool.set_step_tokens(-1)


def test_step_tokens_set_before_attach_apply_at_attach() -> None:
    """As the engine seam may order it: sizes and tokens on a detached pool, pages at attach."""
    geometry = plan_geometry([STRIDE], 16, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    pool = ElasticBlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK,
                            config=KvcachedConfig(page_size=PAGE, max_cached_blocks=-1), name="detached")
    try:
        pool.set_step_tokens(BLOCK * geometry.blocks_per_page)
        pool.running_block_sizes = (BLOCK,)
        pool.attach(KvSpace(geometry, (vrange,)))
        assert pool.page_pool.policies.reserve.step_pages == 3  # 5 blocks of 4 a page: 2, +1 for straddling
    finally:
        pool.close()
        vrange.close()


def test_a_pool_full_of_cached_blocks_skips_admission_for_running_requests(rigs) -> None:
    """With every CLEAN block backed, free cached blocks (held, so mapped) serve whatever vLLM
    can take: `admit_running` says yes however few CLEAN blocks there are, the free count is
    native, and the blocks handed out need no map. With a CLEAN block on an unmapped page
    and too few backed ones it says no."""
    rig = rigs()
    pool = rig.pool
    pool.running_block_sizes = (BLOCK,)
    pool.free_blocks(reversed(cached_request(pool, 15)))  # every block cached, every page mapped
    assert pool.ledger.num_free == pool.ledger.backed_free == 0
    assert pool.free_block_queue.num_free_blocks == 15
    assert pool.admit_running(BLOCK * 4), "every CLEAN block (none) is backed: no admission work"
    assert pool.get_num_free_blocks() == 15
    maps = pool.page_pool.counters().maps
    taken = pool.get_new_blocks(6)  # positional: cached blocks, evicted natively
    assert pool.page_pool.counters().maps == maps and all(pool.state_of(b.block_id) == "live" for b in taken)
    pool.check()
    other = rigs().pool  # 3 CLEAN blocks backed on page 0, 12 on unmapped pages
    other.running_block_sizes = (BLOCK,)
    assert other.ledger.backed_free == 3 < other.ledger.num_free
    assert not other.admit_running(BLOCK * 2)


def test_a_schedule_call_opens_the_gate_exactly_when_every_clean_block_is_backed(rigs) -> None:
    """`begin_schedule` caches `admit_running`'s second test for one schedule call (closed:
    a CLEAN block unbacked, faults injected, no group sizes, or after `end_schedule`). Open or
    closed, the free count without a demand is the same: open only skips the work."""
    pool = rigs().pool
    pool.running_block_sizes = (BLOCK,)
    for mapped_all in (False, True):
        if mapped_all:
            pool.ledger.ensure_backed(pool.ledger.num_free)
        pool.begin_schedule()
        assert pool.running_open is mapped_all, f"every CLEAN block backed: {mapped_all}"
        expected = 15 if mapped_all else 3  # the native count once every CLEAN block is backed
        assert pool.get_num_free_blocks() == expected
        pool.end_schedule()
        assert not pool.running_open and pool.get_num_free_blocks() == expected
    pool.running_block_sizes = ()  # a group that is not full attention: no gate
    pool.begin_schedule()
    assert not pool.running_open
    faulty = rigs(faults=FaultInjector.from_plans([])).pool
    faulty.running_block_sizes = (BLOCK,)
    faulty.ledger.ensure_backed(faulty.ledger.num_free)
    faulty.begin_schedule()
    assert not faulty.running_open, "off while faults are injected, as the gate is"
