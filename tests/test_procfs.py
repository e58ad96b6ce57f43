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
