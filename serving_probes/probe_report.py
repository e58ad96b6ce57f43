"""What every self-contained GPU probe report shares: its JSON beside a markdown page that
opens with the command, date and machine, and ends with the table of its checks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path


def write_probe_report(out_dir: Path, name: str, title: str, environment: Mapping[str, str], data: Mapping[str, object],
                       method: str, body: Sequence[str], checks: Mapping[str, bool]) -> Path:
    """``<out_dir>/<name>.json`` (``environment`` and ``data``) and ``<name>.md``; returns the latter."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"environment": dict(environment), **data}, indent=1))
    command = environment.get("command", f"python -m serving_probes --only {name}")
    lines = [
        f"# {title}", "",
        (f"`{command}` on {environment.get('date')}; {environment.get('device', '')}, driver "
         f"{environment.get('driver', '?')}, torch {environment.get('torch')}."),
        "", f"Method: {method}", "",
        *body, "",
        "| check | holds |", "|---|---|",
        *[f"| {k} | {'yes' if v else '**no**'} |" for k, v in checks.items()], "",
    ]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines))
    return path
