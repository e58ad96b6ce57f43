"""Engines in containers share one budget record: real PID namespaces (``unshare``), each engine PID 1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.budget import BudgetRecord
from kvcached.cli import kvctl

# One engine's side of the record, as the engine seams do it: a rank claims a slot, then the
# engine registers under its default name (`engine_name`) through `join_budgets`. It prints its
# PID and name, then holds the record until its stdin closes.
ENGINE = r"""
import os, sys
from types import SimpleNamespace as NS
from kvcached.budget import open_slot
from kvcached.integration.vllm.engine import engine_name, join_budgets

path = sys.argv[1]
record, slot = open_slot(path, None, "cpu", rank=0)
vllm_config = NS(model_config=NS(served_model_name="meta-llama/Llama-3.1-8B"))
budget = join_budgets(engine_name(vllm_config), [NS(budget=NS(path=path, slot=slot.index))], 4096)
print(os.getpid(), budget.names[0], flush=True)
sys.stdin.read()
budget.close()
record.close()
"""

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _namespaces_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _namespaces_available(), reason="needs root and unshare --pid (real PID namespaces)")
def test_two_engines_each_pid_1_in_its_own_namespace_share_one_record(tmp_path: Path, capsys) -> None:
    """Both engines were ``Llama-3.1-8B-1`` and the second was refused ("already live"); the
    default name now tells their PID namespaces apart, and both hold the one record."""
    path = str(tmp_path / "host.budget")
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_ENGINE_NAME"}
    engines = [subprocess.Popen([*UNSHARE, sys.executable, "-c", ENGINE, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for _ in range(2)]
    try:
        said = []
        for engine in engines:  # each line is written once its engine holds its row
            line = engine.stdout.readline()  # type: ignore[union-attr]
            assert line, f"an engine failed to join: {engine.communicate()[1][-2000:]}"
            said.append(line.split())
        assert [pid for pid, _ in said] == ["1", "1"], "each engine is PID 1 in its namespace"
        names = [name for _, name in said]
        assert len(set(names)) == 2 and all(n.startswith("Llama-3.1-8B-1@pidns") for n in names)
        with BudgetRecord(path, create=False) as record:
            snap = record.snapshot()
        assert sorted(e.name for e in snap.engines) == sorted(names) and {e.pid for e in snap.engines} == {1}
        assert len(snap.slots) == 2
        assert kvctl.main(["--path", path, "list"]) == 0
        listed = capsys.readouterr().out
        assert all(name in listed for name in names)
    finally:
        for engine in engines:
            engine.communicate(timeout=120)
    assert [e.returncode for e in engines] == [0, 0]
    with BudgetRecord(path, create=False) as record:
        assert record.snapshot(include_dead=True).engines == ()
