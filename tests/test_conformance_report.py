"""The conformance report: one model, the same sections and rows in Markdown, HTML and CSV.

``format_problems`` reads each format back (Markdown by its headings and blank-line blocks,
HTML by its ``<section>``/``<div class="block KIND">`` structure, CSV through the ``report.csv``
index) and compares it with the model; the negative controls feed it broken renderings.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conformance import cases as C
from conformance.orchestrate import report as R
from conformance.orchestrate.parity import ParityRow, RequestParity

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "<script>alert('x')</script> & co"

# ---- synthetic runs -----------------------------------------------------------------------

LLAMA = C.ARCHETYPES["llama"]
PASSING = C.Case(LLAMA, max_tokens=4)
FAILING = C.Case(LLAMA, C.Scheduling.ASYNC, max_tokens=4)
EXPLAINED = C.Case(LLAMA, fault=C.MAP_MID_ALLOCATION, max_tokens=4)
NEG_KV = C.Case(LLAMA, control=C.Control.NEG_KV, max_tokens=4)


def _row(case: C.Case, **changes: Any) -> ParityRow:
    n = 3
    row = ParityRow(
        case_id=case.case_id,
        comparison="kvcached vs native" if not case.is_control else f"negative control: {case.control.value}",
        archetype=case.archetype.name,
        scheduling=case.scheduling.value,
        pattern=case.pattern.value,
        lengths=case.lengths.value,
        prefix_caching=case.prefix_caching,
        fault_plan=case.fault.name,
        control=case.control.value,
        fault_seam="kvcached",
        scheduler_reference="Scheduler",
        scheduler_other="Scheduler",
        async_scheduling_reference=False,
        async_scheduling_other=False,
        layout=case.layout.value,
        layout_reference="UniProcExecutor x1",
        layout_other="UniProcExecutor x1",
        requests=n,
        complete_reference=n,
        complete_other=n,
        output_tokens_reference=4 * n,
        output_tokens_other=4 * n,
        expected_output_tokens=4 * n,
        exact_matches=n,
        first_divergence="",
        kv_blocks_compared=5,
        kv_blocks_identical=5,
        kv_only_reference=0,
        kv_only_other=0,
        kv_max_abs_diff=0.0,
        kv_key_variants=0,
        native_unstable_requests=0,
        logprobs_equal=True,
        logprob_max_abs_diff=0.0,
        prefix_hit_tokens_reference=16,
        prefix_hit_tokens_other=16,
        partial_prefix_hits_other=0,
        cow_copies_reference=0,
        cow_copies_other=0,
        injected_failures_fired="",
        injected_failures_expected=0,
        preemptions_reference=0,
        preemptions_other=0,
        peak_mapped_bytes_reference=64 << 20,
        peak_mapped_bytes_other=3 << 19,
        final_mapped_bytes_reference=64 << 20,
        final_mapped_bytes_other=1 << 20,
        same_schedule=True,
        schedule_divergence_step=None,
        verdict="exact",
        passed=True,
    )
    return dataclasses.replace(row, **changes)


def _requests(row: ParityRow) -> list[RequestParity]:
    return [
        RequestParity(
            rid=f"p1-{i:02d}",
            label="x",
            pass_no=1,
            prompt_len=5 + i,
            ref_tokens=4,
            other_tokens=4,
            exact=i < row.exact_matches,
            first_divergence=None if i < row.exact_matches else 2,
            ref_cached=0,
            other_cached=0,
            ref_complete=True,
            other_complete=True,
            logprobs_equal=row.logprobs_equal,
            logprob_max_abs_diff=row.logprob_max_abs_diff,
        )
        for i in range(row.requests)
    ]


def _run() -> tuple[list[ParityRow], list[tuple[ParityRow, list[RequestParity]]], list[str], dict[str, Any]]:
    rows = [
        _row(PASSING),
        _row(
            FAILING,
            exact_matches=1,
            first_divergence="p1-01@2 (2 req)",
            logprobs_equal=False,
            logprob_max_abs_diff=0.25,
            verdict="token mismatch <p1-01>",
            passed=False,
            problems=["2 requests' tokens differ", "KV differs in block <7> & more"],
        ),
        _row(
            EXPLAINED,
            same_schedule=False,
            schedule_divergence_step=0,
            injected_failures_fired="1",
            injected_failures_expected=1,
            explanations=["schedule diverged at step 0, yet KV and logprobs are bit-identical"],
        ),
        _row(
            NEG_KV,
            exact_matches=2,
            first_divergence="p2-00@0 (1 req)",
            verdict="mismatch detected (expected)",
            explanations=["negative control caught: 1 request's tokens differ"],
        ),
    ]
    per_case = [(r, _requests(r)) for r in rows]
    issues = [f"candidate/llama: traceback in log (/tmp/candidate.log): ValueError: {SCRIPT}"]
    env = {
        "date": "2026-01-01T00:00:00+00:00",
        "command": "python -m conformance --quick",
        "vllm": "0.28.0",
        "page_size": "derived <per archetype>",
        "note": "a note with 'quotes' & <angle brackets>",
    }
    return rows, per_case, issues, env


def _report(**changes: Any) -> R.Report:
    rows, per_case, issues, env = _run()
    cases = {c.case_id: c for c in (PASSING, FAILING, EXPLAINED, NEG_KV)}
    report = R.build_report(rows, per_case, env, "KVCached", cases, issues, 12.3)
    return dataclasses.replace(report, **changes) if changes else report


# ---- reading each format back -------------------------------------------------------------


def plain(text: str) -> str:
    """Text without its inline marks (what HTML shows of ```code``` and ``**bold**``)."""
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", re.sub(r"`([^`]+)`", r"\1", str(text))).strip()


def expected(block: R.Block) -> Any:
    """A block's content, normalized as every reader below returns it."""
    if isinstance(block, R.Table):
        frame = block.frame.astype(str)
        return [[str(c) for c in frame.columns], *frame.values.tolist()] if not frame.empty else []
    if isinstance(block, R.Bullets):
        return [plain(i) for i in block.items]
    if isinstance(block, R.Preformatted):
        return block.text.strip()
    if isinstance(block, R.Image):
        return [block.src, block.alt]
    return plain(block.text)


def _md_block(chunk: str, block: R.Block) -> Any:
    if isinstance(block, R.Table):
        if chunk == f"_{block.empty}_":
            return []
        lines = [ln for ln in chunk.splitlines() if not re.match(r"^\|[:\-| ]+\|$", ln)]
        return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    if isinstance(block, R.Bullets):
        return [] if chunk == block.empty else [plain(ln[2:]) for ln in chunk.splitlines() if ln.startswith("- ")]
    if isinstance(block, R.Preformatted):
        return chunk.removeprefix("```").removesuffix("```").strip()
    if isinstance(block, R.Image):
        m = re.fullmatch(r"!\[(.*)\]\((.*)\)", chunk)
        return [m.group(2), m.group(1)] if m else chunk
    return plain(chunk)


def read_markdown(md: str, report: R.Report) -> dict[str, list[Any]]:
    """Section title -> its blocks' contents, read with the model's block kinds."""
    kinds = {s.title: s.blocks for s in report.sections}
    out: dict[str, list[Any]] = {}
    for part in re.split(r"^## ", md, flags=re.MULTILINE)[1:]:
        title, _, body = part.partition("\n")
        chunks = [c.strip("\n") for c in body.strip("\n").split("\n\n")]
        blocks = kinds.get(title, ())
        out[title] = [_md_block(c, b) for c, b in zip(chunks, blocks)] + chunks[len(blocks) :]
    return out


class _HtmlReader(HTMLParser):
    """Sections (``<h2>``) -> blocks (``<div class="block KIND">``) -> rows / items / text."""

    def __init__(self) -> None:
        super().__init__()
        self.h1 = ""
        self.sections: dict[str, list[tuple[str, Any]]] = {}
        self.title: str | None = None
        self.block: tuple[str, Any] | None = None
        self.text: list[str] | None = None
        self.tag = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and (a.get("class") or "").startswith("block "):
            self.block = ((a["class"] or "").split()[1], [])
            self.sections[self.title or ""].append(self.block)
        elif tag == "tr" and self.block:
            self.block[1].append([])
        elif tag == "img" and self.block:
            self.block[1].extend([a.get("src"), a.get("alt")])
        elif tag in ("h1", "h2", "td", "th", "li", "pre", "p"):
            self.text, self.tag = [], tag

    def handle_data(self, data: str) -> None:
        if self.text is not None:
            self.text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag != self.tag or self.text is None:
            return
        text, self.text = "".join(self.text), None
        if tag == "h1":
            self.h1 = text
        elif tag == "h2":
            self.title = text
            self.sections[text] = []
        elif self.block and tag in ("td", "th"):
            self.block[1][-1].append(text.strip())
        elif self.block and tag in ("li", "pre", "p"):
            self.block[1].append(text)


def _html_block(kind: str, parts: list[Any], block: R.Block) -> Any:
    if kind != block.kind:
        return f"<{kind} block>"
    if isinstance(block, R.Bullets) and parts == [block.empty]:
        return []
    if isinstance(block, R.Table) and parts == [block.empty]:
        return []
    if isinstance(block, R.Bullets):
        return [plain(p) for p in parts]
    if isinstance(block, R.Preformatted):
        return "".join(parts).strip()
    if isinstance(block, R.Paragraph):
        return plain("".join(parts))
    return parts


def read_html(page: str, report: R.Report) -> tuple[str, dict[str, list[Any]]]:
    reader = _HtmlReader()
    reader.feed(page)
    kinds = {s.title: s.blocks for s in report.sections}
    out = {}
    for title, blocks in reader.sections.items():
        model = kinds.get(title, ())
        out[title] = [_html_block(k, p, b) for (k, p), b in zip(blocks, model)] + blocks[len(model) :]
    return reader.h1, out


def _csv_block(frame: pd.DataFrame, block: R.Block) -> Any:
    if isinstance(block, R.Table):
        return [list(frame.columns), *frame.values.tolist()] if len(frame) else []
    if isinstance(block, R.Bullets):
        return [plain(i) for i in frame["item"]]
    if isinstance(block, R.Preformatted):
        return "\n".join(frame["line"]).strip()
    if isinstance(block, R.Image):
        return [frame["src"][0], frame["alt"][0]]
    return plain(frame["text"][0])


def read_csv(directory: Path, report: R.Report) -> tuple[pd.DataFrame, dict[str, list[Any]]]:
    """The index ``report.csv`` and, per section title, its blocks read from their CSV files."""
    index = pd.read_csv(directory / "report.csv", dtype=str, keep_default_na=False)
    kinds = {s.title: s.blocks for s in report.sections}
    out: dict[str, list[Any]] = {}
    for entry in index[index["section"] != "0"].itertuples():
        frame = pd.read_csv(directory / entry.file, dtype=str, keep_default_na=False)
        blocks = out.setdefault(entry.title, [])
        model = kinds.get(entry.title, ())
        ok = len(blocks) < len(model) and model[len(blocks)].kind == entry.kind
        blocks.append(_csv_block(frame, model[len(blocks)]) if ok else f"<{entry.kind} block>")
    return index, out


HTML_TAGS = {"html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "p", "nav", "ul", "li", "a",
             "section", "div", "table", "thead", "tbody", "tr", "th", "td", "pre", "code", "strong", "em", "figure",
             "img"}  # fmt: skip


def html_escape_problems(page: str) -> list[str]:
    """Text that reached the page unescaped: a tag the template never writes, a stray ``<`` or ``&``."""
    problems = [f"HTML: unexpected <{t}>" for t in sorted(set(re.findall(r"</?([a-zA-Z][\w-]*)", page)) - HTML_TAGS)]
    stray = re.findall(r"<(?![a-zA-Z/!])|&(?!#?\w+;)", page)
    return problems + ([f"HTML: {len(stray)} unescaped < or &"] if stray else [])


def format_problems(report: R.Report, md: str, page: str, csv_dir: Path) -> list[str]:
    """Every way the three renderings disagree with the model (empty: they all say the same)."""
    want = {s.title: [expected(b) for b in s.blocks] for s in report.sections}
    h1, html_sections = read_html(page, report)
    index, csv_sections = read_csv(csv_dir, report)
    problems = html_escape_problems(page)
    if not md.startswith(f"# {report.title}\n\n{report.headline}\n"):
        problems.append("Markdown: title or headline")
    if h1 != report.title:
        problems.append(f"HTML: title {h1!r}")
    overview = index[index["section"] == "0"]
    if list(overview["title"]) != [report.title]:
        problems.append("CSV: overview entry")
    for fmt, got in (("Markdown", read_markdown(md, report)), ("HTML", html_sections), ("CSV", csv_sections)):
        if list(got) != list(want):
            problems.append(f"{fmt}: sections {list(got)} != {list(want)}")
        for title, blocks in want.items():
            if title in got and got[title] != blocks:
                problems.append(f"{fmt}: section {title!r} differs: {got[title]!r} != {blocks!r}")
    return problems


def _render_all(report: R.Report, directory: Path) -> tuple[str, str]:
    R.write_csv(report, directory)
    return R.render_markdown(report), R.render_html(report)


# ---- tests ----------------------------------------------------------------------------------


def test_model_has_every_section_and_counts() -> None:
    report = _report()
    titles = [s.title for s in report.sections]
    assert titles == [
        "Environment",
        "Summary (validation-table shape)",
        "Parity table",
        "Problems",
        "Explanations",
        "Process issues",
        "Physical KV memory",
    ]
    assert (report.verdict, report.comparisons, report.passed, report.failed, report.process_issues) == (
        "FAIL",
        4,
        3,
        1,
        1,
    )
    assert len(report.section("Problems").blocks[0].items) == 1
    assert len(report.section("Explanations").blocks[0].items) == 2
    assert len(report.cases) == 4 and len(report.requests) == 12
    # native aggregate (1 sync + 1 async), one row per comparison, total
    assert len(report.section("Summary (validation-table shape)").blocks[0].frame) == 2 + 4 + 1


def test_every_section_in_every_format(tmp_path: Path) -> None:
    report = _report()
    md, page = _render_all(report, tmp_path)
    assert format_problems(report, md, page, tmp_path) == []
    index = pd.read_csv(tmp_path / "report.csv", dtype=str, keep_default_na=False)
    for s in report.sections:
        assert f"\n## {s.title}\n" in md
        assert f"<h2>{s.title}</h2>" in page
        assert list(index.loc[index["title"] == s.title, "kind"]) == list(s.kinds)


def test_tables_carry_the_same_rows(tmp_path: Path) -> None:
    report = _report()
    md, page = _render_all(report, tmp_path)
    html_sections = read_html(page, report)[1]
    md_sections = read_markdown(md, report)
    csv_sections = read_csv(tmp_path, report)[1]
    for title in ("Summary (validation-table shape)", "Parity table"):
        rows = expected(report.section(title).blocks[0])
        assert md_sections[title][0] == html_sections[title][0] == csv_sections[title][0] == rows
        assert any("✗" in cell for row in rows for cell in row)  # the failing row is there
    assert page.count('<tr class="bad">') == 2  # the failing row, in the summary and the parity table


def test_empty_sections_say_so_in_every_format(tmp_path: Path) -> None:
    rows, per_case, _, env = _run()
    passing = [r for r in rows if r.passed]
    cases = {c.case_id: c for c in (PASSING, EXPLAINED, NEG_KV)}
    report = R.build_report(passing, per_case[:0], env, "KVCached", cases, [], 1.0)
    md, page = _render_all(report, tmp_path)
    assert report.verdict == "PASS" and "None: no traceback in any engine process log." in md
    assert "\n## Problems\n\nNone.\n" in md and "None: no traceback in any engine process log.</p>" in page
    assert format_problems(report, md, page, tmp_path) == []


def test_html_escapes_text(tmp_path: Path) -> None:
    report = _report()
    page = R.render_html(report)
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; co" in page
    assert "token mismatch &lt;p1-01&gt; ✗" in page  # a table cell
    assert "KV differs in block &lt;7&gt; &amp; more" in page  # a bullet
    assert "derived &lt;per archetype&gt;" in page  # the environment block
    assert "<code>" + FAILING.case_id + "</code>" in page  # inline marks still become HTML
    assert "candidate: <strong>KVCached</strong>" in page
    assert R.render_markdown(report).count(SCRIPT) == 1  # Markdown keeps the text as written


def _drop_md_section(report: R.Report, title: str) -> str:
    return R.render_markdown(
        dataclasses.replace(report, body=tuple(s for s in report.body if s.title != title))
    )


BROKEN = {
    "markdown without Process issues": ("md", lambda r: _drop_md_section(r, "Process issues")),
    "markdown without the memory notes": (
        "md",
        lambda r: R.render_markdown(r).replace(r.section("Physical KV memory").blocks[2].text, ""),
    ),
    "html without a parity row": (
        "html",
        lambda r: re.sub(r"<tr class=\"bad\">.*?</tr>", "", R.render_html(r), count=1, flags=re.DOTALL),
    ),
    "html without Explanations": (
        "html",
        lambda r: re.sub(r"<section id=\"explanations\">.*?</section>", "", R.render_html(r), flags=re.DOTALL),
    ),
    "html with an unescaped bullet": (
        "html",
        lambda r: R.render_html(r).replace("KV differs in block &lt;7&gt;", "KV differs in block <7>"),
    ),
    "html with an unescaped process issue": (
        "html",
        lambda r: R.render_html(r).replace("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;", SCRIPT),
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_catches_a_broken_renderer(tmp_path: Path, name: str) -> None:
    report = _report()
    md, page = _render_all(report, tmp_path)
    fmt, broken = BROKEN[name]
    if fmt == "md":
        md = broken(report)
    else:
        page = broken(report)
    assert format_problems(report, md, page, tmp_path) != []


@pytest.mark.parametrize("damage", ["drop index entry", "drop table row", "empty bullets"])
def test_check_catches_broken_csv(tmp_path: Path, damage: str) -> None:
    report = _report()
    md, page = _render_all(report, tmp_path)
    index = pd.read_csv(tmp_path / "report.csv", dtype=str, keep_default_na=False)
    if damage == "drop index entry":
        index[index["title"] != "Explanations"].to_csv(tmp_path / "report.csv", index=False)
    else:
        title = "Parity table" if damage == "drop table row" else "Process issues"
        path = tmp_path / index.loc[index["title"] == title, "file"].iloc[0]
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        frame.iloc[1:].to_csv(path, index=False)
    assert format_problems(report, md, page, tmp_path) != []


def test_write_report_writes_every_file_and_latest(tmp_path: Path) -> None:
    rows, per_case, issues, env = _run()
    cases = {c.case_id: c for c in (PASSING, FAILING, EXPLAINED, NEG_KV)}
    memory = {
        "reference": [(r.case_id, [64 << 20] * 3) for r in rows],
        "candidate": [(r.case_id, [0, 1 << 20, 1 << 19]) for r in rows],
    }
    run_dir, latest = tmp_path / "20260101-000000", tmp_path / "latest"
    md_path = R.write_report(run_dir, latest, rows, per_case, env, "KVCached", cases, memory, issues, 12.3)
    assert md_path == run_dir / "report.md"
    names = {
        "report.md",
        "report.html",
        "report.csv",
        "sections",
        "summary.md",
        "cases.csv",
        "requests.csv",
        "memory.png",
        "environment.json",
    }
    assert names <= {p.name for p in run_dir.iterdir()}
    assert {p.name for p in latest.iterdir()} == names | {"RUN_ID"}
    assert (latest / "RUN_ID").read_text() == "20260101-000000\n"
    report = _report()
    for d in (run_dir, latest):
        assert format_problems(report, (d / "report.md").read_text(), (d / "report.html").read_text(), d) == []
    assert (run_dir / "summary.md").read_text().startswith("| Case ")
    assert len(pd.read_csv(run_dir / "cases.csv")) == 4 and len(pd.read_csv(run_dir / "requests.csv")) == 12
    assert (run_dir / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_headings_match_the_committed_reference() -> None:
    reference = ROOT / "reports" / "conformance" / "latest" / "report.md"
    if not reference.exists():
        pytest.skip("no committed conformance report")
    headings = [ln for ln in reference.read_text().splitlines() if ln.startswith("#")]
    ours = [ln for ln in R.render_markdown(_report(verdict="PASS")).splitlines() if ln.startswith("#")]
    assert [h.split(":")[0] for h in ours] == [h.split(":")[0] for h in headings]


def test_parent_side_imports_neither_vllm_nor_engine_code() -> None:
    code = (
        "import sys; from conformance.orchestrate import report; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('conformance.engine')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_report_functions_are_short() -> None:
    for path in [*(ROOT / "conformance" / "orchestrate" / "report").glob("*.py"),
                 *(ROOT / "conformance" / "reporting").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path.name}:{node.name}"


def test_recompare_refuses_a_run_it_cannot_compare_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recompare reruns only the comparison: a run without raw results, or one that kept no KV
    snapshots (whose KV bytes would then read as missing), is refused by name, before anything."""
    from conformance.orchestrate import cli

    args = ["--quick", "--reports-dir", str(tmp_path), "--recompare", "old-run"]
    assert cli.main(args) == 2 and "no raw results" in capsys.readouterr().err
    (tmp_path / "old-run" / "raw" / "reference").mkdir(parents=True)
    (tmp_path / "old-run" / "raw" / "reference" / "case.json").write_text("{}")
    assert cli.main(args) == 2 and "--keep-kv" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "old-run").iterdir()) == ["raw"]  # nothing written


def test_memory_plot_of_a_run_where_no_case_ran_a_step_draws_a_note_not_a_warning(tmp_path: Path) -> None:
    import warnings

    from conformance.orchestrate.report import memory_plot

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns about a legend with nothing in it
        memory_plot(tmp_path / "empty.png", {"reference": [("a", [])], "candidate": [("a", [])]}, "t")
        memory_plot(tmp_path / "one.png", {"reference": [("a", [0, 2 << 20])], "candidate": [("a", [0, 2 << 20])]}, "t")
    assert (tmp_path / "empty.png").stat().st_size > 0 and (tmp_path / "one.png").stat().st_size > 0


# ---- a run cut short still renders (--render) -----------------------------------------------
def test_a_groups_saved_comparisons_read_back_whole(tmp_path: Path) -> None:
    from conformance.orchestrate.cli import Collected
    from conformance.orchestrate.parity import Problem, ProblemKind

    bad = _row(FAILING, passed=False, verdict="MISMATCH",
               problems=[Problem(ProblemKind.NUMERIC, "token mismatch"), Problem(ProblemKind.CHECK, "a check")])
    part = Collected(rows=[_row(PASSING), bad], per_case=[(_row(PASSING), _requests(_row(PASSING))), (bad, _requests(bad))],
                     memory={"reference": [(PASSING.case_id, [0, 2 << 20])], "candidate": [(PASSING.case_id, [1])]})
    part.save(tmp_path / "g.json")
    back = Collected.load(tmp_path / "g.json")
    assert back.rows == part.rows and back.memory == part.memory
    assert [[q for q in reqs] for _, reqs in back.per_case] == [reqs for _, reqs in part.per_case]
    assert [(p.kind, str(p)) for p in back.rows[1].problems] == [(ProblemKind.NUMERIC, "token mismatch"),
                                                                  (ProblemKind.CHECK, "a check")]


def _render(tmp_path: Path, saved: list[str]) -> tuple[int, str]:
    """``--render`` of a two-group selection (llama, qwen3) whose run saved the groups in ``saved``."""
    from conformance.orchestrate import cli

    argv = ["--device", "cpu", "--archetypes", "llama,qwen3", "--schedulers", "sync", "--faults", "none",
            "--patterns", "warm3", "--layouts", "inproc", "--no-controls", "--reports-dir", str(tmp_path)]
    cases = cli.select_cases(cli.build_parser().parse_args(argv))
    for label, group in cli.engine_groups(cases).items():
        if label in saved:
            rows = [_row(c) for c in group]
            cli.Collected(rows=rows, per_case=[(r, _requests(r)) for r in rows]).save(
                tmp_path / "r1" / cli.COMPARED / f"{label}.json")
    code = cli.main([*argv, "--render", "r1"])
    report = tmp_path / "r1" / "report.md"
    return code, report.read_text() if report.is_file() else ""


def test_render_reports_a_run_cut_short_and_names_the_groups_it_did_not_finish(tmp_path: Path) -> None:
    code, md = _render(tmp_path, saved=["llama"])
    assert code == 1
    assert "qwen3: not compared: the run ended before this group did" in md
    assert "llama-sync-pc-boundary-warm3-none" in md and "qwen3-sync-pc-boundary-warm3-none" not in md


def test_render_of_a_whole_run_passes(tmp_path: Path) -> None:
    code, md = _render(tmp_path, saved=["llama", "qwen3"])
    assert code == 0 and "not compared" not in md and "qwen3-sync-pc-boundary-warm3-none" in md


def test_render_without_saved_comparisons_is_refused(tmp_path: Path) -> None:
    code, md = _render(tmp_path, saved=[])
    assert code == 2 and md == ""


def test_render_keeps_the_environment_the_engines_ran_in(tmp_path: Path) -> None:
    """A run on the GPU host rendered here: the report's facts are the host's, and it says
    what rendered it (an environment of this machine would claim a CPU run)."""
    import json

    ran = {"command": "python3 -m conformance --device cuda", "date": "2026-12-04T17:05:37+00:00", "git": "d6232de",
           "gpu": "NVIDIA H200, driver 580.159.04", "vllm": "0.26.0", "cpu_cores": "16"}
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "environment.json").write_text(json.dumps(ran))
    code, md = _render(tmp_path, saved=["llama", "qwen3"])
    env = json.loads((tmp_path / "r1" / "environment.json").read_text())
    assert code == 0 and {k: env[k] for k in ran} == ran
    assert "NVIDIA H200" in md and "rendered_by" in env and "nothing ran" in env["rendered"]


def test_render_without_a_selection_reports_what_the_runs_into_the_directory_selected(tmp_path: Path) -> None:
    """A run of one archetype, rendered with no selection here, reports that archetype and calls
    nothing else missing (12-04: rendering a nemotron_h-only run against the whole matrix listed
    12 groups as cut short). Two runs into one directory (the GPU host's chunks) add up."""
    from conformance.orchestrate import cli

    base = ["--device", "cpu", "--schedulers", "sync", "--faults", "none", "--patterns", "warm3", "--layouts",
            "inproc", "--no-controls", "--reports-dir", str(tmp_path)]
    for arch in ("llama", "qwen3"):
        cases = cli.select_cases(cli.build_parser().parse_args([*base, "--archetypes", arch]))
        cli.save_selection(tmp_path / "r1", cases)
        if arch == "llama":
            assert cli.saved_selection(tmp_path / "r1") == cases
            for label, group in cli.engine_groups(cases).items():
                rows = [_row(c) for c in group]
                cli.Collected(rows=rows, per_case=[(r, _requests(r)) for r in rows]).save(
                    tmp_path / "r1" / cli.COMPARED / f"{label}.json")
            assert cli.main(["--device", "cpu", "--reports-dir", str(tmp_path), "--render", "r1"]) == 0
            md = (tmp_path / "r1" / "report.md").read_text()
            assert "not compared" not in md and "llama-sync-pc-boundary-warm3-none" in md
    both = cli.saved_selection(tmp_path / "r1")
    assert list(dict.fromkeys(c.archetype.name for c in both or [])) == ["llama", "qwen3"]
    assert cli.main(["--device", "cpu", "--reports-dir", str(tmp_path), "--render", "r1"]) == 1  # qwen3 never finished
    assert "qwen3: not compared" in (tmp_path / "r1" / "report.md").read_text()
    assert cli.saved_selection(tmp_path / "none") is None  # a run from before the selection was saved
