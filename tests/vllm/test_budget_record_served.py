"""A budget record truncated and restored under a running `vllm serve`: it serves on, then recovers.

One real OpenAI server (front end, EngineCore and worker in their own processes) with its
own budget folder. Its record is truncated while it serves: the same requests are answered
as before, on the pages the engine holds, and ``kvctl`` reports the record unreadable. The
old bytes are written back: the engine publishes into the record again, and requests are
answered as before. Every wait is on an event (a reply, the record's content), with a
deadline, never on speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conformance.cases import ARCHETYPES
from conformance.models import ensure_model
from conformance.serving.server import ServerSpec, one_at_a_time, parity_prompts, serving, with_tokenizer
from kvcached.budget import POLL_S, BudgetRecord, Snapshot

pytestmark = [pytest.mark.multiprocess]

MAX_TOKENS = 8
DEADLINE_S = 120.0


def _kvctl_list(budget_dir: Path) -> subprocess.CompletedProcess[str]:
    kvctl = Path(sys.executable).parent / "kvctl"
    return subprocess.run([str(kvctl), "list"], env={**os.environ, "KVCACHED_BUDGET_DIR": str(budget_dir)},
                          capture_output=True, text=True, timeout=60, check=False)


def _published_since(path: Path, since: float, step: Callable[[], object]) -> Snapshot:
    """The record once the engine has published into it after ``since``.

    An engine publishes after a step, at most every `POLL_S` (kvcached.budget): requests that
    all end within that period of its last publish leave nothing to publish them, and an idle
    engine takes no step. So each look that finds no publish runs ``step`` (one request)
    before looking again (CI, 12-03: a fast server answered every request in that period).
    """
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with BudgetRecord(str(path), create=False) as record:
            snap = record.snapshot()
        if snap.engines and min(e.updated for e in snap.engines) > since and snap.used > 0:
            return snap
        assert time.monotonic() < deadline, f"the engine never published again: {snap}"
        time.sleep(POLL_S)
        step()


def test_a_record_truncated_under_vllm_serve_degrades_then_recovers(tmp_path: Path) -> None:
    model = with_tokenizer(ensure_model(ARCHETYPES["llama"].model), tmp_path / "model")
    budget_dir = tmp_path / "budget"
    budget_dir.mkdir(mode=0o700)
    record = budget_dir / "host.budget"
    env = (("KVCACHED_PAGE_SIZE", str(64 << 10)), ("KVCACHED_BUDGET_DIR", str(budget_dir)))
    prompts = parity_prompts(4)
    with serving(ServerSpec("kvcached", True, extra_env=env), model, tmp_path / "logs") as server:
        def step() -> object:
            return one_at_a_time(server, prompts[:1], MAX_TOKENS)

        before = one_at_a_time(server, prompts, MAX_TOKENS)
        live = _published_since(record, 0.0, step)
        saved = record.read_bytes()
        os.truncate(record, 10)
        listed = _kvctl_list(budget_dir)
        degraded = one_at_a_time(server, prompts, MAX_TOKENS)  # served on the pages it holds
        assert record.stat().st_size == 10, "nothing wrote over the damaged record"
        restored_at = time.time()
        record.write_bytes(saved)
        after = one_at_a_time(server, prompts, MAX_TOKENS)
        back = _published_since(record, restored_at, step)
        log = server.log()
    assert degraded == before and after == before
    assert listed.returncode == 1 and "host.budget" in listed.stdout + listed.stderr, listed
    assert "truncated" in listed.stdout + listed.stderr
    assert [e.name for e in back.engines] == [e.name for e in live.engines]
    assert {s.index for s in back.slots} == {s.index for s in live.slots}
    assert "Traceback" not in log and "BudgetRecordError" not in log
