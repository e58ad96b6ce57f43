"""Configuration: explicit arguments first, environment variables as defaults.

Every value is validated when a config is built, by `resolve` or by the constructor
alike: each field has one rule (`_Knob.check`), which the constructor applies to every
value, read from the environment or passed in code. A bad value raises `ConfigError`
naming the environment variable (and field) and the accepted range. Nothing is read at
import time, so two pools in one process may use different configs.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any

from kvcached.budget import MAX_BYTES, NAME_BYTES
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


# ---- byte sizes --------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(name: str, text: str) -> int:
    """A byte size: ``1048576``, ``512MiB``, ``1.5G`` (binary), ``2GB`` (decimal).

    The result is a whole number of bytes within [0, `MAX_BYTES`], computed exactly (no
    float rounding); anything else is a `ConfigError` naming ``name``: ``0.5`` is refused,
    not rounded to a 0-byte limit, and a size beyond what a budget record holds is refused
    rather than wrapped or confused with "no limit".
    """
    return check_bytes(name, _size_text(name, text))


def _size_text(name: str, text: str) -> int:
    """The whole number of bytes ``text`` says (any size: `check_bytes` bounds it)."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{name}={text!r} is not a byte size (examples: 1048576, 512MiB, 2G)")
    try:
        size = Fraction(match.group(1)) * _UNITS[unit]
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{name}={text[:40]!r}... has too many digits for a byte size") from None
    if size.denominator != 1:
        raise ConfigError(f"{name}={text!r} is not a whole number of bytes ({float(size):g})")
    return int(size)


def check_bytes(name: str, value: Any) -> int:
    """``value`` if it is an integer byte count a budget record can hold, else `ConfigError`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a whole number of bytes")
    if not 0 <= value <= MAX_BYTES:
        raise ConfigError(f"{name}={value} bytes is out of range; accepted: 0 to {MAX_BYTES} bytes")
    return value


# ---- the default engine name -------------------------------------------------------------
#: The initial PID namespace's inode (Linux's ``PROC_PID_INIT_INO``, fixed since 3.8).
INIT_PID_NS = 0xEFFFFFFC


def process_tag(pid: int | None = None) -> str:
    """What tells this process from every other live one on the host, as short as that allows.

    In the host's own PID namespace the PID alone (``4121``). In another one (a container)
    the PID plus that namespace's inode (``1@pidns4026532281``; ``readlink /proc/PID/ns/pid``
    shows the same number), since every container's first process is PID 1 and namespace
    inodes are unique among live namespaces. Without ``/proc`` the namespace is unknown, so
    a random token stands in for it.
    """
    pid = os.getpid() if pid is None else pid
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{pid}@{secrets.token_hex(4)}"
    return str(pid) if namespace == INIT_PID_NS else f"{pid}@pidns{namespace}"


def engine_name(served: str, env: Mapping[str, str] | None = None) -> str:
    """An engine's name in its budget records (``kvctl``): ``KVCACHED_ENGINE_NAME``, else the
    served model's last path part and `process_tag` (unique among live engines on the host,
    containers included), cut to fit a record's name field."""
    env = os.environ if env is None else env
    explicit = env.get("KVCACHED_ENGINE_NAME", "").strip()
    if explicit:
        return explicit
    suffix = f"-{process_tag()}"
    base = os.path.basename(served.rstrip("/")) or "engine"
    return base.encode()[: NAME_BYTES - len(suffix)].decode(errors="ignore") + suffix


# ---- one rule per field ------------------------------------------------------------------
def _int_text(name: str, raw: str) -> int:
    try:
        return int(raw.strip(), 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _ms_text(name: str, raw: str) -> float:
    """Milliseconds (the variables' unit) -> seconds (the fields')."""
    try:
        return float(raw.strip()) / 1000.0
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _count(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} is not an integer")
        if not lo <= value <= hi:
            raise ConfigError(f"{name}={value} is out of range; accepted range is [{lo}, {hi}]")
        return value
    return check


def _page_size(name: str, value: Any) -> int:
    value = _count(4096, 1 << 34)(name, value)
    if value % 4096:
        raise ConfigError(f"{name}={value} must be a positive multiple of 4096 bytes")
    return value


def _seconds(hi: float) -> Callable[[str, Any], float]:
    def check(name: str, value: Any) -> float:
        # Written so that nan fails too (every comparison with nan is false).
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (math.isfinite(value) and 0.0 <= value <= hi):
            raise ConfigError(f"{name}: {value!r} seconds; accepted: a finite number of seconds "
                              f"within [0, {hi:g}] (0 to {hi * 1000:g} ms)")
        return float(value)
    return check


def _optional_bytes(name: str, value: Any) -> int | None:
    return None if value is None else check_bytes(name, value)


def _bytes_text(name: str, raw: str) -> int | None:
    return None if not raw.strip() else _size_text(name, raw)


#: The value of ``budget_path`` that means no record at all (any case, in the variable too).
BUDGET_OFF = "off"


def _budget_path(name: str, value: Any) -> str | None:
    """None (the default record), ``"off"`` (``OFF``, `` Off `` too: never a file of that
    name), or the record's path."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} is not a path")
    if not value.strip():
        return None
    return BUDGET_OFF if value.strip().lower() == BUDGET_OFF else value


def _optional_text(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} is not a string")
    return value or None


#: ``auto``: refills sent ahead run on a background thread only where the worker runs in
#: the scheduler's process *and* a map is a costly driver call (CUDA: ~45 µs per 2 MiB page
#: and backing); on CPU an mmap costs less than handing work to a thread under the GIL.
BACKGROUND_REFILL = ("auto", "on", "off")


def _refill(name: str, value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in BACKGROUND_REFILL:
        raise ConfigError(f"{name}={value!r}; accepted: {', '.join(BACKGROUND_REFILL)}")
    return str(text)


def _parse_cap(name: str, raw: Any) -> int | str:
    """``-1`` (no cap), ``N`` blocks (``N >= 0``) or ``P%`` of the pool (``0 <= P <= 100``)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < -1:
            raise ConfigError(f"{name}={raw}; accepted: -1 (unlimited), N >= 0 blocks, or P% of the pool")
        return raw
    if not isinstance(raw, str):
        raise ConfigError(f"{name}={raw!r}; accepted: -1 (unlimited), N >= 0 blocks, or P% of the pool")
    text = raw.strip()
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


def _reserve(name: str, value: Any) -> int | str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r}; accepted: off, N bytes >= 0, or P% with 0 <= P <= 100")
    return parse_reserve(name, str(value))


def _text(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True, slots=True)
class _Knob:
    """One field's setting: its variable, how the variable's text is read (``parse``: text
    to a value of the field's type, no range checks), and the field's one rule (``check``:
    any value, in code or parsed, to its canonical form, or `ConfigError`)."""

    var: str
    parse: Callable[[str, str], Any]
    check: Callable[[str, Any], Any]


#: field -> its knob: the single source of truth for parsing, checking, and the variable
#: names that validation errors report.
_KNOBS: dict[str, _Knob] = {
    "page_size": _Knob("KVCACHED_PAGE_SIZE", _int_text, _page_size),
    "min_reserve_pages": _Knob("KVCACHED_MIN_RESERVE_PAGES", _int_text, _count(0, 1 << 20)),
    "max_reserve_pages": _Knob("KVCACHED_MAX_RESERVE_PAGES", _int_text, _count(0, 1 << 20)),
    "hold_steps": _Knob("KVCACHED_HOLD_STEPS", _int_text, _count(0, 1 << 20)),
    "capacity_ttl_s": _Knob("KVCACHED_CAPACITY_TTL_MS", _ms_text, _seconds(60.0)),
    "map_retries": _Knob("KVCACHED_MAP_RETRIES", _int_text, _count(0, 100)),
    "retry_backoff_s": _Knob("KVCACHED_RETRY_BACKOFF_MS", _ms_text, _seconds(10.0)),
    "budget_bytes": _Knob("KVCACHED_BUDGET_BYTES", _bytes_text, _optional_bytes),
    "budget_path": _Knob("KVCACHED_BUDGET_PATH", _text, _budget_path),
    "max_cached_blocks": _Knob("KVCACHED_MAX_CACHED_BLOCKS", _parse_cap, _parse_cap),
    "idle_grace_s": _Knob("KVCACHED_IDLE_GRACE_MS", _ms_text, _seconds(3600.0)),
    "fault_plan": _Knob("KVCACHED_FAULT_PLAN", _text, _optional_text),
    "background_refill": _Knob("KVCACHED_BACKGROUND_REFILL", _text, _refill),
    "host_reserve": _Knob("KVCACHED_HOST_RESERVE", parse_reserve, _reserve),
}

#: Every environment variable `KvcachedConfig.resolve` reads (its knobs, and the MiB spelling
#: of the page size).
ENV_NAMES = frozenset({knob.var for knob in _KNOBS.values()} | {"KVCACHED_PAGE_SIZE_MB"})

#: Default cap on free blocks that keep their prefix-cache contents (and so their pages
#: mapped): a tenth of the pool. Idle, an engine then pins at most that share of its KV
#: range for prefix hits and gives the rest back; busy, blocks freed above the cap are
#: evicted at once instead of when the pool runs full, so some prefix hits are lost
#: (`benchmarks/bench_elasticity.py` measures both). ``-1`` keeps vLLM's own caching.
DEFAULT_MAX_CACHED = "10%"

#: Host memory a CPU engine without an explicit budget keeps free of KV (`kvcached.host`):
#: the OS, the engines' own growth and other processes need room too.
DEFAULT_HOST_RESERVE = "10%"

#: What a device's engines get for knobs set neither explicitly nor by variable
#: (`KvcachedConfig.resolve`'s ``defaults``). On CUDA a busy engine holds its recent peak of
#: pages for 256 busy steps (`kvcached.policies.ReservePolicy`): a kv page of a served model
#: is 32 MiB (a 2 MiB VMM page per layer), ~0.9 ms to map and ~0.7 ms to unmap on the step's
#: path, and serving empties and refills pages in waves as requests of one length end and
#: start. Measured on an H100 (reports/gpu/serving/diag-12-05): 92 slow steps and 1.55 s of a
#: 10.5 s saturation phase without holding, 20 and 0.39 s with it. On a CPU an mmap costs
#: microseconds, and an engine gives back what it does not use at every step's end.
#: A served CUDA engine also applies the cached-block cap only once it has been idle for 250 ms
#: (``idle_grace_s``): on an H100 (reports/gpu/serving/run-12-07, round 1) a saturation burst
#: whose waves of equal requests ended together ran out of requests for 10-20 ms four times, the
#: cap applied each time, and the burst's prefix hits fell from 22.4% to 7.7%. The grace is also
#: how long a neighbour's burst may wait for this engine's memory: with 1 s (the default until
#: 12-07) an idle engine's pages were free 1.02-1.05 s after its last response on the GPU
#: (reports/gpu/sharing-serve). 250 ms outlasts the measured gaps more than tenfold.
_DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {"cuda": {"hold_steps": 256, "idle_grace_s": 0.25}}


def device_defaults(device_type: str) -> dict[str, Any]:
    """The ``defaults`` of `KvcachedConfig.resolve` for engines on ``device_type`` (``cuda``,
    ``cpu``: vLLM's device type)."""
    return dict(_DEVICE_DEFAULTS.get(device_type, {}))


_PAGE_SIZE_MB = (1, (1 << 34) // MiB)  # KVCACHED_PAGE_SIZE_MB: page_size's own range, in MiB


@dataclass(frozen=True, slots=True)
class KvcachedConfig:
    """Validated knobs of one elastic pool; every instance holds each field in canonical form.

    Invariants (checked at construction, `_KNOBS`): ``page_size`` is a multiple of 4 KiB in
    [4 KiB, 16 GiB]; ``0 <= min_reserve_pages <= max_reserve_pages <= 2**20``; ``0 <= hold_steps
    <= 2**20`` (`kvcached.policies.ReservePolicy`: 0 gives idle pages back at the step's end); the times are
    finite seconds; ``budget_bytes`` is None (join the device's record with its limit) or
    the global limit in [0, `MAX_BYTES`] to ask that record for (`kvcached.budget`);
    ``budget_path`` is None (the per-user default record of the device), a record's path,
    or ``"off"`` (no record: nothing shared, nothing limited); ``max_cached_blocks`` is -1
    (unlimited), a block count >= 0 or ``"P%"`` of the pool (`cached_cap` turns it into
    blocks): the free cached blocks an *idle* engine keeps (a busy one caches as vLLM
    does); ``0 <= idle_grace_s <= 3600``: how long a served engine stays idle before that cap
    applies (0: at the step that leaves it idle). ``host_reserve`` is what a CPU engine without a ``budget_bytes`` keeps free of
    KV when it derives the host record's limit (`kvcached.host`): bytes, ``"P%"`` of the
    host's memory, or None (``off``: no limit derived).
    """

    page_size: int = 2 * MiB
    min_reserve_pages: int = 1
    max_reserve_pages: int = 4
    hold_steps: int = 0
    capacity_ttl_s: float = 0.1
    map_retries: int = 3
    retry_backoff_s: float = 0.04
    budget_bytes: int | None = None
    budget_path: str | None = None
    max_cached_blocks: int | str = DEFAULT_MAX_CACHED
    idle_grace_s: float = 0.0
    fault_plan: str | None = None
    background_refill: str = "auto"
    host_reserve: int | str | None = DEFAULT_HOST_RESERVE

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None,
                **explicit: Any) -> KvcachedConfig:
        """Build a config: ``explicit`` arguments win, then ``env`` (default ``os.environ``),
        then ``defaults`` (a device's, `device_defaults`), then the fields' own defaults."""
        env = os.environ if env is None else env
        unknown = (set(explicit) | set(defaults or {})) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown kvcached option(s): {sorted(unknown)}")
        values: dict[str, Any] = {name: value for name, value in (defaults or {}).items()
                                  if name not in explicit and _KNOBS[name].var not in env}
        values |= {name: knob.parse(knob.var, env[knob.var])
                   for name, knob in _KNOBS.items() if knob.var in env and name not in explicit}
        if "KVCACHED_PAGE_SIZE_MB" in env and "page_size" not in explicit:
            mib = _count(*_PAGE_SIZE_MB)("KVCACHED_PAGE_SIZE_MB",
                                         _int_text("KVCACHED_PAGE_SIZE_MB", env["KVCACHED_PAGE_SIZE_MB"]))
            if "page_size" in values and values["page_size"] != mib * MiB:
                raise ConfigError(f"KVCACHED_PAGE_SIZE_MB={mib} disagrees with KVCACHED_PAGE_SIZE="
                                  f"{values['page_size']}; set one of them")
            values["page_size"] = mib * MiB
        return cls(**values, **explicit)

    def validate(self) -> None:
        """Apply each field's rule (`_KNOBS`), keeping its canonical form, then the rules
        across fields. Runs at construction; idempotent."""
        for name, knob in _KNOBS.items():
            canonical = knob.check(f"{knob.var} ({name})", getattr(self, name))
            if canonical != getattr(self, name) or type(canonical) is not type(getattr(self, name)):
                object.__setattr__(self, name, canonical)  # frozen: only construction sets fields
        if self.min_reserve_pages > self.max_reserve_pages:
            raise ConfigError(
                f"KVCACHED_MIN_RESERVE_PAGES={self.min_reserve_pages} exceeds "
                f"KVCACHED_MAX_RESERVE_PAGES={self.max_reserve_pages}"
            )

    def cached_cap(self, num_blocks: int) -> int:
        """The cap on free cached blocks of a pool of ``num_blocks`` blocks; -1: none."""
        cap = self.max_cached_blocks
        if isinstance(cap, str):
            return int(num_blocks * float(cap[:-1]) / 100.0)
        return cap
