"""kvctl and kvtop over a real budget record (engines registered the way the engine seam does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.budget import BudgetRecord
from kvcached.cli import kvctl, kvtop
from kvcached.cli.records import parse_bytes
from kvcached.errors import ConfigError

MiB = 1 << 20


@pytest.fixture
def record(tmp_path: Path):
    """A host record with two engines: a (6 MiB, 2 reserved) and b (5 MiB, limited to 4)."""
    rec = BudgetRecord(str(tmp_path / "host.budget"), limit=16 * MiB)
    for name, mapped, reserved in (("a", 6, 2), ("b", 5, 0)):
        slot = rec.slot(rank=0, device="cpu")
        assert slot.charge(mapped * MiB)
        rec.engine(name, (slot.index,)).publish(mapped=mapped * MiB, in_use=(mapped - reserved) * MiB,
                                               reserved=reserved * MiB)
    rec.set_engine_limit("b", 4 * MiB)
    yield rec
    rec.close()


def run(tool, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = tool.main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_shows_engines_bytes_limits_and_who_is_over(record: BudgetRecord, capsys) -> None:
    code, out, _ = run(kvctl, capsys, "--path", record.path, "list")
    assert code == 0
    lines = out.splitlines()
    assert "host: 11.0 MiB used of 16.0 MiB" in lines[0]
    assert [ln.split()[0] for ln in lines[2:]] == ["a", "b"]
    assert "OVER LIMIT" in lines[3] and "OVER LIMIT" not in lines[2]
    code, out, _ = run(kvctl, capsys, "--path", record.path, "list", "--json")
    (device,) = json.loads(out)
    assert device["limit"] == 16 * MiB and device["used"] == 11 * MiB
    assert [(e["name"], e["mapped"], e["reserved"], e["limit"], e["over_limit"]) for e in device["engines"]] == [
        ("a", 6 * MiB, 2 * MiB, None, False), ("b", 5 * MiB, 0, 4 * MiB, True)]


def test_limits_are_set_and_cleared(record: BudgetRecord, capsys) -> None:
    assert run(kvctl, capsys, "--path", record.path, "limit", "a", "3MiB")[:2] == (0, "a's limit: 3.0 MiB\n")
    assert record.snapshot().engine("a").limit == 3 * MiB  # type: ignore[union-attr]
    assert run(kvctl, capsys, "--path", record.path, "clear", "b")[0] == 0
    assert record.snapshot().engine("b").limit is None  # type: ignore[union-attr]
    assert run(kvctl, capsys, "--path", record.path, "limit", "--global", "1G")[0] == 0
    assert record.snapshot().limit == 1 << 30
    assert run(kvctl, capsys, "--path", record.path, "clear", "--global")[0] == 0
    assert record.snapshot().limit is None


@pytest.mark.parametrize(("argv", "code", "message"), [
    (("limit", "nobody", "1G"), 1, "no live engine named 'nobody'"),
    (("limit", "a", "lots"), 1, "not a byte size"),
    (("limit", "a"), 2, "expected ENGINE SIZE"),
    (("clear",), 2, "expected ENGINE"),
    (("limit", "--global", "a", "1G"), 2, "expected --global SIZE"),
    (("frobnicate",), 2, "invalid choice"),
])
def test_bad_usage_and_unknown_engines_exit_nonzero_and_change_nothing(
        record: BudgetRecord, capsys, argv: tuple[str, ...], code: int, message: str) -> None:
    before = record.snapshot()
    got, _, err = run(kvctl, capsys, "--path", record.path, *argv)
    assert got == code and message in err
    after = record.snapshot()
    assert (after.limit, after.engines) == (before.limit, before.engines)


def test_a_missing_or_damaged_record_is_reported(tmp_path: Path, capsys) -> None:
    code, _, err = run(kvctl, capsys, "--dir", str(tmp_path), "list")
    assert code == 1 and "no budget record found" in err
    bad = tmp_path / "host.budget"
    bad.write_bytes(b"garbage")
    bad.chmod(0o600)
    code, _, err = run(kvctl, capsys, "--dir", str(tmp_path), "list")
    assert code == 1 and "truncated" in err
    assert run(kvtop, capsys, "--dir", str(tmp_path), "--once")[0] == 1


def test_kvtop_renders_one_frame_and_json(record: BudgetRecord, capsys) -> None:
    code, out, _ = run(kvtop, capsys, "--path", record.path, "--once")
    assert code == 0
    assert "host: 11.0 MiB used of 16.0 MiB" in out
    rows = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith(("│ a", "│ b"))}
    assert "OVER" in rows["b"] and "█" in rows["a"] and "▒" in rows["a"] and "│" in rows["b"][20:]
    code, out, _ = run(kvtop, capsys, "--path", record.path, "--json")
    assert code == 0 and json.loads(out)[0]["engines"][1]["over_limit"] is True
    assert run(kvtop, capsys, "--path", record.path, "--interval", "0")[0] == 2


def test_byte_sizes() -> None:
    assert [parse_bytes(s) for s in ("1048576", "512MiB", "2G", "2GB", "1.5KiB", " 4 k ")] == [
        MiB, 512 * MiB, 2 << 30, 2 * 10**9, 1536, 4096]
    for bad in ("", "-1", "1 parsec", "1e9"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)


def test_console_scripts_are_installed() -> None:
    bindir = Path(sys.executable).parent
    for tool in ("kvctl", "kvtop"):
        done = subprocess.run([str(bindir / tool), "--help"], capture_output=True, text=True, check=False,
                              env={**os.environ, "COLUMNS": "100"})
        assert done.returncode == 0 and f"usage: {tool}" in done.stdout
