"""PageSpace and PagePool: which kv pages are physically mapped.

A *kv page* is the unit the block ledger reasons about: a fixed run of logical blocks.
Mapping kv page ``p`` maps VMM pages ``[p*k_r, (p+1)*k_r)`` of every backing range ``r``
(one backing per KV tensor, all indexed by the same block ids), so one kv page is the
same set of block ids in every layer.

`PagePool` is policy over that mechanism:

* pages handed to the ledger are *in use*; idle mapped pages form the *reserve*;
  invariant: ``mapped == in_use | reserve`` and ``in_use & reserve == {}``;
* the reserve is refilled after a take up to the *pace* (pages taken per step lately,
  decaying by one a step), at least ``min_reserve_pages`` and at most
  ``max_reserve_pages``, and trimmed down to ``max_reserve_pages`` by `collect`, but only
  pages whose fence ticket has passed are unmapped (a step still in flight may touch them);
* a batch map is all-or-nothing: a failure in the middle unmaps what the batch mapped;
* the physical-capacity query is cached for ``capacity_ttl_s`` and invalidated by this
  pool's own map/unmap, so only other processes' changes can be stale;
* a *limit* (``limit_pages``, read from the ``limiter`` after every step: the engine's own
  limit, or the device's global one while it is exceeded) bounds the mapped pages, refills
  in flight included: capacity and refills stop at it, and `collect` gives back reserve
  pages (as the fence allows) while the pool is over it. In-use pages are never taken:
  `over_limit` says how many pages the reserve cannot cover, for the caller to empty;
* a space whose maps are round trips to other processes (``DeferredMaps``: the ranks of a
  multiprocess engine) has its reserve refilled *ahead of demand* without waiting: the
  refill is sent, its pages are ``pending`` (neither in use nor in the reserve, never
  handed out, never unmapped), and they join the reserve once every rank confirmed, at the
  pool's next decision. A refused refill leaves nothing mapped and is counted as a map
  failure. So a step whose demand the reserve covers waits for no round trip.

Cost: every decision is proportional to the pages it touches, never to the space. The
mapped set is kept as it changes, the lowest unmapped pages come from a lazy min-heap,
and a watcher (the block ledger) hears every change of the mapped set.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvcached.config import KvcachedConfig
from kvcached.errors import BackendError, ConfigError, InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence


class Range(Protocol):
    """What the pool needs from a backing (`kvcached._vmm.VirtualRange` satisfies it)."""

    @property
    def page_size(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_mapped(self) -> int: ...
    def is_mapped(self, page: int) -> bool: ...
    def map(self, pages: Sequence[int]) -> None: ...
    def unmap(self, pages: Sequence[int]) -> None: ...
    def physical_available(self) -> int: ...


class Charger(Protocol):
    """Where mapped bytes are charged (`kvcached.budget.Slot`: the device's shared record)."""

    def charge(self, nbytes: int) -> bool: ...
    def refund(self, nbytes: int) -> None: ...
    def available(self) -> int | None: ...


class Limiter(Protocol):
    """Where an engine's page limit comes from (`kvcached.budget.EngineBudget`): asked after
    every step with what the pool has mapped; answers the most kv pages it may have mapped
    (None: no limit)."""

    def poll(self, *, mapped: int, in_use: int, reserved: int) -> int | None: ...
    def close(self) -> None: ...


class Confirmation(Protocol):
    """A map request in flight: `result` waits for it, and raises as ``map_pages`` would
    (nothing of the batch mapped anywhere) when it was refused; `done` says whether its
    replies are in (so `result` would not wait)."""

    def result(self) -> None: ...
    def done(self) -> bool: ...


class DeferredMaps(Protocol):
    """A space that can send a map without waiting for it (see `PagePool`)."""

    def map_pages_later(self, kv_pages: Sequence[int]) -> Confirmation: ...


class KvPageSpace(Protocol):
    """What a `PagePool` maps into: kv pages of one engine's KV cache.

    `PageSpace` is the local one (this process's ranges); ``kvcached.ranks.RankedPageSpace``
    maps the same kv pages on every rank of a multiprocess engine through a channel.
    ``map_pages`` is all-or-nothing: when it raises, no page of the batch is mapped.
    """

    @property
    def num_kv_pages(self) -> int: ...
    @property
    def kv_page_bytes(self) -> int: ...
    @property
    def vmm_page_bytes(self) -> int: ...
    @property
    def round_trips(self) -> int: ...
    def map_pages(self, kv_pages: Sequence[int]) -> None: ...
    def unmap_pages(self, kv_pages: Sequence[int]) -> None: ...
    def physical_available(self) -> int: ...


@dataclass(frozen=True)
class PageSpace:
    """Geometry: kv page -> VMM pages of each backing.

    ``charger``: where this process's mapped bytes are charged (None: nowhere). A batch is
    charged whole before anything is mapped (refused: `PhysicalMemoryExhausted`, nothing
    mapped) and, whatever happens, the charge is then set right from what the ranges
    report mapped, so it never drifts from the truth, not even after a failed rollback.

    Invariant: every range holds at least ``num_kv_pages * vmm_pages_per_kv_page[r]`` pages;
    with a charger, its charge for this space == bytes mapped in ``ranges``.
    """

    ranges: tuple[Range, ...]
    vmm_pages_per_kv_page: tuple[int, ...]
    num_kv_pages: int
    charger: Charger | None = None

    def __post_init__(self) -> None:
        if len(self.ranges) != len(self.vmm_pages_per_kv_page) or not self.ranges:
            raise ConfigError("PageSpace needs one vmm_pages_per_kv_page entry per range")
        for r, k in zip(self.ranges, self.vmm_pages_per_kv_page, strict=True):
            if k <= 0 or r.num_pages < k * self.num_kv_pages:
                raise ConfigError(
                    f"backing of {r.num_pages} pages cannot hold {self.num_kv_pages} kv pages "
                    f"of {k} VMM pages"
                )

    @property
    def vmm_page_bytes(self) -> int:
        return self.ranges[0].page_size

    @property
    def round_trips(self) -> int:
        """Blocking requests to other processes: none, the ranges are this process's."""
        return 0

    @property
    def kv_page_bytes(self) -> int:
        return sum(r.page_size * k for r, k in zip(self.ranges, self.vmm_pages_per_kv_page, strict=True))

    def vmm_pages(self, r: int, kv_page: int) -> range:
        k = self.vmm_pages_per_kv_page[r]
        return range(kv_page * k, (kv_page + 1) * k)

    def mapped_bytes(self) -> int:
        """Bytes mapped in this space's ranges, as they report it."""
        return sum(r.num_mapped * r.page_size for r in self.ranges)

    def map_pages(self, kv_pages: Sequence[int]) -> None:
        """Map every page of the batch in every range; all-or-nothing across the batch.

        On a failure the batch is unmapped in every backing that mapped any of it. If that
        undo fails too, its error is raised (chained to the first) and the pages it could
        not unmap are still mapped somewhere: `still_mapped` names them, and the caller
        must not treat them as free (`PagePool` quarantines them)."""
        if not kv_pages:
            return
        charged = 0
        if self.charger is not None:
            before, charged = self.mapped_bytes(), len(kv_pages) * self.kv_page_bytes
            if not self.charger.charge(charged):
                raise PhysicalMemoryExhausted(
                    f"physical budget exhausted mapping {len(kv_pages)} kv page(s) of {self.kv_page_bytes} bytes: "
                    f"{self.charger.available()} bytes available")
        done: list[int] = []
        partly: list[int] = []  # the backings that mapped the page in progress
        try:
            for page in kv_pages:
                partly = []
                for r, vrange in enumerate(self.ranges):
                    vrange.map(list(self.vmm_pages(r, page)))
                    partly.append(r)
                done.append(page)
        except BaseException:
            try:
                # Only what this call mapped: the whole pages, and the page in progress in
                # the backings that took it.
                self._unmap_each([[*done, page] if r in partly else done for r in range(len(self.ranges))])
            finally:
                if self.charger is not None:  # keep what is still mapped charged, refund the rest
                    self.charger.refund(charged - (self.mapped_bytes() - before))
            raise

    def unmap_pages(self, kv_pages: Sequence[int], *, strict: bool = True) -> None:
        """Unmap ``kv_pages`` in every backing. ``strict``: a page no backing maps is an
        `InvariantError`, raised before anything is unmapped; a retry after a partial failure
        passes False (what is left is unmapped, what is gone is skipped)."""
        if not kv_pages:
            return
        before = self.mapped_bytes() if self.charger is not None else 0
        try:
            self._unmap(kv_pages, strict=strict)
        finally:
            if self.charger is not None:  # what was unmapped, even if another range then failed
                self.charger.refund(before - self.mapped_bytes())

    def still_mapped(self, kv_pages: Sequence[int]) -> list[int]:
        """Those of ``kv_pages`` that some backing still maps (any of their VMM pages)."""
        return [p for p in kv_pages
                if any(vrange.is_mapped(v) for r, vrange in enumerate(self.ranges) for v in self.vmm_pages(r, p))]

    def _unmap(self, kv_pages: Sequence[int], strict: bool = False) -> None:
        self._unmap_each([kv_pages] * len(self.ranges), strict)

    def _unmap_each(self, kv_pages: Sequence[Sequence[int]], strict: bool = False) -> None:
        """Unmap in each backing ``r`` what it still maps of ``kv_pages[r]``. Every backing
        is tried even after one fails (the first error is raised after), and a page already
        unmapped in a backing is skipped there: a retry after a partial failure finishes.
        ``strict``: a page no backing maps is an `InvariantError`, before anything changes."""
        plan: list[list[int]] = []  # VMM pages to unmap, per backing (one is_mapped pass)
        held: set[int] = set()
        for r, vrange in enumerate(self.ranges):
            wanted: list[int] = []
            for p in kv_pages[r]:
                mapped = [v for v in self.vmm_pages(r, p) if vrange.is_mapped(v)]
                if mapped:
                    held.add(p)
                    wanted += mapped
            plan.append(wanted)
        if strict and (lost := sorted({p for pages in kv_pages for p in pages} - held)):
            raise InvariantError(f"kv pages {lost} are not mapped in any backing")
        first: BaseException | None = None
        for vrange, wanted in zip(self.ranges, plan, strict=True):
            if not wanted:
                continue
            try:
                vrange.unmap(wanted)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other backings
                first = first or exc
        if first is not None:
            raise first

    def physical_available(self) -> int:
        """Bytes this space could still map: the device's free memory, at most the budget's."""
        # All backings of one space draw on the same device (and record).
        device = self.ranges[0].physical_available()
        budget = self.charger.available() if self.charger is not None else None
        return device if budget is None else min(device, budget)


class PoolHealth(str, Enum):
    """Whether a pool's pages all behave (`PagePool.health`).

    * ``HEALTHY``: no page is quarantined.
    * ``DEGRADED``: some pages are quarantined (an unmap failed in some backing or rank);
      they are never handed out, stay charged, and are retried with a backoff. The pool
      serves on with the rest and returns to ``HEALTHY`` once a retry succeeds.
    * ``FAILED``: the quarantine failed `FAILED_AFTER` retries in a row: the backend keeps
      refusing to give that memory back, which will likely last until the engine restarts.
      The pool still serves (refusing to would strand running requests) and keeps retrying
      at the slowest pace; ``kvcached.stats()`` reports it so health checks can act.
    """

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


#: Failed quarantine retries in a row that make a pool FAILED.
FAILED_AFTER = 5
#: Backoff of quarantine retries, in steps (`collect` calls): 2, 4, 8, ... at most this many.
MAX_RETRY_STEPS = 1024


@dataclass(frozen=True, slots=True)
class PoolCounters:
    maps: int
    unmaps: int
    map_failures: int
    mapped_pages: int
    peak_mapped_pages: int
    reserve_pages: int
    takes: int = 0  # pages made in use
    reserve_hits: int = 0  # ... that were mapped already (no driver call, no wait)
    blocking_maps: int = 0  # pages mapped, or waited for, on the caller's path
    unmap_failures: int = 0  # unmap batches a backing refused (their pages quarantined)
    quarantined_pages: int = 0  # pages whose unmap failed somewhere, until a retry succeeds
    health: PoolHealth = PoolHealth.HEALTHY


class PagePool:
    """Maps and unmaps kv pages of one `PageSpace` under a reserve policy and a step fence."""

    def __init__(
        self,
        space: KvPageSpace,
        config: KvcachedConfig,
        *,
        fence: StepFence | None = None,
        faults: FaultInjector | None = None,
        limiter: Limiter | None = None,
    ) -> None:
        self.space = space
        self.config = config
        self.fence = fence if fence is not None else StepFence()
        self.faults = faults
        self.limiter = limiter
        self.limit_pages: int | None = None  # the limiter's last answer
        self._lock = threading.RLock()
        self.in_use: set[int] = set()
        self.reserve: dict[int, int] = {}  # kv page -> fence ticket of its release
        self.pending: dict[int, Confirmation] = {}  # kv page -> its refill in flight
        self._capacity: tuple[float, int] | None = None  # (time, kv pages) cache
        self._maps = self._unmaps = self._failures = self._unmap_failures = 0
        #: Pages an unmap failed for in some backing: neither in use nor in the reserve, never
        #: handed out or mapped again (they stay in the mapped set), retried by `collect`.
        self.quarantined: set[int] = set()
        # Quarantine retries: failed in a row, and the step (`collect` count) of the next one.
        self._retry_failures = 0
        self._steps = self._retry_at = 0
        self._takes = self._hits = self._blocking = 0
        # The reserve's pace: pages taken per step lately (`collect` ends a step). Refills
        # keep that many pages ahead, between the min and max watermarks, so a step whose
        # demand is several pages still finds them mapped.
        self._taken_this_step = 0
        self.pace = 0
        self._peak = 0
        self._mapped: set[int] = set()  # == in_use | reserve, kept as it changes
        # Candidates for the lowest unmapped pages: a min-heap that may hold stale entries
        # (pages mapped since, duplicates); `lowest_unmapped` drops them as it meets them.
        self._unmapped_heap = list(range(space.num_kv_pages))  # sorted, hence a heap
        self._watcher: Callable[[Sequence[int], Sequence[int]], None] | None = None

    # ---- queries -------------------------------------------------------------------
    @property
    def mapped(self) -> set[int]:
        """A copy of the usable mapped set (``in_use | reserve``), refills whose replies are in
        included; quarantined pages are not usable."""
        with self._lock:
            self._confirm(wait=False)
            return self._mapped - self.quarantined

    @property
    def num_mapped(self) -> int:
        with self._lock:
            self._confirm(wait=False)
            return len(self._mapped)

    @property
    def health(self) -> PoolHealth:
        with self._lock:
            if not self.quarantined:
                return PoolHealth.HEALTHY
            return PoolHealth.FAILED if self._retry_failures >= FAILED_AFTER else PoolHealth.DEGRADED

    def watch(self, watcher: Callable[[Sequence[int], Sequence[int]], None]) -> None:
        """Call ``watcher(mapped, unmapped)`` after every change of the mapped set.

        One watcher per pool (the ledger that sits on it); it must not call back into the
        pool's state changes.
        """
        if self._watcher is not None:
            raise InvariantError("this page pool already has a watcher")
        self._watcher = watcher

    def lowest_unmapped(self, n: int, *, skip_pending: bool = False) -> list[int]:
        """Up to ``n`` unmapped kv pages, lowest first (pages of a refill in flight count
        as unmapped unless ``skip_pending``). O(n log N) amortized; no state changes."""
        with self._lock:
            heap = self._unmapped_heap
            out: list[int] = []
            seen: set[int] = set()
            while heap and len(out) < n:
                page = heapq.heappop(heap)
                if page in seen or page in self._mapped:
                    continue  # a duplicate, or stale (pushed again when it is unmapped)
                seen.add(page)
                if not (skip_pending and page in self.pending):
                    out.append(page)
            for page in seen:
                heapq.heappush(heap, page)
            return out

    def settle(self) -> None:
        """Take in every refill whose replies have arrived (never waits)."""
        with self._lock:
            self._confirm(wait=False)

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` is mapped and usable (in use or in the reserve; not quarantined)."""
        with self._lock:
            self._confirm(wait=False)
            return page in self._mapped and page not in self.quarantined

    def capacity_pages(self) -> int:
        """kv pages this pool could map now (cached for ``capacity_ttl_s``)."""
        with self._lock:
            now = time.monotonic()
            if self._capacity is not None and now - self._capacity[0] < self.config.capacity_ttl_s:
                return min(self._capacity[1], self._room())
            pages = self.space.physical_available() // self.space.kv_page_bytes
            self._capacity = (now, pages)
            return min(pages, self._room())

    def _room(self) -> int:
        """Pages the limit still allows (refills in flight count as mapped); large if none."""
        if self.limit_pages is None:
            return self.space.num_kv_pages
        return max(0, self.limit_pages - len(self._mapped) - len(self.pending))

    def over_limit(self) -> int:
        """Pages mapped beyond the limit that the reserve cannot give back (in use)."""
        with self._lock:
            if self.limit_pages is None:
                return 0
            return max(0, len(self._mapped) + len(self.pending) - self.limit_pages - len(self.reserve))

    def counters(self) -> PoolCounters:
        """Counts; pages of a refill in flight count as mapped (they are, or are being)."""
        with self._lock:
            pending = len(self.pending)
            return PoolCounters(self._maps + pending, self._unmaps, self._failures,
                                len(self.in_use) + len(self.reserve) + pending,
                                max(self._peak, len(self.in_use) + len(self.reserve) + pending),
                                len(self.reserve) + pending, self._takes, self._hits, self._blocking,
                                self._unmap_failures, len(self.quarantined), self.health)

    # ---- mechanism -----------------------------------------------------------------
    def _map_batch(self, pages: Sequence[int]) -> None:
        """Map ``pages`` (all unmapped) into the reserve; all-or-nothing.

        Site ``"map"`` is checked once per page *before* anything is mapped, so an injected
        failure on the n-th page costs no mapping and the space sees one batch (one round
        trip for a space that spans ranks).
        """
        if not pages:
            return
        try:
            if self.faults is not None:
                for _ in pages:
                    self.faults.check("map")
            self.space.map_pages(pages)
        except BackendError:  # exhaustion, or a driver error: nothing of the batch is usable
            self._failures += 1
            self._capacity = None
            self._quarantine_stuck(pages)
            raise
        self._capacity = None
        self._maps += len(pages)
        for page in pages:
            self.reserve[page] = 0
        self._mapped_now(pages)

    def _mapped_now(self, pages: Sequence[int]) -> None:
        """Bookkeeping after ``pages`` joined the reserve (already entered there)."""
        self._mapped.update(pages)
        self._peak = max(self._peak, len(self._mapped))
        if self._watcher is not None:
            self._watcher(pages, ())

    def _map_with_retry(self, pages: Sequence[int], wait: bool) -> None:
        attempts = self.config.map_retries + 1 if wait else 1
        for attempt in range(attempts):
            try:
                self._map_batch(pages)
                return
            except PhysicalMemoryExhausted:
                self._capacity = None
                if attempt + 1 == attempts:
                    raise
                time.sleep(self.config.retry_backoff_s * (2**attempt))

    def _confirm(self, wait: bool, pages: Iterable[int] | None = None) -> None:
        """Settle refills in flight: confirmed pages join the reserve (ticket 0).

        ``wait=False`` settles only those whose replies are in (never waits); ``wait=True``
        settles those holding ``pages`` (default: all), waiting for their replies.
        """
        if not self.pending:
            return
        wanted = set(self.pending) if pages is None else set(pages)
        batches: dict[int, tuple[Confirmation, list[int]]] = {}
        for page, conf in self.pending.items():
            batches.setdefault(id(conf), (conf, []))[1].append(page)
        for conf, pages_ in batches.values():
            if not (conf.done() or (wait and wanted.intersection(pages_))):
                continue
            for page in pages_:
                del self.pending[page]
            try:
                conf.result()
            except BackendError:  # refused on some rank: undone on every rank (the protocol)
                self._failures += 1
                self._capacity = None
                continue
            self._maps += len(pages_)
            for page in pages_:
                self.reserve[page] = 0
            self._mapped_now(pages_)

    def _waits_for(self, pages: Iterable[int]) -> set[int]:
        """Those of ``pages`` in a refill whose replies are not in yet."""
        if not self.pending:
            return set()
        return {p for p in pages if p in self.pending and not self.pending[p].done()}

    def _refill_later(self, pages: list[int]) -> bool:
        """Send a refill without waiting (deferred spaces only); False if nothing was sent."""
        later = getattr(self.space, "map_pages_later", None)
        if later is None or not pages:
            return False
        try:
            if self.faults is not None:
                for _ in pages:
                    self.faults.check("map")
        except PhysicalMemoryExhausted:
            self._failures += 1
            return True  # refused on purpose: as if the ranks had refused it
        confirmation = later(pages)
        if confirmation.done():
            self._blocking += len(pages)  # it ran inline, on the caller's path (in-process worker)
        self._capacity = None
        for page in pages:
            self.pending[page] = confirmation
        return True

    def _unmap(self, pages: list[int]) -> None:
        """Unmap reserve ``pages``. If a backing (or a rank) refuses, the pages are
        quarantined instead: out of the reserve, never handed out or mapped again, still
        charged (the memory is still held somewhere), and retried by `collect`. The failure
        is counted (``unmap_failures``), not raised: the engine goes on without those pages."""
        if not pages:
            return
        for page in pages:
            del self.reserve[page]
        self._capacity = None
        if self._watcher is not None:
            self._watcher((), pages)  # the ledger stops counting their blocks either way
        try:
            self.space.unmap_pages(pages)
        except BackendError:
            self._unmap_failures += 1
            self.quarantined.update(pages)
            return
        self._forget(pages)

    def _forget(self, pages: Sequence[int]) -> None:
        """``pages`` are unmapped in every backing: they may be mapped again."""
        self._mapped.difference_update(pages)
        self._unmaps += len(pages)
        heap = self._unmapped_heap
        if len(heap) + len(pages) > 2 * self.space.num_kv_pages + 64:
            # Too many stale entries: rebuild (amortized over as many unmaps).
            heap[:] = [p for p in range(self.space.num_kv_pages) if p not in self._mapped]
        else:
            for page in pages:
                heapq.heappush(heap, page)

    def _unmap_space(self, pages: Sequence[int], strict: bool) -> None:
        if isinstance(self.space, PageSpace):
            self.space.unmap_pages(pages, strict=strict)
        else:  # the ranks keep their own books (`kvcached.ranks.RankPages`): a retry is theirs
            self.space.unmap_pages(pages)

    def _quarantine_stuck(self, pages: Sequence[int]) -> None:
        """After a failed map whose undo failed too: pages a backing still maps are
        quarantined (never handed out, retried by `collect`) instead of looking free."""
        still_mapped = getattr(self.space, "still_mapped", None)  # ranks undo their own (`kvcached.ranks`)
        stuck = still_mapped(pages) if still_mapped is not None else []
        if stuck:
            self._unmap_failures += 1
            self._mapped.update(stuck)
            self.quarantined.update(stuck)

    def _retry_quarantine(self, *, now: bool = False) -> None:
        """Unmap the quarantined pages again (each backing unmaps what it still maps), when
        the backoff allows (``now``: regardless). After ``k`` failures in a row the next try
        is ``2**k`` steps later (at most `MAX_RETRY_STEPS`): a backend that keeps refusing
        costs a failing call every few hundred steps, not one per step."""
        if not self.quarantined or (not now and self._steps < self._retry_at):
            return
        pages = sorted(self.quarantined)
        try:
            self._unmap_space(pages, strict=False)
        except BackendError:
            self._unmap_failures += 1
            self._retry_failures += 1
            self._retry_at = self._steps + min(2 ** self._retry_failures, MAX_RETRY_STEPS)
            return
        self._retry_failures = self._retry_at = 0
        self.quarantined.clear()
        self._capacity = None
        self._forget(pages)

    # ---- policy --------------------------------------------------------------------
    def acquire(self, pages: Iterable[int], *, wait: bool = False) -> None:
        """Make ``pages`` in use, mapping those not mapped in one batch (all-or-nothing).

        Raises `PhysicalMemoryExhausted` (or `InjectedFault`) with no state changed.
        """
        with self._lock:
            wanted = sorted(set(pages))
            waited = self._waits_for(wanted)
            # A refill this take needs is waited for; every other one only if its replies are in.
            self._confirm(wait=True, pages=wanted)
            for page in wanted:
                if page in self.in_use or not 0 <= page < self.space.num_kv_pages:
                    raise InvariantError(f"kv page {page} is already in use or out of range")
            missing = [p for p in wanted if p not in self.reserve]
            self._map_with_retry(missing, wait)
            blocked = len(waited.union(missing))
            self._taken_this_step += len(wanted)
            self._takes += len(wanted)
            self._hits += len(wanted) - blocked
            self._blocking += blocked
            for page in wanted:
                del self.reserve[page]
                self.in_use.add(page)
            self._top_up()

    def adopt(self, pages: Iterable[int]) -> None:
        """Take over kv pages someone else already mapped in every backing.

        They join the reserve with ticket 0 (no step of this pool can have used them) and
        count as mapped by this pool from now on (maps and peak included, so ``maps -
        unmaps`` stays the number of mapped pages); the pool unmaps them like its own. The
        caller guarantees they really are mapped; nothing is mapped here.
        """
        with self._lock:
            wanted = sorted(set(pages))
            for page in wanted:
                if page in self.in_use or page in self.reserve or page in self.pending \
                        or not 0 <= page < self.space.num_kv_pages:
                    raise InvariantError(f"kv page {page} is already known to the pool or out of range")
            for page in wanted:
                self.reserve[page] = 0
            self._maps += len(wanted)
            self._mapped_now(wanted)

    def prefetch(self, pages: Sequence[int]) -> int:
        """Map idle ``pages`` into the reserve; returns how many this call mapped.

        The pages not mapped yet go in one batch (one round trip to the ranks of a
        multiprocess engine, not one per page); if that runs out of memory, one at a time
        until capacity runs out, which is expected here, not an error. A page of a refill in
        flight is never mapped twice: it is waited for, after the batch (a channel that
        keeps order has its reply in by then).
        """
        with self._lock:
            pages = list(pages)
            in_flight = [p for p in pages if p in self.pending]
            missing = [p for p in pages if p not in self.in_use and p not in self.reserve and p not in self.pending]
            mapped = 0
            if missing:
                try:
                    self._map_batch(missing)
                    mapped = len(missing)
                except BackendError:  # short of memory, or a driver error: one page at a time
                    for page in missing:
                        try:
                            self._map_batch([page])
                        except BackendError:
                            break
                        mapped += 1
            self._blocking += len(self._waits_for(in_flight)) + mapped
            self._confirm(wait=True, pages=in_flight)
            return mapped

    def reserve_shortfall(self) -> int:
        """Pages the reserve lacks to reach its target (refills in flight count as there)."""
        with self._lock:
            return min(self._room(), max(0, self.reserve_target() - len(self.reserve) - len(self.pending)))

    def release(self, pages: Iterable[int]) -> None:
        """Pages with no held block go back to the reserve, ticketed by the fence."""
        with self._lock:
            ticket = self.fence.ticket()
            for page in pages:
                if page not in self.in_use:
                    raise InvariantError(f"kv page {page} released but not in use")
                self.in_use.discard(page)
                self.reserve[page] = ticket

    def collect(self, keep: int | None = None) -> int:
        """Unmap reserve pages above ``keep`` (default max_reserve_pages, less what the
        pool is over its limit by) whose ticket passed."""
        with self._lock:
            self._confirm(wait=False)  # a refill in flight is never unmapped here
            if keep is not None:
                return self._unmap_ready(keep)
            # The end of a step: its takes set the pace (decaying by one a step), and the
            # limit is read (and the pool's bytes published) for the next one.
            self.pace = max(self._taken_this_step, self.pace - 1)
            self._taken_this_step = 0
            self._steps += 1
            self._retry_quarantine()
            self._poll_limit()
            return self._unmap_ready(self._under_limit(self.config.max_reserve_pages), publish=True)

    def shed(self) -> int:
        """Unmap the reserve pages (those the fence allows) the pool is over its limit by."""
        with self._lock:
            self._confirm(wait=False)
            return self._unmap_ready(self._under_limit(len(self.reserve)), publish=True)

    def _under_limit(self, keep: int) -> int:
        """At most ``keep`` reserve pages, fewer while the pool is over its limit."""
        if self.limit_pages is None:
            return keep
        over = len(self._mapped) + len(self.pending) - self.limit_pages
        return max(0, min(keep, len(self.reserve) - over))

    def _unmap_ready(self, keep: int, publish: bool = False) -> int:
        """Unmap reserve pages above ``keep`` whose ticket passed; ``publish``: tell the
        limiter what is left at once (the engine may go idle right after)."""
        excess = len(self.reserve) - keep
        if excess <= 0:
            return 0
        # Highest page indices first: block choice prefers low pages, so this keeps the
        # mapped set compact.
        ready = sorted((p for p, t in self.reserve.items() if self.fence.passed(t)), reverse=True)
        victims = ready[:excess]
        self._unmap(victims)
        if victims and publish:
            self._poll_limit()
        return len(victims)

    def _poll_limit(self) -> None:
        if self.limiter is not None:
            mapped = len(self._mapped) + len(self.pending)
            self.limit_pages = self.limiter.poll(mapped=mapped, in_use=len(self.in_use),
                                                 reserved=mapped - len(self.in_use))

    def trim(self) -> int:
        """Give back every idle page the fence allows."""
        return self.collect(keep=0)

    def close(self) -> None:
        """Unmap everything (teardown). In-use pages are a caller bug only if the engine is alive."""
        with self._lock:
            self._confirm(wait=True)
            self.reserve.update({p: 0 for p in self.in_use})
            self.in_use.clear()
            self._unmap(sorted(self.reserve))
            self._retry_quarantine(now=True)  # what still fails now goes with the ranges' own close

    def reserve_target(self) -> int:
        """Pages the reserve refills to: the pace, within the watermarks."""
        return min(self.config.max_reserve_pages, max(self.config.min_reserve_pages, self.pace))

    def _top_up(self) -> None:
        need = self.reserve_shortfall()
        if need <= 0:
            return
        candidates = self.lowest_unmapped(need, skip_pending=True)
        if not self._refill_later(candidates):
            self.prefetch(candidates)
