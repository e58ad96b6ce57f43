"""`bench_scheduler`'s step classes: which steps a column compares, side by side.

The benchmark's runs are real engines (minutes); these tests give its summary runs whose step
times are known, so that a column that picked the wrong steps, or could not see a slower side,
fails here.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_scheduler import WORKLOADS, Pair, Run, summarize

CONCURRENCY = 4
BUDGET = 8192
#: Two full prefill steps, a short one, then decode steps: one token for each request.
TOKENS = [BUDGET, BUDGET, 3 * 1024, CONCURRENCY, CONCURRENCY, CONCURRENCY, CONCURRENCY - 1]


def _run(prefill_s: float, decode_s: float, other_s: float = 0.001) -> Run:
    times = [prefill_s if t == BUDGET else decode_s if t == CONCURRENCY else other_s for t in TOKENS]
    return Run(CONCURRENCY, times, [0] * len(TOKENS), list(TOKENS))


def test_the_decode_column_compares_the_steps_scheduling_a_token_a_request() -> None:
    native = _run(prefill_s=0.002, decode_s=0.001)
    slower_decode = _run(prefill_s=0.002, decode_s=0.0015)
    s = summarize([Pair(native, slower_decode)] * 3, BUDGET, decode=True)
    assert s["decode_step_count"] == 3
    assert s["decode_steps"]["median_ratio"] == 1.5
    assert s["decode_steps"]["verdict"] == "missed"
    assert s["full_steps"]["median_ratio"] == 1.0  # the prefill steps are the same on both sides


def test_the_prefill_column_sees_a_slower_prefill_step_and_not_the_decode_steps() -> None:
    native = _run(prefill_s=0.002, decode_s=0.001)
    slower_prefill = _run(prefill_s=0.003, decode_s=0.001)
    s = summarize([Pair(native, slower_prefill)] * 3, BUDGET, decode=True)
    assert s["full_steps"]["median_ratio"] == 1.5
    assert s["decode_steps"]["median_ratio"] == 1.0
    assert s["decode_steps"]["verdict"] == "met"


def test_only_the_decode_workloads_ask_for_the_column() -> None:
    assert [w.name for w in WORKLOADS.values() if w.decode_steps] == ["decode", "decode-full"]
    assert [w.name for w in WORKLOADS.values() if w.full_pool] == ["decode-full"]
    s = summarize([Pair(_run(0.002, 0.001), _run(0.002, 0.002))], BUDGET)
    assert "decode_steps" not in s and "decode_step_count" not in s


def _owner_seen_in(*modules: str) -> str:
    """What `_owner` says of a live stack of functions defined in ``modules``, outermost
    first (each calls the next; the innermost asks): the stack the sampler interrupts."""
    import sys as _sys

    from conformance.engine.step_sampler import owner as _owner

    def call() -> str:  # a frame of this test module: neither kvcached's nor vLLM's
        return _owner(_sys._getframe())

    for module in reversed(modules):
        scope: dict[str, Any] = {"__name__": module}
        exec("def run(callee):\n    return callee()\n", scope)  # noqa: S102
        call = functools.partial(scope["run"], call)  # a partial adds no Python frame
    return call()


def test_a_sample_counts_for_the_innermost_frame_of_kvcached_or_vllm() -> None:
    assert _owner_seen_in("vllm.v1.core.sched.scheduler", "kvcached.ledger") == "kvcached kvcached.ledger:run"
    assert _owner_seen_in("kvcached.pages", "vllm.v1.core.block_pool") == "vllm"
    # A library frame (heapq, contextlib) counts for its caller.
    assert _owner_seen_in("vllm.x", "kvcached.ledger", "heapq") == "kvcached kvcached.ledger:run"
    assert _owner_seen_in("json") == "other"  # the test's own frames and pytest's are neither


def test_the_sampled_split_is_per_decode_step_and_shows_kvcacheds_own_time() -> None:
    from bench_scheduler import sampled_per_step

    def run(samples: dict[str, int]) -> Run:
        return Run(CONCURRENCY, [0.001] * len(TOKENS), [0] * len(TOKENS), list(TOKENS), samples)

    native = run({"schedule vllm": 30})
    kvc = run({"schedule vllm": 33, "schedule kvcached kvcached.ledger:BlockLedger.allocate": 6,
               "update_from_output kvcached kvcached.pages:PagePool.collect": 3})
    got = sampled_per_step([Pair(native, kvc)] * 3)
    steps = TOKENS.count(CONCURRENCY)  # 3 decode steps
    assert got["schedule all"] == [30 / steps, 39 / steps]
    assert got["schedule kvcached"] == [0.0, 6 / steps]
    assert got["schedule kvcached kvcached.ledger:BlockLedger.allocate"] == [0.0, 2.0]
    assert got["update_from_output kvcached"] == [0.0, 1.0]
    assert sampled_per_step([Pair(_run(0.002, 0.001), _run(0.002, 0.001))]) == {}  # not sampled: no split
