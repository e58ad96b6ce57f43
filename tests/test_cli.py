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
from kvcached.config import MAX_BYTES
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
    assert run(kvctl, capsys, "--path", record.path, "limit", "a", "3MiB")[:2] == (
        0, f"host: a's limit set to 3.0 MiB (3145728 bytes)  ({record.path})\n")
    assert record.snapshot().engine("a").limit == 3 * MiB  # type: ignore[union-attr]
    assert run(kvctl, capsys, "--path", record.path, "clear", "b")[0] == 0
    assert record.snapshot().engine("b").limit is None  # type: ignore[union-attr]
    assert run(kvctl, capsys, "--path", record.path, "limit", "--global", "1G")[0] == 0
    assert record.snapshot().limit == 1 << 30
    assert run(kvctl, capsys, "--path", record.path, "clear", "--global")[0] == 0
    assert record.snapshot().limit is None


@pytest.mark.parametrize(("argv", "code", "message"), [
    (("limit", "nobody", "1G"), 1, "no live engine named 'nobody'"),
    (("limit", "a", "lots"), 2, "not a byte size"),
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
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES and parse_bytes("0.5GiB") == 1 << 29
    for bad in ("", "-1", "1 parsec", "1e9", "0.5", "1.0001KiB", str(MAX_BYTES + 1)):
        with pytest.raises(ConfigError):
            parse_bytes(bad)


def test_console_scripts_are_installed() -> None:
    bindir = Path(sys.executable).parent
    for tool in ("kvctl", "kvtop"):
        done = subprocess.run([str(bindir / tool), "--help"], capture_output=True, text=True, check=False,
                              env={**os.environ, "COLUMNS": "100"})
        assert done.returncode == 0 and f"usage: {tool}" in done.stdout


def _engines(folder: Path, device: str, *names: str) -> BudgetRecord:
    """A real record ``<device>.budget`` in ``folder`` with live engines (1 MiB mapped each)."""
    rec = BudgetRecord(str(folder / f"{device}.budget"))
    for name in names:
        slot = rec.slot(rank=0, device="cpu")
        assert slot.charge(MiB)
        rec.engine(name, (slot.index,)).publish(mapped=MiB, in_use=MiB, reserved=0)
    return rec


def cli(tool: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    return subprocess.run([str(Path(sys.executable).parent / tool), *argv], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "COLUMNS": "100"})


@pytest.mark.parametrize("argv", [
    ("limit", "a", str(1 << 64)), ("limit", "a", "18446744073709551615"), ("limit", "--global", "16EiB"),
    ("limit", "--global", "1" + "0" * 400), ("limit", "a", "1e400"), ("limit", "a", "0.5"),
    ("limit", "--global", "0.0001KiB"), ("limit", "a", "-1"), ("limit", "a", "nan"), ("nothing",),
])
def test_a_size_too_large_fractional_or_not_a_size_is_a_one_line_usage_error(record: BudgetRecord,
                                                                              argv: tuple[str, ...]) -> None:
    """Sizes at or above 2**64 ended in a struct.error traceback, 2**64-1 meant "no limit",
    and ``0.5`` became a 0-byte limit. Now: one line, exit 2, the record unchanged."""
    before = record.snapshot()
    done = cli("kvctl", "--path", record.path, *argv)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("kvctl"), done.stderr
    after = record.snapshot()
    assert (after.limit, after.engines) == (before.limit, before.engines)


@pytest.mark.parametrize("interval", ["inf", "-inf", "nan", "1e400", "0", "-1", "soon", "1e9"])
def test_kvtop_interval_out_of_range_is_a_one_line_usage_error(record: BudgetRecord, interval: str) -> None:
    """``--interval inf`` ended in an OverflowError traceback from time.sleep."""
    done = cli("kvtop", "--path", record.path, "--interval", interval)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "--interval" in done.stderr, done.stderr


def test_one_unreadable_record_is_reported_and_the_others_still_listed(tmp_path: Path) -> None:
    """One corrupt ``*.budget`` made ``kvctl list`` and ``kvtop`` fail for every device."""
    good = _engines(tmp_path, "host", "a")
    bad = tmp_path / "gpu-0bad.budget"
    bad.write_bytes(b"garbage")
    bad.chmod(0o600)
    try:
        done = cli("kvctl", "--dir", str(tmp_path), "list")
        assert done.returncode == 1
        (line,) = done.stderr.splitlines()
        assert str(bad) in line and "truncated" in line
        assert "host: 1.0 MiB used" in done.stdout and "\n  a " in done.stdout
        done = cli("kvctl", "--dir", str(tmp_path), "list", "--json")
        listed = {d["device"]: d for d in json.loads(done.stdout)}
        assert listed["host"]["error"] is None and [e["name"] for e in listed["host"]["engines"]] == ["a"]
        assert "truncated" in listed["gpu-0bad"]["error"] and listed["gpu-0bad"]["engines"] == []
        done = cli("kvtop", "--dir", str(tmp_path), "--once")
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1 and str(bad) in done.stderr
        assert "host: 1.0 MiB used" in done.stdout and "unreadable record" in done.stdout
        # An engine's limit is still set where it is live; the bad record is named, untouched.
        done = cli("kvctl", "--dir", str(tmp_path), "limit", "a", "512KiB")
        assert done.returncode == 1 and "gpu-0bad: not changed" in done.stderr
        assert good.snapshot().engine("a").limit == 512 << 10  # type: ignore[union-attr]
        assert done.stdout.startswith("host: a's limit set to 512.0 KiB")
    finally:
        good.close()


def test_global_limit_names_the_device_it_changes_and_takes_a_device_selector(tmp_path: Path) -> None:
    """``kvctl limit --global`` changed every record in the folder (the host's and every GPU's)
    and named none. With several records it now needs --device (the error lists them)."""
    host = _engines(tmp_path, "host", "a")
    gpu = _engines(tmp_path, "gpu-5f1c2a", "b")
    try:
        done = cli("kvctl", "--dir", str(tmp_path), "limit", "--global", "1G")
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
        assert "--device" in done.stderr and "gpu-5f1c2a, host" in done.stderr
        assert (host.snapshot().limit, gpu.snapshot().limit) == (None, None)
        done = cli("kvctl", "--dir", str(tmp_path), "limit", "--global", "1G", "--device", "gpu-5f")
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"gpu-5f1c2a: global limit set to 1.0 GiB (1073741824 bytes)  ({gpu.path})\n"
        assert (host.snapshot().limit, gpu.snapshot().limit) == (None, 1 << 30)
        done = cli("kvctl", "--dir", str(tmp_path), "clear", "--global", "--device", "gpu-5f1c2a")
        assert (done.returncode, done.stdout) == (0, f"gpu-5f1c2a: global limit cleared  ({gpu.path})\n")
        assert gpu.snapshot().limit is None
        for selector in ("nvme", ""):
            done = cli("kvctl", "--dir", str(tmp_path), "limit", "--global", "1G", "--device", selector)
            assert done.returncode == 2 and "records: gpu-5f1c2a, host" in done.stderr, done.stderr
        done = cli("kvctl", "--dir", str(tmp_path), "limit", "b", "1M", "--device", "host")
        assert done.returncode == 1 and "no live engine named 'b'" in done.stderr
        done = cli("kvctl", "--path", host.path, "limit", "--global", "2G")  # one record: no selector needed
        assert done.returncode == 0
        assert done.stdout == f"host: global limit set to 2.0 GiB (2147483648 bytes)  ({host.path})\n"
    finally:
        host.close()
        gpu.close()
