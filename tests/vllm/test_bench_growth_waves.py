"""`benchmarks/bench_growth_waves.py`: counts of the pages the scheduler maps on its path.

A small burst (24 requests, 16 in flight) through the real scheduler and pool: the counts are
the same every run (no timing), and they see a real difference: with the workers' replies in
only when waited for, more pages block than with replies in by the next step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("kvcached._vmm", reason="native extension not built")

import bench_growth_waves as gw

SHAPE = gw.Shape(requests=24, in_flight=16)


@pytest.fixture(scope="module")
def counted() -> Iterator[dict[str, list[gw.Row]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCACHED_BUDGET_PATH", "off")  # the pool's own pages only: no device budget record
        yield {replies: gw.summarize("t", replies, gw.run(SHAPE, 1, replies)) for replies in gw.REPLIES}


def test_a_burst_takes_its_pages_and_counts_the_same_every_run(counted: dict[str, list[gw.Row]]) -> None:
    (row,) = counted["step"]
    # 24 requests of 1,024 + 256 tokens: 81 blocks each, 16 of them at once on 64-block pages.
    assert row.steps > gw.OUTPUT and row.pages_taken >= 16 * 81 // gw.BLOCKS_PER_PAGE
    assert gw.summarize("t", "step", gw.run(SHAPE, 1, "step")) == counted["step"]


def test_replies_in_only_when_waited_for_block_more_pages(counted: dict[str, list[gw.Row]]) -> None:
    (step,), (waited,) = counted["step"], counted["waited"]
    assert step.pages_taken == waited.pages_taken
    assert waited.blocking_maps_in_schedule > step.blocking_maps_in_schedule
    assert waited.blocking_maps_in_schedule <= waited.blocking_maps_in_the_step
