"""The spec's hybrid serving probe: random-weight Qwen3.5 attention/GDN model, FP16, TP=1.

It runs the conformance harness on its ``qwen3_5`` archetype: a tiny random-weight
``Qwen3_5ForCausalLM`` (3 gated-DeltaNet layers + 1 full-attention layer, FP16), TP=1,
Model Runner V1, eager execution, Triton attention, hash granularity 16, text only; native
and kvcached engines each in their own process, sync and async scheduling, boundary prompt
lengths derived from the engine's real block size (the spec's 783/784/785 for its
784-token block), repeated and partial prefixes, and the CoW-admission fault plan; token-ID
parity with the harness's negative controls.

It needs: a CUDA device; a CUDA build of vLLM 0.28 (``pip install vllm==0.28.0``; the
harness sets ``VLLM_USE_V2_MODEL_RUNNER=0``); torchvision (vLLM's Qwen3.5 module imports
its vision sibling even for text); transformers with ``Qwen3_5TextConfig``. Where any is
missing it reports ``skipped`` with the reason instead of failing. It has not run: the
machines available here have either no GPU or no vLLM.
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
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (vLLM's Qwen3.5 module imports it)"
    import transformers

    if not hasattr(transformers, "Qwen3_5TextConfig"):
        return f"transformers {transformers.__version__} has no Qwen3_5TextConfig"
    if importlib.util.find_spec("conformance") is None:
        return "the conformance package is not importable"
    return None


def run(reports_dir: str = "reports/gpu/serving") -> ServingResult:
    """Run the conformance harness on the hybrid GDN archetype with a CUDA vLLM."""
    reason = requirements_missing()
    if reason is not None:
        return ServingResult("skipped", reason)
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "conformance", "--archetypes", "qwen3_5", "--schedulers", "sync,async",
           "--reports-dir", reports_dir, "--run-id", "hybrid-serving"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    status = "ran" if proc.returncode == 0 else "failed"
    tail = (proc.stdout + proc.stderr)[-2000:]
    return ServingResult(status, f"exit {proc.returncode}; report under {reports_dir}/hybrid-serving",
                         ({"command": " ".join(cmd[1:]), "tail": tail},))
