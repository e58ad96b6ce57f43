"""What both tools show: every budget record found, decoded into plain rows."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import asdict, dataclass

from kvcached.budget import BudgetRecord, Snapshot, default_dir
from kvcached.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``1048576``, ``512MiB``, ``2G`` (binary), ``2GB`` (decimal) -> bytes; ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a byte size (examples: 1048576, 512MiB, 2G)")
    return int(float(match.group(1)) * _UNITS[unit])


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class EngineView:
    """One engine on one device: what its ranks have mapped (the record's charges), what it
    last published as reserved (idle) and in use, and its limit."""

    name: str
    pid: int
    mapped: int
    in_use: int
    reserved: int
    limit: int | None
    ranks: int

    @property
    def over(self) -> bool:
        return self.limit is not None and self.mapped > self.limit


@dataclass(frozen=True)
class DeviceView:
    """One record: the device's global limit and usage, its engines, and charges no live
    engine claims (ranks starting, or a probe without an engine)."""

    path: str
    device: str
    limit: int | None
    used: int
    engines: tuple[EngineView, ...]
    unclaimed: int

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["engines"] = [{**asdict(e), "over_limit": e.over} for e in self.engines]
        return data


def view(snap: Snapshot) -> DeviceView:
    claimed: set[int] = set()
    engines = []
    for e in snap.engines:
        claimed.update(e.slots)
        engines.append(EngineView(e.name, e.pid, snap.charge_of(e), e.in_use, e.reserved, e.limit, len(e.slots)))
    unclaimed = sum(s.charge for s in snap.slots if s.index not in claimed)
    device = os.path.basename(snap.path).removesuffix(".budget")
    return DeviceView(snap.path, device, snap.limit, snap.used, tuple(engines), unclaimed)


def record_paths(path: str | None, folder: str | None) -> list[str]:
    """``path`` alone, else every ``*.budget`` record in ``folder`` (default: the per-user one)."""
    if path:
        return [path]
    return sorted(glob.glob(os.path.join(folder or default_dir(), "*.budget")))


def read_all(paths: list[str]) -> list[DeviceView]:
    """Each record's view (BudgetRecordError or ConfigError if one cannot be read)."""
    views = []
    for p in paths:
        with BudgetRecord(p, create=False) as record:
            views.append(view(record.snapshot()))
    return views
