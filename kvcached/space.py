"""KV space: an engine's KV backings, and the page geometry every process agrees on.

The worker reserves one virtual range per KV backing (on every rank: each holds its shard
of every layer) with the same geometry, a pure function of the block strides, the block
count and the page size. The scheduler's pool maps kv pages into them: directly when the
ranges are its own (`PageSpace`), or on every rank through the engine's own channel
(``kvcached.ranks``), which carries the geometry (`Geometry.to_dict`) and the config the
worker resolved, so the pool runs on the very same values (page size, reserve, budget,
fault plan) instead of reading them again.

Geometry. Backing ``r`` stores logical block ``b`` at bytes ``[b*stride_r, ...)``. A kv
page must cover whole VMM pages in every backing, so it holds
``blocks_per_page = lcm_r(page_size / gcd(page_size, stride_r))`` blocks and spans
``blocks_per_page * stride_r / page_size`` VMM pages of backing ``r``. No block ever
straddles a kv page, and no VMM page is shared by two kv pages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvcached.config import KvcachedConfig
from kvcached.errors import ConfigError
from kvcached.pages import Charger, KvPageSpace, PageSpace, Range
from kvcached.policies import Limiter

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
    """One engine's KV cache as a pool sees it: geometry, config, and where pages map.

    The pages are either this process's ``ranges`` (a worker's own backings, a probe, a
    test) or a ``pages`` space that maps them elsewhere (``kvcached.ranks.RankedPageSpace``:
    on every rank of a multiprocess engine, through the engine's own channel).

    ``premapped``: kv pages already mapped (on every rank) before any pool existed (the
    worker maps the null block's page so warm-up runs may read it). The pool adopts them
    instead of mapping them again.

    ``config``: the config the worker resolved and planned the geometry with; the pool over
    this space uses it (`kvcached.arena.ElasticArena.open`). None only for spaces built
    without one (tests, probes), whose pool must be given a config explicitly.
    ``charger``: where the local ranges' mapped bytes are charged (the device's budget
    record slot of this process, `kvcached.budget.Slot`), or None.
    ``limiter``: where the engine's page limit comes from (its rows in its devices' budget
    records, `kvcached.budget.EngineBudget`), or None; the pool over this space owns it
    from `kvcached.arena.ElasticArena.open` on, and closes it with itself.
    Invariants: exactly one of ``ranges`` and ``pages``; ``config is None or
    config.page_size == geometry.page_size``.
    """

    geometry: Geometry
    ranges: tuple[Range, ...] = ()
    premapped: frozenset[int] = frozenset()
    config: KvcachedConfig | None = None
    pages: KvPageSpace | None = None
    charger: Charger | None = None
    limiter: Limiter | None = None

    def __post_init__(self) -> None:
        if bool(self.ranges) == (self.pages is not None):
            raise ConfigError("a KV space maps into either local ranges or a page space, exactly one")
        if self.config is not None and self.config.page_size != self.geometry.page_size:
            raise ConfigError(
                f"KV space planned with page size {self.geometry.page_size} but its config has "
                f"KVCACHED_PAGE_SIZE={self.config.page_size}"
            )

    def page_space(self) -> KvPageSpace:
        if self.pages is not None:
            return self.pages
        return PageSpace(self.ranges, self.geometry.vmm_pages, self.geometry.num_kv_pages, self.charger)
