"""Model Runner V2: the runner decision, and V2's warm-up over kvcached's ranges.

V2 (``vllm/v1/worker/gpu/``) is what vLLM picks by default on CUDA for dense models. Where
kvcached serves it (``Capabilities.model_runner_v2``: 0.26-0.28, and 0.29-0.32 on trial), its
KV tensors, views and block copies go through the same seams as V1's (`allocation`,
`view_meta`, `copies`), and this module adds what only V2 does. Elsewhere V2 is refused by name.

``VllmConfig.use_v2_model_runner`` (where kvcached does not serve V2, or HiSparse exists)
    vLLM's one decision between the runners, a property read while the engine's config is
    validated and again as each worker starts. A decision for V2 while kvcached acts raises
    `IntegrationError` (`v2_refusal`) where kvcached does not serve V2, naming
    ``VLLM_USE_V2_MODEL_RUNNER=0`` (and, where the V2 rows are drafted, the trial switch), and
    wherever HiSparse is configured (0.30+: it allocates KV through ``init_hisparse_kv_cache``,
    past the allocation seam, and keeps host-tier blocks kvcached's pool does not know).
    Otherwise it answers exactly as vLLM's.

``vllm.v1.worker.gpu_worker.warmup_kernels`` (V2 only)
    V2 compiles its kernels with two real steps of dummy requests whose blocks vLLM numbers
    1, 2, ... itself, with no block pool (``gpu/warmup.py``). Over kvcached's ranges only the
    null block's page is mapped then, so a kernel writing those blocks would fault. The seam
    gives vLLM's function a step that first maps the kv pages of every block its scheduler
    output names (`WarmupPages`), through the rank's own page protocol (`RankPages.handle`,
    charged to its budget slot like any map).

``gpu_worker.Worker.compile_or_warm_up_model`` (0.30+, ``v2_warmup_before_capture``)
    From 0.30 the worker warms V2 up *before* CUDA-graph capture, and capture runs the model
    on the block tables the warm-up left. So there the lent pages stay mapped until the
    worker's whole warm-up returns; on 0.26-0.29 (warm-up after capture) until
    ``warmup_kernels`` returns. Either way they are unmapped before the scheduler exists.

Invariants: the refusal comes at start-up, before any runner or KV tensor exists, so
nothing is built; after warm-up the rank maps what it mapped before (the pool adopts exactly
that), unless an unmap failed, which its books and the log name; disabled, every seam here is
vLLM's own.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvcached.errors import DriverError, IntegrationError, PhysicalMemoryExhausted
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import Seam, own, require_own, require_vllm_helper
from kvcached.integration.vllm.rank_kv import RankKv, rank_kv_of
from kvcached.ranks import PageRequest

__all__ = ["HISPARSE_REFUSAL", "WarmupPages", "scheduled_block_ids", "seams", "v2_refusal"]

_logger = logging.getLogger(__name__)

HISPARSE_REFUSAL = (
    "HiSparse (attention_config.hisparse_config) allocates the KV cache through "
    "init_hisparse_kv_cache, past kvcached's allocation, and keeps blocks in a host tier kvcached's "
    "pool does not track; kvcached does not serve it. Run it with KVCACHED_ENABLE=0"
)


def v2_refusal(caps: Capabilities) -> str:
    """Why V2 is refused on ``caps``'s series (one whose V2 rows are drafted, run without
    trial: the only series in the supported range where kvcached does not serve V2)."""
    return (f"vLLM selected Model Runner V2 for this engine, and kvcached serves Model Runner V2 on vLLM "
            f"0.26-0.28, and 0.29-0.32 on trial: on vLLM {caps.version} its V2 seams are drafted from the "
            "wheel's source and no engine has run them yet; KVCACHED_VLLM_TRIAL=1 accepts them on trial. Set "
            "VLLM_USE_V2_MODEL_RUNNER=0 to run V1 with kvcached (features that exist only in V2, such as "
            "watermark_config, keep V2 selected), or KVCACHED_ENABLE=0 to run V2 without kvcached")


# ---- the decision ---------------------------------------------------------------------------
def _wrap_v2_decision(original: property, caps: Capabilities) -> property:
    """``VllmConfig.use_v2_model_runner`` that refuses what kvcached does not serve (the module)."""
    decide = original.fget
    assert decide is not None

    @functools.wraps(decide)
    def use_v2_model_runner(self: Any) -> bool:
        v2 = bool(decide(self))
        if v2 and install_state.is_enabled():
            if not caps.model_runner_v2:
                raise IntegrationError(v2_refusal(caps))
            if caps.hisparse and getattr(self.attention_config, "hisparse_config", None) is not None:
                raise IntegrationError(HISPARSE_REFUSAL)
        return v2

    return property(use_v2_model_runner, original.fset, original.fdel, original.__doc__)


def _decision_seam(caps: Capabilities) -> Seam:
    from vllm.config import VllmConfig

    decision = own(VllmConfig, "use_v2_model_runner")
    if not isinstance(decision, property) or decision.fget is None:
        raise IntegrationError("vllm.config.VllmConfig.use_v2_model_runner is not the property kvcached "
                               "expects (vLLM's Model Runner V1/V2 decision)")
    return (VllmConfig, "use_v2_model_runner", _wrap_v2_decision(decision, caps))


# ---- the warm-up ----------------------------------------------------------------------------
def scheduled_block_ids(scheduler_output: Any) -> set[int]:
    """Every block a scheduler output hands the runner: new requests' blocks, running
    requests' new blocks, and the blocks it asks to zero."""
    blocks: set[int] = set()
    for request in scheduler_output.scheduled_new_reqs:
        for group in request.block_ids:
            blocks.update(group)
    for new in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for group in new or ():
            blocks.update(group)
    blocks.update(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    return blocks


class WarmupPages:
    """The kv pages one rank maps for a warm-up beyond what it held, unmapped by `release`.

    Invariant: ``lent`` are exactly the pages `cover` mapped and `release` has not unmapped.
    """

    def __init__(self, kv: RankKv) -> None:
        self.kv = kv
        self.lent: list[int] = []
        self.pages_lent = 0  # over the warm-up, for its log line
        self.driver_s = 0.0  # seconds in the rank's maps and unmaps

    def cover(self, block_ids: Iterable[int]) -> None:
        """Map the kv pages of ``block_ids`` the rank does not map yet; a refusal raises
        `PhysicalMemoryExhausted` or `DriverError` naming the warm-up (nothing of it mapped)."""
        pages = self.kv.pages
        wanted = sorted({b // pages.geometry.blocks_per_page for b in block_ids} - pages.mapped)
        if not wanted:
            return
        t0 = time.perf_counter()
        reply = pages.handle(PageRequest("map", tuple(wanted)))
        self.driver_s += time.perf_counter() - t0
        if not reply.ok:
            error = PhysicalMemoryExhausted if reply.refusal == "exhausted" else DriverError
            raise error(f"Model Runner V2's warm-up needs kv pages {wanted} for its dummy requests' blocks on "
                        f"rank {pages.rank}, and the map was refused: {reply.message}")
        self.lent.extend(wanted)
        self.pages_lent += len(wanted)

    def release(self) -> None:
        """Unmap every lent page. A failed unmap is logged, not raised: the rank's books keep
        what it left mapped (`RankPages`), and the pool adopts those pages as mapped."""
        if not self.lent:
            return
        pages, self.lent = tuple(self.lent), []
        t0 = time.perf_counter()
        reply = self.kv.pages.handle(PageRequest("unmap", pages))
        self.driver_s += time.perf_counter() - t0
        if not reply.ok:
            _logger.warning("kvcached: after Model Runner V2's warm-up, rank %d could not unmap kv pages %s "
                            "(%s); they stay mapped and the pool adopts them", self.kv.pages.rank,
                            list(reply.held), reply.message)


def _kv_of_runner(model_runner: Any) -> RankKv | None:
    """The KV space the runner's tensors lie on (None: not kvcached's, or no KV tensors)."""
    for entry in getattr(model_runner, "kv_caches", ()):
        for tensor in _flat(entry):
            return rank_kv_of(tensor)
    return None


def _flat(entry: Any) -> Iterator[Any]:
    yield from entry if isinstance(entry, (list, tuple)) else (entry,)


#: The `WarmupPages` of the worker's warm-up in progress on this thread (0.30+: it outlives
#: ``warmup_kernels`` until ``compile_or_warm_up_model`` returns, CUDA-graph capture included).
_scope = threading.local()


def _wrap_warmup(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def warmup_kernels(model_runner: Any, worker_execute_model: Callable[[Any], Any],
                       worker_sample_tokens: Callable[..., Any]) -> None:
        kv = _kv_of_runner(model_runner) if install_state.is_enabled() else None
        if kv is None:
            original(model_runner, worker_execute_model, worker_sample_tokens)
            return
        held: WarmupPages | None = getattr(_scope, "lease", None)
        lease = held if held is not None and held.kv is kv else WarmupPages(kv)

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            lease.cover(scheduled_block_ids(scheduler_output))
            return worker_execute_model(scheduler_output, *args, **kwargs)

        t0 = time.perf_counter()
        try:
            original(model_runner, execute_model, worker_sample_tokens)
        finally:
            if lease is not held:
                lease.release()
        # Seen on an H100 (12-05): kvcached's engines took 13 s more from CUDA-graph capture to
        # the end of start-up than native's; this says how much of that is the warm-up's.
        _logger.info("kvcached: Model Runner V2's warm-up took %.2f s on rank %d, %.3f s of it mapping and "
                     "unmapping the %d kv page(s) it lent", time.perf_counter() - t0, kv.pages.rank,
                     lease.driver_s, lease.pages_lent)

    return warmup_kernels


def _wrap_compile_or_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
    """The worker's warm-up as the scope of the pages V2's warm-up lends (0.30+)."""

    @functools.wraps(original)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        kv = _kv_of_runner(self.model_runner) if install_state.is_enabled() else None
        if kv is None or getattr(_scope, "lease", None) is not None:
            return original(self, *args, **kwargs)
        _scope.lease = lease = WarmupPages(kv)
        try:
            return original(self, *args, **kwargs)
        finally:
            _scope.lease = None
            lease.release()

    return compile_or_warm_up_model


def seams(caps: Capabilities) -> list[Seam]:
    """V2's warm-up seams where kvcached serves V2; the decision where it refuses V2 or
    HiSparse exists; vLLM's shape checked."""
    plan = [_decision_seam(caps)] if not caps.model_runner_v2 or caps.hisparse else []
    if not caps.model_runner_v2:
        return plan
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import warmup

    original = require_vllm_helper(gpu_worker, "warmup_kernels", warmup)
    plan.append((gpu_worker, "warmup_kernels", _wrap_warmup(original)))
    if caps.v2_warmup_before_capture:
        # Not exclusive: CPUWorker overrides it, and runs no V2 (which needs Triton) and no warm-up.
        worker = gpu_worker.Worker
        warm_up = require_own(worker, "compile_or_warm_up_model", exclusive=False)
        plan.append((worker, "compile_or_warm_up_model", _wrap_compile_or_warm_up(warm_up)))
    return plan
