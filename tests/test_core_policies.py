"""The pool's policies (`kvcached.policies`), each on its own, and composed into a `PagePool`.

Every policy is a small object with no clock or sleep of its own that a test cannot give
it, so nothing here depends on timing: the retry's pauses go to a recording sleeper, the
capacity cache reads a clock the test moves.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcached.pages
from kvcached.budget import LocalBudget
from kvcached.config import KvcachedConfig
from kvcached.errors import ConfigError, DriverError, InjectedFault, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.pages import KvPageSpace, PagePool, PageSpace, PendingRefills, Settled
from kvcached.policies import (
    FAILED_AFTER,
    MAX_RETRY_STEPS,
    CapacityCache,
    EngineLimit,
    FailingSpace,
    PoolHealth,
    PoolPolicies,
    Quarantine,
    ReservePolicy,
    RetryPolicy,
    WindowMax,
)
from kvcached.ranks import RankedPageSpace
from kvcached.space import plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 4096


class FixedLimiter:
    """A `Limiter` that answers a fixed limit and records what it was told."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.told: list[tuple[int, int, int]] = []
        self.closed = False

    def poll(self, *, mapped: int, in_use: int, reserved: int) -> int | None:
        self.told.append((mapped, in_use, reserved))
        return self.limit

    def close(self) -> None:
        self.closed = True


def test_reserve_follows_the_pace_within_the_watermarks() -> None:
    reserve = ReservePolicy(min_pages=1, max_pages=4)
    assert reserve.target() == 1
    reserve.took(2)
    reserve.took(1)
    assert reserve.target() == 1, "the pace moves at the end of a step"
    reserve.end_step()
    assert (reserve.pace, reserve.target()) == (3, 3)
    for expected in (2, 1, 1):
        reserve.end_step()
        assert reserve.target() == expected
    reserve.took(9)
    reserve.end_step()
    assert reserve.target() == 4, "never above the max watermark"
    with pytest.raises(ConfigError):
        ReservePolicy(min_pages=3, max_pages=2)


def test_a_busy_reserve_may_reach_a_full_steps_pages_and_an_idle_one_keeps_its_watermark() -> None:
    """``step_pages``: while busy the pace, and a page more for blocks that straddle pages,
    may raise the reserve to a full step's pages (above ``max_pages``), and a busy step's
    end keeps what it refills to; idle, the ceiling is ``max_pages`` again. With
    ``step_pages=0`` (unknown) the ceiling stays ``max_pages``."""
    reserve = ReservePolicy(min_pages=1, max_pages=4, step_pages=10)
    reserve.took(8)
    reserve.end_step(busy=True)
    assert (reserve.ceiling(), reserve.target(), reserve.keep(in_use=50)) == (10, 9, 9)
    assert reserve.target(inline=True) == 4, "a map on the step's path carries the watermark's share only"
    reserve.took(12)
    reserve.end_step(busy=True)
    assert reserve.target() == 10, "never above a full step's pages"
    reserve.end_step(busy=False)
    assert (reserve.ceiling(), reserve.target(), reserve.keep(in_use=50)) == (4, 4, 4), "idle: the watermark"
    for _ in range(9):
        reserve.end_step(busy=True)
    assert (reserve.pace, reserve.target()) == (2, 3), "busy: the pace and a page more"
    reserve.end_step(busy=False)
    assert reserve.target() == 1, "idle: the pace alone"
    reserve.end_step(busy=True)
    assert (reserve.pace, reserve.target()) == (0, 1), "no page more for a pace of 0: no step takes any"
    plain = ReservePolicy(min_pages=1, max_pages=4)
    plain.took(8)
    plain.end_step(busy=True)
    assert (plain.ceiling(), plain.target(), plain.keep(in_use=50)) == (4, 4, 4)
    with pytest.raises(ConfigError):
        ReservePolicy(min_pages=1, max_pages=4, step_pages=-1)


def test_a_holding_reserve_keeps_the_pace_of_its_busiest_recent_step() -> None:
    """Holding (``hold_steps``): while busy and growing (pages in use at the window's peak),
    the pace is at least the most pages one of the last ``hold_steps`` busy steps took, so
    decode steps between two waves of prefill steps do not decay it; past the window, below
    the window's peak in use (emptied pages are held for the next step), or at an idle step,
    it decays as without holding."""
    held, plain = ReservePolicy(1, 4, hold_steps=3, step_pages=10), ReservePolicy(1, 4, step_pages=10)
    for reserve in (held, plain):
        reserve.took(8)
        reserve.end_step(in_use=8, busy=True)
    for step in range(2):  # decode steps: nothing taken, as many pages in use
        for reserve in (held, plain):
            reserve.end_step(in_use=8, busy=True)
        assert (held.pace, plain.pace) == (8, 7 - step)
    shrunk = ReservePolicy(1, 4, hold_steps=3, step_pages=10)
    shrunk.took(8)
    shrunk.end_step(in_use=8, busy=True)
    shrunk.end_step(in_use=6, busy=True)  # two pages emptied, held: they serve the next step
    assert shrunk.pace == 7, "below the peak in use the pace decays"
    assert held.target() == 9, "the held pace and a page more"
    held.end_step(in_use=8, busy=True)  # the 8-page step leaves the window of 3
    assert held.pace == 7, "then it decays"
    held.took(8)
    held.end_step(in_use=16, busy=True)
    held.end_step(busy=False)
    assert (held.pace, held.target(), held.taken_lately.max()) == (7, 4, 0), "idle: forgotten, the watermark"


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 6), values=st.lists(st.integers(0, 20), max_size=40))
def test_a_window_max_is_the_max_of_the_last_values(size: int, values: list[int]) -> None:
    """`WindowMax` against its definition: the max of the last ``size`` values pushed (0: none)."""
    window = WindowMax(size)
    for i, value in enumerate(values):
        window.push(value)
        last = values[max(0, i + 1 - size):i + 1] if size else []
        assert window.max() == max(last, default=0)
    window.clear()
    assert window.max() == 0
    with pytest.raises(ConfigError):
        WindowMax(-1)


def test_engine_limit_answers_as_unbounded_without_a_limit() -> None:
    limit = EngineLimit()
    limit.poll(mapped=5, in_use=3)  # no limiter: nothing to ask
    assert limit.pages is None
    assert limit.room(mapped=5, unbounded=100) == 100
    assert limit.keep(4, reserve=2, mapped=5) == 4
    assert limit.over(mapped=5, reserve=2) == 0
    limit.close()


def test_engine_limit_caps_room_and_reserve_and_names_what_only_in_use_pages_exceed() -> None:
    limiter = FixedLimiter(3)
    limit = EngineLimit(limiter)
    limit.poll(mapped=5, in_use=4)
    assert limiter.told == [(5, 4, 1)] and limit.pages == 3
    assert limit.room(mapped=2, unbounded=100) == 1 and limit.room(mapped=5, unbounded=100) == 0
    assert limit.keep(4, reserve=1, mapped=5) == 0, "two over: the one reserve page goes"
    assert limit.keep(4, reserve=3, mapped=4) == 2
    assert limit.over(mapped=5, reserve=1) == 1, "one page over that only in-use pages hold"
    limit.close()
    assert limiter.closed


def test_retry_sleeps_the_configured_doubling_pauses_and_reraises_the_last() -> None:
    slept: list[float] = []
    retry = RetryPolicy.from_config(KvcachedConfig(map_retries=3, retry_backoff_s=0.25), sleep=slept.append)
    calls = 0

    def exhausted() -> None:
        nonlocal calls
        calls += 1
        raise PhysicalMemoryExhausted(f"attempt {calls}")

    with pytest.raises(PhysicalMemoryExhausted, match="attempt 4"):
        retry.run(exhausted, wait=True)
    assert slept == [0.25, 0.5, 1.0]
    calls = 0
    with pytest.raises(PhysicalMemoryExhausted, match="attempt 1"):
        retry.run(exhausted, wait=False)
    assert slept == [0.25, 0.5, 1.0], "a caller that does not wait makes one attempt"


def test_retry_stops_at_the_first_success_and_never_retries_other_errors() -> None:
    slept: list[float] = []
    retry = RetryPolicy(retries=5, backoff_s=0.1, sleep=slept.append)
    outcomes: list[BaseException | None] = [PhysicalMemoryExhausted("busy"), None]

    def flaky() -> None:
        if (outcome := outcomes.pop(0)) is not None:
            raise outcome

    retry.run(flaky, wait=True)
    assert slept == [0.1] and not outcomes

    def broken() -> None:
        raise DriverError("CUDA_ERROR_UNKNOWN")

    with pytest.raises(DriverError):
        retry.run(broken, wait=True)
    assert slept == [0.1]
    with pytest.raises(ConfigError):
        RetryPolicy(retries=-1, backoff_s=0.1)


def test_quarantine_backs_off_and_decides_health() -> None:
    quarantine = Quarantine()
    assert quarantine.health is PoolHealth.HEALTHY and not quarantine.due(now=True)
    quarantine.add([3, 1])
    assert quarantine.unmap_failures == 1 and quarantine.health is PoolHealth.DEGRADED
    retried_at: list[int] = []
    for step in range(1, 200):
        quarantine.end_step()
        if quarantine.health is PoolHealth.FAILED:
            break
        if quarantine.due():
            retried_at.append(step)
            quarantine.retry_failed()
    assert retried_at == [1, 3, 7, 15, 31], "2, 4, 8, 16 steps apart"
    assert quarantine.failures == FAILED_AFTER and quarantine.unmap_failures == 1 + FAILED_AFTER
    assert quarantine.due(now=True) and not quarantine.due()
    assert quarantine.retry_succeeded() == [1, 3]
    assert quarantine.health is PoolHealth.HEALTHY and (quarantine.failures, quarantine.retry_at) == (0, 0)


def test_a_quarantine_retry_has_a_per_page_outcome() -> None:
    """A retry that unmapped some pages everywhere and failed for others frees the first at
    once and backs off for the rest only; one that left nothing is a success."""
    quarantine = Quarantine()
    quarantine.add([1, 2, 5])
    assert quarantine.retry_failed(still=[2]) == [1, 5]
    assert quarantine.pages == {2} and quarantine.failures == 1 and quarantine.health is PoolHealth.DEGRADED
    assert quarantine.retry_failed(still=[]) == [2]
    assert quarantine.health is PoolHealth.HEALTHY and (quarantine.failures, quarantine.retry_at) == (0, 0)
    assert quarantine.unmap_failures == 3


def test_quarantine_backoff_is_capped() -> None:
    quarantine = Quarantine(pages={0}, failures=40)
    quarantine.retry_failed()
    assert quarantine.retry_at == quarantine.steps + MAX_RETRY_STEPS


def test_capacity_cache_reuses_its_answer_until_the_ttl_or_an_invalidation() -> None:
    now = [10.0]
    cache = CapacityCache(ttl_s=1.0, clock=lambda: now[0])
    answers = iter([7, 5, 3])
    assert cache.get(lambda: next(answers)) == 7
    now[0] += 0.5
    assert cache.get(lambda: next(answers)) == 7
    now[0] += 0.5
    assert cache.get(lambda: next(answers)) == 5, "expired at the TTL"
    cache.invalidate()
    assert cache.get(lambda: next(answers)) == 3


def local_space(pages: int = 8, budget: LocalBudget | None = None) -> tuple[PageSpace, object]:
    vrange = _vmm.VirtualRange("cpu", pages * PAGE, PAGE)
    return PageSpace((vrange,), (1,), pages, budget), vrange


def test_failing_space_refuses_before_its_inner_space_sees_the_batch() -> None:
    space, vrange = local_space()
    faults = FaultInjector.from_plans([{"site": "map", "skip": 2, "fail_next": 1}])
    failing: KvPageSpace = FailingSpace(space, faults)
    with pytest.raises(InjectedFault):
        failing.map_pages([0, 1, 2, 3])  # the third page's check fails: nothing mapped
    assert vrange.num_mapped == 0 and faults.fired("map") == 1  # type: ignore[attr-defined]
    failing.map_pages([0, 1])
    assert failing.still_mapped([0, 1, 2]) == [0, 1]
    failing.unmap_pages([0, 1])
    assert vrange.num_mapped == 0 and not failing.defers_maps  # type: ignore[attr-defined]


def test_a_local_space_maps_at_once_when_asked_to_map_later() -> None:
    space, vrange = local_space(budget=LocalBudget(PAGE))
    assert not space.defers_maps
    confirmation = space.map_pages_later([2])
    assert confirmation.done() and vrange.is_mapped(2)  # type: ignore[attr-defined]
    confirmation.result()
    refused = space.map_pages_later([3])
    assert refused.done() and isinstance(refused, Settled)
    with pytest.raises(PhysicalMemoryExhausted):
        refused.result()


def test_both_spaces_are_the_protocol() -> None:
    """The protocol is the whole contract: both spaces satisfy it (mypy checks these
    assignments), and the pool never probes its space for more."""
    geometry = plan_geometry([PAGE], 8, PAGE)
    spaces: list[KvPageSpace] = [local_space()[0], RankedPageSpace(geometry, channel=None, ranks=1)]  # type: ignore[arg-type]
    assert [s.defers_maps for s in spaces] == [False, True]
    assert spaces[1].still_mapped([0, 1]) == []
    tree = ast.parse(inspect.getsource(kvcached.pages.PagePool))
    probes = [node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "isinstance")]
    assert probes == []


def test_the_pool_runs_on_the_policies_it_is_given() -> None:
    """A pool given its policies uses them: the retry sleeps through the given sleeper (the
    memory comes back while it sleeps), the limiter caps capacity, and the reserve's
    watermarks are the policy's, not the config's."""
    budget = LocalBudget(PAGE)
    space, vrange = local_space(budget=budget)
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        budget.limit = 8 * PAGE  # another engine gave its memory back meanwhile

    limiter = FixedLimiter(None)
    policies = PoolPolicies(ReservePolicy(1, 2), EngineLimit(limiter), RetryPolicy(2, 0.5, sleep),
                            Quarantine(), CapacityCache(0.0))
    pool = PagePool(space, config, policies=policies)
    pool.acquire([0, 1], wait=True)
    assert slept == [0.5] and pool.in_use == {0, 1} and len(pool.reserve) == 1, "refilled to the policy's min"
    limiter.limit = 4
    pool.release([0, 1])
    pool.collect()
    assert pool.limit_pages == 4 and pool.capacity_pages() == 2
    assert len(pool.reserve) == 2, "trimmed to the policy's max watermark, not the config's 0"
    pool.close()
    assert vrange.num_mapped == 0 and budget.used == 0  # type: ignore[attr-defined]
    with pytest.raises(ConfigError):
        PagePool(space, config, policies=PoolPolicies.from_config(config), limiter=limiter)


def test_a_refused_deferred_refill_is_a_map_failure_with_nothing_pending() -> None:
    """The fault adaptor refuses a deferred refill before it is sent: counted as a map
    failure, nothing pending, as if the ranks had refused it."""

    class Later:
        def __init__(self) -> None:
            self.sent: list[Sequence[int]] = []

        def call(self, request: object) -> list:
            raise AssertionError("a blocking call was not expected")

        def call_later(self, request: object) -> object:
            self.sent.append(request)  # type: ignore[arg-type]
            return None

    channel = Later()
    space = RankedPageSpace(plan_geometry([PAGE], 8, PAGE), channel, ranks=1)
    faults = FaultInjector.from_plans([{"site": "map", "fail_next": 1}])
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=1, max_reserve_pages=1, capacity_ttl_s=60.0)
    pool = PagePool(space, config, faults=faults)
    pool.adopt([0])
    pool.acquire([0])  # the top-up is a deferred refill of page 1: refused on purpose
    assert channel.sent == [] and not pool.pending and pool.counters().map_failures == 1


class Reply:
    """A `Confirmation` whose replies arrive when the test says (or when another's
    ``result`` is waited for: ``then`` arrives with it)."""

    def __init__(self, then: Reply | None = None) -> None:
        self.arrived = False
        self.then = then

    def done(self) -> bool:
        return self.arrived

    def result(self) -> None:
        self.arrived = True
        if self.then is not None:
            self.then.arrived = True


def test_pending_refills_settle_what_arrived_and_what_is_waited_for() -> None:
    later = Reply()
    first = Reply(then=later)
    pending = PendingRefills()
    pending.add([4, 5], first)
    pending.add([7], later)
    assert pending.waits_for([5, 6, 7]) == {5, 7} and 6 not in pending and len(pending) == 3
    assert list(pending.take(wait=False)) == [], "no replies in: nothing settled, nothing waited for"
    settled = []
    for conf, batch in pending.take(wait=True, pages=[4]):
        conf.result()  # waiting for the first brings the second's replies too
        settled.append(batch)
    assert settled == [[4, 5], [7]] and not pending
