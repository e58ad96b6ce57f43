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
