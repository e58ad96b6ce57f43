"""vLLM 0.29 end to end: native and kvcached engines give the same tokens (real engines).

The cases and the child of ``test_engine_parity`` (two children, one per side; two passes
over the same token-ID prompts), with the llama block raised to 32 tokens: vLLM 0.29's CPU
attention only accepts kernel blocks that are multiples of 32, so the 16-token llama cases
of ``test_engine_parity`` cannot start natively there. The hybrids keep vLLM's own
128-token block and a 16-token ``prefix_match_unit`` (partial-prefix hits, so vLLM submits
block copies), in bf16: 0.29's CPU causal-conv weight packing has no float32 kernel. Per case: token IDs and prefix-cache hits identical; kvcached's pool ran and
its copy helper performed exactly the copies vLLM scheduled; pages were mapped during the
run and given back once idle; every KV view vLLM bound lies on a kvcached range.
Skipped on vLLM series that allocate KV tensors in runner methods (0.26-0.28).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import test_engine_parity as parity
from engine_child import NATIVE_ENV, run_side, shared_result

from kvcached.integration.vllm.capabilities import detect

if not detect().allocate_kv_cache:
    pytest.skip("test_engine_parity covers vLLM series that allocate in runner methods", allow_module_level=True)
pytest.importorskip("kvcached._vmm", reason="native extension not built")

LLAMA = {"block_size": 32}
# vLLM 0.29's CPU causal-conv weight packing has no float32 kernel: hybrids run in bf16.
HYBRID = {**parity.HYBRID, "dtype": "bfloat16"}
CASES = [
    parity.Case("llama-prefix-sync", "llama", {**LLAMA, "enable_prefix_caching": True}, False, parity.SMALL_PAGE),
    parity.Case("llama-noprefix-async", "llama", {**LLAMA, "enable_prefix_caching": False}, True, parity.SMALL_PAGE),
    parity.Case("nemotron_h-prefix-sync", "nemotron_h", dict(HYBRID), False, parity.SMALL_PAGE),
    parity.Case("nemotron_h-prefix-async", "nemotron_h", dict(HYBRID), True, parity.SMALL_PAGE),
    parity.Case("granitemoehybrid-prefix-sync", "granitemoehybrid", dict(HYBRID), False, parity.SMALL_PAGE),
]
CASE_IDS = [c.id for c in CASES]


def _views_on_kvcached_ranges(llm: Any) -> bool:
    from kvcached import space

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    published = space.claim(int(runner.kv_cache_config.num_blocks))
    bases = {r.address for r in published.ranges} if published is not None else set()
    return bool(runner.kv_caches) and all(t.untyped_storage().data_ptr() in bases for t in runner.kv_caches)


def child_main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    with_kvcached = job["engine"] == "kvcached"
    cases: dict[str, Any] = {}
    if with_kvcached:  # checked on the first engine, while it runs
        import engine_child

        original = engine_child.scheduler_that_ran

        def scheduler_that_ran(llm: Any) -> dict[str, Any]:
            return {**original(llm), "views_on_kvcached_ranges": _views_on_kvcached_ranges(llm)}

        parity.scheduler_that_ran = scheduler_that_ran
    for raw in job["cases"]:
        case = parity.Case(**raw)
        cases[case.id] = parity.run_case(case, with_kvcached)
    Path(out_path).write_text(json.dumps({"cases": cases}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def compute(workdir: Path) -> dict[str, Any]:
        job = {"cases": [dataclasses.asdict(c) for c in CASES]}
        script = Path(__file__)
        return {
            "native": run_side(script, {**job, "engine": "native"}, workdir / "native", NATIVE_ENV),
            "kvcached": run_side(script, {**job, "engine": "kvcached"}, workdir / "kvcached", parity.KVCACHED_ENV),
        }

    return shared_result(tmp_path_factory, "kvcached-v029-engine", compute)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_same_tokens_hits_and_copies(runs: dict[str, Any], case_id: str) -> None:
    case = CASES[CASE_IDS.index(case_id)]
    native, elastic = runs["native"]["cases"][case_id], runs["kvcached"]["cases"][case_id]
    assert elastic["ran"].pop("views_on_kvcached_ranges") is True
    assert elastic["ran"] == native["ran"]
    assert elastic["tokens"] == native["tokens"]
    assert elastic["cached"] == native["cached"], "prefix-cache hits differ"
    if case.prefix_caching:
        assert sum(native["cached"][1]) > sum(native["cached"][0]), "the second pass did not hit the cache"
    assert elastic["copies_scheduled"] == native["copies_scheduled"]
    assert elastic["copies_performed"] == elastic["copies_scheduled"], "kvcached's copy helper missed copies"
    if case.model in parity.PARTIAL_HIT_MODELS:
        assert native["copies_scheduled"] > 0, "no partial-prefix hit: vLLM submitted no block copy"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pages_given_back_and_unmapped_at_shutdown(runs: dict[str, Any], case_id: str) -> None:
    elastic = runs["kvcached"]["cases"][case_id]
    page, idle = elastic["kv_page_bytes"], elastic["stats_idle"]
    assert idle["live_blocks"] == 1
    assert idle["mapped_bytes"] == (1 + parity.RESERVE_PAGES) * page < idle["peak_mapped_bytes"]
    assert elastic["closed"] is True and elastic["stats_after_shutdown"] == {}
    assert not any(elastic["mapped_after_shutdown"])


if __name__ == "__main__":
    child_main(*sys.argv[1:])
