"""Logical-block copies over byte-page metadata.

`copy_blocks` is kvcached's replacement for vLLM's ``copy_kv_cache_blocks_inplace``.
vLLM's version treats each whole storage as ``num_blocks`` equal rows, which is wrong
for a backing that reserves more address space than the KV view exposes, for split
K/V layouts with a gap between the halves, and for packed backings whose layers are
visited once per layer. This version copies, for each backing allocation, exactly the
union of the byte runs its views describe (see `kvcached.views.BytePageMeta`), once
per run, and never reads or writes any other byte of the backing.

The whole batch is validated before the first byte is written; a rejected batch raises
`CopyValidationError` and leaves every backing untouched.

This module depends on torch and the standard library only; it never imports vllm.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcached.errors import CopyValidationError
from kvcached.views import (
    BytePageMeta,
    KVCacheEntry,
    check_block_disjoint,
    get_meta,
    merge_runs,
)

if TYPE_CHECKING:
    import torch

    from kvcached.faults import FaultInjector

__all__ = ["CopyStats", "copy_blocks", "copy_stats", "parse_copies", "reset_copy_stats"]


@dataclass(frozen=True, slots=True)
class CopyStats:
    """Counters since the last `reset_copy_stats`.

    ``batches``: non-empty batches copied. ``block_copies``: ``(src, dst)`` pairs
    copied. ``runs_copied``: (backing, byte run) copies issued; each one moves the
    run for every pair of its batch.
    """

    batches: int = 0
    block_copies: int = 0
    runs_copied: int = 0


_stats_lock = threading.Lock()
_stats = CopyStats()


def copy_stats() -> CopyStats:
    """A snapshot of the module counters."""
    with _stats_lock:
        return _stats


def reset_copy_stats() -> None:
    """Zero the module counters."""
    global _stats
    with _stats_lock:
        _stats = CopyStats()


def _record(pairs: int, runs: int) -> None:
    global _stats
    with _stats_lock:
        _stats = CopyStats(
            batches=_stats.batches + 1,
            block_copies=_stats.block_copies + pairs,
            runs_copied=_stats.runs_copied + runs,
        )


def _as_index(value: object, what: str, k: int) -> int:
    if isinstance(value, bool):
        # bool is an int subclass; a True/False block id is a caller bug.
        raise CopyValidationError(f"copy #{k}: {what} block id is a bool ({value!r})")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise CopyValidationError(f"copy #{k}: {what} block id {value!r} is not an integer") from exc


def parse_copies(copies: Iterable[Any], num_blocks: int) -> tuple[list[int], list[int]]:
    """Validate a copy batch and split it into source and destination lists.

    Each element is an object with ``src_block_id``/``dst_block_id`` attributes (vLLM's
    ``KVCacheBlockCopy``) or a 2-sequence ``(src, dst)``. Every id must be in
    ``[0, num_blocks)`` and no destination may repeat (two writes to one block would
    make the result depend on scatter order). A source may also be a destination:
    all sources are read before any destination is written.
    """
    srcs: list[int] = []
    dsts: list[int] = []
    seen: set[int] = set()
    for k, item in enumerate(copies):
        if hasattr(item, "src_block_id") and hasattr(item, "dst_block_id"):
            raw_src, raw_dst = item.src_block_id, item.dst_block_id
        else:
            try:
                raw_src, raw_dst = item
            except (TypeError, ValueError) as exc:
                raise CopyValidationError(f"copy #{k} is {item!r}; expected (src, dst) or a KVCacheBlockCopy") from exc
        src = _as_index(raw_src, "source", k)
        dst = _as_index(raw_dst, "destination", k)
        for what, b in (("source", src), ("destination", dst)):
            if not 0 <= b < num_blocks:
                raise CopyValidationError(f"copy #{k}: {what} block {b} out of range [0, {num_blocks})")
        if dst in seen:
            raise CopyValidationError(f"copy #{k}: destination block {dst} appears twice")
        seen.add(dst)
        srcs.append(src)
        dsts.append(dst)
    return srcs, dsts


@dataclass(slots=True)
class _Backing:
    """Every view on one backing allocation, merged."""

    tensor: torch.Tensor  # a view whose storage reaches furthest (used to reach the bytes)
    block_stride: int
    where: str  # first view's position, for messages
    runs: list[tuple[int, int]]  # absolute block-0 runs of all views, unmerged


def _flatten(kv_caches: Iterable[KVCacheEntry]) -> list[tuple[str, torch.Tensor]]:
    import torch

    out: list[tuple[str, torch.Tensor]] = []
    for i, entry in enumerate(kv_caches):
        if isinstance(entry, torch.Tensor):
            out.append((f"kv_caches[{i}]", entry))
            continue
        if not isinstance(entry, (list, tuple)):
            raise CopyValidationError(f"kv_caches[{i}] is a {type(entry).__name__}, not a tensor or list of tensors")
        for j, t in enumerate(entry):
            if not isinstance(t, torch.Tensor):
                raise CopyValidationError(f"kv_caches[{i}][{j}] is a {type(t).__name__}, not a tensor")
            out.append((f"kv_caches[{i}][{j}]", t))
    return out


def _plan(kv_caches: Iterable[KVCacheEntry], num_blocks: int) -> list[tuple[_Backing, tuple[tuple[int, int], ...]]]:
    """Group views by backing and compute each backing's merged runs; validate all."""
    backings: dict[int, _Backing] = {}
    for where, tensor in _flatten(kv_caches):
        meta: BytePageMeta | None = get_meta(tensor)
        if meta is None:
            raise CopyValidationError(f"{where} has no byte-page metadata (annotate it first)")
        if meta.num_blocks != num_blocks:
            raise CopyValidationError(f"{where} metadata describes {meta.num_blocks} blocks, the batch {num_blocks}")
        g = backings.get(meta.backing_id)
        if g is None:
            backings[meta.backing_id] = _Backing(tensor, meta.block_stride, where, list(meta.absolute_runs()))
            continue
        if meta.block_stride != g.block_stride:
            raise CopyValidationError(
                f"{where} and {g.where} share backing {meta.backing_id:#x} but disagree on "
                f"the block stride ({meta.block_stride} vs {g.block_stride} bytes)"
            )
        if tensor.device != g.tensor.device:
            raise CopyValidationError(f"{where} and {g.where} share backing {meta.backing_id:#x} on different devices")
        # Several storage objects may start at one address (e.g. two DLPack imports
        # of one range); reach the bytes through the largest.
        if tensor.untyped_storage().nbytes() > g.tensor.untyped_storage().nbytes():
            g.tensor = tensor
        g.runs.extend(meta.absolute_runs())

    plan: list[tuple[_Backing, tuple[tuple[int, int], ...]]] = []
    spans: list[tuple[str, int, int, str]] = []  # (device, start address, end address, where)
    for base, g in backings.items():
        runs = merge_runs(g.runs)
        # Views that each pass on their own can still disagree about block boundaries
        # (one view's block b overlapping another's block b+1); reject that here.
        try:
            check_block_disjoint(runs, g.block_stride, num_blocks)
        except CopyValidationError as exc:
            raise CopyValidationError(
                f"views on backing {base:#x} (first: {g.where}) disagree on block boundaries: {exc}"
            ) from exc
        last_off, last_n = runs[-1]
        end = (num_blocks - 1) * g.block_stride + last_off + last_n
        storage_bytes = int(g.tensor.untyped_storage().nbytes())
        if end > storage_bytes:
            raise CopyValidationError(
                f"backing {base:#x} (first: {g.where}): described bytes end at {end}, "
                f"past its storage ({storage_bytes} bytes)"
            )
        spans.append((str(g.tensor.device), base + runs[0][0], base + end, g.where))
        plan.append((g, runs))

    # Distinct backings are distinct allocations. If two overlap, the same bytes
    # would be copied twice, which is wrong for chained copies (a->b, b->c).
    spans.sort()
    for (dev_a, _, end_a, where_a), (dev_b, start_b, _, where_b) in itertools.pairwise(spans):
        if dev_a == dev_b and start_b < end_a:
            raise CopyValidationError(
                f"{where_a} and {where_b} have different storages over overlapping "
                "addresses; views of one allocation must share one storage"
            )
    return plan


def copy_blocks(
    kv_caches: Iterable[KVCacheEntry], num_blocks: int, copies: Sequence[Any], faults: FaultInjector | None = None
) -> int:
    """Copy logical blocks ``src -> dst`` in every KV view of ``kv_caches``.

    ``kv_caches`` holds tensors or lists of tensors, each carrying metadata from
    `kvcached.views.attach_meta`. ``copies`` holds ``(src, dst)`` pairs or
    ``KVCacheBlockCopy``-like objects. Semantics are gather-then-scatter per byte run:
    every destination receives the bytes its source held before the call.

    Everything is validated first (ids in range, unique destinations, metadata on
    every view describing ``num_blocks`` blocks, consistent block strides per backing);
    on any problem `CopyValidationError` is raised and nothing is written. ``faults`` (the
    fault site ``copy``) may then fail a valid, non-empty batch on purpose, still before any
    byte is written.

    Returns the number of (backing, run) copies performed (0 for an empty batch).
    """
    import torch

    srcs, dsts = parse_copies(copies, num_blocks)
    entries = list(kv_caches)
    plan = _plan(entries, num_blocks)
    if not srcs or not plan:
        return 0
    if faults is not None:
        faults.check("copy")

    # One (2, n) src/dst index tensor per device, uploaded from pageable memory: a few
    # hundred bytes the driver stages at once, and no pinned staging block outlives the
    # batch (one would stay in torch's host cache for the life of the process).
    index: dict[torch.device, torch.Tensor] = {}
    pair: torch.Tensor | None = None
    runs_done = 0
    try:
        for g, runs in plan:
            device = g.tensor.device
            if device not in index:
                index[device] = torch.tensor([srcs, dsts], dtype=torch.int64, device=device)
            pair = index[device]
            raw = torch.empty(0, dtype=torch.uint8, device=device)
            raw.set_(g.tensor.untyped_storage())
            for off, n in runs:
                rows = torch.as_strided(raw, (num_blocks, n), (g.block_stride, 1), off)
                rows[pair[1]] = rows[pair[0]]
                runs_done += 1
    finally:
        # The index tensors die here, not whenever this frame is torn down: a tool that
        # keeps frames alive (compute-sanitizer's leak check does) must not keep them.
        index.clear()
        pair = None
    _record(len(srcs), runs_done)
    return runs_done
