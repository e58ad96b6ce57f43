"""Pages on every rank: the scheduler↔worker page protocol, independent of any engine.

In a multiprocess engine the scheduler decides which kv pages are mapped, but the memory
lives in other processes: one worker per tensor-parallel rank, each holding its shard of
every layer in virtual ranges of the same geometry. This module is both ends of the page
protocol between them:

* `RankPages` (worker side, one per rank) owns that rank's `PageSpace` and answers
  `PageRequest`s with a `RankReply`: map (all-or-nothing on the rank), unmap, capacity,
  close. It never raises for a refused map: exhaustion, a driver error or an injected fault
  is *reported*, with the rank and the reason, so the scheduler can undo the other ranks.
* `RankedPageSpace` (scheduler side) is the `KvPageSpace` a `PagePool` maps into. A batch is
  mapped on every rank through a `PageChannel`; if any rank refuses, the batch is unmapped
  on the ranks that did map it and `PhysicalMemoryExhausted` (or `DriverError`) is raised
  with nothing mapped anywhere, which the pool turns into a scheduling miss.

The channel is the engine's own: vLLM's executor ``collective_rpc``, which delivers requests
to every rank in order, behind the steps already sent. That order is the fence: a page is
mapped on every rank before any later step runs there, and an unmap sent after step N has
executed reaches each rank only after that rank has run step N. Requests and replies are
plain data (ints, strings), so any transport can carry them.

Cost: the pool batches maps ahead of demand (its reserve), so a round trip happens when the
reserve is refilled or trimmed, never per step while the reserve covers demand.
`RankedPageSpace.calls` counts the round trips by operation.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvcached.errors import DriverError, InvariantError, KvcachedError, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector, rank_map_site
from kvcached.pages import Confirmation, PageSpace, Settled
from kvcached.space import Geometry

#: How long a rank reuses its measured free physical memory (moved by its own maps).
AVAILABLE_TTL_S = 0.05

Op = Literal["map", "unmap", "capacity", "close"]
#: A refusal's kind, as the worker reports it.
Refusal = Literal["", "exhausted", "driver"]


@dataclass(frozen=True, slots=True)
class PageRequest:
    """One page operation for the ranks in ``ranks`` (empty: every rank)."""

    op: Op
    pages: tuple[int, ...] = ()
    ranks: frozenset[int] = frozenset()

    def applies_to(self, rank: int) -> bool:
        return not self.ranks or rank in self.ranks


@dataclass(frozen=True, slots=True)
class RankReply:
    """One rank's answer. ``ok`` False: the request failed on that rank. A refused map
    mapped none of its pages there but ``held``, those its undo left mapped in some
    backing; after a refused unmap, ``held`` are still mapped (in some backing) and the
    other pages are unmapped."""

    rank: int
    ok: bool
    refusal: Refusal = ""
    message: str = ""
    available_bytes: int = 0  # physical bytes this rank could still map after the request
    held: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BudgetRef:
    """Where a rank's mapped bytes are charged: a budget record and its slot there."""

    path: str
    slot: int


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What a rank reports at start: its geometry, the pages it already mapped, and its
    budget slot (None: budgets are off)."""

    rank: int
    geometry: dict[str, object]
    premapped: tuple[int, ...]
    available_bytes: int
    budget: BudgetRef | None = None


class RankPages:
    """Worker side: one rank's KV ranges and the protocol's answers for them.

    Invariant: ``mapped`` is exactly the set of kv pages that some range of ``space`` maps.
    Such a page is mapped in every range unless a failed call left it behind (a map whose
    undo failed, an unmap that failed); the reply to that call named it (`RankReply.held`),
    so the scheduler never maps it again and retries its unmap here, which unmaps whatever
    the ranges still map of it.
    """

    def __init__(self, rank: int, space: PageSpace, geometry: Geometry, premapped: Sequence[int] = (),
                 faults: FaultInjector | None = None, budget: BudgetRef | None = None) -> None:
        self.rank = rank
        self.budget = budget
        self.space = space
        self.geometry = geometry
        self.mapped: set[int] = set(premapped)
        self.faults = faults  # site rank<N>_map: this rank refuses a map request on purpose
        self._lock = threading.Lock()
        self._measured: tuple[float, int] | None = None  # (when, bytes): see `_available`

    def layout(self) -> RankLayout:
        return RankLayout(self.rank, self.geometry.to_dict(), tuple(sorted(self.mapped)), self._available(fresh=True),
                          self.budget)

    def _available(self, fresh: bool = False) -> int:
        """Physical bytes this rank could still map, for every reply.

        Measured at most every `AVAILABLE_TTL_S` (on CPU it reads /proc/meminfo: tens of µs,
        which every refill would pay) and moved by this rank's own maps and unmaps in
        between, so only other processes' changes can be that stale; a capacity request
        always measures.
        """
        now = time.monotonic()
        if fresh or self._measured is None or now - self._measured[0] >= AVAILABLE_TTL_S:
            self._measured = (now, int(self.space.physical_available()))
        return self._measured[1]

    def _moved(self, pages: int) -> None:
        """This rank mapped (``pages`` > 0) or unmapped kv pages: move the measured bytes."""
        if self._measured is not None:
            when, available = self._measured
            self._measured = (when, max(0, available - pages * self.space.kv_page_bytes))

    def handle(self, request: PageRequest) -> RankReply:
        """Apply ``request`` on this rank; report, never raise, a refused or failed operation."""
        with self._lock:
            fresh = request.op == "capacity"
            if not request.applies_to(self.rank):
                return RankReply(self.rank, True, available_bytes=self._available(fresh))
            try:
                self._apply(request)
            except _Refused as e:  # a map or an unmap that leaves pages held
                return self._refused(e.error, e.held)
            except KvcachedError as e:  # a map refused before any range was touched
                return self._refused(e)
            return RankReply(self.rank, True, available_bytes=self._available(fresh))

    def _refused(self, error: KvcachedError, held: tuple[int, ...] = ()) -> RankReply:
        refusal: Refusal = "exhausted" if isinstance(error, PhysicalMemoryExhausted) else "driver"
        return RankReply(self.rank, False, refusal, f"{type(error).__name__}: {error}", self._available(True), held)

    def _apply(self, request: PageRequest) -> None:
        """Apply ``request``; a map that fails in the ranges, or an unmap that fails,
        raises `_Refused` with the pages it left held."""
        pages = list(request.pages)
        if request.op == "map":
            if clash := sorted(set(pages) & self.mapped):
                raise InvariantError(f"rank {self.rank}: kv pages {clash} are already mapped")
            if self.faults is not None:
                self.faults.check(rank_map_site(self.rank))  # before anything is mapped
            try:
                self.space.map_pages(pages)  # all-or-nothing on this rank, unless its undo fails
            except KvcachedError as e:
                # The space undid the batch; a page its undo could not unmap is still mapped
                # in some range: on the books (mapped again, it would be refused "already
                # mapped" by the range forever) and in the reply (the scheduler quarantines it).
                raise self._left_behind(e, pages) from e
            self.mapped.update(pages)
            self._moved(len(pages))
        elif request.op == "unmap":
            if stray := sorted(set(pages) - self.mapped):
                error = InvariantError(f"rank {self.rank}: kv pages {stray} are not mapped")
                raise _Refused(error, tuple(sorted(set(pages) & self.mapped)))  # nothing was unmapped
            # Not strict: after a failed unmap the scheduler retries the same pages, some of
            # them perhaps unmapped in every backing already (the rank's books say "mapped").
            try:
                self.space.unmap_pages(pages, strict=False)
            except KvcachedError as e:
                self.mapped.difference_update(pages)  # what is left goes back on the books
                raise self._left_behind(e, pages) from e
            self.mapped.difference_update(pages)
            self._moved(-len(pages))
        elif request.op == "close":
            self.close()
        elif request.op != "capacity":
            raise InvariantError(f"unknown page operation {request.op!r}")

    def _left_behind(self, error: KvcachedError, pages: Sequence[int]) -> _Refused:
        """After a failed map or unmap of ``pages`` (none of them on the books any more):
        those some range still maps go back on the books, and into the refusal."""
        held = tuple(self.space.still_mapped(pages))
        self.mapped.update(held)
        return _Refused(error, held)

    def close(self) -> None:
        """Unmap every page (teardown); idempotent."""
        pages = sorted(self.mapped)
        self.mapped.clear()
        self.space.unmap_pages(pages)


class _Refused(Exception):  # a reply in the making: it never leaves `RankPages.handle`
    """A failed map or unmap on a rank, with the pages it left held there."""

    def __init__(self, error: KvcachedError, held: tuple[int, ...]) -> None:
        super().__init__(str(error))
        self.error = error
        self.held = held


class PageChannel(Protocol):
    """Delivers one request to every rank, in order after everything sent before, and
    returns every rank's reply (one per rank, any order). ``call_later`` sends it the same
    way without waiting; its ``result()`` gives the replies."""

    def call(self, request: PageRequest) -> list[RankReply]: ...
    def call_later(self, request: PageRequest) -> Any: ...


@dataclass(eq=False)
class _Later:
    """A map or an unmap sent to every rank without waiting (`RankedPageSpace.map_pages_later`,
    `RankedPageSpace.unmap_pages_later`); ``result`` settles the replies as the waiting
    call would (``settle``: `RankedPageSpace.settle_map` or ``settle_unmap``)."""

    space: RankedPageSpace
    op: str
    pages: tuple[int, ...]
    future: Any
    settle: Callable[[tuple[int, ...], list[RankReply]], None]

    def done(self) -> bool:
        return bool(self.future.done())

    def result(self) -> None:
        if not self.future.done():
            # The reply has not arrived: the scheduler waits for it after all.
            self.space.calls[f"{self.op} (waited)"] += 1
        self.settle(self.pages, self.space.check_replies(self.op, list(self.future.result())))


@dataclass
class RankedPageSpace:
    """Scheduler side: the kv pages of an engine whose memory lives on ``ranks`` ranks.

    Invariant: a page this space reports mapped is mapped on every rank; a failed
    `map_pages` leaves no page of the batch usable and every page unmapped on every rank,
    except those an undo left on some rank (the refusing rank's own, or the unmap sent to
    the ranks that mapped the batch): `still_mapped` names them, with the ranks holding
    them, until an unmap of them succeeds there. Such a failure is a `DriverError`, as the
    same double failure in one process is, never an `InvariantError`.
    """

    geometry: Geometry
    channel: PageChannel
    ranks: int
    capacity_ttl_s: float = 0.1
    calls: Counter[str] = field(default_factory=Counter)  # blocking requests, by operation
    #: Pages some ranks still hold after a failed call (a map whose undo failed there, an
    #: unmap they refused), with those ranks: the other ranks map none of them.
    _held_by: dict[int, frozenset[int]] = field(default_factory=dict)
    deferred: int = 0  # maps sent ahead of demand without waiting (confirmed later)
    deferred_unmaps: int = 0  # unmaps sent without waiting (settled later)
    _available: tuple[float, int] = (0.0, 0)

    @property
    def num_kv_pages(self) -> int:
        return self.geometry.num_kv_pages

    @property
    def kv_page_bytes(self) -> int:
        return sum(self.geometry.vmm_pages) * self.geometry.page_size

    @property
    def vmm_page_bytes(self) -> int:
        return self.geometry.page_size

    @property
    def round_trips(self) -> int:
        """Requests sent to the ranks that the scheduler waited for (every operation)."""
        return sum(self.calls.values())

    @property
    def defers_maps(self) -> bool:
        """True: `map_pages_later` returns once the request is sent to the ranks."""
        return True

    def note_available(self, replies: Sequence[RankReply]) -> None:
        """Capacity is the smallest rank's (every rank must map every page)."""
        if replies:
            self._available = (time.monotonic(), min(r.available_bytes for r in replies))

    def check_replies(self, op: str, replies: list[RankReply]) -> list[RankReply]:
        if sorted(r.rank for r in replies) != list(range(self.ranks)):
            raise InvariantError(f"{op}: replies from ranks {sorted(r.rank for r in replies)}, "
                                 f"expected 0..{self.ranks - 1}")
        self.note_available(replies)
        return replies

    def _call(self, request: PageRequest) -> list[RankReply]:
        replies = self.channel.call(request)
        self.calls[request.op] += 1
        return self.check_replies(request.op, replies)

    def map_pages(self, kv_pages: Sequence[int]) -> None:
        if kv_pages:
            pages = tuple(kv_pages)
            self.settle_map(pages, self._call(PageRequest("map", pages)))

    def map_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        """Send a map to every rank now and return at once; ``result()`` settles it as
        `map_pages` would (the channel's order puts it before every later step)."""
        pages = tuple(kv_pages)
        self.deferred += 1
        return _Later(self, "map", pages, self.channel.call_later(PageRequest("map", pages)), self.settle_map)

    def settle_map(self, pages: tuple[int, ...], replies: list[RankReply]) -> None:
        """Raise, with the batch undone on every rank that mapped it, if any rank refused.

        A page an undo left mapped on a rank (a refusing rank's own undo, or the unmap sent
        to the ranks that mapped the batch) is remembered with that rank (`still_mapped`
        names it; an unmap goes there) and the error is a `DriverError`: never retried as
        exhaustion, since the same batch would meet its own leftovers."""
        refused = [r for r in replies if not r.ok]
        if not refused:
            return
        self.note_held(refused)
        done = frozenset(r.rank for r in replies if r.ok)
        if done:
            undo = self._call(PageRequest("unmap", pages, done))
            self.note_held([r for r in undo if not r.ok])
        why = "; ".join(f"rank {r.rank}: {r.message}" for r in refused)
        if left := self.still_mapped(pages):
            raise DriverError(f"kv pages {list(pages)} not mapped: {why}; undoing it left kv pages {left} "
                              f"mapped on {sorted(set().union(*(self._held_by[p] for p in left)))}")
        if all(r.refusal == "exhausted" for r in refused):
            raise PhysicalMemoryExhausted(f"kv pages {list(pages)} not mapped: {why}")
        raise DriverError(f"kv pages {list(pages)} not mapped: {why}")

    def note_held(self, replies: Sequence[RankReply]) -> None:
        """Remember the pages failed calls left on the ranks that replied so."""
        for reply in replies:
            for page in reply.held:
                self._held_by[page] = self._held_by.get(page, frozenset()) | {reply.rank}

    def unmap_pages(self, kv_pages: Sequence[int], *, strict: bool = True) -> None:
        """Unmap on every rank. A rank that fails keeps the pages its reply names
        (`RankReply.held`): each is remembered with the ranks still holding it (`DriverError`
        is raised after every group was sent; `still_mapped` names them), and a later unmap
        of it, the pool's retry, goes to those ranks only. The outcome is per page: a page
        no rank holds any more is forgotten here, whatever happened to the others.

        ``strict`` changes nothing here: each rank checks the pages against its own books
        (a page it does not map is refused there), and a retry is sent only to the ranks
        that still hold the pages, so it never meets a page already gone."""
        if not kv_pages:
            return
        groups: dict[frozenset[int], list[int]] = {}
        for page in kv_pages:
            groups.setdefault(self._held_by.get(page, frozenset()), []).append(page)
        failed: list[RankReply] = []
        for holders, pages in groups.items():  # holders empty: every rank
            replies = self._call(PageRequest("unmap", tuple(pages), holders))
            refused = [r for r in replies if not r.ok]
            for page in pages:  # what the ranks that were asked hold now
                self._held_by.pop(page, None)
            self.note_held(refused)
            failed += refused
        if failed:
            raise DriverError(f"kv pages {list(kv_pages)} not unmapped on {_names(failed)}")

    def unmap_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        """Send an unmap to every rank now and return at once; ``result()`` raises as
        `unmap_pages` would. Pages a failed call left on some ranks go the waiting way
        (`unmap_pages`, to those ranks only): a settled confirmation is returned."""
        pages = tuple(kv_pages)
        if any(p in self._held_by for p in pages):
            return Settled.after(lambda: self.unmap_pages(pages))
        self.deferred_unmaps += 1
        return _Later(self, "unmap", pages, self.channel.call_later(PageRequest("unmap", pages)), self.settle_unmap)

    def settle_unmap(self, pages: tuple[int, ...], replies: list[RankReply]) -> None:
        """Raise `DriverError` if any rank refused, its held pages remembered (`still_mapped`)."""
        if failed := [r for r in replies if not r.ok]:
            self.note_held(failed)
            raise DriverError(f"kv pages {list(pages)} not unmapped on {_names(failed)}")

    def still_mapped(self, kv_pages: Sequence[int]) -> list[int]:
        """Those of ``kv_pages`` that a failed map (or unmap) of them left mapped on some
        rank, as the ranks replied; a refused map is otherwise undone on every rank before
        `map_pages` (or a deferred map's ``result``) raises."""
        return [p for p in kv_pages if p in self._held_by]

    def physical_available(self) -> int:
        t, available = self._available
        if time.monotonic() - t >= self.capacity_ttl_s:
            self._call(PageRequest("capacity"))
            available = self._available[1]
        return available


def _names(replies: Sequence[RankReply]) -> str:
    return ", ".join(f"rank {r.rank} ({r.refusal or 'error'}: {r.message})" for r in replies)


def check_layouts(layouts: Sequence[RankLayout]) -> tuple[Geometry, frozenset[int], int]:
    """Every rank must report the same geometry and premapped pages; returns them and the
    smallest rank's available bytes. Raises `InvariantError` naming the first disagreement."""
    if not layouts:
        raise InvariantError("no rank reported a KV layout")
    ranks = sorted(lo.rank for lo in layouts)
    if ranks != list(range(len(layouts))):
        raise InvariantError(f"KV layouts came from ranks {ranks}")
    first = layouts[0]
    for lo in layouts[1:]:
        if (lo.geometry, lo.premapped) != (first.geometry, first.premapped):
            raise InvariantError(
                f"rank {lo.rank} reserved another KV geometry than rank {first.rank}: "
                f"{lo.geometry} / premapped {lo.premapped} != {first.geometry} / premapped {first.premapped}"
            )
    return Geometry.from_dict(first.geometry), frozenset(first.premapped), min(lo.available_bytes for lo in layouts)
