"""Where a hung engine was: every process of an engine prints its Python stacks before a timeout kills it.

An engine child runs in its own process group (``runner.run_child``), and vLLM starts its
EngineCore and workers inside that group. Each of those processes that loads the harness
(the child itself, and every vLLM process through the agent's plugin) calls `enable`, which
registers `faulthandler` for `SIGNAL`: on that signal the process writes every thread's stack
to its stderr, the job's log, and carries on. `dump_then_kill` is the runner's timeout: the
signal to each process of the group in turn, a grace period for the dumps, then SIGKILL. A process that never
called `enable` is ended by the signal itself, as the SIGKILL would have ended it.

Why: on the H200 (12-04) four engines started side by side hung after vLLM's sampler set-up and
were killed after 720 s with nothing in their logs to say where they stood.
Standard library only: the parent, which imports no engine code, uses it too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

#: The signal that asks for stacks. vLLM handles SIGTERM and SIGINT; SIGUSR2 is unused by it.
SIGNAL = signal.SIGUSR2
#: Seconds the processes get to write their stacks before SIGKILL.
GRACE_S = 3.0
#: Seconds between two processes' signals, so that their stacks do not interleave in the shared log.
STAGGER_S = 0.3


def enable() -> None:
    """Write all threads' stacks to stderr on `SIGNAL` (this process, and children that fork it)."""
    faulthandler.register(SIGNAL, all_threads=True, chain=False)


def members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` (Linux ``/proc``), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ")".
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            found.append(int(entry.name))
    return sorted(found)


def dump_then_kill(pgid: int, grace_s: float = GRACE_S, stagger_s: float = STAGGER_S) -> None:
    """Ask every process of group ``pgid`` for its stacks, one after another, wait ``grace_s``, then
    SIGKILL the group.

    The processes share one log (vLLM's children inherit the engine child's stderr), and
    `faulthandler` writes in many small pieces: asked together, their stacks interleave line by line.
    A group that has already gone is not an error: there is nothing left to kill.
    """
    for pid in members(pgid):
        try:
            os.kill(pid, SIGNAL)
        except ProcessLookupError:
            continue
        time.sleep(stagger_s)
    time.sleep(grace_s)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
