"""What users run: `vllm serve` with kvcached against native, over loopback HTTP.

Three real OpenAI servers (each a multiprocess engine: front end, EngineCore and worker are
separate processes), one at a time on 2 cores: kvcached, native, and a second native one as
the noise floor of the concurrent phase. See ``conformance.orchestrate.serve``.
"""

from __future__ import annotations

import pytest

from conformance.cases import ARCHETYPES
from conformance.models import ensure_model
from conformance.orchestrate.serve import (
    ACTIVE_LINE,
    ServerSpec,
    all_at_once,
    compare_tokens,
    one_at_a_time,
    parity_prompts,
    serving,
    with_tokenizer,
)

pytestmark = [pytest.mark.multiprocess]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    work = tmp_path_factory.mktemp("serve")
    model = with_tokenizer(ensure_model(ARCHETYPES["llama"].model), work / "model")
    prompts = parity_prompts(24)
    out: dict[str, dict[str, object]] = {}
    sides = [ServerSpec("kvcached", True, extra_env=(("KVCACHED_PAGE_SIZE", str(64 << 10)),)),
             ServerSpec("native", False), ServerSpec("native-control", False)]
    for spec in sides:
        with serving(spec, model, work / "logs") as server:
            alone = one_at_a_time(server, prompts, MAX_TOKENS)
            together = all_at_once(server, prompts, MAX_TOKENS)
            out[spec.label] = {"alone": alone, "together": together}
        out[spec.label]["log"] = server.log()
        out[spec.label]["exit"] = server.proc.returncode
    return out


def test_server_reports_kvcached_active_and_native_alone(served: dict[str, dict[str, object]]) -> None:
    assert ACTIVE_LINE in str(served["kvcached"]["log"])
    assert ACTIVE_LINE not in str(served["native"]["log"])
    assert "Traceback" not in str(served["kvcached"]["log"]).replace("Chat template warmup failed", "")


def test_requests_one_at_a_time_give_native_tokens(served: dict[str, dict[str, object]]) -> None:
    res = compare_tokens(served["kvcached"]["alone"], served["native"]["alone"])  # type: ignore[arg-type]
    assert res.requests == 24 and res.exact, res.mismatches
    # The control is exact too, and the comparison sees a real difference when there is one.
    assert compare_tokens(served["native-control"]["alone"], served["native"]["alone"]).exact  # type: ignore[arg-type]
    shifted = [toks[1:] + toks[:1] for toks in served["native"]["alone"]]  # type: ignore[union-attr]
    assert compare_tokens(shifted, served["native"]["alone"]).mismatches  # type: ignore[arg-type]


def test_concurrent_requests_stay_within_the_native_noise_floor(served: dict[str, dict[str, object]]) -> None:
    kvc = compare_tokens(served["kvcached"]["together"], served["native"]["together"])  # type: ignore[arg-type]
    floor = compare_tokens(served["native-control"]["together"], served["native"]["together"])  # type: ignore[arg-type]
    assert len(kvc.mismatches) <= len(floor.mismatches), (kvc.mismatches, floor.mismatches)


def test_servers_stop_on_sigterm(served: dict[str, dict[str, object]]) -> None:
    assert {side: r["exit"] for side, r in served.items()} == dict.fromkeys(served, 0)
