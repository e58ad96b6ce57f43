"""Tests for kvcached.views: byte-page metadata derived from real KV views.

The layout builders below mimic how vLLM 0.28's V1 runner carves KV views out of its
raw int8 allocations (``_allocate_kv_cache_tensors``, ``_reshape_kv_cache_tensors``,
``_reshape_attention_kv_cache``, ``_update_hybrid_attention_mamba_layout``), plus the
layouts kvcached itself produces (split K/V with a reserved gap, a backing larger than
the exposed view, strided raw Mamba pages in a packed backing). ``tests/test_copy.py``
imports them.

All builders use num_blocks values that are not a factor of any other dimension, so
the block dimension is found without a hint, as it would be with a real engine's
thousands of blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod

import pytest
import torch

from kvcached.errors import CopyValidationError
from kvcached.views import (
    BytePageMeta,
    annotate,
    attach_meta,
    check_block_disjoint,
    describe_block_view,
    get_meta,
    merge_runs,
)

# ----------------------------------------------------------------------------------------
# Builders (vLLM 0.28 shapes)
# ----------------------------------------------------------------------------------------

NHD = (0, 2, 1, 3)  # stride order of the standard backends for the NHD cache layout
HND = (0, 1, 2, 3)


def new_backing(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A 1-D int8 allocation filled with reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=g)


def attn_page_bytes(block_size: int, heads: int, head: int, dtype: torch.dtype) -> int:
    """``AttentionSpec.page_size_bytes`` for K+V of one block."""
    return block_size * heads * 2 * head * torch.empty(0, dtype=dtype).element_size()


def attention_view(
    raw: torch.Tensor,
    num_blocks: int,
    *,
    block_size: int = 4,
    heads: int = 2,
    head: int = 3,
    dtype: torch.dtype = torch.float16,
    stride_order: tuple[int, ...] = NHD,
    ratio: int = 1,
    packing: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Blocks-first attention view ``(kernel_blocks, H, kernel_bs, 2*D)`` (CPU/flash/triton).

    Mirrors ``_reshape_attention_kv_cache``: the physical shape is the logical shape
    permuted by the stride order; a packed layout slices ``[:, offset:offset+page]`` out
    of ``raw.view(-1, block_stride)``.
    """
    kernel_bs = block_size // ratio
    shape = (num_blocks * ratio, heads, kernel_bs, 2 * head)
    physical = tuple(shape[i] for i in stride_order)
    inv = [stride_order.index(i) for i in range(len(stride_order))]
    if packing is not None:
        offset, block_stride = packing
        page = prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
        typed = raw.view(-1, block_stride)[:, offset : offset + page].view(dtype).view(physical)
    else:
        typed = raw.view(dtype).view(physical)
    return typed.permute(*inv)


def split_kv_view(
    raw: torch.Tensor,
    num_blocks: int,
    *,
    block_size: int = 4,
    heads: int = 2,
    head: int = 3,
    dtype: torch.dtype = torch.float16,
    hnd: bool = False,
    ratio: int = 1,
    v_offset_bytes: int | None = None,
) -> torch.Tensor:
    """Split K/V view ``(2, kernel_blocks, kbs, H, D)`` (ROCm; HND puts heads before tokens).

    With ``v_offset_bytes`` the V half starts that many bytes after K (a reserved gap,
    as in kvcached's split storage); otherwise K and V halves are adjacent as in vLLM.
    """
    kernel_bs = block_size // ratio
    inner = (heads, kernel_bs, head) if hnd else (kernel_bs, heads, head)
    shape = (2, num_blocks * ratio, *inner)
    typed = raw.view(dtype)
    if v_offset_bytes is None:
        return typed.view(shape)
    item = typed.element_size()
    assert v_offset_bytes % item == 0
    contiguous = torch.empty(shape, device="meta").stride()
    assert v_offset_bytes // item >= contiguous[0], "V half would overlap K"
    return torch.as_strided(typed, shape, (v_offset_bytes // item, *contiguous[1:]))


def restride_hybrid(kv: torch.Tensor) -> torch.Tensor:
    """``_update_hybrid_attention_mamba_layout``: ``(2, B, ...)`` -> K,V adjacent per block, in place."""
    hidden = kv.shape[2:].numel()
    kv.as_strided_(size=kv.shape, stride=(hidden, 2 * hidden, *kv.stride()[2:]))
    return kv


def mla_view(
    raw: torch.Tensor,
    num_blocks: int,
    *,
    block_size: int = 4,
    head: int = 5,
    dtype: torch.dtype = torch.float16,
    ratio: int = 1,
) -> torch.Tensor:
    """MLA single latent ``(kernel_blocks, kbs, head_size)``."""
    return raw.view(dtype).view(num_blocks * ratio, block_size // ratio, head)


def mamba_raw_view(
    raw: torch.Tensor, num_blocks: int, page: int, packing: tuple[int, int] | None = None
) -> torch.Tensor:
    """0.27+ raw Mamba page view ``[B, 1, 1, page]`` int8.

    vLLM slices ``raw[: B*page]``; in a packed backing kvcached keeps the block stride
    and layer offset instead (vLLM's own slice would be wrong there).
    """
    if packing is None:
        return raw[: num_blocks * page].view(num_blocks, 1, 1, page)
    offset, block_stride = packing
    return torch.as_strided(raw, (num_blocks, 1, 1, page), (block_stride, page, page, 1), offset)


def mamba_state_views(
    raw: torch.Tensor,
    num_blocks: int,
    page: int,
    shapes: Sequence[tuple[int, ...]] = ((2, 3), (3, 5)),
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.float32),
    packing: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """0.26 Mamba: list of typed ``as_strided`` states packed at the start of each page."""
    offset_bytes, block_stride = packing if packing is not None else (0, page)
    out = []
    for shape, dtype in zip(shapes, dtypes):
        item = torch.empty(0, dtype=dtype).element_size()
        target = (num_blocks, *shape)
        stride = torch.empty(target, device="meta").stride()
        assert block_stride % item == 0 and offset_bytes % item == 0
        out.append(
            torch.as_strided(
                raw.view(dtype),
                target,
                (block_stride // item, *stride[1:]),
                storage_offset=offset_bytes // item,
            )
        )
        offset_bytes += prod(shape) * item
    assert offset_bytes - (packing[0] if packing else 0) <= page
    return out


def mamba_states_bytes(
    shapes: Sequence[tuple[int, ...]] = ((2, 3), (3, 5)),
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.float32),
) -> int:
    return sum(prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))


@dataclass
class Layout:
    """A vLLM-style ``kv_caches`` list over one or more raw backings."""

    name: str
    num_blocks: int
    kv_caches: list  # tensors or lists of tensors
    backings: list[torch.Tensor]
    runs_per_batch: int  # (backing, run) copies one batch should issue
    notes: dict = field(default_factory=dict)


N = 7  # logical blocks in the fixed layouts (prime, larger than every other dim)
PAGE = attn_page_bytes(4, 2, 3, torch.float16)  # 96 bytes


def build_layouts() -> list[Layout]:
    """Every layout the copy path must handle, annotated."""
    layouts: list[Layout] = []

    # Per-KVCacheTensor allocations, one attention layer each (NHD / HND / kernel ratio 2).
    for name, kwargs in (
        ("nhd", {"stride_order": NHD}),
        ("hnd", {"stride_order": HND}),
        ("nhd_ratio2", {"stride_order": NHD, "ratio": 2}),
        ("hnd_ratio2", {"stride_order": HND, "ratio": 2}),
    ):
        raws = [new_backing(N * PAGE, seed=s) for s in (1, 2)]
        views = [attention_view(r, N, **kwargs) for r in raws]  # type: ignore[arg-type]
        layouts.append(Layout(name, N, views, raws, runs_per_batch=2))

    # Split K/V (ROCm): K and V halves adjacent, and with a reserved gap plus a tail
    # reserve (kvcached split storage: the backing is much bigger than the view).
    for name, kwargs, size in (
        ("split_nhd", {}, N * PAGE),
        ("split_hnd", {"hnd": True}, N * PAGE),
        ("split_ratio2", {"ratio": 2}, N * PAGE),
        ("split_gap", {"v_offset_bytes": 4096}, 8192 + 1024),
        ("split_gap_hnd_ratio2", {"v_offset_bytes": 1000, "hnd": True, "ratio": 2}, 3000),
    ):
        raw = new_backing(size, seed=3)
        layouts.append(Layout(name, N, [split_kv_view(raw, N, **kwargs)], [raw], runs_per_batch=2))  # type: ignore[arg-type]

    # Packed (block_stride > 0): group 0 has two attention layers at offsets 0 and PAGE,
    # group 1 an MLA layer at offset 0 (aliasing group 0's bytes) and a raw Mamba page
    # after it; the row has 16 bytes of tail padding no layer describes.
    mla_page = 4 * 5 * 2
    block_stride = 2 * PAGE + 16
    raw = new_backing(N * block_stride, seed=4)
    packed = [
        attention_view(raw, N, packing=(0, block_stride)),
        attention_view(raw, N, packing=(PAGE, block_stride), stride_order=HND),
        raw.view(-1, block_stride)[:, :mla_page].view(torch.float16).view(N, 4, 5),  # MLA
        mamba_raw_view(raw, N, 50, packing=(mla_page, block_stride)),
    ]
    layouts.append(Layout("packed", N, packed, [raw], runs_per_batch=1, notes={"uncovered_tail": 16}))

    # Packed 0.26 Mamba state list next to an attention layer.
    block_stride = PAGE + 80
    raw = new_backing(N * block_stride, seed=5)
    layouts.append(
        Layout(
            "packed_mamba026",
            N,
            [
                attention_view(raw, N, packing=(0, block_stride)),
                mamba_state_views(raw, N, 80, packing=(PAGE, block_stride)),
            ],
            [raw],
            runs_per_batch=1,
        )
    )

    # Cross-layer sharing: two layers of different groups use the same KVCacheTensor;
    # one entry is the same tensor object twice, the other an identical second view.
    raw = new_backing(N * PAGE, seed=6)
    v = attention_view(raw, N)
    layouts.append(Layout("shared_by", N, [v, v, attention_view(raw, N)], [raw], runs_per_batch=1))

    # MLA, ratio 1 and 2.
    for name, ratio in (("mla", 1), ("mla_ratio2", 2)):
        raw = new_backing(N * 4 * 5 * 2, seed=7)
        layouts.append(Layout(name, N, [mla_view(raw, N, ratio=ratio)], [raw], runs_per_batch=1))

    # Mamba 0.27+ raw page (padded page: the states use 72 of 96 bytes, the raw view
    # covers the whole page, so padding is copied like vLLM does).
    raw = new_backing(N * PAGE + 4096, seed=8)  # tail reserve beyond the view
    layouts.append(Layout("mamba_raw", N, [mamba_raw_view(raw, N, PAGE)], [raw], runs_per_batch=1))

    # Mamba 0.26 list of typed states inside a padded page: only the states' bytes are
    # described; the padding is never touched.
    raw = new_backing(N * PAGE, seed=9)
    layouts.append(
        Layout(
            "mamba026",
            N,
            [mamba_state_views(raw, N, PAGE)],
            [raw],
            runs_per_batch=1,
            notes={"uncovered_tail": PAGE - mamba_states_bytes()},
        )
    )

    # Hybrid attention + Mamba: each KVCacheTensor is shared by one attention layer and
    # one Mamba layer; split K/V attention is restrided in place to blocks-first.
    for name, ratio, legacy in (
        ("hybrid_split", 1, False),
        ("hybrid_split_ratio2", 2, False),
        ("hybrid_split_mamba026", 1, True),
    ):
        raws = [new_backing(N * PAGE, seed=10 + s) for s in range(2)]
        entries: list = []
        for r in raws:
            entries.append(restride_hybrid(split_kv_view(r, N, ratio=ratio)))
        for r in raws:
            entries.append(mamba_state_views(r, N, PAGE) if legacy else mamba_raw_view(r, N, PAGE))
        layouts.append(Layout(name, N, entries, raws, runs_per_batch=2))

    # Hybrid with a blocks-first backend (no restride needed) and kernel ratio 2.
    raws = [new_backing(N * PAGE, seed=20 + s) for s in range(2)]
    entries = [attention_view(r, N, ratio=2) for r in raws] + [mamba_raw_view(r, N, PAGE) for r in raws]
    layouts.append(Layout("hybrid_blocks_first", N, entries, raws, runs_per_batch=2))

    for lay in layouts:
        annotate(lay.kv_caches, lay.num_blocks)
    return layouts


def flat_views(kv_caches: list) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for e in kv_caches:
        out.extend([e] if isinstance(e, torch.Tensor) else e)
    return out


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rebase(view: torch.Tensor, backing: torch.Tensor) -> torch.Tensor:
    """The same geometry as ``view`` over ``backing``'s storage (a same-size clone).

    The element type becomes the integer of the same size, so copies move bit
    patterns exactly (random bytes include NaNs).
    """
    out = torch.empty(0, dtype=_INT_OF_SIZE[view.element_size()])
    return out.set_(backing.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def reference_copy(layout: Layout, copies: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Expected backings after the batch, computed with typed indexing per view.

    Reads come from untouched clones and writes go to separate clones, so aliasing views
    (shared layers, chained copies) get gather-then-scatter semantics.
    """
    src = [s for s, _ in copies]
    dst = [d for _, d in copies]
    before = {id(b): b.clone() for b in layout.backings}
    after = {id(b): b.clone() for b in layout.backings}
    for v in flat_views(layout.kv_caches):
        owner = next(b for b in layout.backings if b.untyped_storage().data_ptr() == v.untyped_storage().data_ptr())
        meta = get_meta(v)
        assert meta is not None
        bd = layout.notes.get("block_dims", {}).get(id(v))
        if bd is None:
            bd = block_dim_of(v, layout.num_blocks)
        r = meta.kernel_blocks_per_block
        old = rebase(v, before[id(owner)]).unflatten(bd, (layout.num_blocks, r)).movedim(bd, 0)
        new = rebase(v, after[id(owner)]).unflatten(bd, (layout.num_blocks, r)).movedim(bd, 0)
        if src:
            new[dst] = old[src]
    return [after[id(b)] for b in layout.backings]


def block_dim_of(view: torch.Tensor, num_blocks: int) -> int:
    dims = [d for d, s in enumerate(view.shape) if s >= num_blocks and s % num_blocks == 0]
    assert len(dims) == 1, (view.shape, num_blocks)
    return dims[0]


def covered_mask(layout: Layout, backing: torch.Tensor) -> torch.Tensor:
    """Bytes of ``backing`` that some view's metadata assigns to some block."""
    mask = torch.zeros(backing.numel(), dtype=torch.bool)
    base = backing.untyped_storage().data_ptr()
    for v in flat_views(layout.kv_caches):
        meta = get_meta(v)
        assert meta is not None
        if meta.backing_id != base:
            continue
        for b in range(meta.num_blocks):
            for off, n in meta.segments:
                start = meta.backing_offset + b * meta.block_stride + off
                mask[start : start + n] = True
    return mask


def typed_covered_mask(layout: Layout, backing: torch.Tensor) -> torch.Tensor:
    """Bytes of ``backing`` that some view's elements occupy (computed without metadata)."""
    mask = torch.zeros(backing.numel(), dtype=torch.bool)
    base = backing.untyped_storage().data_ptr()
    for v in flat_views(layout.kv_caches):
        if v.untyped_storage().data_ptr() != base:
            continue
        item = v.element_size()
        idx = torch.as_strided(torch.arange(backing.numel() // item), v.shape, v.stride(), v.storage_offset())
        starts = idx.reshape(-1) * item
        for k in range(item):
            mask[starts + k] = True
    return mask


LAYOUT_NAMES = [lay.name for lay in build_layouts()]


@pytest.fixture(params=LAYOUT_NAMES)
def layout(request: pytest.FixtureRequest) -> Layout:
    return next(lay for lay in build_layouts() if lay.name == request.param)


# ----------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------


def _check_invariants(meta: BytePageMeta) -> None:
    segs = meta.segments
    assert segs and segs[0][0] == 0
    assert all(n > 0 for _, n in segs)
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(segs)), "sorted, merged"
    assert meta.page_bytes == sum(n for _, n in segs)
    assert meta.block_stride > 0
    assert meta.layer_offset == meta.backing_offset % meta.block_stride
    check_block_disjoint(segs, meta.block_stride, meta.num_blocks)


def test_metadata_matches_element_footprint(layout: Layout) -> None:
    """The runs of all blocks are exactly the bytes the typed views occupy."""
    for backing in layout.backings:
        assert torch.equal(covered_mask(layout, backing), typed_covered_mask(layout, backing))
    for v in flat_views(layout.kv_caches):
        meta = get_meta(v)
        assert meta is not None
        _check_invariants(meta)
        assert meta.backing_id == v.untyped_storage().data_ptr()
        assert meta.backing_offset == v.data_ptr() - meta.backing_id


def test_attention_nhd_geometry() -> None:
    raw = new_backing(N * PAGE)
    v = attention_view(raw, N)
    assert tuple(v.shape) == (N, 2, 4, 6)
    assert v.stride() == (48, 6, 12, 1)  # physical (B, bs, H, 2D), permuted back to (B, H, bs, 2D)
    meta = describe_block_view(v, N)
    assert meta == BytePageMeta(
        backing_id=raw.untyped_storage().data_ptr(),
        backing_offset=0,
        layer_offset=0,
        block_stride=PAGE,
        page_bytes=PAGE,
        segments=((0, PAGE),),
        num_blocks=N,
        kernel_blocks_per_block=1,
    )


def test_split_kv_excludes_gap() -> None:
    raw = new_backing(9000)
    v = split_kv_view(raw, N, v_offset_bytes=4096)
    meta = describe_block_view(v, N)
    half = PAGE // 2
    assert meta.block_stride == half
    assert meta.segments == ((0, half), (4096, half))
    assert meta.page_bytes == PAGE
    # adjacent halves (vLLM's own ROCm layout): V starts N * half bytes after K
    meta2 = describe_block_view(split_kv_view(raw[: N * PAGE], N), N)
    assert meta2.segments == ((0, half), (N * half, half))


def test_kernel_ratio_two() -> None:
    raw = new_backing(N * PAGE)
    v = attention_view(raw, N, ratio=2)
    assert v.shape[0] == 2 * N
    meta = describe_block_view(v, N)
    assert meta.kernel_blocks_per_block == 2
    assert meta.block_stride == PAGE and meta.segments == ((0, PAGE),)
    s = describe_block_view(split_kv_view(raw, N, ratio=2), N)
    assert s.block_stride == PAGE // 2 and s.segments == ((0, PAGE // 2), (N * PAGE // 2, PAGE // 2))


def test_hybrid_restride_is_one_page() -> None:
    raw = new_backing(N * PAGE)
    kv = split_kv_view(raw, N)
    before = describe_block_view(kv, N)
    assert len(before.segments) == 2
    restride_hybrid(kv)
    after = describe_block_view(kv, N)
    assert after.block_stride == PAGE and after.segments == ((0, PAGE),)


def test_packed_layer_offsets() -> None:
    block_stride = 2 * PAGE + 16
    raw = new_backing(N * block_stride)
    a = describe_block_view(attention_view(raw, N, packing=(0, block_stride)), N)
    b = describe_block_view(attention_view(raw, N, packing=(PAGE, block_stride)), N)
    m = describe_block_view(mamba_raw_view(raw, N, 50, packing=(40, block_stride)), N)
    assert (a.layer_offset, a.backing_offset, a.block_stride) == (0, 0, block_stride)
    assert (b.layer_offset, b.backing_offset, b.segments) == (PAGE, PAGE, ((0, PAGE),))
    assert (m.layer_offset, m.block_stride, m.segments) == (40, block_stride, ((0, 50),))


def test_mamba026_states() -> None:
    raw = new_backing(N * PAGE)
    conv, ssm = mamba_state_views(raw, N, PAGE)
    mc, ms = describe_block_view(conv, N), describe_block_view(ssm, N)
    assert (mc.block_stride, mc.segments, mc.layer_offset) == (PAGE, ((0, 12),), 0)
    assert (ms.block_stride, ms.segments, ms.layer_offset) == (PAGE, ((0, 60),), 12)


def test_mamba_raw_packed_matches_bind_unpacking() -> None:
    """The strided raw page still unpacks like ``MambaBase.bind_kv_cache`` expects."""
    block_stride = 256
    raw = new_backing(N * block_stride)
    page = mamba_raw_view(raw, N, 72, packing=(32, block_stride))
    pages = page.squeeze(dim=(1, 2))
    conv = pages[:, 0:12].view(torch.float16).view(-1, 2, 3)
    ssm = pages[:, 12:72].view(torch.float32).view(-1, 3, 5)
    legacy = mamba_state_views(raw, N, 72, packing=(32, block_stride))
    # random bytes include NaNs, so compare geometry rather than values
    for got, want in ((conv, legacy[0]), (ssm, legacy[1])):
        assert (got.data_ptr(), got.shape, got.stride(), got.dtype) == (
            want.data_ptr(),
            want.shape,
            want.stride(),
            want.dtype,
        )


def test_block_dim_ambiguity_and_hint() -> None:
    raw = new_backing(4 * 4 * 5 * 2)
    v = raw.view(torch.float16).view(4, 4, 5)  # MLA with num_blocks == block_size
    with pytest.raises(CopyValidationError, match="ambiguous"):
        describe_block_view(v, 4)
    meta = describe_block_view(v, 4, block_dim=0)
    assert meta.block_stride == 40 and meta.segments == ((0, 40),)
    # dim 1 is also block-strided geometrically: the hint decides
    meta1 = describe_block_view(v, 4, block_dim=1)
    assert meta1.block_stride == 10 and len(meta1.segments) == 4
    with pytest.raises(CopyValidationError, match="not a multiple"):
        describe_block_view(v, 4, block_dim=2)
    with pytest.raises(ValueError, match="out of range"):
        describe_block_view(v, 4, block_dim=3)
    with pytest.raises(ValueError, match="positive"):
        describe_block_view(v, 0)
    with pytest.raises(CopyValidationError, match="no dimension"):
        describe_block_view(v, 3)


def test_rejects_overlapping_blocks() -> None:
    raw = new_backing(1024)
    # blocks 8 bytes apart but 16 bytes long
    v = torch.as_strided(raw, (N, 16), (8, 1))
    with pytest.raises(CopyValidationError, match="overlap"):
        describe_block_view(v, N)
    # zero block stride (expanded block dim)
    e = raw[:16].unsqueeze(0).expand(N, 16)
    with pytest.raises(CopyValidationError, match="stride 0"):
        describe_block_view(e, N)
    # split halves too close: V of block b is K of block b + 2
    s = torch.as_strided(raw, (2, N, 4), (8, 4, 1))
    with pytest.raises(CopyValidationError, match="overlap"):
        describe_block_view(s, N)
    with pytest.raises(CopyValidationError, match="empty"):
        describe_block_view(raw[:0].view(0, 1), N)


def test_stride_zero_inner_dim_is_deduplicated() -> None:
    raw = new_backing(N * 8)
    v = torch.as_strided(raw, (N, 3, 8), (8, 0, 1))  # broadcast inner dim: same 8 bytes
    meta = describe_block_view(v, N)
    assert meta.segments == ((0, 8),) and meta.page_bytes == 8


def test_merge_runs() -> None:
    assert merge_runs([(10, 5), (0, 4), (4, 2), (12, 1), (30, 0)]) == ((0, 6), (10, 5))
    assert merge_runs([]) == ()


def test_check_block_disjoint_modular_cases() -> None:
    check_block_disjoint(((0, 4), (28, 4)), 4, 7)  # split halves exactly N strides apart
    with pytest.raises(CopyValidationError):
        check_block_disjoint(((0, 4), (24, 4)), 4, 7)  # V of block 0 is K of block 6
    check_block_disjoint(((0, 4), (24, 4)), 4, 6)  # ... unless there is no block 6
    with pytest.raises(CopyValidationError):
        check_block_disjoint(((0, 5),), 4, 2)
    check_block_disjoint(((0, 5),), 4, 1)
    with pytest.raises(CopyValidationError):
        check_block_disjoint(((0, 1),), 0, 2)


def test_attach_get_meta() -> None:
    raw = new_backing(N * PAGE)
    v = attention_view(raw, N)
    assert get_meta(v) is None
    meta = describe_block_view(v, N)
    attach_meta(v, meta)
    assert get_meta(v) is meta
    # a different view object has its own (absent) metadata
    assert get_meta(attention_view(raw, N)) is None
    other = new_backing(N * PAGE)
    with pytest.raises(ValueError, match="backing_id"):
        attach_meta(attention_view(other, N), meta)


def test_restride_after_attach_is_detected() -> None:
    raw = new_backing(N * PAGE)
    kv = split_kv_view(raw, N)
    annotate([kv], N)
    restride_hybrid(kv)
    with pytest.raises(CopyValidationError, match="geometry changed"):
        get_meta(kv)
    annotate([kv], N)  # re-annotating after the restride is the fix
    meta = get_meta(kv)
    assert meta is not None and meta.segments == ((0, PAGE),)


def test_annotate_lists_and_atomicity() -> None:
    raw = new_backing(N * PAGE)
    states = mamba_state_views(raw, N, PAGE)
    bad = torch.zeros(4, 6)
    entries = [attention_view(new_backing(N * PAGE), N), states, [bad]]
    with pytest.raises(CopyValidationError, match=r"kv_caches\[2\]\[0\]"):
        annotate(entries, N)
    assert all(get_meta(t) is None for t in flat_views(entries[:2]))  # nothing attached
    metas = annotate(entries[:2], N)
    assert len(metas) == 3
    assert [m.layer_offset for m in metas[1:]] == [0, 12]
