"""`bench_client.BenchClient`: vLLM's benchmark client in one child per server, how it fails.

Its success path (phases against a real `vllm serve`) is in ``tests/vllm/test_serve.py``; here
the child is real too (it imports vLLM's client), and each failure is a real one: arguments
vLLM's parser refuses, a child that dies, a phase that outlasts its timeout.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_client import BenchClient, ClientError


def test_a_failed_phase_names_itself_with_its_log_and_the_child_takes_the_next(tmp_path: Path) -> None:
    with BenchClient(tmp_path / "client.log") as client:
        pid = client.proc.pid
        for tag in ("first", "second"):
            with pytest.raises(ClientError, match=rf"(?s){tag}: the client failed: SystemExit: 2.*--no-such-flag"):
                client.run(["--no-such-flag"], tmp_path / f"{tag}.json", tag)
            assert (tmp_path / f"{tag}.client.log").is_file()
        assert client.proc.pid == pid and client.proc.poll() is None
    assert client.proc.returncode == 0  # end of stdin ends it


def test_a_dead_child_fails_the_phase_and_every_later_one(tmp_path: Path) -> None:
    with BenchClient(tmp_path / "client.log") as client:
        os.kill(client.proc.pid, signal.SIGKILL)
        with pytest.raises(ClientError, match=f"a: the client process exited with -{signal.SIGKILL}"):
            client.run(["--help"], tmp_path / "a.json", "a")
        with pytest.raises(ClientError, match="b: the client process exited"):
            client.run(["--help"], tmp_path / "b.json", "b")


def test_a_phase_with_no_answer_in_time_kills_the_child(tmp_path: Path) -> None:
    with BenchClient(tmp_path / "client.log") as client:
        os.kill(client.proc.pid, signal.SIGSTOP)  # alive, answering nothing
        with pytest.raises(ClientError, match=r"slow: a phase gave no answer in 1 s; the client was killed"):
            client.run(["--help"], tmp_path / "slow.json", "slow", timeout_s=1.0)
        assert client.proc.wait(10) == -signal.SIGKILL
        with pytest.raises(ClientError, match="next: a phase gave no answer"):
            client.run(["--help"], tmp_path / "next.json", "next")


def test_a_block_left_by_an_exception_kills_the_child_at_once(tmp_path: Path) -> None:
    """A run that fails or is stopped (SIGTERM is a `SystemExit` in the benchmarks) leaves no
    phase running on: the child is killed, not waited for."""
    with pytest.raises(SystemExit), BenchClient(tmp_path / "client.log") as client:
        raise SystemExit(143)
    assert client.proc.returncode == -signal.SIGKILL
