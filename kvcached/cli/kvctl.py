"""kvctl: list the engines sharing each device's KV budget, and set or clear their limits.

    kvctl list [--json]                       every engine on every device, with its bytes and limits
    kvctl limit ENGINE SIZE [--device DEV]    cap one engine (it gives back idle memory at its next step)
    kvctl limit --global SIZE [--device DEV]  one device's global limit, for every engine on it
    kvctl clear (ENGINE | --global) [--device DEV]   remove that limit

Records: every ``*.budget`` in the per-user folder (``$KVCACHED_BUDGET_DIR``, else
``$XDG_RUNTIME_DIR`` or ``/dev/shm``, ``kvcached-<uid>/``), or ``--path`` for one record.
A device is a record's file name less ``.budget`` (``host``, or a GPU's UUID; ``--device``
takes it or a prefix of one only). ``--global`` changes one device: it needs ``--device``
when there is more than one record. An engine's limit is set on every device it is live on
(or on ``--device``'s). Each change is reported with the device and record it changed.

SIZE: whole bytes (1073741824), 512MiB, 1.5G (binary), 2GB (decimal), at most 2**63-1;
0 is a limit of nothing (the engine gives back every idle page).

A record that cannot be read is reported on one line (its file and why); the others are
still listed and changed.

Exit codes: 0 done; 1 nothing to act on (no record, no live engine of that name) or a
record refused or unreadable (a message says which and why); 2 bad usage (one line;
nothing changed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvcached.budget import BudgetRecord
from kvcached.cli.records import (
    FAILED,
    OK,
    DeviceView,
    Parser,
    Unreadable,
    device_of,
    human,
    parse_bytes,
    read_all,
    record_paths,
    select,
)
from kvcached.errors import ConfigError


def _parser() -> Parser:
    parser = Parser(prog="kvctl", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--path", help="one budget record (default: every record in the per-user folder)")
    parser.add_argument("--dir", help="the folder of records (default: the per-user one)")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="engines, bytes and limits per device")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    for name, usage in (("limit", "(ENGINE | --global) SIZE"), ("clear", "(ENGINE | --global)")):
        cmd = sub.add_parser(name, usage=f"kvctl {name} {usage} [--device DEV] [--json]",
                             help="set a limit" if name == "limit" else "remove a limit")
        cmd.add_argument("operands", nargs="*", metavar="ENGINE SIZE",
                         help="the engine's name (kvctl list shows it); SIZE: 1073741824, 512MiB, 2G")
        cmd.add_argument("--global", dest="globally", action="store_true", help="a device's global limit")
        cmd.add_argument("--device", help="the device (record) to change: host, or a GPU's UUID or its prefix")
        cmd.add_argument("--json", action="store_true", help="print the records after the change as JSON")
    return parser


def _operands(parser: Parser, args: argparse.Namespace) -> None:
    """Sets ``args.engine`` and ``args.size`` (bytes, or None to clear) from the operands, or
    exits with a one-line usage error (2)."""
    want = (0 if args.globally else 1) + (1 if args.command == "limit" else 0)
    if len(args.operands) != want:
        parser.error(f"{args.command}: expected {'--global' if args.globally else 'ENGINE'}"
                     f"{' SIZE' if args.command == 'limit' else ''}, got {' '.join(args.operands) or 'nothing'}")
    args.engine = None if args.globally else args.operands[0]
    try:
        args.size = parse_bytes(args.operands[-1]) if args.command == "limit" else None
    except ConfigError as e:
        parser.error(str(e))


def _targets(parser: Parser, args: argparse.Namespace, paths: list[str]) -> list[str]:
    """The records to change; a selector that fits none or several, or ``--global`` over
    several records without one, is a usage error listing the choices."""
    try:
        chosen = select(paths, args.device)
    except ConfigError as e:
        parser.error(str(e))
    if args.globally and len(chosen) > 1:
        parser.error(f"--global changes one device's limit, and there are {len(chosen)} records; "
                     f"name one with --device: {', '.join(map(device_of, chosen))}")
    return chosen


def _change(args: argparse.Namespace, paths: list[str]) -> tuple[list[str], list[str]]:
    """Apply the change to each record of ``paths`` (an engine's: where it is live). Returns
    one line per record changed and one per record that refused or could not be read."""
    what = "global limit" if args.globally else f"{args.engine}'s limit"
    to = "cleared" if args.size is None else f"set to {human(args.size)} ({args.size} bytes)"
    done, failed = [], []
    for path in paths:
        try:
            with BudgetRecord(path, create=False) as record:
                if args.globally:
                    record.set_limit(args.size)
                elif record.snapshot().engine(args.engine) is not None:
                    record.set_engine_limit(args.engine, args.size)
                else:
                    continue
        except ConfigError as e:  # BudgetRecordError included: this record is unreadable or refused
            failed.append(f"{device_of(path)}: not changed: {e}")
            continue
        done.append(f"{device_of(path)}: {what} {to}  ({path})")
    if not done and not failed:
        raise ConfigError(f"no live engine named {args.engine!r} in {', '.join(paths)}")
    return done, failed


def _table(views: list[DeviceView | Unreadable]) -> str:
    lines = []
    for v in views:
        if isinstance(v, Unreadable):
            continue  # reported on stderr, one line each
        lines.append(f"{v.device}: {human(v.used)} used of {human(v.limit) if v.limit is not None else 'no limit'}"
                     f"  ({v.path})")
        lines.append(f"  {'ENGINE':<28} {'PID':>8} {'RANKS':>5} {'MAPPED':>11} {'RESERVED':>11} {'LIMIT':>11}")
        for e in v.engines:
            flag = "  OVER LIMIT" if e.over else ""
            lines.append(f"  {e.name:<28} {e.pid:>8} {e.ranks:>5} {human(e.mapped):>11} {human(e.reserved):>11} "
                         f"{human(e.limit):>11}{flag}")
        if v.unclaimed:
            lines.append(f"  {'(no engine: starting ranks)':<28} {'':>8} {'':>5} {human(v.unclaimed):>11}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "list":
        _operands(parser, args)
    done: list[str] = []
    failed: list[str] = []
    try:
        paths = record_paths(args.path, args.dir)
        if not paths:
            raise ConfigError("no budget record found: no kvcached engine has run as this user "
                              "(or pass --path / --dir)")
        if args.command != "list":
            done, failed = _change(args, _targets(parser, args, paths))
        views = read_all(paths)
    except ConfigError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return FAILED
    if args.command == "list":
        failed = [v.line() for v in views if isinstance(v, Unreadable)]
    for line in failed:
        print(f"kvctl: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps([v.to_json() for v in views], indent=2))
    elif args.command == "list":
        if table := _table(views):
            print(table)
    elif done:
        print("\n".join(done))
    return FAILED if failed else OK


if __name__ == "__main__":
    sys.exit(main())
