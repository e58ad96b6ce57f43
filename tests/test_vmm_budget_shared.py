"""A Budget with a path is one pool shared by real processes, like one GPU's memory."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.synchronize as mps
import os
import signal
import stat
from pathlib import Path

import pytest

from kvcached import _vmm
from kvcached.errors import ConfigError, PhysicalMemoryExhausted

PS = 2 << 20
LIMIT = 8 * PS
TIMEOUT = 60


def hog(path: str, pages: int, took: mps.Event, release: mps.Event, released: mps.Event) -> None:
    """Child: attach to the shared budget, hold `pages` pages until told to let go."""
    budget = _vmm.Budget(0, path)  # 0 = attach with the arena's limit
    r = _vmm.VirtualRange("cpu", pages * PS, PS, budget)
    r.map(range(pages))
    took.set()
    if not release.wait(TIMEOUT):
        os._exit(3)
    r.unmap(range(pages))
    released.set()


def hog_and_die(path: str, pages: int, took: mps.Event) -> None:
    """Child: take pages and get killed without any cleanup."""
    budget = _vmm.Budget(0, path)
    r = _vmm.VirtualRange("cpu", pages * PS, PS, budget)
    r.map(range(pages))
    took.set()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def ctx() -> mp.context.SpawnContext:
    return mp.get_context("spawn")


def test_arena_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "budget"
    budget = _vmm.Budget(LIMIT, str(path))
    assert budget.path == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (budget.limit, budget.used) == (LIMIT, 0)


def test_attach_keeps_or_replaces_limit(tmp_path: Path) -> None:
    path = str(tmp_path / "budget")
    first = _vmm.Budget(LIMIT, path)
    r = _vmm.VirtualRange("cpu", 2 * PS, PS, first)
    r.map([0])
    second = _vmm.Budget(0, path)
    assert (second.limit, second.used) == (LIMIT, PS)
    third = _vmm.Budget(2 * LIMIT, path)
    assert first.limit == 2 * LIMIT and third.used == PS
    first.limit = PS
    assert second.available == 0


def test_not_a_budget_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"x" * 4096)
    with pytest.raises(ConfigError):
        _vmm.Budget(LIMIT, str(bogus))
    short = tmp_path / "short"
    short.write_bytes(b"x")
    with pytest.raises(ConfigError):
        _vmm.Budget(LIMIT, str(short))


def test_other_process_takes_the_memory(tmp_path: Path, ctx: mp.context.SpawnContext) -> None:
    path = str(tmp_path / "budget")
    budget = _vmm.Budget(LIMIT, path)
    r = _vmm.VirtualRange("cpu", LIMIT, PS, budget)
    took, release, released = ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=hog, args=(path, 6, took, release, released))
    child.start()
    try:
        assert took.wait(TIMEOUT)
        assert budget.used == 6 * PS
        with pytest.raises(PhysicalMemoryExhausted):
            r.map([0, 1, 2])  # only 2 pages are left
        assert r.num_mapped == 0 and budget.used == 6 * PS
        r.map([0, 1])
        release.set()
        assert released.wait(TIMEOUT)
        r.map([2, 3, 4])
        assert budget.used == 5 * PS
    finally:
        release.set()
        child.join(TIMEOUT)
    assert child.exitcode == 0


def test_dead_process_memory_comes_back(tmp_path: Path, ctx: mp.context.SpawnContext) -> None:
    path = str(tmp_path / "budget")
    budget = _vmm.Budget(LIMIT, path)
    took = ctx.Event()
    child = ctx.Process(target=hog_and_die, args=(path, 7, took))
    child.start()
    assert took.wait(TIMEOUT)
    child.join(TIMEOUT)
    assert child.exitcode == -signal.SIGKILL
    assert budget.used == 7 * PS  # the dead child's charge is still on the books...
    r = _vmm.VirtualRange("cpu", LIMIT, PS, budget)
    r.map(range(4))  # ...until admission runs short and reclaims it
    assert budget.used == 4 * PS
