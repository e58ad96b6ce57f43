"""Scheduler time per step inside a running EngineCore, for benchmarks of `vllm serve`.

A served engine's front end is the API server, which cannot reach the harness's utility
calls; so this timer is switched on by the environment instead. With ``CONFORMANCE_AGENT=1``
and ``CONFORMANCE_STEP_LOG=<path>``, the agent plugin installs it in the EngineCore process
(vLLM loads general plugins there too). It changes nothing an engine computes.

The first ``Scheduler.schedule`` call puts timed ``schedule`` / ``update_from_output``
attributes on that scheduler *instance*. They call what the class then resolves to, so
every class-level wrapper (kvcached's seams, whichever plugin loaded first) is inside the
timed region. Step i is the i-th ``schedule`` with the i-th ``update_from_output`` (async
scheduling runs one ahead), as in ``benchmarks/bench_scheduler.py``.

Each step appends one JSON line ``[wall_time, schedule_s, update_s, requests, tokens, replays,
maps, unmaps, blocking_maps, blocking_unmaps, replays_at_schedule]`` (``requests``: requests
scheduled in the step; ``replays``: CUDA graph replays in this process so far, counted at the
step's update, where the worker runs in the EngineCore process, as with vLLM's UniProcExecutor on
one GPU; then the kvcached pool's page counts so far, `page_counts`, zeros on native; last, the
replays so far when the step's ``schedule`` began). Exactly one step is launched between two
``schedule`` calls, async scheduling or not, so the change of the last field from one row to the
next is that step's own replays: whether it ran as a graph or fell back to eager. (At the
update, async scheduling has already launched the next step: 12-05's logs, which lack the last
field, read one row late.) Rows go to the path, buffered: written every
`FLUSH_EVERY` steps and whenever the engine runs out of requests (outside the timed
region), and when the scheduler shuts down or the process exits.

With ``CONFORMANCE_STEP_SAMPLE_US=<µs>`` as well, a `StepSampler` samples the stack of every
timed call that often, and each flush writes ``<path>.samples.json``: the samples of the decode
steps (those scheduling one token for each of their requests) by whose code ran, vLLM's or which
of kvcached's functions (`conformance.engine.step_sampler`). Sampling slows the calls.
"""

from __future__ import annotations

import atexit
import json
import lzma
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.engine.step_sampler import StepSampler, write_counts

ENV = "CONFORMANCE_STEP_LOG"
#: Sample the timed calls' stacks every this many µs (`conformance.engine.step_sampler`).
SAMPLE_ENV = "CONFORMANCE_STEP_SAMPLE_US"
FLUSH_EVERY = 256


def samples_path(step_log: str | Path) -> Path:
    """Where a sampled step log's decode-step samples go (`StepLog.flush`), beside it."""
    return Path(f"{step_log}.samples.json")


class StepLog:
    """Buffered rows of one scheduler, appended to ``path``."""

    def __init__(self, path: str, sampler: StepSampler | None = None) -> None:
        self.path = path
        self.rows: list[tuple[float, ...]] = []
        self.sampler = sampler
        self.decode_steps: list[int] = []  # the steps whose samples the sampler's file counts

    def flush(self) -> None:
        if not self.rows:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)
        self.rows.clear()
        if self.sampler is not None:
            write_counts(samples_path(self.path), self.sampler, self.decode_steps)


class ReplayCounter:
    """Counts ``torch.cuda.CUDAGraph.replay`` calls in this process (wrapped once; 0 where no
    graph is replayed, as on the CPU)."""

    count = 0

    @classmethod
    def install(cls) -> None:
        import torch

        original = torch.cuda.CUDAGraph.replay
        if getattr(original, "_conformance_replays", False):
            return

        def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.count += 1
            return original(self, *args, **kwargs)

        replay._conformance_replays = True  # type: ignore[attr-defined]
        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]


def read_rows(path: str | Path) -> list[list[float]]:
    """The rows a `StepLog` appended to ``path``, in order (``.xz``: a log compressed to be kept,
    as under ``reports/``)."""
    path = Path(path)
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def instrument(sched: Any, path: str, sample_us: int = 0) -> StepLog:
    """Put the timed methods on ``sched`` (instance attributes) and return their log. With
    ``sample_us``, a `StepSampler` samples every call's stack that often, and the log's flush
    writes the decode steps' samples (steps scheduling one token for each of their requests)
    to ``PATH.samples.json`` (`step_sampler.write_counts`)."""
    sampler = StepSampler(sample_us / 1e6) if sample_us else None
    log = StepLog(path, sampler)
    schedule_fn = type(sched).schedule.__get__(sched)
    update_fn = type(sched).update_from_output.__get__(sched)
    shutdown_fn = type(sched).shutdown.__get__(sched)
    # Steps awaiting their update: (wall, schedule s, requests, tokens, replays, step number).
    scheduled: deque[tuple[float, float, int, int, int, int]] = deque()
    clock = time.perf_counter
    pages = page_counts(sched)
    timed = [0]  # timed schedule calls so far: a step's number, for its samples

    def schedule(*args: Any, **kwargs: Any) -> Any:
        replays = ReplayCounter.count  # every replay since the last schedule is the last step's
        step = timed[0]
        timed[0] += 1
        if sampler is not None:
            sampler.enter("schedule", step)
        t = clock()
        try:
            out = schedule_fn(*args, **kwargs)
        finally:
            if sampler is not None:
                sampler.exit()
        dt = clock() - t
        scheduled.append((time.time(), dt, len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens),
                          replays, step))
        return out

    def update_from_output(*args: Any, **kwargs: Any) -> Any:
        if sampler is not None:  # the samples of the step this update completes in the log (-1: none)
            sampler.enter("update_from_output", scheduled[0][-1] if scheduled else -1)
        t = clock()
        try:
            out = update_fn(*args, **kwargs)
        finally:
            if sampler is not None:
                sampler.exit()
        dt = clock() - t
        if scheduled:
            wall, schedule_s, requests, tokens, replays, step = scheduled.popleft()
            if tokens == requests:
                log.decode_steps.append(step)
            log.rows.append((wall, schedule_s, dt, requests, tokens, ReplayCounter.count, *pages(), replays))
            if len(log.rows) >= FLUSH_EVERY or not sched.has_unfinished_requests():
                log.flush()  # outside the timed region; idle: a reader may be waiting
        return out

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        log.flush()
        return shutdown_fn(*args, **kwargs)

    sched.schedule, sched.update_from_output, sched.shutdown = schedule, update_from_output, shutdown
    atexit.register(log.flush)
    return log


def page_counts(sched: Any) -> Callable[[], tuple[int, int, int, int]]:
    """What a step row ends with: the scheduler's kvcached pool's kv pages mapped (refills
    sent ahead included), unmapped (unmaps sent ahead, once settled), and mapped or unmapped
    or waited for on the scheduler's path (``blocking_maps``, ``blocking_unmaps``), so far
    (`kvcached.pages.PagePool.counters`); zeros for a native pool, which maps nothing. Read
    after the step's update, outside its timed region."""
    pool = getattr(getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None), "page_pool", None)
    if pool is None:
        return lambda: (0, 0, 0, 0)

    def counts() -> tuple[int, int, int, int]:
        c = pool.counters()
        return c.maps, c.unmaps, c.blocking_maps, c.blocking_unmaps

    return counts


def install(path: str, sample_us: int = 0) -> None:
    """Arrange for the first scheduler of this process to be timed (idempotent); ``sample_us``:
    and its calls' stacks sampled (`instrument`)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule
    if getattr(original, "_conformance_step_timer", False):
        return

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "schedule" not in vars(self):
            instrument(self, path, sample_us)  # this first step runs untimed; every later one is timed
        return original(self, *args, **kwargs)

    ReplayCounter.install()
    schedule._conformance_step_timer = True  # type: ignore[attr-defined]
    schedule.__wrapped__ = original  # type: ignore[attr-defined]
    Scheduler.schedule = schedule
