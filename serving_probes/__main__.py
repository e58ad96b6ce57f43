"""`python -m serving_probes`: run the GPU probes and write reports/gpu/.

    python -m serving_probes                      # copy, cost, sanitizer, serving
    python -m serving_probes --only copy,cost     # a subset
    python -m serving_probes --out reports/gpu    # where the report goes (default)

Exit status is non-zero if any probe check fails (a skipped probe is not a failure, and
says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROBES = ("copy", "cost", "sanitizer", "serving")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving_probes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PROBES),
                   help=f"comma-separated subset of {','.join(PROBES)} (default: all)")
    p.add_argument("--out", default="reports/gpu", help="report directory (default: reports/gpu)")
    p.add_argument("--blocks", type=int, default=600, help="blocks mapped per copy case (default 600)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cost-pages", type=int, default=256, help="pages timed per cost path (default 256)")
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
    import torch

    import kvcached

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.executable).name, "-m", "serving_probes", *sys.argv[1:]]),
        "kvcached": kvcached.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=False).stdout.strip()
            env["driver"] = out.splitlines()[0] if out else "unknown"
        env["cuda (torch)"] = str(torch.version.cuda)
    return env


def _sanitizer(args: argparse.Namespace) -> dict[str, object]:
    """Run compute-sanitizer memcheck over kvcached's CUDA paths; report each run."""
    tool = shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer") if p.exists()), None)
    if tool is None:
        return {"status": "not run", "detail": "compute-sanitizer not found on PATH or /usr/local/cuda*/bin"}
    # Without caching, torch returns device memory with cudaFree as soon as a tensor dies,
    # so a leak report names real lifetimes rather than torch's cache.
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    runs = {
        # kvcached's own CUDA backend: reserve, map, views, OOM rollback, unmap, release.
        "backend tests, memcheck + leak check": [
            "--tool", "memcheck", "--leak-check", "full",
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vmm_cuda.py",
            # This test touches an unmapped slot on purpose (in a child process) to prove the
            # fault is loud; under memcheck that planted access is, correctly, an error.
            "-k", "not stray_access"],
        # The copy matrix (no device filling: each deliberate OOM is reported as an API error).
        "copy matrix, memcheck": [
            "--tool", "memcheck",
            sys.executable, "-m", "serving_probes", "--only", "copy", "--blocks", "120", "--no-report",
            "--no-pressure"],
        # Control without kvcached: torch tensors created and dropped in a function. If the
        # leak check flags these too, its reports for the copy matrix are torch's, not ours.
        "torch-only control, memcheck + leak check": [
            "--tool", "memcheck", "--leak-check", "full", sys.executable, "-c",
            ("import torch\ndef f():\n    x = torch.randn(1 << 20, device='cuda')\n    return float(x.clone().sum())\n"
            "[f() for _ in range(3)]\ntorch.cuda.synchronize()")],
        "copy matrix, memcheck + leak check": [
            "--tool", "memcheck", "--leak-check", "full",
            sys.executable, "-m", "serving_probes", "--only", "copy", "--blocks", "120", "--no-report",
            "--no-pressure"],
    }
    out: dict[str, object] = {"status": "ran", "environment": "PYTORCH_NO_CUDA_MEMORY_CACHING=1"}
    for name, argv in runs.items():
        proc = subprocess.run([tool, "--error-exitcode", "3", *argv], capture_output=True, text=True,
                              check=False, timeout=240, env=env)
        text = proc.stdout + proc.stderr
        errors = re.search(r"ERROR SUMMARY: (\d+) error", text)
        leaks = re.search(r"LEAK SUMMARY: (\d+) bytes leaked in (\d+) allocations", text)
        apis = sorted(set(re.findall(r"Host Frame: (cu\w+|cuda\w+) ", text)))
        out[name] = {
            "command": "compute-sanitizer " + " ".join(a if a != sys.executable else "python" for a in argv),
            "exit_code": proc.returncode,
            "errors": int(errors.group(1)) if errors else -1,
            "leaked_bytes": int(leaks.group(1)) if leaks else 0,
            "allocation_apis_in_reports": apis,
            "tail": text[-1200:],
        }
    return out


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
        # Warm up torch's lazily loaded kernels (they hold device memory for the rest of the
        # process), so the teardown comparison below measures what kvcached gives back.
        from serving_probes.copy_matrix import CopyCase
        from serving_probes.copy_matrix import run_case as warm_case

        warm_case(CopyCase("NHD", "separate", 2), 8, args.device, pressure=False)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    free_start, total = torch.cuda.mem_get_info()
    failed = False
    results: dict[str, object] = {"environment": _environment()}

    if "copy" in args.only:
        from serving_probes.copy_matrix import all_cases, run_case

        rows = []
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

    if "cost" in args.only:
        from serving_probes.driver_cost import kvcached_rows, raw_floor

        page = _vmm.cuda_granularity(0)
        floor, overhead = raw_floor(0, page, args.cost_pages)
        rows = [floor, *kvcached_rows(args.device, page, args.cost_pages)]
        results["cost"] = [{"path": r.path, "map_us": round(r.map_us, 2), "unmap_us": round(r.unmap_us, 2),
                            "total_us": round(r.total_us, 2),
                            "ratio_vs_floor": round(r.total_us / floor.total_us, 3)} for r in rows]
        results["ctypes_overhead_us_per_call"] = round(overhead, 3)
        for row in results["cost"]:  # type: ignore[union-attr]
            print(f"cost {row}", flush=True)

    if "sanitizer" in args.only:
        san = _sanitizer(args)
        results["sanitizer"] = san
        for name, run in san.items():
            if isinstance(run, dict):
                failed |= run["errors"] != 0
                print(f"sanitizer {name}: { {k: v for k, v in run.items() if k != 'tail'} }", flush=True)

    if "serving" in args.only:
        from serving_probes.hybrid_serving import run as run_serving

        serving = run_serving()
        results["serving"] = dataclasses.asdict(serving)
        print(f"serving: {serving.status} {serving.reason}", flush=True)

    torch.cuda.synchronize()
    gc.collect()  # drop anything only a reference cycle still holds before measuring
    torch.cuda.empty_cache()
    free_end, _ = torch.cuda.mem_get_info()
    results["teardown"] = {"free_bytes_start": free_start, "free_bytes_end": free_end,
                           "torch_live_tensor_bytes": torch.cuda.memory_allocated(),
                           "total_bytes": total, "returned": free_end >= free_start}
    failed |= free_end < free_start
    print(f"teardown: free memory {free_start} -> {free_end} bytes; torch live tensor bytes "
          f"{torch.cuda.memory_allocated()}", flush=True)

    if not args.no_report:
        from serving_probes.report import write_report

        path = write_report(results, Path(args.out))
        print(f"report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
