"""Runs a matrix: one child process per (side, archetype), reference first.

Order per archetype: the reference (native) child runs every case and the base of every
control case, deriving workloads from its engine's geometry; then the candidate child(ren)
and the control child run the same workloads. Sides never share a process, so whatever the
candidate (kvcached) patches cannot reach the reference.

kvcached resolves its configuration (``KvcachedConfig.resolve()``) when each engine's pool
is built, so per-case knobs (fault plan, physical budget) are set in the child's environment
just before that case's engine is built and removed after it. ``--isolate-knob-cases`` gives
every such case a process of its own instead, for a kvcached that reads its environment once.

Invariants:
* Every case of every job ends with a result file: when a child crashes or times out, the
  runner writes an error result naming the cause and the tail of the child's log.
* A child's log is scanned for Python tracebacks; any found is reported (process issue),
  since case errors are recorded in the result files and never printed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.cases import Case, Control
from conformance.engine_env import ENGINE_ENV as BASE_ENGINE_ENV

ENGINE_ENV = {
    **BASE_ENGINE_ENV,
    # Prefix-cache hashes are seeded from PYTHONHASHSEED; a fixed seed makes block hashes
    # equal across processes, which is how KV blocks of two engines are matched.
    "PYTHONHASHSEED": "0",
}
KVCACHED_KNOBS = ("KVCACHED_ENABLE", "KVCACHED_FAULT_PLAN", "KVCACHED_BUDGET_BYTES", "KVCACHED_PAGE_SIZE")


@dataclass(frozen=True)
class RunConfig:
    run_dir: Path
    candidate: str  # "kvcached" | "native"
    page_size: int | None  # explicit KVCACHED_PAGE_SIZE; None: derived per archetype from geometry
    kv_cache_bytes: int
    async_override: bool = True
    isolate_knob_cases: bool = False
    budget_bytes: int | None = None
    startup_timeout_s: float = 120.0
    case_timeout_s: float = 150.0


@dataclass
class ChildOutcome:
    label: str
    returncode: int | None
    timed_out: bool
    wall_s: float
    log_path: Path
    tracebacks: list[str] = field(default_factory=list)


def base_case(c: Case) -> Case:
    """The reference case a control is compared against (same case without the control)."""
    from dataclasses import replace

    return replace(c, control=Control.NONE)


def child_env(engine: str) -> dict[str, str]:
    """Engine environment; kvcached knobs other than the switch are set per case by the child."""
    env = {k: v for k, v in os.environ.items() if k not in KVCACHED_KNOBS}
    env.update(ENGINE_ENV)
    if engine == "kvcached":
        env["KVCACHED_ENABLE"] = "1"
    return env


def group_candidate_cases(cases: Iterable[Case], engine: str, isolate_knob_cases: bool) -> list[list[Case]]:
    """Candidate jobs: one shared process (plus one per knob-setting kvcached case if isolating)."""
    shared: list[Case] = []
    alone: list[list[Case]] = []
    for c in cases:
        if isolate_knob_cases and engine == "kvcached" and not c.fault.is_none:
            alone.append([c])
        else:
            shared.append(c)
    return ([shared] if shared else []) + alone


def _scan_tracebacks(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith(("Traceback (most recent call last)", "Exception ignored in")):
            found.append("\n".join(lines[i : i + 25]))
    return found


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def run_child(
    label: str,
    job: dict[str, Any],
    env: dict[str, str],
    job_dir: Path,
    timeout_s: float,
    on_line: Callable[[str], None],
) -> ChildOutcome:
    """Start ``conformance.engine`` on ``job``; relay its progress lines; enforce the timeout."""
    job_dir.mkdir(parents=True, exist_ok=True)
    job_path = job_dir / f"{label}.job.json"
    job_path.write_text(json.dumps(job))
    log_path = job_dir / f"{label}.log"
    r_fd, w_fd = os.pipe()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.engine", str(job_path), str(w_fd)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(w_fd,),
            cwd=str(Path(__file__).resolve().parent.parent),
            start_new_session=True,  # its own process group, so a timeout kills all of it
        )
    os.close(w_fd)
    timed_out = False
    buf = b""
    with os.fdopen(r_fd, "rb", buffering=0) as pipe:
        while True:
            remaining = timeout_s - (time.monotonic() - t0)
            if remaining <= 0:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([pipe], [], [], min(remaining, 1.0))
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            chunk = pipe.read(4096)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                on_line(line.decode(errors="replace"))
    rc = proc.wait()
    return ChildOutcome(label, rc, timed_out, time.monotonic() - t0, log_path, _scan_tracebacks(log_path))


class Runner:
    """Drives the children for one matrix and collects their result files."""

    def __init__(self, cfg: RunConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.raw = cfg.run_dir / "raw"
        self.children: list[ChildOutcome] = []

    def _job(self, side: str, engine: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "side": side,
            "engine": engine,
            "out_dir": str(self.raw / side),
            "page_size": self.cfg.page_size,
            "kv_cache_bytes": self.cfg.kv_cache_bytes,
            "async_override": self.cfg.async_override,
            "budget_bytes_override": self.cfg.budget_bytes,
            "entries": entries,
        }

    def result_path(self, side: str, case: Case) -> Path:
        return self.raw / side / f"{case.case_id}.json"

    def load(self, side: str, case: Case) -> dict[str, Any]:
        return json.loads(self.result_path(side, case).read_text())

    def _run(self, side: str, engine: str, label: str, cases: list[Case], entries: list[dict[str, Any]]) -> None:
        (self.raw / side).mkdir(parents=True, exist_ok=True)
        timeout = self.cfg.startup_timeout_s + self.cfg.case_timeout_s * len(cases) * (
            3 if any(c.archetype.slow for c in cases) else 1
        )
        t0 = time.monotonic()

        def on_line(line: str) -> None:
            parts = line.split()
            if parts and parts[0] == "DONE":
                status = parts[3] if len(parts) > 3 else "?"
                self.say(f"      {status:<5} {parts[1]} ({parts[2]} s)")

        self.say(f"  -> {label}: {len(cases)} case(s), {engine} engine")
        out = run_child(
            label,
            self._job(side, engine, entries),
            child_env(engine),
            self.raw / "jobs",
            timeout,
            on_line,
        )
        self.children.append(out)
        for c in cases:
            p = self.result_path(side, c)
            done = p.is_file() and "t_total" in json.loads(p.read_text())
            if not done:
                why = (
                    f"child timed out after {timeout:.0f} s" if out.timed_out else f"child exited with {out.returncode}"
                )
                prev = json.loads(p.read_text()) if p.is_file() else {}
                prev.update(
                    {
                        "case": c.to_json(),
                        "side": side,
                        "engine": engine,
                        "error": f"{why} before the case finished (kv_status={prev.get('kv_status', 'not-run')})",
                        "traceback": _tail(out.log_path),
                    }
                )
                p.write_text(json.dumps(prev))
        if out.tracebacks:
            self.say(f"      ! {len(out.tracebacks)} traceback(s) in {out.log_path}")
        self.say(f"     {label} finished in {time.monotonic() - t0:.0f} s")

    def run_archetype(self, arch: str, cases: list[Case]) -> None:
        regular = [c for c in cases if not c.is_control]
        controls = [c for c in cases if c.is_control]
        ref_cases: list[Case] = list(regular)
        for c in controls:
            b = base_case(c)
            if b not in ref_cases:
                ref_cases.append(b)
        # Budget cases probe geometry first; running them last lets them reuse it.
        ref_cases.sort(key=lambda c: c.fault.physical_budget)
        self._run("reference", "native", f"reference-{arch}", ref_cases, [{"case": c.to_json()} for c in ref_cases])

        def entry(c: Case, base: Case) -> dict[str, Any]:
            ref = self.load("reference", base)
            if ref.get("error") or "workload" not in ref:
                return {"case": c.to_json(), "skip": True}
            return {"case": c.to_json(), "workload": ref["workload"], "geometry": ref["geometry"], "plan": ref["plan"]}

        for i, group in enumerate(group_candidate_cases(regular, self.cfg.candidate, self.cfg.isolate_knob_cases)):
            entries = [entry(c, c) for c in group]
            self._run_entries("candidate", self.cfg.candidate, f"candidate-{arch}-{i}", group, entries)
        if controls:
            entries = [entry(c, base_case(c)) for c in controls]
            self._run_entries("control", "native", f"control-{arch}", controls, entries)

    def _run_entries(
        self, side: str, engine: str, label: str, cases: list[Case], entries: list[dict[str, Any]]
    ) -> None:
        runnable = [(c, e) for c, e in zip(cases, entries, strict=True) if not e.get("skip")]
        for c, e in zip(cases, entries, strict=True):
            if e.get("skip"):
                (self.raw / side).mkdir(parents=True, exist_ok=True)
                self.result_path(side, c).write_text(
                    json.dumps(
                        {
                            "case": c.to_json(),
                            "side": side,
                            "engine": engine,
                            "error": "not run: the reference case failed",
                            "t_total": 0,
                        }
                    )
                )
        if runnable:
            self._run(side, engine, label, [c for c, _ in runnable], [e for _, e in runnable])
