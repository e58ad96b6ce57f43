"""Whose code a scheduler call runs: a stack sampler for ``schedule`` and ``update_from_output``.

Per-call timers cost each timed call a frame, which inflates small, frequent functions most (the
seams kvcached adds to every running request); a sampler costs each sample instead. `StepSampler`
arms a wall-clock timer (``SIGALRM``) only while a scheduler call runs (`enter` / `exit`), so no
signal reaches the engine between calls, where its thread waits on sockets or the device; the
first sample of a call comes after a random part of the interval, so a call's first microseconds
are sampled as often as its others. Each sample is credited to the innermost frame of kvcached
(by module and function: self time, as a profiler's) or of vLLM (`owner`); library frames (heapq,
contextlib) count for their caller.

Used by `benchmarks/bench_scheduler.py` (``--sample-us``, an in-process engine) and by the
served engine's step timer (`conformance.engine.step_timer`, ``CONFORMANCE_STEP_SAMPLE_US``).
The sampler slows the calls it samples (a handler run per sample): a sampled run's step times
are not the ones to quote; its split is what it is for. Signal handlers run on the main thread,
which is the thread that schedules in an EngineCore and in an in-process engine.
"""

from __future__ import annotations

import random
import signal
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def owner(frame: Any) -> str:
    """``"kvcached MODULE:FUNCTION"``, ``"vllm"`` or ``"other"`` for a sampled stack."""
    while frame is not None:
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        if code.co_filename.startswith("<kvcached"):  # a seam compiled at install (no module)
            return f"kvcached {code.co_filename.strip('<>')}"
        if module.startswith("kvcached"):
            return f"kvcached {module}:{getattr(code, 'co_qualname', code.co_name)}"
        if module.startswith("vllm"):
            return "vllm"
        frame = frame.f_back
    return "other"


class StepSampler:
    """Stack samples of the scheduler's calls, as ``(call, step, owner)``."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"a sampling interval must be positive, not {interval_s}")
        self.interval_s = interval_s
        self.where: tuple[str, int] | None = None  # (call, step) while a call runs
        self.samples: list[tuple[str, int, str]] = []
        self._random = random.Random(0)
        signal.signal(signal.SIGALRM, self._sample)

    def _sample(self, _signum: int, frame: Any) -> None:
        if self.where is not None:
            self.samples.append((*self.where, owner(frame)))

    def enter(self, call: str, step: int) -> None:
        """A scheduler call begins: sample it until `exit`."""
        self.where = (call, step)
        signal.setitimer(signal.ITIMER_REAL, self._random.uniform(0, self.interval_s) or self.interval_s,
                         self.interval_s)

    def exit(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        self.where = None

    def counts(self, steps: Iterable[int]) -> dict[str, int]:
        """Samples of ``steps``, by ``"CALL OWNER"``."""
        wanted = set(steps)
        return dict(Counter(f"{call} {who}" for call, step, who in self.samples if step in wanted))


def write_counts(path: str | Path, sampler: StepSampler, steps: Iterable[int]) -> None:
    """Save the samples of ``steps`` (a served engine's decode steps) as JSON beside its step log:
    ``{"interval_us", "steps", "samples": {"CALL OWNER": n}}``."""
    import json

    wanted = sorted(set(steps))
    doc = {"interval_us": round(sampler.interval_s * 1e6), "steps": len(wanted), "samples": sampler.counts(wanted)}
    Path(path).write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")


# ---- the split, as the reports show it ----------------------------------------------------------
#: kvcached's functions a split names, per call, most samples first (the others are summed).
TOP_FUNCTIONS = 6


def per_step(samples: dict[str, int], steps: int) -> dict[str, float]:
    """Samples per step by ``"CALL OWNER"``, with each call's totals ``"CALL all"`` and
    ``"CALL kvcached"``."""
    out: dict[str, float] = {}
    for key, n in samples.items():
        call, who = key.split(" ", 1)
        for k in (key, f"{call} all", *([f"{call} kvcached"] if who.startswith("kvcached") else [])):
            out[k] = out.get(k, 0.0) + n / max(steps, 1)
    return out


def split(rounds: list[tuple[dict[str, float], dict[str, float]]]) -> dict[str, list[float]]:
    """``[native, kvcached]`` samples per step for every key of `per_step`, each the median over
    ``rounds`` (pairs of `per_step` results; 0 where a side has none)."""
    import statistics

    keys = sorted({key for nat, kvc in rounds for key in (*nat, *kvc)})
    return {k: [statistics.median(n.get(k, 0.0) for n, _ in rounds), statistics.median(c.get(k, 0.0) for _, c in rounds)]
            for k in keys}


def split_rows(sampled: dict[str, list[float]], interval_us: int) -> list[dict[str, object]]:
    """A `split` as table rows, ms per step: per call its whole time, vLLM's, kvcached's, then
    kvcached's `TOP_FUNCTIONS` busiest functions and the rest of kvcached."""
    ms = interval_us / 1e3
    rows: list[dict[str, object]] = []
    for call in ("schedule", "update_from_output"):
        own = sorted((k for k in sampled if k.startswith(f"{call} kvcached ")), key=lambda k: -sampled[k][1])
        rest = [sum(sampled[k][i] for k in own[TOP_FUNCTIONS:]) for i in (0, 1)]
        entries = [(what, sampled.get(f"{call} {what}", [0.0, 0.0])) for what in ("all", "vllm", "kvcached")]
        entries += [(k.split(" ", 2)[2], sampled[k]) for k in own[:TOP_FUNCTIONS]]
        entries += [("the rest of kvcached", rest)] if own[TOP_FUNCTIONS:] else []
        rows += [{"call": call, "code": what, "native ms/step": f"{nat * ms:.3f}", "kvcached ms/step": f"{kvc * ms:.3f}",
                  "difference ms": f"{(kvc - nat) * ms:+.3f}"} for what, (nat, kvc) in entries]
    return rows
