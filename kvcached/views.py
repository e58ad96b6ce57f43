"""Byte-page metadata for KV-cache views.

A KV-cache *view* is a typed tensor (attention K/V, MLA latent, Mamba page or Mamba
state) laid over a raw byte *backing*. The engine addresses it by *logical block*:
block ``b`` of the scheduler owns some bytes of every view. Copying a logical block
therefore means copying exactly those bytes, and nothing else. The backing may be a
large virtual reservation whose unused parts are unmapped, so even reading a byte
that no view describes can fault.

`BytePageMeta` records, for one view, which bytes of its backing belong to logical
block ``b``. `describe_block_view` derives it from the view's real geometry (storage
base, data pointer, sizes, strides, item size); `attach_meta` / `get_meta` keep it on
the tensor object so `kvcached.copy.copy_blocks` can find it later.

This module depends on torch and the standard library only; it never imports vllm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from kvcached.errors import CopyValidationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BytePageMeta",
    "KVCacheEntry",
    "annotate",
    "attach_meta",
    "check_block_disjoint",
    "describe_block_view",
    "get_meta",
    "merge_runs",
    "storage_base",
]

#: Attribute under which metadata is stored on a tensor object.
META_ATTR = "_kvcached_meta"

#: Upper bound on the byte runs enumerated for one logical block before merging.
#: Every layout vLLM builds needs at most a handful; a view needing more is too
#: fragmented to copy efficiently and is most likely not a KV view at all.
MAX_RAW_RUNS = 1 << 16

Run = tuple[int, int]
"""``(offset, nbytes)``: a contiguous byte run."""


@dataclass(frozen=True, slots=True)
class BytePageMeta:
    """Which bytes of a backing allocation belong to each logical block of one view.

    Byte ``x`` of the backing belongs to logical block ``b`` of this view iff, for some
    ``(off, n)`` in ``segments``::

        backing_offset + b * block_stride + off <= x < backing_offset + b * block_stride + off + n

    Fields:

    ``backing_id``
        Base address of the backing storage (``tensor.untyped_storage().data_ptr()``).
        Views with the same ``backing_id`` alias one allocation; offsets below are
        relative to this address.
    ``backing_offset``
        Byte offset, from the backing base, of the view's first byte of logical block 0
        (the element with every index 0). It includes ``layer_offset``.
    ``layer_offset``
        ``backing_offset % block_stride``: where this view starts inside a block row.
        Non-zero for packed layers, interleaved layers and Mamba 0.26 state tensors;
        0 for a view that starts its own allocation. Informational (copying uses
        ``backing_offset``).
    ``block_stride``
        Bytes between logical block ``b`` and ``b + 1``; always ``> 0``. For a kernel
        block size smaller than the logical block this is ``kernel_blocks_per_block``
        times the stride of the tensor's block dimension.
    ``page_bytes``
        Bytes of one logical block that belong to this view: ``sum(n for _, n in segments)``.
    ``segments``
        Byte runs of logical block 0, relative to ``backing_offset``. Invariants:
        non-empty; sorted by offset; every ``n > 0``; runs neither overlap nor touch
        (adjacent runs are merged); ``segments[0][0] == 0``. Runs normally lie inside
        ``[0, block_stride)``, but not always: a split K/V view ``(2, num_blocks, ...)``
        has one run for K at offset 0 and one for V at its real offset (the distance
        between the K and V halves), and the gap between them is *not* covered.
    ``num_blocks``
        Number of logical blocks the view exposes.
    ``kernel_blocks_per_block``
        How many entries of the tensor's block dimension make one logical block
        (the logical/kernel block-size ratio, 1 when they are equal).

    Whole-view invariants (checked by `describe_block_view`): the byte sets of two
    different logical blocks ``b != b'`` in ``[0, num_blocks)`` are disjoint, so a
    block copy never clobbers a third block; and the furthest byte,
    ``backing_offset + (num_blocks - 1) * block_stride + end_of_last_segment``, lies
    inside the backing storage.
    """

    backing_id: int
    backing_offset: int
    layer_offset: int
    block_stride: int
    page_bytes: int
    segments: tuple[Run, ...]
    num_blocks: int
    kernel_blocks_per_block: int

    @property
    def extent(self) -> int:
        """Bytes from ``backing_offset`` to the end of the last logical block's last run."""
        last_off, last_n = self.segments[-1]
        return (self.num_blocks - 1) * self.block_stride + last_off + last_n

    def absolute_runs(self) -> tuple[Run, ...]:
        """``segments`` shifted to offsets from the backing base (block 0)."""
        return tuple((self.backing_offset + off, n) for off, n in self.segments)


def merge_runs(runs: Iterable[Run]) -> tuple[Run, ...]:
    """Union of byte runs: sorted, with overlapping or touching runs merged, empty runs dropped."""
    out: list[list[int]] = []
    for off, n in sorted(r for r in runs if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            last = out[-1]
            last[1] = max(last[1], off + n - last[0])
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)


def check_block_disjoint(runs: Sequence[Run], block_stride: int, num_blocks: int) -> None:
    """Raise `CopyValidationError` unless blocks ``b != b'`` cover disjoint bytes.

    ``runs`` are block 0's runs (merged, sorted); block ``b`` covers them shifted by
    ``b * block_stride``. Two blocks share a byte iff some byte offset ``x`` of block 0
    and ``y`` of block 0 satisfy ``x - y == k * block_stride`` with
    ``0 < |k| < num_blocks``. Each run is cut into pieces that do not cross a multiple
    of ``block_stride``; a piece is described by its residue interval modulo the stride
    and its quotient. Pieces whose residue intervals intersect collide iff their
    quotients differ by less than ``num_blocks`` (and are not the same piece).
    """
    if block_stride <= 0:
        raise CopyValidationError(f"block stride must be positive, got {block_stride}")
    if num_blocks <= 1 or not runs:
        return
    # Fast path: everything inside one window of block_stride bytes.
    start = runs[0][0]
    end = max(o + n for o, n in runs)
    if end - start <= block_stride:
        return
    pieces: list[tuple[int, int, int]] = []  # (residue_start, residue_end, quotient)
    for off, n in runs:
        pos, stop = off, off + n
        while pos < stop:
            q, r = divmod(pos, block_stride)
            take = min(stop - pos, block_stride - r)
            pieces.append((r, r + take, q))
            pos += take
            if len(pieces) > MAX_RAW_RUNS:
                raise CopyValidationError(
                    "view spans too many block strides per logical block to validate "
                    f"({len(pieces)} pieces); it is not a block-strided KV view"
                )
    pieces.sort()
    active: list[tuple[int, int, int]] = []
    for piece in pieces:
        r0, _, q = piece
        active = [a for a in active if a[1] > r0]
        for _, _, qa in active:
            if qa != q and abs(qa - q) < num_blocks:
                raise CopyValidationError(
                    f"logical blocks overlap: bytes of block 0 reappear in block {abs(qa - q)} "
                    f"(block stride {block_stride}, runs {list(runs)[:8]})"
                )
        active.append(piece)


def storage_base(tensor: torch.Tensor) -> int:
    """Base address of the storage behind ``tensor`` (the ``backing_id`` of its views)."""
    return int(tensor.untyped_storage().data_ptr())


def _candidate_block_dims(shape: Sequence[int], num_blocks: int) -> list[int]:
    return [d for d, size in enumerate(shape) if size >= num_blocks and size % num_blocks == 0]


def describe_block_view(tensor: torch.Tensor, num_blocks: int, *, block_dim: int | None = None) -> BytePageMeta:
    """Derive `BytePageMeta` for ``tensor``, a view with ``num_blocks`` logical blocks.

    The block dimension is the one whose size is ``num_blocks * r`` for an integer
    ``r >= 1`` (``r`` kernel blocks per logical block, consecutive along that dim).
    When several dimensions qualify, ``block_dim`` must name it; a given ``block_dim``
    is always checked. Logical block ``b`` is the sub-tensor whose block-dim index is
    in ``[b * r, (b + 1) * r)``; its bytes are enumerated from the strides: inner
    dimensions that are contiguous with each other collapse into one run, and the
    remaining (outer) dimensions contribute one run per index combination, which are
    then merged.

    Raises `ValueError` for bad arguments and `CopyValidationError` for views that
    cannot be copied block by block (no or ambiguous block dimension, zero block
    stride, logical blocks sharing bytes, too many runs).
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = tuple(int(s) for s in tensor.shape)
    strides = tuple(int(s) for s in tensor.stride())
    if tensor.numel() == 0:
        raise CopyValidationError(f"cannot describe an empty view (shape {shape})")
    if any(s < 0 for s in strides):
        # torch forbids negative strides today; keep the check so the offset
        # arithmetic below (block 0 starts at the lowest address) stays sound.
        raise CopyValidationError(f"negative strides are not supported: {strides}")
    block_dim = _resolve_block_dim(shape, num_blocks, block_dim)

    itemsize = tensor.element_size()
    ratio = shape[block_dim] // num_blocks
    block_stride = ratio * strides[block_dim] * itemsize
    if block_stride <= 0:
        raise CopyValidationError(
            f"block dimension {block_dim} of shape {shape} has stride {strides[block_dim]}; "
            "logical blocks would alias each other"
        )
    segments = _block_runs(shape, strides, block_dim, ratio, itemsize)
    check_block_disjoint(segments, block_stride, num_blocks)

    base = storage_base(tensor)
    backing_offset = int(tensor.data_ptr()) - base
    meta = BytePageMeta(
        backing_id=base,
        backing_offset=backing_offset,
        layer_offset=backing_offset % block_stride,
        block_stride=block_stride,
        page_bytes=sum(n for _, n in segments),
        segments=segments,
        num_blocks=num_blocks,
        kernel_blocks_per_block=ratio,
    )
    storage_bytes = int(tensor.untyped_storage().nbytes())
    if backing_offset < 0 or backing_offset + meta.extent > storage_bytes:
        # Cannot happen for a tensor torch accepted; guards the arithmetic above.
        raise CopyValidationError(
            f"described bytes [{backing_offset}, {backing_offset + meta.extent}) exceed "
            f"the storage ({storage_bytes} bytes)"
        )
    return meta


def _resolve_block_dim(shape: tuple[int, ...], num_blocks: int, block_dim: int | None) -> int:
    """The block dimension of ``shape``: the one candidate, or ``block_dim`` checked."""
    if block_dim is None:
        candidates = _candidate_block_dims(shape, num_blocks)
        if not candidates:
            raise CopyValidationError(f"no dimension of shape {shape} is a multiple of num_blocks={num_blocks}")
        if len(candidates) > 1:
            raise CopyValidationError(
                f"block dimension of shape {shape} is ambiguous for num_blocks={num_blocks} "
                f"(candidates {candidates}); pass block_dim"
            )
        return candidates[0]
    if not -len(shape) <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for shape {shape}")
    block_dim %= len(shape)
    size = shape[block_dim]
    if size < num_blocks or size % num_blocks:
        raise CopyValidationError(
            f"dim {block_dim} of shape {shape} has size {size}, not a multiple of num_blocks={num_blocks}"
        )
    return block_dim


def _block_runs(shape: tuple[int, ...], strides: tuple[int, ...], block_dim: int, ratio: int,
                itemsize: int) -> tuple[Run, ...]:
    """Logical block 0's bytes as merged ``(offset, length)`` runs relative to its start.

    The dimensions that span one logical block, in element units, are every non-block dim plus
    the ``ratio`` kernel blocks along the block dim; size-1 and stride-0 dims add no bytes.
    Inner dims contiguous with each other collapse into one run; each index combination of the
    remaining (outer) dims is one run.
    """
    dims = [(strides[d], shape[d]) for d in range(len(shape)) if d != block_dim]
    dims.append((strides[block_dim], ratio))
    dims = sorted((st, sz) for st, sz in dims if sz > 1 and st > 0)
    run_elems = 1
    outer: list[tuple[int, int]] = []
    for st, sz in dims:
        if not outer and st == run_elems:
            run_elems *= sz  # this dim continues the contiguous inner run
        else:
            outer.append((st, sz))
    count = 1
    for _, sz in outer:
        count *= sz
    if count > MAX_RAW_RUNS:
        raise CopyValidationError(
            f"view with shape {shape} and strides {strides} needs {count} byte runs per "
            f"block (limit {MAX_RAW_RUNS}); it is too fragmented to copy by block"
        )
    offsets = [0]
    for st, sz in outer:
        offsets = [o + i * st for o in offsets for i in range(sz)]
    return merge_runs((o * itemsize, run_elems * itemsize) for o in offsets)


@dataclass(frozen=True, slots=True)
class _Attached:
    """Metadata plus the geometry of the tensor it was attached to.

    The geometry lets `get_meta` notice a view that was restrided in place
    (``as_strided_``, ``set_``) after its metadata was recorded.
    """

    meta: BytePageMeta
    geometry: tuple[object, ...]


def _geometry(tensor: torch.Tensor) -> tuple[object, ...]:
    return (
        storage_base(tensor),
        int(tensor.data_ptr()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def attach_meta(tensor: torch.Tensor, meta: BytePageMeta) -> None:
    """Store ``meta`` on ``tensor`` (replacing any earlier metadata).

    ``meta.backing_id`` must be the base of ``tensor``'s storage, since the copy
    reaches the backing bytes through that storage.
    """
    base = storage_base(tensor)
    if meta.backing_id != base:
        raise ValueError(f"metadata backing_id {meta.backing_id:#x} does not match the tensor's storage base {base:#x}")
    setattr(tensor, META_ATTR, _Attached(meta, _geometry(tensor)))


def get_meta(tensor: torch.Tensor) -> BytePageMeta | None:
    """Metadata previously attached to ``tensor``, or None.

    Raises `CopyValidationError` if the tensor's geometry changed since the metadata
    was attached (it would describe the wrong bytes).
    """
    attached = getattr(tensor, META_ATTR, None)
    if attached is None:
        return None
    if not isinstance(attached, _Attached):
        raise CopyValidationError(f"unexpected {META_ATTR} value: {type(attached).__name__}")
    if attached.geometry != _geometry(tensor):
        raise CopyValidationError(
            "view geometry changed after its byte-page metadata was attached "
            f"(was {attached.geometry[2:]}, now {_geometry(tensor)[2:]}); re-annotate it"
        )
    return attached.meta


KVCacheEntry = Union["torch.Tensor", Sequence["torch.Tensor"]]


def annotate(kv_caches: Iterable[KVCacheEntry], num_blocks: int, *, block_dim: int | None = None) -> list[BytePageMeta]:
    """Attach derived metadata to every tensor of a vLLM-style ``kv_caches`` list.

    Elements are tensors, or lists/tuples of tensors (vLLM 0.26 Mamba state lists).
    ``block_dim`` (if given) applies to every tensor. Returns the metadata in
    flattened order. Nothing is attached unless every tensor can be described.
    """
    import torch  # lazy: keep `import kvcached.views` cheap

    pairs: list[tuple[torch.Tensor, BytePageMeta]] = []
    for i, entry in enumerate(kv_caches):
        tensors = (entry,) if isinstance(entry, torch.Tensor) else tuple(entry)
        for j, t in enumerate(tensors):
            where = f"kv_caches[{i}]" if isinstance(entry, torch.Tensor) else f"kv_caches[{i}][{j}]"
            if not isinstance(t, torch.Tensor):
                raise CopyValidationError(f"{where} is a {type(t).__name__}, not a tensor")
            try:
                meta = describe_block_view(t, num_blocks, block_dim=block_dim)
            except CopyValidationError as exc:
                raise CopyValidationError(f"{where}: {exc}") from exc
            pairs.append((t, meta))
    for t, meta in pairs:
        attach_meta(t, meta)
    return [m for _, m in pairs]
