"""kvctl: list the engines sharing each device's KV budget, and set or clear their limits.

    kvctl list [--json]                 every engine on every device, with its bytes and limits
    kvctl limit ENGINE SIZE             cap one engine (it gives back idle memory at its next step)
    kvctl limit --global SIZE           the device's global limit, for every engine on it
    kvctl clear ENGINE | --global       remove that limit

Records: every ``*.budget`` in the per-user folder (``$KVCACHED_BUDGET_DIR``, else
``$XDG_RUNTIME_DIR`` or ``/dev/shm``, ``kvcached-<uid>/``), or ``--path`` for one record.
Exit codes: 0 done, 1 nothing to act on or the record refused (a message says why),
2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvcached.budget import BudgetRecord
from kvcached.cli.records import DeviceView, human, parse_bytes, read_all, record_paths
from kvcached.errors import ConfigError

OK, FAILED, USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--path", help="one budget record (default: every record in the per-user folder)")
    parser.add_argument("--dir", help="the folder of records (default: the per-user one)")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="engines, bytes and limits per device")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    for name, usage in (("limit", "(ENGINE | --global) SIZE"), ("clear", "(ENGINE | --global)")):
        cmd = sub.add_parser(name, usage=f"kvctl {name} {usage} [--json]",
                             help="set a limit" if name == "limit" else "remove a limit")
        cmd.add_argument("operands", nargs="*", metavar="ENGINE SIZE",
                         help="the engine's name (kvctl list shows it); SIZE: 1073741824, 512MiB, 2G")
        cmd.add_argument("--global", dest="globally", action="store_true", help="the device's global limit")
        cmd.add_argument("--json", action="store_true", help="print the records after the change as JSON")
    return parser


def _operands(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.engine`` and ``args.size`` from the operands, or exits with usage (2)."""
    want = (0 if args.globally else 1) + (1 if args.command == "limit" else 0)
    if len(args.operands) != want:
        parser.error(f"{args.command}: expected {'--global' if args.globally else 'ENGINE'}"
                     f"{' SIZE' if args.command == 'limit' else ''}, got {' '.join(args.operands) or 'nothing'}")
    args.engine = None if args.globally else args.operands[0]
    args.size = args.operands[-1] if args.command == "limit" else None


def _table(views: list[DeviceView]) -> str:
    lines = []
    for v in views:
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


def _change(args: argparse.Namespace, paths: list[str]) -> None:
    size = parse_bytes(args.size) if args.size is not None else None
    changed = False
    for path in paths:
        with BudgetRecord(path, create=False) as record:
            if args.globally:
                record.set_limit(size)
                changed = True
            elif record.snapshot().engine(args.engine) is not None:
                record.set_engine_limit(args.engine, size)
                changed = True
    if not changed:
        raise ConfigError(f"no live engine named {args.engine!r} in {', '.join(paths)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "list":
        _operands(parser, args)
    try:
        paths = record_paths(args.path, args.dir)
        if not paths:
            raise ConfigError("no budget record found: no kvcached engine has run as this user "
                              "(or pass --path / --dir)")
        if args.command != "list":
            _change(args, paths)
        views = read_all(paths)
    except ConfigError as e:  # BudgetRecordError and BudgetConflict included
        print(f"kvctl: {e}", file=sys.stderr)
        return FAILED
    if args.json:
        print(json.dumps([v.to_json() for v in views], indent=2))
    elif args.command == "list":
        print(_table(views))
    else:
        what = "global limit" if args.globally else f"{args.engine}'s limit"
        print(f"{what}: {human(parse_bytes(args.size)) if args.size else 'cleared'}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
