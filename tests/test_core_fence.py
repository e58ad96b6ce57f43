"""The step fences of the core (`kvcached.fence`), without any engine."""

from __future__ import annotations

import pytest

from kvcached.errors import InvariantError
from kvcached.fence import EngineStepFence


def test_engine_step_fence_tickets_skip_steps_without_kv_work() -> None:
    """The async engine idles with an empty step queued; pages freed before it must go back."""
    fence = EngineStepFence()
    first = fence.begin_step()
    assert fence.ticket() == first
    empty = fence.begin_step()
    fence.mark_kv_free(empty)
    assert fence.ticket() == first, "the queued empty step touches no page"
    fence.end_step()  # the first step executed; the empty one is still queued
    assert fence.passed(fence.ticket())
    fence.end_step()
    busy = fence.begin_step()
    assert fence.ticket() == busy
    with pytest.raises(InvariantError, match="not in flight"):
        fence.mark_kv_free(empty)


def test_the_core_fence_module_imports_no_engine() -> None:
    """Core policy: importing `kvcached.fence` in a fresh interpreter loads no vLLM."""
    import subprocess
    import sys

    code = "import sys, kvcached.fence; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
