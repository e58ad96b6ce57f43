"""`python -m serving_probes`: run the GPU probes and write reports/gpu/.

    python -m serving_probes                      # copy, cost, bandwidth, sanitizer, serving, sharing, isolation
    python -m serving_probes --only copy,cost     # a subset
    python -m serving_probes --out reports/gpu    # where the report goes (default)

Exit status is non-zero if any probe check fails (a skipped probe is not a failure, and
says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving_probes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PROBES),
                   help=f"comma-separated subset of {','.join(PROBES)} (default: all)")
    p.add_argument("--out", default="reports/gpu", help="report directory (default: reports/gpu)")
    p.add_argument("--blocks", type=int, default=600, help="blocks mapped per copy case (default 600)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cost-pages", type=int, default=256, help="pages timed per cost path (default 256)")
    p.add_argument("--cost-rounds", type=int, default=5,
                   help="alternating floor/kvcached rounds after a warm-up round (default 5)")
    p.add_argument("--bandwidth-gib", type=float, default=40.0,
                   help="bytes per side of the bandwidth probe, GiB (default 40); its own report goes to "
                        "<out>/bandwidth/")
    p.add_argument("--no-report", action="store_true", help="print results only (used under the sanitizer)")
    p.add_argument("--no-pressure", action="store_true",
                   help="skip the device-filling phase of the copy cases (used under the sanitizer, where "
                        "every deliberate out-of-memory return is reported as an API error)")
    args = p.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    bad = set(args.only) - set(PROBES)
    if bad:
        p.error(f"unknown probe(s) {sorted(bad)}; choose from {','.join(PROBES)}")
    return args


def _environment() -> dict[str, str]:
    """The report's environment block (`conformance.reporting.provenance`), with the CUDA
    runtime torch was built for and the sanitizer's version."""
    import torch

    from conformance.reporting import provenance
    from serving_probes.sanitizer import find_tool

    extra = {"cuda (torch)": str(torch.version.cuda)}
    tool = find_tool()
    if tool:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False).stdout
        extra["compute-sanitizer"] = next((ln.strip() for ln in out.splitlines() if ln.startswith("Version")),
                                          "unknown")
    return provenance([Path(sys.executable).name, "-m", "serving_probes", *sys.argv[1:]], extra).as_dict()


def _checked_probe(name: str, args: argparse.Namespace, results: dict[str, object]) -> bool:
    """Run the probe module ``serving_probes.<name>`` (its ``run`` and ``write_report``),
    record it in ``results`` and return whether every check held."""
    import importlib

    module = importlib.import_module(f"serving_probes.{name}")
    probe = module.run(args.device)
    ok = all(probe.checks.values())
    results[name] = dataclasses.asdict(probe)
    print(f"{name}: {'PASS' if ok else 'FAIL'} {probe.checks}", flush=True)
    if not args.no_report:
        from conformance.reporting import Provenance

        env = Provenance.from_dict(results.get("environment", {}))  # type: ignore[arg-type]
        print(f"{name} report: {module.write_report(probe, Path(args.out) / name, env)}", flush=True)
    return ok


#: A probe step: runs one probe, adds its rows to ``results`` and returns whether it failed.
Step = Callable[[argparse.Namespace, dict[str, object]], bool]


def _warm_torch(device: str) -> None:
    """Load torch's lazily loaded copy kernels before the start-of-run free memory is read:
    they hold device memory for the rest of the process, so the teardown comparison then
    measures only what kvcached gives back."""
    import torch

    from serving_probes.copy_matrix import CopyCase, run_case

    run_case(CopyCase("NHD", "separate", 2), 8, device, pressure=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _probe_copy(args: argparse.Namespace, results: dict[str, object]) -> bool:
    from serving_probes.copy_matrix import all_cases, run_case

    rows, failed = [], False
    for case in all_cases():
        r = run_case(case, args.blocks, args.device, pressure=not args.no_pressure)
        ok = (r.copy_exact and r.runs_copied == r.runs_expected
              and (args.no_pressure or r.rejected_by_driver)
              and r.rejection_left_state_unchanged and r.recovered_blocks == args.blocks
              and r.contents_verified)
        failed |= not ok
        rows.append({**dataclasses.asdict(r), "pass": ok})
        print(f"copy {r.case}: {'PASS' if ok else 'FAIL'} {dataclasses.asdict(r)}", flush=True)
    results["copy"] = rows
    return failed


def _probe_cost(args: argparse.Namespace, results: dict[str, object]) -> bool:
    """Timings only: the cost probe has no pass/fail of its own."""
    from kvcached import _vmm
    from serving_probes.driver_cost import measure

    cost = measure(args.device, _vmm.cuda_granularity(0), args.cost_pages, args.cost_rounds)
    floor = cost.rows[0]
    rows = [{"path": r.path, "map_us": round(r.map_us, 2), "unmap_us": round(r.unmap_us, 2),
             "total_us": round(r.total_us, 2), "ratio_vs_floor": round(r.total_us / floor.total_us, 3),
             "ratio_range_over_rounds": str(cost.ratio_range.get(r.path, "-"))}
            for r in cost.rows]
    results["cost"], results["floor_calls"] = rows, cost.floor_calls
    for row in [*rows, *cost.floor_calls]:
        print(f"cost {row}", flush=True)
    return False


def _probe_bandwidth(args: argparse.Namespace, results: dict[str, object]) -> bool:
    from serving_probes.bandwidth import run as run_bandwidth
    from serving_probes.bandwidth import write_outputs

    bandwidth = run_bandwidth(args.device, args.bandwidth_gib, argv=[f"--gib={args.bandwidth_gib}"])
    results["bandwidth"] = bw_rows = bandwidth.get("bandwidth_table", [])
    results["bandwidth_decode"] = decode_rows = bandwidth.get("decode_table", [])
    for bw_row in [*bw_rows, *bandwidth.get("bandwidth_checks", []), *decode_rows]:
        print(f"bandwidth {bw_row}", flush=True)
    print(f"bandwidth: {'PASS' if bandwidth['passed'] else 'FAIL'} errors={bandwidth['errors']}", flush=True)
    if not args.no_report:
        print(f"bandwidth report: {write_outputs(bandwidth, Path(args.out) / 'bandwidth')}", flush=True)
    return not bandwidth["passed"]


def _probe_sanitizer(args: argparse.Namespace, results: dict[str, object]) -> bool:
    """Not run (and not failed) without compute-sanitizer; the report says so."""
    from serving_probes.sanitizer import find_tool, run_all

    tool = find_tool()
    if tool is None:
        results["sanitizer_status"] = "not run: compute-sanitizer not found on PATH or /usr/local/cuda*/bin"
        print(f"sanitizer: {results['sanitizer_status']}", flush=True)
        return False
    san_rows, san_logs = run_all(tool)
    results["sanitizer"] = [dataclasses.asdict(r) for r in san_rows]
    results["sanitizer_logs"] = san_logs
    for san in san_rows:
        print(f"sanitizer {san.name}: {san.verdict} (exit {san.exit_code}, {san.errors} errors, "
              f"{san.leaked_bytes} B leaked in {san.leaked_allocations}; APIs: {san.apis_in_reports or '-'})",
              flush=True)
    return any(san.verdict == "FAIL" for san in san_rows)


def _probe_serving(args: argparse.Namespace, results: dict[str, object]) -> bool:
    """The hybrid serving probe reports a status (ran, skipped and why); no pass/fail here."""
    from serving_probes.hybrid_serving import run as run_serving

    serving = run_serving()
    results["serving"] = dataclasses.asdict(serving)
    print(f"serving: {serving.status} {serving.reason}", flush=True)
    return False


def _self_contained(name: str) -> Step:
    """A probe with its own checks and report (`_checked_probe`)."""
    return lambda args, results: not _checked_probe(name, args, results)


#: Every probe, in the order they run.
STEPS: dict[str, Step] = {"copy": _probe_copy, "cost": _probe_cost, "bandwidth": _probe_bandwidth,
                          "sanitizer": _probe_sanitizer, "serving": _probe_serving,
                          "sharing": _self_contained("sharing"), "isolation": _self_contained("isolation")}
PROBES = tuple(STEPS)


def _teardown(free_start: int, total: int, results: dict[str, object]) -> bool:
    """Whether kvcached gave back all it took: free device memory at the end, once torch's
    own caches are released (they would hide it, or be mistaken for it), is at least the
    start's. Returns True when it failed."""
    import torch

    from serving_probes.torch_caches import release_torch_caches

    release_torch_caches()
    free_end, _ = torch.cuda.mem_get_info()
    results["teardown"] = {"free_bytes_start": free_start, "free_bytes_end": free_end,
                           "torch_live_tensor_bytes": torch.cuda.memory_allocated(),
                           "total_bytes": total, "returned": free_end >= free_start}
    print(f"teardown: free memory {free_start} -> {free_end} bytes; torch live tensor bytes "
          f"{torch.cuda.memory_allocated()}", flush=True)
    return free_end < free_start


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    from kvcached import _vmm

    if not _vmm.cuda_available() or not torch.cuda.is_available():
        print("serving_probes: no CUDA device (kvcached._vmm.cuda_available() is False); nothing to probe")
        return 2
    torch.cuda.init()
    torch.empty(1, device=args.device)  # make the primary context current for the floor probe
    if "copy" in args.only:
        _warm_torch(args.device)
    free_start, total = torch.cuda.mem_get_info()
    # The environment table is for the report; a --no-report child (the sanitizer's) skips
    # it, so nothing it runs (nvidia-smi, compute-sanitizer --version) runs under memcheck.
    results: dict[str, object] = {} if args.no_report else {"environment": _environment()}
    failed = False
    for name, step in STEPS.items():
        if name in args.only:
            failed |= step(args, results)
    failed |= _teardown(free_start, total, results)
    if not args.no_report:
        from serving_probes.report import write_report

        print(f"report: {write_report(results, Path(args.out))}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
