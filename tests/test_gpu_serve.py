"""`vllm serve` on a GPU with kvcached against native, as users run it: compiled with CUDA graphs
and the model runner vLLM picks (V2 for this dense model on 0.26), over loopback HTTP.

Runs only where a CUDA build of vLLM sees a GPU (the H200 host through the offline bundle); anywhere
else it is skipped with the reason (`test_gpu_engine._why_not`). Two real OpenAI servers, one after
the other: kvcached and native, the CUDA tiny llama in bf16 with Triton attention (FA3 is
history-dependent with prefix hits, ``../shared/notes/cuda-vllm-h200.md``). Every request alone,
so no batch depends on timing: tokens must be identical, with a negative control. The kvcached
server's log must say kvcached is active and the native one's not; each log must name the runner
vLLM built, the same on both sides.
"""

from __future__ import annotations

import pytest
from test_gpu_engine import _why_not

pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "")

MAX_TOKENS = 16
V2_LINE = "Using V2 Model Runner"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    from conformance.models import ensure_model, model_spec
    from conformance.serving.server import ServerSpec, one_at_a_time, parity_prompts, serving, with_tokenizer

    work = tmp_path_factory.mktemp("gpu-serve")
    model = with_tokenizer(ensure_model(model_spec("llama", "cuda")), work / "model")
    prompts = parity_prompts(16)
    out: dict[str, dict[str, object]] = {}
    for label, kvcached in (("kvcached", True), ("native", False)):
        spec = ServerSpec(label, kvcached, dtype="bfloat16", eager=False, model_runner="vllm",
                          extra_args=("--attention-backend", "TRITON_ATTN"), device="cuda")
        with serving(spec, model, work / "logs", max_model_len=4096, kv_cache_bytes=1 << 30,
                     start_timeout_s=600.0) as server:
            out[label] = {"alone": one_at_a_time(server, prompts, MAX_TOKENS)}
        out[label]["log"] = server.log()
    return out


def test_kvcached_is_active_and_both_ran_vllms_runner(served: dict[str, dict[str, object]]) -> None:
    from conformance.serving.server import ACTIVE_LINE

    kvc, native = str(served["kvcached"]["log"]), str(served["native"]["log"])
    assert ACTIVE_LINE in kvc and ACTIVE_LINE not in native
    assert V2_LINE in kvc and V2_LINE in native, "vLLM picks Model Runner V2 for a dense model on CUDA"
    assert "/kvcached/" not in kvc.split("[shutdown]")[0]


def test_requests_one_at_a_time_give_native_tokens(served: dict[str, dict[str, object]]) -> None:
    from conformance.serving.server import compare_tokens

    alone = served["native"]["alone"]
    res = compare_tokens(served["kvcached"]["alone"], alone)  # type: ignore[arg-type]
    assert res.requests == 16 and res.exact, res.mismatches
    shifted = [toks[1:] + toks[:1] for toks in alone]  # type: ignore[union-attr]
    assert compare_tokens(shifted, alone).mismatches  # type: ignore[arg-type]
