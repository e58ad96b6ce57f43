"""Reports of every program in this repository, and where their figures came from.

One model (``model.py``: a subject, a verdict, a headline, the environment block and
typed sections of tables, bullets, paragraphs and figures), rendered to Markdown, HTML
(``templates/report.html.j2``) and CSV (``render.py``); one environment block
(``environment.py``: ``provenance(command)``, read from the machine); one verdict rule for
ratios measured in rounds (``verdicts.py``). The conformance matrix, the soak, the sharing
run, compat, the GPU probes (``serving_probes``) and the benchmarks all report through it.
Nothing here imports vLLM.
"""

from __future__ import annotations

from conformance.reporting.environment import Provenance, provenance, revision, saved_environment, version
from conformance.reporting.model import (
    ENVIRONMENT,
    Block,
    Bullets,
    Image,
    Paragraph,
    Preformatted,
    Report,
    Section,
    Table,
    checks_table,
    column,
    columns_of,
    environment_section,
    notes_section,
    table,
)
from conformance.reporting.render import (
    csv_frames,
    markdown_block,
    render_html,
    render_markdown,
    write_csv,
    write_report,
)
from conformance.reporting.verdicts import RULE, verdict

__all__ = [
    "ENVIRONMENT",
    "RULE",
    "Block",
    "Bullets",
    "Image",
    "Paragraph",
    "Preformatted",
    "Provenance",
    "Report",
    "Section",
    "Table",
    "checks_table",
    "column",
    "columns_of",
    "csv_frames",
    "environment_section",
    "markdown_block",
    "notes_section",
    "provenance",
    "render_html",
    "render_markdown",
    "revision",
    "saved_environment",
    "table",
    "verdict",
    "version",
    "write_csv",
    "write_report",
]
