"""The budget record shared by real processes: charges, liveness, validation, limits, fork.

Each defect of the earlier PID-based record has a test here that reproduces its scenario
with real processes (another PID namespace, a reused PID, a zombie, a fork, a second
engine asking for another limit).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcached import _vmm
from kvcached import budget as kb
from kvcached.budget import BudgetConflict, BudgetRecord, BudgetRecordError, LocalBudget
from kvcached.errors import ConfigError, InvariantError, PhysicalMemoryExhausted
from kvcached.pages import PageSpace

PAGE = 64 << 10
TIMEOUT = 60

# A child that claims a slot, charges `pages` pages, says "ready" and sleeps until killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from kvcached.budget import BudgetRecord
    record = BudgetRecord(sys.argv[1])
    slot = record.slot(rank=0, device="cpu", label="holder")
    assert slot.charge(int(sys.argv[2]))
    print("ready", flush=True)
    time.sleep(600)
""")


def start_holder(path: Path, nbytes: int, prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(path), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait(TIMEOUT)
        pytest.fail(f"holder did not start: {line!r}")
    return proc


def space(charger: object, pages: int = 8) -> PageSpace:
    vrange = _vmm.VirtualRange("cpu", pages * PAGE, PAGE)
    return PageSpace((vrange,), (1,), pages, charger)  # type: ignore[arg-type]


# ---- charging ---------------------------------------------------------------------------
def test_charges_are_all_or_nothing_under_the_global_limit(tmp_path: Path) -> None:
    with BudgetRecord(str(tmp_path / "b"), limit=3 * PAGE) as record:
        slot = record.slot(rank=0, device="cpu")
        s = space(slot)
        s.map_pages([0, 1])
        with pytest.raises(PhysicalMemoryExhausted, match="budget"):
            s.map_pages([2, 3])  # 4 pages > 3: refused whole, nothing mapped
        assert s.mapped_bytes() == 2 * PAGE and record.snapshot().used == 2 * PAGE
        s.map_pages([2])
        assert record.snapshot().available == 0 and s.physical_available() == 0
        s.unmap_pages([0, 1, 2])
        assert record.snapshot().used == 0


def test_a_failed_map_keeps_the_charge_equal_to_what_is_mapped(tmp_path: Path) -> None:
    """A backend failure mid-batch: the batch is undone and its charge refunded."""
    with BudgetRecord(str(tmp_path / "b")) as record:
        slot = record.slot(rank=0, device="cpu")
        s = space(slot)
        s.map_pages([1])
        with pytest.raises(InvariantError, match="already mapped"):
            s.map_pages([0, 1])  # page 0 maps, page 1 fails: page 0 is unmapped again
        assert s.mapped_bytes() == PAGE and record.snapshot().used == PAGE


def test_two_processes_draw_on_one_limit(tmp_path: Path) -> None:
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        holder = start_holder(path, 3 * PAGE)
        try:
            s = space(record.slot(rank=0, device="cpu"))
            with pytest.raises(PhysicalMemoryExhausted):
                s.map_pages([0, 1])
            s.map_pages([0])
            holder.terminate()
            holder.wait(TIMEOUT)
            s.map_pages([1, 2, 3])  # the holder's charge went with it
            assert record.snapshot().used == 4 * PAGE
        finally:
            holder.kill()
            holder.wait(TIMEOUT)


# ---- liveness ---------------------------------------------------------------------------
def test_a_sigkilled_process_charge_is_reclaimed(tmp_path: Path) -> None:
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        holder = start_holder(path, 4 * PAGE)
        assert record.snapshot().used == 4 * PAGE
        holder.send_signal(signal.SIGKILL)
        holder.wait(TIMEOUT)
        assert record.snapshot().used == 0
        assert len(record.snapshot(include_dead=True).slots) == 1, "the dead slot is still in the file"
        record.set_limit(4 * PAGE)  # any transaction reclaims it
        assert record.snapshot(include_dead=True).slots == ()


def test_a_zombie_charge_is_reclaimed_before_it_is_reaped(tmp_path: Path) -> None:
    """The earlier record kept a killed engine's charge until its parent reaped it."""
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        holder = start_holder(path, 4 * PAGE)
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT
        while Path(f"/proc/{holder.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        try:
            assert record.snapshot().used == 0  # a zombie, not reaped, holds no charge
            assert record.slot(rank=0, device="cpu").charge(4 * PAGE)
        finally:
            holder.wait(TIMEOUT)


def test_a_reused_pid_does_not_keep_a_dead_charge(tmp_path: Path) -> None:
    """The slot's recorded PID now names a live process (PID reuse): its charge is still freed."""
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        holder = start_holder(path, 4 * PAGE)
        holder.kill()
        holder.wait(TIMEOUT)
        data = bytearray(path.read_bytes())
        state = kb._decode(bytes(data), str(path))
        dead = next(s for s in state.slots if s is not None)
        state.slots[dead.index] = kb.replace(dead, pid=os.getpid())  # a live PID, as if reused
        path.write_bytes(kb._encode(state))
        assert record.snapshot().used == 0


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_available(), reason="needs unshare --pid (root or user namespaces)")
def test_a_live_process_in_another_pid_namespace_keeps_its_charge(tmp_path: Path) -> None:
    """The earlier record took it for dead (its PID means nothing here), wiped its charge
    when another process attached, and then mapped 5 pages under a 4-page limit."""
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        # Some 400 processes first, so that the holder's PID there is one no process has here
        # (as the namespace's init it would be 1, which looks alive to a PID check).
        burn = 'for i in $(seq 1 400); do /bin/true; done; "$0" "$@"'
        holder = start_holder(path, 3 * PAGE, ("unshare", "--pid", "--fork", "--kill-child", "sh", "-c", burn))
        try:
            seen = record.snapshot().slots
            assert [s.charge for s in seen] == [3 * PAGE] and seen[0].pid > 400  # its own namespace's PID
            other = BudgetRecord(str(path))  # another process attaching reclaims only the dead
            s = space(other.slot(rank=0, device="cpu"))
            with pytest.raises(PhysicalMemoryExhausted):
                s.map_pages([0, 1])  # 3 + 2 > 4
            s.map_pages([0])
            assert record.snapshot().used == 4 * PAGE
            s.unmap_pages([0])
            other.close()
        finally:
            holder.kill()
            holder.wait(TIMEOUT)
        # The holder inside the namespace gets its SIGKILL (unshare's --kill-child) only
        # once unshare itself is gone: a moment later.
        deadline = time.monotonic() + TIMEOUT
        while record.snapshot().used:
            assert time.monotonic() < deadline
            time.sleep(0.01)


# ---- the global limit -------------------------------------------------------------------
def test_a_second_engine_cannot_silently_replace_the_limit(tmp_path: Path) -> None:
    path = str(tmp_path / "b")
    first = BudgetRecord(path, limit=4 * PAGE)
    first.slot(rank=0, device="cpu")
    with pytest.raises(BudgetConflict, match="kvctl limit --global"):
        BudgetRecord(path, limit=8 * PAGE)
    assert BudgetRecord(path).snapshot().limit == 4 * PAGE  # no limit asked: joins with it
    assert BudgetRecord(path, limit=4 * PAGE).snapshot().limit == 4 * PAGE  # the same: fine
    first.set_limit(8 * PAGE)  # what kvctl does: for everyone
    assert BudgetRecord(path).snapshot().limit == 8 * PAGE
    first.close()
    assert BudgetRecord(path, limit=2 * PAGE).snapshot().limit == 2 * PAGE  # nobody live: a new epoch


def test_a_default_limit_applies_only_with_nobody_live_and_only_lowers(tmp_path: Path) -> None:
    """A CPU host's derived budget (`kvcached.host`): it sets the limit of a record nobody
    holds, lowers a higher one left from before, keeps a lower one, and joins live engines'."""
    path = str(tmp_path / "b")
    assert BudgetRecord(path, default_limit=8 * PAGE).snapshot().limit == 8 * PAGE  # none before
    assert BudgetRecord(path, default_limit=16 * PAGE).snapshot().limit == 8 * PAGE  # lower stays
    assert BudgetRecord(path, default_limit=4 * PAGE).snapshot().limit == 4 * PAGE  # higher lowered
    with BudgetRecord(path) as live:
        live.slot(rank=0, device="cpu")
        assert BudgetRecord(path, default_limit=PAGE).snapshot().limit == 4 * PAGE, "live: joined"
    with pytest.raises(ConfigError, match="not both"):
        BudgetRecord(path, limit=PAGE, default_limit=PAGE)
    with pytest.raises(ConfigError, match=">= 0"):
        BudgetRecord(path, default_limit=-1)


def test_lowering_the_limit_below_usage_takes_nothing_and_refuses_more(tmp_path: Path) -> None:
    with BudgetRecord(str(tmp_path / "b"), limit=4 * PAGE) as record:
        s = space(record.slot(rank=0, device="cpu"))
        s.map_pages([0, 1, 2])
        record.set_limit(PAGE)
        assert record.snapshot().used == 3 * PAGE and record.snapshot().available == 0
        with pytest.raises(PhysicalMemoryExhausted):
            s.map_pages([3])
        s.unmap_pages([1, 2])
        with pytest.raises(PhysicalMemoryExhausted):
            s.map_pages([3])  # at the limit
        record.set_limit(None)
        s.map_pages([3])


def test_engine_rows_and_their_limits(tmp_path: Path) -> None:
    with BudgetRecord(str(tmp_path / "b")) as record:
        slot = record.slot(rank=0, device="cpu")
        row = record.engine("a", (slot.index,))
        with pytest.raises(ConfigError, match="already live"):
            record.engine("a", ())
        record.set_engine_limit("a", 2 * PAGE)
        snap = row.publish(mapped=PAGE, in_use=0, reserved=PAGE)
        info = snap.engine("a")
        assert info is not None and (info.limit, info.reserved, info.slots) == (2 * PAGE, PAGE, (slot.index,))
        with pytest.raises(ConfigError, match="no live engine named 'b'.*live: a"):
            record.set_engine_limit("b", PAGE)
    # A closed handle's rows and slots are gone for everyone.
    with BudgetRecord(str(tmp_path / "b")) as again:
        assert again.snapshot().engines == () and again.snapshot().slots == ()


# ---- validation -------------------------------------------------------------------------
def test_the_record_is_private_to_its_user(tmp_path: Path) -> None:
    path = tmp_path / "b"
    BudgetRecord(str(path)).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(BudgetRecordError, match="mode 644"):
        BudgetRecord(str(path))
    path.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 12345, 12345)
        with pytest.raises(BudgetRecordError, match="uid 12345"):
            BudgetRecord(str(path))


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "magic", "version", "empty-foreign"])
def test_a_damaged_record_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "b"
    with BudgetRecord(str(path), limit=4 * PAGE) as record:
        record.slot(rank=0, device="cpu").charge(PAGE)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[kb._HEADER.size + 8] ^= 0x40  # inside slot 0's charge: the checksum catches it
    elif damage == "truncate":
        data = data[:100]
    elif damage == "extend":
        data += b"\0"
    elif damage == "magic":
        data[:8] = b"NOTOURS!"
    elif damage == "version":
        struct.pack_into("<H", data, 8, kb.VERSION + 1)
    else:
        data = bytearray(b"\0" * len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(BudgetRecordError, match=str(path)):
        BudgetRecord(str(path))


def test_a_record_damaged_while_open_fails_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "b"
    record = BudgetRecord(str(path), limit=4 * PAGE)
    slot = record.slot(rank=0, device="cpu")
    os.truncate(path, 10)
    with pytest.raises(BudgetRecordError, match="truncated"):
        slot.charge(PAGE)
    with pytest.raises(BudgetRecordError):
        record.snapshot()
    record.close()  # silent even now


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        BudgetRecord(str(tmp_path / "b"), limit=-1)
    with pytest.raises(ConfigError, match="no budget record"):
        BudgetRecord(str(tmp_path / "missing"), create=False)
    with BudgetRecord(str(tmp_path / "b")) as record:
        with pytest.raises(ConfigError, match="at most 48"):
            record.engine("x" * 49, ())
        with pytest.raises(ConfigError):
            record.set_limit(-5)
        slot = record.slot(rank=0, device="cpu")
        with pytest.raises(InvariantError):
            slot.refund(1)  # never charged


# ---- fork -------------------------------------------------------------------------------
def test_a_forked_child_never_touches_the_parents_pages_or_charge(tmp_path: Path) -> None:
    """The earlier range, destroyed in a forked child, punched the parent's live page out of
    the shared memfd (zeroing it) and refunded the parent's charge."""
    from kvcached.memory import array_view

    record = BudgetRecord(str(tmp_path / "b"), limit=4 * PAGE)
    s = space(record.slot(rank=0, device="cpu"))
    s.map_pages([0])
    view = array_view(s.ranges[0], 0, PAGE)  # type: ignore[arg-type]
    view.fill(7)
    pid = os.fork()
    if pid == 0:  # the child: try everything, then drop it all
        code = 0
        try:
            try:
                s.unmap_pages([0])
                code = 10  # must have raised
            except InvariantError:
                pass
            try:
                s.ranges[0].close()  # type: ignore[attr-defined]
                code = 11
            except InvariantError:
                pass
            record.close()  # drops the child's descriptor only
            del view
            del s
            import gc

            gc.collect()  # the range's destructor runs here
        except Exception:  # noqa: BLE001 - the child reports any failure by its exit code
            code = 12
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(view.sum()) == 7 * PAGE and bool((view == 7).all())
    assert record.snapshot().used == PAGE and [x.charge for x in record.snapshot().slots] == [PAGE]
    s.unmap_pages([0])
    record.close()


def test_local_budget_is_the_same_protocol() -> None:
    budget = LocalBudget(2 * PAGE)
    s = space(budget)
    s.map_pages([0, 1])
    with pytest.raises(PhysicalMemoryExhausted):
        s.map_pages([2])
    budget.limit = 3 * PAGE
    s.map_pages([2])
    s.unmap_pages([0, 1, 2])
    assert budget.used == 0
