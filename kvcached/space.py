"""KV space: the worker's backings, and the page geometry shared with the scheduler.

At tensor-parallel size 1 the worker and the scheduler live in one process (vLLM's
EngineCore runs the executor in-process). The worker reserves one virtual range per
KV backing and *publishes* them here; the scheduler-side pool, built right after,
*claims* the published space and maps pages into exactly those ranges. The space carries
the `KvcachedConfig` the worker resolved and planned with, so the pool runs on the very
same values (page size, reserve, budget, fault plan) instead of reading them again.

Geometry. Backing ``r`` stores logical block ``b`` at bytes ``[b*stride_r, ...)``. A kv
page must cover whole VMM pages in every backing, so it holds
``blocks_per_page = lcm_r(page_size / gcd(page_size, stride_r))`` blocks and spans
``blocks_per_page * stride_r / page_size`` VMM pages of backing ``r``. No block ever
straddles a kv page, and no VMM page is shared by two kv pages.

TP > 1 (a design; kvcached runs at TP=1 today): every rank reserves the same geometry (it is a pure
function of the KV config), and the scheduler sends the kv pages to map/unmap with each
step through vLLM's own scheduler-to-worker channel, so ranks map identical pages before
the step runs; a rank that fails reports it in its step output and the scheduler unmaps
the batch on every rank (no partial state survives a step).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvcached.config import KvcachedConfig
from kvcached.errors import ConfigError, IntegrationError
from kvcached.pages import PageSpace, Range

#: Refuse geometries where one kv page would need more VMM pages than this per backing
#: (a pathological block stride); the user should pick another page size instead.
MAX_VMM_PAGES_PER_KV_PAGE = 64


@dataclass(frozen=True, slots=True)
class Geometry:
    """Page geometry for a set of backings. Invariant: ``vmm_pages[r] * page_size ==
    blocks_per_page * strides[r]``, and ``reserved_bytes[r]`` covers ``num_kv_pages``."""

    page_size: int
    strides: tuple[int, ...]
    num_blocks: int
    blocks_per_page: int
    vmm_pages: tuple[int, ...]
    num_kv_pages: int

    @property
    def reserved_bytes(self) -> tuple[int, ...]:
        return tuple(k * self.num_kv_pages * self.page_size for k in self.vmm_pages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (ints and lists of ints, one key per field); `from_dict` inverts it."""
        return {
            "page_size": self.page_size,
            "strides": list(self.strides),
            "num_blocks": self.num_blocks,
            "blocks_per_page": self.blocks_per_page,
            "vmm_pages": list(self.vmm_pages),
            "num_kv_pages": self.num_kv_pages,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Geometry:
        """The geometry `to_dict` described, checked strictly; `ConfigError` otherwise.

        Every field must be present and no other key may be; values must be ints (lists
        of ints for ``strides`` and ``vmm_pages``), never bools or floats. Because a
        geometry is a pure function of (strides, num_blocks, page_size), the derived
        fields must equal what `plan_geometry` computes from those three: a peer that
        planned differently is refused here rather than mapping different pages.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"KV geometry must be a mapping, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(str(k) for k in data if k not in names)
        if missing or unknown:
            raise ConfigError(f"KV geometry: missing keys {missing}, unknown keys {unknown}")
        values: dict[str, Any] = {}
        for name in names:
            raw = data[name]
            if name in ("strides", "vmm_pages"):
                if not isinstance(raw, (list, tuple)) or not all(_is_int(v) for v in raw):
                    raise ConfigError(f"KV geometry: {name}={raw!r} is not a list of ints")
                values[name] = tuple(raw)
            elif _is_int(raw):
                values[name] = raw
            else:
                raise ConfigError(f"KV geometry: {name}={raw!r} is not an int")
        geometry = cls(**values)
        planned = plan_geometry(geometry.strides, geometry.num_blocks, geometry.page_size)
        if geometry != planned:
            raise ConfigError(f"KV geometry {geometry} is inconsistent: its strides, block count "
                              f"and page size plan {planned}")
        return geometry


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_geometry(strides: Sequence[int], num_blocks: int, page_size: int) -> Geometry:
    """Compute the kv-page geometry for backings with the given block strides (bytes)."""
    if not strides or any(s <= 0 for s in strides):
        raise ConfigError(f"block strides must be positive, got {list(strides)}")
    if num_blocks <= 0:
        raise ConfigError(f"num_blocks={num_blocks} must be > 0")
    bpp = 1
    for s in strides:
        bpp = math.lcm(bpp, page_size // math.gcd(page_size, s))
    vmm = tuple(bpp * s // page_size for s in strides)
    if max(vmm) > MAX_VMM_PAGES_PER_KV_PAGE:
        raise ConfigError(
            f"KVCACHED_PAGE_SIZE={page_size} fits block strides {list(strides)} badly: one kv page "
            f"would span {max(vmm)} VMM pages; choose a page size that is a multiple of the strides"
        )
    pages = -(-num_blocks // bpp)
    return Geometry(page_size, tuple(strides), num_blocks, bpp, vmm, pages)


@dataclass(frozen=True)
class KvSpace:
    """The published backings of one engine's KV cache, their geometry and config.

    ``premapped``: kv pages the publisher already mapped in every range before any pool
    existed (the worker maps the null block's page so warm-up runs may read it). The pool
    that claims the space adopts them instead of mapping them again.

    ``config``: the config the publisher resolved and planned the geometry with; the pool
    over this space uses it (`kvcached.arena.ElasticArena.open`). None only for spaces
    built without one (tests, probes), whose pool must be given a config explicitly.
    Invariant: ``config is None or config.page_size == geometry.page_size``.
    """

    geometry: Geometry
    ranges: tuple[Range, ...]
    premapped: frozenset[int] = frozenset()
    config: KvcachedConfig | None = None

    def __post_init__(self) -> None:
        if self.config is not None and self.config.page_size != self.geometry.page_size:
            raise ConfigError(
                f"KV space planned with page size {self.geometry.page_size} but its config has "
                f"KVCACHED_PAGE_SIZE={self.config.page_size}"
            )

    def page_space(self) -> PageSpace:
        return PageSpace(self.ranges, self.geometry.vmm_pages, self.geometry.num_kv_pages)


_lock = threading.Lock()
_published: KvSpace | None = None


def publish(space: KvSpace) -> None:
    """Worker side: make this engine's KV backings available to the scheduler pool."""
    global _published
    with _lock:
        _published = space


def claim(num_blocks: int) -> KvSpace | None:
    """Scheduler side: the published space, checked against the scheduler's block count."""
    with _lock:
        space = _published
    if space is None:
        return None
    if space.geometry.num_blocks != num_blocks:
        raise IntegrationError(
            f"worker published {space.geometry.num_blocks} KV blocks but the scheduler has "
            f"{num_blocks}: the two sides disagree on the KV geometry"
        )
    return space


def withdraw(space: KvSpace | None = None) -> None:
    """Forget the published space (engine shutdown)."""
    global _published
    with _lock:
        if space is None or _published is space:
            _published = None
