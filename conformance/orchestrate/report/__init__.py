"""Conformance reports: the shared report model (``conformance.reporting``) with the run's
counts (``model.py``), built from parity rows (``build.py``), rendered to Markdown, HTML and
CSV from the same data by ``conformance.reporting``.

Layout of ``reports/conformance/<run-id>/`` (copied to ``reports/conformance/latest/``):

* ``report.md`` / ``report.html``: verdict, environment block, summary table, parity table
  (one row per case), problems, explanations, process issues, memory plot; the same sections.
* ``report.csv``: the same sections as an index (one row per block: section, title, kind,
  file, rows), each block's data in ``sections/NN-<slug>.csv``; section 0 is the overview.
* ``summary.md``: the spec's validation table shape
  (Case | Complete requests | Output tokens | Match to native token IDs | Injected allocation failures).
* ``cases.csv``: every ParityRow field; ``requests.csv``: one row per request per comparison.
* ``memory.png``: physical KV memory per scheduler step, reference vs candidate.
* ``environment.json``: the environment block as data (``conformance.reporting.environment``).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.notes import WARMUP_WARNING_EXPLANATION
from conformance.orchestrate.parity import ParityRow, RequestParity
from conformance.orchestrate.report.build import (
    SUMMARY,
    build_report,
    display_table,
    parity_frame,
    request_frame,
    summary_table,
)
from conformance.orchestrate.report.model import MatrixReport
from conformance.orchestrate.report.plot import memory_plot
from conformance.reporting import (
    Block,
    Bullets,
    Image,
    Paragraph,
    Preformatted,
    Report,
    Section,
    Table,
    csv_frames,
    markdown_block,
    provenance,
    render_html,
    render_markdown,
    version,
    write_csv,
)

__all__ = [
    "Block",
    "Bullets",
    "Image",
    "MatrixReport",
    "Paragraph",
    "Preformatted",
    "Report",
    "Section",
    "Table",
    "build_report",
    "csv_frames",
    "display_table",
    "environment",
    "memory_plot",
    "parity_frame",
    "python_command",
    "render_html",
    "render_markdown",
    "request_frame",
    "summary_table",
    "write_csv",
    "write_files",
    "write_report",
]

LATEST = ("report.md", "report.html", "report.csv", "sections", "summary.md", "cases.csv", "requests.csv",
          "memory.png", "environment.json")  # fmt: skip


def environment(command: Sequence[str], settings: Mapping[str, Any], plugin_status: str) -> dict[str, str]:
    """The run's environment block as data (``environment.json``, the Environment section):
    ``conformance.reporting.environment`` with the run's settings and the kvcached plugin's status."""
    extra = {"transformers": version("transformers"), "kvcached_plugin": plugin_status, **settings,
             "note": WARMUP_WARNING_EXPLANATION}
    return provenance(command, extra).as_dict()


def python_command() -> list[str]:
    """How this run was started, as the report shows it (``python -m conformance ...``)."""
    return [Path(sys.executable).name, "-m", "conformance", *sys.argv[1:]]


def write_files(report: MatrixReport, run_dir: Path, memory: dict[str, list[tuple[str, list[int]]]]) -> Path:
    """Every format of ``report`` into ``run_dir``; returns the path of ``report.md``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_csv(report, run_dir)
    (run_dir / "summary.md").write_text(markdown_block(report.section(SUMMARY).blocks[0]) + "\n")
    (run_dir / "environment.json").write_text(json.dumps(report.environment.as_dict(), indent=1) + "\n")
    name = report.candidate_name
    labels = {"reference": "native reference (whole KV tensor)", "candidate": f"{name} (mapped bytes)"}
    memory_plot(run_dir / "memory.png", memory, f"Physical KV memory: native reference vs {name}", labels)
    (run_dir / "report.md").write_text(render_markdown(report))
    (run_dir / "report.html").write_text(render_html(report))
    return run_dir / "report.md"


def copy_latest(run_dir: Path, latest_dir: Path) -> None:
    """Replace ``latest_dir`` with the report files of ``run_dir`` (not ``raw/``) and its ``RUN_ID``."""
    if latest_dir.exists():
        shutil.rmtree(latest_dir)
    latest_dir.mkdir(parents=True)
    for name in LATEST:
        src = run_dir / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, latest_dir / name)
    (latest_dir / "RUN_ID").write_text(run_dir.name + "\n")


def write_report(
    run_dir: Path,
    latest_dir: Path,
    rows: Sequence[ParityRow],
    per_case: Sequence[tuple[ParityRow, Sequence[RequestParity]]],
    env: dict[str, Any],
    candidate_name: str,
    cases_by_id: dict[str, Any],
    memory: dict[str, list[tuple[str, list[int]]]],
    process_issues: list[str],
    wall_s: float,
) -> Path:
    """Build the report, write every format into ``run_dir``, copy it to ``latest_dir``."""
    report = build_report(rows, per_case, env, candidate_name, cases_by_id, process_issues, wall_s)
    md = write_files(report, run_dir, memory)
    copy_latest(run_dir, latest_dir)
    return md
