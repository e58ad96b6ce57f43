"""What both tools show: every budget record found, decoded into plain rows (or, for a record
that cannot be read, why), and what both tools share about their command lines."""

from __future__ import annotations

import argparse
import glob
import math
import os
from dataclasses import asdict, dataclass
from typing import NoReturn

from kvcached.budget import BudgetRecord, Snapshot, default_dir
from kvcached.config import parse_bytes as _parse_bytes
from kvcached.errors import ConfigError

#: Exit codes of both tools: done; nothing to act on, or a record refused or unreadable (a
#: message says which and why); bad usage (any bad argument: one line, nothing changed).
OK, FAILED, USAGE = 0, 1, 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``kvctl: ...``) and exit code `USAGE`."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse_bytes(text: str) -> int:
    """A SIZE argument in bytes (`kvcached.config.parse_bytes`: the rule the variables use)."""
    return _parse_bytes("SIZE", text)


def parse_interval(text: str) -> float:
    """kvtop's ``--interval``: finite seconds in (0, 3600] (``inf`` would never refresh)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 3600.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 3600]")
    return value


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
        data: dict[str, object] = {**asdict(self), "error": None}
        data["engines"] = [{**asdict(e), "over_limit": e.over} for e in self.engines]
        return data


def view(snap: Snapshot) -> DeviceView:
    claimed: set[int] = set()
    engines = []
    for e in snap.engines:
        claimed.update(e.slots)
        engines.append(EngineView(e.name, e.pid, snap.charge_of(e), e.in_use, e.reserved, e.limit, len(e.slots)))
    unclaimed = sum(s.charge for s in snap.slots if s.index not in claimed)
    return DeviceView(snap.path, device_of(snap.path), snap.limit, snap.used, tuple(engines), unclaimed)


@dataclass(frozen=True)
class Unreadable:
    """A record that could not be read (corrupt, foreign, of another version, gone): shown
    as such, so that one bad file hides no other device."""

    path: str
    device: str
    error: str

    def line(self) -> str:
        """One line naming the file and why."""
        why = self.error if self.path in self.error else f"{self.path}: {self.error}"
        return f"{self.device}: unreadable record, not listed: {why}"

    def to_json(self) -> dict[str, object]:
        """A device's keys (nothing known: None, no engines) with the error beside them."""
        return {"path": self.path, "device": self.device, "limit": None, "used": None, "engines": [],
                "unclaimed": None, "error": self.error}


def device_of(path: str) -> str:
    """A record's device, as the tools name it: its file name less ``.budget``."""
    return os.path.basename(path).removesuffix(".budget")


def record_paths(path: str | None, folder: str | None) -> list[str]:
    """``path`` alone, else every ``*.budget`` record in ``folder`` (default: the per-user one)."""
    if path:
        return [path]
    return sorted(glob.glob(os.path.join(folder or default_dir(), "*.budget")))


def select(paths: list[str], device: str | None) -> list[str]:
    """The records ``device`` names (its name, or a prefix of one name only); all without it.
    A selector that names none, or several, is a `ConfigError` listing the choices."""
    if device is None:
        return paths
    exact = [p for p in paths if device_of(p) == device]
    chosen = exact or [p for p in paths if device_of(p).startswith(device)]
    if len(chosen) != 1:
        what = "names no record" if not chosen else "names more than one record"
        raise ConfigError(f"--device {device!r} {what}; records: {', '.join(map(device_of, paths)) or 'none'}")
    return chosen


def read(path: str) -> DeviceView | Unreadable:
    """One record's view, or why it cannot be read (the typed errors of `BudgetRecord`)."""
    try:
        with BudgetRecord(path, create=False) as record:
            return view(record.snapshot())
    except ConfigError as e:  # BudgetRecordError included; the record is gone or refused
        return Unreadable(path, device_of(path), str(e))


def read_all(paths: list[str]) -> list[DeviceView | Unreadable]:
    """Each record's view, in order; an unreadable one is reported in its place."""
    return [read(p) for p in paths]
