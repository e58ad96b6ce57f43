"""Worker allocation seam of vLLM 0.29 (``allocate_kv_cache``) over real virtual ranges.

vLLM 0.29 allocates one backing buffer and carves ``[B, H, N, C]`` views out of it
(``create_kv_cache_views``). kvcached's seam runs vLLM's own function on the meta device,
backs each region of overlapping views with a virtual range and rebuilds the views there.
Every test compares against vLLM's own ``allocate_kv_cache`` on ordinary memory: same
layer names, shapes, strides, dtypes and offsets inside each region, and the same bytes
after a block copy (vLLM's copy on its allocation, kvcached's on kvcached's). No engine is
started. Skipped on vLLM series that allocate in runner methods (0.26-0.28).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from worker_env import registered_space, worker_installed

from kvcached import space
from kvcached.copy import copy_stats, reset_copy_stats
from kvcached.errors import IntegrationError
from kvcached.integration.vllm import allocation, rank_kv, worker
from kvcached.integration.vllm.capabilities import detect
from kvcached.views import get_meta

CAPS = detect()
if not CAPS.allocate_kv_cache:
    pytest.skip("this vLLM allocates KV tensors in runner methods (see test_worker_alloc)", allow_module_level=True)
pytest.importorskip("kvcached._vmm", reason="native extension not built")

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker import gpu_model_runner, utils

N = 13  # blocks: a layer slot of 13 KiB is not a whole number of 4 KiB pages
BS = 16  # tokens per block
PAGE_SIZE = 4096  # VMM page: 4 attention blocks per kv page
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)
P = ATTN.page_size_bytes  # 1024
CPU = torch.device("cpu")
INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with worker_installed(monkeypatch, PAGE_SIZE):
        yield


def tensor(spec: Any, layers: list[str], layout: KVCacheLayout, size: int, *, block_stride: int | None = None,
           offset: int = 0) -> KVCacheTensor:
    """A KVCacheTensor as vLLM's get_kv_cache_config_from_groups places it."""
    layer_stride, stride, *_ = compute_layout_strides(spec, N, len(layers), layout,
                                                      fixed_strides=(None, block_stride, None, None, None))
    return KVCacheTensor(size=size, layers=layers, layer_stride=layer_stride, block_stride=stride, offset=offset)


def build(config: KVCacheConfig, layout: KVCacheLayout, kernel_block_sizes: list[int] | None = None,
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], space.KvSpace]:
    """kvcached's allocation through the patched name, vLLM's on ordinary memory, the space."""
    native = utils.allocate_kv_cache(config, CPU, layout, kernel_block_sizes)
    kv = gpu_model_runner.allocate_kv_cache(config, CPU, layout, kernel_block_sizes)
    published = registered_space(next(iter(kv.values()))) if kv else None
    assert published is not None and published.premapped == {rank_kv.NULL_BLOCK_PAGE}
    assert published.config is not None and published.config.page_size == published.geometry.page_size
    bases = {r.address for r in published.ranges}
    assert kv.keys() == native.keys()
    for name, t in kv.items():
        ref = native[name]
        assert (t.shape, t.stride(), t.dtype) == (ref.shape, ref.stride(), ref.dtype), name
        assert t.untyped_storage().data_ptr() in bases
        meta = get_meta(t)
        assert meta is not None and meta.num_blocks == config.num_blocks
    vmm = published.geometry.vmm_pages
    assert [r.mapped_pages() for r in published.ranges] == [list(range(k)) for k in vmm]  # null block's page
    return kv, native, published


def region_offsets(kv: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: t.data_ptr() - t.untyped_storage().data_ptr() for n, t in kv.items()}


def map_blocks(published: space.KvSpace, blocks: set[int]) -> None:
    g = published.geometry
    for p in sorted({b // g.blocks_per_page for b in blocks} - published.premapped):
        published.page_space().map_pages([p])


def check_copy(kv: dict[str, torch.Tensor], native: dict[str, torch.Tensor], published: space.KvSpace,
               copies: list[tuple[int, int]], runs: int) -> None:
    """Same data in the touched blocks of both allocations; copy; same bytes afterwards."""
    touched = sorted({b for pair in copies for b in pair})
    map_blocks(published, set(touched))
    gen = torch.Generator().manual_seed(0)
    for name, view in kv.items():  # same writes in the same order on both sides (overlaid views included)
        ratio = view.shape[0] // N
        ints = view.view(INTS[view.element_size()])
        for b in touched:
            rows = slice(b * ratio, (b + 1) * ratio)
            data = torch.randint(-100, 100, ints[rows].shape, generator=gen, dtype=ints.dtype)
            ints[rows] = data
            native[name].view(ints.dtype)[rows] = data
    batch = [KVCacheBlockCopy(s, d) for s, d in copies]
    reset_copy_stats()
    gpu_model_runner.copy_kv_cache_blocks_inplace(list(kv.values()), N, batch)
    assert copy_stats().runs_copied == runs and copy_stats().block_copies == len(copies)
    utils.copy_kv_cache_blocks_inplace(list(native.values()), N, batch)
    for name, view in kv.items():
        ratio = view.shape[0] // N
        ints, ref = view.view(INTS[view.element_size()]), native[name].view(INTS[view.element_size()])
        for b in touched:
            rows = slice(b * ratio, (b + 1) * ratio)
            assert torch.equal(ints[rows], ref[rows]), (name, b)


def test_layer_outer_layout_one_range_per_layer_slot() -> None:
    """LBHNC (the CPU backend's only layout): each layer's region becomes its own range."""
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0", "l1"], layout, 2 * N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)])
    kv, native, published = build(config, layout)
    assert len(published.ranges) == 2 and published.geometry.strides == (P, P)
    assert published.geometry.blocks_per_page == 4
    assert region_offsets(kv) == {"l0": 0, "l1": 0}  # vLLM: l1 at N*P, a range of its own here
    assert region_offsets(native) == {"l0": 0, "l1": N * P}
    v = kv["l0"]
    assert tuple(v.shape) == (N, 2, BS, 16) and v.dtype == torch.float16  # [B, H, N, C]
    meta = get_meta(v)
    assert meta is not None and meta.segments == ((0, P),) and meta.block_stride == P
    check_copy(kv, native, published, [(1, 9), (9, 1), (2, 12)], runs=2)


def test_hybrid_attention_and_padded_mamba_overlay() -> None:
    """Two groups overlay each layer slot: attention [B,H,N,C] and a raw [B,1,1,C] Mamba page."""
    layout = KVCacheLayout.LBHNC
    mamba = MambaSpec(block_size=BS, shapes=((2, 3), (3, 5)), dtypes=(torch.float16, torch.float32),
                      page_size_padded=P)
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[tensor(ATTN, ["a0", "a1"], layout, 2 * N * P),
                          tensor(mamba, ["m0", "m1"], layout, 2 * N * P)],
        kv_cache_groups=[KVCacheGroupSpec(["a0", "a1"], ATTN), KVCacheGroupSpec(["m0", "m1"], mamba)],
    )
    kv, native, published = build(config, layout)
    assert len(published.ranges) == 2
    assert kv["a0"].untyped_storage().data_ptr() == kv["m0"].untyped_storage().data_ptr()
    assert kv["a1"].untyped_storage().data_ptr() == kv["m1"].untyped_storage().data_ptr()
    m = kv["m0"]
    assert tuple(m.shape) == (N, 1, 1, 72) and m.dtype == torch.int8 and m.stride(0) == P
    meta = get_meta(m)
    assert meta is not None and meta.segments == ((0, 72),) and meta.block_stride == P
    check_copy(kv, native, published, [(5, 10), (3, 0)], runs=2)  # each slot's runs once


def test_block_outer_layout_is_one_range() -> None:
    """BLHNC: every block holds all layers' pages; the whole buffer is one block-strided range."""
    layout = KVCacheLayout.BLHNC
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[tensor(ATTN, ["l0", "l1"], layout, 2 * N * P, block_stride=2 * P)],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)],
    )
    kv, native, published = build(config, layout)
    assert len(published.ranges) == 1 and published.geometry.strides == (2 * P,)
    assert region_offsets(kv) == region_offsets(native) == {"l0": 0, "l1": P}
    m0, m1 = get_meta(kv["l0"]), get_meta(kv["l1"])
    assert m0 is not None and m1 is not None and (m0.layer_offset, m1.layer_offset) == (0, P)
    check_copy(kv, native, published, [(0, 11), (7, 4)], runs=1)  # interleaved layers: one run


def test_kernel_blocks_split_a_logical_block() -> None:
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    kv, native, published = build(config, layout, kernel_block_sizes=[BS // 2])
    assert kv["l0"].shape[0] == 2 * N
    meta = get_meta(kv["l0"])
    assert meta is not None and meta.kernel_blocks_per_block == 2 and meta.block_stride == P
    check_copy(kv, native, published, [(3, 8)], runs=1)


def test_head_outer_layout_is_refused() -> None:
    """LHBNC puts a block's heads a whole head plane apart: no block row kvcached could map."""
    layout = KVCacheLayout.LHBNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    with pytest.raises(IntegrationError, match="own row"):
        gpu_model_runner.allocate_kv_cache(config, CPU, layout, None)
    assert not rank_kv.registered_rank_kv()


def test_profiling_allocation_is_plain_memory() -> None:
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    mark = allocation._wrap_profiling(lambda self: gpu_model_runner.allocate_kv_cache(config, CPU, layout, None))
    kv = mark(object())
    assert not rank_kv.registered_rank_kv()  # nothing published
    assert get_meta(kv["l0"]) is None and torch.count_nonzero(kv["l0"]) == 0  # vLLM's torch.zeros


def test_disabled_is_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    worker.uninstall()
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    worker.install(CAPS)
    assert gpu_model_runner.allocate_kv_cache is not utils.allocate_kv_cache
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0", "l1"], layout, 2 * N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)])
    kv = gpu_model_runner.allocate_kv_cache(config, CPU, layout, None)
    assert not rank_kv.registered_rank_kv()
    assert kv["l0"].untyped_storage().data_ptr() == kv["l1"].untyped_storage().data_ptr()  # one buffer
    assert kv["l0"].untyped_storage().nbytes() == 2 * N * P and get_meta(kv["l0"]) is None
