"""compute-sanitizer memcheck over kvcached's CUDA paths, with controls that prove the check.

Each `SanitizerRun` is one program under ``compute-sanitizer --tool memcheck`` and an
expectation:

* ``clean``: zero errors, zero leaked bytes and exit status 0 (kvcached's runs, and torch
  alone once its caches are released);
* ``leak reported``: the planted-leak controls must be flagged, or a clean kvcached run
  would prove nothing;
* ``observe``: recorded, not judged (whether the tool tracks driver VMM handles at all).

Every child runs with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (torch frees device memory as
soon as a tensor dies) and releases torch's remaining caches before it exits
(`serving_probes.torch_caches`), so what a leak report names is memory still held.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: Expectations a run can carry.
CLEAN, LEAK_REPORTED, OBSERVE = "clean", "leak reported", "observe"

_PROBE = [sys.executable, "-m", "serving_probes", "--only", "copy", "--blocks", "120", "--no-report"]
_CHILD = [sys.executable, "-m", "serving_probes.sanitizer_children"]
_PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vmm_cuda.py")


@dataclass(frozen=True)
class SanitizerRun:
    name: str
    expect: str
    argv: tuple[str, ...]  # the program, after the sanitizer's own options
    options: tuple[str, ...] = ("--leak-check", "full")


RUNS: tuple[SanitizerRun, ...] = (
    # kvcached's CUDA backend: reserve, map, views, OOM rollback, unmap, release. The
    # stray-access test touches an unmapped slot on purpose (in a child process) to prove
    # the fault is loud; under memcheck that planted access is, correctly, an error.
    SanitizerRun("backend tests", CLEAN, (*_PYTEST, "-k", "not stray_access and not device_oom")),
    # The out-of-memory test makes the driver refuse on purpose, so API-error reporting is
    # off for it alone; the leak check and access checks stay on.
    SanitizerRun("backend out-of-memory test", CLEAN, (*_PYTEST, "-k", "device_oom"),
                 ("--leak-check", "full", "--report-api-errors", "no")),
    # The copy matrix with every driver API error reported: none may occur.
    SanitizerRun("copy matrix", CLEAN, (*_PROBE, "--no-pressure")),
    # The copy matrix with the device filled until the driver refuses kvcached's map.
    # Those refusals are the point of the phase, so API-error reporting is off here; the
    # run above is the one that shows no unexpected API error.
    SanitizerRun("copy matrix under device pressure", CLEAN, tuple(_PROBE),
                 ("--leak-check", "full", "--report-api-errors", "no")),
    SanitizerRun("control: torch alone, caches released", CLEAN, (*_CHILD, "torch-clean")),
    SanitizerRun("negative control: torch tensor held at exit", LEAK_REPORTED, (*_CHILD, "torch-leak")),
    SanitizerRun("observe: cuMemCreate handle never released", OBSERVE, (*_CHILD, "vmm-leak")),
)


@dataclass(frozen=True)
class SanitizerResult:
    name: str
    expect: str
    command: str
    exit_code: int
    errors: int  # -1 when the tool printed no summary
    leaked_bytes: int
    leaked_allocations: int
    apis_in_reports: str
    verdict: str  # "pass" | "FAIL" | "observed: ..."


def find_tool() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    return next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))), None)


@dataclass(frozen=True)
class Summary:
    errors: int  # -1 when the tool printed no ERROR SUMMARY (it did not finish)
    leaked_bytes: int
    leaked_allocations: int
    apis: str  # allocation APIs named in the reports' host frames, comma-separated


def summarize(text: str) -> Summary:
    """The figures of one compute-sanitizer memcheck output."""
    errors = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    leaks = re.search(r"LEAK SUMMARY: (\d+) bytes leaked in (\d+) allocations?", text)
    return Summary(errors=int(errors.group(1)) if errors else -1,
                   leaked_bytes=int(leaks.group(1)) if leaks else 0,
                   leaked_allocations=int(leaks.group(2)) if leaks else 0,
                   apis=",".join(sorted(set(re.findall(r"Host Frame: (cu\w+|cuda\w+) ", text)))))


def judge(expect: str, exit_code: int, errors: int, leaked: int) -> str:
    """``pass``/``FAIL`` against the expectation (``observed: ...`` for OBSERVE runs)."""
    if expect == CLEAN:
        return "pass" if (exit_code, errors, leaked) == (0, 0, 0) else "FAIL"
    if expect == LEAK_REPORTED:
        return "pass" if leaked > 0 and errors > 0 else "FAIL"
    if expect == OBSERVE:
        return f"observed: {'leak reported' if leaked > 0 else 'no leak reported'}"
    raise ValueError(f"unknown expectation {expect!r}; use {CLEAN!r}, {LEAK_REPORTED!r} or {OBSERVE!r}")


def _text(output: bytes | str | None) -> str:
    """What a timed-out child had written (bytes even with ``text=True``, as CPython hands it over)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_all(tool: str, runs: tuple[SanitizerRun, ...] = RUNS,
            timeout_s: int = 300) -> tuple[list[SanitizerResult], dict[str, str]]:
    """Run each program under memcheck; return one result per run and its full log."""
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    results, logs = [], {}
    for run in runs:
        argv = [tool, "--tool", "memcheck", *run.options, "--error-exitcode", "3", *run.argv]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout_s, env=env)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text = f"{_text(e.stdout)}{_text(e.stderr)}\n[timed out after {timeout_s} s]"
            code = 124
        summary = summarize(text)
        shown = " ".join("python" if a == sys.executable else a for a in argv[1:])
        results.append(SanitizerResult(
            name=run.name, expect=run.expect, command=f"compute-sanitizer {shown}", exit_code=code,
            errors=summary.errors, leaked_bytes=summary.leaked_bytes,
            leaked_allocations=summary.leaked_allocations, apis_in_reports=summary.apis,
            verdict=judge(run.expect, code, summary.errors, summary.leaked_bytes)))
        logs[run.name] = text
    return results, logs
