"""What ``/proc`` says about processes' descriptors: the one reading that the soak, the
sharing run and the engine's teardown check use. kvcached names each CPU KV range's memfd
``kvcached...``, so ``/proc/<pid>/fd`` shows it as ``/memfd:kvcached...``."""

from __future__ import annotations

import os
from collections.abc import Iterable

KVCACHED_MEMFD = "/memfd:kvcached"


def descriptors(pids: Iterable[int]) -> tuple[int, int]:
    """Open descriptors over ``pids``, and kvcached's memfds among them. A process that
    exited meanwhile, or a descriptor closed while being read, counts nothing."""
    fds = memfds = 0
    for pid in pids:
        folder = f"/proc/{pid}/fd"
        try:
            entries = os.listdir(folder)
        except OSError:
            continue  # exited meanwhile
        for fd in entries:
            try:
                target = os.readlink(f"{folder}/{fd}")
            except OSError:
                continue  # closed meanwhile (the listing's own descriptor among them)
            fds += 1
            memfds += target.startswith(KVCACHED_MEMFD)
    return fds, memfds


#: Where POSIX shared memory lives, and the prefix of the segments Python's
#: ``multiprocessing.shared_memory`` names: vLLM's message queues between its processes.
SHM = "/dev/shm"
SEGMENT_PREFIX = "psm_"


def shared_memory_segments() -> set[str]:
    """The names of the ``multiprocessing.shared_memory`` segments in `SHM`."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(SEGMENT_PREFIX)}
    except OSError:
        return set()


def mapped_segments(names: Iterable[str]) -> set[str]:
    """Those of ``names`` that some live process maps (``/proc/<pid>/maps``)."""
    wanted = {f"{SHM}/{n}": n for n in names}
    found: set[str] = set()
    if not wanted:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                text = maps.read()
        except OSError:
            continue  # exited meanwhile
        found |= {n for path, n in wanted.items() if path in text}
    return found


def reclaim_segments(since: set[str]) -> list[str]:
    """Unlink the segments made after ``since`` that no live process maps, and name them.

    A process killed with SIGKILL, and its ``multiprocessing`` resource tracker with it, leaves
    its segments behind: vLLM's front end SIGKILLs EngineCore when it is stopped, and a
    process group SIGKILLed at a timeout loses its tracker too. A segment someone still maps
    (another engine's, running beside) is left alone.
    """
    new = shared_memory_segments() - since
    orphans = sorted(new - mapped_segments(new))
    for name in orphans:
        try:
            os.unlink(f"{SHM}/{name}")
        except FileNotFoundError:
            pass  # its owner's tracker got there first
    return orphans
