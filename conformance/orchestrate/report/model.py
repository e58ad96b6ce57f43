"""The matrix's report: the shared report model (``conformance.reporting``) with the run's counts.

The counts are typed fields beside the model's sections; they also fill the headline and
section 0 of the CSV index (``overview``), so every format states them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

from conformance.reporting import Report

SUBJECT = "kvcached conformance report"


@dataclass(frozen=True, eq=False, kw_only=True)
class MatrixReport(Report):
    """One conformance run. ``data`` holds ``cases.csv`` (every ``ParityRow`` field) and
    ``requests.csv`` (one row per request): the full data behind the tables."""

    comparisons: int
    passed: int
    failed: int
    process_issues: int
    wall_s: float
    candidate_name: str
    #: Comparisons native vLLM could not run on its own (known native defects): neither passed nor failed.
    native_errors: int = 0

    @property
    def cases(self) -> pd.DataFrame:
        return self.data["cases.csv"]

    @property
    def requests(self) -> pd.DataFrame:
        return self.data["requests.csv"]


def headline(comparisons: int, passed: int, failed: int, native_errors: int, candidate_name: str,
             wall_s: float) -> str:
    return (
        f"{comparisons} comparisons ({passed} passed, {failed} failed"
        + (f", {native_errors} native errors" if native_errors else "") + "), "
        f"candidate: **{candidate_name}**, wall time {wall_s:.0f} s."
    )
