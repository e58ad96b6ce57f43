"""Progress of a long run: cases done and left, and the elapsed time.

On a terminal it is a live `rich` progress bar with log lines printed above it; anywhere
else (CI logs, a pipe) it prints plain lines, one per finished case, so logs stay greppable
and free of escape codes. Benchmarks and the compat session use the same class.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class RunProgress:
    """``with RunProgress(total, "conformance") as p: p.log(...); p.advance("case-id")``."""

    def __init__(self, total: int, title: str, file: IO[str] | None = None, force_terminal: bool | None = None) -> None:
        self.total, self.title, self.done = total, title, 0
        self.console = Console(file=file or sys.stdout, force_terminal=force_terminal, highlight=False)
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    @property
    def live(self) -> bool:
        """Whether a live bar is drawn (only on a terminal)."""
        return self.console.is_terminal

    def __enter__(self) -> RunProgress:  # noqa: PYI034 - py3.10 has no typing.Self
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("cases, {task.fields[left]} left"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[last]}"),
                console=self.console,
                transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, left=self.total, last="")
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(et, e, tb)
            self._bar = None

    def log(self, message: str) -> None:
        """A line of output (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.console.file, flush=True)

    def advance(self, label: str, ok: bool = True, seconds: float | None = None) -> None:
        """One case finished (from any thread: groups of engines may run side by side)."""
        with self._lock:
            self.done += 1
            done = self.done
        left = max(0, self.total - done)
        took = f" ({seconds:.1f} s)" if seconds is not None else ""
        status = "ok" if ok else "error"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, left=left, last=f"{status} {label}{took}")
        else:
            elapsed = time.monotonic() - self._t0
            self.log(f"      [{done}/{self.total}, {left} left, {elapsed:.0f} s] {status:<5} {label}{took}")
