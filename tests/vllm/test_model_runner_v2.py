"""Model Runner V2 is never silent: served where kvcached serves it, else refused by name.

vLLM decides between the runners in one place, ``VllmConfig.use_v2_model_runner``, which it reads
while it validates the engine's config, before any worker, runner or KV tensor exists. Where
kvcached serves V2 (0.26-0.28, and 0.29-0.32 on trial: ``Capabilities.model_runner_v2``) the
decision is vLLM's; elsewhere kvcached's seam wraps it and refuses V2, naming the switches (the
HiSparse refusal and the wrapper per series: ``test_runner_v2_decision``). On CPU vLLM decides V1 by
default (no Triton), so the tests reach V2 two ways, each in its own fresh interpreter with a
real ``LLM``:

* ``env``: vLLM's own switch, ``VLLM_USE_V2_MODEL_RUNNER=1`` (real: the decision is vLLM's);
* ``fake``: the decision itself faked to say V2 (what vLLM's default does on CUDA for dense
  models), by replacing the property before the plugin installs, the one named seam.

Controls: with kvcached disabled the same engines are vLLM's alone (its own failure, never
kvcached's refusal); with kvcached enabled and V1 decided, the engine starts on kvcached. (V2's
own seams are tested without an engine: ``test_worker_alloc``, ``test_runner_v2_warmup``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvcached._vmm", reason="native extension not built")

from conformance.engine_env import engine_env, without_kvcached
from kvcached.integration.vllm.capabilities import detect

TIMEOUT_S = 300


def _child(scenario: str) -> dict[str, object]:
    """Build one engine; report how it ended (the refusal's text, or that it started)."""
    if scenario.startswith("fake"):
        from vllm.config import VllmConfig

        VllmConfig.use_v2_model_runner = property(lambda self: True)  # type: ignore[method-assign,assignment]
    from engine_child import build_llm, engine_kwargs, pool_stats, shutdown

    try:
        llm = build_llm(engine_kwargs("llama"), want_async=False)
    except Exception as e:  # noqa: BLE001 - how the start failed is the result
        from kvcached.integration.vllm.rank_kv import registered_rank_kv

        return {"started": False, "error": f"{type(e).__name__}: {e}", "spaces": len(registered_rank_kv())}
    pools = len(pool_stats())
    shutdown(llm)
    return {"started": True, "pools": pools}


_ENDED: dict[str, dict[str, object]] = {}  # scenario -> how its engine ended (one child per scenario)


def _run(scenario: str, tmp_path: Path) -> dict[str, object]:
    if scenario not in _ENDED:
        _ENDED[scenario] = _start(scenario, tmp_path)
    return _ENDED[scenario]


def _start(scenario: str, tmp_path: Path) -> dict[str, object]:
    env = {k: v for k, v in without_kvcached(dict(os.environ)).items() if k != "VLLM_PLUGINS"}
    env.update(engine_env("cpu"))
    env["KVCACHED_ENABLE"] = "0" if scenario.endswith("-off") else "1"
    if scenario.startswith("env"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run([sys.executable, __file__, scenario, str(out)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False, cwd=Path(__file__).parent)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result: dict[str, object] = json.loads(out.read_text())
    return result


SERVES_V2 = detect().model_runner_v2


@pytest.mark.skipif(SERVES_V2, reason="kvcached serves Model Runner V2 on this vLLM series")
@pytest.mark.parametrize("scenario", ["env", "fake"])
def test_v2_is_refused_at_start_up_by_name(scenario: str, tmp_path: Path) -> None:
    got = _run(scenario, tmp_path)
    assert got["started"] is False
    assert str(got["error"]).startswith("IntegrationError: vLLM selected Model Runner V2")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(got["error"])
    assert got["spaces"] == 0, "a KV space was built before the refusal"


@pytest.mark.skipif(not SERVES_V2, reason="kvcached refuses Model Runner V2 on this vLLM series")
@pytest.mark.parametrize("scenario", ["env", "fake"])
def test_where_kvcached_serves_v2_the_decision_is_vllms(scenario: str, tmp_path: Path) -> None:
    """Served: kvcached changes no decision; on CPU vLLM then refuses V2 itself (no Triton),
    exactly as with kvcached off."""
    got = _run(scenario, tmp_path)
    assert got == _run(f"{scenario}-off", tmp_path)


@pytest.mark.parametrize("scenario", ["env-off", "fake-off"])
def test_disabled_kvcached_leaves_the_decision_to_vllm(scenario: str, tmp_path: Path) -> None:
    """vLLM alone: V2 really was decided (vLLM's own refusal on CPU, where it has no Triton),
    and nothing of kvcached's took part."""
    got = _run(scenario, tmp_path)
    error = str(got.get("error", ""))
    assert got["started"] is False and "Model Runner V2 requires Triton" in error
    assert "kvcached" not in error and "Model Runner V1 only" not in error


def test_v1_decided_starts_on_kvcached(tmp_path: Path) -> None:
    got = _run("v1", tmp_path)
    assert got == {"started": True, "pools": 1}


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_child(sys.argv[1])))
