"""An engine's limit at run time: the pool shrinks idle memory first, never live blocks, and
admits nothing new while over it. Real parts: a CPU `VirtualRange`, the device's budget record
(a file), the engine's row in it and `kvctl`'s own call to change the limit.

Geometry: 4 blocks per kv page of 4 KiB; block 0 is the null block, pinned on page 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_requests import make_request

from kvcached.budget import BudgetRecord, EngineBudget, EngineShare
from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
STRIDE = 1024
BLOCK = 16


class Engine:
    """One elastic pool charged to a budget record, registered there as engine ``name``."""

    def __init__(self, path: Path, name: str, num_blocks: int = 32, **cfg: object) -> None:
        geometry = plan_geometry([STRIDE], num_blocks, PAGE)
        self.record = BudgetRecord(str(path))
        slot = self.record.slot(rank=0, device="cpu")
        self.limiter = EngineBudget([EngineShare(self.record.engine(name, (slot.index,)), PAGE)], period_s=0.0)
        self.vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
        config = KvcachedConfig(page_size=PAGE, **{"min_reserve_pages": 0, "max_reserve_pages": 2,
                                                   "capacity_ttl_s": 0.0, "map_retries": 0,
                                                   "max_cached_blocks": -1, **cfg})
        space = KvSpace(geometry, (self.vrange,), charger=slot, limiter=self.limiter)
        self.pool = ElasticBlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK,
                                     kv_space=space, config=config, fence=StepFence(), name=name)
        self.name = name

    def step(self) -> None:
        """What the scheduler seam does after a step: the fence moves, the pool collects."""
        self.pool.fence.begin_step()
        self.pool.fence.end_step()
        self.pool.collect()

    def blocks(self, n: int, first_token: int) -> list:
        request = make_request(list(range(first_token, first_token + n * BLOCK)), BLOCK)
        blocks = self.pool.get_new_blocks(n)
        self.pool.cache_full_blocks(request, blocks, 0, n, BLOCK, 0)
        return blocks

    def admits(self, blocks: int, *, new: bool) -> bool:
        """One admission check of ``blocks`` new blocks, as vLLM's ``allocate_slots`` makes it."""
        with self.pool.admission(watermark=0, reserved=0, site="admission", new=new):
            self.pool.note_demand(blocks)
            return self.pool.get_num_free_blocks() >= blocks

    def mapped(self) -> list[int]:
        return self.vrange.mapped_pages()

    def close(self) -> None:
        self.pool.close()
        self.record.close()
        self.vrange.close()


@pytest.fixture
def engine(tmp_path: Path):
    made = Engine(tmp_path / "host.budget", "a")
    yield made
    made.close()


def test_a_lowered_limit_gives_back_idle_pages_then_cached_ones_never_live(engine: Engine) -> None:
    pool = engine.pool
    live = engine.blocks(6, 1)  # blocks 1-6: pages 0 and 1
    cached = engine.blocks(8, 1000)  # blocks 7-14: page 1's last block, pages 2 and 3
    assert {b.block_id // 4 for b in live} == {0, 1} and {b.block_id // 4 for b in cached} == {1, 2, 3}
    pool.free_blocks(reversed(cached))
    engine.step()
    assert engine.mapped() == [0, 1, 2, 3]  # cached blocks keep their pages (no cap)
    assert engine.admits(8, new=True)  # maps two more pages for the demand (and the reserve's)
    assert engine.mapped()[:6] == [0, 1, 2, 3, 4, 5]

    engine.record.set_engine_limit("a", 2 * PAGE)  # kvctl limit a 8KiB
    engine.step()
    # The idle pages went first, then the pages all of whose held blocks were free but
    # cached; page 1 keeps its cached block 7 beside the live ones.
    assert engine.mapped() == [0, 1]
    assert [pool.state_of(b.block_id) for b in live] == ["live"] * 6
    assert pool.state_of(7) == "cached" and {pool.state_of(b.block_id) for b in cached[1:]} == {"clean"}
    pool.check()
    # At its limit the engine maps nothing more: it admits only into what it has mapped,
    # here by evicting its own cached block 7 (reclaim), and no further.
    assert engine.admits(1, new=True) and pool.state_of(7) == "clean"
    assert not engine.admits(2, new=True)
    assert engine.mapped() == [0, 1]
    snap = engine.record.snapshot()
    row = snap.engine("a")
    assert row is not None and row.limit == 2 * PAGE and snap.charge_of(row) == 2 * PAGE

    engine.record.set_engine_limit("a", None)  # kvctl clear a
    engine.step()
    assert engine.admits(8, new=True) and len(engine.mapped()) > 2


def test_below_live_usage_nothing_new_is_admitted_until_under(engine: Engine) -> None:
    pool = engine.pool
    live = engine.blocks(5, 1)  # pages 0 and 1, page 1 holds blocks 4 and 5 (6, 7 free)
    engine.step()
    engine.record.set_engine_limit("a", PAGE)  # one page, under the two live ones
    engine.step()
    assert engine.mapped() == [0, 1], "live blocks are never taken"
    assert pool.page_pool.limit_pages == 1
    assert not engine.admits(1, new=True), "a new request is refused while over the limit"
    assert engine.admits(1, new=False), "a running request goes on, on the pages it has"
    assert pool.ledger.pool_stats().admission_misses >= 1
    pool.free_blocks(reversed(live[2:]))  # blocks 3, 4, 5 cached: page 1 holds no live block now
    engine.step()
    assert engine.mapped() == [0], "the cached page went as soon as it could"
    assert engine.admits(1, new=True), "at the limit again: admitted into its own cached block 3"
    assert engine.mapped() == [0] and pool.state_of(3) == "clean"


def test_a_global_limit_below_usage_makes_every_engine_give_back_idle_memory(tmp_path: Path) -> None:
    path = tmp_path / "host.budget"
    a, b = Engine(path, "a"), Engine(path, "b")
    try:
        for e in (a, b):
            e.pool.free_blocks(reversed(e.blocks(8, 1)))  # 2-3 pages of idle cached blocks each
            e.step()
        before = a.record.snapshot().used
        assert before >= 6 * PAGE
        a.record.set_limit(2 * PAGE)  # kvctl limit --global 8KiB: under what both hold
        for e in (a, b):
            e.step()
        for e in (a, b):
            e.step()  # the pages the fence held one step
        assert a.mapped() == [0] and b.mapped() == [0]  # only the null blocks' pages
        assert a.record.snapshot().used == 2 * PAGE
    finally:
        a.close()
        b.close()
