"""Worker seams over real virtual ranges: vLLM 0.28's own reshape code, kvcached's allocation.

Model Runner V1: a `GPUModelRunner` is made without ``__init__`` and given just the attributes
``_allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors`` read. Model Runner V2: its own
module functions, ``gpu.attn_utils._allocate_kv_cache`` and ``_reshape_kv_cache`` (what its
``init_kv_cache`` calls), and its own copy name. The layout tests run on both runners. The
attention backends are vLLM's real CPU (blocks-first) and ROCm (K/V-first) classes, the specs
vLLM's real spec classes. No engine is started. Skipped on vLLM series that allocate KV tensors
through ``allocate_kv_cache`` (0.29+), where these runner methods are gone: their seam is
tested in ``test_v029_worker_alloc``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached.integration.vllm.capabilities import detect

if detect().allocate_kv_cache:
    pytest.skip("this vLLM allocates KV tensors through allocate_kv_cache; its runner has no "
                "_allocate_kv_cache_tensors / _reshape_kv_cache_tensors (see test_v029_worker_alloc)",
                allow_module_level=True)

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from worker_env import forget_all, registered_space, worker_installed

from kvcached import space
from kvcached.budget import BudgetRecord
from kvcached.copy import copy_stats, reset_copy_stats
from kvcached.errors import ConfigError, IntegrationError
from kvcached.integration.vllm import allocation, capacity, engine_config, rank_kv
from kvcached.views import get_meta

pytest.importorskip("kvcached._vmm", reason="native extension not built")

N = 12  # blocks
BS = 16  # tokens per block
PAGE_SIZE = 4096  # VMM page: 4 attention blocks per kv page
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)
ATTN_PAGE = ATTN.page_size_bytes  # 1024
STATES = {"shapes": ((2, 3), (3, 5)), "dtypes": (torch.float16, torch.float32)}


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with worker_installed(monkeypatch, PAGE_SIZE):
        yield


def make_runner(config: KVCacheConfig, groups: list[tuple[Any, type, list[str]]]) -> GPUModelRunner:
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.kv_cache_config = config
    runner.attn_groups = [
        [SimpleNamespace(kv_cache_spec=spec, backend=backend, kv_cache_group_id=gid, layer_names=names)]
        for gid, (spec, backend, names) in enumerate(groups)
    ]
    runner.runner_only_attn_layers = set()
    runner.cache_config = SimpleNamespace(cache_dtype="auto")
    runner.device = torch.device("cpu")
    return runner


Groups = list[tuple[Any, type, list[str]]]


class V1:
    """Model Runner V1's allocation, reshape and copy names (the seams replace them)."""

    @staticmethod
    def allocate(config: KVCacheConfig, groups: Groups) -> dict[str, torch.Tensor]:
        return GPUModelRunner._allocate_kv_cache_tensors(make_runner(config, groups), config)

    @staticmethod
    def reshape(config: KVCacheConfig, groups: Groups, raw: dict[str, torch.Tensor]) -> dict[str, Any]:
        return GPUModelRunner._reshape_kv_cache_tensors(make_runner(config, groups), raw,
                                                        [g[0].block_size for g in groups])

    @staticmethod
    def copy(kv_caches: list[Any], num_blocks: int, copies: list[KVCacheBlockCopy]) -> None:
        gpu_model_runner.copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)


class V2:
    """Model Runner V2's module functions (0.26-0.28), as its ``init_kv_cache`` calls them."""

    @staticmethod
    def allocate(config: KVCacheConfig, groups: Groups) -> dict[str, torch.Tensor]:
        from vllm.v1.worker.gpu import attn_utils

        return attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))

    @staticmethod
    def reshape(config: KVCacheConfig, groups: Groups, raw: dict[str, torch.Tensor]) -> dict[str, Any]:
        from vllm.v1.worker.gpu import attn_utils

        flat = [g for gs in make_runner(config, groups).attn_groups for g in gs]
        return attn_utils._reshape_kv_cache(flat, raw, "auto", [g[0].block_size for g in groups], {}, config)

    @staticmethod
    def copy(kv_caches: list[Any], num_blocks: int, copies: list[KVCacheBlockCopy]) -> None:
        from vllm.v1.worker.gpu import model_runner

        model_runner.copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)


RUNNERS = [V1, *([V2] if detect().model_runner_v2 else [])]


@pytest.fixture(params=RUNNERS, ids=lambda r: r.__name__)
def runner(request: pytest.FixtureRequest) -> type:
    """The model runner whose names a layout test goes through."""
    return request.param  # type: ignore[no-any-return]


def build(config: KVCacheConfig, groups: Groups, runner: Any = V1) -> tuple[dict[str, Any], space.KvSpace]:
    raw = runner.allocate(config, groups)
    published = registered_space(next(iter(raw.values())))
    # exactly KVCacheTensor.size bytes per tensor, over a range where only the null block's
    # kv page is mapped (warm-up may read block 0 before the scheduler's pool exists)
    for t in config.kv_cache_tensors:
        tensor = raw[t.shared_by[0]]
        assert tensor.dtype == torch.int8 and tensor.numel() == t.size
        assert tensor.untyped_storage().data_ptr() in {r.address for r in published.ranges}
    assert published.premapped == {rank_kv.NULL_BLOCK_PAGE}
    assert published.config is not None and published.config.page_size == published.geometry.page_size
    vmm = published.geometry.vmm_pages
    assert [r.mapped_pages() for r in published.ranges] == [list(range(k)) for k in vmm]
    kv = runner.reshape(config, groups, raw)
    return kv, published


def map_blocks(published: space.KvSpace, blocks: set[int]) -> None:
    """Map only the kv pages holding ``blocks`` (every other byte stays PROT_NONE)."""
    g = published.geometry
    for p in sorted({b // g.blocks_per_page for b in blocks} - published.premapped):
        published.page_space().map_pages([p])


def check_copy(kv: dict[str, Any], published: space.KvSpace, copies: list[tuple[int, int]], runs: int,
               runner: Any = V1) -> None:
    """Copy through the patched helper; compare typed views of the touched blocks."""
    touched = {b for pair in copies for b in pair}
    map_blocks(published, touched)
    views = [t for e in kv.values() for t in (e if isinstance(e, (list, tuple)) else [e])]
    order = sorted(touched)
    gen = torch.Generator().manual_seed(0)
    blocks_of: list[torch.Tensor] = []
    for v in views:
        meta = get_meta(v)
        assert meta is not None
        bd = next(d for d, s in enumerate(v.shape) if s == N * meta.kernel_blocks_per_block and d in (0, 1))
        ints = v.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[v.element_size()])
        blocks = ints.unflatten(bd, (N, meta.kernel_blocks_per_block)).movedim(bd, 0)
        blocks[order] = torch.randint(-100, 100, blocks[order].shape, generator=gen, dtype=blocks.dtype)
        blocks_of.append(blocks)
    before = [b[order].clone() for b in blocks_of]
    reset_copy_stats()
    runner.copy(list(kv.values()), N, [KVCacheBlockCopy(s, d) for s, d in copies])
    assert copy_stats().runs_copied == runs
    pos = {b: i for i, b in enumerate(order)}
    dsts = {d: s for s, d in copies}
    for blocks, old in zip(blocks_of, before):
        for b in order:
            want = old[pos[dsts[b]]] if b in dsts else old[pos[b]]
            assert torch.equal(blocks[b], want)


def test_full_attention_layers(runner: type) -> None:
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=[f"l{i}"]) for i in range(2)],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)],
    )
    kv, published = build(config, [(ATTN, CPUAttentionBackend, ["l0", "l1"])], runner)
    assert published.geometry.blocks_per_page == 4 and len(published.ranges) == 2
    v = kv["l0"]
    assert tuple(v.shape) == (N, 2, BS, 16) and v.stride() == (512, 256, 16, 1)  # CPU: (B, H, N, 2D)
    meta = get_meta(v)
    assert meta is not None and meta.segments == ((0, ATTN_PAGE),) and meta.block_stride == ATTN_PAGE
    check_copy(kv, published, [(1, 9), (9, 1), (2, 3)], runs=2, runner=runner)


def test_hybrid_split_kv_restrided_with_mamba(runner: type) -> None:
    mamba = MambaSpec(block_size=BS, page_size_padded=ATTN_PAGE, **STATES)  # type: ignore[arg-type]
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=[f"a{i}", f"m{i}"]) for i in range(2)],
        kv_cache_groups=[KVCacheGroupSpec(["a0", "a1"], ATTN), KVCacheGroupSpec(["m0", "m1"], mamba)],
    )
    kv, published = build(
        config, [(ATTN, RocmAttentionBackend, ["a0", "a1"]), (mamba, RocmAttentionBackend, ["m0", "m1"])], runner
    )
    a, m = kv["a0"], kv["m0"]
    hidden = BS * 2 * 8
    assert tuple(a.shape) == (2, N, BS, 2, 8) and a.stride()[:2] == (hidden, 2 * hidden)  # restrided in place
    assert tuple(m.shape) == (N, 1, 1, ATTN_PAGE) and m.dtype == torch.int8
    for t in (a, m):
        meta = get_meta(t)
        assert meta is not None and meta.segments == ((0, ATTN_PAGE),) and meta.block_stride == ATTN_PAGE
    # each KVCacheTensor (attention + Mamba layer) is copied once
    check_copy(kv, published, [(5, 10), (10, 0)], runs=2, runner=runner)


def test_packed_layers_share_one_backing(runner: type) -> None:
    stride = 2 * ATTN_PAGE
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[
            KVCacheTensor(size=N * stride, shared_by=["l0"], offset=0, block_stride=stride),
            KVCacheTensor(size=N * stride, shared_by=["l1"], offset=ATTN_PAGE, block_stride=stride),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)],
    )
    kv, published = build(config, [(ATTN, CPUAttentionBackend, ["l0", "l1"])], runner)
    assert len(published.ranges) == 1
    assert kv["l0"].untyped_storage().data_ptr() == kv["l1"].untyped_storage().data_ptr()
    m0, m1 = get_meta(kv["l0"]), get_meta(kv["l1"])
    assert m0 is not None and m1 is not None
    assert (m0.layer_offset, m1.layer_offset, m1.block_stride) == (0, ATTN_PAGE, stride)
    check_copy(kv, published, [(0, 11), (7, 4)], runs=1, runner=runner)  # interleaved layers merge into one run


def test_packed_mamba_slice_is_rejected(runner: type) -> None:
    """vLLM 0.28 slices a packed Mamba page as if unpacked; kvcached refuses that view."""
    mamba = MambaSpec(block_size=BS, **STATES)  # type: ignore[arg-type]  # 72-byte page
    stride = ATTN_PAGE
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * stride, shared_by=["a0", "m0"], offset=0, block_stride=stride)],
        kv_cache_groups=[KVCacheGroupSpec(["a0"], ATTN), KVCacheGroupSpec(["m0"], mamba)],
    )
    with pytest.raises(IntegrationError, match="layer m0"):
        build(config, [(ATTN, CPUAttentionBackend, ["a0"]), (mamba, CPUAttentionBackend, ["m0"])], runner)


def test_split_kv_without_restride_is_rejected(runner: type) -> None:
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)],
    )
    with pytest.raises(IntegrationError, match="K/V-first"):
        build(config, [(ATTN, RocmAttentionBackend, ["l0"])], runner)


def test_profiling_kv_cache_is_plain_memory() -> None:
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)],
    )
    runner = make_runner(config, [(ATTN, CPUAttentionBackend, ["l0"])])
    forget_all()
    mark = allocation._wrap_profiling(lambda self: GPUModelRunner._allocate_kv_cache_tensors(self, config))
    raw = mark(runner)
    assert not rank_kv.registered_rank_kv()  # nothing registered
    assert torch.count_nonzero(raw["l0"]) == 0  # vLLM's torch.zeros, readable everywhere


def test_the_engine_config_is_resolved_once_and_carried_with_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity report resolves the engine's config; the allocation plans with that one
    and carries it with the space for the pool, even if the environment changed in between. The next
    engine built in the process resolves its own."""
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)],
    )
    groups = [(ATTN, CPUAttentionBackend, ["l0"])]
    report = capacity._wrap_gpu_determine(lambda self: 1 << 30)  # the engine's capacity report
    assert report(SimpleNamespace(device="cpu")) == 1 << 30  # no budget: uncapped
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(2 * PAGE_SIZE))  # too late for this engine
    _, first = build(config, groups)
    assert first.config is not None and first.config.page_size == first.geometry.page_size == PAGE_SIZE
    forget_all()
    _, second = build(config, groups)  # a later engine, no report: resolved at its allocation
    assert second.config is not None and second.config.page_size == second.geometry.page_size == 2 * PAGE_SIZE


def test_an_engines_explicit_settings_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``additional_config["kvcached"]`` carries one engine's settings (what the
    conformance harness gives each case): they win over ``KVCACHED_*``, and are validated."""
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(2 * PAGE_SIZE))
    monkeypatch.setenv("KVCACHED_MAX_CACHED_BLOCKS", "5")
    explicit = SimpleNamespace(additional_config={"kvcached": {"page_size": PAGE_SIZE, "max_cached_blocks": -1}})
    config = engine_config.resolve_engine_config(explicit)
    assert (config.page_size, config.max_cached_blocks) == (PAGE_SIZE, -1)
    assert engine_config.take_engine_config() is config  # the allocation plans with exactly this one
    assert engine_config.resolve_engine_config(SimpleNamespace(additional_config={})).page_size == 2 * PAGE_SIZE
    engine_config.take_engine_config()
    with pytest.raises(ConfigError, match="unknown kvcached option"):
        engine_config.resolve_engine_config(SimpleNamespace(additional_config={"kvcached": {"page_sise": PAGE_SIZE}}))
    with pytest.raises(ConfigError, match="must be a mapping"):
        engine_config.engine_settings(SimpleNamespace(additional_config={"kvcached": PAGE_SIZE}))


def test_a_cuda_engine_holds_pages_while_busy_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's defaults (`kvcached.config.device_defaults`) come under the variables and
    the engine's explicit settings: holding on CUDA, none on CPU or without a vLLM config."""
    monkeypatch.delenv("KVCACHED_HOLD_STEPS", raising=False)

    def hold(device: str, **settings: object) -> int:
        vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                                      additional_config={"kvcached": settings})
        config = engine_config.resolve_engine_config(vllm_config)
        engine_config.take_engine_config()
        return int(config.hold_steps)

    assert (hold("cuda"), hold("cpu")) == (256, 0)
    assert engine_config.resolve_engine_config(None).hold_steps == 0
    engine_config.take_engine_config()
    assert hold("cuda", hold_steps=3) == 3
    monkeypatch.setenv("KVCACHED_HOLD_STEPS", "0")
    assert hold("cuda") == 0  # a variable the user set wins over the device's default


def test_layer_coverage_is_checked() -> None:
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], ATTN)],
    )
    with pytest.raises(IntegrationError, match=r"missing \['l1'\]"):
        GPUModelRunner._allocate_kv_cache_tensors(make_runner(config, []), config)


UNSERVABLE = {
    "no KV tensors": ([], "no KV tensors"),
    "unequal blocks": ([KVCacheTensor(size=N * ATTN_PAGE + 1, shared_by=["l0"])], "not 12 equal blocks"),
    "packed, too small": ([KVCacheTensor(size=N * ATTN_PAGE - 1, shared_by=["l0"], offset=0, block_stride=ATTN_PAGE)],
                          "cannot hold 12 blocks"),
    "packed, disagreeing": ([KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"], offset=0, block_stride=ATTN_PAGE),
                             KVCacheTensor(size=2 * N * ATTN_PAGE, shared_by=["l1"], offset=0,
                                           block_stride=2 * ATTN_PAGE)], "disagree on the shared backing"),
}


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_kv_tensors_kvcached_cannot_serve_are_refused_before_anything_maps(case: str) -> None:
    """Each is an IntegrationError naming the problem; no range is reserved, nothing registered.
    Control: the same layer with a servable tensor allocates (`test_full_attention_layers`)."""
    tensors, match = UNSERVABLE[case]
    names = [n for t in tensors for n in t.shared_by] or ["l0"]
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, ATTN)])
    with pytest.raises(IntegrationError, match=match):
        GPUModelRunner._allocate_kv_cache_tensors(make_runner(config, [(ATTN, CPUAttentionBackend, names)]), config)
    assert rank_kv.registered_rank_kv() == []


def test_a_budget_smaller_than_one_kv_page_is_refused_before_anything_maps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = KVCacheConfig(
        num_blocks=N,
        kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)],
    )
    groups = [(ATTN, CPUAttentionBackend, ["l0"])]
    monkeypatch.setenv("KVCACHED_BUDGET_PATH", str(tmp_path / "host.budget"))
    monkeypatch.setenv("KVCACHED_BUDGET_BYTES", "1000")
    with pytest.raises(ConfigError, match=r"global limit \(1000 bytes.*smaller than one kv page"):
        build(config, groups)
    assert rank_kv.registered_rank_kv() == []
    with BudgetRecord(str(tmp_path / "host.budget"), create=False) as record:
        assert record.snapshot().slots == (), "the slot went with the failed allocation"


def _forget_all() -> None:
    """Engine teardown of every space built so far (its slot in the record goes with it)."""
    for kv in rank_kv.registered_rank_kv():
        rank_kv.forget_rank_kv(kv)


def _one_layer() -> tuple[KVCacheConfig, list[tuple[Any, type, list[str]]]]:
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[KVCacheTensor(size=N * ATTN_PAGE, shared_by=["l0"])],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], ATTN)])
    return config, [(ATTN, CPUAttentionBackend, ["l0"])]


def test_without_a_budget_a_cpu_engine_derives_one_from_host_memory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The host record's limit becomes the memory available at allocation less the reserve,
    so running out is a scheduling miss rather than the OOM killer. Controls: an explicit
    budget is used as given; ``off`` derives nothing."""
    from kvcached.host import read_host_memory

    record_path = tmp_path / "host.budget"
    monkeypatch.setenv("KVCACHED_BUDGET_PATH", str(record_path))
    monkeypatch.setenv("KVCACHED_HOST_RESERVE", str(1 << 30))
    before = read_host_memory().available
    build(*_one_layer())
    after = read_host_memory().available
    with BudgetRecord(str(record_path), create=False) as record:
        limit = record.snapshot().limit
    assert limit is not None and min(before, after) - (1 << 30) - (64 << 20) <= limit <= max(before, after) - (1 << 30)
    _forget_all()

    monkeypatch.setenv("KVCACHED_BUDGET_BYTES", str(1 << 20))
    build(*_one_layer())
    with BudgetRecord(str(record_path), create=False) as record:
        assert record.snapshot().limit == 1 << 20
    _forget_all()

    monkeypatch.delenv("KVCACHED_BUDGET_BYTES")
    monkeypatch.setenv("KVCACHED_HOST_RESERVE", "off")
    record_path.unlink()
    build(*_one_layer())
    with BudgetRecord(str(record_path), create=False) as record:
        assert record.snapshot().limit is None
    _forget_all()


def test_a_host_with_no_room_left_is_a_clear_error_at_allocation(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("KVCACHED_BUDGET_PATH", str(tmp_path / "host.budget"))
    monkeypatch.setenv("KVCACHED_HOST_RESERVE", "100%")  # nothing left for KV
    with pytest.raises(ConfigError, match=r"global limit \(0 bytes.*smaller than one kv page"):
        build(*_one_layer())
    assert rank_kv.registered_rank_kv() == []
