"""The spec's hybrid serving probe: random-weight Qwen3.5-style attention/GDN model, FP16, TP=1.

It needs a CUDA build of vLLM 0.28 (``pip install vllm==0.28.0`` on a CUDA 12.9+/13 host)
with Model Runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0``), plus transformers with the
``qwen3_5_text`` config, and a GPU. Where any of these is missing it reports ``skipped``
with the reason instead of failing.

When it can run, it runs the conformance harness (native and kvcached engines, each in its
own process) on the hybrid attention/GDN archetype, sync and async scheduling, with the
harness's geometry-derived boundary lengths and repeated/partial prefixes, and reports the
harness's verdict. It has not been run: no machine available here has a CUDA build of
vLLM, and the harness's engine arguments were tuned on CPU.
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


def run(reports_dir: str = "reports/gpu/serving") -> ServingResult:
    """Run the conformance harness on the hybrid GDN archetype with a CUDA vLLM."""
    reason = requirements_missing()
    if reason is not None:
        return ServingResult("skipped", reason)
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "conformance", "--archetypes", "qwen3_next", "--schedulers", "sync,async",
           "--reports-dir", reports_dir, "--run-id", "hybrid-serving"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    status = "ran" if proc.returncode == 0 else "failed"
    tail = (proc.stdout + proc.stderr)[-2000:]
    return ServingResult(status, f"exit {proc.returncode}; report under {reports_dir}/hybrid-serving",
                         ({"command": " ".join(cmd[1:]), "tail": tail},))
