"""Write the GPU probe results as pandas tables: Markdown + CSV under reports/gpu/."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pandas as pd


def _md(df: pd.DataFrame) -> str:
    try:
        return df.to_markdown(index=False)
    except ImportError:  # tabulate is optional on the GPU machine
        return "```\n" + df.to_string(index=False) + "\n```"


def write_report(results: dict[str, object], out: Path) -> Path:
    """Write ``<out>/<timestamp>/`` (report.md, *.csv, results.json) and refresh ``<out>/latest``."""
    run_dir = out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    assert isinstance(env, dict)
    lines = ["# kvcached GPU probes", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    for key, title in (("copy", "VMM copy matrix"), ("cost", "Driver cost per 2 MiB page (µs, mean over the timed pages)")):
        rows = results.get(key)
        if rows:
            df = pd.DataFrame(rows)
            df.to_csv(run_dir / f"{key}.csv", index=False)
            lines += ["", f"## {title}", "", _md(df)]
    if "ctypes_overhead_us_per_call" in results:
        lines += ["", (f"ctypes overhead per driver call in the floor: "
                      f"{results['ctypes_overhead_us_per_call']} µs (the floor includes ~5 such calls per page).")]
    for key in ("sanitizer", "serving", "teardown"):
        if key in results:
            value = results[key]
            if isinstance(value, dict):
                value = {k: ({kk: vv for kk, vv in v.items() if kk != "tail"} if isinstance(v, dict) else v)
                         for k, v in value.items()}
            lines += ["", f"## {key}", "", "```", json.dumps(value, indent=2, default=str), "```"]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    latest = out / "latest"
    if latest.exists():
        shutil.rmtree(latest)
    shutil.copytree(run_dir, latest)
    return run_dir / "report.md"
