"""The engine worker's per-case kvcached settings: explicit configuration for the engine
(vLLM's ``additional_config``), never the process environment."""

from __future__ import annotations

import os
from pathlib import Path

from conformance import cases as C
from conformance.engine.worker import CaseRunner
from conformance.results import Budget, Job, Plan
from kvcached.integration.vllm import ENGINE_CONFIG_KEY

BUDGET = Budget(blocks=10, native_kv_cache_bytes=1 << 18, kvcached_budget_bytes=1 << 19)
PLAN = Plan(max_model_len=256, page_size=1 << 16, budget=BUDGET)


def _kvcached_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("KVCACHED_")}


def _runner(tmp_path: Path, side: str, engine: str, device: str = "cpu") -> CaseRunner:
    return CaseRunner(Job(side=side, engine=engine, out_dir=tmp_path, page_size=None,  # type: ignore[arg-type]
                          kv_cache_bytes=1 << 26, async_override=True, budget_bytes_override=None, entries=[],
                          device=device))  # type: ignore[arg-type]


def test_a_kvcached_candidates_settings_are_explicit_and_leave_the_environment_alone(tmp_path: Path) -> None:
    case = C.Case(C.ARCHETYPES["llama"], lengths=C.LengthSet.EXTENDED, pattern=C.PrefixPattern.SHARED_CONCURRENT,
                  fault=C.TINY_BUDGET)  # fmt: skip
    runner = _runner(tmp_path, "candidate", "kvcached")
    before = _kvcached_env()
    knobs = runner._knobs(case, PLAN)
    record = str(tmp_path / f"{case.case_id}.budget")
    assert knobs.kvcached == {"budget_bytes": 1 << 19, "budget_path": record, "page_size": 1 << 16,
                              "max_cached_blocks": -1}  # fmt: skip
    kwargs = runner._engine_kwargs(case, tmp_path, PLAN.max_model_len, knobs.kv_bytes, knobs.kvcached)
    assert kwargs["additional_config"] == {ENGINE_CONFIG_KEY: knobs.kvcached}
    assert _kvcached_env() == before


def test_native_engines_get_no_kvcached_settings(tmp_path: Path) -> None:
    case = C.Case(C.ARCHETYPES["llama"], fault=C.MAP_MID_ALLOCATION)
    for side, engine in (("reference", "native"), ("candidate", "native"), ("control", "native")):
        runner = _runner(tmp_path, side, engine)
        knobs = runner._knobs(case, PLAN)
        assert knobs.kvcached == {}
        assert "additional_config" not in runner._engine_kwargs(case, tmp_path, 256, knobs.kv_bytes, knobs.kvcached)
    cap = _runner(tmp_path, "candidate", "kvcached")._knobs(C.Case(C.ARCHETYPES["llama"], fault=C.CACHED_CAP), PLAN)
    assert cap.kvcached["max_cached_blocks"] == 2
