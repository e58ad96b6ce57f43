"""What every self-contained GPU probe report shares: its JSON (the environment block and the
probe's data) beside a report in the shared model (``conformance.reporting``: Markdown, HTML,
CSV) that opens with the environment, says the method, and ends with the table of its checks.

A committed probe report renders again from its JSON, running nothing::

    python -m serving_probes.probe_report reports/gpu/isolation/isolation.json

(``<name>.json`` names the probe: ``isolation``, ``sharing``, ``memory``, the device memory
probe of ``serving_probes.gpu_memory``, or ``map-rate``, ``serving_probes.map_rate_probe``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from conformance.reporting import Paragraph, Provenance, Report, Section, checks_table, write_report

#: A probe's JSON name -> the module whose ``render_saved(data, environment, out_dir)`` renders it.
PROBES = {"isolation": "serving_probes.isolation", "sharing": "serving_probes.sharing",
          "memory": "serving_probes.gpu_memory", "map-rate": "serving_probes.map_rate_probe"}


def write_probe_report(out_dir: Path, name: str, title: str, environment: Provenance, data: Mapping[str, object],
                       method: str, sections: Sequence[Section], checks: Mapping[str, bool], save: bool = True) -> Path:
    """``<out_dir>/<name>.json`` (``environment`` and ``data``; not with ``save=False``, which
    renders a saved one again) and ``<name>.md`` / ``.html`` / ``.csv``; returns the Markdown file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if save:
        (out_dir / f"{name}.json").write_text(json.dumps({"environment": environment.as_dict(), **data}, indent=1))
    held = sum(checks.values())
    report = Report(subject=title, verdict="PASS" if held == len(checks) else "FAIL",
                    headline=f"**{held} of {len(checks)}** checks hold.", environment=environment,
                    body=(Section("Method", (Paragraph(method),)), *sections,
                          Section("Checks", (checks_table(checks),))))
    return write_report(report, out_dir, name)


def load(path: Path) -> tuple[dict[str, object], Provenance]:
    """A probe's saved JSON: its data and its environment block."""
    data = json.loads(path.read_text())
    return data, Provenance.from_dict(data.pop("environment", {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving_probes.probe_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("saved", type=Path, nargs="+", help="<name>.json of a probe report")
    args = ap.parse_args(argv)
    for path in args.saved:
        if path.stem not in PROBES:
            ap.error(f"{path}: not one of {sorted(PROBES)}.json")
        data, environment = load(path)
        module = importlib.import_module(PROBES[path.stem])
        print(module.render_saved(data, environment, path.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
