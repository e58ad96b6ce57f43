"""A compiled CUDA vLLM engine with kvcached: exact, and its CUDA graphs valid, across unmap and remap.

Runs only where a CUDA build of vLLM sees a GPU (the H200 host through the offline bundle,
``serving_probes.gpu_bundle``); anywhere else it is skipped with the reason. It runs the
device-memory probe's engines (`serving_probes.gpu_memory`: the same code as the committed
report) on a smaller burst: native, then kvcached, then a second kvcached engine beside the
first. Every check of the probe must hold, among them: the burst's pages are unmapped once the
engine is idle and mapped again in the next burst (the pool's counters), the KV tensors keep
their addresses, the captured graphs replay in both bursts, and both bursts give native's tokens.
It runs twice: on Model Runner V1, and on the runner vLLM picks itself (V2 for this dense model
on CUDA), which each engine must have run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    import vllm

    if "cpu" in vllm.__version__:
        return f"vLLM {vllm.__version__} is a CPU build"
    if importlib.util.find_spec("pynvml") is None:
        return "pynvml (nvidia-ml-py) is not installed"
    return None


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "")


@pytest.mark.parametrize(("model_runner", "ran"), [("v1", "V1"), ("vllm", "V2")])
def test_compiled_engine_survives_unmap_and_remap(model_runner: str, ran: str, tmp_path: Path) -> None:
    """``vllm``: the runner vLLM picks for this dense model on CUDA, Model Runner V2."""
    from serving_probes.gpu_memory import Workload, checks, measure

    runs = measure(Workload(requests=16, prompt_tokens=600, max_tokens=32, model_runner=model_runner), tmp_path)
    errors = {r.side: r.error for r in runs if r.error}  # first: an engine that failed ran no runner at all
    assert not errors, errors
    assert {r.model_runner.startswith("vllm.v1.worker.gpu.") for r in runs} == {ran == "V2"}, [r.model_runner for r in runs]
    failed = {name: holds for name, holds in checks(runs).items() if not holds}
    assert not failed, failed
    kvc = next(r for r in runs if r.side == "kvcached")
    # The counters the checks read, spelled out: pages went, and came back.
    went = kvc.counters["idle after burst 1"]["unmaps"] - kvc.counters["after burst 1"]["unmaps"]
    came = kvc.counters["after burst 2"]["maps"] - kvc.counters["idle after burst 1"]["maps"]
    assert went > 0 and came > 0
