"""The report model: what a conformance report says, before any format is chosen.

A ``Report`` is a verdict, its counts, the environment and an ordered tuple of ``Section``s;
a section is a title and one or more blocks, each a ``Table`` (a ``pandas.DataFrame``),
``Bullets``, ``Preformatted`` text, an ``Image`` or a ``Paragraph``. The renderers in
``render.py`` turn the same model into Markdown, HTML and CSV, so no format can say more
than another.

Text in bullets, paragraphs and the headline may carry two inline marks, ``code`` in
backticks and ``**bold**``: Markdown keeps them, HTML turns them into ``<code>`` and
``<strong>``, CSV keeps the text as written. Everything else is plain text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment


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


@dataclass(frozen=True, eq=False)
class Report:
    """One conformance run. ``cases`` and ``requests`` are the full data behind the tables
    (every ``ParityRow`` field, one row per request); they are written as CSV only."""

    passed_all: bool
    comparisons: int
    passed: int
    failed: int
    process_issues: int
    wall_s: float
    candidate_name: str
    environment: Mapping[str, Any]
    sections: tuple[Section, ...]
    cases: pd.DataFrame = field(default_factory=pd.DataFrame)
    requests: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: Comparisons native vLLM could not run on its own (known native defects): neither passed nor failed.
    native_errors: int = 0

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed_all else "FAIL"

    @property
    def title(self) -> str:
        return f"kvcached conformance report: {self.verdict}"

    @property
    def headline(self) -> str:
        return (
            f"{self.comparisons} comparisons ({self.passed} passed, {self.failed} failed"
            + (f", {self.native_errors} native errors" if self.native_errors else "") + "), "
            f"candidate: **{self.candidate_name}**, wall time {self.wall_s:.0f} s."
        )

    def section(self, title: str) -> Section:
        for s in self.sections:
            if s.title == title:
                return s
        raise KeyError(title)
