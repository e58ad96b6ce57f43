"""A timed-out engine's processes say where they hung (`conformance.stacks`), with real process groups."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conformance import stacks
from conformance.orchestrate.runner import _relay

# A parent and its child, both in the group the parent leads, both parked in `hang_here`.
_FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    from conformance import stacks
    ENABLE = sys.argv[1] == "1"
    if ENABLE:
        stacks.enable()
    def hang_here():
        while True:
            time.sleep(0.05)
    if len(sys.argv) < 3:
        child = subprocess.Popen([sys.executable, "-c", CODE, sys.argv[1], "child"])
    print("READY", flush=True)
    hang_here()
""")


def _start(tmp_path: Path, enable: bool) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "family.log"
    code = f"CODE = {_FAMILY!r}\n" + _FAMILY
    # bufsize=0: `_relay` reads the pipe as the runner does, unbuffered.
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, "1" if enable else "0"], stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True, bufsize=0)
    assert proc.stdout is not None and proc.stdout.readline() == b"READY\n"
    deadline = time.monotonic() + 30
    while len(stacks.members(proc.pid)) < 2:  # the child too is up (it prints READY into the same pipe)
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    time.sleep(0.3)  # and parked in hang_here
    return proc, log


def test_every_process_of_the_group_prints_its_stack_then_the_group_is_killed(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, enable=True)
    stacks.dump_then_kill(proc.pid, grace_s=1.0)
    assert proc.wait(timeout=10) == -signal.SIGKILL  # the handler kept it alive until the SIGKILL
    text = log.read_text()
    assert text.count("most recent call first") == 2, text
    # one after another: each stack is whole, its lines in order, not interleaved with the other's
    assert text.count("in hang_here\n") == 2 and text.count("in <module>\n") == 2, text


def test_a_process_without_the_handler_prints_nothing_and_ends(tmp_path: Path) -> None:
    """Negative control: the stacks come from `stacks.enable`, not from the signal itself."""
    proc, log = _start(tmp_path, enable=False)
    stacks.dump_then_kill(proc.pid, grace_s=0.5)
    assert proc.wait(timeout=10) == -stacks.SIGNAL
    assert "hang_here" not in log.read_text()


def test_a_group_that_is_gone_is_not_an_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    stacks.dump_then_kill(proc.pid, grace_s=0.0)


def test_the_runner_deadline_asks_for_stacks(tmp_path: Path) -> None:
    """`_relay`, the runner's timeout, goes through `dump_then_kill`: the log names where the child hung."""
    proc, log = _start(tmp_path, enable=True)
    assert proc.stdout is not None
    assert _relay(proc.stdout, proc, time.monotonic() + 0.5, lambda _line: None) is True
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert "in hang_here" in log.read_text()
