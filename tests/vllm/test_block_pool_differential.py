"""Differential test: vLLM 0.28's native `BlockPool` vs `ElasticBlockPool`.

Both pools receive the same operations, issued the way vLLM's managers issue them
(prefix lookup, touch, allocate, cache full and partial blocks, extend and promote,
copy-on-write hash moves, evict, free in reverse order, reset). Block identities
differ by design, so the test keeps a bijection between native and elastic block ids,
re-established whenever both pools hand out a block at the same position, and asserts
that everything else agrees: hits and misses, ref counts, free counts, the positional
(hashed) region of the free queue, hashes and aliases per block, and KV events. The
elastic pool's mapped pages must follow its live + cached blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, resolve_block_hashes
from vllm.v1.request import Request
from vllm_requests import make_request

from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
STRIDE = 1024  # 4 blocks per kv page
NUM_BLOCKS = 14  # small, so free CLEAN blocks run out; the last kv page is partial
BLOCK = 16
HASH = 4  # hash granularity finer than the block: partial entries and promotion
CHUNKS = ((1, 2, 3, 4), (5, 6, 7, 8), (1, 2, 3, 5), (9, 9, 9, 9))
# Shared "documents": prompts start with a prefix of one of them, so prefix hits
# (full and partial) are common.
DOCS = ((1, 2, 3, 4) * 3 + (5, 6, 7, 8) * 3, (9, 9, 9, 9, 1, 2, 3, 4) * 3)





def make_elastic(num_blocks: int = NUM_BLOCKS, hash_block_size: int = HASH, *, caching: bool = True,
                 events: bool = True, budget: object | None = None, **cfg: object) -> tuple[ElasticBlockPool, object]:
    geometry = plan_geometry([STRIDE], num_blocks, PAGE)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    # No cached-block cap (the default keeps 10% of the pool): the differential compares
    # against vLLM's own caching.
    config = KvcachedConfig(page_size=PAGE, **{"min_reserve_pages": 0, "max_reserve_pages": 0,
                                               "capacity_ttl_s": 0.0, "map_retries": 0,
                                               "max_cached_blocks": -1, **cfg})
    pool = ElasticBlockPool(num_gpu_blocks=num_blocks, enable_caching=caching, hash_block_size=hash_block_size,
                            enable_kv_cache_events=events, kv_space=KvSpace(geometry, (vrange,), charger=budget),  # type: ignore[arg-type]
                            config=config, faults=None, fence=StepFence(), name="test")
    return pool, vrange


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Seq:
    request: Request
    blocks: list[tuple[KVCacheBlock, KVCacheBlock]]  # (native, elastic), table order
    num_cached: int
    extra: list[tuple[KVCacheBlock, KVCacheBlock]] = field(default_factory=list)  # pins, CoW copies


class PoolDifferential(RuleBasedStateMachine):
    #: The elastic pool's knobs beyond `make_elastic`'s, and whether each step's `collect`
    #: says the engine is busy (the cached-block cap applies only when it is not).
    CFG: ClassVar[dict[str, object]] = {}
    BUSY = False

    def __init__(self) -> None:
        super().__init__()
        self.native = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=HASH,
                                enable_kv_cache_events=True)
        self.elastic, self.vrange = make_elastic(**self.CFG)
        self.n2e: dict[int, int] = {0: 0}
        self.e2n: dict[int, int] = {0: 0}
        self.live: list[Seq] = []

    def teardown(self) -> None:
        self.elastic.close()
        self.vrange.close()

    # ---- helpers --------------------------------------------------------------------
    def pair(self, native: list[KVCacheBlock], elastic: list[KVCacheBlock]) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        assert len(native) == len(elastic)
        for n, e in zip(native, elastic, strict=True):
            old_e = self.n2e.pop(n.block_id, None)
            if old_e is not None:
                self.e2n.pop(old_e, None)
            old_n = self.e2n.pop(e.block_id, None)
            if old_n is not None:
                self.n2e.pop(old_n, None)
            self.n2e[n.block_id] = e.block_id
            self.e2n[e.block_id] = n.block_id
        return list(zip(native, elastic, strict=True))

    def new_blocks(self, n: int) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        event("take: positional (evicts)" if n > self.elastic.ledger.num_free else "take: CLEAN only")
        return self.pair(self.native.get_new_blocks(n), self.elastic.get_new_blocks(n))

    def admissible(self, demand: int, protected: list[KVCacheBlock]) -> bool:
        """Admission as KVCacheManager does it: both pools must reach the same decision."""
        native_ok = demand <= self.native.get_num_free_blocks()
        self.elastic.note_demand(demand, (protected,))
        elastic_free = self.elastic.get_num_free_blocks()
        assert elastic_free <= self.native.get_num_free_blocks()
        assert (demand <= elastic_free) == native_ok
        return native_ok

    def cache(self, seq: Seq) -> None:
        """cache_full_blocks for every full block, then a partial entry for the tail."""
        num_tokens = seq.request.num_tokens
        num_full = num_tokens // BLOCK
        if any(p[0].block_hash_num_tokens is not None and p[0].block_hash_num_tokens % BLOCK
               for p in seq.blocks[seq.num_cached:num_full]):
            event("partial -> full promotion")
        for pool, side in ((self.native, 0), (self.elastic, 1)):
            pool.cache_full_blocks(seq.request, [p[side] for p in seq.blocks], seq.num_cached, num_full, BLOCK, 0)
        seq.num_cached = max(seq.num_cached, num_full)
        partial = num_tokens - num_tokens % HASH
        if partial % BLOCK and partial > 0 and num_full < len(seq.blocks):
            keys = [pool.cache_partial_block(seq.request, seq.blocks[num_full][side], partial, 0, BLOCK)
                    for pool, side in ((self.native, 0), (self.elastic, 1))]
            assert keys[0] == keys[1]

    # ---- rules ----------------------------------------------------------------------
    @rule(doc=st.sampled_from(DOCS), shared=st.integers(0, 24),
          chunks=st.lists(st.sampled_from(CHUNKS), max_size=4), tail=st.integers(0, 3))
    def admit(self, doc: tuple[int, ...], shared: int, chunks: list[tuple[int, ...]], tail: int) -> None:
        tokens = list(doc[:shared]) + [t for c in chunks for t in c] + [7] * tail
        if not tokens:
            return
        request = make_request(tokens, HASH)
        hashes = resolve_block_hashes(request.block_hashes, HASH, BLOCK)
        hits: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for i in range((len(tokens) - 1) // BLOCK):
            native_hit = self.native.get_cached_block(hashes[i], [0])
            elastic_hit = self.elastic.get_cached_block(hashes[i], [0])
            assert (native_hit is None) == (elastic_hit is None)
            if native_hit is None or elastic_hit is None:
                break
            assert self.n2e[native_hit[0].block_id] == elastic_hit[0].block_id
            hits.append((native_hit[0], elastic_hit[0]))
        need = cdiv(len(tokens), BLOCK) - len(hits)
        evictable = [p[0] for p in hits if p[0].ref_cnt == 0]
        event("admit: prefix hit" if hits else "admit: miss")
        if not self.admissible(need + len(evictable), [p[1] for p in hits]):
            event("admit: refused (pool full)")
            return
        self.native.touch([p[0] for p in hits])
        self.elastic.touch([p[1] for p in hits])
        seq = Seq(request, hits + self.new_blocks(need), num_cached=len(hits))
        self.cache(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 20))
    def extend(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        seq.request.append_output_token_ids([3] * n)
        need = cdiv(seq.request.num_tokens, BLOCK) - len(seq.blocks)
        if need > 0:
            if not self.admissible(need, []):
                return
            seq.blocks.extend(self.new_blocks(need))
        self.cache(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        blocks = seq.extra + seq.blocks
        self.native.free_blocks(reversed([p[0] for p in blocks]))
        self.elastic.free_blocks(reversed([p[1] for p in blocks]))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        picked = data.draw(st.lists(st.sampled_from(seq.blocks), min_size=1, max_size=3))
        self.native.touch([p[0] for p in picked])
        self.elastic.touch([p[1] for p in picked])
        seq.extra.extend(picked)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def move_hashes(self, data: st.DataObject) -> None:
        """Mamba-align CoW of a running request: its hashes move to a fresh copy block."""
        seq = data.draw(st.sampled_from(self.live))
        hashed = [p for p in seq.blocks if p[0].block_hash is not None]
        if not hashed or not self.admissible(1, []):
            return
        src = data.draw(st.sampled_from(hashed))
        dst = self.new_blocks(1)[0]
        self.native.move_block_hashes(src[0], dst[0])
        self.elastic.move_block_hashes(src[1], dst[1])
        seq.extra.append(dst)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
        # One id per call: a set's iteration order (hence event order) depends on the ids.
        for block_id in sorted(b for b in ids if b in self.n2e):
            self.native.evict_blocks({block_id})
            self.elastic.evict_blocks({self.n2e[block_id]})

    @rule()
    def reset(self) -> None:
        assert self.native.reset_prefix_cache() == self.elastic.reset_prefix_cache()

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def free_counts_agree(self) -> None:
        native_free = self.native.get_num_free_blocks()
        assert self.elastic.free_block_queue.num_free_blocks == native_free
        assert self.elastic.get_usage() == self.native.get_usage()

    @invariant()
    def blocks_agree_through_the_bijection(self) -> None:
        for n_id, e_id in self.n2e.items():
            n, e = self.native.blocks[n_id], self.elastic.blocks[e_id]
            assert n.ref_cnt == e.ref_cnt or n.is_null
            assert n.block_hash == e.block_hash
            assert n.block_hash_num_tokens == e.block_hash_num_tokens
            assert (self.native.cached_block_hashes_by_block.get(n_id)
                    == self.elastic.cached_block_hashes_by_block.get(e_id))
        # Unpaired blocks carry nothing observable: CLEAN on both sides.
        for pool, paired in ((self.native, self.n2e), (self.elastic, self.e2n)):
            for block in pool.blocks:
                if block.block_id not in paired:
                    assert block.ref_cnt == 0 and block.block_hash is None

    @invariant()
    def hash_maps_agree(self) -> None:
        native_map = self.native.cached_block_hash_to_block._cache
        elastic_map = self.elastic.cached_block_hash_to_block._cache
        assert native_map.keys() == elastic_map.keys()
        for key, value in native_map.items():
            n_ids = [value.block_id] if isinstance(value, KVCacheBlock) else list(value)
            other = elastic_map[key]
            e_ids = [other.block_id] if isinstance(other, KVCacheBlock) else list(other)
            assert [self.n2e[b] for b in n_ids] == e_ids  # same order: get_one_block agrees

    @invariant()
    def positional_region_agrees(self) -> None:
        def queue(pool: BlockPool) -> list[int]:
            return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]

        num_clean = self.elastic.ledger.num_free
        native_tail = queue(self.native)[num_clean:]
        elastic_tail = queue(self.elastic)[num_clean:]
        assert [self.n2e[b] for b in native_tail] == elastic_tail

    @invariant()
    def events_agree(self) -> None:
        assert self.native.take_events() == self.elastic.take_events()

    @invariant()
    def pages_follow_held_blocks(self) -> None:
        if self.elastic._stranded:
            event("STRANDED blocks present")
        self.elastic.check()
        self.elastic.collect(busy=self.BUSY)  # no step in flight: every ticket has passed
        held_pages = {self.elastic.ledger.page_of(b) for b in range(NUM_BLOCKS)
                      if self.elastic.ledger.is_held(b)}
        assert self.elastic.page_pool.mapped == held_pages
        vmm = self.elastic.page_pool.space.vmm_pages_per_kv_page[0]
        assert self.vrange.mapped_pages() == sorted(v for p in held_pages for v in range(p * vmm, (p + 1) * vmm))


PoolDifferential.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolDifferential = PoolDifferential.TestCase


class BusyCappedDifferential(PoolDifferential):
    """The strictest cap (0 cached blocks) changes nothing while the engine is busy: hits,
    evictions, events, free counts and queue order stay native (the cap waits for idle)."""

    CFG: ClassVar[dict[str, object]] = {"max_cached_blocks": 0}
    BUSY = True


BusyCappedDifferential.TestCase.settings = settings(PoolDifferential.TestCase.settings, max_examples=50)
TestBusyCappedDifferential = BusyCappedDifferential.TestCase
