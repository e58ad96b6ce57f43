"""kvcached's page requests wait as long as vLLM waits for the steps ahead of them (issue 32).

A page request reaches the workers behind the steps in flight. Its timeout was a constant
(120 s) shorter than vLLM's own step timeout (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s):
a long step vLLM tolerated killed EngineCore with a ``TimeoutError`` in ``schedule``. It is
now derived from vLLM's setting (`rank_rpc_timeout`). The unit tests check the derivation;
the engine test runs the failure scaled down: steps of `STEP_DELAY_S` against the 2 s the
constant stood for, with vLLM allowing each step `STEP_TIMEOUT_S`. A page request alone
(`REQUEST_DELAY_S`) is within the 2 s: only the step ahead of it puts it over.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_child import run_side

from kvcached.integration.vllm.engine import rank_rpc_timeout

CHILD = Path(__file__).with_name("step_timeout_child.py")
ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
STEP_DELAY_S = 3
#: Each page request's own time on the worker (why: `step_timeout_child`).
REQUEST_DELAY_S = 1
#: What vLLM allows a step in the engine test: the delayed steps are well within it.
STEP_TIMEOUT_S = 15


def _executor(max_concurrent_batches: int) -> SimpleNamespace:
    return SimpleNamespace(vllm_config=SimpleNamespace(max_concurrent_batches=max_concurrent_batches))


@pytest.fixture
def fresh_vllm_env() -> Iterator[None]:
    """vLLM reads its environment at each access until an engine caches it (EngineCore does
    after start-up): an engine built earlier in this process must not hide the test's value."""
    from vllm import envs

    envs.disable_envs_cache()
    yield


@pytest.mark.usefixtures("fresh_vllm_env")
def test_the_timeout_is_vllms_step_timeout_per_step_in_flight_plus_the_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "7")
    assert rank_rpc_timeout(_executor(1)) == 14  # synchronous scheduling: one step, then the request
    assert rank_rpc_timeout(_executor(2)) == 21  # async scheduling's batch queue: two steps
    monkeypatch.setenv(ENV, "1800")  # the user's value, read when called (at engine start)
    assert rank_rpc_timeout(_executor(2)) == 5400


@pytest.mark.usefixtures("fresh_vllm_env")
def test_vllms_default_counts_when_the_user_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import envs

    monkeypatch.delenv(ENV, raising=False)
    step_s = envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS  # 300 in 0.26 and 0.28; the old constant was 120
    assert rank_rpc_timeout(_executor(1)) == 2 * step_s


def _job() -> dict[str, object]:
    """Two prompts of several chunks each: every step needs new pages for its chunk."""
    r = random.Random(0)
    return {"chunk_tokens": 32, "max_tokens": 3, "prompts": [[r.randrange(10, 500) for _ in range(n)] for n in (70, 40)]}


def _env() -> dict[str, str]:
    """kvcached with no reserve (every page a blocking request) and one-block pages; a slow worker."""
    return {"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": "4096", "KVCACHED_MIN_RESERVE_PAGES": "0",
            "KVCACHED_MAX_RESERVE_PAGES": "0", ENV: str(STEP_TIMEOUT_S), "STEP_TIMEOUT_TEST_DELAY_S": str(STEP_DELAY_S),
            "STEP_TIMEOUT_TEST_REQUEST_DELAY_S": str(REQUEST_DELAY_S), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.mark.multiprocess
def test_page_requests_behind_steps_longer_than_the_old_timeout_are_served(tmp_path: Path) -> None:
    """Before the fix (a 2 s constant standing for 120 s) ``schedule`` raised ``TimeoutError``
    ("RPC call to rank_request timed out") behind the first delayed step. Bounded by the
    child's timeout (`engine_child.CHILD_TIMEOUT_S`)."""
    out = run_side(CHILD, _job(), tmp_path, _env())
    assert out["executor"] == "MultiprocExecutor"
    assert out["ran"]["batch_queue"] and out["ran"]["async_scheduling"]
    # vLLM's 15 s for each of two steps in flight, and for the request.
    assert out["timeout_s"] == 3 * STEP_TIMEOUT_S
    assert any(n > 0 for n in out["requests_ahead"]), f"no page request queued behind a step: {out['requests_ahead']}"
    assert [len(t) for t in out["tokens"]] == [3, 3]
    log = (tmp_path / "stdout.txt").read_text() + (tmp_path / "stderr.txt").read_text()
    assert "rank requests time out after 45 s (2 step(s) in flight" in log
