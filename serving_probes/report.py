"""Write the GPU probe results as pandas tables: Markdown + CSV under reports/gpu/."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pandas as pd

#: results key -> section title, in report order. Each is a list of row dicts.
TABLES = (
    ("copy", "VMM copy matrix"),
    ("cost", "Driver cost per 2 MiB page (µs per page: mean over the pages of a round, median over the rounds)"),
    ("floor_calls", "Raw driver floor per call (µs, C++ timing) beside the spec's reference figures"),
    ("sanitizer", "compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1, torch caches released at exit)"),
)
#: Kept whole in the log files, not in results.json.
LOG_TAIL_CHARS = 200_000


def _md(df: pd.DataFrame) -> str:
    try:
        return df.to_markdown(index=False)
    except ImportError:  # tabulate is optional on the GPU machine
        return "```\n" + df.to_string(index=False) + "\n```"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_report(results: dict[str, object], out: Path) -> Path:
    """Write ``<out>/<timestamp>/`` (report.md, *.csv, results.json, sanitizer logs) and refresh ``<out>/latest``."""
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    logs = results.pop("sanitizer_logs", None) or {}
    env = results["environment"]
    assert isinstance(env, dict)
    lines = ["# kvcached GPU probes", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    for key, title in TABLES:
        rows = results.get(key)
        if rows:
            df = pd.DataFrame(rows)
            df.to_csv(run_dir / f"{key}.csv", index=False)
            if key == "sanitizer":  # the command is long; it stays in the CSV
                df = df.drop(columns=["command"])
            lines += ["", f"## {title}", "", _md(df)]
    if logs:
        (run_dir / "sanitizer").mkdir()
        for name, text in logs.items():  # type: ignore[union-attr]
            (run_dir / "sanitizer" / f"{_slug(name)}.log").write_text(text[-LOG_TAIL_CHARS:])
        lines += ["", "Full sanitizer output: `sanitizer/*.log`; commands: `sanitizer.csv`."]
    for key in ("sanitizer_status", "serving", "teardown"):
        if key in results:
            lines += ["", f"## {key}", "", "```", json.dumps(results[key], indent=2, default=str), "```"]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    latest = out / "latest"
    if latest.exists():
        shutil.rmtree(latest)
    shutil.copytree(run_dir, latest)
    return run_dir / "report.md"
