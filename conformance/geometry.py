"""Engine geometry read from a running engine, and the prompt lengths derived from it.

Nothing here is hard-coded per model: the attention block size (which vLLM enlarges for
hybrids so attention and Mamba pages line up), the prefix-hash granularity and the KV bytes
of one block are read from the engine after it has started. The page size is kvcached's
virtual-memory page: the size the harness passes to the candidate (``KVCACHED_PAGE_SIZE``);
unless given explicitly it is derived from the engine's KV backings (``derive_page_size``),
because kvcached needs pages that hold whole blocks of every backing. The reference derives
it once and every engine of the case uses it; a kvcached engine must report the same page
through ``kvcached.stats()`` (``EngineHandle.check_page_size``), else the case fails. The
engine side reads the geometry (``EngineHandle.geometry``); this module is pure.

Invariants:
* ``prompt_lengths`` returns distinct lengths in ascending order, each in
  ``[1, max_prompt_len]``; every label of the requested set appears on exactly one length
  (labels that coincide, e.g. hash == block for dense models, are merged as "hash=block").
* ``Geometry.same_attention_layout`` is what both engines must agree on for token-ID
  parity to be meaningful; kvcached must never change it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ConfigDict

from conformance.cases import LengthSet
from conformance.device import PROFILES, Device, DeviceProfile


@dataclass(frozen=True)
class Geometry:
    block_size: int  # scheduler block size: LCM of the groups' (attention enlarged for hybrids)
    hash_block_size: int  # prefix-hash granularity (BlockPool.hash_block_size)
    group_block_sizes: tuple[int, ...]
    group_kinds: tuple[str, ...]  # KV spec class name per group
    group_layers: tuple[tuple[str, ...], ...]
    block_page_bytes: int  # bytes of one block in one layer's backing (max over groups)
    block_bytes_all_layers: int  # bytes of one block across every KV backing tensor
    block_strides: tuple[int, ...]  # bytes of one block in each KV backing tensor
    num_blocks: int
    kv_tensor_bytes: int  # sum of the KVCacheTensor sizes: what native vLLM commits at start
    max_model_len: int
    page_size_bytes: int  # kvcached VMM page size
    page_size_source: str  # "configured" (given to the harness) | "derived" (from the strides)
    device: str = "cpu"  # where the KV lives (`conformance.device`)

    # Validated strictly where it crosses a process boundary (``conformance.results``).
    __pydantic_config__ = ConfigDict(extra="forbid")

    @property
    def tokens_per_page(self) -> int:
        """Tokens of one layer's KV that fit in one VMM page (at least 1).

        When a block is smaller than a page, pages hold whole blocks; otherwise page
        boundaries fall inside blocks at a fixed byte offset.
        """
        if self.block_page_bytes <= self.page_size_bytes:
            return (self.page_size_bytes // self.block_page_bytes) * self.block_size
        bytes_per_token = self.block_page_bytes / self.block_size
        return max(1, int(self.page_size_bytes // bytes_per_token))

    def same_attention_layout(self) -> tuple[Any, ...]:
        return (self.block_size, self.hash_block_size, self.group_block_sizes, self.group_kinds, self.block_page_bytes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Geometry:
        d = dict(data)
        d["group_block_sizes"] = tuple(d["group_block_sizes"])
        d["group_kinds"] = tuple(d["group_kinds"])
        d["group_layers"] = tuple(tuple(x) for x in d["group_layers"])
        d["block_strides"] = tuple(d["block_strides"])
        return cls(**d)


def derive_page_size(block_strides: tuple[int, ...], device: DeviceProfile = PROFILES[Device.CPU]) -> int:
    """The smallest multiple of every block stride and of the device's page unit (4 KiB on the
    CPU, 2 MiB on CUDA) that is >= the device's page target (64 KiB on the CPU).

    Such a page holds whole blocks of every backing (kvcached refuses others), and a target
    of a few blocks keeps a page boundary within reach of the prompt lengths.
    """
    unit = math.lcm(device.page_unit, *block_strides)
    return unit * max(1, -(-device.page_target // unit))


def prompt_lengths(geo: Geometry, length_set: LengthSet, max_prompt_len: int) -> list[tuple[str, int]]:
    """The labelled prompt lengths of a case, derived from the engine geometry.

    BOUNDARY covers 1, hash-1, hash, hash+1, block-1, block, block+1, 2*block-1 and a length
    whose KV straddles a page boundary (one page worth of tokens plus half a hash unit, so
    it ends strictly inside the second page). EXTENDED adds multi-block lengths used to put
    pressure on the KV pool. Lengths above ``max_prompt_len`` are dropped, except that an
    unreachable page straddle is an error unless one block holds every prompt.
    """
    h, b = geo.hash_block_size, geo.block_size
    straddle = geo.tokens_per_page + max(1, h // 2)
    wanted: list[tuple[str, int]] = [
        ("1", 1),
        ("hash-1", h - 1),
        ("hash", h),
        ("hash+1", h + 1),
        ("block-1", b - 1),
        ("block", b),
        ("block+1", b + 1),
        ("2*block-1", 2 * b - 1),
        ("page-straddle", straddle),
    ]
    if length_set is LengthSet.EXTENDED:
        wanted += [("3*block+hash+1", 3 * b + h + 1), ("4*block-1", 4 * b - 1)]
    by_len: dict[int, list[str]] = {}
    for label, n in wanted:
        if n < 1:
            continue
        if n > max_prompt_len:
            # One block holding every possible prompt (Mamba without prefix caching: block ==
            # max_model_len) has a fixed-size state, so no prompt length moves a page
            # boundary; anywhere else an unreachable straddle means the page is too large.
            if label == "page-straddle" and geo.block_size < max_prompt_len:
                raise ValueError(
                    f"page straddle needs {n} tokens but prompts are capped at {max_prompt_len}; "
                    "use a smaller --page-size"
                )
            continue
        by_len.setdefault(n, []).append(label)
    return [("=".join(labels), n) for n, labels in sorted(by_len.items())]
