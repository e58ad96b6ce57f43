"""The revision a benchmark measured, for its report's header.

``git describe --always``, with ``-dirty`` only when a tracked file that can change what is
measured differs from it: reports, the README and ``docs/`` do not count, so a benchmark
that runs after another has rewritten that one's report still names the committed code.
Benchmarks read it when they start, when their code is loaded.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def revision() -> str:
    """``<rev>`` or ``<rev>-dirty``; ``unknown`` outside a git checkout."""
    try:
        rev = _git("describe", "--always")
        changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)reports",
                       ":(exclude)docs", ":(exclude)README.md")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if changed else rev


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
