"""What an engine left behind after its shutdown, read in the harness's engine process.

Used for cases whose plan ends in an engine error (`conformance.cases.FaultPlan.ends_in_engine_error`):
the error must return every byte the engine held, whichever process it lived in. The facts
(`conformance.results.TeardownFacts`) are judged by the comparator, not here.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from conformance.results import TeardownFacts


def kvcached_memfds() -> int:
    """This process's open descriptors on kvcached's memfds (its CPU KV ranges)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvcached")
        except OSError:
            pass  # the listing's own descriptor, closed meanwhile
    return count


def facts(record_path: Path | None, memfds_before: int) -> TeardownFacts:
    """Read once the engine was shut down: the case's budget record (live slots and their
    charges), kvcached spaces still registered here, memfds, and surviving engine processes."""
    live = charged = None
    if record_path is not None and record_path.exists():
        from kvcached.budget import BudgetRecord

        with BudgetRecord(str(record_path), create=False) as record:
            snap = record.snapshot()
        live, charged = len(snap.slots), snap.used
    from kvcached.integration.vllm.worker import registered_rank_kv

    registered = len(registered_rank_kv())
    children = [f"{p.name} (pid {p.pid})" for p in multiprocessing.active_children()]
    return TeardownFacts(record_live_slots=live, record_charged_bytes=charged, registered_spaces=registered,
                         memfds_before=memfds_before, memfds_after=kvcached_memfds(), live_children=children)
