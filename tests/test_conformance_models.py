"""The tiny-model cache: generating a model leaves the caller safe to fork.

GNU OpenMP is not fork-safe. On the H200, every multiprocess engine whose harness worker had
just written its model hung in EngineCore (a fork of the worker) at its first parallel torch op.
The scenario, with real processes: a fresh interpreter generates a model through
``ensure_model``, forks, and the child runs a parallel torch op. The child must finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

# Exit codes of the script: 0 the child finished, 3 it hung (killed after the hang window).
HANG_S = 120
_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    {warm}
    from conformance.models import ensure_model, model_spec
    path = ensure_model(model_spec("llama", "cuda"))  # bf16: the conversion is a parallel op
    assert (path / "conformance-spec.json").is_file(), path
    import torch
    pid = os.fork()
    if pid == 0:
        torch.zeros((1024, 40960), dtype=torch.int32).fill_(7)  # a parallel op, as vLLM's first
        os._exit(0)
    deadline = time.monotonic() + {hang_s}
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    sys.exit(3)
""")


def _run(tmp_path: Path, warm: str = "", hang_s: int = HANG_S) -> int:
    script = _SCRIPT.replace("{warm}", warm).replace("{hang_s}", str(hang_s))
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=hang_s + 480,
                          # A pool of OpenMP threads, as torch makes by default: the hazard needs one (the
                          # test sessions run engines with one thread, `CPU_ENGINE_ENV`).
                          env={**os.environ, "KVCACHED_MODELS_DIR": str(tmp_path / "models"), "OMP_NUM_THREADS": "2"})
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    return proc.returncode


def test_a_process_that_generated_a_model_can_fork_torch_work(tmp_path: Path) -> None:
    assert _run(tmp_path) == 0, f"the forked child's torch op hung for {HANG_S} s after ensure_model"


def test_the_fork_hang_is_real_when_the_caller_ran_torch_itself(tmp_path: Path) -> None:
    """The negative control: the same fork after the caller's own parallel torch op hangs, so
    the check above would see the hang if ``ensure_model`` ran torch in the caller. (A shorter
    window: a child that is only slow would pass this control, never fail the suite.)"""
    warm = "import torch; torch.zeros((1024, 40960), dtype=torch.int32).fill_(7)"
    assert _run(tmp_path, warm, hang_s=30) == 3
