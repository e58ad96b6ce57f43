"""Write the GPU probe results under reports/gpu/ through the shared report model
(``conformance.reporting``): ``report.md``, ``report.html`` and ``report.csv`` (with
``sections/``), each probe's table as ``<probe>.csv``, ``results.json`` and the sanitizer logs.

A saved run renders again from its ``results.json``, running nothing::

    python -m serving_probes.report reports/gpu/latest
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

from conformance.reporting import Paragraph, Preformatted, Provenance, Report, Section, Table
from conformance.reporting import write_report as write_report_files

#: results key -> section title, in report order. Each is a list of row dicts.
TABLES = (
    ("copy", "VMM copy matrix"),
    ("cost", "Driver cost per 2 MiB page (µs per page: mean over the pages of a round, median over the rounds)"),
    ("floor_calls", "Raw driver floor per call (µs, C++ timing) beside the spec's reference figures"),
    ("sanitizer", "compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1, torch caches released at exit)"),
)
#: results key -> section title: what a probe records as a whole, shown as its JSON.
RECORDS = (("sanitizer_status", "sanitizer_status"), ("serving", "serving"), ("teardown", "teardown"))
#: Kept whole in the log files, not in results.json.
LOG_TAIL_CHARS = 200_000


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _table_section(key: str, title: str, rows: list[dict[str, Any]]) -> Section:
    frame = pd.DataFrame(rows)
    if key == "sanitizer":  # the command is long; it stays in the CSV
        shown = Table(frame.drop(columns=["command"], errors="ignore"))
        note = Paragraph("Full sanitizer output: `sanitizer/*.log`; commands: `sanitizer.csv`.")
        return Section(title, (shown, note))
    return Section(title, (Table(frame),))


def build(results: dict[str, Any]) -> Report:
    """The probes' report as data: one section per probe that ran (``TABLES``, ``RECORDS``)."""
    body = [_table_section(key, title, results[key]) for key, title in TABLES if results.get(key)]
    body += [Section(title, (Preformatted(json.dumps(results[key], indent=2, default=str)),))
             for key, title in RECORDS if key in results]
    ran = [title.split(" (")[0] for key, title in TABLES if results.get(key)] + [k for k, _ in RECORDS if k in results]
    data = {f"{key}.csv": pd.DataFrame(results[key]) for key, _ in TABLES if results.get(key)}
    return Report(subject="kvcached GPU probes", headline=f"Probes: {', '.join(ran) or 'none'}.",
                  environment=Provenance.from_dict(results.get("environment", {})), body=tuple(body), data=data)


def write_report(results: dict[str, object], out: Path) -> Path:
    """Write ``<out>/<timestamp>/`` (the report, *.csv, results.json, sanitizer logs) and refresh ``<out>/latest``."""
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    logs = results.pop("sanitizer_logs", None) or {}
    assert isinstance(logs, dict)
    if logs:
        (run_dir / "sanitizer").mkdir()
        for name, text in logs.items():
            (run_dir / "sanitizer" / f"{_slug(name)}.log").write_text(str(text)[-LOG_TAIL_CHARS:])
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    md = render(run_dir)
    latest = out / "latest"
    if latest.exists():
        shutil.rmtree(latest)
    shutil.copytree(run_dir, latest)
    return md


def render(run_dir: Path) -> Path:
    """The report of ``run_dir`` from its ``results.json``; returns ``report.md``."""
    return write_report_files(build(json.loads((run_dir / "results.json").read_text())), run_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving_probes.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, nargs="+", help="a folder holding a results.json")
    for run_dir in ap.parse_args(argv).run_dir:
        print(render(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
