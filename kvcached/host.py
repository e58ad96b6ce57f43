"""Host memory as a CPU engine's KV cache must respect it, and the budget derived from it.

A CPU page is mapped with ``mmap`` and only takes memory when written, so a map never fails
for lack of memory: without a budget, an engine that outgrows the host is ended by the OOM
killer instead of getting a scheduling miss. kvcached therefore derives a global limit for
the host's record at start-up from the memory available then (`default_host_limit`),
unless the user set one (``KVCACHED_BUDGET_BYTES``) or turned budgets off
(``KVCACHED_BUDGET_PATH=off``). The record's limit counts mapped bytes, written or not, so
it is conservative, and it is shared by every engine on the host.

*Available* is the kernel's ``MemAvailable``, or less where a memory cgroup above this
process (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) leaves less room: in a container
the host's figure would promise memory the container cannot have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcached.errors import ConfigError

#: cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages, about 2**63).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Bytes of memory: ``total`` (``MemTotal``, or the tightest cgroup limit above this
    process) and ``available`` (``MemAvailable``, or the least room some cgroup leaves).
    Invariant: ``0 <= available <= total``."""

    total: int
    available: int


def read_host_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """What this process may use now (the roots are parameters for tests)."""
    info = _meminfo(proc / "meminfo")
    total, available = info["MemTotal"], info["MemAvailable"]
    for limit, usage in _cgroup_limits(proc / "self" / "cgroup", cgroup_root):
        total = min(total, limit)
        available = min(available, max(0, limit - usage))
    return HostMemory(total, min(available, total))


def _meminfo(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            out[name] = int(fields[0]) * 1024
    missing = {"MemTotal", "MemAvailable"} - out.keys()
    if missing:
        raise ConfigError(f"{path} has no {sorted(missing)}: kvcached cannot size a CPU KV budget here; "
                          "set KVCACHED_BUDGET_BYTES")
    return out


def _cgroup_limits(self_cgroup: Path, root: Path) -> list[tuple[int, int]]:
    """(limit, usage) of every memory cgroup from this process's up to the root that has a
    limit: v2 (``0::/path``) and v1 (``N:...memory...:/path``) hierarchies alike."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, int]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found += _walk(root, path, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            found += _walk(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes")
    return found


def _walk(base: Path, path: str, limit_name: str, usage_name: str) -> list[tuple[int, int]]:
    out = []
    folder = base / path.lstrip("/")
    while True:
        limit = _read_int(folder / limit_name)
        usage = _read_int(folder / usage_name)
        if limit is not None and usage is not None and limit < _V1_UNLIMITED:
            out.append((limit, usage))
        if folder == base or base not in folder.parents:
            return out
        folder = folder.parent


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None when absent, unreadable or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def parse_reserve(name: str, raw: str) -> int | str | None:
    """``KVCACHED_HOST_RESERVE``: ``N`` bytes or ``P%`` of the host's total kept free of KV, or
    ``off`` (None: derive no limit)."""
    text = raw.strip().lower()
    if text == "off":
        return None
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = float("nan")
        if not 0.0 <= percent <= 100.0:  # also refuses nan
            raise ConfigError(f"{name}={raw!r}; accepted: off, N bytes >= 0, or P% with 0 <= P <= 100")
        return f"{percent:g}%"
    if not text.isdigit():
        raise ConfigError(f"{name}={raw!r}; accepted: off, N bytes >= 0, or P% with 0 <= P <= 100")
    return int(text)


def default_host_limit(reserve: int | str, memory: HostMemory | None = None) -> int:
    """The host budget: available memory less ``reserve`` (bytes, or ``"P%"`` of ``total``)."""
    memory = memory if memory is not None else read_host_memory()
    keep = int(memory.total * float(reserve[:-1]) / 100.0) if isinstance(reserve, str) else reserve
    return max(0, memory.available - keep)

