"""The step timer's CUDA graph replay count (`conformance.engine.step_timer.ReplayCounter`): each
replay counted once, through the original, however often the counter is installed."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest


def test_each_replay_is_counted_once_and_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from conformance.engine.step_timer import ReplayCounter

    replayed: list[object] = []
    # Stands in for the driver's replay (no GPU here); monkeypatch restores torch's own after.
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replayed.append(self))
    monkeypatch.setattr(ReplayCounter, "count", 0)
    ReplayCounter.install()
    ReplayCounter.install()  # a second engine in the process: still one wrapper
    torch.cuda.CUDAGraph.replay("graph a")
    torch.cuda.CUDAGraph.replay("graph b")
    assert ReplayCounter.count == 2 and replayed == ["graph a", "graph b"]


class _Scheduler:
    """The three methods the timer wraps, as vLLM's engine loop calls them (no vLLM here)."""

    def __init__(self) -> None:
        self.unfinished = True

    def schedule(self) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1)

    def update_from_output(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


def test_a_steps_own_replays_are_read_between_its_schedule_and_the_next(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling launches step i+1 before step i's update: the count at the update (field
    5) holds the next step's replays, the count at each schedule (the last field) does not."""
    from conformance.engine.step_timer import ReplayCounter, instrument, read_rows

    monkeypatch.setattr(ReplayCounter, "count", 0)
    sched = _Scheduler()
    log = instrument(sched, str(tmp_path / "steps.jsonl"))
    own = [1, 17, 0]  # step 1 a FULL graph, step 2 PIECEWISE pieces, step 3 eager
    sched.schedule()
    ReplayCounter.count += own[0]  # step 1 runs
    for i in (1, 2):
        sched.schedule()  # step i+1, scheduled and launched before step i's update
        ReplayCounter.count += own[i]
        sched.update_from_output()  # step i's
    sched.schedule()  # step 4: what follows step 3
    sched.update_from_output()  # step 3's
    sched.unfinished = False
    sched.update_from_output()  # step 4's; the engine idles: the log is flushed
    rows = read_rows(log.path)
    at_schedule = [r[-1] for r in rows]
    assert [b - a for a, b in itertools.pairwise(at_schedule)] == own
    # At the updates the count already holds the next step's replays: read there, step 1 would
    # look like 18 replays and step 2 like none.
    assert [r[5] for r in rows] == [18, 18, 18, 18]


def test_a_sampled_engine_saves_its_decode_steps_samples_by_owner(tmp_path: Path) -> None:
    """With a sampling interval the timed calls' stacks are sampled, and the flush writes the
    decode steps' samples (one token for each request) beside the log, by whose code ran."""
    import json
    import signal
    import time
    from types import SimpleNamespace

    from conformance.engine.step_timer import instrument

    scope: dict[str, object] = {"__name__": "vllm.v1.core.sched.fake", "time": time}
    # vLLM's side of a call: busy until the sampler has seen it (bounded), never on a timer.
    exec("def busy(seen, until):\n"  # noqa: S102
         "    while not seen() and time.monotonic() < until:\n"
         "        pass\n", scope)
    busy: Any = scope["busy"]
    tokens = iter([1, 5, 1])  # step 2 schedules 5 tokens for its one request: a prefill step

    class Sampled(_Scheduler):
        def schedule(self) -> object:
            step_tokens = next(tokens)
            if step_tokens == 1:  # only the decode steps run vLLM's code long enough to be seen
                seen = len(log.sampler.samples)  # type: ignore[union-attr]
                busy(lambda: len(log.sampler.samples) > seen, time.monotonic() + 5)  # type: ignore[union-attr]
            return SimpleNamespace(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=step_tokens)

    sched = Sampled()
    previous = signal.getsignal(signal.SIGALRM)
    try:
        log = instrument(sched, str(tmp_path / "steps.jsonl"), sample_us=200)
        sched.update_from_output()  # the update of the engine's first step, scheduled untimed: no row
        for _ in range(3):
            sched.schedule()
            sched.update_from_output()
    finally:
        signal.signal(signal.SIGALRM, previous)
    log.flush()
    saved = json.loads((tmp_path / "steps.jsonl.samples.json").read_text())
    assert saved["interval_us"] == 200 and saved["steps"] == 2  # steps 1 and 3, not the prefill step
    # Each decode step's schedule was seen, and counted under its own step: counted one step
    # late (the update after the untimed first step), they would fall on the prefill step.
    assert saved["samples"].get("schedule vllm", 0) >= 2
    assert set(saved["samples"]) <= {"schedule vllm", "schedule other", "update_from_output other"}
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no timer left armed between calls
