"""Model Runner V2's warm-up over kvcached's ranges: vLLM's own ``warmup_kernels``, real ranges.

V2 compiles its kernels with two real steps of dummy requests whose blocks vLLM numbers 1, 2, ...
itself (``gpu/warmup.py``), before any block pool exists; over kvcached's ranges only the null
block's page is mapped then. Here vLLM's real ``warmup_kernels`` runs through the installed seam
(``vllm.v1.worker.gpu_worker.warmup_kernels``) against a runner that has just what it reads, and a
worker step that stands in for the kernels: it writes every byte row of every block its scheduler
output hands over, which on an unmapped page of a CPU range is a SIGSEGV. From 0.30 the worker
warms up before CUDA-graph capture, which runs on the block tables the warm-up left: there the
pages stay lent until the worker's warm-up (``compile_or_warm_up_model``) returns. Skipped where
kvcached does not serve V2 (0.29-0.32 without trial: refused by name, ``test_model_runner_v2``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached.integration.vllm.capabilities import detect

CAPS = detect()
if not CAPS.model_runner_v2:
    pytest.skip("kvcached refuses Model Runner V2 on this vLLM series", allow_module_level=True)

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: F401  (vLLM's registry)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.worker import gpu_worker
from vllm.v1.worker.gpu import attn_utils
from worker_env import registered_space, worker_installed

from kvcached.budget import BudgetRecord
from kvcached.errors import PhysicalMemoryExhausted
from kvcached.integration.vllm import rank_kv, runner_v2

pytest.importorskip("kvcached._vmm", reason="native extension not built")

N = 24  # blocks
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
PAGE = 4096  # 4 blocks of 1 KiB per kv page
MAX_SEQS = 8  # warm-up requests: blocks 1..8, on kv pages 0-2


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with worker_installed(monkeypatch, PAGE):
        yield


def _config() -> KVCacheConfig:
    size = N * SPEC.page_size_bytes
    if not CAPS.allocate_kv_cache:
        tensor = KVCacheTensor(size=size, shared_by=["l0"])
    else:  # 0.29+: one layer's slot in vLLM's LBHNC buffer
        from vllm.v1.kv_cache_interface import compute_layout_strides
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layer_stride, block_stride, *_ = compute_layout_strides(SPEC, N, 1, KVCacheLayout.LBHNC,
                                                                fixed_strides=(None,) * 5)
        tensor = KVCacheTensor(size=size, layers=["l0"], layer_stride=layer_stride, block_stride=block_stride,
                               offset=0)
    return KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(["l0"], SPEC)])


def _runner(config: KVCacheConfig, kv: torch.Tensor) -> Any:
    """What ``warmup_kernels`` reads of a V2 runner, and its KV tensors."""
    return SimpleNamespace(
        is_encoder_only=False, is_encoder_decoder=False, is_pooling_model=False, is_last_pp_rank=True,
        num_speculative_steps=0, decode_query_len=1, kv_cache_config=config, model_state=SimpleNamespace(),
        vllm_config=SimpleNamespace(num_lookahead_tokens=0, is_mm_encoder_only=False), max_model_len=1024,
        max_num_reqs=MAX_SEQS, adaptive_verification=None, rejection_sampler=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS, max_num_batched_tokens=256),
        model_config=SimpleNamespace(get_vocab_size=lambda: 32), kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None), kv_caches=[kv],
    )


class Kernels:
    """The worker's step: writes every block the scheduler output hands over, and notes which
    pages the range mapped at that moment."""

    def __init__(self, kv: torch.Tensor, mapped: Any) -> None:
        self.rows = kv.view(N, -1)
        self.mapped = mapped
        self.blocks: set[int] = set()
        self.pages_seen: list[list[int]] = []

    def execute_model(self, scheduler_output: Any) -> None:
        blocks = [b for r in scheduler_output.scheduled_new_reqs for g in r.block_ids for b in g]
        for new in scheduler_output.scheduled_cached_reqs.new_block_ids:
            blocks += [b for g in new or () for b in g]
        self.pages_seen.append(self.mapped())
        for b in blocks:
            self.rows[b].fill_(7)  # SIGSEGV on a page no range maps
        self.blocks.update(blocks)

    def sample_tokens(self, grammar_output: Any) -> None:
        pass


def _allocate(config: KVCacheConfig) -> torch.Tensor:
    """The KV tensor V2's ``init_kv_cache`` gets through the patched name of this series."""
    if not CAPS.allocate_kv_cache:
        return attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))["l0"]
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return attn_utils.allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, None)["l0"]


def test_warm_up_maps_its_blocks_pages_and_gives_them_back(caplog: pytest.LogCaptureFixture) -> None:
    config = _config()
    kv = _allocate(config)
    published = registered_space(kv)
    pages = rank_kv.rank_kv_of(kv).pages  # type: ignore[union-attr]
    kernels = Kernels(kv, published.ranges[0].mapped_pages)
    with caplog.at_level(logging.INFO, logger="kvcached"):
        gpu_worker.warmup_kernels(_runner(config, kv), kernels.execute_model, kernels.sample_tokens)
    timing = [r.getMessage() for r in caplog.records if "Model Runner V2's warm-up took" in r.getMessage()]
    assert len(timing) == 1 and timing[0].endswith("of it mapping and unmapping the 2 kv page(s) it lent"), timing
    assert kernels.blocks == set(range(1, MAX_SEQS + 1)), "vLLM's warm-up numbers its blocks 1, 2, ..."
    assert [0, 1, 2] in kernels.pages_seen  # the pages of blocks 1-8, mapped while the steps ran
    assert published.ranges[0].mapped_pages() == [0] and pages.mapped == {rank_kv.NULL_BLOCK_PAGE}
    assert published.charger is not None and published.charger.charged == PAGE  # type: ignore[attr-defined]


def test_a_refused_warm_up_map_names_the_warm_up_and_leaves_the_null_page_alone(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCACHED_BUDGET_PATH", str(tmp_path / "host.budget"))
    monkeypatch.setenv("KVCACHED_BUDGET_BYTES", str(PAGE))  # the null block's page, and no other
    config = _config()
    kv = _allocate(config)
    published = registered_space(kv)
    kernels = Kernels(kv, published.ranges[0].mapped_pages)
    with pytest.raises(PhysicalMemoryExhausted, match=r"Model Runner V2's warm-up needs kv pages \[1, 2\]"):
        gpu_worker.warmup_kernels(_runner(config, kv), kernels.execute_model, kernels.sample_tokens)
    assert kernels.blocks == set() and published.ranges[0].mapped_pages() == [0]
    with BudgetRecord(str(tmp_path / "host.budget"), create=False) as record:
        assert [s.charge for s in record.snapshot().slots] == [PAGE]


def test_native_kv_tensors_are_left_to_vllm() -> None:
    """A runner whose KV tensors are not kvcached's (an engine built before kvcached acted): the
    seam is vLLM's function, its blocks in ordinary memory."""
    config = _config()
    kv = torch.zeros(N * SPEC.page_size_bytes, dtype=torch.int8)
    assert rank_kv.rank_kv_of(kv) is None
    kernels = Kernels(kv, list)
    gpu_worker.warmup_kernels(_runner(config, kv), kernels.execute_model, kernels.sample_tokens)
    assert kernels.blocks == set(range(1, MAX_SEQS + 1))
    assert int(kv.view(N, -1)[1:MAX_SEQS + 1].eq(7).all()) == 1


def test_every_block_a_step_hands_over_is_covered() -> None:
    """New requests' blocks (every group), running requests' new blocks, and blocks to zero."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from kvcached.integration.vllm.runner_v2 import scheduled_block_ids

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [SimpleNamespace(block_ids=([1, 2], [9])), SimpleNamespace(block_ids=([3],))]
    cached = CachedRequestData.make_empty()
    cached.new_block_ids = [None, ([4], [10, 11])]
    out.scheduled_cached_reqs = cached
    out.new_block_ids_to_zero = [12]
    assert scheduled_block_ids(out) == {1, 2, 3, 4, 9, 10, 11, 12}
    assert scheduled_block_ids(SchedulerOutput.make_empty()) == set()


def test_the_workers_warm_up_keeps_the_pages_until_capture_has_run() -> None:
    """0.30+: the installed ``Worker.compile_or_warm_up_model`` is the lease's scope. Here the
    seam's wrapper runs a worker warm-up that calls vLLM's real ``warmup_kernels`` (through its
    seam), then a capture that runs the model on the blocks the warm-up left; the pages are
    mapped for both and unmapped when the worker's warm-up returns."""
    from vllm.v1.worker.gpu_worker import Worker

    if not CAPS.v2_warmup_before_capture:
        pytest.skip("the worker warms V2 up after CUDA-graph capture on this series")
    assert Worker.compile_or_warm_up_model.__wrapped__ is not None  # type: ignore[attr-defined]
    config = _config()
    kv = _allocate(config)
    published = registered_space(kv)
    pages = rank_kv.rank_kv_of(kv).pages  # type: ignore[union-attr]
    kernels = Kernels(kv, published.ranges[0].mapped_pages)
    runner = _runner(config, kv)
    during_capture: list[list[int]] = []

    def compile_or_warm_up_model(worker: Any) -> str:
        gpu_worker.warmup_kernels(worker.model_runner, kernels.execute_model, kernels.sample_tokens)
        during_capture.append(published.ranges[0].mapped_pages())
        for b in kernels.blocks:  # capture's dummy runs on the block tables the warm-up left
            kernels.rows[b].fill_(8)
        return "compiled"

    scoped = runner_v2._wrap_compile_or_warm_up(compile_or_warm_up_model)
    assert scoped(SimpleNamespace(model_runner=runner)) == "compiled"
    assert kernels.blocks == set(range(1, MAX_SEQS + 1)) and during_capture == [[0, 1, 2]]
    assert published.ranges[0].mapped_pages() == [0] and pages.mapped == {rank_kv.NULL_BLOCK_PAGE}


def test_a_failed_worker_warm_up_still_gives_the_pages_back() -> None:
    config = _config()
    kv = _allocate(config)
    published = registered_space(kv)
    kernels = Kernels(kv, published.ranges[0].mapped_pages)

    def compile_or_warm_up_model(worker: Any) -> None:
        gpu_worker.warmup_kernels(worker.model_runner, kernels.execute_model, kernels.sample_tokens)
        raise RuntimeError("capture failed")

    scoped = runner_v2._wrap_compile_or_warm_up(compile_or_warm_up_model)
    with pytest.raises(RuntimeError, match="capture failed"):
        scoped(SimpleNamespace(model_runner=_runner(config, kv)))
    assert kernels.blocks and published.ranges[0].mapped_pages() == [0]
