"""The `PagePool`'s policies: one decision per small object, composed like RMM's adaptors.

`kvcached.pages.PagePool` keeps the books of which kv pages are mapped (in use, in the
reserve, pending, quarantined) and asks these objects what to do about them:

* `ReservePolicy`: how many idle mapped pages to keep ahead of demand (the *pace*);
* `EngineLimit`: the most pages the engine may have mapped (its `Limiter`'s answer), and
  what that leaves of capacity and of the reserve;
* `RetryPolicy`: how often, and after which pauses, a map that ran out of memory is tried
  again (pauses from the config, slept through a `Sleeper` it is given);
* `Quarantine`: the pages an unmap failed for, when to retry them, and the pool's health;
* `CapacityCache`: the last answer of the (possibly costly) physical-capacity query;
* `FailingSpace`: a `KvPageSpace` adaptor that refuses maps on purpose (the fault plan's
  ``map`` site), before its inner space sees them.

One set of these belongs to one pool (`PoolPolicies`); they hold state of that pool and
are not thread-safe on their own: the pool calls them under its lock. None of them maps
or unmaps anything except `FailingSpace`, which only forwards.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvcached.errors import ConfigError, PhysicalMemoryExhausted
from kvcached.stats import PoolHealth

if TYPE_CHECKING:
    from kvcached.config import KvcachedConfig
    from kvcached.faults import FaultInjector
    from kvcached.pages import Confirmation, KvPageSpace

#: Sleeps for the given seconds (`time.sleep`; a test passes one that records instead).
Sleeper = Callable[[float], None]


class Limiter(Protocol):
    """Where an engine's page limit comes from (`kvcached.budget.EngineBudget`): asked after
    every step with what the pool has mapped; answers the most kv pages it may have mapped
    (None: no limit)."""

    def poll(self, *, mapped: int, in_use: int, reserved: int) -> int | None: ...
    def close(self) -> None: ...


class WindowMax:
    """The largest of the last ``size`` values pushed (0 when there are none), in O(1)
    amortized a push: a deque of (push index, value) with values strictly decreasing from
    the front, so the front is the window's maximum. `ReservePolicy` pushes once a busy step;
    with 256-step windows, ``max`` over plain deques cost 8 µs a step (12-07)."""

    __slots__ = ("_pushed", "_queue", "size")

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ConfigError(f"a window of {size} values: need >= 0")
        self.size = size
        self._queue: deque[tuple[int, int]] = deque()
        self._pushed = 0

    def push(self, value: int) -> None:
        if not self.size:
            return  # a window of 0 keeps nothing
        queue = self._queue
        while queue and queue[-1][1] <= value:
            queue.pop()  # never the maximum again: ``value`` is newer and as large
        queue.append((self._pushed, value))
        self._pushed += 1
        if queue[0][0] < self._pushed - self.size:  # one push moves the window by one
            queue.popleft()

    def max(self) -> int:
        return self._queue[0][1] if self._queue else 0

    def clear(self) -> None:
        self._queue.clear()


@dataclass(slots=True)
class ReservePolicy:
    """How many idle mapped pages the pool keeps ahead of demand.

    The *pace* is the pages taken per step lately: a step's takes set it, and each step
    without as many decays it by one. The reserve refills to the pace (while busy, one page
    more: `target`), at least ``min_pages`` and at most the *ceiling*, so a steady demand
    of several pages a step finds them mapped. The ceiling is ``max_pages``, or while the engine is busy
    ``step_pages`` if more: the pages one step of the engine can take at most (set from
    its token budget, `ElasticBlockPool.set_step_tokens`; 0 where unknown). A burst of
    prefill steps that each take a full step's pages then finds the next step's pages
    mapped ahead, instead of mapping half of them on the step's path (12-06, an H100: 8
    pages a step against a ceiling of 4, 2.9 ms a page on the path). An idle engine's
    ceiling is ``max_pages``. Invariant: ``0 <= min_pages <= target() <= ceiling()``.

    *Holding* (``hold_steps`` > 0): while the engine is busy, a step's end keeps idle pages
    up to the most pages in use at the end of any of the last ``hold_steps`` busy steps, so
    a page emptied as one request ends and wanted as the next one starts stays mapped
    instead of being unmapped and mapped again (a driver call each way on the step's
    path). While the engine grows (its pages in use at the window's peak, so no emptied page
    is held for its next step), the pace is at least the most pages one of those steps
    took, so a wave of prefill steps after a stretch of decode finds a step's pages mapped
    instead of a pace decayed to the decode steps' (`bench_growth_waves`, 12-07: 18 pages a
    burst on the scheduler's path with the decayed pace, 5 with the held one; 127 and 47
    where refills are in only when waited for). Below its peak the held emptied pages serve
    instead: holding that pace there too mapped pages no step took (an engine of two
    requests of different lengths: 14 maps against 10; 12 with the pace held only while it
    grows). The first idle step forgets the window: an idle engine keeps ``max_pages``. A
    busy step's end also keeps the reserve's target (what it was just refilled to).
    Invariant: ``max_pages <= keep(in_use)``, equal when not busy.
    """

    min_pages: int
    max_pages: int
    hold_steps: int = 0
    step_pages: int = 0
    pace: int = 0
    taken_this_step: int = 0
    busy: bool = False
    #: The most pages in use at the end of one of the last ``hold_steps`` busy steps.
    in_use_lately: WindowMax = field(default_factory=lambda: WindowMax(0))
    #: The most pages taken during one of the last ``hold_steps`` busy steps.
    taken_lately: WindowMax = field(default_factory=lambda: WindowMax(0))

    def __post_init__(self) -> None:
        if not 0 <= self.min_pages <= self.max_pages:
            raise ConfigError(f"reserve watermarks min={self.min_pages} max={self.max_pages} "
                              "need 0 <= min <= max")
        if self.hold_steps < 0 or self.step_pages < 0:
            raise ConfigError(f"hold_steps={self.hold_steps} and step_pages={self.step_pages} need to be >= 0")
        self.in_use_lately = WindowMax(self.hold_steps)
        self.taken_lately = WindowMax(self.hold_steps)

    @classmethod
    def from_config(cls, config: KvcachedConfig) -> ReservePolicy:
        return cls(config.min_reserve_pages, config.max_reserve_pages, config.hold_steps)

    def took(self, pages: int) -> None:
        """``pages`` were made in use during this step."""
        self.taken_this_step += pages

    def end_step(self, *, in_use: int = 0, busy: bool = False) -> None:
        """The step is over: its takes set the pace, or the pace decays by one, but while
        busy and growing (``in_use`` at the hold window's peak) not below the window's most
        taken; a busy step's ``in_use`` and takes join the hold window, an idle one clears it."""
        taken, self.taken_this_step = self.taken_this_step, 0
        self.pace = max(taken, self.pace - 1)
        self.busy = busy
        if busy:
            self.in_use_lately.push(in_use)
            self.taken_lately.push(taken)
            if in_use >= self.in_use_lately.max():
                self.pace = max(self.pace, self.taken_lately.max())
        else:
            self.in_use_lately.clear()
            self.taken_lately.clear()

    def keep(self, in_use: int) -> int:
        """Idle pages to keep mapped at a step's end: ``max_pages``, or while busy, the
        reserve's target, or what the hold window's peak of pages in use exceeds ``in_use``
        by, if more."""
        if not self.busy:
            return self.max_pages
        return max(self.max_pages, self.target(), self.in_use_lately.max() - in_use)

    def ceiling(self) -> int:
        """The most pages the reserve refills to: ``max_pages``, or busy, ``step_pages`` if more."""
        return max(self.max_pages, self.step_pages) if self.busy else self.max_pages

    def target(self, *, inline: bool = False) -> int:
        """Pages the reserve refills to: the pace, and while busy one page more, within
        ``min_pages`` and the ceiling. ``inline``: within ``max_pages`` instead, what a map
        on the caller's path carries along (a full step's pages are for refills sent ahead,
        off that path).

        The page more is for blocks that straddle a page: a step that takes the blocks of
        the step before may need one page more than it did (a prefill step of 8 prompts of
        1,024 tokens takes 520 blocks, 8 or 9 pages of 64). Without it, such steps mapped a
        page on their path (a simulated saturation burst, 12-07: 49 blocking maps with the
        pace alone, 18 with it)."""
        pace = self.pace + 1 if self.busy and self.pace else self.pace
        return min(self.max_pages if inline else self.ceiling(), max(self.min_pages, pace))


@dataclass(slots=True)
class EngineLimit:
    """The most kv pages the engine may have mapped, as its ``limiter`` last answered.

    ``mapped`` below always counts refills in flight (they are mapped, or are being). No
    limiter, or an answer of None: no limit, and every question answers as if unbounded.
    """

    limiter: Limiter | None = None
    pages: int | None = None  # the limiter's last answer

    def poll(self, *, mapped: int, in_use: int) -> None:
        """Publish what the pool maps and read the limit for the next step."""
        if self.limiter is not None:
            self.pages = self.limiter.poll(mapped=mapped, in_use=in_use, reserved=mapped - in_use)

    def room(self, *, mapped: int, unbounded: int) -> int:
        """Pages the limit still allows mapping (``unbounded`` when there is no limit)."""
        return unbounded if self.pages is None else max(0, self.pages - mapped)

    def keep(self, keep: int, *, reserve: int, mapped: int) -> int:
        """At most ``keep`` reserve pages, fewer while the pool is over its limit."""
        if self.pages is None:
            return keep
        return max(0, min(keep, reserve - (mapped - self.pages)))

    def over(self, *, mapped: int, reserve: int) -> int:
        """Pages mapped beyond the limit that the reserve cannot give back (in use)."""
        return 0 if self.pages is None else max(0, mapped - self.pages - reserve)

    def close(self) -> None:
        if self.limiter is not None:
            self.limiter.close()


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries an operation that ran out of physical memory, with a doubling pause.

    A waiting call makes ``1 + retries`` attempts at most, pausing ``backoff_s * 2**k``
    after the ``k``-th failure; a call that does not wait makes one. Only
    `PhysicalMemoryExhausted` (which includes injected faults) is retried: memory another
    process holds may come back, a driver error or a broken invariant will not.
    """

    retries: int
    backoff_s: float
    sleep: Sleeper = time.sleep

    def __post_init__(self) -> None:
        if self.retries < 0 or not self.backoff_s >= 0.0:
            raise ConfigError(f"retry policy needs retries >= 0 and backoff_s >= 0, got "
                              f"{self.retries} and {self.backoff_s}")

    @classmethod
    def from_config(cls, config: KvcachedConfig, sleep: Sleeper = time.sleep) -> RetryPolicy:
        return cls(config.map_retries, config.retry_backoff_s, sleep)

    def run(self, attempt: Callable[[], None], *, wait: bool) -> None:
        """Call ``attempt`` until it returns; re-raise its last exhaustion."""
        attempts = self.retries + 1 if wait else 1
        for k in range(attempts):
            try:
                attempt()
                return
            except PhysicalMemoryExhausted:
                if k + 1 == attempts:
                    raise
                self.sleep(self.backoff_s * (2**k))


#: Failed quarantine retries in a row that make a pool FAILED.
FAILED_AFTER = 5
#: Backoff of quarantine retries, in steps (`collect` calls): 2, 4, 8, ... at most this many.
MAX_RETRY_STEPS = 1024


@dataclass(slots=True)
class Quarantine:
    """Pages whose unmap failed somewhere, and when to try them again.

    A quarantined page is still mapped in some backing or rank: the pool never hands it
    out or maps it again, and it stays charged. After ``k`` failed retries in a row the
    next is ``2**k`` steps later (at most `MAX_RETRY_STEPS`), so a backend that keeps
    refusing costs one failing call per few hundred steps, not one per step.
    ``unmap_failures`` counts every refused unmap (first tries and retries alike). A retry
    has a per-page outcome: the pages it unmapped everywhere leave, even when others fail.
    Invariants: ``pages`` are exactly the pages some backing or rank still maps (after
    the failed call that put them here); ``failures == retry_at == 0`` whenever ``pages``
    is empty after a retry.
    """

    pages: set[int] = field(default_factory=set)
    failures: int = 0  # failed retries in a row
    retry_at: int = 0  # the step of the next retry
    steps: int = 0  # steps seen (`end_step` calls)
    unmap_failures: int = 0

    def add(self, pages: Sequence[int]) -> None:
        """An unmap of ``pages`` failed (counted once, however many pages)."""
        self.unmap_failures += 1
        self.pages.update(pages)

    def end_step(self) -> None:
        self.steps += 1

    def due(self, *, now: bool = False) -> bool:
        """Whether a retry should run (``now``: whenever there is something to retry)."""
        return bool(self.pages) and (now or self.steps >= self.retry_at)

    def retry_failed(self, still: Collection[int] | None = None) -> list[int]:
        """The retry failed for ``still`` (default: every page): back off. The other pages
        were unmapped everywhere: returns them, now free, and forgets them (a page that no
        backing or rank maps any more can only be refused by a later retry, never healed).
        ``still`` empty: nothing is left, as after a success."""
        self.unmap_failures += 1
        freed = [] if still is None else sorted(self.pages.difference(still))
        if len(freed) == len(self.pages):
            return self.retry_succeeded()
        self.pages.difference_update(freed)  # in place: the pool hands this set out
        self.failures += 1
        self.retry_at = self.steps + min(2**self.failures, MAX_RETRY_STEPS)
        return freed

    def retry_succeeded(self) -> list[int]:
        """The retry unmapped everything: returns the pages, now free, and forgets them."""
        pages = sorted(self.pages)
        self.pages.clear()
        self.failures = self.retry_at = 0
        return pages

    @property
    def health(self) -> PoolHealth:
        if not self.pages:
            return PoolHealth.HEALTHY
        return PoolHealth.FAILED if self.failures >= FAILED_AFTER else PoolHealth.DEGRADED


@dataclass(slots=True)
class CapacityCache:
    """The physical-capacity answer, reused for ``ttl_s`` and dropped by the pool's own
    maps and unmaps (so only other processes' changes can be stale)."""

    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _cached: tuple[float, int] | None = None  # (when, kv pages)

    def get(self, measure: Callable[[], int]) -> int:
        """The cached answer while fresh, else ``measure()`` (cached from now)."""
        now = self.clock()
        if self._cached is not None and now - self._cached[0] < self.ttl_s:
            return self._cached[1]
        pages = measure()
        self._cached = (now, pages)
        return pages

    def invalidate(self) -> None:
        self._cached = None


@dataclass(frozen=True, slots=True)
class PoolPolicies:
    """The policies one `PagePool` is given. Each object holds that pool's state: a set
    serves exactly one pool (`from_config` builds a fresh one)."""

    reserve: ReservePolicy
    limit: EngineLimit
    retry: RetryPolicy
    quarantine: Quarantine
    capacity: CapacityCache

    @classmethod
    def from_config(cls, config: KvcachedConfig, limiter: Limiter | None = None,
                    sleep: Sleeper = time.sleep) -> PoolPolicies:
        return cls(ReservePolicy.from_config(config), EngineLimit(limiter), RetryPolicy.from_config(config, sleep),
                   Quarantine(), CapacityCache(config.capacity_ttl_s))


class FailingSpace:
    """A `KvPageSpace` that refuses maps on purpose, then forwards to ``inner``.

    Site ``map`` of ``faults`` is checked once per page *before* the inner space sees the
    batch (a fault on the n-th page maps nothing, and a space spanning ranks still gets one
    request); a deferred map is refused the same way, before it is sent. Everything else
    is the inner space's.
    """

    __slots__ = ("faults", "inner")

    def __init__(self, inner: KvPageSpace, faults: FaultInjector) -> None:
        self.inner = inner
        self.faults = faults

    def _check(self, kv_pages: Sequence[int]) -> None:
        for _ in kv_pages:
            self.faults.check("map")

    @property
    def num_kv_pages(self) -> int:
        return self.inner.num_kv_pages

    @property
    def kv_page_bytes(self) -> int:
        return self.inner.kv_page_bytes

    @property
    def vmm_page_bytes(self) -> int:
        return self.inner.vmm_page_bytes

    @property
    def round_trips(self) -> int:
        return self.inner.round_trips

    @property
    def defers_maps(self) -> bool:
        return self.inner.defers_maps

    def map_pages(self, kv_pages: Sequence[int]) -> None:
        if kv_pages:
            self._check(kv_pages)
        self.inner.map_pages(kv_pages)

    def map_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        self._check(kv_pages)
        return self.inner.map_pages_later(kv_pages)

    def unmap_pages(self, kv_pages: Sequence[int], *, strict: bool = True) -> None:
        self.inner.unmap_pages(kv_pages, strict=strict)

    def unmap_pages_later(self, kv_pages: Sequence[int]) -> Confirmation:
        return self.inner.unmap_pages_later(kv_pages)

    def still_mapped(self, kv_pages: Sequence[int]) -> list[int]:
        return self.inner.still_mapped(kv_pages)

    def physical_available(self) -> int:
        return self.inner.physical_available()
