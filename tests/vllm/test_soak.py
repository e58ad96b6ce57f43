"""The churn soak's CI variant: two minutes of random traffic through `vllm serve` with
kvcached (`conformance.orchestrate.soak`; `nox -s soak` runs ten). Every check must hold; the
negative controls show each comparison can fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.orchestrate.soak import Sample, SoakPlan, SoakResult, run


@pytest.mark.multiprocess  # two real servers, one after the other; every wait is bounded
def test_two_minutes_of_churn_leave_nothing_behind(tmp_path: Path) -> None:
    result = run(SoakPlan(duration_s=120.0), tmp_path)
    checks = result.checks()
    assert all(checks.values()), (checks, result.baseline, result.end, result.unexplained)
    assert len(result.completed) > 100 and result.samples


def test_the_checks_see_a_leak_and_a_mismatch() -> None:
    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=2, mapped=10 << 16)
    result = SoakResult(SoakPlan(), baseline=base, end=base, aborted=1, preemptions=1)
    assert all(result.checks().values())
    for changed, check in (({"rss": 1060 << 20}, "rss"), ({"mapped": 11 << 16}, "mapped"),
                           ({"fds": 101}, "descriptors"), ({"memfds": 3}, "memfds")):
        result.end = dataclasses.replace(base, **changed)
        assert [name for name, ok in result.checks().items() if not ok] == [
            next(n for n in result.checks() if n.startswith(check))]
    result.end = base
    result.mismatches, result.mismatch_margins = [0, 1], [1e-5, 0.5]  # one near-tie, one real
    assert result.unexplained == [1] and not result.checks()["no token difference beyond a native near-tie"]


def test_the_native_control_has_only_the_checks_that_can_fail_on_native(tmp_path: Path) -> None:
    from conformance.orchestrate.soak_report import render

    with pytest.raises(ValueError, match="candidate='kvached'"):
        SoakPlan(candidate="kvached")
    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=0, mapped=0)
    result = SoakResult(SoakPlan(candidate="native"), baseline=base, end=base, aborted=1, preemptions=1)
    assert all(result.checks().values())
    assert not any("mapped" in name or "memfds" in name for name in result.checks())
    result.end = dataclasses.replace(base, fds=101)
    assert [name for name, ok in result.checks().items() if not ok] == ["descriptors back to the baseline"]
    # The control's report sets its rate beside the kvcached soak's result.
    kvcached = tmp_path / "result.json"
    kvcached.write_text('{"completed": 100, "mismatches": [3], "unexplained": [], '
                        '"plan": {"duration_s": 600, "clients": 8, "seed": 0}}')
    result.completed = [(None, [1])] * 50  # type: ignore[list-item]
    result.mismatches, result.mismatch_margins = [7, 9], [1e-4, 2e-4]
    text = render(result, "cmd", kvcached)
    assert "| kvcached (" in text and "1 of 100 (1.000%)" in text and "2 of 50 (4.000%)" in text
    assert "native control: FAIL" in text and "kvcached mapped" not in text


@pytest.mark.parametrize("candidate", ["kvcached", "native"])
def test_a_saved_soak_is_redrawn(tmp_path: Path, candidate: str) -> None:
    import json

    from conformance.orchestrate.soak import to_json
    from conformance.orchestrate.soak_report import load_for_plot, plot

    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=2, mapped=10 << 16)
    result = SoakResult(SoakPlan(candidate=candidate), samples=[base, dataclasses.replace(base, t=2.0)],
                        baseline=base, end=base, warmup_end_s=1.0, traffic_end_s=2.0, sent=3, aborted=1,
                        preemptions=1)
    (tmp_path / "result.json").write_text(json.dumps(to_json(result)))
    loaded = load_for_plot(tmp_path / "result.json")
    assert (loaded.plan, loaded.samples, loaded.sent) == (result.plan, result.samples, 3)
    plot(loaded, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
