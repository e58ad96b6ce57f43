"""Capacity seams: the KV capacity, in bytes, the worker reports to the engine, and its device share.

vLLM derives ``num_blocks`` from the capacity the worker reports. kvcached's KV tensors are
virtual: nothing is committed when they are made, pages are mapped per admission and given
back when idle, and an admission that finds no physical memory is a scheduling miss, not an
error. So the worker reports the *virtual* capacity vLLM would use, capped by the physical
budget kvcached is configured with (`physical_cap_bytes`: ``KVCACHED_BUDGET_BYTES``, else the
limit of the shared budget file ``KVCACHED_BUDGET_PATH``): blocks beyond the budget could
never be mapped, and reporting them would only turn every admission past the budget into a
miss. Without a budget the native capacity is reported unchanged. The report is the
engine's first seam that needs its config, so it resolves it (`engine_config`).

``CPUWorker.determine_available_memory`` (CPU platform only)
    vLLM sizes the CPU KV cache from ``kv_cache_memory_bytes`` (or
    ``VLLM_CPU_KVCACHE_SPACE``) and refuses a size above the node's currently available
    memory, i.e. it demands the whole cache up front. With an explicit size kvcached
    runs vLLM's model warm-up and reports that size, capped, without the up-front check.
    Without one, vLLM's own RSS-based sizing (and its checks) runs and its result is
    capped.

``Worker.determine_available_memory`` and ``vllm.v1.worker.gpu_worker.request_memory``
(GPU; unit-tested, but no GPU engine has run them yet: this project's CI has no GPU)
    ``Worker.init_device`` calls ``request_memory``, which takes ``total memory x
    gpu_memory_utilization`` as this engine's share and refuses to start unless that
    much is free *now*. Peers sharing the device through kvcached legitimately hold
    memory they will give back, so the replacement returns the same share without the
    free-memory check. ``determine_available_memory`` keeps vLLM's profiling: the share
    minus what this process's profile run measured (weights, activation peak, non-torch
    growth during the run, CUDA-graph estimate), or ``kv_cache_memory_bytes`` when set
    (vLLM then profiles without any free-memory arithmetic); the result is the virtual
    capacity and is capped by the budget. Memory peers hold at start-up is in neither
    snapshot difference, so it does not shrink the capacity. Limitation, left visible:
    a peer that maps or unmaps pages *during* this engine's profile run changes the
    measured non-torch growth (a release even trips vLLM's own assertion). Co-located
    engines should pass ``kv_cache_memory_bytes``, whose path has no such arithmetic.
    Other ``Worker`` subclasses that override ``determine_available_memory`` (XPU) run
    on devices kvcached does not back (`backings.device_string` refuses them).

Versions: these seams are checked against vLLM 0.28.0's to 0.32.0's source. `seams` checks
the shape they rely on (the attributes exist where expected, ``request_memory`` is still
vLLM's helper) and refuses, patching nothing, a vLLM that differs. Two capability rows
follow vLLM: from 0.30 the CPU warm-up runs when ``CPUWorker._should_warm_up_model()`` says
so (``cpu_warmup_decision``); from 0.32 ``request_memory`` takes the weights held outside
the process and subtracts them from the share (``request_memory_external``).

Invariant: the reported capacity is never above the physical budget when there is one, and
disabled (`install_state`) every seam here returns vLLM's own answer.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from kvcached.budget import expected_limit, record_path
from kvcached.config import KvcachedConfig
from kvcached.errors import IntegrationError
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.backings import device_string, host_default
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.engine_config import resolve_engine_config
from kvcached.integration.vllm.patching import Seam, require_own

__all__ = ["capped_kv_bytes", "physical_cap_bytes", "seams"]

_logger = logging.getLogger(__name__)


def physical_cap_bytes(config: KvcachedConfig | None = None, device: str = "cpu") -> int | None:
    """The physical bytes this engine's KV pages may ever occupy, or None (no limit).

    ``budget_bytes`` wins (the engine will ask the device's record for exactly that limit).
    Otherwise the lower of the limit its claim would be under (`kvcached.budget.expected_limit`:
    live engines' limit, else the device limit; never a stale one an earlier engine left)
    and, on CPU, the host budget the engine would derive now (`backings.host_default`).
    """
    config = config if config is not None else KvcachedConfig.resolve()
    if config.budget_bytes is not None:
        return config.budget_bytes
    if record_path(config.budget_path, device) is None:
        return None  # budgets off: nothing is limited
    default = host_default(config, device)
    limits = [default, expected_limit(config.budget_path, device, default)]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def capped_kv_bytes(virtual_bytes: int, config: KvcachedConfig | None = None, device: str = "cpu") -> int:
    """The KV capacity to report: ``virtual_bytes``, at most the physical budget."""
    cap = physical_cap_bytes(config, device)
    reported = int(virtual_bytes) if cap is None else min(int(virtual_bytes), cap)
    _logger.info("kvcached: KV capacity %d bytes (virtual %d, physical budget %s)", reported,
                 int(virtual_bytes), "none" if cap is None else cap)
    return reported


def _wrap_cpu_determine(original: Callable[..., int], caps: Capabilities) -> Callable[..., int]:
    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        if not install_state.is_enabled():
            return original(self)
        config = resolve_engine_config(getattr(self, "vllm_config", None))
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is None:
            return capped_kv_bytes(original(self), config)  # vLLM's RSS-based sizing, checks included
        # vLLM's version warms the model up first (0.30+: when its own decision says so),
        # then checks `explicit` against the node's available memory; the KV tensors are
        # virtual, so only the warm-up applies.
        if not caps.cpu_warmup_decision or self._should_warm_up_model():
            self.model_runner.warming_up_model()
        return capped_kv_bytes(explicit, config)

    return determine_available_memory


def _wrap_gpu_determine(original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        available = original(self)
        if not install_state.is_enabled():
            return available
        return capped_kv_bytes(available, resolve_engine_config(getattr(self, "vllm_config", None)),
                               device_string(torch.device(self.device)))

    return determine_available_memory


def _share(init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0) -> int:
    """vLLM's share of the device, without "that much must be free now": peers' elastic
    pages come and go, and kvcached admits only what can be mapped. Weights held outside
    the process (0.32+) are not part of it, as in vLLM."""
    share = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    return share - external_weight_memory if external_weight_memory > 0 else share


def _wrap_request_memory(original: Callable[..., int], caps: Capabilities) -> Callable[..., int]:
    if caps.request_memory_external:

        @functools.wraps(original)
        def request_memory_external(init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0) -> int:
            if not install_state.is_enabled():
                return original(init_snapshot, cache_config, external_weight_memory)
            return _share(init_snapshot, cache_config, external_weight_memory)

        return request_memory_external

    @functools.wraps(original)
    def request_memory(init_snapshot: Any, cache_config: Any) -> int:
        if not install_state.is_enabled():
            return original(init_snapshot, cache_config)
        return _share(init_snapshot, cache_config)

    return request_memory


def seams(caps: Capabilities) -> list[Seam]:
    """The capacity seams (see the module docstring), after checking vLLM's shape."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_worker, utils

    request = require_own(gpu_worker, "request_memory")
    if request is not utils.request_memory:
        raise IntegrationError(
            "vllm.v1.worker.gpu_worker.request_memory is not vLLM's helper; another plugin replaced it"
        )
    # CPUWorker overrides determine_available_memory and gets its own seam below.
    plan: list[Seam] = [
        (gpu_worker, "request_memory", _wrap_request_memory(request, caps)),
        (gpu_worker.Worker, "determine_available_memory",
         _wrap_gpu_determine(require_own(gpu_worker.Worker, "determine_available_memory", exclusive=False))),
    ]
    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_worker

        cpu = cpu_worker.CPUWorker
        if caps.cpu_warmup_decision:
            require_own(cpu, "_should_warm_up_model")
        plan.append((cpu, "determine_available_memory",
                     _wrap_cpu_determine(require_own(cpu, "determine_available_memory"), caps)))
    return plan
