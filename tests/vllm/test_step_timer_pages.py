"""The step timer on a real vLLM scheduler (no model: outputs made up, as in
`benchmarks/bench_scheduler_loop.py`): every step row ends with the pool's page counts, which
a kvcached pool moves as it maps its first pages and native leaves at zero."""

from __future__ import annotations

import contextlib
import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_scheduler_loop as loop


def _rows(kvcached: bool, tmp_path: Path) -> list[list[float]]:
    from conformance.engine.step_timer import instrument, read_rows
    from kvcached.integration.vllm import scheduler as seams
    from kvcached.integration.vllm.capabilities import detect

    config = loop.Config("async", 1000, 8, 1 << 16)
    caps, planned = detect(), seams.plan()

    @contextlib.contextmanager
    def installed() -> Any:
        seams.install(caps, enabled=True, planned=planned)
        try:
            yield
        finally:
            seams.uninstall()

    # The seams stay installed for the kvcached scheduler's whole run, as in the benchmark.
    with installed() if kvcached else contextlib.nullcontext():
        sched = loop._scheduler(config, kvcached=kvcached)
        log = instrument(sched, str(tmp_path / f"{kvcached}.jsonl"))
        side = loop._Side(sched, loop._requests(config.concurrency, 8, 0, "r"), 0)
        while side.running:
            side.step()
        log.flush()
        side.finish()
    return read_rows(log.path)


@pytest.mark.parametrize("kvcached", [True, False], ids=["kvcached", "native"])
def test_each_step_row_ends_with_the_pools_page_counts(kvcached: bool, tmp_path: Path) -> None:
    rows = _rows(kvcached, tmp_path)
    assert rows and all(len(r) == 11 for r in rows)
    maps, unmaps, blocking, blocking_unmaps = (max(r[i] for r in rows) for i in (6, 7, 8, 9))
    if kvcached:
        assert maps > 0 and blocking > 0  # its first pages, mapped on the CPU inline
        assert all(a[i] <= b[i] for a, b in itertools.pairwise(rows) for i in (6, 7, 8, 9))
    else:
        assert (maps, unmaps, blocking, blocking_unmaps) == (0, 0, 0, 0)
