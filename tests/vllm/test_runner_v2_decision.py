"""The runner decision seam, per series: what kvcached refuses of Model Runner V2, and why.

``VllmConfig.use_v2_model_runner`` is wrapped where kvcached does not serve V2 (a series whose V2
rows are drafted, without trial) or where HiSparse exists (0.30+). The wrapper is built here from
each series' capability row around a decision that says V2 (what vLLM's default says on CUDA for
dense models) or V1, with kvcached's worker seams really installed (enabled or disabled). The
engine-level refusal on the installed vLLM is ``test_model_runner_v2``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("kvcached._vmm", reason="native extension not built")

from worker_env import worker_installed

from kvcached.errors import IntegrationError
from kvcached.integration.vllm import worker
from kvcached.integration.vllm.capabilities import Capabilities, capabilities_for, detect
from kvcached.integration.vllm.runner_v2 import HISPARSE_REFUSAL, _wrap_v2_decision, v2_refusal


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with worker_installed(monkeypatch, 4096):
        yield


def config(hisparse: object = None) -> SimpleNamespace:
    """What the wrapper reads of a ``VllmConfig`` (0.29 has no ``hisparse_config`` at all)."""
    return SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=hisparse))


def decide(caps: Capabilities, v2: bool, cfg: SimpleNamespace) -> bool:
    wrapped = _wrap_v2_decision(property(lambda self: v2), caps)
    return bool(wrapped.__get__(cfg))


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.32.0"])
def test_a_drafted_series_without_trial_refuses_v2_naming_the_trial_switch(version: str) -> None:
    caps = capabilities_for(version)
    with pytest.raises(IntegrationError) as refused:
        decide(caps, True, config())
    text = str(refused.value)
    assert text == v2_refusal(caps) and f"on vLLM {version} its V2 seams are drafted" in text
    assert "KVCACHED_VLLM_TRIAL=1" in text and "VLLM_USE_V2_MODEL_RUNNER=0" in text
    assert decide(caps, False, config()) is False  # V1: vLLM's answer


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0"])
def test_hisparse_is_refused_by_name_where_v2_is_served(version: str) -> None:
    caps = capabilities_for(version, trial=True)
    assert caps.model_runner_v2 and caps.hisparse
    with pytest.raises(IntegrationError, match="HiSparse") as refused:
        decide(caps, True, config(hisparse=object()))
    assert str(refused.value) == HISPARSE_REFUSAL and "KVCACHED_ENABLE=0" in HISPARSE_REFUSAL
    assert decide(caps, True, config()) is True  # V2 without HiSparse: served, vLLM's answer


def test_0_29_has_no_hisparse_and_serves_v2_on_trial() -> None:
    caps = capabilities_for("0.29.0", trial=True)
    assert caps.model_runner_v2 and not caps.hisparse
    assert decide(caps, True, SimpleNamespace(attention_config=SimpleNamespace())) is True


def test_disabled_kvcached_leaves_every_decision_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    worker.uninstall()
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    worker.install(detect())
    for caps in (capabilities_for("0.30.0"), capabilities_for("0.30.0", trial=True)):
        assert decide(caps, True, config(hisparse=object())) is True


def test_a_series_kvcached_serves_without_hisparse_installs_no_decision_seam() -> None:
    """0.26-0.28: the decision is vLLM's own property (the fewest seams)."""
    from vllm.config import VllmConfig

    from kvcached.integration.vllm.patching import own

    caps = detect()
    if not caps.model_runner_v2 or caps.hisparse:
        pytest.skip("this series refuses V2 or has HiSparse: the decision seam is installed")
    decision = own(VllmConfig, "use_v2_model_runner")  # with the worker seams installed (the fixture)
    assert decision.fget.__module__ == "vllm.config.vllm" and not hasattr(decision.fget, "__wrapped__")
