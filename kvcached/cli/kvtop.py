"""kvtop: a live view of every engine sharing each device's KV budget.

Per engine, one bar on a common scale: in-use bytes (solid), reserved idle bytes (shaded),
and its limit (a marker); beside it the device's global limit. Refreshes in place (rich's
Live display, no flicker) every --interval seconds until Ctrl-C.

A record that cannot be read is shown as such, with its file and why (a panel of its own;
with --json an entry with its "error"); the others are still shown.

Exit codes: 0 done; 1 no record, or a record unreadable (--once, --json: a message says
which and why); 2 bad usage (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from kvcached.cli.records import (
    FAILED,
    OK,
    DeviceView,
    EngineView,
    Parser,
    Unreadable,
    human,
    parse_interval,
    read_all,
    record_paths,
)
from kvcached.errors import ConfigError


def _bar(e: EngineView, scale: int, width: int):  # -> rich.text.Text
    from rich.text import Text

    cells = [" "] * width
    styles = [""] * width

    def cell(n: int) -> int:
        return min(width, round(n * width / scale)) if scale else 0

    in_use = cell(min(e.in_use, e.mapped))
    mapped = cell(e.mapped)
    for i in range(mapped):
        cells[i], styles[i] = ("█", "green") if i < in_use else ("▒", "cyan")
    if e.limit is not None:
        at = min(width - 1, cell(e.limit))
        cells[at], styles[at] = "│", "bold red" if e.over else "bold yellow"
    text = Text()
    for ch, style in zip(cells, styles, strict=True):
        text.append(ch, style=style)
    return text


def render(shown: list[DeviceView | Unreadable], width: int = 120):  # -> rich.console.Group
    """One panel per device (an unreadable record's says why); the bars take what ``width``
    columns leave after the numbers."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    panels = []
    views = [v for v in shown if isinstance(v, DeviceView)]
    names = max([6, *(len(e.name) + 5 for v in views for e in v.engines)])
    bar = max(8, width - names - 3 * 11 - 10)
    for v in shown:
        if isinstance(v, Unreadable):
            panels.append(Panel(Text(v.error, style="red"), title=f"{v.device}: [bold red]unreadable record[/]",
                                subtitle=v.path, title_align="left"))
            continue
        scale = max([v.limit or 0, v.used, *(e.limit or 0 for e in v.engines), 1])
        table = Table(expand=True, box=None, pad_edge=False)
        table.add_column("engine", no_wrap=True, min_width=names)
        for col in ("mapped", "reserved", "limit"):
            table.add_column(col, justify="right", no_wrap=True, min_width=9)
        table.add_column("█ in use ▒ reserved │ limit", no_wrap=True, min_width=bar)
        for e in v.engines:
            name = f"[bold red]{e.name} OVER[/]" if e.over else e.name
            table.add_row(name, human(e.mapped), human(e.reserved), human(e.limit), _bar(e, scale, bar))
        if v.unclaimed:
            table.add_row("[dim](ranks starting)[/]", human(v.unclaimed), "", "", "")
        if not v.engines and not v.unclaimed:
            table.add_row("[dim](no engine running)[/]", "", "", "", "")
        limit = human(v.limit) if v.limit is not None else "no global limit"
        over = v.limit is not None and v.used > v.limit
        title = (f"{v.device}: {human(v.used)} used of {limit}" + (" [bold red]OVER[/]" if over else "")
                 + f"  [dim](a full bar: {human(scale)})[/]")
        panels.append(Panel(table, title=title, subtitle=v.path, title_align="left"))
    return Group(*panels) if panels else Group("no engines")


def _parser() -> Parser:
    parser = Parser(prog="kvtop", description=__doc__.split("\n\n")[0],
                    epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="one budget record (default: every record in the per-user folder)")
    parser.add_argument("--dir", help="the folder of records (default: the per-user one)")
    parser.add_argument("--interval", type=parse_interval, default=0.5,
                        help="seconds between refreshes, in (0, 3600] (default 0.5)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    return parser


def _once(views: list[DeviceView | Unreadable], console, *, as_json: bool) -> int:
    """One snapshot (a frame, or JSON); each unreadable record is also one line on stderr."""
    unreadable = [v for v in views if isinstance(v, Unreadable)]
    for v in unreadable:
        print(f"kvtop: {v.line()}", file=sys.stderr)
    if as_json:
        print(json.dumps([v.to_json() for v in views], indent=2))
    else:
        console.print(render(views, console.width))
    return FAILED if unreadable else OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("kvtop: needs the 'rich' package (pip install 'kvcached[cli]')", file=sys.stderr)
        return FAILED
    try:
        paths = record_paths(args.path, args.dir)
        if not paths:
            raise ConfigError("no budget record found: no kvcached engine has run as this user (or pass --path / --dir)")
        views = read_all(paths)
        console = Console()
        if args.json or args.once:
            return _once(views, console, as_json=args.json)
        with Live(render(views, console.width), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                views = read_all(record_paths(args.path, args.dir))
                live.update(render(views, console.width), refresh=True)
    except KeyboardInterrupt:
        return OK
    except ConfigError as e:
        print(f"kvtop: {e}", file=sys.stderr)
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
