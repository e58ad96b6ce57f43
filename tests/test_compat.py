"""The compatibility report's stages on synthetic inputs (the real run is `nox -s compat`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from conformance import compat
from conformance.compat import CompatRow, SuiteRun, VersionResult

REFUSAL = ("candidate error: IntegrationError: vLLM 0.33.0 is not supported; kvcached supports vLLM 0.26 to 0.32")


def _cases(path: Path, rows: list[dict[str, object]]) -> Path:
    base = {"archetype": "llama", "scheduling": "sync", "layout": "inproc", "control": "none",
            "verdict": "exact", "passed": True, "problems": ""}
    pd.DataFrame([{**base, **r} for r in rows]).to_csv(path, index=False)
    return path


def test_each_comparison_gets_its_outcome_and_reason(tmp_path: Path) -> None:
    csv = _cases(tmp_path / "cases.csv", [
        {"case_id": "a"},
        {"case_id": "b", "verdict": "MISMATCH", "passed": False, "problems": "token mismatch in 2 request(s)"},
        {"case_id": "c", "verdict": "error", "passed": False, "problems": REFUSAL},
        {"case_id": "d", "verdict": "error", "passed": False, "problems": "candidate error: RuntimeError: boom"},
        {"case_id": "e", "verdict": "error", "passed": False,
         "problems": "reference error: IndexError: index 6 is out of bounds; other error: not run",
         "native_defect_reference": "native vLLM 0.32.0 fails here on its own, in conv_ssm_forward"},
        {"case_id": "e2", "verdict": "error", "passed": False,
         "problems": "reference error: IndexError: index 6 is out of bounds; other error: not run"},
        {"case_id": "f", "verdict": "error", "passed": False,
         "problems": "other error: RuntimeError: boom; reference error: IndexError: late"},
        {"case_id": "ctl", "control": "baseline"},
    ])
    rows, controls_ok = compat.rows_from_cases("0.30.0", csv)
    assert [(r.case_id, r.outcome) for r in rows] == [
        ("a", "exact"), ("b", "mismatch"), ("c", "unsupported"), ("d", "error"), ("e", "native-error"),
        ("e2", "error"), ("f", "error")], "only a reference error recorded as a known native defect is native-error"
    assert "conv_ssm_forward" in rows[4].reason and "IndexError" in rows[4].reason
    assert rows[0].reason == "" and "token mismatch" in rows[1].reason and "0.26 to 0.32" in rows[2].reason
    assert controls_ok
    csv = _cases(tmp_path / "bad.csv", [{"case_id": "a"}, {"case_id": "ctl", "control": "neg-kv", "passed": False,
                                                             "verdict": "NOT DETECTED"}])
    assert compat.rows_from_cases("0.30.0", csv)[1] is False, "a failed control must show"


def test_a_run_that_wrote_nothing_is_an_error_row_not_an_empty_table(tmp_path: Path) -> None:
    rows, controls_ok = compat.rows_from_cases("0.31.0", tmp_path / "missing.csv")
    assert [r.outcome for r in rows] == ["error"] and not controls_ok
    rows, _ = compat.rows_from_cases("0.31.0", _cases(tmp_path / "c.csv", [{"case_id": "ctl", "control": "baseline"}]))
    assert [r.outcome for r in rows] == ["error"] and "no kvcached comparison" in rows[0].reason


def test_junit_counts_and_first_lines(tmp_path: Path) -> None:
    xml = tmp_path / "t.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.vllm.test_a" name="test_ok"/>
      <testcase classname="tests.vllm.test_a" name="test_bad"><failure message="AttributeError: no attribute 'x'">tb</failure></testcase>
      <testcase classname="tests.vllm.test_b" name="test_err"><error message="">line one&#10;line two</error></testcase>
      <testcase classname="tests.vllm.test_b" name="test_skip"><skipped message="no gpu"/></testcase>
    </testsuite></testsuites>""")
    run = compat.parse_junit(xml, 1.5)
    assert (run.passed, run.failed, run.skipped) == (1, 2, 1) and not run.ok
    assert run.failures == ("tests.vllm.test_a::test_bad: AttributeError: no attribute 'x'",
                            "tests.vllm.test_b::test_err: line one")
    assert not compat.parse_junit(tmp_path / "absent.xml", 0.0).ok


def _version(version: str, outcomes: list[str], tests_failed: int = 0) -> VersionResult:
    rows = tuple(CompatRow(version, "llama", s, "inproc", f"llama-{s}-{i}", o, "" if o == "exact" else "why")  # type: ignore[arg-type]
                 for i, (s, o) in enumerate(zip(["sync", "async"] * 4, outcomes)))
    return VersionResult(version, "2026-12-01T00:00:00+00:00", f"nox -s compat -- {version}", "3.11.7", "2.13.0",
                         SuiteRun(10, tests_failed, 1, 5.0, ("t::x: boom",) * tests_failed), rows, True, "runs/x")


def test_the_report_round_trips_and_names_every_failure(tmp_path: Path) -> None:
    good, bad, refused = (_version("0.30.0", ["exact"] * 4), _version("0.31.0", ["exact", "mismatch", "exact", "exact"]),
                          _version("0.32.0", ["unsupported"] * 2))
    for v in (bad, good, refused):
        compat.write_version(v, tmp_path)
    loaded = compat.load_versions(tmp_path)
    assert loaded == [good, bad, refused]  # JSON round trip, in release order
    assert [compat.version_verdict(v) for v in loaded] == ["supported: exact", "broken", "refused at start-up"]
    assert compat.version_verdict(_version("0.30.0", ["exact"] * 4, tests_failed=1)) == "broken"
    # A case native vLLM fails alone is counted, not blamed; kvcached must be exact on the rest.
    assert compat.version_verdict(_version("0.32.0", ["exact", "native-error"])) == (
        "supported: exact (1 case(s) native vLLM fails alone)")
    assert compat.version_verdict(_version("0.32.0", ["native-error", "mismatch"])) == "broken"
    text = compat.render([_version("0.32.0", ["exact", "native-error"])], tmp_path).read_text()
    assert "- **0.32.0**: 0 failing comparison(s), 1 native vLLM fails alone\n" in text
    text = compat.render(loaded, tmp_path).read_text()
    assert "| 0.30.0 | supported: exact" in text and "mismatch (1/2)" in text and "unsupported (0/1)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 0.31.0") and "`llama-async-1`" in ln)
    assert [c.strip() for c in row.strip("|").split("|")] == ["0.31.0", "`llama-async-1`", "mismatch", "why"]
    assert "0.26 stays at contract level" in text
    assert (tmp_path / "README.html").is_file() and (tmp_path / "README.csv").is_file()


def test_releases_after_the_range_run_on_trial_and_the_row_says_so(tmp_path: Path) -> None:
    from kvcached.integration.vllm.capabilities import SUPPORTED, TRIAL

    newest = f"{SUPPORTED[1][0]}.{SUPPORTED[1][1]}.0"
    assert not compat.on_trial(newest) and not compat.on_trial("0.27.1")
    assert not compat.on_trial(f"{TRIAL[0]}.{TRIAL[1] + 1}.0")  # no drafted rows: refused as kvcached finds it
    if SUPPORTED[1] < TRIAL:
        assert compat.on_trial(f"{TRIAL[0]}.{TRIAL[1]}.0")
    row = dataclasses.replace(_version("0.31.0", ["exact"]), trial=True)
    old = {k: v for k, v in _version("0.30.0", ["exact"]).to_json().items() if k != "trial"}
    assert compat.VersionResult.from_json(old).trial is False  # rows written before the field
    compat.write_version(row, tmp_path)
    assert compat.load_versions(tmp_path) == [row]
    text = compat.render([compat.VersionResult.from_json(old), row], tmp_path).read_text()
    assert "| in range" in text and "| on trial" in text


def test_children_keep_the_trial_switch_and_lose_every_case_knob() -> None:
    from conformance.engine_env import without_kvcached

    env = {"KVCACHED_VLLM_TRIAL": "1", "KVCACHED_ENABLE": "1", "ENABLE_KVCACHED": "1",
           "KVCACHED_BUDGET_BYTES": "1", "KVCACHED_FAULT_PLAN": "/x", "PATH": "/bin"}
    assert without_kvcached(env) == {"KVCACHED_VLLM_TRIAL": "1", "PATH": "/bin"}


def _raise_in(function: str, error: Exception) -> BaseException:
    """``error`` raised (and caught) inside a function named ``function``."""
    namespace: dict[str, object] = {}
    exec(f"def {function}(e):\n    raise e\n", namespace)  # noqa: S102 - a fixed two-line function
    try:
        namespace[function](error)  # type: ignore[operator]
    except Exception as caught:  # noqa: BLE001 - returned to the test
        return caught
    raise AssertionError("not raised")


def test_a_native_defect_is_recognised_by_its_exception_and_innermost_frame(monkeypatch) -> None:
    from conformance import vllm_series

    monkeypatch.setattr(vllm_series, "installed_version", lambda: "0.32.0")
    def oob() -> IndexError:  # a fresh one each time: a raised exception keeps its traceback
        return IndexError("index 6 is out of bounds for dimension 0 with size 2")

    assert "0.32.0 fails here on its own" in (vllm_series.native_defect_of(_raise_in("conv_ssm_forward", oob())) or "")
    assert vllm_series.native_defect_of(_raise_in("forward", oob())) is None, "another frame: not the defect"
    assert vllm_series.native_defect_of(_raise_in("conv_ssm_forward", IndexError("list index out of range"))) is None
    monkeypatch.setattr(vllm_series, "installed_version", lambda: "0.31.0")
    assert vllm_series.native_defect_of(_raise_in("conv_ssm_forward", oob())) is None, "another release"
