"""The pool's shutdown line: what an engine logs when its pool closes, read back from a log."""

from __future__ import annotations

import dataclasses

import pytest

from kvcached.stats import PoolHealth, PoolStats, parse_shutdown_lines, shutdown_line


def test_a_shutdown_line_reads_back_as_the_snapshot() -> None:
    snap = PoolStats(*range(12), page_takes=40, reserve_hits=38, blocking_maps=2, health=PoolHealth.DEGRADED)
    log = f"INFO starting\n(EngineCore pid=7) INFO [engine.py:331] {shutdown_line(snap)}\nINFO bye\n"
    (back,) = parse_shutdown_lines(log)
    assert back == {**dataclasses.asdict(snap), "health": "degraded"}
    assert parse_shutdown_lines("INFO nothing of kvcached here\n") == []


def test_an_unreadable_shutdown_line_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="unreadable kvcached shutdown line"):
        parse_shutdown_lines('kvcached: pool at shutdown: {"maps": 1,}\n')
