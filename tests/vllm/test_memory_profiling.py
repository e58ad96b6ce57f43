"""The KV capacity the worker reports: virtual, capped by kvcached's physical budget.

Real engines (tiny random Llama, block 16: 16 KiB per block over both layers; block 32,
32 KiB, where the vLLM series' CPU attention needs it, see `conformance.vllm_series`) in two
children, one per side (see ``engine_child``). vLLM derives ``kv_cache_config.num_blocks``
from the bytes the worker reports, so the checks compare block counts:

* a kvcached engine with a budget below ``kv_cache_memory_bytes`` gets exactly the
  blocks a native engine gets when given the budget as its KV size;
* without a budget it gets exactly the native block count for the same KV size;
* the budget may also come from a shared budget file's limit;
* vLLM's start-up check does not demand the cache up front: a virtual KV size far
  beyond this machine's memory starts, capped by the budget (natively it is refused);
* with vLLM's automatic sizing (no ``kv_cache_memory_bytes``) the result is capped too.

The GPU seams (``request_memory`` without the free-memory guard, the capped
``Worker.determine_available_memory``) cannot run here; their logic is tested directly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_child import (
    NATIVE_ENV,
    block_pool_type,
    build_llm,
    collect_garbage,
    engine_kwargs,
    install_warmup_probe,
    run_side,
    scheduler_that_ran,
    shared_result,
    shutdown,
)

from conformance.engine_env import without_kvcached
from conformance.vllm_series import attention_block_size
from kvcached.budget import BudgetRecord
from kvcached.host import read_host_memory
from kvcached.integration.vllm import capacity, worker
from kvcached.integration.vllm.capabilities import detect

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

MiB = 1 << 20
KV_BYTES = 64 * MiB
BUDGET = 16 * MiB
BLOCK = attention_block_size(16)  # llama's block: 16, or the smallest the CPU attention accepts
BLOCK_BYTES = 2 * BLOCK * 2 * 64 * 4  # llama: 2 layers x BLOCK tokens x 2 KV heads x 64 floats x 4 bytes
HUGE_KV = 1 << 40  # 1 TiB of virtual KV: far more than any CI machine has

# case id -> (engine argument overrides, kvcached environment for that case)
NATIVE_CASES: dict[str, dict[str, Any]] = {
    "kv64": {},
    "kv16": {"kv_cache_memory_bytes": BUDGET},
    "huge-virtual": {"kv_cache_memory_bytes": HUGE_KV},  # refused at start-up: last, it leaves a half-built engine
}
REFUSED = {"huge-virtual"}  # native cases whose start-up vLLM refuses
KVCACHED_CASES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "no-budget": ({}, {}),
    "budget": ({}, {"KVCACHED_BUDGET_BYTES": str(BUDGET), "KVCACHED_BUDGET_PATH": "<budget file>"}),
    "budget-file": ({}, {"KVCACHED_BUDGET_PATH": "<budget file>"}),
    "huge-virtual": ({"kv_cache_memory_bytes": HUGE_KV},
                     {"KVCACHED_BUDGET_BYTES": str(BUDGET), "KVCACHED_BUDGET_PATH": "<budget file>"}),
    # vLLM's RSS-based sizing from a fraction of the machine, then the cap
    "auto-sized": ({"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.3},
                   {"KVCACHED_BUDGET_BYTES": str(BUDGET), "KVCACHED_BUDGET_PATH": "<budget file>"}),
}


# ---- child -------------------------------------------------------------------------------------
def _engine_args(overrides: dict[str, Any]) -> dict[str, Any]:
    return engine_kwargs("llama", **{"block_size": BLOCK, "kv_cache_memory_bytes": KV_BYTES, **overrides})


def run_case(overrides: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Build one engine, serve one request, report its block count; the env is per case."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.update(env)
    try:
        llm = build_llm(_engine_args(overrides), want_async=False)
        try:
            res = scheduler_that_ran(llm)
            res["pool"] = block_pool_type(llm)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
            out = llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 40)))], params, use_tqdm=False)
            res["tokens"] = list(out[0].outputs[0].token_ids)
        finally:
            shutdown(llm)
        del llm
    finally:
        for name in env:
            os.environ.pop(name)
    collect_garbage()
    return res


def refused_start(overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's start-up check refusing the KV size: its message, as data for the parent."""
    try:
        build_llm(_engine_args(overrides), want_async=False)
    except ValueError as exc:  # the expected outcome, recorded; anything else propagates
        return {"refused": str(exc)}
    raise AssertionError("vLLM started an engine it was expected to refuse")


def child_main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    warmups = install_warmup_probe()
    results = {
        cid: refused_start(overrides) if cid in job.get("refused", ()) else run_case(overrides, env)
        for cid, (overrides, env) in job["cases"].items()
    }
    Path(out_path).write_text(json.dumps({"cases": results, "warmups": warmups}))


# ---- parent: real engines ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def compute(workdir: Path) -> dict[str, Any]:
        budget_file = workdir / "budget.arena"
        BudgetRecord(str(budget_file), limit=BUDGET).close()  # creates the shared record with that limit
        kvcached_cases = {
            cid: (overrides, {k: str(budget_file) if v == "<budget file>" else v for k, v in env.items()})
            for cid, (overrides, env) in KVCACHED_CASES.items()
        }
        script = Path(__file__)
        native_job = {"cases": {cid: (overrides, {}) for cid, overrides in NATIVE_CASES.items()},
                      "refused": sorted(REFUSED)}
        return {
            "native": run_side(script, native_job, workdir / "native", NATIVE_ENV),
            "kvcached": run_side(script, {"cases": kvcached_cases}, workdir / "kvcached", {"KVCACHED_ENABLE": "1"}),
        }

    return shared_result(tmp_path_factory, "kvcached-memory-profiling", compute)


def _blocks(runs: dict[str, Any], side: str, case_id: str) -> int:
    return int(runs[side]["cases"][case_id]["num_blocks"])


def test_each_side_ran_its_pool(runs: dict[str, Any]) -> None:
    assert {c["pool"] for cid, c in runs["native"]["cases"].items() if cid not in REFUSED} == {"BlockPool"}
    assert {c["pool"] for c in runs["kvcached"]["cases"].values()} == {"ElasticBlockPool"}


def test_native_start_up_demands_the_whole_kv_size(runs: dict[str, Any]) -> None:
    assert "less than requested memory for kv" in runs["native"]["cases"]["huge-virtual"]["refused"]


def test_native_block_counts_are_what_the_test_assumes(runs: dict[str, Any]) -> None:
    assert _blocks(runs, "native", "kv64") == KV_BYTES // BLOCK_BYTES
    assert _blocks(runs, "native", "kv16") == BUDGET // BLOCK_BYTES


def test_without_budget_the_capacity_is_native(runs: dict[str, Any]) -> None:
    assert _blocks(runs, "kvcached", "no-budget") == _blocks(runs, "native", "kv64")


@pytest.mark.parametrize("case_id", ["budget", "budget-file", "huge-virtual", "auto-sized"])
def test_budget_caps_the_capacity(runs: dict[str, Any], case_id: str) -> None:
    assert _blocks(runs, "kvcached", case_id) == _blocks(runs, "native", "kv16")


def test_capped_engines_serve_the_same_tokens(runs: dict[str, Any]) -> None:
    want = runs["native"]["cases"]["kv64"]["tokens"]
    assert len(want) == 4
    served = [c for side in ("native", "kvcached") for cid, c in runs[side]["cases"].items() if cid not in REFUSED]
    assert all(case["tokens"] == want for case in served)


def test_warmup_reads_the_null_block_before_the_pool_exists(runs: dict[str, Any]) -> None:
    warmups = runs["kvcached"]["warmups"]
    assert len(warmups) == len(KVCACHED_CASES)
    assert all(w["views_read"] == 2 and w["pools_alive"] == 0 for w in warmups)


# ---- parent: the seams' logic (no engine) ----------------------------------------------------------
@pytest.fixture
def seams(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The worker seams installed and enabled in this process, restored afterwards."""
    for name in set(os.environ) - set(without_kvcached(dict(os.environ))):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    worker.install(detect())
    yield monkeypatch
    worker.uninstall()


def test_physical_cap_sources(seams: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "arena"
    seams.setenv("KVCACHED_BUDGET_PATH", str(path))
    seams.setenv("KVCACHED_HOST_RESERVE", "1073741824")
    derived = capacity.physical_cap_bytes()  # no record yet: the host budget an engine would derive
    assert derived is not None and abs(derived - (read_host_memory().available - (1 << 30))) < 256 * MiB
    seams.setenv("KVCACHED_HOST_RESERVE", "off")
    assert capacity.physical_cap_bytes() is None  # no record, nothing derived: no limit
    seams.setenv("KVCACHED_BUDGET_PATH", "off")
    seams.delenv("KVCACHED_HOST_RESERVE")
    assert capacity.physical_cap_bytes() is None  # budgets off: nothing is limited
    seams.setenv("KVCACHED_BUDGET_PATH", str(path))
    assert not path.exists()
    BudgetRecord(str(path), limit=3 * MiB).close()
    assert capacity.physical_cap_bytes() == 3 * MiB  # the shared record's limit
    seams.setenv("KVCACHED_BUDGET_BYTES", str(5 * MiB))
    assert capacity.physical_cap_bytes() == 5 * MiB  # explicit bytes win (the engine asks the record for them)
    assert capacity.capped_kv_bytes(4 * MiB) == 4 * MiB
    assert capacity.capped_kv_bytes(9 * MiB) == 5 * MiB


def _snapshot(total: int, free: int) -> SimpleNamespace:
    return SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0")


def test_gpu_request_memory_does_not_demand_what_peers_hold(seams: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker import gpu_worker, utils

    assert gpu_worker.request_memory.__wrapped__ is utils.request_memory  # type: ignore[attr-defined]
    cache_config = SimpleNamespace(gpu_memory_utilization=0.5)
    peers_hold_most = _snapshot(total=100 * MiB, free=10 * MiB)
    assert gpu_worker.request_memory(peers_hold_most, cache_config) == 50 * MiB
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        utils.request_memory(peers_hold_most, cache_config)  # what vLLM alone would do
    worker.uninstall()
    seams.setenv("KVCACHED_ENABLE", "0")
    worker.install(detect())  # installed but disabled: pure delegation
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        gpu_worker.request_memory(peers_hold_most, cache_config)


def test_gpu_determine_available_memory_is_capped(seams: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker import gpu_worker

    installed = gpu_worker.Worker.determine_available_memory
    assert installed.__wrapped__.__qualname__ == "Worker.determine_available_memory"  # type: ignore[attr-defined]
    assert installed is not installed.__wrapped__  # type: ignore[attr-defined]
    profiled = capacity._wrap_gpu_determine(lambda self: 64 * MiB)  # vLLM's profiling result
    gpu = SimpleNamespace(device="cuda:0")
    seams.setenv("KVCACHED_BUDGET_PATH", "off")  # no record (reading one would ask the driver for the GPU's UUID)
    assert profiled(gpu) == 64 * MiB
    seams.setenv("KVCACHED_BUDGET_BYTES", str(24 * MiB))
    assert profiled(gpu) == 24 * MiB


if __name__ == "__main__":
    child_main(*sys.argv[1:])
