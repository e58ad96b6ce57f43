"""The step timer's CUDA graph replay count (`conformance.engine.step_timer.ReplayCounter`): each
replay counted once, through the original, however often the counter is installed."""

from __future__ import annotations

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
