"""Worker seams: install/uninstall restore vLLM exactly; the copy seam delegates when disabled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.worker import gpu_model_runner, utils
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from kvcached.copy import copy_stats, reset_copy_stats
from kvcached.errors import CopyValidationError, IntegrationError
from kvcached.integration.vllm import worker
from kvcached.integration.vllm.capabilities import capabilities_for, detect
from kvcached.views import annotate

CAPS = detect()  # the installed vLLM; the seams depend on where it allocates KV tensors
# 0.26-0.28: runner methods allocate and reshape; 0.29: the module-level allocate_kv_cache
RUNNER_SEAMS = ("_init_minimal_kv_cache_for_profiling",) + (
    () if CAPS.allocate_kv_cache else ("_allocate_kv_cache_tensors", "_reshape_kv_cache_tensors")
)
MODULE_SEAMS = ("allocate_kv_cache",) if CAPS.allocate_kv_cache else ()
# Model Runner V2's names where kvcached serves it: (owner, attribute)
V2_SEAMS: tuple[tuple[object, str], ...] = ()
if CAPS.model_runner_v2:
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as model_runner_v2

    V2_SEAMS = (((attn_utils, "allocate_kv_cache"),) if CAPS.allocate_kv_cache  # 0.29+
                else ((attn_utils, "_allocate_kv_cache"), (attn_utils, "_reshape_kv_cache")))
    if CAPS.v2_profiling_cache:
        from vllm.v1.worker.gpu import cudagraph_utils

        V2_SEAMS += ((cudagraph_utils, "_init_minimal_kv_cache_for_profiling"),)
    V2_SEAMS += ((model_runner_v2, "copy_kv_cache_blocks_inplace"), (gpu_worker, "warmup_kernels"))
    if CAPS.v2_warmup_before_capture:
        V2_SEAMS += ((gpu_worker.Worker, "compile_or_warm_up_model"),)
if not CAPS.model_runner_v2 or CAPS.hisparse:  # the runner decision: V2 refused, or HiSparse
    from vllm.config import VllmConfig

    V2_SEAMS += ((VllmConfig, "use_v2_model_runner"),)
# a supported series whose worker seams this vLLM does not have
OTHER = capabilities_for("0.28.0" if CAPS.allocate_kv_cache else "0.29.0")


def _originals() -> tuple[object, ...]:
    return (
        *(vars(GPUModelRunner)[n] for n in RUNNER_SEAMS),
        *(vars(gpu_model_runner)[n] for n in MODULE_SEAMS),
        gpu_model_runner.copy_kv_cache_blocks_inplace,
        *(vars(module)[n] for module, n in V2_SEAMS),
    )


@pytest.fixture
def clean() -> Iterator[None]:
    before = _originals()
    yield
    worker.uninstall()
    assert _originals() == before


def _install(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "1" if enabled else "0")
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    worker.install(CAPS)


def test_install_uninstall_restores_exact_originals(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _originals()
    _install(monkeypatch, enabled=True)
    after = _originals()
    assert all(a is not b for a, b in zip(after, before))
    # a property (the runner decision) wraps its getter
    assert all(getattr(a, "fget", a).__wrapped__ is getattr(b, "fget", b) for a, b in zip(after, before))
    assert worker.is_enabled() and worker.installed_capabilities() == CAPS
    worker.install(CAPS)  # idempotent: nothing re-wrapped
    assert _originals() == after
    worker.uninstall()
    assert _originals() == before
    assert all(a is b for a, b in zip(_originals(), before))
    assert gpu_model_runner.copy_kv_cache_blocks_inplace is utils.copy_kv_cache_blocks_inplace
    for name in MODULE_SEAMS:
        assert vars(gpu_model_runner)[name] is vars(utils)[name]
    assert not worker.is_enabled() and worker.installed_capabilities() is None
    worker.uninstall()  # idempotent
    assert _originals() == before


def test_install_refuses_other_capabilities(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, enabled=True)
    with pytest.raises(IntegrationError, match="already installed"):
        worker.install(OTHER)


def test_install_refuses_another_series_seams_with_nothing_patched(
    clean: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.29's capabilities on 0.26-0.28 (no allocate_kv_cache), or 0.28's on 0.29 (no runner methods)."""
    before = _originals()
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    missing = "_allocate_kv_cache_tensors" if CAPS.allocate_kv_cache else "allocate_kv_cache"
    with pytest.raises(IntegrationError, match=f"{missing} is not defined where kvcached expects it"):
        worker.install(OTHER)
    assert _originals() == before and worker.installed_capabilities() is None


@pytest.mark.skipif(not CAPS.allocate_kv_cache, reason="vLLM allocates KV tensors in runner methods")
def test_install_refuses_foreign_allocate_kv_cache(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_model_runner, "allocate_kv_cache", lambda *a: {})
    before = _originals()
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    with pytest.raises(IntegrationError, match="allocate_kv_cache is not vLLM's helper; another plugin"):
        worker.install(CAPS)
    assert _originals() == before


def test_install_refuses_foreign_copy_helper(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_model_runner, "copy_kv_cache_blocks_inplace", lambda *a: None)
    before = _originals()
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    with pytest.raises(IntegrationError, match="another plugin"):
        worker.install(CAPS)
    assert _originals() == before


def _kv_caches(n: int = 6, page: int = 64) -> tuple[list[torch.Tensor], torch.Tensor]:
    raw = torch.randint(-128, 128, (n * page,), dtype=torch.int8)
    return [raw.view(torch.float16).view(n, 2, page // 4)], raw


def test_disabled_delegates_to_original(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []

    def spy(kv_caches: object, num_blocks: int, copies: object) -> None:
        calls.append((kv_caches, num_blocks, copies))

    # the seam binds whatever vLLM's helper is at install time
    monkeypatch.setattr(utils, "copy_kv_cache_blocks_inplace", spy)
    monkeypatch.setattr(gpu_model_runner, "copy_kv_cache_blocks_inplace", spy)
    for module, name in V2_SEAMS:
        if name == "copy_kv_cache_blocks_inplace":
            monkeypatch.setattr(module, name, spy)
    _install(monkeypatch, enabled=False)
    assert not worker.is_enabled()
    patched = gpu_model_runner.copy_kv_cache_blocks_inplace
    assert patched is not spy
    kv, _ = _kv_caches()
    copies = [KVCacheBlockCopy(0, 1)]
    reset_copy_stats()
    patched(kv, 6, copies)
    assert calls == [(kv, 6, copies)]
    assert copy_stats().batches == 0
    worker.uninstall()
    assert gpu_model_runner.copy_kv_cache_blocks_inplace is spy


def test_disabled_runs_native_copy_on_unannotated_views(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, enabled=False)
    kv, raw = _kv_caches()
    before = raw.clone().view(6, -1)
    gpu_model_runner.copy_kv_cache_blocks_inplace(kv, 6, [KVCacheBlockCopy(2, 4)])
    after = raw.view(6, -1)
    assert torch.equal(after[4], before[2]) and torch.equal(after[[0, 1, 2, 3, 5]], before[[0, 1, 2, 3, 5]])


def test_enabled_uses_copy_blocks(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, enabled=True)
    kv, raw = _kv_caches()
    before = raw.clone()
    with pytest.raises(CopyValidationError, match="no byte-page metadata"):
        gpu_model_runner.copy_kv_cache_blocks_inplace(kv, 6, [KVCacheBlockCopy(2, 4)])
    assert torch.equal(raw, before)
    annotate(kv, 6)
    reset_copy_stats()
    gpu_model_runner.copy_kv_cache_blocks_inplace(kv, 6, [KVCacheBlockCopy(2, 4), KVCacheBlockCopy(4, 2)])
    assert copy_stats().runs_copied == 1 and copy_stats().block_copies == 2
    rows, old = raw.view(6, -1), before.view(6, -1)
    assert torch.equal(rows[4], old[2]) and torch.equal(rows[2], old[4])
