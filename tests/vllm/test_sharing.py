"""Several engines, one budget, as users run it: two `vllm serve` engines (tiny llama and tiny
qwen3, each a multiprocess engine) share one budget record over HTTP, against two native
servers splitting the same memory. The scenario is `conformance.sharing.run`
(quick plan: 3 burst/idle cycles); every check of its report must hold, the planted token
difference included (retried on the real native servers, never given by native).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from conformance.serving.retrial import PLANTED_MARGIN, Difference
from conformance.sharing.report import MIN_SAMPLES_UNDER, checks
from conformance.sharing.run import SIDES, MiB, SharingPlan, SharingResult, run

pytestmark = [pytest.mark.multiprocess]  # every wait in the scenario is bounded (starts, requests, idles)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> SharingResult:
    """The scenario in three parts, a side each, the state saved and read back between them:
    how a lent GPU runs it (`--sides`), and the whole of what one call runs."""
    plan, work = SharingPlan.quick(), tmp_path_factory.mktemp("sharing")
    state = work / "run-state.json"
    for side in SIDES:
        done = run(plan, work / side, [side], state)
    assert done.done == list(SIDES)
    return done.result


def test_every_check_holds(shared: SharingResult) -> None:
    failed = [f"{c.name}: {c.detail}" for c in checks(shared) if not c.ok]
    assert not failed, failed
    # The planted difference was retried on the real native servers, and native never chose it.
    assert shared.planted is not None and (shared.planted.retrials, shared.planted.reproduced) == (8, 0)
    assert shared.planted.margin >= PLANTED_MARGIN


def test_the_scenario_ran_whole(shared: SharingResult) -> None:
    labels = [b.label for b in shared.bursts]
    # B1 and the requests sent once its limit was lowered (B6) end in either order
    assert labels[:2] == ["A0", "B0"] and set(labels[2:4]) == {"B1", "B6"} and labels[-2:] == ["A (killed)", "B5"]
    assert len(shared.fds["A"]) == len(shared.fds["B"]) == SharingPlan.quick().cycles
    assert [m for _, m in shared.marks if m.startswith(("kvctl", "SIGKILL"))] == [
        "kvctl limit B", "kvctl clear B", "SIGKILL A"]
    assert shared.exits["B"] == 0 and len(shared.native_bursts) == 6
    # Step 4b, before the kill: A's burst, then B's the moment A's responses were in, on both sides.
    assert labels[-4:-2] == ["A handover", "B handover"]
    assert [b.label for b in shared.native_bursts[-2:]] == ["A handover", "B handover"]
    handover = shared.handover
    assert handover is not None and handover.wait_s is not None and handover.b_peak_bytes > handover.above_bytes
    assert shared.b0_over_s is not None  # B0's ramp, the handover's baseline
    # The CPU plan does not stream (`SharingPlan.stream`): no time to first token is kept.
    assert not shared.plan["stream"] and all(not b.ttft_s for b in [*shared.bursts, *shared.native_bursts])


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
    assert failing(lambda r: setattr(r, "b_samples_once_under", MIN_SAMPLES_UNDER - 1)) == {
        "B's lowered limit holds while its burst runs"}  # too few reads to show it
    assert failing(lambda r: r.fds["A"][-1].__setitem__(1, r.fds["A"][0][1] + 1)) == {
        "file descriptors and memfds do not grow"}
    assert failing(lambda r: r.idle_bytes["B"].append(r.watermark_bytes["B"] + 1)) == {
        "every idle point at the watermark"}
    tokens, planted = "every token difference is one native also gives", "the planted difference is caught"
    unexplained = Difference(3, 3, 5, 10, 11, 1e-7, retrials=8, reproduced=0)  # even at a near-tie

    def quiet_native(r: SharingResult) -> None:  # native's concurrent bursts gave no difference
        for b in r.native_bursts:
            b.differences.clear()

    assert failing(lambda r: (quiet_native(r), r.bursts[0].differences.append(unexplained))) == {tokens}
    # Within native's own noise: native's concurrent bursts differed at a larger margin.
    noisy = dataclasses.replace(unexplained, margin=1e-6)
    assert failing(lambda r: (r.native_bursts[0].differences.append(noisy),
                              r.bursts[0].differences.append(unexplained))) == set()
    assert failing(lambda r: r.bursts[0].differences.append(Difference(3, 3, -1, -1, -1, -1.0))) == {tokens}  # cut
    explained = dataclasses.replace(unexplained, margin=0.5, reproduced=1)  # native gave it in one batch mix
    assert failing(lambda r: r.bursts[0].differences.append(explained)) == set()
    assert failing(lambda r: setattr(r, "planted", dataclasses.replace(r.planted, reproduced=1))) == {planted}
    assert failing(lambda r: setattr(r, "planted", None)) == {planted}
    assert failing(lambda r: setattr(r, "b_after_kill_peak_bytes", 0)) == {"B took the memory of A after SIGKILL"}
    assert failing(lambda r: setattr(r, "handover", dataclasses.replace(r.handover, wait_s=None))) == {
        "B's burst sent as A's ended got A's memory"}


def test_reports_are_written(shared: SharingResult, tmp_path: Path) -> None:
    from conformance.reporting import write_report
    from conformance.sharing.report import build, plot

    plot(shared, tmp_path / "timeline.png")
    text = write_report(build(shared, checks(shared)), tmp_path).read_text()
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert "| budget never exceeded " in text and "](timeline.png)" in text
    assert "| planted in A0 (control) " in text and "| 0 of 8 " in text
    shared.save(tmp_path / "result.json")  # what `--render` reads back (JSON: tuples come back as lists)
    loaded = SharingResult.load(tmp_path / "result.json")
    assert (loaded.bursts, loaded.native_bursts, loaded.planted, loaded.handover) == (
        shared.bursts, shared.native_bursts, shared.planted, shared.handover)
    assert checks(loaded) == checks(shared)

