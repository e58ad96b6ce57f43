"""The sharing run in parts (``--sides``), without engines: the order its sides run in, the
state saved between them, and the errors that refuse a part before any server starts; and
SIGTERM stopping what a harness program started."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from conformance.serving import exit_on_sigterm
from conformance.serving.retrial import Difference
from conformance.sharing.report import STATE, main
from conformance.sharing.run import (
    SIDES,
    Burst,
    SharingPlan,
    SharingResult,
    SharingRun,
    SharingStateError,
    check_order,
    run,
)


def test_sides_run_in_their_order_each_once() -> None:
    check_order([], SIDES)
    check_order([], ["native"])
    check_order(["native"], ["shared", "retrial"])
    for done, sides in (([], ["shared"]), (["native"], ["native"]), (["native"], ["retrial"]),
                        ([], ["native", "retrial"]), (list(SIDES), ["retrial"]), ([], [])):
        with pytest.raises(SharingStateError, match="cannot run now"):
            check_order(done, sides)


def _state(plan: SharingPlan) -> SharingRun:
    result = SharingResult(plan=asdict(plan), marks=[(1.5, "A burst")])
    result.bursts.append(Burst("A", "A0", 0.1, 2.0, 2, 2, [Difference(1, 1, 3, 7, 8, 0.25, 8, 1)], 4096))
    return SharingRun(result, {"A0": [([5, 6, 7], [1.0, 0.5, 2.0]), ([9], [0.0])]}, ["native", "shared"])


def test_the_state_between_parts_reads_back_whole(tmp_path: Path) -> None:
    plan = SharingPlan.quick()
    state, path = _state(plan), tmp_path / STATE
    state.save(path)
    back = SharingRun.load(path, plan)
    assert back.done == state.done and back.reference == state.reference
    assert back.result.bursts == state.result.bursts and back.result.marks == state.result.marks
    assert back.reference["A0"][0] == ([5, 6, 7], [1.0, 0.5, 2.0])  # a reference is a (tokens, margins) pair
    assert not path.with_name(STATE + ".tmp").exists()
    with pytest.raises(SharingStateError, match="another plan"):
        SharingRun.load(path, replace(plan, cycles=plan.cycles + 1))
    for broken in ("{", '{"result": {}}', "[]"):
        path.write_text(broken)
        with pytest.raises(SharingStateError, match="not a sharing run's saved state"):
            SharingRun.load(path, plan)


def test_a_part_out_of_order_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """`run` checks the order first: with no state, the shared side is refused, and no side ran
    (an engine would take minutes to start; none is importable here)."""
    with pytest.raises(SharingStateError, match="sides done: none"):
        run(SharingPlan.quick(), tmp_path / "work", ["shared"], tmp_path / STATE)
    assert not (tmp_path / STATE).exists()


def test_the_command_line_refuses_bad_sides_and_a_run_cut_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--sides", "native,bogus"])
    assert "unknown ['bogus']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--quick", "--sides", "retrial"])
    assert "sides done: none" in capsys.readouterr().err
    _state(SharingPlan.quick()).save(out / STATE)
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--quick"])  # all sides, native first: the saved run would be lost
    assert "holds a run cut short" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--sides", "retrial"])  # the full plan, not the saved quick one
    assert "another plan" in capsys.readouterr().err
    assert SharingRun.load(out / STATE, SharingPlan.quick()).done == ["native", "shared"]  # untouched


def test_sigterm_runs_the_cleanup_of_a_program_that_started_servers(tmp_path: Path) -> None:
    """`exit_on_sigterm`: a context manager's exit runs (a server's stop), status 143. The
    control: without it, SIGTERM ends the program with its cleanup not run. The handler before
    it is back at its end."""
    before = signal.getsignal(signal.SIGTERM)
    with exit_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    program = textwrap.dedent("""
        import contextlib, pathlib, sys, time
        from conformance.serving import exit_on_sigterm
        with contextlib.ExitStack() as stack:
            if sys.argv[2] == "on":
                stack.enter_context(exit_on_sigterm())
            stack.callback(pathlib.Path(sys.argv[1]).write_text, "stopped")
            print("ready", flush=True)
            time.sleep(60)
    """)
    for mode, code, cleaned in (("on", 143, True), ("off", -15, False)):
        mark = tmp_path / f"stopped-{mode}"
        proc = subprocess.Popen([sys.executable, "-c", program, str(mark), mode], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.terminate()
        assert proc.wait(30) == code
        assert mark.exists() is cleaned, mode
