"""`bench_scheduler`'s step classes: which steps a column compares, side by side.

The benchmark's runs are real engines (minutes); these tests give its summary runs whose step
times are known, so that a column that picked the wrong steps, or could not see a slower side,
fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_only_the_decode_workload_asks_for_the_column() -> None:
    assert [w.name for w in WORKLOADS.values() if w.decode_steps] == ["decode"]
    s = summarize([Pair(_run(0.002, 0.001), _run(0.002, 0.002))], BUDGET)
    assert "decode_steps" not in s and "decode_step_count" not in s
