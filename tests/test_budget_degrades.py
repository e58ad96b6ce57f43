"""A budget record that becomes unreadable under running engines: they degrade, then recover.

Before, a record truncated (another tool, an older kvcached, a disk error) while engines ran
made the next admission check and the next `collect` (vLLM's ``update_from_output``) raise
`BudgetRecordError` into EngineCore. Now every live entry's operation goes through one place
(`BudgetRecord._tolerant`): the engine serves on with the pages it has mapped, maps no
more, reports why (``kvcached.stats()``, the log once), and once a valid record is back its
entries are written back as they stand. Real parts: a CPU `VirtualRange`, the record's file,
the pool's own arena, and real processes where another engine takes part.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvcached
from kvcached.arena import ElasticArena
from kvcached.budget import BudgetRecord, EngineBudget, EngineShare, Slot
from kvcached.config import KvcachedConfig
from kvcached.space import KvSpace, plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096
STRIDE = 1024  # 4 blocks per kv page
TIMEOUT = 60


@dataclass
class Engine:
    """One pool charged to a real record, with its engine row as its limiter."""

    path: Path
    record: BudgetRecord
    slot: Slot
    limiter: EngineBudget
    arena: ElasticArena
    vrange: object

    @property
    def mapped(self) -> set[int]:
        return self.arena.pool.mapped

    def step(self) -> None:
        """The end of a step, as the scheduler seam runs it: the fence moves, the pool collects
        (and polls its limiter: vLLM's ``update_from_output`` path)."""
        self.arena.fence.begin_step()
        self.arena.fence.end_step()
        self.arena.pool.collect()

    def stats(self) -> kvcached.PoolStats:
        return kvcached.stats()[self.arena.stats_key]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    path = tmp_path / "host.budget"
    geometry = plan_geometry([STRIDE], 32, PAGE)
    record = BudgetRecord(str(path), limit=6 * PAGE)
    slot = record.slot(rank=0, device="cpu")
    limiter = EngineBudget([EngineShare(record.engine("a", (slot.index,)), PAGE)], period_s=0.0)
    vrange = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=8, capacity_ttl_s=0.0,
                            map_retries=0)
    arena = ElasticArena.open(KvSpace(geometry, (vrange,), charger=slot, limiter=limiter), config, name="degrade")
    made = Engine(path, record, slot, limiter, arena, vrange)
    yield made
    arena.close()
    record.close()
    vrange.close()


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, 10)
    else:  # foreign content of the right size
        path.write_bytes(b"NOTOURS!" + bytes(path.stat().st_size - 8))


@pytest.mark.parametrize("how", ["truncated", "foreign"])
def test_a_record_damaged_under_a_running_engine_degrades_then_recovers(
        engine: Engine, how: str, caplog: pytest.LogCaptureFixture) -> None:
    pool = engine.arena.pool
    assert pool.prefetch([1, 2, 3]) == 3
    engine.step()
    saved = engine.path.read_bytes()  # the record as it stood: 3 pages charged
    _damage(engine.path, how)
    caplog.set_level(logging.WARNING, logger="kvcached.budget")

    # Degraded: nothing raises; the pool keeps its pages and maps no more.
    assert pool.prefetch([4, 5]) == 0, "a charge the record cannot take is a miss"
    engine.step()
    assert engine.mapped == {1, 2, 3} and pool.limit_pages == 3, "capped at what it maps"
    assert engine.stats().budget_error and str(engine.path) in engine.stats().budget_error
    assert engine.limiter.failure == engine.record.failure
    assert engine.slot.available() == 0
    pool.collect(keep=1)  # giving back works on: the refund is kept until it can be written
    assert engine.mapped == {1} and engine.slot.charged == PAGE
    engine.step()
    warned = [r for r in caplog.records if "maps no more" in r.getMessage()]
    assert len(warned) == 1, "logged once"

    # A valid record back (here the old bytes: 3 pages charged, which is stale now).
    engine.path.write_bytes(saved)
    engine.step()
    assert engine.record.failure is None and engine.stats().budget_error == ""
    snap = engine.record.snapshot()
    assert snap.used == PAGE, "this process's charge written back as it stands"
    assert snap.engine("a") is not None and snap.engine("a").mapped == PAGE  # type: ignore[union-attr]
    assert pool.limit_pages is None
    assert pool.prefetch([2, 3]) == 2 and engine.record.snapshot().used == 3 * PAGE
    assert any("can be read again" in r.getMessage() for r in caplog.records)


# A child that claims a slot in the record, says which, and holds it until killed.
CLAIMER = textwrap.dedent("""
    import sys, time
    from kvcached.budget import BudgetRecord
    record = BudgetRecord(sys.argv[1])
    print(record.slot(rank=0, device="cpu", label="other").index, flush=True)
    time.sleep(600)
""")


def test_a_record_restored_from_before_a_process_claimed_gets_its_entry_back(tmp_path: Path) -> None:
    """A record restored from a copy older than a live slot shows that slot free. Another
    process starting then skips it (its lock is held), and the owner's next transaction
    writes it back with its charge."""
    path = tmp_path / "host.budget"
    BudgetRecord(str(path), limit=6 * PAGE).close()
    older = path.read_bytes()
    record = BudgetRecord(str(path))
    slot = record.slot(rank=0, device="cpu")
    assert slot.charge(2 * PAGE)
    path.write_bytes(older)
    other = subprocess.Popen([sys.executable, "-c", CLAIMER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        assert int(other.stdout.readline()) != slot.index, "a held slot is never handed out again"
        assert slot.available() == 4 * PAGE  # one transaction: the entry is back
        snap = record.snapshot()
        assert sorted(s.label for s in snap.slots) == ["", "other"] and snap.used == 2 * PAGE
    finally:
        other.kill()
        other.wait(TIMEOUT)
        slot.refund(2 * PAGE)
        record.close()
