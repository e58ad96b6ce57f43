"""What an engine left behind after its shutdown, read in the harness's engine process.

Used for cases whose plan ends in an engine error (`conformance.cases.FaultPlan.ends_in_engine_error`):
the error must return every byte the engine held, whichever process it lived in. The facts
(`conformance.results.TeardownFacts`) are judged by the comparator, not here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from conformance.procfs import descriptors
from conformance.results import TeardownFacts


def kvcached_memfds() -> int:
    """This process's open descriptors on kvcached's memfds (its CPU KV ranges)."""
    return descriptors([os.getpid()])[1]


#: How long the engine's processes may take to go after its shutdown returned: after an engine
#: error vLLM's workers notice their EngineCore is gone and exit on their own, a moment later.
SETTLE_S = 30.0


def facts(record_path: Path | None, memfds_before: int, settle_s: float = SETTLE_S) -> TeardownFacts:
    """Read once the engine was shut down: the case's budget record (live slots and their
    charges), kvcached spaces still registered here, memfds, and surviving engine processes.

    Engine processes (and so their slots) may outlive ``shutdown`` by a moment: the record and
    the process tree are read again until both are empty or ``settle_s`` has passed, and the
    time it took is reported; what is left then is a leak.
    """
    t0 = time.monotonic()
    while True:
        live, charged = _record(record_path)
        children = engine_processes()
        if (not live and not children) or time.monotonic() - t0 > settle_s:
            break
        time.sleep(0.1)
    from kvcached.integration.vllm.rank_kv import registered_rank_kv

    return TeardownFacts(record_live_slots=live, record_charged_bytes=charged,
                         registered_spaces=len(registered_rank_kv()), memfds_before=memfds_before,
                         memfds_after=kvcached_memfds(), live_children=children,
                         settle_s=round(time.monotonic() - t0, 2))


def _record(path: Path | None) -> tuple[int | None, int | None]:
    if path is None or not path.exists():
        return None, None
    from kvcached.budget import BudgetRecord

    with BudgetRecord(str(path), create=False) as record:
        snap = record.snapshot()
    return len(snap.slots), snap.used


def engine_processes() -> list[str]:
    """Live descendants of this process (EngineCore, workers, their helpers), except Python's
    multiprocessing resource tracker, which serves this process for its whole life."""
    import psutil  # type: ignore[import-untyped]  # no types-psutil in the environment

    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or "multiprocessing.resource_tracker" in " ".join(proc.cmdline()):
                continue
            out.append(f"{proc.name()} (pid {proc.pid})")
        except psutil.NoSuchProcess:
            continue
    return out
