"""kvsnap's CPU_ATTN block layout: derived from vLLM's own cache-write kernel for every ISA this
machine runs, read back through the map in engine-shaped caches, and a wrong map is caught.

(The CUDA packed-layout reads are tested in test_conformance_cuda.py.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

from conformance.engine import kvsnap
from conformance.engine.kvsnap import (
    CpuAttnGeometry,
    CpuAttnLayoutError,
    check_cpu_attn_layout,
    derive_cpu_attn_layout,
    split_cpu_attn_block,
    vllm_cache_write,
)

AMX = bool(torch.cpu._is_amx_tile_supported())
# (dtype, block_size, head_size, KV heads): vLLM's ISA choice per geometry covers every CPU
# attention path this machine has: fp32 "vec" (or the platform's SIMD ISA), bf16 "amx" where
# AMX exists, "vec16" for 16-token blocks and for head sizes that are multiples of 16 only.
GEOMETRIES = [
    (torch.float32, 32, 64, 2),
    (torch.bfloat16, 32, 64, 2),
    (torch.bfloat16, 64, 128, 3),
    (torch.float16, 32, 128, 2),
    (torch.bfloat16, 16, 64, 2),
    (torch.bfloat16, 32, 48, 1),
]


def _geometry(dtype: Any, block_size: int, head_size: int, heads: int) -> CpuAttnGeometry:
    return CpuAttnGeometry(dtype, cpu_attn._get_attn_isa(dtype, block_size, head_size), block_size, head_size, heads)


def test_the_geometries_cover_every_isa_this_machine_runs() -> None:
    isas = {_geometry(*g).isa for g in GEOMETRIES}
    assert "vec16" in isas and ("amx" in isas) == AMX
    assert isas & {"vec", "neon", "rvv", "vxe", "vsx"}  # the platform's fp32 path


def _engine_cache(num_blocks: int, heads: int, block_size: int, head_size: int, dtype: Any) -> Any:
    """A layer cache as vLLM's hybrid restride leaves it: block rows wider than the block."""
    row = heads * block_size * 2 * head_size + 96  # padding between block rows
    storage = torch.full((num_blocks * row,), -7.0, dtype=dtype)
    return torch.as_strided(storage, (num_blocks, heads, block_size, 2 * head_size),
                            (row, block_size * 2 * head_size, 2 * head_size, 1))


@pytest.mark.parametrize("dtype,block_size,head_size,heads", GEOMETRIES)
def test_kv_written_by_vllm_reads_back_through_the_derived_layout(dtype: Any, block_size: int, head_size: int,
                                                                  heads: int) -> None:
    geom = _geometry(dtype, block_size, head_size, heads)
    layout = derive_cpu_attn_layout(geom)
    assert layout.shape == (2, heads, block_size, head_size)
    # An engine-shaped cache, written the way CPUAttentionBackendImpl writes it: a full block 1
    # and the first `valid` slots of block 2.
    cache = _engine_cache(3, heads, block_size, head_size, dtype)
    key_cache, value_cache = cache.view(3, heads, 2 * block_size, -1).chunk(2, dim=2)
    valid = block_size // 2 + 3
    gen = torch.Generator().manual_seed(1)
    key, val = (torch.randn(block_size + valid, heads, head_size, generator=gen).to(dtype) for _ in range(2))
    slots = torch.cat([torch.arange(block_size, 2 * block_size), torch.arange(2 * block_size, 2 * block_size + valid)])
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, val, key_cache, value_cache, slots, geom.isa)
    for block_id, first, n in ((1, 0, block_size), (2, block_size, valid)):
        (k, k_axis), (v, v_axis) = split_cpu_attn_block(cache[block_id], n, layout)
        assert k_axis == v_axis == 1 and k.shape == v.shape == (heads, n, head_size)
        assert torch.equal(k, key[first : first + n].transpose(0, 1))
        assert torch.equal(v, val[first : first + n].transpose(0, 1))


@pytest.mark.skipif(not AMX, reason="the AMX ISA needs a CPU with AMX tiles")
def test_the_amx_layout_is_not_the_vec_layout() -> None:
    """Why a fixed K^T|V reading failed on AMX machines: vLLM's AMX write packs differently."""
    amx = derive_cpu_attn_layout(_geometry(torch.bfloat16, 32, 64, 2))
    vec = derive_cpu_attn_layout(CpuAttnGeometry(torch.bfloat16, "vec", 32, 64, 2))
    assert not torch.equal(amx, vec)
    with pytest.raises(CpuAttnLayoutError, match="isa amx"):
        check_cpu_attn_layout(_geometry(torch.bfloat16, 32, 64, 2), vec)


def _swap(flat: Any, a: int, b: int) -> None:
    flat[a], flat[b] = flat[b].clone(), flat[a].clone()


def test_a_wrong_map_is_caught_by_the_round_trip() -> None:
    geom = _geometry(torch.bfloat16, 32, 64, 2)
    wrong = derive_cpu_attn_layout(geom).clone()
    _swap(wrong.view(-1), 5, 700)
    with pytest.raises(CpuAttnLayoutError, match="do not read back"):
        check_cpu_attn_layout(geom, wrong)


def _stub(action: Any, from_call: int = 0) -> Any:
    """vLLM's kernel at kvsnap's one seam, then ``action`` on the flat block from call ``from_call`` on."""
    calls = [0]

    def write(key: Any, value: Any, block: Any, isa: str) -> None:
        vllm_cache_write(key, value, block, isa)
        if calls[0] >= from_call:
            action(block.view(-1))
        calls[0] += 1

    return write


@pytest.mark.parametrize("dtype,block_size,head_size,heads", GEOMETRIES[:2])
def test_a_kernel_whose_writes_disagree_with_the_derived_map_is_caught(dtype: Any, block_size: int,
                                                                      head_size: int, heads: int) -> None:
    geom = _geometry(dtype, block_size, head_size, heads)
    index_writes = 2  # 2*heads*block_size*head_size < 256**2 elements: two digit passes
    permuting = _stub(lambda flat: _swap(flat, 3, 1000), from_call=index_writes)
    with pytest.raises(CpuAttnLayoutError, match=f"isa {geom.isa}, {dtype}, block_size {block_size}"):
        derive_cpu_attn_layout(geom, permuting)
    # A kernel that always permutes the two slots just has another layout: the map follows it.
    real, followed = derive_cpu_attn_layout(geom), derive_cpu_attn_layout(geom, _stub(lambda f: _swap(f, 3, 1000)))
    moved = (real != followed).nonzero()
    assert len(moved) == 2 and sorted(real[tuple(moved.T)].tolist()) == [3, 1000]


@pytest.mark.parametrize("action,from_call,reason", [
    (lambda flat: flat.__setitem__(1, flat[0]), 0, "1 elements in no slot, 1 in several"),
    (lambda flat: flat.__setitem__(9, 0), 0, "1 slots never written"),
    (lambda flat: flat.__setitem__(9, 0), 1, "different slots"),
])
def test_a_write_that_is_not_a_bijection_is_caught(action: Any, from_call: int, reason: str) -> None:
    geom = _geometry(torch.float32, 32, 64, 2)
    with pytest.raises(CpuAttnLayoutError, match=reason):
        derive_cpu_attn_layout(geom, _stub(action, from_call))


def test_unreadable_caches_are_refused() -> None:
    geom = _geometry(torch.float32, 32, 64, 2)
    with pytest.raises(CpuAttnLayoutError, match="quantized"):
        derive_cpu_attn_layout(CpuAttnGeometry(torch.uint8, "vec", 32, 64, 2))
    strided = torch.zeros(2, 64, 128).transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(CpuAttnLayoutError, match="not contiguous"):
        split_cpu_attn_block(strided, 4, derive_cpu_attn_layout(geom))


def _worker(t: Any, isa: str) -> Any:
    layer = SimpleNamespace(kv_cache=[t], attn_backend=cpu_attn.CPUAttentionBackend, impl=SimpleNamespace(isa=isa))
    ctx = {"model.layers.0.attn": layer}
    return SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx)))


def test_read_blocks_widens_k_and_v_with_tokens_on_axis_1() -> None:
    geom = _geometry(torch.bfloat16, 32, 64, 2)
    cache = _engine_cache(2, 2, 32, 64, torch.bfloat16)
    key_cache, value_cache = cache.view(2, 2, 64, -1).chunk(2, dim=2)
    key, val = (torch.randn(40, 2, 64).to(torch.bfloat16) for _ in range(2))
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, val, key_cache, value_cache, torch.arange(40), geom.isa)
    layer = "model.layers.0.attn"
    got = kvsnap.read_blocks(_worker(cache, geom.isa), [kvsnap.BlockRead(1, layer, "FullAttentionSpec", 32, 40)])
    assert got["token_dims"] == {f"{layer}|0": 1, f"{layer}|1": 1} and got["whole_block_layers"] == []
    k, v = got["arrays"][f"b1|{layer}|0"], got["arrays"][f"b1|{layer}|1"]
    assert k.dtype == v.dtype == "float32" and k.shape == v.shape == (2, 8, 64)
    assert (k == key[32:].float().transpose(0, 1).numpy()).all()
    assert (v == val[32:].float().transpose(0, 1).numpy()).all()
    with pytest.raises(CpuAttnLayoutError, match="16"):
        kvsnap.read_blocks(_worker(cache, geom.isa), [kvsnap.BlockRead(1, layer, "FullAttentionSpec", 16, 40)])
