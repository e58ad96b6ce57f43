"""Configuration: explicit arguments first, environment variables as defaults.

Every value is validated when the config is built; a bad value raises `ConfigError`
naming the environment variable (or argument) and the accepted range. Nothing is read
at import time, so two pools in one process may use different configs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvcached.errors import ConfigError
from kvcached.host import parse_reserve

MiB = 1 << 20

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean switch strictly: 1/0, true/false, yes/no, on/off (any case)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no")


def _parse_int(name: str, raw: str, lo: int, hi: int | None) -> int:
    try:
        value = int(raw.strip(), 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    _check_range(name, value, lo, hi)
    return value


def _parse_float(name: str, raw: str, lo: float, hi: float | None) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    _check_range(name, value, lo, hi)
    return value


def _check_range(name: str, value: float, lo: float, hi: float | None) -> None:
    # Written so that nan fails too (every comparison with nan is false).
    if not (lo <= value and (hi is None or value <= hi)):
        upper = "inf" if hi is None else str(hi)
        raise ConfigError(f"{name}={value} is out of range; accepted range is [{lo}, {upper}]")


def enabled_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether kvcached is switched on: ``KVCACHED_ENABLE`` or upstream's ``ENABLE_KVCACHED``.

    If both are set they must agree; a disagreement is a configuration error rather than
    a silent preference for one of them.
    """
    env = os.environ if env is None else env
    values = {
        name: parse_bool(name, env[name])
        for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")
        if name in env
    }
    if len(set(values.values())) > 1:
        raise ConfigError(f"KVCACHED_ENABLE and ENABLE_KVCACHED disagree: {values}")
    return any(values.values())


# field -> (env var, kind, lower bound, upper bound): the single source of truth for
# parsing and for the variable names that validation errors report.
_ENV: dict[str, tuple[str, str, float, float | None]] = {
    "page_size": ("KVCACHED_PAGE_SIZE", "int", 4096, 1 << 34),
    "min_reserve_pages": ("KVCACHED_MIN_RESERVE_PAGES", "int", 0, 1 << 20),
    "max_reserve_pages": ("KVCACHED_MAX_RESERVE_PAGES", "int", 0, 1 << 20),
    "capacity_ttl_s": ("KVCACHED_CAPACITY_TTL_MS", "ms", 0.0, 60_000.0),
    "map_retries": ("KVCACHED_MAP_RETRIES", "int", 0, 100),
    "retry_backoff_s": ("KVCACHED_RETRY_BACKOFF_MS", "ms", 0.0, 10_000.0),
    "budget_bytes": ("KVCACHED_BUDGET_BYTES", "int", 0, None),
    "budget_path": ("KVCACHED_BUDGET_PATH", "str", 0, None),
    "max_cached_blocks": ("KVCACHED_MAX_CACHED_BLOCKS", "cap", -1, None),
    "fault_plan": ("KVCACHED_FAULT_PLAN", "str", 0, None),
    "background_refill": ("KVCACHED_BACKGROUND_REFILL", "str", 0, None),
    "host_reserve": ("KVCACHED_HOST_RESERVE", "reserve", 0, None),
}

#: ``auto``: refills sent ahead run on a background thread only where the worker runs in
#: the scheduler's process *and* a map is a costly driver call (CUDA: ~45 µs per 2 MiB page
#: and backing); on CPU an mmap costs less than handing work to a thread under the GIL.
BACKGROUND_REFILL = ("auto", "on", "off")

#: Default cap on free blocks that keep their prefix-cache contents (and so their pages
#: mapped): a tenth of the pool. Idle, an engine then pins at most that share of its KV
#: range for prefix hits and gives the rest back; busy, blocks freed above the cap are
#: evicted at once instead of when the pool runs full, so some prefix hits are lost
#: (`benchmarks/bench_elasticity.py` measures both). ``-1`` keeps vLLM's own caching.
DEFAULT_MAX_CACHED = "10%"

#: Host memory a CPU engine without an explicit budget keeps free of KV (`kvcached.host`):
#: the OS, the engines' own growth and other processes need room too.
DEFAULT_HOST_RESERVE = "10%"


def _parse_cap(name: str, raw: str | int) -> int | str:
    """``-1`` (no cap), ``N`` blocks (``N >= 0``) or ``P%`` of the pool (``0 <= P <= 100``)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < -1:
            raise ConfigError(f"{name}={raw}; accepted: -1 (unlimited), N >= 0 blocks, or P% of the pool")
        return raw
    text = str(raw).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a percentage") from None
        if not 0.0 <= percent <= 100.0:  # also refuses nan
            raise ConfigError(f"{name}={raw!r}; a percentage must be within [0, 100]")
        return f"{percent:g}%"
    try:
        value = int(text, 0)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r}; accepted: -1 (unlimited), N >= 0 blocks, or P% of the pool"
        ) from None
    return _parse_cap(name, value)


@dataclass(frozen=True, slots=True)
class KvcachedConfig:
    """Validated knobs of one elastic pool.

    Invariants: ``page_size`` is a positive multiple of 4 KiB; ``0 <= min_reserve_pages <=
    max_reserve_pages``; ``budget_bytes`` is None (join the device's record with its
    limit) or the global limit >= 0 to ask that record for (`kvcached.budget`);
    ``budget_path`` is None (the per-user default record of the device), a record's path,
    or ``"off"`` (no record: nothing shared, nothing limited); ``max_cached_blocks`` is -1 (unlimited), a block count >= 0 or ``"P%"`` of the pool
    (`cached_cap` turns it into blocks). ``host_reserve`` is what a CPU engine without a
    ``budget_bytes`` keeps free of KV when it derives the host record's limit
    (`kvcached.host`): bytes, ``"P%"`` of the host's memory, or None (``off``: no limit derived).
    """

    page_size: int = 2 * MiB
    min_reserve_pages: int = 1
    max_reserve_pages: int = 4
    capacity_ttl_s: float = 0.1
    map_retries: int = 3
    retry_backoff_s: float = 0.04
    budget_bytes: int | None = None
    budget_path: str | None = None
    max_cached_blocks: int | str = DEFAULT_MAX_CACHED
    fault_plan: str | None = None
    background_refill: str = "auto"
    host_reserve: int | str | None = DEFAULT_HOST_RESERVE

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> KvcachedConfig:
        """Build a config: ``explicit`` arguments win, then ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        unknown = set(explicit) - known
        if unknown:
            raise ConfigError(f"unknown kvcached option(s): {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, (var, kind, lo, hi) in _ENV.items():
            if name in explicit:
                values[name] = explicit[name]
                continue
            if var not in env:
                continue
            raw = env[var]
            if kind == "int":
                values[name] = _parse_int(var, raw, int(lo), None if hi is None else int(hi))
            elif kind == "ms":
                values[name] = _parse_float(var, raw, float(lo), hi) / 1000.0
            elif kind == "cap":
                values[name] = _parse_cap(var, raw)
            elif kind == "reserve":
                values[name] = parse_reserve(var, raw)
            elif name == "background_refill":
                values[name] = raw.strip().lower()
            else:
                values[name] = raw or None
        if "KVCACHED_PAGE_SIZE_MB" in env and "page_size" not in explicit:
            mib = _parse_int("KVCACHED_PAGE_SIZE_MB", env["KVCACHED_PAGE_SIZE_MB"], 1, 1 << 14)
            if "page_size" in values and values["page_size"] != mib * MiB:
                raise ConfigError(f"KVCACHED_PAGE_SIZE_MB={mib} disagrees with KVCACHED_PAGE_SIZE="
                                  f"{values['page_size']}; set one of them")
            values["page_size"] = mib * MiB
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Check cross-field invariants (also run for explicit arguments)."""
        if not isinstance(self.page_size, int) or self.page_size <= 0 or self.page_size % 4096:
            raise ConfigError(
                f"KVCACHED_PAGE_SIZE={self.page_size} must be a positive multiple of 4096 bytes"
            )
        for name in ("min_reserve_pages", "max_reserve_pages", "map_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{_ENV[name][0]}={value} must be an integer >= 0")
        if self.min_reserve_pages > self.max_reserve_pages:
            raise ConfigError(
                f"KVCACHED_MIN_RESERVE_PAGES={self.min_reserve_pages} exceeds "
                f"KVCACHED_MAX_RESERVE_PAGES={self.max_reserve_pages}"
            )
        for name in ("capacity_ttl_s", "retry_backoff_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{_ENV[name][0]}: {value!r} seconds must be a finite number >= 0")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ConfigError(f"KVCACHED_BUDGET_BYTES={self.budget_bytes} must be >= 0")
        if self.background_refill not in BACKGROUND_REFILL:
            raise ConfigError(f"KVCACHED_BACKGROUND_REFILL={self.background_refill!r}; accepted: "
                              f"{', '.join(BACKGROUND_REFILL)}")
        if self.host_reserve is not None and parse_reserve(
                "KVCACHED_HOST_RESERVE", str(self.host_reserve)) != self.host_reserve:
            raise ConfigError(f"KVCACHED_HOST_RESERVE={self.host_reserve!r} is not in canonical form")
        if _parse_cap("KVCACHED_MAX_CACHED_BLOCKS", self.max_cached_blocks) != self.max_cached_blocks:
            raise ConfigError(f"KVCACHED_MAX_CACHED_BLOCKS={self.max_cached_blocks!r} is not in canonical form")

    def cached_cap(self, num_blocks: int) -> int:
        """The cap on free cached blocks of a pool of ``num_blocks`` blocks; -1: none."""
        cap = self.max_cached_blocks
        if isinstance(cap, str):
            return int(num_blocks * float(cap[:-1]) / 100.0)
        return cap
