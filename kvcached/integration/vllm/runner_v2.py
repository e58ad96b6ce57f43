"""The Model Runner V2 refusal: kvcached serves Model Runner V1 only.

``VllmConfig.use_v2_model_runner`` (Model Runner V2)
    vLLM's one decision between the runners, a property read while the engine's config is
    validated. While kvcached acts, a decision for V2 raises `IntegrationError` naming
    ``VLLM_USE_V2_MODEL_RUNNER=0`` (`V2_REFUSAL`): V2 allocates and copies KV through its own
    names, which the V1 seams (`allocation`, `copies`) do not reach (``docs/model-runner-v2.md``).

Invariants: the refusal comes at start-up, before any worker, runner or KV tensor exists, so
nothing is built; disabled, or deciding V1, the property answers exactly as vLLM's, and its
setter, deleter and doc are vLLM's.
"""

from __future__ import annotations

import functools
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.patching import Seam, own

__all__ = ["V2_REFUSAL", "seams"]

V2_REFUSAL = (
    "vLLM selected Model Runner V2 for this engine, and kvcached serves Model Runner V1 only (V2 "
    "allocates and copies KV through other functions: docs/model-runner-v2.md). Set "
    "VLLM_USE_V2_MODEL_RUNNER=0 to run V1 with kvcached (features that exist only in V2, such as "
    "watermark_config or HiSparse, keep V2 selected), or KVCACHED_ENABLE=0 to run V2 without kvcached"
)


def _wrap_v2_decision(original: property) -> property:
    """``VllmConfig.use_v2_model_runner`` that refuses V2 while kvcached acts.

    vLLM reads this decision when it validates the engine's config, before any worker, runner
    or KV tensor exists, so the refusal comes at start-up with nothing built. Disabled (or
    deciding V1), it returns vLLM's own answer.
    """
    decide = original.fget
    assert decide is not None

    @functools.wraps(decide)
    def use_v2_model_runner(self: Any) -> bool:
        v2 = bool(decide(self))
        if v2 and install_state.is_enabled():
            raise IntegrationError(V2_REFUSAL)
        return v2

    return property(use_v2_model_runner, original.fset, original.fdel, original.__doc__)


def seams() -> list[Seam]:
    """The refusal seam, after checking that vLLM's decision is still the property it wraps."""
    from vllm.config import VllmConfig

    decision = own(VllmConfig, "use_v2_model_runner")
    if not isinstance(decision, property) or decision.fget is None:
        raise IntegrationError("vllm.config.VllmConfig.use_v2_model_runner is not the property kvcached "
                               "expects (vLLM's Model Runner V1/V2 decision)")
    return [(VllmConfig, "use_v2_model_runner", _wrap_v2_decision(decision))]
