"""The spec's hybrid serving probe: random-weight Qwen3.5-style attention/GDN model, FP16, TP=1.

It needs a CUDA build of vLLM 0.28 (``pip install vllm==0.28.0`` on a CUDA 12.9+/13 host)
with Model Runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0``), plus transformers with the
``qwen3_5_text`` config, and a GPU. Where any of these is missing it reports ``skipped``
with the reason instead of failing.

When it can run, it starts a native engine and a kvcached engine (each in its own
process, through the conformance harness's engine worker) on prompts of 48, 64, 783, 784,
785 and 1087 tokens with repeated prefixes, sync and async scheduling, and compares token
IDs exactly, like the spec's validation table.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class ServingResult:
    status: str  # "ran" | "skipped"
    reason: str
    rows: tuple[dict[str, object], ...] = ()


def requirements_missing() -> str | None:
    """Why the probe cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (needs a CUDA build: pip install vllm==0.28.0)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    import vllm

    if "cpu" in getattr(vllm, "__version__", ""):
        return f"vLLM {vllm.__version__} is a CPU build; the probe needs the CUDA build"
    if importlib.util.find_spec("conformance") is None:
        return "the conformance package is not importable"
    return None


def run() -> ServingResult:
    reason = requirements_missing()
    if reason is not None:
        return ServingResult("skipped", reason)
    from conformance.gpu import run_hybrid_serving  # type: ignore[import-not-found]

    rows = run_hybrid_serving(
        archetype="qwen3_5", dtype="float16", prompt_lengths=(48, 64, 783, 784, 785, 1087),
        schedulers=("sync", "async"),
    )
    return ServingResult("ran", "", tuple(rows))
