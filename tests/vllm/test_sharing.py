"""Several engines, one budget, as users run it: two `vllm serve` engines (tiny llama and tiny
qwen3, each a multiprocess engine) share one budget record over HTTP, against two native
servers splitting the same memory. The scenario is `conformance.orchestrate.sharing`
(quick plan: 3 burst/idle cycles); every check of its report must hold.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from conformance.orchestrate.sharing import TIE, MiB, SharingPlan, SharingResult, run
from conformance.orchestrate.sharing_report import checks

pytestmark = [pytest.mark.multiprocess]  # every wait in the scenario is bounded (starts, requests, idles)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> SharingResult:
    return run(SharingPlan.quick(), tmp_path_factory.mktemp("sharing"))


def test_every_check_holds(shared: SharingResult) -> None:
    failed = [f"{c.name}: {c.detail}" for c in checks(shared) if not c.ok]
    assert not failed, failed


def test_the_scenario_ran_whole(shared: SharingResult) -> None:
    labels = [b.label for b in shared.bursts]
    assert labels[:3] == ["A0", "B0", "B1"] and labels[-2:] == ["A (killed)", "B5"]
    assert len(shared.fds["A"]) == len(shared.fds["B"]) == SharingPlan.quick().cycles
    assert [m for _, m in shared.marks if m.startswith(("kvctl", "SIGKILL"))] == [
        "kvctl limit B", "kvctl clear B", "SIGKILL A"]
    assert shared.exits["B"] == 0 and len(shared.native_bursts) == 4


def test_each_check_sees_a_real_failure(shared: SharingResult) -> None:
    """Negative controls: the same result, doctored one way at a time, fails that check."""
    budget = int(shared.plan["budget_bytes"])  # type: ignore[call-overload]

    def failing(change) -> set[str]:
        doctored = copy.deepcopy(shared)
        change(doctored)
        return {c.name for c in checks(doctored) if not c.ok}

    assert failing(lambda r: r.samples.append([1e9, 0, 0, budget + MiB, budget])) == {"budget never exceeded"}
    assert failing(lambda r: setattr(r, "b_max_once_under_bytes", r.limit_b_bytes + 1)) == {
        "B's lowered limit holds while its burst runs"}
    assert failing(lambda r: r.fds["A"][-1].__setitem__(1, r.fds["A"][0][1] + 1)) == {
        "file descriptors and memfds do not grow"}
    assert failing(lambda r: r.idle_bytes["B"].append(r.watermark_bytes["B"] + 1)) == {
        "every idle point at the watermark"}
    tokens = f"tokens exact but at near-ties (reference margin < {TIE:g})"
    assert failing(lambda r: r.bursts[0].margins.append(0.5)) == {tokens}  # a flip at an ordinary margin
    assert failing(lambda r: r.bursts[0].margins.append(-1.0)) == {tokens}  # a failed or cut request
    assert failing(lambda r: r.bursts[0].margins.append(TIE / 10)) == set()  # a near-tie is explained
    assert failing(lambda r: setattr(r, "b_after_kill_peak_bytes", 0)) == {"B took the memory of A after SIGKILL"}


def test_reports_are_written(shared: SharingResult, tmp_path: Path) -> None:
    from conformance.orchestrate.sharing_report import markdown, plot

    plot(shared, tmp_path / "timeline.png")
    text = markdown(shared, checks(shared), "pytest")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert "| budget never exceeded | yes |" in text and "![timeline](timeline.png)" in text
