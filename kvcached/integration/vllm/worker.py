"""Worker-side seams: installed and uninstalled together, as the ``worker`` part of `install_state`.

Model Runner V1, every series in `capabilities.SUPPORTED`, and V2 where kvcached serves it.
Each seam lives with its concern,
and `install` replaces these attributes, each restored exactly by `uninstall`:

* `allocation`: ``GPUModelRunner._allocate_kv_cache_tensors`` while ``allocate_kv_cache`` is
  false (0.26-0.28), else ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` (0.29+); and
  ``GPUModelRunner._init_minimal_kv_cache_for_profiling``, the profiling mark, on every series;
* `view_meta`: ``GPUModelRunner._reshape_kv_cache_tensors`` while ``allocate_kv_cache`` is false;
* `copies`: ``vllm.v1.worker.gpu_model_runner.copy_kv_cache_blocks_inplace``;
* `capacity`: ``vllm.v1.worker.gpu_worker.request_memory``, ``Worker.determine_available_memory``
  and, on the CPU platform, ``CPUWorker.determine_available_memory``;
* `runner_v2`: Model Runner V2, where kvcached serves it (0.26-0.28, and 0.29-0.32 on trial;
  ``Capabilities.model_runner_v2``): ``vllm.v1.worker.gpu_worker.warmup_kernels`` and, from
  0.30, ``Worker.compile_or_warm_up_model`` (the warm-up's scope), with V2's allocation and copy
  names in `allocation` and `copies`; ``VllmConfig.use_v2_model_runner`` where V2 is refused or
  HiSparse exists.

Behind them: `backings` opens and registers the virtual ranges, `rank_kv` finds a rank's
KV space by the address of its tensors, and `engine_config` hands the engine's
`KvcachedConfig` from the capacity report to the allocation.

Whether the seams act is the one switch in `install_state` (decided when the first part
is installed, from ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` unless the installer says): the
plugin only installs when enabled, but a disabled install makes every seam a pure
delegation to vLLM, so tests and tools can install the seams without changing behaviour.

Invariants: `install` checks every seam's vLLM shape before the first attribute is replaced
(a vLLM that differs is refused with nothing patched); `uninstall` restores every attribute
exactly, newest first, and forgets what the seams learned while engines were built (the
last allocation's strides, a pending engine config), leaving registered KV spaces alone:
an engine may still be using them.
"""

from __future__ import annotations

from kvcached.integration.vllm import (
    allocation,
    capacity,
    copies,
    engine_config,
    install_state,
    rank_kv,
    runner_v2,
)
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import PatchSet, Seam

__all__ = ["install", "installed_capabilities", "is_enabled", "uninstall"]

_PART = "worker"

_patches = PatchSet()  # guarded by install_state.LOCK


def is_enabled() -> bool:
    """Whether the installed seams act (False: not installed, or installed disabled)."""
    return install_state.is_enabled(_PART)


def installed_capabilities() -> Capabilities | None:
    """The capabilities the seams were installed for, or None when not installed."""
    return install_state.capabilities(_PART)


def _plan(caps: Capabilities) -> list[Seam]:
    """(owner, attribute, replacement) for every seam, after checking vLLM's shape."""
    copy = copies.seams(caps)  # checked first: without a logical block copy nothing else applies
    return [*allocation.seams(caps), *copy, *capacity.seams(caps), *runner_v2.seams(caps)]


def install(caps: Capabilities, *, enabled: bool | None = None) -> None:
    """Replace the worker-side attributes; idempotent. Nothing is patched on error.

    ``enabled``: the switch (None: the one already recorded in `install_state`, else
    ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` now). Other capabilities or another switch
    than the installed ones raise `IntegrationError`.
    """
    install_state.install_part(_PART, caps, enabled, lambda: _patches.apply(_plan(caps)))  # validates first


def _restore() -> None:
    _patches.restore()
    rank_kv.forget_strides()
    engine_config.forget()


def uninstall() -> None:
    """Restore every replaced attribute exactly (in reverse order); idempotent.

    Registered KV spaces are left alone: an engine may still be using them.
    """
    install_state.uninstall_part(_PART, _restore)
