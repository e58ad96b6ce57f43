"""The report model: what a report says, before any format is chosen.

Every program of the project (the conformance matrix, the soak, the sharing run, compat,
the GPU probes, the benchmarks) describes its report as one ``Report``: a subject and a
verdict (together the title), a headline, the environment it ran in (a ``Provenance``,
always the first section) and an ordered tuple of ``Section``s. A section is a title and
one or more blocks, each a ``Table`` (a ``pandas.DataFrame``), ``Bullets``,
``Preformatted`` text, an ``Image`` or a ``Paragraph``. The renderers in ``render.py`` turn
the same model into Markdown, HTML and CSV, so no format can say more than another.

Text in bullets, paragraphs and the headline may carry two inline marks, ``code`` in
backticks and ``**bold**``: Markdown keeps them, HTML turns them into ``<code>`` and
``<strong>``, CSV keeps the text as written. Everything else is plain text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

from conformance.reporting.environment import Provenance

ENVIRONMENT = "Environment"
NOTES = "Notes"
#: Verdicts that colour a report's header: green for these, red for ``FAILED``, grey otherwise.
PASSED = ("PASS",)
FAILED = ("FAIL",)


@dataclass(frozen=True, eq=False)
class Table:
    """A table; ``empty`` is said instead when it has no rows."""

    frame: pd.DataFrame
    empty: str = "(none)"
    kind: ClassVar[str] = "table"


@dataclass(frozen=True)
class Bullets:
    """A bullet list; ``empty`` is said instead when it has no items."""

    items: tuple[str, ...]
    empty: str = "None."
    kind: ClassVar[str] = "bullets"


@dataclass(frozen=True)
class Preformatted:
    text: str
    kind: ClassVar[str] = "preformatted"


@dataclass(frozen=True)
class Image:
    """An image file next to the report (``src`` is relative to the report's folder)."""

    src: str
    alt: str
    kind: ClassVar[str] = "image"


@dataclass(frozen=True)
class Paragraph:
    text: str
    kind: ClassVar[str] = "paragraph"


Block = Table | Bullets | Preformatted | Image | Paragraph


def slug(text: str) -> str:
    """``"Summary (validation-table shape)"`` -> ``"summary-validation-table-shape"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class Section:
    title: str
    blocks: tuple[Block, ...]

    @property
    def slug(self) -> str:
        return slug(self.title)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(b.kind for b in self.blocks)


def column(name: str) -> dict[str, str]:
    """A dataclass field's column title, where its name cannot say it: ``field(metadata=column("a / b"))``."""
    return {"column": name}


def columns_of(row_type: type) -> list[str]:
    """The column titles of a row dataclass: each field's ``column`` metadata, else its name in words."""
    return [f.metadata.get("column", f.name.replace("_", " ")) for f in fields(row_type)]


def table(rows: Iterable[Any], columns: Sequence[str] | None = None, empty: str = "(none)") -> Table:
    """A ``Table`` from typed rows: dataclass instances (their fields, in order, are the columns,
    titled by ``columns_of``) or mappings; ``columns`` names the columns when there may be no row."""
    records = []
    for r in rows:
        if is_dataclass(r) and not isinstance(r, type):
            records.append(dict(zip(columns_of(type(r)), (getattr(r, f.name) for f in fields(r)), strict=True)))
        else:
            records.append(dict(r))
    # dtype object: each cell as the row gave it (a None stays None, an int among floats stays an int)
    frame = pd.DataFrame(records, columns=list(columns) if columns is not None else None, dtype=object)
    return Table(frame, empty)


def checks_table(checks: Mapping[str, bool]) -> Table:
    """What a run requires, and whether it held (``yes`` / ``NO``)."""
    return table(({"check": name, "holds": "yes" if ok else "NO"} for name, ok in checks.items()),
                 columns=["check", "holds"])


def notes_section(path: Path, title: str = NOTES) -> Section | None:
    """Notes written by hand beside a report (``notes.md``: paragraphs separated by blank
    lines): what a program cannot say about its own run (how a result was read, earlier runs).
    They stay when the report is rendered again; None without the file."""
    if not path.is_file():
        return None
    paragraphs = [" ".join(p.split()) for p in path.read_text().split("\n\n") if p.strip()]
    return Section(title, tuple(Paragraph(p) for p in paragraphs))


def environment_section(environment: Provenance) -> Section:
    """The environment block every report opens with: one row per fact."""
    facts = environment.as_dict()
    frame = pd.DataFrame({"fact": list(facts), "value": [str(v) for v in facts.values()]}, dtype=object)
    return Section(ENVIRONMENT, (Table(frame),))


@dataclass(frozen=True, eq=False, kw_only=True)
class Report:
    """One report. ``data`` holds more tables written as CSV files only (name -> frame: a
    run's full data behind its tables); ``overview`` holds the facts of the CSV index's
    section 0 beside the verdict and the headline."""

    subject: str
    headline: str
    environment: Provenance
    body: tuple[Section, ...]
    verdict: str | None = None
    overview: Mapping[str, object] = field(default_factory=dict)
    data: Mapping[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.subject}: {self.verdict}" if self.verdict else self.subject

    @property
    def tone(self) -> str:
        """``pass``, ``fail`` or ``neutral``: the HTML header's colour."""
        return "pass" if self.verdict in PASSED else "fail" if self.verdict in FAILED else "neutral"

    @property
    def sections(self) -> tuple[Section, ...]:
        return (environment_section(self.environment), *self.body)

    def section(self, title: str) -> Section:
        for s in self.sections:
            if s.title == title:
                return s
        raise KeyError(title)
