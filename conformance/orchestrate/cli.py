"""``python -m conformance``: run native and kvcached vLLM side by side and report parity.

Exit status: 0 when every comparison passed (including the negative controls being caught)
and no engine process printed a traceback; 1 on any unexplained mismatch, error or process
issue; 2 on a usage or setup error (e.g. the kvcached plugin is missing).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from conformance import cases as C
from conformance.device import Device, detect, profile
from conformance.orchestrate.compare import compare_results, judge_against_native_floor
from conformance.orchestrate.parity import ParityRow, RequestParity
from conformance.orchestrate.runner import ChildOutcome, RunConfig, Runner, base_case, planned_runs
from conformance.progress import RunProgress
from conformance.results import CaseResult

EPILOG = """
Sides and processes:
  reference  native vLLM (KVCACHED_ENABLE unset); derives every workload from its engine's geometry
  candidate  --candidate kvcached: the same engine code with KVCACHED_ENABLE=1; each engine gets its
             kvcached settings (page size, and per case fault plan / budget) in additional_config;
             --candidate native: native vLLM again (harness self-test; fault plans use a
             harness-emulated seam and the budget is a small kv_cache_memory_bytes)
  control    native vLLM: the native-vs-native noise baseline and the negative controls
Each side of each archetype and layout is its own process; each case builds a fresh engine.

Engine layouts (--layouts): inproc (EngineCore and worker in the engine process), mp (vLLM's
default multiprocess engine, TP=1), tp2 (multiprocess, tensor parallelism 2). The layout that
really ran (executor, world size) is read from the engine and reported.

Fault plans (--faults): none, cow-admission-x2, map-mid-alloc, tiny-budget, cached-cap, and
the sweep's sweep-<site>-<n>. --sweep runs the fault sweep instead of the parity matrix: each
allocation site (admission, cow-admission, map, rank1-map) failed at each of its first three
checks, sync and async (--quick: the first check, sync); `nox -s faults` writes it to
reports/faults/.
Archetypes (--archetypes): %(archetypes)s.
Reports: reports/conformance/<run-id>/ and a copy in reports/conformance/latest/.
Exit status: 0 all comparisons passed (negative controls caught) and no engine process
printed a traceback; 1 otherwise; 2 usage or setup error (e.g. kvcached plugin missing).
"""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Conformance harness: native and kvcached vLLM side by side, token-ID parity, KV-byte and "
        "logprob parity, pandas reports.",
        epilog=EPILOG % {"archetypes": ", ".join(C.ARCHETYPES)},
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_selection(p)
    _add_engine_settings(p)
    _add_run_settings(p)
    return p


def _add_selection(p: argparse.ArgumentParser) -> None:
    """Which cases run: the matrix, the device, the filters."""
    p.add_argument("--quick", action="store_true", help="smoke matrix (a few minutes; what CI runs)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the engines compute (auto: cuda when torch sees a CUDA device); cuda runs the "
                        "CUDA matrix: CUDA geometry, Triton attention for exact rows, CUDA graphs, FlashAttention 3 "
                        "beside its own native baseline")
    p.add_argument("--jobs", type=int, default=1,
                   help="archetype groups whose engine processes run at the same time (default 1; a GPU host "
                        "has room for several)")
    p.add_argument("--sweep", action="store_true", help="the fault sweep (with --quick: its CI subset)")
    p.add_argument("--archetypes", type=_csv, help="comma-separated archetypes to keep")
    p.add_argument("--schedulers", type=_csv, help="comma-separated: sync, async")
    p.add_argument("--faults", type=_csv, help="comma-separated fault plans to keep (controls always run)")
    p.add_argument("--patterns", type=_csv, help="comma-separated prefix patterns: warm3, partial, shared")
    p.add_argument("--layouts", type=_csv, help="comma-separated engine layouts: inproc, mp, tp2")
    p.add_argument("--no-controls", action="store_true", help="skip the baseline and negative controls (not for CI)")


def _add_engine_settings(p: argparse.ArgumentParser) -> None:
    """What the engines under test get: the candidate, page size, KV and budget sizes."""
    p.add_argument(
        "--candidate",
        choices=("kvcached", "native"),
        default="kvcached",
        help="engine under test (default kvcached; 'native' = harness self-test)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="kvcached page size in bytes (KVCACHED_PAGE_SIZE), also the page of the straddle length "
        "(default: per archetype, the smallest multiple of every KV backing's block stride and of 4 KiB "
        "that is >= 64 KiB, read from the reference engine)",
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None,
        help="kv_cache_memory_bytes for every engine (default 64 MiB on the CPU, 1 GiB on CUDA)",
    )
    p.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="override KVCACHED_BUDGET_BYTES of the tiny-budget plan (default: derived from geometry)",
    )
    p.add_argument(
        "--model-runner", choices=("v1", "v2", "vllm"), default="v1",
        help="vLLM's model runner on both sides: v1 (VLLM_USE_V2_MODEL_RUNNER=0, the default), v2 (=1), or vllm "
             "(unset: vLLM decides, as for a user; on CUDA that is V2 for dense models). Rows name the runner "
             "that ran",
    )
    p.add_argument(
        "--no-async-override",
        action="store_true",
        help="do not re-enable async scheduling on CPU (async cases then report 'asked async, ran sync')",
    )
    p.add_argument(
        "--isolate-knob-cases",
        action="store_true",
        help="run each kvcached case with its own fault plan/budget in a process of its own",
    )


def _add_run_settings(p: argparse.ArgumentParser) -> None:
    """Where results go, re-comparison, timeouts."""
    p.add_argument(
        "--reports-dir",
        type=Path,
        default=Path("reports/conformance"),
        help="where run directories and latest/ go (default reports/conformance)",
    )
    p.add_argument("--run-id", default=None, help="name of the run directory (default: UTC time + candidate)")
    p.add_argument("--recompare", metavar="RUN_ID", default=None,
                   help="compare and report that run's raw results again, running no engine (after a comparator "
                        "or report change; the run must have used --keep-kv; select the same cases as it did)")
    p.add_argument("--render", metavar="RUN_ID", default=None,
                   help="report that run from the comparisons it saved as each engine group finished, running "
                        "and comparing nothing (a run cut short: the groups it did not finish are listed as "
                        "process issues; without a selection here, the cases its runs selected)")
    p.add_argument("--keep-kv", action="store_true", help="keep the raw KV snapshots (.npz) after comparing")
    p.add_argument("--case-timeout", type=float, default=None,
                   help="seconds allowed per case in a child (default: the device's, 150 on the CPU, 60 on CUDA)")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")


def select_cases(args: argparse.Namespace) -> list[C.Case]:
    if args.sweep:
        matrix = C.sweep_matrix(args.quick) + C.control_cases(("llama",))
    elif args.device == Device.CUDA.value:
        matrix = C.cuda_matrix(args.quick)
    else:
        matrix = C.quick_matrix() if args.quick else C.default_matrix()
    if args.no_controls:
        matrix = [c for c in matrix if not c.is_control]
    if not args.archetypes and not args.render:  # the default matrix leaves out what cannot run here, and says so
        skipped = {a.name: why for a in C.ARCHETYPES.values() if (why := C.unavailable_here(a))}
        for name, why in skipped.items():
            print(f"conformance: archetype {name} left out: {why}", file=sys.stderr)
        matrix = [c for c in matrix if c.archetype.name not in skipped]
    return C.select(matrix, args.archetypes, args.schedulers, args.faults, args.patterns, args.layouts)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.archetypes and (bad := set(args.archetypes) - set(C.ARCHETYPES)):
        return f"unknown archetype(s): {sorted(bad)}"
    for name in () if args.render else args.archetypes or ():  # rendering runs nothing
        if (why := C.unavailable_here(C.ARCHETYPES[name])) is not None:
            return f"archetype {name} cannot run here: {why}"
    if args.schedulers and (bad := set(args.schedulers) - {"sync", "async"}):
        return f"unknown scheduler(s): {sorted(bad)}"
    if args.faults and (bad := set(args.faults) - set(C.FAULT_PLANS)):
        return f"unknown fault plan(s): {sorted(bad)}"
    if args.patterns and (bad := set(args.patterns) - {p.value for p in C.PrefixPattern}):
        return f"unknown pattern(s): {sorted(bad)}"
    if args.layouts and (bad := set(args.layouts) - {x.value for x in C.Layout}):
        return f"unknown layout(s): {sorted(bad)}; known: {[x.value for x in C.Layout]}"
    unit = profile(args.device).page_unit
    if args.page_size is not None and (args.page_size <= 0 or args.page_size % unit):
        return f"--page-size must be a positive multiple of {unit} on {args.device}"
    if args.jobs < 1:
        return "--jobs must be at least 1"
    return None


def _plugin_status(candidate: str) -> str | None:
    """The plugin's status line for the report; None (after saying why) if it cannot run."""
    try:
        import kvcached.integration.vllm.plugin  # noqa: F401 - importable is all this checks
    except ImportError as e:
        if candidate == "kvcached":
            print(
                f"conformance: kvcached's vLLM plugin is not importable ({e}).\n"
                "Build/install kvcached, or run the harness self-test with --candidate native.",
                file=sys.stderr,
            )
            return None
        return f"plugin missing: {e}"
    return "plugin importable"


def _config(args: argparse.Namespace) -> RunConfig:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_id = args.run_id or f"{stamp}-{args.candidate}-{'sweep-' if args.sweep else ''}{'quick' if args.quick else 'full'}"
    device = profile(args.device)
    return RunConfig(
        run_dir=args.reports_dir / run_id,
        candidate=args.candidate,
        page_size=args.page_size,
        kv_cache_bytes=args.kv_cache_bytes or device.kv_cache_bytes,
        device=device.device.value,
        # Only the CPU platform turns async scheduling off (`conformance.engine.overrides`).
        async_override=not args.no_async_override and device.device is Device.CPU,
        budget_bytes=args.budget_bytes,
        case_timeout_s=args.case_timeout or device.case_timeout_s,
        isolate_knob_cases=args.isolate_knob_cases,
        jobs=args.jobs,
        model_runner=args.model_runner,
    )


#: The run directory's folder of saved comparisons: one JSON per engine group (`Collected.save`).
COMPARED = "compared"
#: The cases every run into the run directory selected, in order (several runs may share one
#: directory, each with its own selection): what ``--render`` reports unless told otherwise.
SELECTION = "selection.json"


def save_selection(run_dir: Path, cases: list[C.Case]) -> None:
    """Add ``cases`` to the run directory's selection (those already there keep their place)."""
    saved = saved_selection(run_dir) or []
    known = {c.case_id for c in saved}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SELECTION).write_text(json.dumps([c.to_json() for c in saved + [c for c in cases
                                                                             if c.case_id not in known]], indent=1))


def saved_selection(run_dir: Path) -> list[C.Case] | None:
    """The cases the runs into ``run_dir`` selected (None: runs from before it was saved)."""
    path = run_dir / SELECTION
    return [C.Case.from_json(x) for x in json.loads(path.read_text())] if path.is_file() else None


def _selects(args: argparse.Namespace) -> bool:
    """Whether the command line selects cases itself (else a render takes the run's own)."""
    return any((args.archetypes, args.schedulers, args.faults, args.patterns, args.layouts, args.no_controls,
                args.quick, args.sweep))


@dataclass
class Collected:
    """Everything the report needs, gathered while the archetypes run."""

    rows: list[ParityRow] = field(default_factory=list)
    per_case: list[tuple[ParityRow, list[RequestParity]]] = field(default_factory=list)
    memory: dict[str, list[tuple[str, list[int]]]] = field(default_factory=lambda: {"reference": [], "candidate": []})

    def merge(self, other: Collected) -> None:
        self.rows += other.rows
        self.per_case += other.per_case
        for side, series in other.memory.items():
            self.memory[side] += series

    def rejudged(self, rows: list[ParityRow]) -> None:
        """Take the rows a run-wide stage judged again (one per case id, as before)."""
        by_case = {r.case_id: r for r in rows}
        self.rows = rows
        self.per_case = [(by_case[row.case_id], reqs) for row, reqs in self.per_case]

    def save(self, path: Path) -> None:
        """One engine group's comparisons, as JSON (`load` reads them back)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"rows": [r.to_json() for r in self.rows],
               "requests": {row.case_id: [asdict(q) for q in reqs] for row, reqs in self.per_case},
               "memory": self.memory}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, allow_nan=False))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Collected:
        doc = json.loads(path.read_text())
        rows = [ParityRow.from_json(r) for r in doc["rows"]]
        return cls(rows=rows,
                   per_case=[(r, [RequestParity(**q) for q in doc["requests"][r.case_id]]) for r in rows],
                   memory={side: [(cid, steps) for cid, steps in series] for side, series in doc["memory"].items()})

    def add(self, case: C.Case, row: ParityRow, reqs: list[RequestParity], ref: CaseResult, oth: CaseResult) -> None:
        self.rows.append(row)
        self.per_case.append((row, reqs))
        if not case.is_control:
            for side, res in (("reference", ref), ("candidate", oth)):
                self.memory[side].append((case.case_id, [s.mapped_bytes for s in res.probe.steps] if res.probe else []))


def _compare_archetype(runner: Runner, cases: list[C.Case], out: Collected, progress: RunProgress) -> None:
    for c in cases:
        side, ref_case = ("control" if c.is_control else "candidate"), base_case(c)
        ref, oth = runner.load("reference", ref_case), runner.load(side, c)
        row, reqs = compare_results(
            c, ref, oth, runner.npz_path("reference", ref_case), runner.npz_path(side, c), runner.cfg.async_required
        )
        out.add(c, row, reqs, ref, oth)
        progress.log(
            f"    {'PASS' if row.passed else 'FAIL'} {c.case_id}: {row.verdict}; {row.exact_matches}/{row.requests} "
            f"exact, KV {row.kv_blocks_identical}/{row.kv_blocks_compared}, copies {row.cow_copies_other}, "
            f"fired {row.injected_failures_fired or '-'}, preempt {row.preemptions_other}"
        )
        for p in row.problems:
            progress.log(f"         problem: {p}")
        if row.native_defect_reference:
            progress.log(f"         a known native defect: {row.native_defect_reference}")


def _run_matrix(cfg: RunConfig, cases: list[C.Case], progress: RunProgress,
                run_engines: bool = True) -> tuple[Runner, Collected]:
    """Every archetype's engine processes (unless ``run_engines`` is off: the run directory's
    raw results are compared again), then its comparisons."""
    runner = Runner(cfg, progress.log, lambda side, cid, secs, ok: progress.advance(f"{side} {cid}", ok, secs))
    groups = engine_groups(cases)

    def run_group(i: int, label: str, group: list[C.Case]) -> Collected:
        progress.log(f"[{i}/{len(groups)}] {label}: {len(group)} case(s)")
        if run_engines:
            runner.run_archetype(label, group)
        part = Collected()
        _compare_archetype(runner, group, part, progress)
        part.save(cfg.run_dir / COMPARED / f"{label}.json")  # a run cut short still renders (--render)
        return part

    # Groups share nothing but the device: with --jobs N, N of them run at once; the
    # report's rows keep the matrix's group order whichever finishes first.
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        parts = list(pool.map(lambda item: run_group(item[0], *item[1]), enumerate(groups.items(), 1)))
    out = Collected()
    for part in parts:
        out.merge(part)
    return runner, out


def engine_groups(cases: list[C.Case]) -> dict[str, list[C.Case]]:
    """The cases each set of engine processes (reference, candidate, control) runs, by label.

    A process serves one layout (vLLM reads its environment once); an execution mode or
    attention backend of its own is a group of its own too, so groups can run side by side.
    """
    groups: dict[str, list[C.Case]] = {}
    for c in cases:
        label = "-".join([c.archetype.name, *([c.layout.value] if c.layout is not C.Layout.INPROC else []),
                          *(["graphs"] if c.compiled else []), *([c.attention.lower()] if c.attention else [])])
        groups.setdefault(label, []).append(c)
    return groups


def process_issues(children: Sequence[ChildOutcome]) -> list[str]:
    """Engine processes that timed out, exited non-zero, or printed a traceback."""
    issues = []
    for ch in children:
        if ch.timed_out:
            issues.append(f"{ch.label}: timed out ({ch.log_path})")
        elif ch.returncode != 0:
            issues.append(f"{ch.label}: exit status {ch.returncode} ({ch.log_path})")
        for tb in ch.tracebacks:
            first = tb.splitlines()[-1] if tb else ""
            issues.append(f"{ch.label}: traceback in log ({ch.log_path}): {first}")
    return issues


def _write(args: argparse.Namespace, cfg: RunConfig, cases: list[C.Case], out: Collected, issues: list[str],
           plugin_status: str, wall: float) -> Path:
    from conformance.orchestrate import report

    settings = {
        "candidate": args.candidate,
        "page_size": args.page_size or "derived per archetype (see geometry in raw results)",
        "kv_cache_bytes": args.kv_cache_bytes,
        "async_override": cfg.async_override,
        "model_runner": {"v1": "V1 (VLLM_USE_V2_MODEL_RUNNER=0)", "v2": "V2 (VLLM_USE_V2_MODEL_RUNNER=1)",
                         "vllm": "vLLM's choice (VLLM_USE_V2_MODEL_RUNNER unset)"}[cfg.model_runner],
        "engine_env": "PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1" + (" OMP_NUM_THREADS=1" if cfg.device == "cpu" else "") + "; layout inproc: "
                      "VLLM_ENABLE_V1_MULTIPROCESSING=0; mp and tp2: =1, VLLM_CPU_OMP_THREADS_BIND=nobind",
    }
    if args.recompare:
        settings["recompared"] = (f"the raw results of run {args.recompare} compared again; no engine ran, so the "
                                  "wall time is the comparison's")
    if args.render:
        settings["rendered"] = (f"the comparisons run {args.render} saved as its groups finished; nothing ran or "
                                "was compared again, so the wall time is the rendering's")
    env = report.environment(report.python_command(), settings, plugin_status)
    saved = cfg.run_dir / "environment.json"
    if (args.render or args.recompare) and saved.is_file():
        # The engines ran elsewhere (the GPU host): the report keeps the environment they ran
        # in, and says what rendered it here.
        env = {**json.loads(saved.read_text()), **{k: v for k, v in settings.items() if k in ("rendered", "recompared")},
               "rendered_by": f"{env['command']} ({env['date']}, git {env['git']}, {env['platform']})"}
    name = "KVCached" if args.candidate == "kvcached" else "Native candidate (harness self-test)"
    return report.write_report(
        cfg.run_dir, args.reports_dir / "latest", out.rows, out.per_case, env, name,
        {c.case_id: c for c in cases}, out.memory, issues, wall,
    )  # fmt: skip


def _rendered(run_dir: Path, cases: list[C.Case]) -> tuple[Collected, list[str]]:
    """A run's saved comparisons (`Collected.save`), in the matrix's group order, and the groups it
    did not finish, as process issues."""
    out, missing = Collected(), []
    for label in engine_groups(cases):
        path = run_dir / COMPARED / f"{label}.json"
        if path.is_file():
            out.merge(Collected.load(path))
        else:
            missing.append(f"{label}: not compared: the run ended before this group did")
    return out, missing


def _not_recomparable(run_dir: Path) -> str | None:
    """Why a run's raw results cannot be compared again (None: they can)."""
    raw = run_dir / "raw"
    if not raw.is_dir():
        return f"no raw results under {run_dir}"
    if not any(raw.rglob("*.npz")):
        return "the run kept no KV snapshots (.npz), so its KV bytes cannot be compared again; rerun it with --keep-kv"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "auto":
        args.device = detect().value
    if (err := _check_args(args)) is not None:
        print(f"conformance: {err}", file=sys.stderr)
        return 2
    if not (cases := select_cases(args)):
        print("conformance: no case selected", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(c.case_id for c in cases))
        return 0
    if (plugin_status := _plugin_status(args.candidate)) is None:
        return 2
    if args.recompare and args.render:
        print("conformance: --recompare and --render: one or the other", file=sys.stderr)
        return 2
    args.run_id = args.recompare or args.render or args.run_id
    cfg, t0 = _config(args), time.monotonic()
    if args.recompare and (why := _not_recomparable(cfg.run_dir)):
        print(f"conformance: --recompare {args.recompare}: {why}", file=sys.stderr)
        return 2
    if args.render:
        if not (cfg.run_dir / COMPARED).is_dir():
            print(f"conformance: --render {args.render}: no saved comparisons under {cfg.run_dir / COMPARED}",
                  file=sys.stderr)
            return 2
        if not _selects(args) and (ran := saved_selection(cfg.run_dir)) is not None:
            cases = ran  # the run's own selection: nothing to repeat, nothing reported missing that never ran
        out, issues = _rendered(cfg.run_dir, cases)
    else:
        save_selection(cfg.run_dir, cases)
        n_ctrl = sum(c.is_control for c in cases)
        with RunProgress(planned_runs(cases), "conformance") as progress:
            progress.log(f"[conformance] run {cfg.run_dir.name}: {len(cases) - n_ctrl} cases + {n_ctrl} controls, "
                         f"candidate={args.candidate}; results under {cfg.run_dir}")
            runner, out = _run_matrix(cfg, cases, progress, run_engines=not args.recompare)
        if not args.keep_kv:
            for npz in runner.raw.rglob("*.npz"):
                npz.unlink()
        issues = process_issues(runner.children)
    out.rejudged(judge_against_native_floor(out.rows, {c.case_id: c for c in cases}))
    wall = time.monotonic() - t0
    md = _write(args, cfg, cases, out, issues, plugin_status, wall)
    failed = [r for r in out.rows if not r.passed and not r.native_error]
    native = sum(r.native_error for r in out.rows)
    print(f"[conformance] {sum(r.passed for r in out.rows)}/{len(out.rows)} comparisons passed, "
          f"{len(failed)} failed, {native} native error(s), "
          f"{len(issues)} process issue(s), {wall:.0f} s; report: {md}", flush=True)
    return 0 if not failed and not issues else 1
