"""Tests for kvcached.copy.copy_blocks against typed-view references.

Layouts come from tests/test_views.py (vLLM 0.28 shapes). Every test compares the whole
backing, so bytes outside the described runs (split K/V gaps, Mamba padding, packed
tail padding, reserve past the view) must come out unchanged.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_views import (  # the path above makes test_views importable under every import mode
    LAYOUT_NAMES,
    PAGE,
    Layout,
    attention_view,
    build_layouts,
    covered_mask,
    flat_views,
    new_backing,
    reference_copy,
    restride_hybrid,
    split_kv_view,
)

from kvcached.copy import copy_blocks, copy_stats, parse_copies, reset_copy_stats
from kvcached.errors import CopyValidationError
from kvcached.views import BytePageMeta, annotate, attach_meta, describe_block_view

REPO = Path(__file__).resolve().parents[1]


class KVCacheBlockCopy(NamedTuple):
    """Same field names as vLLM's ``v1.core.kv_cache_utils.KVCacheBlockCopy``."""

    src_block_id: int
    dst_block_id: int


# A chain (1->3->5), a swap (0<->6) and a self copy: gather-then-scatter matters.
BATCH = [(1, 3), (3, 5), (0, 6), (6, 0), (2, 2)]


@pytest.fixture(params=LAYOUT_NAMES)
def layout(request: pytest.FixtureRequest) -> Layout:
    return next(lay for lay in build_layouts() if lay.name == request.param)


def _snapshot(lay: Layout) -> list[torch.Tensor]:
    return [b.clone() for b in lay.backings]


def _assert_unchanged(lay: Layout, before: list[torch.Tensor]) -> None:
    for b, old in zip(lay.backings, before):
        assert torch.equal(b, old), f"{lay.name}: backing modified by a rejected batch"


def test_copy_counters_are_public_api_and_import_kvcached_stays_cheap() -> None:
    import kvcached

    layout = build_layouts()[0]
    reset_copy_stats()
    copy_blocks(layout.kv_caches, layout.num_blocks, [KVCacheBlockCopy(s, d) for s, d in BATCH])
    assert "copy_stats" in kvcached.__all__
    public = kvcached.copy_stats()
    assert public == copy_stats() and (public.batches, public.block_copies) == (1, len(BATCH))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import kvcached
        print(sorted(m for m in ("torch", "vllm", "kvcached.copy") if m in sys.modules))
        print(kvcached.copy_stats(), "torch" in sys.modules)
    """)], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[]", "CopyStats(batches=0, block_copies=0, runs_copied=0) False"]


def test_copy_matches_reference(layout: Layout) -> None:
    before = _snapshot(layout)
    expected = reference_copy(layout, BATCH)
    reset_copy_stats()
    runs = copy_blocks(layout.kv_caches, layout.num_blocks, [KVCacheBlockCopy(s, d) for s, d in BATCH])
    assert runs == layout.runs_per_batch
    assert copy_stats().runs_copied == layout.runs_per_batch
    assert copy_stats().block_copies == len(BATCH) and copy_stats().batches == 1
    for b, want, old in zip(layout.backings, expected, before):
        assert torch.equal(b, want), layout.name
        outside = ~covered_mask(layout, b)
        assert torch.equal(b[outside], old[outside])
        assert not torch.equal(b, old), "the batch should have changed something"
    tail = layout.notes.get("uncovered_tail")
    if tail:  # padding at the end of every block row is never written
        stride = next(
            m for m in (describe_block_view(v, layout.num_blocks) for v in flat_views(layout.kv_caches))
        ).block_stride
        rows_now = layout.backings[0][: layout.num_blocks * stride].view(layout.num_blocks, stride)
        rows_old = before[0][: layout.num_blocks * stride].view(layout.num_blocks, stride)
        assert torch.equal(rows_now[:, -tail:], rows_old[:, -tail:])


def test_all_layouts_in_one_batch() -> None:
    """A model-like kv_caches list spanning every layout: each backing copied once per run."""
    layouts = build_layouts()
    merged = Layout(
        "all",
        layouts[0].num_blocks,
        [e for lay in layouts for e in lay.kv_caches],
        [b for lay in layouts for b in lay.backings],
        runs_per_batch=sum(lay.runs_per_batch for lay in layouts),
    )
    expected = reference_copy(merged, BATCH)
    assert copy_blocks(merged.kv_caches, merged.num_blocks, BATCH) == merged.runs_per_batch
    for b, want in zip(merged.backings, expected):
        assert torch.equal(b, want)


def test_shared_backing_copied_once() -> None:
    lay = next(x for x in build_layouts() if x.name == "shared_by")
    assert len(flat_views(lay.kv_caches)) == 3
    reset_copy_stats()
    assert copy_blocks(lay.kv_caches, lay.num_blocks, [(0, 1)]) == 1
    assert copy_stats().runs_copied == 1
    packed = next(x for x in build_layouts() if x.name == "packed")
    assert copy_blocks(packed.kv_caches, packed.num_blocks, [(0, 1)]) == 1  # 4 layers, 1 run


def test_chain_semantics_are_gather_then_scatter() -> None:
    raw = torch.arange(7 * 4, dtype=torch.int32).view(torch.int8).clone()  # 16-byte blocks
    rows = raw.view(7, 16)
    annotate([rows], 7)
    copy_blocks([rows], 7, [(0, 1), (1, 2), (2, 0)])
    as_ints = raw.view(torch.int32).view(7, 4)[:, 0].tolist()
    assert as_ints[:3] == [8, 0, 4]  # rotated using the values from before the batch


def test_empty_batch_is_a_no_op() -> None:
    lay = build_layouts()[0]
    before = _snapshot(lay)
    reset_copy_stats()
    assert copy_blocks(lay.kv_caches, lay.num_blocks, []) == 0
    assert copy_stats().batches == 0
    _assert_unchanged(lay, before)


def test_parse_copies_accepts_pairs_and_named_tuples() -> None:
    import numpy as np

    srcs, dsts = parse_copies([KVCacheBlockCopy(1, 2), (3, 4), [np.int64(5), 6]], 7)
    assert (srcs, dsts) == ([1, 3, 5], [2, 4, 6])


def _meta_with(meta: BytePageMeta, **changes: int) -> BytePageMeta:
    fields = {f: getattr(meta, f) for f in BytePageMeta.__slots__}  # type: ignore[attr-defined]
    fields.update(changes)
    return BytePageMeta(**fields)


BAD_BATCHES = {
    "src_out_of_range": ([(7, 1)], "out of range"),
    "dst_out_of_range": ([(0, 100)], "out of range"),
    "negative": ([(0, 1), (-1, 2)], "out of range"),
    "duplicate_dst": ([(0, 1), (2, 1)], "appears twice"),
    "bool_id": ([(True, 1)], "bool"),
    "float_id": ([(1.0, 2)], "not an integer"),
    "not_a_pair": ([(1, 2, 3)], "expected"),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batches_write_nothing(case: str) -> None:
    copies, match = BAD_BATCHES[case]
    for lay in build_layouts():
        before = _snapshot(lay)
        # the good pair first: validation must happen before any copy
        with pytest.raises(CopyValidationError, match=match):
            copy_blocks(lay.kv_caches, lay.num_blocks, [(0, 5), *copies])
        _assert_unchanged(lay, before)


def test_missing_metadata_names_position() -> None:
    lay = next(x for x in build_layouts() if x.name == "hybrid_split_mamba026")
    lay.kv_caches[3].append(attention_view(new_backing(7 * PAGE), 7))
    before = _snapshot(lay)
    with pytest.raises(CopyValidationError, match=r"kv_caches\[3\]\[2\] has no byte-page"):
        copy_blocks(lay.kv_caches, 7, [(0, 1)])
    _assert_unchanged(lay, before)
    with pytest.raises(CopyValidationError, match="not a tensor"):
        copy_blocks([lay.kv_caches[0], "x"], 7, [(0, 1)])


def test_wrong_num_blocks() -> None:
    lay = build_layouts()[0]
    before = _snapshot(lay)
    with pytest.raises(CopyValidationError, match="describes 7 blocks"):
        copy_blocks(lay.kv_caches, 14, [(0, 1)])
    _assert_unchanged(lay, before)


def test_block_stride_disagreement_on_shared_backing() -> None:
    raw = new_backing(7 * PAGE)
    a, b = attention_view(raw, 7), attention_view(raw, 7)
    meta = describe_block_view(a, 7)
    attach_meta(a, meta)
    attach_meta(
        b,
        _meta_with(
            meta,
            block_stride=PAGE // 2,
            segments=((0, PAGE // 2),),  # type: ignore[arg-type]
            page_bytes=PAGE // 2,
        ),
    )
    before = raw.clone()
    with pytest.raises(CopyValidationError, match="disagree on the block stride"):
        copy_blocks([a, b], 7, [(0, 1)])
    assert torch.equal(raw, before)


def test_views_disagreeing_on_block_boundaries() -> None:
    """Two views of one backing, the second shifted by one block: block b of one is b+1 of the other."""
    raw = new_backing(8 * PAGE)
    a = attention_view(raw[: 7 * PAGE], 7)
    b = attention_view(raw[PAGE:], 7)
    annotate([a, b], 7)
    before = raw.clone()
    with pytest.raises(CopyValidationError, match="disagree on block boundaries"):
        copy_blocks([a, b], 7, [(0, 1)])
    assert torch.equal(raw, before)


def test_overlapping_distinct_storages_rejected() -> None:
    import numpy as np

    arr = np.random.default_rng(0).integers(-128, 127, 8 * PAGE, dtype=np.int8)
    a = attention_view(torch.from_numpy(arr[: 7 * PAGE]), 7)
    b = attention_view(torch.from_numpy(arr[PAGE:]), 7)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    annotate([a, b], 7)
    before = arr.copy()
    with pytest.raises(CopyValidationError, match="overlapping addresses"):
        copy_blocks([a, b], 7, [(0, 1)])
    assert (arr == before).all()


def test_restrided_after_annotation_rejected() -> None:
    raw = new_backing(7 * PAGE)
    kv = split_kv_view(raw, 7)
    annotate([kv], 7)
    restride_hybrid(kv)
    before = raw.clone()
    with pytest.raises(CopyValidationError, match="geometry changed"):
        copy_blocks([kv], 7, [(0, 1)])
    assert torch.equal(raw, before)


def test_stats_are_thread_safe() -> None:
    layouts = build_layouts()[:4]
    reset_copy_stats()

    def work(lay: Layout) -> None:
        for _ in range(25):
            copy_blocks(lay.kv_caches, lay.num_blocks, [(0, 1), (2, 3)])

    with ThreadPoolExecutor(max_workers=4) as pool:
        for fut in [pool.submit(work, lay) for lay in layouts]:
            fut.result()  # re-raises a worker's exception here
    stats = copy_stats()
    assert stats.batches == 100 and stats.block_copies == 200
    assert stats.runs_copied == 25 * sum(lay.runs_per_batch for lay in layouts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_split_and_hybrid() -> None:
    for lay in build_layouts():
        dev = [b.cuda() for b in lay.backings]
        # rebuild the same views over the device copies
        kv: list = []
        for e in lay.kv_caches:
            ts = [e] if isinstance(e, torch.Tensor) else e
            moved = []
            for t in ts:
                i = next(
                    k
                    for k, b in enumerate(lay.backings)
                    if b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                )
                moved.append(
                    torch.empty(0, dtype=t.dtype, device="cuda").set_(
                        dev[i].untyped_storage(), t.storage_offset(), t.shape, t.stride()
                    )
                )
            kv.append(moved[0] if isinstance(e, torch.Tensor) else moved)
        annotate(kv, lay.num_blocks)
        expected = reference_copy(lay, BATCH)
        copy_blocks(kv, lay.num_blocks, BATCH)
        torch.cuda.synchronize()
        for d, want in zip(dev, expected):
            assert torch.equal(d.cpu(), want), lay.name


# ----------------------------------------------------------------------------------------
# Unmapped memory: the copy must never touch bytes outside the described runs
# ----------------------------------------------------------------------------------------

_GUARD_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import torch
    from kvcached.copy import copy_blocks
    from kvcached.views import annotate

    PG = mmap.PAGESIZE
    N = 8
    mm = mmap.mmap(-1, 6 * PG)  # K: page 0 | gap: pages 1-2 | V: page 3 | reserve: pages 4-5
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    buf[:PG] = torch.randint(0, 256, (PG,), dtype=torch.uint8, generator=g)
    buf[3 * PG : 4 * PG] = torch.randint(0, 256, (PG,), dtype=torch.uint8, generator=g)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, n in ((PG, 2 * PG), (4 * PG, 2 * PG)):
        assert libc.mprotect(buf.data_ptr() + start, n, 0) == 0, ctypes.get_errno()  # PROT_NONE
    half = PG // N // 2  # fp16 elements per block half
    kv = torch.as_strided(buf.view(torch.float16), (2, N, half), (3 * PG // 2, half, 1))
    k_old = buf[:PG].clone().view(N, -1)
    v_old = buf[3 * PG : 4 * PG].clone().view(N, -1)
    if sys.argv[1] == "native":
        # vLLM 0.28's algorithm: the whole storage as num_blocks rows (reads the gap)
        rows = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage()).view(N, -1)
        rows[torch.tensor([1])] = rows[torch.tensor([0])]
    else:
        annotate([kv], N, block_dim=1)
        copies = [(0, 5), (5, 7), (3, 0)]
        assert copy_blocks([kv], N, copies) == 2
        for old, now in ((k_old, buf[:PG].view(N, -1)), (v_old, buf[3 * PG : 4 * PG].view(N, -1))):
            want = old.clone()
            want[[d for _, d in copies]] = old[[s for s, _ in copies]]
            assert torch.equal(now, want)
    print("OK")
    """
)


def _run_guard(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _GUARD_SCRIPT, mode], check=False, cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs mprotect")
def test_never_touches_unmapped_gap_or_reserve() -> None:
    res = _run_guard("kvcached")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs mprotect")
def test_guard_harness_catches_whole_storage_copy() -> None:
    """Control: the native whole-storage row copy does fault on the same backing."""
    res = _run_guard("native")
    # Under AddressSanitizer (`nox -s sanitize`) its SEGV handler reports the fault and exits.
    faulted = res.returncode == -signal.SIGSEGV or "AddressSanitizer: SEGV" in res.stderr
    assert faulted and "OK" not in res.stdout, res.stderr


# ----------------------------------------------------------------------------------------
# Property test: random layouts and batches vs. the typed reference
# ----------------------------------------------------------------------------------------

_DTYPES = (torch.int8, torch.float16, torch.float32)


@st.composite
def random_layouts(draw: st.DrawFn) -> tuple[Layout, list[tuple[int, int]]]:
    nb = draw(st.integers(1, 6))
    ratio = draw(st.sampled_from([1, 2]))
    backings: list[torch.Tensor] = []
    entries: list = []
    block_dims: dict[int, int] = {}

    def add(view: torch.Tensor, bd: int) -> None:
        attach_meta(view, describe_block_view(view, nb, block_dim=bd))
        block_dims[id(view)] = bd
        entries.append(view)

    for a in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["packed", "split", "hybrid"]))
        dtype = draw(st.sampled_from(_DTYPES))
        item = torch.empty(0, dtype=dtype).element_size()
        heads, kbs, dim = (draw(st.integers(1, 3)) for _ in range(3))
        tail = 4 * draw(st.integers(0, 4))
        seed = draw(st.integers(0, 2**16))
        if kind == "packed":
            # kernel row: layers at 4-byte aligned offsets, then padding; a logical
            # block is `ratio` consecutive kernel rows.
            layers = draw(st.lists(st.sampled_from(["nhd", "hnd", "mla", "mamba"]), min_size=1, max_size=3))
            specs, off = [], 0
            for lk in layers:
                off += 4 * draw(st.integers(0, 2))
                nbytes = (
                    draw(st.integers(1, 9))
                    if lk == "mamba"
                    else (heads * kbs * 2 * dim if lk != "mla" else kbs * dim) * item
                )
                specs.append((lk, off, nbytes))
                off = -(-(off + nbytes) // 4) * 4
            row = off + 4 * draw(st.integers(0, 2))
            raw = new_backing(nb * ratio * row + tail, seed)
            typed = raw.view(dtype)
            ks = row // item  # kernel stride, elements
            for lk, o, nbytes in specs:
                if lk == "mamba":
                    add(torch.as_strided(raw, (nb, 1, 1, nbytes), (ratio * row, nbytes, nbytes, 1), o), 0)
                elif lk == "mla":
                    add(torch.as_strided(typed, (nb * ratio, kbs, dim), (ks, dim, 1), o // item), 0)
                elif lk == "nhd":  # logical (B, H, kbs, 2D) over physical (B, kbs, H, 2D)
                    add(
                        torch.as_strided(
                            typed, (nb * ratio, heads, kbs, 2 * dim), (ks, 2 * dim, heads * 2 * dim, 1), o // item
                        ),
                        0,
                    )
                else:
                    add(
                        torch.as_strided(
                            typed, (nb * ratio, heads, kbs, 2 * dim), (ks, kbs * 2 * dim, 2 * dim, 1), o // item
                        ),
                        0,
                    )
        else:
            hnd = draw(st.booleans())
            inner = (heads, kbs, dim) if hnd else (kbs, heads, dim)
            hidden = heads * kbs * dim  # elements per kernel block half
            inner_strides = torch.empty(inner, device="meta").stride()
            if kind == "split":
                gap = item * draw(st.integers(0, 5))
                v_off = nb * ratio * hidden * item + gap
                raw = new_backing(v_off + nb * ratio * hidden * item + tail, seed)
                add(
                    torch.as_strided(raw.view(dtype), (2, nb * ratio, *inner), (v_off // item, hidden, *inner_strides)),
                    1,
                )
            else:  # hybrid: restrided split attention + raw Mamba page on one KVCacheTensor
                page = 2 * ratio * hidden * item
                raw = new_backing(nb * page + tail, seed)
                add(torch.as_strided(raw.view(dtype), (2, nb * ratio, *inner), (hidden, 2 * hidden, *inner_strides)), 1)
                add(raw[: nb * page].view(nb, 1, 1, page), 0)
        backings.append(raw)
        if draw(st.booleans()):
            entries.append(entries[-1])  # cross-layer sharing: same view twice
    del a
    dsts = draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    copies = [(draw(st.integers(0, nb - 1)), d) for d in dsts]
    lay = Layout("random", nb, entries, backings, runs_per_batch=-1, notes={"block_dims": block_dims})
    return lay, copies


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_layouts())
def test_property_random_layouts(case: tuple[Layout, list[tuple[int, int]]]) -> None:
    lay, copies = case
    before = _snapshot(lay)
    expected = reference_copy(lay, copies)
    runs = copy_blocks(lay.kv_caches, lay.num_blocks, copies)
    assert runs >= (len(lay.backings) if copies else 0)
    for b, want, old in zip(lay.backings, expected, before):
        assert torch.equal(b, want)
        outside = ~covered_mask(lay, b)
        assert torch.equal(b[outside], old[outside])


# ----------------------------------------------------------------------------------------
# Real virtual ranges: only the pages of the touched blocks are mapped
# ----------------------------------------------------------------------------------------


def _vmm_layouts(raw: torch.Tensor) -> dict[str, list]:
    """kv_caches entries over one range's bytes (block stride 96 or 208; V half 64 KiB away)."""
    packed_stride = 2 * PAGE + 16
    return {
        "nhd_hnd_ratio2": [
            attention_view(raw[: 7 * PAGE], 7, ratio=2),
            attention_view(raw[: 7 * PAGE], 7, ratio=2, stride_order=(0, 1, 2, 3)),
        ],
        "split_gap_hnd_ratio2": [split_kv_view(raw, 7, hnd=True, ratio=2, v_offset_bytes=1 << 16)],
        "packed_interleaved": [
            attention_view(raw[: 7 * packed_stride], 7, packing=(0, packed_stride)),
            attention_view(raw[: 7 * packed_stride], 7, packing=(PAGE, packed_stride)),
        ],
        "hybrid_split_ratio2": [
            restride_hybrid(split_kv_view(raw[: 7 * PAGE], 7, ratio=2)),
            raw[: 7 * PAGE].view(7, 1, 1, PAGE),
        ],
    }


@pytest.mark.parametrize(
    "name", ["nhd_hnd_ratio2", "split_gap_hnd_ratio2", "packed_interleaved", "hybrid_split_ratio2"]
)
def test_copy_over_virtual_range_maps_only_touched_blocks(name: str) -> None:
    vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")
    from kvcached.memory import tensor_view

    page = vmm.os_page_size()
    vr = vmm.VirtualRange("cpu", 32 * page + (1 << 16), page)
    raw = tensor_view(vr, 0, vr.size, dtype=torch.int8)
    kv = _vmm_layouts(raw)[name]
    annotate(kv, 7)
    copies = [(0, 6), (6, 0), (3, 4)]
    touched = sorted({b for pair in copies for b in pair})
    pages: set[int] = set()
    for v in kv:
        meta = describe_block_view(v, 7)
        for b in touched:
            for off, n in meta.segments:
                start = meta.backing_offset + b * meta.block_stride + off
                pages.update(range(start // page, (start + n - 1) // page + 1))
    vr.map(sorted(pages))
    assert vr.num_mapped < vr.num_pages  # most of the range stays PROT_NONE
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    blocks = []
    for v in kv:
        bd = 1 if v.shape[0] == 2 else 0
        r = v.shape[bd] // 7
        blocks.append(v.view(int_dtype[v.element_size()]).unflatten(bd, (7, r)).movedim(bd, 0))
    gen = torch.Generator().manual_seed(1)
    for b in blocks:  # indexing reads and writes only the touched blocks
        b[touched] = torch.randint(-100, 100, b[touched].shape, generator=gen, dtype=b.dtype)
    old = [b[touched].clone() for b in blocks]
    copy_blocks(kv, 7, copies)
    result = dict(zip(touched, range(len(touched))))
    src_of = {d: s for s, d in copies}
    for b, o in zip(blocks, old):
        for blk in touched:
            assert torch.equal(b[blk], o[result[src_of.get(blk, blk)]]), (name, blk)
    vr.unmap(vr.mapped_pages())


def test_copy_fault_site_fails_after_validation_before_any_write(layout: Layout) -> None:
    """Fault site ``copy``: a valid batch fails on purpose with every backing untouched; an
    invalid one is still a `CopyValidationError` (validation comes first, and does not count as
    a check); an empty batch is no check; after the planned failure the same batch copies."""
    from kvcached.errors import InjectedFault
    from kvcached.faults import FaultInjector

    faults = FaultInjector.from_plans([{"site": "copy", "skip": 1, "fail_next": 1}])
    before = _snapshot(layout)
    with pytest.raises(CopyValidationError):
        copy_blocks(layout.kv_caches, layout.num_blocks, [(0, layout.num_blocks)], faults=faults)
    assert copy_blocks(layout.kv_caches, layout.num_blocks, [], faults=faults) == 0
    assert copy_blocks(layout.kv_caches, layout.num_blocks, [(2, 2)], faults=faults) == layout.runs_per_batch
    before = _snapshot(layout)
    with pytest.raises(InjectedFault, match="site 'copy'"):
        copy_blocks(layout.kv_caches, layout.num_blocks, BATCH, faults=faults)
    _assert_unchanged(layout, before)
    assert faults.fired("copy") == 1
    expected = reference_copy(layout, BATCH)
    copy_blocks(layout.kv_caches, layout.num_blocks, BATCH, faults=faults)  # the plan is spent
    for b, want in zip(layout.backings, expected):
        assert torch.equal(b, want)
