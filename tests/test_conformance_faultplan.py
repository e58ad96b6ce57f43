"""The fault-plan file: round trip, fired-file reading, and compatibility with kvcached's reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.cases import COW_ADMISSION_X2, FAULT_PLANS, MAP_MID_ALLOCATION
from conformance.faultplan import (
    FaultRule,
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
    ],
)
def test_rule_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        FaultRule(**kwargs)


def test_expected_fired_counts() -> None:
    assert COW_ADMISSION_X2.expected_fired == 2
    assert MAP_MID_ALLOCATION.expected_fired == 1
    assert FAULT_PLANS["tiny-budget"].physical_budget and FAULT_PLANS["tiny-budget"].expected_fired == 0


def test_kvcached_reads_our_plan_and_we_read_its_fired_file(tmp_path: Path) -> None:
    """The harness writes plans and reads fired counts; kvcached's injector is the other end."""
    faults = pytest.importorskip("kvcached.faults")
    from kvcached.errors import InjectedFault

    path = write_plan(tmp_path / "plan.json", COW_ADMISSION_X2.rules + MAP_MID_ALLOCATION.rules)
    inj = faults.FaultInjector.from_env(str(path))
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
