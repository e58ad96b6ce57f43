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
* Every case of every job ends with a result file (a `conformance.results.CaseResult`): when
  a child crashes or times out, the runner writes an error result naming the cause and the
  tail of the child's log.
* A child's log is scanned for Python tracebacks; any found is reported (process issue),
  since case errors are recorded in the result files and never printed.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance import stacks
from conformance.cases import Case, Control, Layout
from conformance.engine_env import engine_env, with_model_runner

AGENT_ENV = "CONFORMANCE_AGENT"  # conformance.engine.agent.ENV (the parent imports no engine code)
from conformance.results import CaseResult, Job, JobEntry, load_result, write_atomic

#: What every engine child adds to `conformance.engine_env.engine_env` of its device.
CHILD_ENV = {
    # Prefix-cache hashes are seeded from PYTHONHASHSEED; a fixed seed makes block hashes
    # equal across processes, which is how KV blocks of two engines are matched.
    "PYTHONHASHSEED": "0",
}
KVCACHED_KNOBS = ("KVCACHED_ENABLE", "KVCACHED_FAULT_PLAN", "KVCACHED_BUDGET_BYTES", "KVCACHED_PAGE_SIZE",
                  "KVCACHED_MAX_CACHED_BLOCKS")


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
    device: str = "cpu"  # the `conformance.device` profile of every engine
    jobs: int = 1  # archetype groups run side by side (`cli._run_matrix`)
    model_runner: str = "v1"  # `conformance.engine_env.MODEL_RUNNER_ENV`: v1, v2, or vllm (vLLM decides)

    @property
    def async_required(self) -> bool:
        """Whether an async case that ran the synchronous scheduler fails (else it is explained):
        on the CPU only with the harness's override; on a GPU vLLM runs it natively."""
        return self.async_override or self.device != "cpu"


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


def child_env(engine: str, layout: Layout = Layout.INPROC, model_runner: str = "v1",
              device: str = "cpu") -> dict[str, str]:
    """Engine environment; kvcached knobs other than the switch are set per case by the child.
    ``model_runner`` and ``device``: `RunConfig`'s.

    The layout is a process's, not a case's: vLLM caches its environment once an engine
    core has started in a process, so each layout gets engine processes of its own.
    """
    env = {k: v for k, v in os.environ.items() if k not in KVCACHED_KNOBS}
    env.update(engine_env(device) | CHILD_ENV)
    if layout.multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        # vLLM binds each CPU worker to a NUMA node of its own unless told not to.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env[AGENT_ENV] = "1"  # the harness's agent in every process of the engine (observes only)
    if engine == "kvcached":
        env["KVCACHED_ENABLE"] = "1"
    return with_model_runner(env, model_runner)


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


def _relay(pipe: Any, proc: subprocess.Popen[bytes], deadline: float, on_line: Callable[[str], None]) -> bool:
    """Relay the child's progress lines until it closes the pipe; True if the deadline hit."""
    buf = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stacks.dump_then_kill(proc.pid)  # where it hung goes to the job's log
            return True
        ready, _, _ = select.select([pipe], [], [], min(remaining, 1.0))
        if not ready:
            if proc.poll() is not None:
                return False
            continue
        chunk = pipe.read(4096)
        if not chunk:
            return False
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            on_line(line.decode(errors="replace"))


def run_child(
    label: str, job: Job, env: dict[str, str], job_dir: Path, timeout_s: float, on_line: Callable[[str], None]
) -> ChildOutcome:
    """Start ``conformance.engine`` on ``job``; relay its progress lines; enforce the timeout."""
    job_dir.mkdir(parents=True, exist_ok=True)
    job_path = job_dir / f"{label}.job.json"
    write_atomic(job_path, job)
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
            cwd=str(Path(__file__).resolve().parents[2]),
            start_new_session=True,  # its own process group, so a timeout reaches all of it
        )
    os.close(w_fd)
    with os.fdopen(r_fd, "rb", buffering=0) as pipe:
        timed_out = _relay(pipe, proc, t0 + timeout_s, on_line)
    rc = proc.wait()
    return ChildOutcome(label, rc, timed_out, time.monotonic() - t0, log_path, _scan_tracebacks(log_path))


def planned_runs(cases: Iterable[Case]) -> int:
    """Engine-side case runs a matrix takes (references of controls are shared)."""
    cases = list(cases)
    refs = {base_case(c) for c in cases}
    return len(refs) + len(cases)


class Runner:
    """Drives the children for one matrix and collects their result files.

    ``on_case_done(side, case_id, seconds, ok)`` is called as each engine-side case ends.
    """

    def __init__(
        self,
        cfg: RunConfig,
        say: Callable[[str], None],
        on_case_done: Callable[[str, str, float, bool], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.say = say
        self.on_case_done = on_case_done or (lambda *_: None)
        self.raw = cfg.run_dir / "raw"
        self.children: list[ChildOutcome] = []

    def _job(self, side: str, engine: str, entries: list[JobEntry]) -> Job:
        return Job(
            side=side,  # type: ignore[arg-type]
            engine=engine,  # type: ignore[arg-type]
            out_dir=self.raw / side,
            page_size=self.cfg.page_size,
            kv_cache_bytes=self.cfg.kv_cache_bytes,
            async_override=self.cfg.async_override,
            budget_bytes_override=self.cfg.budget_bytes,
            entries=entries,
            device=self.cfg.device,  # type: ignore[arg-type]
        )

    def result_path(self, side: str, case: Case) -> Path:
        return self.raw / side / f"{case.case_id}.json"

    def npz_path(self, side: str, case: Case) -> Path | None:
        p = self.raw / side / f"{case.case_id}.npz"
        return p if p.is_file() else None

    def load(self, side: str, case: Case) -> CaseResult:
        return load_result(self.result_path(side, case))

    def _on_line(self, side: str) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "DONE":
                self.on_case_done(side, parts[1], float(parts[2]), parts[3] == "ok")

        return on_line

    def _run(self, side: str, engine: str, label: str, cases: list[Case], entries: list[JobEntry]) -> None:
        layout = cases[0].layout
        if any(c.layout is not layout for c in cases):
            raise ValueError(f"{label}: one engine process serves one layout")
        (self.raw / side).mkdir(parents=True, exist_ok=True)
        slow = 3 if any(c.archetype.slow for c in cases) else 1
        # A multiprocess engine starts its own processes for every case (about 45 s at TP=2 here).
        slow += 1 if layout.multiprocess else 0
        # torch.compile and CUDA-graph capture at every engine start: a multiprocess group of compiled
        # cases ran past 420 s on the H200 with 8 jobs (0.26.0).
        slow += 2 if any(c.compiled for c in cases) else 0
        timeout = self.cfg.startup_timeout_s + self.cfg.case_timeout_s * len(cases) * slow
        self.say(f"  -> {label}: {len(cases)} case(s), {engine} engine")
        job = self._job(side, engine, entries)
        out = run_child(label, job, child_env(engine, layout, self.cfg.model_runner, self.cfg.device), self.raw / "jobs", timeout, self._on_line(side))
        self.children.append(out)
        why = (f"child timed out after {timeout:.0f} s (its processes' stacks end {out.log_path.name})"
               if out.timed_out else f"child exited with {out.returncode}")
        for c in cases:
            self._ensure_result(side, engine, c, why, out.log_path)
        if out.tracebacks:
            self.say(f"      ! {len(out.tracebacks)} traceback(s) in {out.log_path}")
        self.say(f"     {label} finished in {out.wall_s:.0f} s")

    def _ensure_result(self, side: str, engine: str, case: Case, why: str, log_path: Path) -> None:
        """A case the child did not finish gets an error result (keeping what it wrote)."""
        p = self.result_path(side, case)
        prev = self.load(side, case) if p.is_file() else None
        if prev is not None and prev.finished:
            return
        status = prev.kv_status if prev is not None else "not-run"
        base = prev or CaseResult(case=case, side=side, engine=engine)  # type: ignore[arg-type]
        err = base.model_copy(
            update={"error": f"{why} before the case finished (kv_status={status})", "traceback": _tail(log_path)}
        )
        write_atomic(p, err)
        self.on_case_done(side, case.case_id, 0.0, False)

    def run_archetype(self, arch: str, cases: list[Case]) -> None:
        regular = [c for c in cases if not c.is_control]
        controls = [c for c in cases if c.is_control]
        ref_cases = list(dict.fromkeys([*regular, *(base_case(c) for c in controls)]))
        # Budget cases probe geometry first; running them last lets them reuse it.
        ref_cases.sort(key=lambda c: c.fault.physical_budget)
        entries = [JobEntry(case=c) for c in ref_cases]
        self._run("reference", "native", f"reference-{arch}", ref_cases, entries)
        groups = group_candidate_cases(regular, self.cfg.candidate, self.cfg.isolate_knob_cases)
        for i, group in enumerate(groups):
            self._run_entries("candidate", self.cfg.candidate, f"candidate-{arch}-{i}", group, group)
        if controls:
            self._run_entries("control", "native", f"control-{arch}", controls, [base_case(c) for c in controls])

    def _entry(self, case: Case, base: Case) -> JobEntry | None:
        """What a candidate or control receives from the reference (None: it failed)."""
        ref = self.load("reference", base)
        if ref.error or ref.workload is None:
            return None
        return JobEntry(case=case, workload=ref.workload, geometry=ref.geometry, plan=ref.plan)

    def _run_entries(self, side: str, engine: str, label: str, cases: list[Case], bases: list[Case]) -> None:
        runnable: list[tuple[Case, JobEntry]] = []
        for c, b in zip(cases, bases, strict=True):
            if (e := self._entry(c, b)) is not None:
                runnable.append((c, e))
                continue
            (self.raw / side).mkdir(parents=True, exist_ok=True)
            skipped = CaseResult(
                case=c, side=side, engine=engine, error="not run: the reference case failed", t_total=0.0  # type: ignore[arg-type]
            )
            write_atomic(self.result_path(side, c), skipped)
            self.on_case_done(side, c.case_id, 0.0, False)
        if runnable:
            self._run(side, engine, label, [c for c, _ in runnable], [e for _, e in runnable])
