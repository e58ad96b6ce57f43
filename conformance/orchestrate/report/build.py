"""From parity rows to the report model: the tables and the sections, in report order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

from conformance.orchestrate.parity import ParityRow, RequestParity
from conformance.orchestrate.report.model import SUBJECT, MatrixReport, headline
from conformance.reporting import Bullets, Image, Paragraph, Provenance, Section, Table

MiB = float(1 << 20)

SUMMARY = "Summary (validation-table shape)"
PARITY = "Parity table"
PROBLEMS = "Problems"
EXPLANATIONS = "Explanations"
PROCESS_ISSUES = "Process issues"
MEMORY = "Physical KV memory"
MEMORY_PNG = "memory.png"

MEMORY_NOTE = (
    "Native vLLM commits its whole KV tensor at start (a flat line at `kv_cache_config` bytes); "
    "kvcached samples `kvcached.stats()` mapped bytes after every scheduler step."
)
FILES_NOTE = (
    "Files: `cases.csv` (every field), `requests.csv` (per request), `summary.md`, `environment.json`, "
    "`raw/` (per-engine JSON results and logs)."
)


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def parity_frame(rows: Sequence[ParityRow]) -> pd.DataFrame:
    """Every ParityRow field, one row per comparison (``cases.csv``)."""
    return pd.DataFrame([r.to_record() for r in rows])


def request_frame(per_case: Sequence[tuple[ParityRow, Sequence[RequestParity]]]) -> pd.DataFrame:
    """One row per request per comparison (``requests.csv``)."""
    recs = []
    for row, reqs in per_case:
        for r in reqs:
            recs.append({"case_id": row.case_id, "comparison": row.comparison, **asdict(r)})
    return pd.DataFrame(recs)


def _display_record(r: ParityRow) -> dict[str, str]:
    unstable = f" ({r.native_unstable_requests} native-unstable)" if r.native_unstable_requests else ""
    return {
        "Case": r.case_id,
        "Comparison": r.comparison,
        "Scheduler ran (ref / other)": f"{r.scheduler_reference} / {r.scheduler_other}",
        "Layout ran (ref / other)": f"{r.layout_reference} / {r.layout_other}",
        "Complete (ref / other)": f"{r.complete_reference}/{r.requests} / {r.complete_other}/{r.requests}",
        "Output tokens (other)": f"{r.output_tokens_other}/{r.expected_output_tokens}",
        "Exact matches": f"{r.exact_matches}/{r.requests}" + unstable,
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


def display_table(rows: Sequence[ParityRow]) -> pd.DataFrame:
    """The human-readable parity table (one row per case)."""
    return pd.DataFrame([_display_record(r) for r in rows])


def _summary_record(case: str, complete: str, tokens: str, match: str, fired: str) -> dict[str, str]:
    return {
        "Case": case,
        "Complete requests": complete,
        "Output tokens": tokens,
        "Match to native token IDs": match,
        "Injected allocation failures": fired,
    }


def _native_records(rows: Sequence[ParityRow]) -> list[dict[str, str]]:
    """The native references, aggregated per archetype and scheduler."""
    native: dict[tuple[str, str], list[ParityRow]] = {}
    for r in rows:
        if r.control == "none":
            native.setdefault((r.archetype, r.scheduling), []).append(r)
    recs = []
    for (arch, sched), rs in native.items():
        c, n = sum(x.complete_reference for x in rs), sum(x.requests for x in rs)
        t, e = sum(x.output_tokens_reference for x in rs), sum(x.expected_output_tokens for x in rs)
        mode = "synchronous" if sched == "sync" else "asynchronous"
        recs.append(
            _summary_record(
                f"Native control, {arch}, {mode} ({len(rs)} cases)", f"{c}/{n}", f"{t}/{e}", "Reference", "None"
            )
        )
    return recs


def _who_and_match(r: ParityRow, candidate_name: str) -> tuple[str, str]:
    if r.native_error:
        return candidate_name, "Native error (nothing to compare)"
    if r.control == "native-baseline":
        return "Native vs native baseline", "Exact" if r.passed else f"Mismatch ({r.exact_matches}/{r.requests} exact)"
    if r.control == "native-equal-pool":
        return "Native at the candidate's pool", "Exact" if r.exact_matches == r.requests else r.verdict
    if r.control != "none":
        return f"Negative control ({r.control})", "Mismatch detected (expected)" if r.passed else "NOT DETECTED"
    if r.engine_error:  # a plan that fails inside execute_model (fault site copy)
        return candidate_name, f"Engine error as planned ({r.engine_error})" if r.passed else r.verdict
    if r.passed and r.exact_matches == r.requests:
        return candidate_name, "Exact"
    if r.passed and r.native_unstable_requests:
        excluded = r.requests - r.exact_matches
        return candidate_name, f"Exact ({excluded} native history-dependent request(s) excluded)"
    if r.exact_matches == r.requests:
        return candidate_name, f"Exact tokens; {r.verdict}"
    if r.passed:  # within native's floor, or near-tie flips: how it passed, not "mismatch"
        return candidate_name, f"{r.verdict[:1].upper()}{r.verdict[1:]} ({r.exact_matches}/{r.requests} exact)"
    return candidate_name, f"Mismatch ({r.exact_matches}/{r.requests} exact)"


def _comparison_record(r: ParityRow, candidate_name: str, case: Any) -> dict[str, str]:
    who, match = _who_and_match(r, candidate_name)
    fired = r.injected_failures_fired if (r.injected_failures_fired and r.fault_plan != "none") else "None"
    return _summary_record(
        f"{who}, {case.describe()}",
        f"{r.complete_other}/{r.requests}",
        f"{r.output_tokens_other}/{r.expected_output_tokens}",
        match + ("" if r.passed else " ✗"),
        fired,
    )


def summary_table(rows: Sequence[ParityRow], candidate_name: str, cases_by_id: Mapping[str, Any]) -> pd.DataFrame:
    """The spec's validation table: native references (aggregated per archetype and scheduler),
    then one row per candidate comparison and per control, then the total."""
    recs = _native_records(rows) + [_comparison_record(r, candidate_name, cases_by_id[r.case_id]) for r in rows]
    native = [r for r in rows if r.control == "none"]
    complete = sum(r.complete_reference for r in native) + sum(r.complete_other for r in rows)
    tokens = sum(r.output_tokens_reference for r in native) + sum(r.output_tokens_other for r in rows)
    requests = sum(r.requests for r in native) + sum(r.requests for r in rows)
    expected = sum(r.expected_output_tokens for r in native) + sum(r.expected_output_tokens for r in rows)
    total = "all pass" if all(r.passed for r in rows) else "FAILURES"
    recs.append(
        _summary_record("Total, including native controls", f"{complete}/{requests}", f"{tokens}/{expected}", total, "")
    )
    return pd.DataFrame(recs)


def problem_sections(rows: Sequence[ParityRow], process_issues: Sequence[str]) -> tuple[Section, ...]:
    """Problems (failing comparisons), explanations (passing with a note), process issues."""
    problems = tuple(f"`{r.case_id}` ({r.comparison}): {'; '.join(r.problems)}"
                     + (f" (a known native defect: {r.native_defect_reference})" if r.native_defect_reference else "")
                     for r in rows if not r.passed)
    explained = tuple(f"`{r.case_id}`: {'; '.join(r.explanations)}" for r in rows if r.explanations)
    return (
        Section(PROBLEMS, (Bullets(problems),)),
        Section(EXPLANATIONS, (Bullets(explained),)),
        Section(PROCESS_ISSUES, (Bullets(tuple(process_issues), "None: no traceback in any engine process log."),)),
    )


def memory_section() -> Section:
    """The memory plot (drawn by ``plot.memory_plot`` into ``memory.png``) and what it shows."""
    return Section(MEMORY, (Image(MEMORY_PNG, "physical KV memory"), Paragraph(MEMORY_NOTE), Paragraph(FILES_NOTE)))


def build_report(
    rows: Sequence[ParityRow],
    per_case: Sequence[tuple[ParityRow, Sequence[RequestParity]]],
    env: Mapping[str, Any],
    candidate_name: str,
    cases_by_id: Mapping[str, Any],
    process_issues: Sequence[str],
    wall_s: float,
) -> MatrixReport:
    """The whole report as data; every renderer reads only this."""
    body = (
        Section(SUMMARY, (Table(summary_table(rows, candidate_name, cases_by_id)),)),
        Section(PARITY, (Table(display_table(rows)),)),
        *problem_sections(rows, process_issues),
        memory_section(),
    )
    passed, native_errors = sum(r.passed for r in rows), sum(r.native_error for r in rows)
    failed = len(rows) - passed - native_errors
    counts = {"comparisons": len(rows), "passed": passed, "failed": failed, "native_errors": native_errors,
              "process_issues": len(process_issues)}
    return MatrixReport(
        subject=SUBJECT,
        verdict="PASS" if passed + native_errors == len(rows) and not process_issues else "FAIL",
        headline=headline(len(rows), passed, failed, native_errors, candidate_name, wall_s),
        environment=Provenance.from_dict(env),
        body=body,
        overview={**counts, "candidate": candidate_name, "wall_s": f"{wall_s:.1f}"},
        data={"cases.csv": parity_frame(rows), "requests.csv": request_frame(per_case)},
        **counts,
        wall_s=wall_s,
        candidate_name=candidate_name,
    )
