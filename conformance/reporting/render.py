"""One report model, three formats: Markdown, HTML (a Jinja2 template) and CSV.

Every section of the model appears in every format: a ``## title`` in Markdown, an
``<h2>`` in HTML, and a row per block in the CSV index (``<stem>.csv``), whose ``file``
column names the CSV holding that block's data (``<sections>/NN-slug.csv``).
``write_report`` writes all three next to each other.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup, escape

from conformance.reporting.model import Block, Bullets, Image, Paragraph, Preformatted, Report, Table

TEMPLATES = Path(__file__).resolve().parent / "templates"
INDEX_COLUMNS = ["section", "title", "kind", "file", "rows"]


# ---- Markdown ---------------------------------------------------------------------------


def markdown_block(block: Block) -> str:
    if isinstance(block, Table):
        return _markdown_table(block.frame) if not block.frame.empty else f"_{block.empty}_"
    if isinstance(block, Bullets):
        return "\n".join(f"- {item}" for item in block.items) or block.empty
    if isinstance(block, Preformatted):
        return f"```\n{block.text}\n```"
    if isinstance(block, Image):
        return f"![{block.alt}]({block.src})"
    return block.text


def _markdown_table(frame: pd.DataFrame) -> str:
    try:
        # Cells as the program wrote them: tabulate would re-read "2,261.1" as a number and drop ".0".
        return str(frame.to_markdown(index=False, disable_numparse=True))
    except ImportError:  # pandas draws Markdown tables with tabulate, which a GPU host may lack
        return "```\n" + frame.to_string(index=False) + "\n```"


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", report.headline, ""]
    for section in report.sections:
        lines += [f"## {section.title}", ""]
        for block in section.blocks:
            lines += [markdown_block(block), ""]
    return "\n".join(lines)


# ---- HTML -------------------------------------------------------------------------------


def inline_html(text: str) -> Markup:
    """Escape ``text``, then turn its inline marks (```code```, ``**bold**``) into HTML."""
    out = str(escape(str(text)))
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return Markup(out)


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["inline"] = inline_html
    return env


def render_html(report: Report) -> str:
    return _environment().get_template("report.html.j2").render(report=report)


# ---- CSV --------------------------------------------------------------------------------


def csv_block(block: Block) -> pd.DataFrame:
    """A block's data as a table (bullets: ``item``; text: ``line`` / ``text``; image: ``src``, ``alt``)."""
    if isinstance(block, Table):
        return block.frame
    if isinstance(block, Bullets):
        return pd.DataFrame({"item": list(block.items)}, dtype=object)
    if isinstance(block, Preformatted):
        return pd.DataFrame({"line": block.text.splitlines()}, dtype=object)
    if isinstance(block, Image):
        return pd.DataFrame([{"src": block.src, "alt": block.alt}])
    if isinstance(block, Paragraph):
        return pd.DataFrame([{"text": block.text}])
    raise TypeError(f"not a report block: {block!r}")


def _overview(report: Report) -> pd.DataFrame:
    facts = {"verdict": report.verdict or "", **report.overview, "headline": report.headline}
    return pd.DataFrame({"key": list(facts), "value": [str(v) for v in facts.values()]})


def sections_dir(stem: str) -> str:
    """Where a report's per-block CSV files go: ``sections/`` beside ``report.*``, else
    ``<stem>-sections/`` (several reports may share a folder)."""
    return "sections" if stem == "report" else f"{stem}-sections"


def csv_frames(report: Report, stem: str = "report") -> dict[str, pd.DataFrame]:
    """Relative path -> table: ``report.data``, the index ``<stem>.csv`` (section 0 is the
    overview: verdict, counts, headline) and one CSV per block of every section."""
    frames = dict(report.data)
    folder = sections_dir(stem)
    index = []
    parts = [(0, report.title, "overview", _overview(report), f"{folder}/00-overview.csv")]
    for n, section in enumerate(report.sections, start=1):
        for k, block in enumerate(section.blocks, start=1):
            name = f"{folder}/{n:02d}-{section.slug}" + (f"-{k}" if k > 1 else "") + ".csv"
            parts.append((n, section.title, block.kind, csv_block(block), name))
    for n, title, kind, frame, name in parts:
        frames[name] = frame
        index.append({"section": n, "title": title, "kind": kind, "file": name, "rows": len(frame)})
    frames[f"{stem}.csv"] = pd.DataFrame(index, columns=INDEX_COLUMNS)
    return frames


def write_csv(report: Report, directory: Path, stem: str = "report") -> list[Path]:
    """Write every table of ``csv_frames`` under ``directory``; returns the paths written."""
    shutil.rmtree(directory / sections_dir(stem), ignore_errors=True)  # no block of an earlier rendering stays
    written = []
    for name, frame in csv_frames(report, stem).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(path, index=False)
        written.append(path)
    return written


# ---- all three ----------------------------------------------------------------------------


def write_report(report: Report, directory: Path, stem: str = "report") -> Path:
    """``<stem>.md``, ``<stem>.html`` and the CSV files of ``report`` into ``directory``; returns
    the Markdown file's path. Figures (``Image`` blocks) are the program's to draw there."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(report, directory, stem)
    (directory / f"{stem}.html").write_text(render_html(report))
    md = directory / f"{stem}.md"
    md.write_text(render_markdown(report))
    return md
