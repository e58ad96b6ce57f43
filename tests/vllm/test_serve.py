"""What users run: `vllm serve` with kvcached against native, over loopback HTTP.

Three real OpenAI servers (each a multiprocess engine: front end, EngineCore and worker are
separate processes), one at a time on 2 cores: kvcached, native, and a second native one as
the noise floor of the concurrent phase. See ``conformance.serving.server``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_client import BenchClient
from bench_serving import PhaseConfig, run_phase

from conformance.cases import ARCHETYPES
from conformance.models import ensure_model
from conformance.serving.server import (
    ACTIVE_LINE,
    ServerError,
    ServerSpec,
    all_at_once,
    compare_tokens,
    one_at_a_time,
    parity_prompts,
    serving,
    with_tokenizer,
)
from kvcached.budget import BudgetRecord
from kvcached.stats import parse_shutdown_lines

pytestmark = [pytest.mark.multiprocess]

MAX_TOKENS = 12
#: Two phases of the serving benchmark, through one client: other loads and prompt counts, so each
#: result is its own.
BENCH_PHASES = (PhaseConfig("saturation", float("inf"), 4, 8, 101), PhaseConfig("rate", 20.0, None, 12, 102))
BENCH_LENGTHS = (16, 8)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    work = tmp_path_factory.mktemp("serve")
    model = with_tokenizer(ensure_model(ARCHETYPES["llama"].model), work / "model")
    prompts = parity_prompts(24)
    out: dict[str, dict[str, object]] = {}
    # The kvcached server idles between requests sent one at a time and between phases: with an
    # idle grace (a CUDA engine's default) each request cancels it, and longer gaps let it run out.
    sides = [ServerSpec("kvcached", True, extra_env=(("KVCACHED_PAGE_SIZE", str(64 << 10)),
                                                     ("KVCACHED_IDLE_GRACE_MS", "200"))),
             ServerSpec("native", False), ServerSpec("native-control", False)]
    # The serving benchmark's client, started before the first server (its vLLM import overlaps
    # the start, as in the benchmark), runs its phases against the last one.
    with BenchClient(work / "bench" / "client.log") as client:
        for spec in sides:
            with serving(spec, model, work / "logs") as server:
                alone = one_at_a_time(server, prompts, MAX_TOKENS)
                together = all_at_once(server, prompts, MAX_TOKENS)
                streamed = [server.complete_timed(p, MAX_TOKENS) for p in prompts[:4]]
                out[spec.label] = {"alone": alone, "together": together, "streamed": streamed}
                if spec is sides[-1]:
                    out[spec.label]["bench"] = [run_phase(client, server.port, model, phase, work / "bench",
                                                          phase.name, BENCH_LENGTHS) for phase in BENCH_PHASES]
            out[spec.label]["log"] = server.log()
            out[spec.label]["exit"] = server.proc.returncode
    out["native-control"]["bench_exit"] = client.proc.returncode
    return out


def test_server_reports_kvcached_active_and_native_alone(served: dict[str, dict[str, object]]) -> None:
    assert ACTIVE_LINE in str(served["kvcached"]["log"])
    assert "cached-block cap after 0.2 s idle" in str(served["kvcached"]["log"])
    assert ACTIVE_LINE not in str(served["native"]["log"])
    log = str(served["kvcached"]["log"])
    # Nothing failed while serving. At SIGTERM vLLM's own output handler may log an
    # EngineDeadError traceback (native servers do too); no kvcached frame appears in any.
    assert "Traceback" not in log.split("[shutdown]")[0]
    assert "/kvcached/" not in log


def test_the_pool_logs_its_lifetime_counters_at_shutdown(served: dict[str, dict[str, object]]) -> None:
    """SIGTERM stops the server; EngineCore's shutdown logs the pool's counters once (what the
    serving benchmark reads per server; it is there because the server has a shutdown grace,
    `SHUTDOWN_GRACE_S`); a native server logs none."""
    (pool,) = parse_shutdown_lines(str(served["kvcached"]["log"]))
    assert pool["page_takes"] > 0 and pool["maps"] > 0 and pool["health"] == "healthy", pool  # type: ignore[operator]
    assert pool["reserve_hits"] <= pool["page_takes"]  # type: ignore[operator]
    assert parse_shutdown_lines(str(served["native"]["log"])) == []


def test_requests_one_at_a_time_give_native_tokens(served: dict[str, dict[str, object]]) -> None:
    res = compare_tokens(served["kvcached"]["alone"], served["native"]["alone"])  # type: ignore[arg-type]
    assert res.requests == 24 and res.exact, res.mismatches
    # The control is exact too, and the comparison sees a real difference when there is one.
    assert compare_tokens(served["native-control"]["alone"], served["native"]["alone"]).exact  # type: ignore[arg-type]
    shifted = [toks[1:] + toks[:1] for toks in served["native"]["alone"]]  # type: ignore[union-attr]
    assert compare_tokens(shifted, served["native"]["alone"]).mismatches  # type: ignore[arg-type]


def test_a_streamed_request_gives_the_same_tokens_and_its_time_to_first_token(
        served: dict[str, dict[str, object]]) -> None:
    """`Server.complete_timed` (the sharing run's bursts on a GPU): the tokens of the plain
    request, assembled from the stream, and a first-token time within the request's."""
    for side in served.values():
        streamed = side["streamed"]
        assert [t.tokens for t in streamed] == side["alone"][:4]  # type: ignore[attr-defined,index]
        assert all(t.ttft_s is not None and 0 < t.ttft_s < 60 for t in streamed)  # type: ignore[attr-defined]


def test_concurrent_requests_stay_within_the_native_noise_floor(served: dict[str, dict[str, object]]) -> None:
    kvc = compare_tokens(served["kvcached"]["together"], served["native"]["together"])  # type: ignore[arg-type]
    floor = compare_tokens(served["native-control"]["together"], served["native"]["together"])  # type: ignore[arg-type]
    assert len(kvc.mismatches) <= len(floor.mismatches), (kvc.mismatches, floor.mismatches)


def test_the_benchmark_client_runs_each_phase_in_one_process(served: dict[str, dict[str, object]]) -> None:
    """`bench_client.BenchClient` against a real server: vLLM's `vllm bench serve` ran each phase
    whole (its own prompts and load, every request completed: `run_phase` checks) in the one
    child, started before the servers, which ended cleanly when its block closed."""
    control = served["native-control"]
    results: list[dict[str, object]] = control["bench"]  # type: ignore[assignment]
    assert [r["completed"] for r in results] == [p.num_prompts for p in BENCH_PHASES]
    assert [r["max_concurrency"] for r in results] == [4, None]
    assert [r["total_input_tokens"] for r in results] == [p.num_prompts * BENCH_LENGTHS[0] for p in BENCH_PHASES]
    assert control["bench_exit"] == 0


def test_servers_stop_on_sigterm(served: dict[str, dict[str, object]]) -> None:
    assert {side: r["exit"] for side, r in served.items()} == dict.fromkeys(served, 0)
    # Within the grace (SHUTDOWN_GRACE_S): the front end waited for EngineCore's own teardown
    # instead of SIGKILLing it, which vLLM's default does a few milliseconds after the SIGTERM.
    for side, r in served.items():
        assert "force killing remaining process EngineCore" not in str(r["log"]), side
        assert "[shutdown] EngineCore: exiting busy loop" in str(r["log"]), side


def _dead_worker(spec: ServerSpec, model: Path, logs: Path) -> dict[str, object]:
    """SIGKILL rank 1's worker of a running TP=2 server; what do the client and server see?"""
    with serving(spec, model, logs) as server:
        server.complete([5, 6, 7, 8], 4)
        family = psutil.Process(server.proc.pid).children(recursive=True)
        victim = next(p for p in family if p.name().endswith("Worker_TP1"))
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="HTTP 500") as err:
            server.complete([5, 6, 7, 9], 4, timeout_s=120)
        exit_code = server.proc.wait(120)  # the server stops by itself: nothing hangs
        took = time.monotonic() - t0
    # The server process has exited; give its children the same bounded time to go.
    _, alive = psutil.wait_procs(family, timeout=30)
    survivors = [f"{p.pid} {_name(p)}" for p in alive if _alive(p)]
    return {"error": str(err.value), "exit": exit_code, "survivors": survivors, "seconds": took,
            "log": (logs / f"{spec.label}.log").read_text(errors="replace")}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return "?"


def test_a_dead_worker_fails_the_server_as_native_does(tmp_path: Path) -> None:
    """TP=2: rank 1's worker is killed. Like native vLLM, the client gets an error, the server
    exits on its own, and no process of it survives (so no memory of any rank stays held)."""
    model = with_tokenizer(ensure_model(ARCHETYPES["llama"].model), tmp_path / "model")
    budget_dir = tmp_path / "budget"
    budget_dir.mkdir(mode=0o700)
    env = (("KVCACHED_PAGE_SIZE", str(64 << 10)), ("KVCACHED_BUDGET_DIR", str(budget_dir)))
    kvc = _dead_worker(ServerSpec("kvcached", True, 2, env), model, tmp_path / "logs")
    with BudgetRecord(str(budget_dir / "host.budget"), create=False) as record:
        live = record.snapshot()
    assert live.slots == () and live.engines == (), "no rank or engine of the dead server holds the budget"
    native = _dead_worker(ServerSpec("native", False, 2), model, tmp_path / "logs")
    for name, side in (("kvcached", kvc), ("native", native)):
        assert "EngineCore encountered an issue" in str(side["error"]), name
        assert side["survivors"] == [] and float(side["seconds"]) < 120, (name, side["survivors"])  # type: ignore[arg-type]
    assert kvc["exit"] == native["exit"]
    assert ACTIVE_LINE in str(kvc["log"]) and "/kvcached/" not in str(kvc["log"])  # no kvcached frame
