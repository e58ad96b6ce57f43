"""The fault plan (`kvcached.faults`, its one definition): the harness's plans round-trip, fired
files read back, bad plans are refused naming the field, and the injector and the harness's
emulated seam evaluate a plan the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.cases import COW_ADMISSION_X2, FAULT_PLANS, MAP_MID_ALLOCATION
from kvcached.errors import ConfigError, InjectedFault
from kvcached.faults import (
    FaultInjector,
    FaultRule,
    RuleState,
    fired_path,
    read_fired,
    read_plan,
    read_triggers,
    write_fired,
    write_plan,
)


def test_plan_round_trip(tmp_path: Path) -> None:
    rules = COW_ADMISSION_X2.rules + MAP_MID_ALLOCATION.rules
    path = write_plan(tmp_path / "plan.json", rules)
    assert read_plan(path) == rules
    assert json.loads(path.read_text()) == {
        "plans": [
            {"site": "cow_admission", "fail_next": 2, "after_trigger": "partial_prefix_hit"},
            {"site": "map", "fail_next": 1, "skip": 1},
        ]
    }


def test_fired_missing_is_none_not_zero(tmp_path: Path) -> None:
    path = write_plan(tmp_path / "plan.json", MAP_MID_ALLOCATION.rules)
    assert read_fired(path) is None
    assert read_triggers(path) == []
    write_fired(path, {"map": 1}, ["partial_prefix_hit"])
    assert read_fired(path) == {"map": 1}
    assert read_triggers(path) == ["partial_prefix_hit"]


def test_write_plan_removes_stale_fired_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    fired_path(path).write_text(json.dumps({"fired": {"map": 9}}))
    write_plan(path, MAP_MID_ALLOCATION.rules)
    assert read_fired(path) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"site": "nowhere", "fail_next": 1},
        {"site": "map", "fail_next": 0},
        {"site": "map", "fail_next": 1, "skip": -1},
        {"site": "map", "fail_next": 1, "after_trigger": "bogus"},
        {"site": "map", "fail_next": True},
        {"site": "map", "fail_next": 1.0},
        {"site": "rank99999_map"},
    ],
)
def test_rule_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="site|fail_next|skip|after_trigger"):
        FaultRule(**kwargs)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{", "invalid JSON"),
        ('{"plans": {}}', "expected"),
        ('{"plans": [], "extra": 1}', "expected"),
        ('{"plans": [{"site": "map", "typo": 1}]}', r"plan 0: unknown plan keys \['typo'\]"),
        ('{"plans": [{"fail_next": 1}]}', "plan 0: a plan needs a site"),
        ('{"plans": [{"site": "map"}, {"site": "map", "skip": -1}]}', "plan 1: skip=-1"),
    ],
)
def test_bad_plan_files_are_refused_naming_the_file_and_the_plan(tmp_path: Path, doc: str, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(doc)
    with pytest.raises(ConfigError, match=message) as info:
        read_plan(path)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match=message):
        FaultInjector.from_env(str(path))
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match="does not exist"):
        FaultInjector.from_env(str(missing))


def test_rank_and_wildcard_sites_are_rules() -> None:
    assert FaultRule("rank3_map").site == "rank3_map"
    state = RuleState.start(FaultRule("*", fail_next=2, skip=1))
    assert [state.check(site) for site in ("map", "admission", "rank0_map", "map")] == [False, True, True, False]


def test_the_injector_and_the_emulated_seam_fire_alike(tmp_path: Path) -> None:
    """The same plan and the same checks: the same failures, whichever end evaluates it."""
    from conformance.engine.emulated_faults import EmulatedSeam

    rules = COW_ADMISSION_X2.rules + MAP_MID_ALLOCATION.rules
    injector = FaultInjector(rules)
    seam = EmulatedSeam(tmp_path / "plan.json", 16, [RuleState.start(r) for r in rules])
    checks = ["cow_admission", "map", "!partial_prefix_hit", "map", "cow_admission", "map", "cow_admission",
              "cow_admission"]
    got_injector, got_seam = [], []
    for check in checks:
        if check.startswith("!"):
            injector.trigger(check[1:])
            for s in seam.states:
                s.trigger(check[1:])
            continue
        try:
            injector.check(check)
            got_injector.append(False)
        except InjectedFault:
            got_injector.append(True)
        fired = [s.check(check) for s in seam.states if s.rule.site == check]  # every rule sees it
        got_seam.append(any(fired))
    assert got_injector == got_seam == [False, False, True, True, False, True, False]


def test_expected_fired_counts() -> None:
    assert COW_ADMISSION_X2.expected_fired == 2
    assert MAP_MID_ALLOCATION.expected_fired == 1
    assert FAULT_PLANS["tiny-budget"].physical_budget and FAULT_PLANS["tiny-budget"].expected_fired == 0


def test_kvcached_reads_our_plan_and_we_read_its_fired_file(tmp_path: Path) -> None:
    """The harness writes plans and reads fired counts; kvcached's injector is the other end."""
    path = write_plan(tmp_path / "plan.json", COW_ADMISSION_X2.rules + MAP_MID_ALLOCATION.rules)
    inj = FaultInjector.from_env(str(path))
    inj.check("cow_admission")  # not armed yet: passes
    inj.trigger("partial_prefix_hit")
    for _ in range(2):
        with pytest.raises(InjectedFault):
            inj.check("cow_admission")
    inj.check("cow_admission")  # plan exhausted
    inj.check("map")  # skip 1
    with pytest.raises(InjectedFault):
        inj.check("map")
    assert read_fired(path) == {"cow_admission": 2, "map": 1}
    assert read_triggers(path) == ["partial_prefix_hit"]
