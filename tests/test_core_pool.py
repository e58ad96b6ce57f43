"""PagePool, config and fault-injection behaviour on the real CPU backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached.budget import BudgetRecord, LocalBudget
from kvcached.config import KvcachedConfig, enabled_from_env
from kvcached.errors import ConfigError, InjectedFault, InvariantError, PhysicalMemoryExhausted
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool, PageSpace
from kvcached.policies import PoolPolicies
from kvcached.space import plan_geometry

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 64 << 10


def make_pool(num_pages: int = 8, budget_pages: int | None = None, ranges: int = 1,
              faults: FaultInjector | None = None, budget: object = None,
              **cfg) -> tuple[PagePool, list, object]:
    config = KvcachedConfig(page_size=PAGE, **{"min_reserve_pages": 0, "max_reserve_pages": 0,
                                               "capacity_ttl_s": 0.0, **cfg})
    if budget_pages is not None:
        budget = LocalBudget(budget_pages * PAGE)
    vranges = [_vmm.VirtualRange("cpu", num_pages * PAGE, PAGE) for _ in range(ranges)]
    space = PageSpace(tuple(vranges), (1,) * ranges, num_pages, budget)  # type: ignore[arg-type]
    return PagePool(space, config, fence=StepFence(), faults=faults), vranges, budget


def test_acquire_maps_in_every_backing_and_release_unmaps_after_collect():
    pool, (a, b), _ = make_pool(ranges=2)
    pool.acquire([1, 3])
    assert a.mapped_pages() == [1, 3] and b.mapped_pages() == [1, 3]
    pool.release([1, 3])
    assert pool.mapped == {1, 3}  # idle pages wait in the reserve until collected
    assert pool.collect() == 2
    assert a.num_mapped == 0 and b.num_mapped == 0


def test_reserve_watermarks():
    pool, (vr,), _ = make_pool(num_pages=8, min_reserve_pages=2, max_reserve_pages=3)
    pool.acquire([0])
    assert len(pool.reserve) == 2, "min watermark refilled after a take"
    pool.acquire([5, 6])
    pool.release([0, 5, 6])
    pool.collect()
    assert len(pool.reserve) == 3, "trimmed down to the max watermark"
    assert vr.num_mapped == 3


def test_failure_in_the_middle_of_a_batch_rolls_back():
    faults = FaultInjector.from_plans([{"site": "map", "skip": 2, "fail_next": 1}])
    pool, (vr,), _ = make_pool(faults=faults)
    with pytest.raises(InjectedFault):
        pool.acquire([0, 1, 2, 3])
    assert vr.num_mapped == 0 and pool.mapped == set()
    assert faults.fired("map") == 1
    pool.acquire([0, 1, 2, 3])  # the plan is spent: the same batch now succeeds
    assert vr.mapped_pages() == [0, 1, 2, 3]


def test_budget_exhaustion_is_typed_and_leaks_nothing():
    pool, (vr,), budget = make_pool(budget_pages=3)
    pool.acquire([0, 1])
    with pytest.raises(PhysicalMemoryExhausted):
        pool.acquire([2, 3])
    assert vr.mapped_pages() == [0, 1] and budget.used == 2 * PAGE
    assert pool.in_use == {0, 1}


def test_fence_keeps_pages_mapped_while_a_step_is_in_flight():
    pool, (vr,), _ = make_pool()
    pool.acquire([4])
    step = pool.fence.begin_step()
    assert step == 1
    pool.release([4])  # e.g. a copy-on-write retention freed right after scheduling
    assert pool.trim() == 0 and vr.is_mapped(4), "unmapped under an in-flight step"
    pool.fence.end_step()
    assert pool.trim() == 1 and not vr.is_mapped(4)


def test_capacity_query_is_cached_and_invalidated_by_own_maps():
    pool, _, budget = make_pool(budget_pages=4, capacity_ttl_s=60.0)
    assert pool.capacity_pages() == 4
    budget.limit = 2 * PAGE  # someone else's change: invisible until the TTL expires
    assert pool.capacity_pages() == 4
    pool.acquire([0])  # our own map invalidates the cache
    assert pool.capacity_pages() == 1


def test_bounded_retry_recovers_when_pressure_goes_away(tmp_path: Path):
    """Another process holds the budget; the pool's retry pauses, the other process lets go
    during the pause, and the retry maps. Event-driven: the pause itself tells the other
    process to let go and waits until it has (no wall-clock bound, so a busy machine passes)."""
    path = str(tmp_path / "arena")
    shared = BudgetRecord(path, limit=2 * PAGE)
    hog = subprocess.Popen([sys.executable, "-c", (
        "import sys; from kvcached import _vmm; from kvcached.budget import BudgetRecord\n"
        "from kvcached.pages import PageSpace\n"
        f"b=BudgetRecord({path!r}).slot(rank=0, device='cpu'); r=_vmm.VirtualRange('cpu', {2 * PAGE}, {PAGE})\n"
        "s=PageSpace((r,), (1,), 2, b)\n"
        "s.map_pages([0,1]); print('held', flush=True); sys.stdin.readline()\n"
        "s.unmap_pages([0,1]); print('released', flush=True); sys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hog.stdin is not None and hog.stdout is not None and hog.stdout.readline().strip() == "held"
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # the retry's backoff: the other process lets go now
        pauses.append(seconds)
        if len(pauses) == 1:
            hog.stdin.write("go\n")
            hog.stdin.flush()
            assert hog.stdout.readline().strip() == "released"

    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=0, capacity_ttl_s=0.0,
                            map_retries=4, retry_backoff_s=0.05)
    vr = _vmm.VirtualRange("cpu", 8 * PAGE, PAGE)
    space = PageSpace((vr,), (1,), 8, shared.slot(rank=0, device="cpu"))
    pool = PagePool(space, config, fence=StepFence(), policies=PoolPolicies.from_config(config, sleep=pause))
    with pytest.raises(PhysicalMemoryExhausted):
        pool.acquire([0], wait=False)
    assert pauses == []  # no wait asked: no retry
    pool.acquire([0], wait=True)  # retries with backoff until the other process lets go
    assert pauses == [0.05] and pool.mapped == {0}
    hog.stdin.close()
    assert hog.wait(timeout=60) == 0


def test_ledger_fills_mapped_pages_first_and_returns_empty_pages():
    geometry = plan_geometry([PAGE // 4], 32, PAGE)
    pool, (vr,), _ = make_pool(num_pages=geometry.num_kv_pages)
    ledger = BlockLedger(32, geometry.blocks_per_page, pool, pinned=[0])
    first = ledger.allocate(3)
    assert {ledger.page_of(b) for b in first} == {0}, "fills the pinned block's page first"
    more = ledger.allocate(2)
    assert {ledger.page_of(b) for b in more} == {1}
    assert ledger.release(more) == [1]
    with pytest.raises(InvariantError):
        ledger.release(more)  # double free is a bug, loudly
    pool.trim()
    assert vr.mapped_pages() == [0]


@pytest.mark.parametrize("bad", ["duplicate", "not held", "out of range"])
def test_a_bad_id_in_a_batch_release_changes_nothing(bad: str):
    geometry = plan_geometry([PAGE // 4], 32, PAGE)
    pool, _, _ = make_pool(num_pages=geometry.num_kv_pages)
    ledger = BlockLedger(32, geometry.blocks_per_page, pool, pinned=[0])
    held = ledger.allocate(6)  # pages 0 and 1
    intruder = {"duplicate": held[1], "not held": 31, "out of range": 32}[bad]
    before = ([ledger.is_held(b) for b in range(32)], ledger.num_held, ledger.backed_free, set(pool.in_use))
    with pytest.raises(InvariantError, match=str(intruder)):
        ledger.release([*held[:3], intruder, *held[3:]])
    assert ([ledger.is_held(b) for b in range(32)], ledger.num_held, ledger.backed_free, set(pool.in_use)) == before
    ledger.check()
    assert sorted(ledger.release(held)) == [1]  # the same blocks still release cleanly


def test_config_validation_names_the_variable():
    with pytest.raises(ConfigError, match="KVCACHED_PAGE_SIZE"):
        KvcachedConfig.resolve(env={"KVCACHED_PAGE_SIZE": "1000"})
    with pytest.raises(ConfigError, match=r"KVCACHED_MAX_CACHED_BLOCKS.*accepted"):
        KvcachedConfig.resolve(env={"KVCACHED_MAX_CACHED_BLOCKS": "-7"})
    with pytest.raises(ConfigError, match="KVCACHED_MIN_RESERVE_PAGES"):
        KvcachedConfig.resolve(env={"KVCACHED_MIN_RESERVE_PAGES": "9", "KVCACHED_MAX_RESERVE_PAGES": "2"})
    explicit = KvcachedConfig.resolve(env={"KVCACHED_PAGE_SIZE": "8192"}, page_size=PAGE)
    assert explicit.page_size == PAGE, "explicit arguments win over the environment"
    assert KvcachedConfig.resolve(env={"KVCACHED_CAPACITY_TTL_MS": "250"}).capacity_ttl_s == 0.25
    assert enabled_from_env({"ENABLE_KVCACHED": "true"}) is True
    assert enabled_from_env({}) is False
    with pytest.raises(ConfigError, match="KVCACHED_ENABLE"):
        enabled_from_env({"KVCACHED_ENABLE": "maybe"})
    with pytest.raises(ConfigError, match="disagree"):
        enabled_from_env({"KVCACHED_ENABLE": "1", "ENABLE_KVCACHED": "false"})
    assert KvcachedConfig.resolve(env={}).background_refill == "auto"
    assert KvcachedConfig.resolve(env={"KVCACHED_BACKGROUND_REFILL": " On "}).background_refill == "on"
    for bad in ("", "yes", "1"):
        with pytest.raises(ConfigError, match=r"KVCACHED_BACKGROUND_REFILL.*auto, on, off"):
            KvcachedConfig.resolve(env={"KVCACHED_BACKGROUND_REFILL": bad})


def test_fault_plan_file_is_driven_from_another_process(tmp_path: Path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"plans": []}))
    faults = FaultInjector.from_env(str(plan))
    assert faults is not None
    faults.check("admission")  # nothing armed
    # Another process arms a triggered plan.
    subprocess.run([sys.executable, "-c", (
        "import json,sys; open(sys.argv[1],'w').write(json.dumps({'plans': [{'site': "
        "'cow_admission', 'after_trigger': 'partial_prefix_hit', 'fail_next': 2}]}))"), str(plan)],
        check=True)
    os.utime(plan, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    faults.check("cow_admission")  # not armed until the trigger fires
    faults.trigger("partial_prefix_hit")
    for _ in range(2):
        with pytest.raises(InjectedFault):
            faults.check("cow_admission")
    faults.check("cow_admission")  # spent
    fired = json.loads((tmp_path / "plan.json.fired.json").read_text())
    assert fired["fired"] == {"cow_admission": 2}


def test_fault_plan_errors_are_clear(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        FaultInjector.from_env(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"plans": [{"site": "nowhere"}]}))
    with pytest.raises(ConfigError, match="accepted sites"):
        FaultInjector.from_env(str(bad))
    assert FaultInjector.from_env("") is None


def test_lowest_unmapped_stays_exact_and_bounded_over_many_map_cycles():
    """The lazy heap drops stale entries and duplicates, and is rebuilt before it grows
    past twice the space: after 200 map/unmap cycles the answer is still the definition."""
    pool, (vr,), _ = make_pool(num_pages=8)
    for i in range(200):
        pages = [i % 8, (3 * i + 1) % 8]
        pool.acquire(pages)
        assert pool.lowest_unmapped(8) == [p for p in range(8) if p not in pages]
        pool.release(pages)
        pool.collect()
        assert len(pool._unmapped) <= 2 * 8 + 64
    pool.acquire([2, 5])
    assert pool.lowest_unmapped(3) == [0, 1, 3] and pool.lowest_unmapped(100) == [0, 1, 3, 4, 6, 7]
    assert vr.mapped_pages() == [2, 5]


def test_reserve_hits_and_blocking_maps_are_counted_per_page():
    """A take from the reserve is a hit; a page mapped on the caller's path is a blocking
    map (the local space has no deferred refill: its top-up maps on the path too)."""
    pool, _, _ = make_pool(num_pages=8, min_reserve_pages=1, max_reserve_pages=1)
    pool.acquire([0])  # not mapped: one blocking map, then the top-up maps one more
    c = pool.counters()
    assert (c.takes, c.reserve_hits, c.blocking_maps) == (1, 0, 2)
    (refill,) = pool.reserve
    pool.acquire([refill])  # from the reserve: a hit (and another top-up)
    c = pool.counters()
    assert (c.takes, c.reserve_hits, c.blocking_maps) == (2, 1, 3)


def test_reserve_keeps_the_pace_of_recent_steps_within_the_watermarks():
    """A step that took 3 pages makes the next refill 3 pages (not min=1), so a steady demand
    of several pages a step finds them mapped; idle steps decay the pace back to min."""
    pool, _, _ = make_pool(num_pages=16, min_reserve_pages=1, max_reserve_pages=4)
    pool.acquire([0, 1, 2])
    assert pool.policies.reserve.target() == 1 and len(pool.reserve) == 1
    pool.collect()  # end of the step: it took 3 pages
    assert pool.policies.reserve.pace == 3 and pool.policies.reserve.target() == 3
    (page,) = pool.reserve
    pool.acquire([page])
    assert len(pool.reserve) == 3, "refilled to the pace"
    for expected in (2, 1, 1):  # steps without takes: the pace decays by one a step
        pool.collect()
        assert pool.policies.reserve.target() == max(1, expected)
    pool.acquire([9, 10, 11, 12, 13, 14])
    pool.collect()
    assert pool.policies.reserve.pace == 6 and pool.policies.reserve.target() == 4, "never above the max watermark"


@pytest.mark.parametrize("step_pages", [0, 9])
def test_a_busy_pool_maps_a_full_steps_pages_ahead(step_pages: int) -> None:
    """Prefill steps that each take 8 pages (a wave of long prompts): with ``step_pages`` the
    reserve refills a full step's pages after each take, so from the second step on every
    take is a reserve hit; with the max watermark alone (4), half of each step's pages are
    mapped on its path. Idle, the pool keeps its watermark either way."""
    pool, (vr,), _ = make_pool(num_pages=64, min_reserve_pages=1, max_reserve_pages=4)
    pool.set_step_pages(step_pages)
    hits = []
    for step in range(4):
        before = pool.counters().reserve_hits
        pool.acquire(range(8 * step, 8 * step + 8))
        hits.append(pool.counters().reserve_hits - before)
        pool.collect(busy=True)
    # Step 1 refills to the min (no pace yet), step 2 to the pace within the ceiling.
    assert hits == ([0, 1, 8, 8] if step_pages else [0, 1, 4, 4])
    pool.release(range(32))
    pool.collect(busy=False)
    assert vr.num_mapped == 4, "idle: the max watermark, whatever a step took"
    with pytest.raises(ConfigError):
        pool.set_step_pages(65)


def test_a_steps_takes_top_the_reserve_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The takes of one scheduler step, one a request (`batch_top_ups`), top the reserve up
    once, at the step's end; a take that empties the reserve refills it at once. Outside a
    batch every take tops up."""
    pool, _, _ = make_pool(num_pages=64, min_reserve_pages=1, max_reserve_pages=4)
    pool.set_step_pages(9)
    tops: list[int] = []
    top_up = pool._top_up
    monkeypatch.setattr(pool, "_top_up", lambda: (tops.append(len(pool.reserve)), top_up())[1])

    def step(pages: int) -> tuple[list[int], int]:
        tops.clear()
        hits = pool.counters().reserve_hits
        pool.batch_top_ups()
        for _ in range(pages):
            pool.acquire([min(pool.reserve)])
        pool.end_top_ups()
        pool.collect(busy=True)
        return list(tops), pool.counters().reserve_hits - hits

    pool.acquire(range(8))  # a first step: its pace makes the busy target a step's pages (9)
    pool.collect(busy=True)
    assert len(pool.reserve) == 1  # refilled to the min as it was taken: no pace yet
    assert step(8) == ([0, 2], 8), "the first take emptied the reserve: refilled at once, then at the end"
    assert step(8) == ([1], 8), "one top-up, at the end, of the reserve the takes left 1 page of"
    assert step(10) == ([0, 8], 10), "emptied at the 9th take: refilled at once, then at the end"
    tops.clear()
    for _ in range(3):
        pool.acquire([min(pool.reserve)])
    assert len(tops) == 3, "outside a batch, each take tops up"
    with pytest.raises(InvariantError):
        pool.end_top_ups()


def test_a_busy_pool_holds_pages_it_will_want_again_and_an_idle_one_gives_them_back():
    """Holding (``hold_steps``): a page emptied as one request ends and wanted as the next one
    starts stays mapped while the engine is busy, not unmapped and mapped again; the window
    forgets old peaks, and the first idle step gives back all but the reserve. With
    ``hold_steps=0`` (the default) a busy step gives back as an idle one does."""
    pool, (vr,), _ = make_pool(num_pages=16, hold_steps=3)
    pool.acquire([0, 1, 2, 3])
    pool.collect(busy=True)  # the window's peak: 4 pages in use
    pool.release([2, 3])  # two requests end ...
    assert pool.collect(busy=True) == 0 and vr.num_mapped == 4, "held: the window says 4 in use lately"
    pool.acquire([2])  # ... and the next one takes a page with no driver call
    assert pool.counters().blocking_maps == 4 and pool.counters().maps == 4
    pool.release([0, 1, 2])
    # The window (in use at the ends of the last 3 busy steps) goes [4, 2, 0], [2, 0, 0], [0, 0, 0]:
    # held pages go back as the steps that needed them leave it.
    assert [pool.collect(busy=True) for _ in range(3)] == [0, 2, 2] and vr.num_mapped == 0
    pool.acquire([0, 1, 2])
    pool.collect(busy=True)
    pool.release([0, 1, 2])
    assert pool.collect(busy=False) == 3 and vr.num_mapped == 0, "idle: all but max_reserve_pages (0) go back"
    plain, (vr,), _ = make_pool(num_pages=16)
    plain.acquire([0, 1])
    plain.collect(busy=True)
    plain.release([1])
    assert plain.collect(busy=True) == 1 and vr.num_mapped == 1, "hold_steps=0: given back at once"


def test_holding_never_outlasts_a_limit():
    """A limit (a budget another engine needs) takes held pages back at the next step's end:
    what the pool is over its limit by comes out of the reserve first, held or not."""
    from kvcached.policies import ReservePolicy

    policy = ReservePolicy(0, 0, hold_steps=8)
    policy.end_step(in_use=10, busy=True)
    assert policy.keep(in_use=4) == 6
    assert pool_keep_under_limit(policy, in_use=4, reserve=6, limit=7) == 3
    with pytest.raises(ConfigError, match="hold_steps"):
        ReservePolicy(0, 0, hold_steps=-1)
    with pytest.raises(ConfigError, match="KVCACHED_HOLD_STEPS"):
        KvcachedConfig.resolve(env={"KVCACHED_HOLD_STEPS": "-1"})


def pool_keep_under_limit(policy: object, *, in_use: int, reserve: int, limit: int) -> int:
    from kvcached.policies import EngineLimit

    limit_policy = EngineLimit(pages=limit)
    return limit_policy.keep(policy.keep(in_use), reserve=reserve, mapped=in_use + reserve)  # type: ignore[attr-defined]


@pytest.mark.parametrize("var", ["KVCACHED_CAPACITY_TTL_MS", "KVCACHED_RETRY_BACKOFF_MS"])
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "-1", "1e400"])
def test_non_finite_or_negative_times_are_refused(var: str, raw: str) -> None:
    """``nan`` passed every range check (comparisons with nan are false) and then broke the
    retry path with a ValueError; ``inf`` would wait forever."""
    with pytest.raises(ConfigError, match=var):
        KvcachedConfig.resolve(env={var: raw})


def test_explicit_non_finite_times_are_refused() -> None:
    for name in ("capacity_ttl_s", "retry_backoff_s"):
        with pytest.raises(ConfigError):
            KvcachedConfig.resolve(env={}, **{name: float("nan")})


def test_page_size_aliases_must_agree() -> None:
    """``KVCACHED_PAGE_SIZE_MB`` was silently ignored beside ``KVCACHED_PAGE_SIZE``."""
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=4.*KVCACHED_PAGE_SIZE=2097152"):
        KvcachedConfig.resolve(env={"KVCACHED_PAGE_SIZE": str(2 << 20), "KVCACHED_PAGE_SIZE_MB": "4"})
    agreed = KvcachedConfig.resolve(env={"KVCACHED_PAGE_SIZE": str(4 << 20), "KVCACHED_PAGE_SIZE_MB": "4"})
    assert agreed.page_size == 4 << 20
    assert KvcachedConfig.resolve(env={"KVCACHED_PAGE_SIZE_MB": "4"}).page_size == 4 << 20


@pytest.mark.parametrize("step_pages", [0, 9])
def test_an_admission_on_the_steps_path_carries_only_the_watermarks_refill(step_pages: int) -> None:
    """A map an admission waits for carries the reserve's refill within the max watermark
    (4), however far a busy reserve's ceiling (a full step's pages) lets the pace go: the
    rest is the refill its takes send ahead."""
    from kvcached.ledger import BlockLedger

    pool, _, _ = make_pool(num_pages=64, min_reserve_pages=1, max_reserve_pages=4)
    pool.set_step_pages(step_pages)
    ledger = BlockLedger(128, 2, pool)
    ledger.allocate(16)  # 8 pages in one step: the pace (and one page more, busy)
    pool.collect(busy=True)
    assert len(pool.reserve) == 1 and ledger.backed_free == 2 and pool.policies.reserve.target() == (9 if step_pages else 4)
    maps = pool.counters().maps
    ledger.ensure_backed(ledger.backed_free + 4)  # 2 pages short
    assert pool.counters().maps - maps == 2 + 3, "the 2 pages and the watermark's refill (4, 1 there)"
