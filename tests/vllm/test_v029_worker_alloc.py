"""Worker allocation seam of vLLM 0.29 (``allocate_kv_cache``) over real virtual ranges.

vLLM 0.29 allocates one backing buffer and carves ``[B, H, N, C]`` views out of it
(``create_kv_cache_views``). kvcached's seam runs vLLM's own function on the meta device,
backs each region of overlapping views with a virtual range and rebuilds the views there.
Every test compares against vLLM's own ``allocate_kv_cache`` on ordinary memory: same
layer names, shapes, strides, dtypes and offsets inside each region, and the same bytes
after a block copy (vLLM's copy on its allocation, kvcached's on kvcached's). Each layout test
runs through Model Runner V1's names (``gpu_model_runner.allocate_kv_cache`` and its copy) and,
where kvcached serves V2 (0.29-0.32 on trial), through V2's (``gpu.attn_utils.allocate_kv_cache``,
``gpu.model_runner``'s copy), and V2's own ``init_kv_cache`` binds kvcached's views. No engine
is started. Skipped on vLLM series that allocate in runner methods (0.26-0.28).
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


class Runner:
    """A model runner's allocation and copy names, read when called (the seams replace them)."""

    def __init__(self, name: str, allocating: Any, copying: Any) -> None:
        self.name, self.allocating, self.copying = name, allocating, copying

    def allocate(self, *args: Any) -> dict[str, torch.Tensor]:
        return self.allocating.allocate_kv_cache(*args)  # type: ignore[no-any-return]

    def copy(self, *args: Any) -> None:
        self.copying.copy_kv_cache_blocks_inplace(*args)


def _runners() -> list[Runner]:
    runners = [Runner("V1", gpu_model_runner, gpu_model_runner)]
    if CAPS.model_runner_v2:
        from vllm.v1.worker.gpu import attn_utils, model_runner

        runners.append(Runner("V2", attn_utils, model_runner))
    return runners


@pytest.fixture(params=_runners(), ids=lambda r: r.name)
def runner(request: pytest.FixtureRequest) -> Runner:
    """The model runner whose names a layout test goes through."""
    return request.param  # type: ignore[no-any-return]


def tensor(spec: Any, layers: list[str], layout: KVCacheLayout, size: int, *, block_stride: int | None = None,
           offset: int = 0) -> KVCacheTensor:
    """A KVCacheTensor as vLLM's get_kv_cache_config_from_groups places it."""
    layer_stride, stride, *_ = compute_layout_strides(spec, N, len(layers), layout,
                                                      fixed_strides=(None, block_stride, None, None, None))
    return KVCacheTensor(size=size, layers=layers, layer_stride=layer_stride, block_stride=stride, offset=offset)


def build(config: KVCacheConfig, layout: KVCacheLayout, runner: Runner, kernel_block_sizes: list[int] | None = None,
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], space.KvSpace]:
    """kvcached's allocation through ``runner``'s patched name, vLLM's on ordinary memory, the space."""
    native = utils.allocate_kv_cache(config, CPU, layout, kernel_block_sizes)
    kv = runner.allocate(config, CPU, layout, kernel_block_sizes)
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
               copies: list[tuple[int, int]], runs: int, runner: Runner) -> None:
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
    runner.copy(list(kv.values()), N, batch)
    assert copy_stats().runs_copied == runs and copy_stats().block_copies == len(copies)
    utils.copy_kv_cache_blocks_inplace(list(native.values()), N, batch)
    for name, view in kv.items():
        ratio = view.shape[0] // N
        ints, ref = view.view(INTS[view.element_size()]), native[name].view(INTS[view.element_size()])
        for b in touched:
            rows = slice(b * ratio, (b + 1) * ratio)
            assert torch.equal(ints[rows], ref[rows]), (name, b)


def test_layer_outer_layout_one_range_per_layer_slot(runner: Runner) -> None:
    """LBHNC (the CPU backend's only layout): each layer's region becomes its own range."""
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0", "l1"], layout, 2 * N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)])
    kv, native, published = build(config, layout, runner)
    assert len(published.ranges) == 2 and published.geometry.strides == (P, P)
    assert published.geometry.blocks_per_page == 4
    assert region_offsets(kv) == {"l0": 0, "l1": 0}  # vLLM: l1 at N*P, a range of its own here
    assert region_offsets(native) == {"l0": 0, "l1": N * P}
    v = kv["l0"]
    assert tuple(v.shape) == (N, 2, BS, 16) and v.dtype == torch.float16  # [B, H, N, C]
    meta = get_meta(v)
    assert meta is not None and meta.segments == ((0, P),) and meta.block_stride == P
    check_copy(kv, native, published, [(1, 9), (9, 1), (2, 12)], runs=2, runner=runner)


def test_hybrid_attention_and_padded_mamba_overlay(runner: Runner) -> None:
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
    kv, native, published = build(config, layout, runner)
    assert len(published.ranges) == 2
    assert kv["a0"].untyped_storage().data_ptr() == kv["m0"].untyped_storage().data_ptr()
    assert kv["a1"].untyped_storage().data_ptr() == kv["m1"].untyped_storage().data_ptr()
    m = kv["m0"]
    assert tuple(m.shape) == (N, 1, 1, 72) and m.dtype == torch.int8 and m.stride(0) == P
    meta = get_meta(m)
    assert meta is not None and meta.segments == ((0, 72),) and meta.block_stride == P
    check_copy(kv, native, published, [(5, 10), (3, 0)], runs=2, runner=runner)  # each slot's runs once


def test_block_outer_layout_is_one_range(runner: Runner) -> None:
    """BLHNC: every block holds all layers' pages; the whole buffer is one block-strided range."""
    layout = KVCacheLayout.BLHNC
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[tensor(ATTN, ["l0", "l1"], layout, 2 * N * P, block_stride=2 * P)],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)],
    )
    kv, native, published = build(config, layout, runner)
    assert len(published.ranges) == 1 and published.geometry.strides == (2 * P,)
    assert region_offsets(kv) == region_offsets(native) == {"l0": 0, "l1": P}
    m0, m1 = get_meta(kv["l0"]), get_meta(kv["l1"])
    assert m0 is not None and m1 is not None and (m0.layer_offset, m1.layer_offset) == (0, P)
    check_copy(kv, native, published, [(0, 11), (7, 4)], runs=1, runner=runner)  # interleaved layers: one run


def test_kernel_blocks_split_a_logical_block(runner: Runner) -> None:
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    kv, native, published = build(config, layout, runner, kernel_block_sizes=[BS // 2])
    assert kv["l0"].shape[0] == 2 * N
    meta = get_meta(kv["l0"])
    assert meta is not None and meta.kernel_blocks_per_block == 2 and meta.block_stride == P
    check_copy(kv, native, published, [(3, 8)], runs=1, runner=runner)


def test_head_outer_layout_is_refused(runner: Runner) -> None:
    """LHBNC puts a block's heads a whole head plane apart: no block row kvcached could map."""
    layout = KVCacheLayout.LHBNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    with pytest.raises(IntegrationError, match="own row"):
        runner.allocate(config, CPU, layout, None)
    assert not rank_kv.registered_rank_kv()


def test_profiling_allocation_is_plain_memory(runner: Runner) -> None:
    layout = KVCacheLayout.LBHNC
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, ["l0"], layout, N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    mark = allocation._wrap_profiling(lambda self: runner.allocate(config, CPU, layout, None))
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


class Layer:
    """What vLLM's binding reads of an attention layer: it binds the view it is handed."""

    kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


@pytest.mark.skipif(not CAPS.model_runner_v2, reason="kvcached serves Model Runner V2 on this series on trial only")
def test_v2_init_kv_cache_binds_kvcached_views() -> None:
    """V2's own ``init_kv_cache`` (vLLM's code, each series' signature): it allocates through the
    patched name, binds every layer to a view over kvcached's ranges, and returns the views its
    runner keeps for the block copy (0.29: the list it fills; 0.30+: ``runner.kv_caches`` is built
    from the returned dict), each with its byte-page metadata; V2's copy moves their bytes as
    vLLM's copy moves native's."""
    import inspect
    from types import SimpleNamespace

    from vllm.v1.worker.gpu import attn_utils

    layout = KVCacheLayout.LBHNC
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor(ATTN, names, layout, 2 * N * P)],
                           kv_cache_groups=[KVCacheGroupSpec(names, ATTN)])
    layers = {name: Layer() for name in names}
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama")),
        attention_config=SimpleNamespace(hisparse_config=None),
        compilation_config=SimpleNamespace(static_forward_context=layers))
    kept: list[torch.Tensor] = []
    args: dict[str, Any] = {"forward_context": layers, "kv_cache_config": config, "device": CPU,
                            "kernel_block_sizes": [BS], "vllm_config": vllm_config}
    if "runner_kv_caches" in inspect.signature(attn_utils.init_kv_cache).parameters:
        args["runner_kv_caches"] = kept  # 0.29
    kv = attn_utils.init_kv_cache(**args)
    kept = kept or [c for c in kv.values() if c.device == CPU]  # as V2's runner builds it from 0.30
    published = registered_space(next(iter(kv.values())))
    assert published.premapped == {rank_kv.NULL_BLOCK_PAGE} and len(published.ranges) == 2
    assert {id(t) for t in kept} == {id(t) for t in kv.values()} and all(get_meta(t) for t in kept)
    for name, layer in layers.items():
        assert layer.kv_cache is not None and layer.kv_cache.untyped_storage().data_ptr() == \
            kv[name].untyped_storage().data_ptr()
    native = utils.allocate_kv_cache(config, CPU, layout, [BS])
    from vllm.v1.worker.gpu import model_runner

    check_copy(kv, native, published, [(1, 9), (9, 1), (2, 12)], runs=2,
               runner=Runner("V2", attn_utils, model_runner))
