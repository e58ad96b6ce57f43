"""``python -m conformance``: run native and kvcached vLLM side by side and report parity.

Exit status: 0 when every comparison passed (including the negative controls being caught)
and no engine process printed a traceback; 1 on any unexplained mismatch, error or process
issue; 2 on a usage or setup error (e.g. the kvcached plugin is missing).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from conformance import cases as C
from conformance.orchestrate.compare import ParityRow, RequestParity, compare_results
from conformance.orchestrate.runner import RunConfig, Runner, base_case

EPILOG = """
Sides and processes:
  reference  native vLLM (KVCACHED_ENABLE unset); derives every workload from its engine's geometry
  candidate  --candidate kvcached: the same engine code with KVCACHED_ENABLE=1, KVCACHED_PAGE_SIZE,
             and per case KVCACHED_FAULT_PLAN / KVCACHED_BUDGET_BYTES;
             --candidate native: native vLLM again (harness self-test; fault plans use a
             harness-emulated seam and the budget is a small kv_cache_memory_bytes)
  control    native vLLM: the native-vs-native noise baseline and the negative controls
Each side of each archetype is its own process; each case builds a fresh engine.

Fault plans (--faults): none, cow-admission-x2, map-mid-alloc, tiny-budget.
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
    p.add_argument("--quick", action="store_true", help="smoke matrix (a few minutes; what CI runs)")
    p.add_argument("--archetypes", type=_csv, help="comma-separated archetypes to keep")
    p.add_argument("--schedulers", type=_csv, help="comma-separated: sync, async")
    p.add_argument("--faults", type=_csv, help="comma-separated fault plans to keep (controls always run)")
    p.add_argument("--patterns", type=_csv, help="comma-separated prefix patterns: warm3, partial, shared")
    p.add_argument("--no-controls", action="store_true", help="skip the baseline and negative controls (not for CI)")
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
        "--kv-cache-bytes", type=int, default=64 << 20, help="kv_cache_memory_bytes for every engine (default 64 MiB)"
    )
    p.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="override KVCACHED_BUDGET_BYTES of the tiny-budget plan (default: derived from geometry)",
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
    p.add_argument(
        "--reports-dir",
        type=Path,
        default=Path("reports/conformance"),
        help="where run directories and latest/ go (default reports/conformance)",
    )
    p.add_argument("--run-id", default=None, help="name of the run directory (default: UTC time + candidate)")
    p.add_argument("--keep-kv", action="store_true", help="keep the raw KV snapshots (.npz) after comparing")
    p.add_argument("--case-timeout", type=float, default=150.0, help="seconds allowed per case in a child")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    return p


def select_cases(args: argparse.Namespace) -> list[C.Case]:
    matrix = C.quick_matrix() if args.quick else C.default_matrix()
    if args.no_controls:
        matrix = [c for c in matrix if not c.is_control]
    if not args.archetypes:  # the default matrix leaves out what cannot run here, and says so
        skipped = {a.name: why for a in C.ARCHETYPES.values() if (why := C.unavailable_here(a))}
        for name, why in skipped.items():
            print(f"conformance: archetype {name} left out: {why}", file=sys.stderr)
        matrix = [c for c in matrix if c.archetype.name not in skipped]
    return C.select(matrix, args.archetypes, args.schedulers, args.faults, args.patterns)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.archetypes and (bad := set(args.archetypes) - set(C.ARCHETYPES)):
        return f"unknown archetype(s): {sorted(bad)}"
    for name in args.archetypes or ():
        if (why := C.unavailable_here(C.ARCHETYPES[name])) is not None:
            return f"archetype {name} cannot run here: {why}"
    if args.schedulers and (bad := set(args.schedulers) - {"sync", "async"}):
        return f"unknown scheduler(s): {sorted(bad)}"
    if args.faults and (bad := set(args.faults) - set(C.FAULT_PLANS)):
        return f"unknown fault plan(s): {sorted(bad)}"
    if args.patterns and (bad := set(args.patterns) - {p.value for p in C.PrefixPattern}):
        return f"unknown pattern(s): {sorted(bad)}"
    if args.page_size is not None and (args.page_size <= 0 or args.page_size % 4096):
        return "--page-size must be a positive multiple of 4096"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (err := _check_args(args)) is not None:
        print(f"conformance: {err}", file=sys.stderr)
        return 2
    cases = select_cases(args)
    if not cases:
        print("conformance: no case selected", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(c.case_id)
        return 0

    from conformance.engine.kvcached_probe import plugin_importable

    plugin_ok, plugin_err = plugin_importable()
    plugin_status = "plugin importable" if plugin_ok else f"plugin missing: {plugin_err}"
    if args.candidate == "kvcached" and not plugin_ok:
        print(
            f"conformance: kvcached's vLLM plugin is not importable ({plugin_err}).\n"
            "Build/install kvcached, or run the harness self-test with --candidate native.",
            file=sys.stderr,
        )
        return 2

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_id = args.run_id or f"{stamp}-{args.candidate}-{'quick' if args.quick else 'full'}"
    run_dir = args.reports_dir / run_id
    cfg = RunConfig(
        run_dir=run_dir,
        candidate=args.candidate,
        page_size=args.page_size,
        kv_cache_bytes=args.kv_cache_bytes,
        async_override=not args.no_async_override,
        budget_bytes=args.budget_bytes,
        case_timeout_s=args.case_timeout,
        isolate_knob_cases=args.isolate_knob_cases,
    )

    def say(msg: str) -> None:
        print(msg, flush=True)

    archetypes = list(dict.fromkeys(c.archetype.name for c in cases))
    n_ctrl = sum(c.is_control for c in cases)
    say(
        f"[conformance] run {run_id}: {len(cases) - n_ctrl} cases + {n_ctrl} controls, candidate={args.candidate}, "
        f"archetypes={','.join(archetypes)}"
    )
    say(f"[conformance] results under {run_dir}")
    t0 = time.monotonic()
    runner = Runner(cfg, say)
    rows: list[ParityRow] = []
    per_case: list[tuple[ParityRow, list[RequestParity]]] = []
    memory: dict[str, list[tuple[str, list[int]]]] = {"reference": [], "candidate": []}
    for i, arch in enumerate(archetypes, 1):
        arch_cases = [c for c in cases if c.archetype.name == arch]
        say(f"[{i}/{len(archetypes)}] {arch}: {len(arch_cases)} case(s)  (elapsed {time.monotonic() - t0:.0f} s)")
        runner.run_archetype(arch, arch_cases)
        for c in arch_cases:
            ref_case = base_case(c)
            side = "control" if c.is_control else "candidate"
            ref = runner.load("reference", ref_case)
            oth = runner.load(side, c)
            ref_npz = runner.raw / "reference" / f"{ref_case.case_id}.npz"
            oth_npz = runner.raw / side / f"{c.case_id}.npz"
            row, reqs = compare_results(
                c,
                ref,
                oth,
                ref_npz if ref_npz.is_file() else None,
                oth_npz if oth_npz.is_file() else None,
                async_override=cfg.async_override,
            )
            rows.append(row)
            per_case.append((row, reqs))
            if not c.is_control:
                memory["reference"].append(
                    (c.case_id, [s["mapped_bytes"] for s in ref.get("probe", {}).get("steps", [])])
                )
                memory["candidate"].append(
                    (c.case_id, [s["mapped_bytes"] for s in oth.get("probe", {}).get("steps", [])])
                )
            mark = "PASS" if row.passed else "FAIL"
            say(
                f"    {mark} {c.case_id}: {row.verdict}; {row.exact_matches}/{row.requests} exact, "
                f"KV {row.kv_blocks_identical}/{row.kv_blocks_compared}, copies {row.cow_copies_other}, "
                f"fired {row.injected_failures_fired or '-'}, preempt {row.preemptions_other}"
            )
            for p in row.problems:
                say(f"         problem: {p}")
    if not args.keep_kv:
        for npz in (runner.raw).rglob("*.npz"):
            npz.unlink()

    process_issues = []
    for ch in runner.children:
        if ch.timed_out:
            process_issues.append(f"{ch.label}: timed out ({ch.log_path})")
        elif ch.returncode != 0:
            process_issues.append(f"{ch.label}: exit status {ch.returncode} ({ch.log_path})")
        for tb in ch.tracebacks:
            first = tb.splitlines()[-1] if tb else ""
            process_issues.append(f"{ch.label}: traceback in log ({ch.log_path}): {first}")

    from conformance.orchestrate import report

    settings = {
        "candidate": args.candidate,
        "page_size": args.page_size or "derived per archetype (see geometry in raw results)",
        "kv_cache_bytes": args.kv_cache_bytes,
        "async_override": cfg.async_override,
        "engine_env": "VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1",
    }
    env = report.environment(report.python_command(), settings, plugin_status)
    candidate_name = "KVCached" if args.candidate == "kvcached" else "Native candidate (harness self-test)"
    wall = time.monotonic() - t0
    md = report.write_report(
        run_dir,
        args.reports_dir / "latest",
        rows,
        per_case,
        env,
        candidate_name,
        {c.case_id: c for c in cases},
        memory,
        process_issues,
        wall,
    )
    failed = [r for r in rows if not r.passed]
    say(
        f"[conformance] {len(rows) - len(failed)}/{len(rows)} comparisons passed, "
        f"{len(process_issues)} process issue(s), {wall:.0f} s; report: {md}"
    )
    return 0 if not failed and not process_issues else 1

