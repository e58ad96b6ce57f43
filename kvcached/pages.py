"""PageSpace and PagePool: which kv pages are physically mapped.

A *kv page* is the unit the block ledger reasons about: a fixed run of logical blocks.
Mapping kv page ``p`` maps VMM pages ``[p*k_r, (p+1)*k_r)`` of every backing range ``r``
(one backing per KV tensor, all indexed by the same block ids), so one kv page is the
same set of block ids in every layer.

The space protocol (`KvPageSpace`) is the whole contract between a pool and where its
pages live: map a batch now (all-or-nothing), send one without waiting (`map_pages_later`;
``defers_maps`` says whether that returns before the maps are done), unmap (strictly, or
as a retry that skips what is gone), name the pages a failed map left behind
(`still_mapped`), and report capacity. `PageSpace` is this process's ranges;
``kvcached.ranks.RankedPageSpace`` is every rank of a multiprocess engine.

`PagePool` keeps the books of the mapped set and asks its policies
(``kvcached.policies``, one decision per object, given to it as `PoolPolicies`) what to do:

* pages handed to the ledger are *in use*; idle mapped pages form the *reserve*;
  invariant: ``mapped == in_use | reserve | quarantined`` (disjoint), and pages of a
  refill in flight are ``pending`` (none of those, never handed out, never unmapped);
* the reserve is refilled after a take up to `ReservePolicy.target` (the pace within the
  watermarks; while busy, up to a full step's pages) and trimmed by `collect` to what
  `ReservePolicy.keep` says, but only pages whose fence ticket has passed are unmapped (a
  step still in flight may touch them);
* a batch map is all-or-nothing: a failure in the middle unmaps what the batch mapped;
  `RetryPolicy` retries an exhausted map of a caller that waits;
* the physical-capacity query is cached (`CapacityCache`) and invalidated by this pool's
  own map/unmap, so only other processes' changes can be stale;
* `EngineLimit` bounds the mapped pages, refills in flight included: capacity and refills
  stop at it, and `collect` gives back reserve pages (as the fence allows) while the pool
  is over it. In-use pages are never taken: `over_limit` says how many pages the reserve
  cannot cover, for the caller to empty;
* a page whose unmap failed, or that a failed map's undo left mapped somewhere (the
  space's `still_mapped`), goes to the `Quarantine` (retried with a backoff; it decides
  the pool's `PoolHealth`);
* a fault plan's ``map`` site is a `FailingSpace` between the pool and its space;
* a space that defers maps (the ranks of a multiprocess engine) has its reserve refilled
  *ahead of demand* without waiting: the refill is sent, its pages are ``pending``, and
  they join the reserve once every rank confirmed, at the pool's next decision. A refused
  refill leaves nothing usable and is counted as a map failure (what a rank's failed undo
  left mapped is quarantined, as for a map that waits). So a step whose demand the
  reserve covers waits for no round trip;
* in such a space an unmap is sent the same way (`unmap_pages_later`): the pages leave the
  reserve and the ledger's books at once, are ``draining`` until every rank confirmed, and
  are never mapped or handed out before. So a step that gives pages back waits for no
  driver call either; a page wanted again while draining is waited for first.

Thread safety: every public method of `PagePool` holds its (re-entrant) lock, and the
policies are only called under it. A background thread (``kvcached-refill``) only
completes the confirmations of deferred maps and unmaps, which the pool reads under its
lock.

Cost: every decision is proportional to the pages it touches, never to the space. The
mapped set is kept as it changes, the lowest unmapped pages come from a lazy min-heap,
and a watcher (the block ledger) hears every change of the mapped set.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcached.config import KvcachedConfig
from kvcached.errors import BackendError, ConfigError, DriverError, InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.policies import (
    FAILED_AFTER,
    MAX_RETRY_STEPS,
    FailingSpace,
    Limiter,
    PoolHealth,
    PoolPolicies,
)

__all__ = [
    "FAILED_AFTER", "MAX_RETRY_STEPS", "UNMAP_BATCH_PAGES", "Charger", "Confirmation", "KvPageSpace", "Limiter",
    "PagePool", "PageSpace", "PendingRefills", "PoolCounters", "PoolHealth", "Range", "Settled",
]


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


class Confirmation(Protocol):
    """A map request in flight: `result` waits for it, and raises as ``map_pages`` would
    (nothing of the batch mapped anywhere) when it was refused; `done` says whether its
    replies are in (so `result` would not wait)."""

    def result(self) -> None: ...
    def done(self) -> bool: ...


class KvPageSpace(Protocol):
    """What a `PagePool` maps into: kv pages of one engine's KV cache.

    `PageSpace` is the local one (this process's ranges); ``kvcached.ranks.RankedPageSpace``
    maps the same kv pages on every rank of a multiprocess engine through a channel.

    * ``map_pages`` is all-or-nothing: when it raises, no page of the batch is usable; the
      pages its failed undo left mapped somewhere are those `still_mapped` names (the
      same for a `Confirmation` that raises).
    * ``map_pages_later`` sends a map and returns its `Confirmation`. ``defers_maps``: True
      when that returns before the maps are done (the pool then refills ahead of demand
      with it, and gives pages back with ``unmap_pages_later``); False when it maps at
      once, in which case the pool maps and unmaps itself and never calls either.
    * ``unmap_pages_later`` sends a strict unmap of pages no failed call left anywhere and
      returns its `Confirmation`, which raises as ``unmap_pages`` would (`still_mapped`
      then names what is left).
    * ``unmap_pages``: ``strict`` makes a page no backing maps an `InvariantError` before
      anything changes; a retry after a partial failure passes False (what is left is
      unmapped, what is gone is skipped). A failure raises `BackendError` after every
      backing (or rank) was tried; the pages it left mapped somewhere are those
      `still_mapped` names (the outcome is per page: the others are unmapped everywhere).
    * ``still_mapped``: asked after a failed map or unmap of those pages, names the ones
      some backing (or rank) still maps.
    """

    @property
    def num_kv_pages(self) -> int: ...
    @property
    def kv_page_bytes(self) -> int: ...
    @property
    def vmm_page_bytes(self) -> int: ...
    @property
    def round_trips(self) -> int: ...
    @property
    def defers_maps(self) -> bool: ...
    def map_pages(self, kv_pages: Sequence[int]) -> None: ...
    def map_pages_later(self, kv_pages: Sequence[int]) -> Confirmation: ...
    def unmap_pages(self, kv_pages: Sequence[int], *, strict: bool = True) -> None: ...
    def unmap_pages_later(self, kv_pages: Sequence[int]) -> Confirmation: ...
    def still_mapped(self, kv_pages: Sequence[int]) -> list[int]: ...
    def physical_available(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Settled:
    """The `Confirmation` of a map or unmap that already happened (or failed with ``error``)."""

    error: BackendError | None = None

    def done(self) -> bool:
        return True

    def result(self) -> None:
        if self.error is not None:
            raise self.error

    @classmethod
    def after(cls, call: Callable[[], None]) -> Settled:
        """Run ``call`` now: its confirmation, refused with the `BackendError` it raised."""
        try:
            call()
        except BackendError as exc:
            return cls(exc)
        return cls()


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
    def defers_maps(self) -> bool:
        """False: this process's ranges map at once."""
        return False

    def map_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        """Map now (nothing here can be deferred); the confirmation raises as `map_pages`
        would have."""
        return Settled.after(lambda: self.map_pages(kv_pages))

    def unmap_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        """Unmap now (strictly), as `map_pages_later` maps now."""
        return Settled.after(lambda: self.unmap_pages(kv_pages))

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

        One `Range.map` per range for the whole batch, not one per (kv page, range), and the
        native ranges' maps in one call (`kvcached._vmm.map_each`) that releases the GIL once
        for all of them: each retake of the GIL waits for the thread that holds it meanwhile
        (the scheduler's, where a refill maps in the background; up to the switch interval,
        5 ms), so a batch of 8 kv pages over 16 ranges paid 128 of those handoffs, then 16,
        now 1. (`serving_probes/map_rate_probe.py`, 12-07 on 2 CPU cores: a batch mapped one
        call per range beside a thread spinning Python took 4.5-6.4 ms a kv page, against
        16-20 µs alone.) A range's map is itself all-or-nothing (it maps the whole list or
        rolls back, csrc/vrange.cpp).

        On a failure the batch is unmapped in every backing that mapped any of it. If that
        undo fails too, its error is raised (chained to the first) and the pages it could
        not unmap are still mapped somewhere: `still_mapped` names them, and the caller
        must not treat them as free (`PagePool` quarantines them)."""
        if not kv_pages:
            return
        from kvcached._vmm import map_each  # the mechanism layer, under every real range

        charged = 0
        if self.charger is not None:
            before, charged = self.mapped_bytes(), len(kv_pages) * self.kv_page_bytes
            if not self.charger.charge(charged):
                raise PhysicalMemoryExhausted(
                    f"physical budget exhausted mapping {len(kv_pages)} kv page(s) of {self.kv_page_bytes} bytes: "
                    f"{self.charger.available()} bytes available")
        done: list[None] = []  # an entry per range that mapped the whole batch: ranges[:len(done)]
        try:
            map_each([(vrange, [v for page in kv_pages for v in self.vmm_pages(r, page)])
                      for r, vrange in enumerate(self.ranges)], done)
        except BaseException as exc:
            mapped = len(done)
            # The failing range mapped nothing, unless its own rollback failed (an unmap at
            # the OS mapping limit, csrc/vrange.cpp): what that left is this call's too, and
            # `_unmap_each` skips what a backing does not map. Not after an InvariantError:
            # the range refused the list before mapping anything (a page already mapped
            # there is not this call's to undo).
            undo = min(mapped + (not isinstance(exc, InvariantError)), len(self.ranges))
            try:
                self._unmap_each([kv_pages if r < undo else () for r in range(len(self.ranges))])
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
        is tried even after one fails (the first error is raised after; `kvcached._vmm.unmap_each`,
        the native ranges with the GIL released once), and a page already
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
        from kvcached._vmm import unmap_each  # one GIL release for the native ranges, as `map_pages`

        unmap_each([(vrange, wanted) for vrange, wanted in zip(self.ranges, plan, strict=True) if wanted])

    def physical_available(self) -> int:
        """Bytes this space could still map: the device's free memory, at most the budget's."""
        # All backings of one space draw on the same device (and record).
        device = self.ranges[0].physical_available()
        budget = self.charger.available() if self.charger is not None else None
        return device if budget is None else min(device, budget)


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """A snapshot of a pool's counts (`PagePool.counters`), as `kvcached.stats()` reports them."""

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
    blocking_unmaps: int = 0  # pages unmapped, or waited for, on the caller's path



@dataclass(slots=True)
class PoolTally:
    """A pool's running counts (`PoolCounters` is their snapshot)."""

    maps: int = 0  # pages mapped (and adopted)
    unmaps: int = 0  # pages unmapped in every backing
    map_failures: int = 0  # map batches refused (exhaustion, a driver error, a fault)
    takes: int = 0  # pages made in use
    reserve_hits: int = 0  # ... that were mapped already (no driver call, no wait)
    blocking_maps: int = 0  # pages mapped, or waited for, on the caller's path
    blocking_unmaps: int = 0  # pages unmapped, or waited for, on the caller's path
    peak: int = 0  # most pages mapped at once


class LowestUnmapped:
    """Candidates for the lowest unmapped kv pages: a min-heap that may hold stale entries
    (pages mapped since, duplicates), dropped as they are met. Invariant: every unmapped
    page of ``range(num_pages)`` is in the heap; it never holds more than
    ``2 * num_pages + 64`` entries after `freed` (then it is rebuilt, amortized)."""

    __slots__ = ("heap", "num_pages")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.heap = list(range(num_pages))  # sorted, hence a heap

    def __len__(self) -> int:
        return len(self.heap)

    def lowest(self, n: int, mapped: Container[int], skip: Container[int]) -> list[int]:
        """Up to ``n`` pages neither ``mapped`` nor in ``skip``, lowest first; O(n log N)."""
        heap = self.heap
        out: list[int] = []
        seen: set[int] = set()
        while heap and len(out) < n:
            page = heapq.heappop(heap)
            if page in seen or page in mapped:
                continue  # a duplicate, or stale (pushed again when it is unmapped)
            seen.add(page)
            if page not in skip:
                out.append(page)
        for page in seen:
            heapq.heappush(heap, page)
        return out

    def freed(self, pages: Sequence[int], mapped: Container[int]) -> None:
        """``pages`` were unmapped (``mapped``: the mapped set after that)."""
        if len(self.heap) + len(pages) > 2 * self.num_pages + 64:
            # Too many stale entries: rebuild (amortized over as many unmaps).
            self.heap[:] = [p for p in range(self.num_pages) if p not in mapped]
        else:
            for page in pages:
                heapq.heappush(self.heap, page)


#: The most kv pages one unmap sent without waiting carries, and a busy step gives back. A
#: map that must wait meets at most about one such batch on the rank (which applies one
#: request at a time), and each batch's pages become free as soon as it is done. (12-05, an
#: H100: a phase's winding down unmapped up to 462 pages of 32 MiB, 266 ms, in one step.)
UNMAP_BATCH_PAGES = 16


@dataclass(frozen=True, slots=True)
class _AnyOf:
    """A container of what any of ``parts`` contains (no set built per question)."""

    parts: tuple[Container[int], ...]

    def __init__(self, *parts: Container[int]) -> None:
        object.__setattr__(self, "parts", parts)

    def __contains__(self, item: object) -> bool:
        return any(item in part for part in self.parts)


class PendingRefills:
    """Requests sent without waiting (a space that defers maps): kv page -> its
    `Confirmation`. A pool keeps its refills in one and its unmaps in another.

    Invariants: a page in either is neither in the pool's mapped set nor handed out; the
    pages of one confirmation leave together, when it is settled, exactly once.
    """

    __slots__ = ("_by_page",)

    def __init__(self) -> None:
        self._by_page: dict[int, Confirmation] = {}

    def __len__(self) -> int:
        return len(self._by_page)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_page)

    def __contains__(self, page: object) -> bool:
        return page in self._by_page

    def add(self, pages: Sequence[int], confirmation: Confirmation) -> None:
        for page in pages:
            self._by_page[page] = confirmation

    def waits_for(self, pages: Iterable[int]) -> set[int]:
        """Those of ``pages`` in a refill whose replies are not in yet."""
        by_page = self._by_page
        if not by_page:  # the common case (every local space): no set to build
            return set()
        return {p for p in pages if p in by_page and not by_page[p].done()}

    def take(self, wait: bool, pages: Iterable[int] | None = None) -> Iterator[tuple[Confirmation, list[int]]]:
        """Remove and yield the refills to settle, with their pages: those whose replies
        are in and, with ``wait``, those holding any of ``pages`` (default: all). Whether
        replies are in is asked as each comes up, so one that arrives while the caller
        waits for an earlier one is settled in the same pass."""
        wanted = set(self._by_page) if pages is None else set(pages)
        batches: dict[int, tuple[Confirmation, list[int]]] = {}
        for page, conf in self._by_page.items():
            batches.setdefault(id(conf), (conf, []))[1].append(page)
        for conf, batch in batches.values():
            if conf.done() or (wait and wanted.intersection(batch)):
                for page in batch:
                    del self._by_page[page]
                yield conf, batch


class PagePool:
    """The mapped set of one `KvPageSpace`, under the policies it is given and a step fence.

    Invariants (under ``_lock``): ``_mapped == in_use | reserve | quarantined``, the three
    disjoint; ``pending`` (refills in flight) and ``draining`` (unmaps in flight) are
    disjoint from ``_mapped`` and from each other; a quarantined, pending or draining page
    is never handed out, and a draining one is never mapped before it is settled; every
    change of ``_mapped`` is told to the watcher (a draining page's, when it is sent).
    """

    def __init__(
        self,
        space: KvPageSpace,
        config: KvcachedConfig,
        *,
        fence: StepFence | None = None,
        faults: FaultInjector | None = None,
        limiter: Limiter | None = None,
        policies: PoolPolicies | None = None,
    ) -> None:
        """``policies`` default to `PoolPolicies.from_config` (with ``limiter``); given
        policies bring their own limiter, so passing both is a `ConfigError`."""
        if policies is not None and limiter is not None:
            raise ConfigError("give the limiter inside the pool's policies or on its own, not both")
        self.space = space
        self.config = config
        self.fence = fence if fence is not None else StepFence()
        self.faults = faults
        self.policies = policies if policies is not None else PoolPolicies.from_config(config, limiter)
        #: Where maps go: the space, behind the fault plan's refusals when there is one.
        self._maps_into: KvPageSpace = space if faults is None else FailingSpace(space, faults)
        self._lock = threading.RLock()
        self.in_use: set[int] = set()
        self.reserve: dict[int, int] = {}  # kv page -> fence ticket of its release
        self.pending = PendingRefills()
        self.draining = PendingRefills()  # unmaps in flight (`unmap_pages_later`)
        self._mapped: set[int] = set()  # == in_use | reserve | quarantined, kept as it changes
        self._unmapped = LowestUnmapped(space.num_kv_pages)
        self._tally = PoolTally()
        self._watcher: Callable[[Sequence[int], Sequence[int]], None] | None = None
        #: Inside `batch_top_ups` (a depth): takes leave the reserve's top-up to its end.
        self._batching = 0
        self._top_up_due = False

    # ---- the policies' state, as callers read it -------------------------------------
    @property
    def limiter(self) -> Limiter | None:
        return self.policies.limit.limiter

    @property
    def limit_pages(self) -> int | None:
        """The limiter's last answer (None: no limit)."""
        return self.policies.limit.pages

    @property
    def quarantined(self) -> set[int]:
        """Pages an unmap failed for in some backing: neither in use nor in the reserve,
        never handed out or mapped again (they stay in the mapped set), retried by `collect`."""
        return self.policies.quarantine.pages

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
            return self.policies.quarantine.health

    def watch(self, watcher: Callable[[Sequence[int], Sequence[int]], None]) -> None:
        """Call ``watcher(mapped, unmapped)`` after every change of the mapped set.

        One watcher per pool (the ledger that sits on it); it must not call back into the
        pool's state changes.
        """
        if self._watcher is not None:
            raise InvariantError("this page pool already has a watcher")
        self._watcher = watcher

    def lowest_unmapped(self, n: int, *, skip_pending: bool = False) -> list[int]:
        """Up to ``n`` unmapped kv pages, lowest first (pages of a refill in flight count as
        unmapped unless ``skip_pending``: a take of one waits for it). Pages of an unmap in
        flight are never offered: taking one would wait for its unmap and map it again (on
        a CPU engine, 60% of the unmaps sent ahead came back so: the ledger wants the lowest
        unmapped pages, and those are the highest mapped ones, which go first). O(n log N)
        amortized; no state changes."""
        with self._lock:
            skip = _AnyOf(self.pending, self.draining) if skip_pending else self.draining
            return self._unmapped.lowest(n, self._mapped, skip)

    def settle(self, *, wait: bool = False) -> None:
        """Take in every refill and unmap whose replies have arrived; ``wait``: wait for every
        one in flight first (a snapshot of the books, `kvcached.stats()`, asks so: an idle
        engine's unmaps are still in flight when its last step ends, see `collect`)."""
        with self._lock:
            self._confirm(wait=wait, on_path=False)

    def drain(self) -> None:
        """Wait for every unmap in flight: the scheduler wants their pages (`lowest_unmapped`
        never offers one before it is settled). Counted as blocking unmaps; a page a backing
        refused to unmap is quarantined, as at any settle."""
        with self._lock:
            if self.draining:
                self._settle_unmaps(True)

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` is mapped and usable (in use or in the reserve; not quarantined)."""
        with self._lock:
            self._confirm(wait=False)
            return page in self._mapped and page not in self.quarantined

    def capacity_pages(self) -> int:
        """kv pages this pool could map now (the space's answer cached by `CapacityCache`)."""
        with self._lock:
            pages = self.policies.capacity.get(lambda: self.space.physical_available() // self.space.kv_page_bytes)
            return min(pages, self._room())

    def _in_flight_mapped(self) -> int:
        """Pages mapped, refills in flight included (they are, or are being)."""
        return len(self._mapped) + len(self.pending)

    def _room(self) -> int:
        """Pages the limit still allows (refills in flight count as mapped); large if none."""
        return self.policies.limit.room(mapped=self._in_flight_mapped(), unbounded=self.space.num_kv_pages)

    def over_limit(self) -> int:
        """Pages mapped beyond the limit that the reserve cannot give back (in use)."""
        with self._lock:
            return self.policies.limit.over(mapped=self._in_flight_mapped(), reserve=len(self.reserve))

    def counters(self) -> PoolCounters:
        """Counts; pages of a refill in flight count as mapped (they are, or are being), and
        so do those of an unmap in flight (until it is settled: ``maps - unmaps`` is the
        mapped pages)."""
        with self._lock:
            t, q, pending = self._tally, self.policies.quarantine, len(self.pending)
            mapped = len(self.in_use) + len(self.reserve) + pending + len(self.draining)
            return PoolCounters(t.maps + pending, t.unmaps, t.map_failures, mapped, max(t.peak, mapped),
                                len(self.reserve) + pending, t.takes, t.reserve_hits, t.blocking_maps,
                                q.unmap_failures, len(q.pages), q.health, t.blocking_unmaps)

    # ---- mechanism -----------------------------------------------------------------
    def _map_batch(self, pages: Sequence[int]) -> None:
        """Map ``pages`` (all unmapped) into the reserve in one batch; all-or-nothing (one
        round trip for a space that spans ranks). A failure is counted, and what its undo
        left mapped somewhere is quarantined."""
        if not pages:
            return
        try:
            self._maps_into.map_pages(pages)
        except PhysicalMemoryExhausted as exc:  # nothing of the batch is usable
            if stuck := self._map_failed(pages):
                # Never retried as exhaustion: the same batch would meet its own leftovers.
                raise DriverError(f"kv pages {stuck} stay mapped after a failed undo (quarantined): {exc}") from exc
            raise
        except BackendError:  # a driver error: nothing of the batch is usable
            self._map_failed(pages)
            raise
        self.policies.capacity.invalidate()
        self._tally.maps += len(pages)
        for page in pages:
            self.reserve[page] = 0
        self._mapped_now(pages)

    def _map_failed(self, pages: Sequence[int]) -> list[int]:
        """A map of ``pages`` failed: count it, and quarantine what its undo left mapped
        (returned)."""
        self._tally.map_failures += 1
        self.policies.capacity.invalidate()
        return self._quarantine_stuck(pages)

    def _mapped_now(self, pages: Sequence[int]) -> None:
        """Bookkeeping after ``pages`` joined the reserve (already entered there)."""
        self._mapped.update(pages)
        self._tally.peak = max(self._tally.peak, len(self._mapped))
        if self._watcher is not None:
            self._watcher(pages, ())

    def _confirm(self, wait: bool, pages: Iterable[int] | None = None, *, on_path: bool = True) -> None:
        """Settle unmaps, then refills, in flight: confirmed refills join the reserve
        (ticket 0), confirmed unmaps are free.

        ``wait=False`` settles only those whose replies are in (never waits); ``wait=True``
        settles those holding ``pages`` (default: all), waiting for their replies
        (``on_path``: on the scheduler's path, see `_settle_unmaps`).
        """
        if self.draining:
            wanted = None if pages is None else list(pages)
            self._settle_unmaps(wait, wanted, on_path=on_path)
            pages = wanted
        if not self.pending:
            return
        for conf, batch in self.pending.take(wait, pages):
            try:
                conf.result()
            except BackendError:  # refused on some rank: undone on every rank, but where an undo failed
                self._map_failed(batch)
                continue
            self._tally.maps += len(batch)
            for page in batch:
                self.reserve[page] = 0
            self._mapped_now(batch)

    def _refill_later(self, pages: list[int]) -> bool:
        """Send a refill without waiting (spaces that defer maps only); False if nothing
        was sent."""
        if not pages or not self.space.defers_maps:
            return False
        try:
            confirmation = self._maps_into.map_pages_later(pages)
        except PhysicalMemoryExhausted:  # refused on purpose: as if the ranks had refused it
            self._tally.map_failures += 1
            return True
        if confirmation.done():
            self._tally.blocking_maps += len(pages)  # it ran inline, on the caller's path (in-process worker)
        self.policies.capacity.invalidate()
        self.pending.add(pages, confirmation)
        return True

    def _give_back(self, pages: list[int]) -> None:
        """Unmap reserve ``pages``: sent without waiting where the space defers (`_unmap_later`),
        else here, on the caller's path (counted as blocking)."""
        if self.space.defers_maps:
            self._unmap_later(pages)
        else:
            self._tally.blocking_unmaps += len(pages)
            self._unmap(pages)

    def _unmap_later(self, pages: list[int]) -> None:
        """Send the unmap of reserve ``pages`` without waiting, in batches of at most
        `UNMAP_BATCH_PAGES`: they leave the reserve and the mapped set now (the watcher is
        told: no block of theirs is handed out again) and are ``draining`` until settled
        (`_settle_unmaps`); those whose replies are already in are settled here (one that
        was done when sent ran inline: an in-process worker with no background thread)."""
        if not pages:
            return
        for page in pages:
            del self.reserve[page]
        self._mapped.difference_update(pages)
        self._unmapped.freed(pages, self._mapped)  # candidates again; skipped while draining
        self.policies.capacity.invalidate()
        if self._watcher is not None:
            self._watcher((), pages)
        for i in range(0, len(pages), UNMAP_BATCH_PAGES):
            batch = pages[i:i + UNMAP_BATCH_PAGES]
            confirmation = self.space.unmap_pages_later(batch)
            if confirmation.done():
                self._tally.blocking_unmaps += len(batch)  # it ran inline, on the caller's path
            self.draining.add(batch, confirmation)
        self._settle_unmaps(wait=False)

    def _settle_unmaps(self, wait: bool, pages: Iterable[int] | None = None, *, on_path: bool = True) -> None:
        """Settle unmaps in flight (as `_confirm` says which): their pages are free, except
        those a refusing backing or rank still maps, which are quarantined (mapped, never
        handed out, retried by `collect`). An unmap waited for here counts as blocking
        when ``on_path`` (a snapshot's wait, `settle`, is not the scheduler's)."""
        for conf, batch in self.draining.take(wait, pages):
            if on_path and not conf.done():
                self._tally.blocking_unmaps += len(batch)
            stuck: list[int] = []
            try:
                conf.result()
            except BackendError:
                stuck = self.space.still_mapped(batch)
                self.policies.quarantine.add(stuck)
                self._mapped.update(stuck)
            self._tally.unmaps += len(batch) - len(stuck)
            self.policies.capacity.invalidate()

    def _unmap(self, pages: list[int]) -> None:
        """Unmap reserve ``pages`` now. If a backing (or a rank) refuses, the pages it left
        mapped are quarantined instead: out of the reserve, never handed out or mapped
        again, still charged (the memory is still held somewhere), and retried by `collect`.
        The failure is counted (``unmap_failures``), not raised: the engine goes on without
        those pages."""
        if not pages:
            return
        for page in pages:
            del self.reserve[page]
        self.policies.capacity.invalidate()
        if self._watcher is not None:
            self._watcher((), pages)  # the ledger stops counting their blocks either way
        try:
            self.space.unmap_pages(pages)
        except BackendError:
            # Per page: what some backing (or rank) still maps is quarantined, the rest is free.
            stuck = self.space.still_mapped(pages)
            self.policies.quarantine.add(stuck)
            self._forget(sorted(set(pages).difference(stuck)))
            return
        self._forget(pages)

    def _forget(self, pages: Sequence[int]) -> None:
        """``pages`` are unmapped in every backing: they may be mapped again."""
        self._mapped.difference_update(pages)
        self._tally.unmaps += len(pages)
        self._unmapped.freed(pages, self._mapped)

    def _quarantine_stuck(self, pages: Sequence[int]) -> list[int]:
        """After a failed map whose undo failed too: pages a backing (or a rank) still maps
        are quarantined (never handed out or mapped again, retried by `collect`) instead of
        looking free; returns them."""
        if stuck := self.space.still_mapped(pages):
            self.policies.quarantine.add(stuck)
            self._mapped.update(stuck)
        return stuck

    def _retry_quarantine(self, *, now: bool = False) -> None:
        """Unmap the quarantined pages again (each backing or rank unmaps what it still
        maps) when the quarantine's backoff allows (``now``: regardless)."""
        quarantine = self.policies.quarantine
        if not quarantine.due(now=now):
            return
        pages = sorted(quarantine.pages)
        try:
            self.space.unmap_pages(pages, strict=False)
        except BackendError:
            # Per page: those unmapped everywhere leave the quarantine now (the space has
            # forgotten them; kept here, every later retry of them would be refused).
            freed = quarantine.retry_failed(still=self.space.still_mapped(pages))
        else:
            freed = quarantine.retry_succeeded()
        if freed:
            self.policies.capacity.invalidate()
            self._forget(freed)

    # ---- policy --------------------------------------------------------------------
    def acquire(self, pages: Iterable[int], *, wait: bool = False) -> None:
        """Make ``pages`` in use, mapping those not mapped in one batch (all-or-nothing;
        ``wait``: retried as the `RetryPolicy` says while memory is short).

        Raises `PhysicalMemoryExhausted` (or `InjectedFault`) with no state changed, at once
        (not retried) for a quarantined page: it cannot be mapped until a retry unmaps it.
        """
        with self._lock:
            wanted = sorted(set(pages))
            waited = self.pending.waits_for(wanted)
            # A refill this take needs is waited for; every other one only if its replies are in.
            self._confirm(wait=True, pages=wanted)
            for page in wanted:
                if page in self.in_use or not 0 <= page < self.space.num_kv_pages:
                    raise InvariantError(f"kv page {page} is already in use or out of range")
            if stuck := sorted(self.quarantined.intersection(wanted)):
                raise PhysicalMemoryExhausted(f"kv pages {stuck} are quarantined (an unmap left them mapped "
                                              "somewhere): not usable until a retry succeeds")
            missing = [p for p in wanted if p not in self.reserve]
            self.policies.retry.run(lambda: self._map_batch(missing), wait=wait)
            blocked = len(waited.union(missing))
            self.policies.reserve.took(len(wanted))
            self._tally.takes += len(wanted)
            self._tally.reserve_hits += len(wanted) - blocked
            self._tally.blocking_maps += blocked
            for page in wanted:
                del self.reserve[page]
                self.in_use.add(page)
            if self._batching and self.reserve:
                self._top_up_due = True
            else:  # an empty reserve refills at once: the step's next takes may find it mapped
                self._top_up_due = False
                self._top_up()

    def batch_top_ups(self) -> None:
        """From now until `end_top_ups`, takes leave the reserve's top-up to that call: one
        refill for all of them. A scheduler step's takes (one a request that crosses into a
        new page: 8 in a prefill step of 8,192 tokens at 64 blocks a page) then send one
        batch, not one refill each, and a background refill costs one charge of the budget
        record, one rank request and one wake of its thread a step. The reserve's target
        covers a step's takes while the engine is busy (`ReservePolicy.target`), so the
        takes of the step rarely need the refill; a take that empties it refills at once, so
        that a step taking more than it (a burst's first steps) finds its later pages mapped
        or in flight. Calls nest."""
        with self._lock:
            self._batching += 1

    def end_top_ups(self) -> None:
        """The end of `batch_top_ups`: the one top-up its takes were due, if any."""
        with self._lock:
            if self._batching <= 0:
                raise InvariantError("end_top_ups without batch_top_ups")
            self._batching -= 1
            if not self._batching and self._top_up_due:
                self._top_up_due = False
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
                if page in self.in_use or page in self.reserve or page in self.pending or page in self.draining \
                        or not 0 <= page < self.space.num_kv_pages:
                    raise InvariantError(f"kv page {page} is already known to the pool or out of range")
            for page in wanted:
                self.reserve[page] = 0
            self._tally.maps += len(wanted)
            self._mapped_now(wanted)

    def prefetch(self, pages: Sequence[int]) -> int:
        """Map idle ``pages`` into the reserve; returns how many this call mapped.

        The pages not mapped yet go in one batch (one round trip to the ranks of a
        multiprocess engine, not one per page); if that runs out of memory, one at a time
        until capacity runs out, which is expected here, not an error. A page the batch's
        failed undo left mapped somewhere is quarantined, not tried again. A page of a
        refill in flight is never mapped twice: it is waited for, after the batch (a channel
        that keeps order has its reply in by then). A page of an unmap in flight is waited
        for first, then mapped.
        """
        with self._lock:
            pages = list(pages)
            self._settle_unmaps(wait=True, pages=pages)  # a page being unmapped is mapped after that
            in_flight = [p for p in pages if p in self.pending]
            # Not mapped, not in flight; a page quarantined as its unmap was settled above is mapped.
            missing = [p for p in pages if p not in self._mapped and p not in self.pending]
            mapped = 0
            if missing:
                try:
                    self._map_batch(missing)
                    mapped = len(missing)
                except BackendError:  # short of memory, or a driver error: one page at a time
                    for page in missing:
                        if page in self.quarantined:  # left mapped by the batch's failed undo
                            continue
                        try:
                            self._map_batch([page])
                        except BackendError:
                            break
                        mapped += 1
            self._tally.blocking_maps += len(self.pending.waits_for(in_flight)) + mapped
            self._confirm(wait=True, pages=in_flight)
            return mapped

    def set_step_pages(self, pages: int) -> None:
        """The most kv pages one step of the engine can take (`ReservePolicy.step_pages`)."""
        if not 0 <= pages <= self.space.num_kv_pages:
            raise ConfigError(f"step_pages={pages} is outside [0, {self.space.num_kv_pages}] (the space's kv pages)")
        with self._lock:
            self.policies.reserve.step_pages = pages

    def reserve_shortfall(self, *, inline: bool = False) -> int:
        """Pages the reserve lacks to reach its target (refills in flight count as there);
        ``inline``: its target within the max watermark (`ReservePolicy.target`)."""
        with self._lock:
            target = self.policies.reserve.target(inline=inline)
            return min(self._room(), max(0, target - len(self.reserve) - len(self.pending)))

    def release(self, pages: Iterable[int]) -> None:
        """Pages with no held block go back to the reserve, ticketed by the fence."""
        with self._lock:
            ticket = self.fence.ticket()
            for page in pages:
                if page not in self.in_use:
                    raise InvariantError(f"kv page {page} released but not in use")
                self.in_use.discard(page)
                self.reserve[page] = ticket

    def collect(self, keep: int | None = None, *, busy: bool = False) -> int:
        """Unmap reserve pages above ``keep`` whose ticket passed. ``keep`` None: the end of a
        step, keeping what the reserve policy says (`ReservePolicy.keep`: max_reserve_pages,
        or while ``busy`` the reserve's target or the hold window's), less what the pool is
        over its limit by.

        A step's end waits for none of the unmaps it sends (`_unmap_later`, where the space
        defers them), busy or not: they settle at the pool's next decision (a page wanted
        again first waits for its own), `settle(wait=True)` or `close`. The step that leaves
        the engine idle is the one that gives back most, and its outputs (the last tokens
        of a burst) reach the client only when it returns: waiting there held them back
        0.3-0.5 s for 456 pages of 32 MiB (reports/gpu/serving/run-12-06b, an H100). A busy
        step's end gives back at most `UNMAP_BATCH_PAGES` pages beyond what a limit takes:
        the rest goes at the next steps, so the ranks' queue (or the background thread)
        never holds more than a batch or so of unmaps for a map to wait behind. An idle
        one gives back all: no map of its own waits behind them until a request comes."""
        with self._lock:
            self._confirm(wait=False)  # a refill in flight is never unmapped here
            if keep is not None:
                unmapped = self._unmap_ready(keep, wait=not busy)
            else:
                # The end of a step: its takes set the pace, the quarantine's backoff moves
                # on, and the limit is read (and the pool's bytes published) for the next one.
                reserve = self.policies.reserve
                reserve.end_step(in_use=len(self.in_use), busy=busy)
                self.policies.quarantine.end_step()
                self._retry_quarantine()
                self._poll_limit()
                keep = reserve.keep(len(self.in_use))
                if busy:  # one batch a step: a refill waited for never queues behind many
                    keep = max(keep, len(self.reserve) - UNMAP_BATCH_PAGES)
                unmapped = self._unmap_ready(keep, limited=True)
            return unmapped

    def shed(self) -> int:
        """Unmap the reserve pages (those the fence allows) the pool is over its limit by,
        waiting for the unmaps: a limit makes room for another engine, which may map the
        memory as soon as the limiter hears of it."""
        with self._lock:
            self._confirm(wait=False)
            return self._unmap_ready(len(self.reserve), limited=True, wait=True)

    def _unmap_ready(self, keep: int, *, limited: bool = False, wait: bool = False) -> int:
        """Unmap reserve pages above ``keep`` whose ticket passed (``wait``: and wait for every
        unmap in flight, earlier ones included). ``limited``: keep fewer while the pool is over its
        limit, and tell the limiter what is left at once (the engine may go idle right
        after), once those unmaps are done if waited for."""
        if limited:
            keep = self.policies.limit.keep(keep, reserve=len(self.reserve), mapped=self._in_flight_mapped())
        excess = len(self.reserve) - keep
        victims: list[int] = []
        if excess > 0:
            # Highest page indices first: block choice prefers low pages, so this keeps the
            # mapped set compact.
            ready = sorted((p for p, t in self.reserve.items() if self.fence.passed(t)), reverse=True)
            victims = ready[:excess]
            self._give_back(victims)
        if wait:
            self._settle_unmaps(wait=True)
        if victims and limited:
            self._poll_limit()
        return len(victims)

    def _poll_limit(self) -> None:
        self.policies.limit.poll(mapped=self._in_flight_mapped(), in_use=len(self.in_use))

    def trim(self) -> int:
        """Give back every idle page the fence allows."""
        return self.collect(keep=0)

    def close(self) -> None:
        """Unmap everything (teardown), unmaps in flight waited for. In-use pages are a caller
        bug only if the engine is alive."""
        with self._lock:
            self._confirm(wait=True)
            self.reserve.update({p: 0 for p in self.in_use})
            self.in_use.clear()
            self._unmap(sorted(self.reserve))
            self._retry_quarantine(now=True)  # what still fails now goes with the ranges' own close

    def _top_up(self) -> None:
        need = self.reserve_shortfall()
        if need <= 0:
            return
        candidates = self.lowest_unmapped(need, skip_pending=True)
        if not self._refill_later(candidates):
            self.prefetch(candidates)
