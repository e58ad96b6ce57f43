"""Guarded access to kvcached's numbers from inside an engine process.

The native engine must not need kvcached at all, so nothing here imports it unless
``KVCACHED_ENABLE=1`` is set. When it is set, kvcached *must* be active: an import error,
a missing API or an empty pool registry is raised as ``KvcachedInactive`` (the case fails),
never swallowed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

STAT_FIELDS = (
    "mapped_bytes",
    "peak_mapped_bytes",
    "reserved_idle_bytes",
    "live_blocks",
    "capacity_blocks",
    "kv_page_bytes",
    "maps",
    "unmaps",
    "map_failures",
    "admission_misses",
)


class KvcachedInactive(RuntimeError):
    """KVCACHED_ENABLE=1 but kvcached is not running inside this engine."""


def enabled() -> bool:
    return os.environ.get("KVCACHED_ENABLE") == "1"


def _kvcached() -> Any:
    try:
        import kvcached
    except ImportError as e:
        raise KvcachedInactive(f"KVCACHED_ENABLE=1 but kvcached cannot be imported: {e}") from e
    if not hasattr(kvcached, "stats"):
        raise KvcachedInactive("kvcached has no stats(): the integration is not built yet")
    return kvcached


def plugin_importable() -> tuple[bool, str]:
    """Whether the vLLM plugin module exists (checked by the parent before a kvcached run)."""
    try:
        import kvcached.integration.vllm.plugin  # noqa: F401
    except ImportError as e:
        return False, str(e)
    return True, ""


def assert_active() -> None:
    """Raise unless kvcached's plugin installed its seams and created a pool in this engine."""
    try:
        from kvcached.integration.vllm import plugin
    except ImportError as e:
        raise KvcachedInactive(f"KVCACHED_ENABLE=1 but the vLLM plugin cannot be imported: {e}") from e
    if not plugin.is_installed():
        raise KvcachedInactive("KVCACHED_ENABLE=1 but kvcached's vLLM plugin did not install its seams")
    stats()


def stats() -> dict[str, dict[str, int]]:
    """{pool: {field: value}} from ``kvcached.stats()``; raises if kvcached is inactive."""
    raw = _kvcached().stats()
    if not raw:
        raise KvcachedInactive("kvcached.stats() is empty: no kvcached pool was created in this engine")
    out: dict[str, dict[str, int]] = {}
    for name, st in raw.items():
        out[str(name)] = {f: int(getattr(st, f)) for f in STAT_FIELDS if hasattr(st, f)}
        if "mapped_bytes" not in out[str(name)]:
            raise KvcachedInactive(f"kvcached pool {name!r} stats lack mapped_bytes")
    return out


def mapped_bytes() -> int:
    return sum(s["mapped_bytes"] for s in stats().values())


def peak_mapped_bytes() -> int:
    return sum(s.get("peak_mapped_bytes", s["mapped_bytes"]) for s in stats().values())


def copy_stats() -> dict[str, int]:
    """``kvcached.copy.copy_stats()`` as a dict (module-wide counters: take deltas per case)."""
    try:
        from kvcached.copy import copy_stats as _copy_stats
    except ImportError as e:
        raise KvcachedInactive(f"kvcached.copy.copy_stats unavailable: {e}") from e
    st = _copy_stats()
    if dataclasses.is_dataclass(st) and not isinstance(st, type):
        return {k: int(v) for k, v in dataclasses.asdict(st).items()}
    return {k: int(v) for k, v in dict(st).items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def page_size() -> int | None:
    """kvcached's VMM page size as the running engine reports it (None if it does not say)."""
    for st in _kvcached().stats().values():
        for name in ("page_size", "page_size_bytes"):
            if hasattr(st, name):
                return int(getattr(st, name))
    return None
