"""The descriptor reading the soak, the sharing run and the teardown check share."""

from __future__ import annotations

import os
import subprocess
import sys

from conformance.procfs import descriptors


def test_kvcached_memfds_are_counted_and_others_are_not() -> None:
    before = descriptors([os.getpid()])
    mine, other = os.memfd_create("kvcached-test"), os.memfd_create("someone-else")
    try:
        assert descriptors([os.getpid()]) == (before[0] + 2, before[1] + 1)
    finally:
        os.close(mine)
        os.close(other)
    assert descriptors([os.getpid()]) == before


def test_a_process_that_is_gone_counts_nothing() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert descriptors([gone.pid]) == (0, 0)
    assert descriptors([os.getpid(), gone.pid]) == descriptors([os.getpid()])


def test_segments_a_killed_process_group_left_are_reclaimed_and_live_ones_kept() -> None:
    """A process SIGKILLed with its resource tracker (as a killed engine is) leaves its segment in
    /dev/shm; `reclaim_segments` unlinks it. A segment a live process maps (this one's, made
    after ``since`` too) stays: another engine running beside."""
    import signal
    from multiprocessing import shared_memory

    from conformance.procfs import SHM, reclaim_segments, shared_memory_segments

    since = shared_memory_segments()
    code = ("from multiprocessing import shared_memory as s; m = s.SharedMemory(create=True, size=4096); "
            "print(m.name, flush=True); import time; time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    live = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert child.stdout is not None
        left = child.stdout.readline().strip()
        os.killpg(child.pid, signal.SIGKILL)  # the child and its tracker: nothing unlinks the segment
        child.wait()
        assert os.path.exists(f"{SHM}/{left}")
        reclaimed = reclaim_segments(since)  # other tests' orphans (a parallel run) may be among them
        assert left in reclaimed and live.name not in reclaimed
        assert not os.path.exists(f"{SHM}/{left}") and os.path.exists(f"{SHM}/{live.name}")
        assert left not in reclaim_segments(since)
    finally:
        live.close()
        live.unlink()
