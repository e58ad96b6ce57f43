"""The block-copy seam: vLLM's logical block copies, through kvcached's validated copy.

``vllm.v1.worker.gpu_model_runner.copy_kv_cache_blocks_inplace`` (every series), and
``vllm.v1.worker.gpu.model_runner.copy_kv_cache_blocks_inplace`` (Model Runner V2, 0.26-0.28)
    The names the runners imported (patching ``vllm.v1.worker.utils`` would have no
    effect); `seams` refuses a vLLM where it is no longer that helper. When kvcached is
    disabled it calls the original; otherwise `kvcached.copy.copy_blocks`, which validates
    first and copies each backing's byte runs once, reading the views' byte-page metadata
    (`view_meta`). The runner's call site and timing are untouched. vLLM 0.29's own helper
    copies view by view and would only touch the listed blocks, but it copies views that
    overlay one backing (hybrid groups) once each, so a batch where a block is both a
    destination and a later source is applied twice over the same bytes, and it validates
    nothing before writing; kvcached's copy is kept on every series.

Invariant: a copy batch is validated whole before any byte is written; its faults come from
the rank that owns the KV tensors (fault site ``copy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvcached.copy import copy_blocks
from kvcached.errors import IntegrationError
from kvcached.faults import FaultInjector
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import Seam, require_vllm_helper
from kvcached.integration.vllm.rank_kv import rank_kv_of

__all__ = ["seams"]


def _wrap_copy(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def copy_kv_cache_blocks_inplace(kv_caches: Any, num_blocks: int, kv_cache_block_copies: Any) -> None:
        if not install_state.is_enabled():
            original(kv_caches, num_blocks, kv_cache_block_copies)
            return
        copy_blocks(kv_caches, num_blocks, kv_cache_block_copies, faults=_copy_faults(kv_caches))

    return copy_kv_cache_blocks_inplace


def _copy_faults(kv_caches: Any) -> FaultInjector | None:
    """The fault injector of the rank whose KV tensors these are (fault site ``copy``)."""
    for entry in kv_caches:
        for tensor in entry if isinstance(entry, (list, tuple)) else (entry,):
            kv = rank_kv_of(tensor)
            return kv.pages.faults if kv is not None else None
    return None


def seams(caps: Capabilities) -> list[Seam]:
    """The copy seam (and Model Runner V2's, where kvcached serves it), after checking that this
    vLLM copies logical blocks through vLLM's helper."""
    if not caps.logical_block_copy:
        raise IntegrationError(f"vLLM {caps.version} has no logical block copy helper")
    from vllm.v1.worker import gpu_model_runner, utils

    runners = [gpu_model_runner]
    if caps.model_runner_v2:
        from vllm.v1.worker.gpu import model_runner as model_runner_v2

        runners.append(model_runner_v2)
    name = "copy_kv_cache_blocks_inplace"
    return [(module, name, _wrap_copy(require_vllm_helper(module, name, utils))) for module in runners]
