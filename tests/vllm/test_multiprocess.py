"""kvcached in vLLM's multiprocess layout: a real TP=2 engine (``MultiprocExecutor``).

The EngineCore (scheduler and kvcached's pool) and each of the two workers (KV memory, one
shard per rank) are separate processes; kvcached maps pages on both ranks through vLLM's
``collective_rpc``. Native vLLM and kvcached run the same token-ID workload at the same
layout; kvcached's run injects a map refusal on rank 1 only, in the middle of the run.

Marked ``multiprocess``: the nox ``tests`` session runs these serially after the xdist run
(two TP=2 engines on 2 cores make OpenMP spin); every engine child has a timeout.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from engine_child import run_side

pytestmark = [pytest.mark.multiprocess]

CHILD = Path(__file__).with_name("mp_engine_child.py")
PAGE = 64 << 10
MAX_RESERVE = 4
#: The kvcached engine's idle grace: no cached block is kept once it has idled this long.
GRACE_S = 5.0
MP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONHASHSEED": "0"}


def _job(tp: int) -> dict[str, object]:
    """Shared prefixes, a partial hit, a 1-token prompt, then 8 concurrent long prompts."""
    r = random.Random(0)
    root = [r.randrange(10, 500) for _ in range(80)]
    fresh = lambda n: [r.randrange(10, 500) for _ in range(n)]
    passes = [
        [root[:40], root[:70], fresh(33)],
        [root[:40] + [11, 12, 13], root[:75], root[:17], fresh(50), [15]],
        [fresh(120 + 7 * i) for i in range(8)],
    ]
    return {"archetype": "llama", "tp": tp, "max_tokens": 12, "passes": passes}


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, Path]:
    work = tmp_path_factory.mktemp("tp2")
    native = run_side(CHILD, _job(2), work / "native", {**MP_ENV, "VLLM_PLUGINS": ""})
    plan = work / "plan.json"
    plan.write_text(json.dumps({"plans": [{"site": "rank1_map", "skip": 1, "fail_next": 1}]}))
    env = {**MP_ENV, "KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": str(PAGE),
           "KVCACHED_MAX_RESERVE_PAGES": str(MAX_RESERVE), "KVCACHED_FAULT_PLAN": str(plan),
           "KVCACHED_MAX_CACHED_BLOCKS": "0", "KVCACHED_IDLE_GRACE_MS": str(int(GRACE_S * 1000))}
    job = {**_job(2), "kvcached": True, "idle_watch_s": GRACE_S + 60}
    kvcached = run_side(CHILD, job, work / "kvcached", env)
    return native, kvcached, plan, work


def test_tp2_engine_runs_both_ranks_in_their_own_processes(tp2_runs: tuple[dict, dict, Path, Path]) -> None:
    native, kvcached, _, work = tp2_runs
    assert native["client"] == kvcached["client"] == "SyncMPClient"  # the EngineCore is another process
    log = lambda side: "".join((work / side / f).read_text() for f in ("stdout.txt", "stderr.txt"))
    assert "kvcached: elastic KV cache active on 2 rank(s) (MultiprocExecutor)" in log("kvcached")
    assert "elastic KV cache active" not in log("native")
    assert [f["rank"] for f in kvcached["ranks_after_run"]] == [0, 1]


def test_tp2_tokens_are_native_through_a_map_refusal_on_rank_1(tp2_runs: tuple[dict, dict, Path, Path]) -> None:
    native, kvcached, plan, _ = tp2_runs
    assert kvcached["passes"] == native["passes"]
    fired = json.loads(plan.with_name(plan.name + ".rank1.fired.json").read_text())["fired"]
    assert fired == {"rank1_map": 1}, "the refusal on rank 1 really happened"
    assert not plan.with_name(plan.name + ".rank0.fired.json").exists()


def test_tp2_ranks_hold_the_same_pages_and_return_them(tp2_runs: tuple[dict, dict, Path, Path]) -> None:
    _, kvcached, _, _ = tp2_runs
    run, idle = kvcached["ranks_after_run"], kvcached["ranks_after_reset"]
    # The batch rank 1 refused was undone on rank 0: both ranks map exactly the same pages.
    assert run[0]["mapped"] == run[1]["mapped"]
    assert all(f["spaces"] == 1 for f in run + idle)
    # With the prefix cache reset nothing is in use: the null block's page and the reserve.
    assert idle[0]["mapped"] == idle[1]["mapped"] and len(idle[0]["mapped"]) <= 1 + MAX_RESERVE


def test_tp2_engine_gives_its_cache_back_after_its_idle_grace_with_no_step(
        tp2_runs: tuple[dict, dict, Path, Path]) -> None:
    """The cap (0 cached blocks here) waits for the grace; then the EngineCore, idle and sent no
    request, applies it on its own thread (woken through vLLM's idle callbacks) on both ranks."""
    _, kvcached, _, work = tp2_runs
    run, grace = kvcached["ranks_after_run"], kvcached["ranks_after_grace"]
    log = "".join((work / "kvcached" / f).read_text() for f in ("stdout.txt", "stderr.txt"))
    assert f"cached-block cap after {GRACE_S:g} s idle" in log
    if kvcached["after_run_s"] < GRACE_S:  # looked before the grace ran out (always but on a stalled host)
        assert len(run[0]["mapped"]) > 1 + MAX_RESERVE, "within the grace, cached blocks keep their pages"
    assert grace[0]["mapped"] == grace[1]["mapped"] and len(grace[0]["mapped"]) <= 1 + MAX_RESERVE
    assert kvcached["after_grace_s"] > GRACE_S / 2, "the cap waited for the grace"
