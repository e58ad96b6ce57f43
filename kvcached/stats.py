"""`kvcached.stats()`: a snapshot of every live elastic pool in this process."""

from __future__ import annotations

import itertools
import json
import re
import threading
import weakref
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Protocol


class PoolHealth(str, Enum):
    """Whether a pool's pages all behave (`PagePool.health`).

    * ``HEALTHY``: no page is quarantined.
    * ``DEGRADED``: some pages are quarantined (an unmap failed in some backing or rank);
      they are never handed out, stay charged, and are retried with a backoff. The pool
      serves on with the rest and returns to ``HEALTHY`` once a retry succeeds.
    * ``FAILED``: the quarantine failed `kvcached.policies.FAILED_AFTER` retries in a row: the backend keeps
      refusing to give that memory back, which will likely last until the engine restarts.
      The pool still serves (refusing to would strand running requests) and keeps retrying
      at the slowest pace; ``kvcached.stats()`` reports it so health checks can act.
    """

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool at one instant. Invariant: ``reserved_idle_bytes <= mapped_bytes <=
    peak_mapped_bytes``, all multiples of ``kv_page_bytes``; ``live_blocks <= capacity_blocks``.

    ``kv_page_bytes`` is one kv page across every backing (the unit pages are mapped in);
    ``vmm_page_bytes`` is the virtual-memory page of each backing (``KVCACHED_PAGE_SIZE``).
    ``rank_round_trips`` counts the blocking page requests sent to the engine's ranks
    (``kvcached.ranks``); the reserve keeps it at zero while it covers the demand.

    ``page_takes`` counts kv pages handed to blocks; ``reserve_hits`` those that were
    already mapped when taken (no driver call and no wait on the scheduler's path: the
    reserve, or a refill sent ahead whose reply was in). ``blocking_maps`` counts kv pages
    mapped on the scheduler's path, or whose refill it had to wait for (0 while the reserve
    covers the demand); ``maps`` counts every page mapped, refills sent ahead included.
    ``blocking_unmaps`` counts kv pages unmapped on the scheduler's path, or whose unmap it
    had to wait for (an engine whose ranks take unmaps without waiting: only a page wanted
    again while it drains); ``unmaps`` counts every page unmapped. `path_pages` is the two
    together: the driver work a step waited for.

    ``map_failures`` counts page-map batches the backend refused; ``admission_misses``
    counts admission checks the pool had to answer with fewer blocks than asked because
    memory was short or a fault was injected (each is a scheduling miss for the caller,
    and a retried request counts again). ``unmap_failures`` counts unmap batches a backing
    or a rank refused; ``quarantined_pages`` are the pages waiting for a successful retry
    (never handed out meanwhile, still held). ``health`` is ``"healthy"``, ``"degraded"``
    (pages quarantined) or ``"failed"`` (the quarantine resisted every retry so far; see
    `PoolHealth`). ``budget_error`` says why the engine's budget record
    cannot be read now (``""`` while it can): the pool then serves on with the pages it has
    mapped and maps no more until the record is readable again (`kvcached.budget`).
    """

    mapped_bytes: int
    peak_mapped_bytes: int
    reserved_idle_bytes: int
    live_blocks: int
    capacity_blocks: int
    kv_page_bytes: int
    vmm_page_bytes: int
    rank_round_trips: int
    maps: int
    unmaps: int
    map_failures: int
    admission_misses: int
    page_takes: int = 0
    reserve_hits: int = 0
    blocking_maps: int = 0
    unmap_failures: int = 0
    quarantined_pages: int = 0
    health: PoolHealth = PoolHealth.HEALTHY
    budget_error: str = ""
    blocking_unmaps: int = 0

    @property
    def path_pages(self) -> int:
        """kv pages mapped, unmapped or waited for on the scheduler's path."""
        return self.blocking_maps + self.blocking_unmaps

    @property
    def reserve_hit_rate(self) -> float:
        """``reserve_hits / page_takes`` (1.0 before any take)."""
        return self.reserve_hits / self.page_takes if self.page_takes else 1.0


class StatsSource(Protocol):
    def pool_stats(self) -> PoolStats: ...


_lock = threading.Lock()
_sources: weakref.WeakValueDictionary[str, StatsSource] = weakref.WeakValueDictionary()
_seq = itertools.count()


def register(name: str, source: StatsSource) -> str:
    """Register a pool under ``name`` (made unique with a suffix); held weakly."""
    with _lock:
        key = name if name not in _sources else f"{name}#{next(_seq)}"
        _sources[key] = source
        return key


def unregister(key: str) -> None:
    with _lock:
        _sources.pop(key, None)


def stats() -> dict[str, PoolStats]:
    """Per pool: mapped, peak and reserved-but-idle bytes, live blocks, capacity, page size, counters."""
    with _lock:
        items = list(_sources.items())
    return {name: source.pool_stats() for name, source in items}


#: What an engine logs when its pool closes (`shutdown_line`), before the counters as JSON.
SHUTDOWN_MARK = "kvcached: pool at shutdown: "


def shutdown_line(s: PoolStats) -> str:
    """The pool's whole snapshot as one log line at engine shutdown: a server's lifetime figures
    (driver work on the scheduler's path, refills sent ahead, rank round trips) for whoever reads
    its log afterwards (`parse_shutdown_lines`)."""
    return SHUTDOWN_MARK + json.dumps(asdict(s), sort_keys=True, default=str)


def parse_shutdown_lines(log: str) -> list[dict[str, object]]:
    """Every `shutdown_line` in ``log`` (one per pool that closed), as dictionaries; malformed
    JSON after the mark raises ``ValueError`` naming the line."""
    out = []
    for m in re.finditer(re.escape(SHUTDOWN_MARK) + r"(\{.*\})", log):
        try:
            out.append(json.loads(m.group(1)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"unreadable kvcached shutdown line: {m.group(0)[:200]!r}") from exc
    return out
