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


# A child that takes the steps it reads, one a line: "open LIMIT" opens the record with that
# limit ("-": none), "claim LIMIT" claims a slot asking for it; each is answered "ok <the
# record's limit>" or "conflict". Two of them interleave two engines' starts step by step.
STEPPER = textwrap.dedent("""
    import sys
    from kvcached.budget import BudgetConflict, BudgetRecord
    record = None
    for line in sys.stdin:
        step, arg = line.split()
        limit = None if arg == "-" else int(arg)
        try:
            if step == "open":
                record = BudgetRecord(sys.argv[1], limit=limit)
            elif limit is None:
                record.slot(rank=0, device="cpu")
            else:
                record.slot(rank=0, device="cpu", limit=limit)
            print("ok", record.snapshot().limit, flush=True)
        except BudgetConflict:
            print("conflict", flush=True)
""")


class Stepper:
    """A child process taking `STEPPER`'s steps when told."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", STEPPER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def do(self, step: str, limit: int | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{step} {'-' if limit is None else limit}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(TIMEOUT)


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


# A child caught closing its record between freeing its slot and dropping the slot's lock:
# the slot is free in the record, its lock still held (what an earlier close left for a
# moment, and what a record restored from before a claim shows).
MID_CLOSE = textwrap.dedent("""
    import fcntl, os, sys, time
    from kvcached import budget as kb
    fd = os.open(sys.argv[1], os.O_RDWR)
    kb._ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, kb._SLOT_LOCKS + 0)
    print("ready", flush=True)
    time.sleep(600)
""")

# A child whose close pauses at the write that frees its slot, until told to go on.
PAUSED_CLOSE = textwrap.dedent("""
    import os, sys
    from kvcached.budget import BudgetRecord
    record = BudgetRecord(sys.argv[1])
    print(record.slot(rank=0, device="cpu").index, flush=True)
    write = os.pwrite
    def paused(fd, data, offset):
        print("writing", flush=True)
        sys.stdin.readline()
        return write(fd, data, offset)
    sys.stdin.readline()
    os.pwrite = paused
    record.close()
    print("closed", flush=True)
""")


def test_a_claim_while_another_process_closes_takes_another_slot(tmp_path: Path) -> None:
    """A process claiming slot 0 while its last owner is mid-close (free in the record, the
    lock still held) got a bare OSError (EAGAIN from F_OFD_SETLK), and its worker failed to
    start. Now that slot is skipped, as the live entry it still is."""
    path = tmp_path / "b"
    BudgetRecord(str(path)).close()
    closing = subprocess.Popen([sys.executable, "-c", MID_CLOSE, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert closing.stdout is not None and closing.stdout.readline().strip() == "ready"
        with BudgetRecord(str(path)) as record:
            assert record.slot(rank=0, device="cpu").index == 1
    finally:
        closing.kill()
        closing.wait(TIMEOUT)
    with BudgetRecord(str(path)) as record:
        assert record.slot(rank=0, device="cpu").index == 0, "free again once its owner is gone"


def test_a_closing_process_drops_its_lock_before_its_slot_shows_free(tmp_path: Path) -> None:
    """`close` freed the slot in one transaction and dropped its lock after: in between, a
    claimer found the slot free and its lock taken. Now the write that frees it comes after
    the lock is dropped (checked from another process at that very write)."""
    path = tmp_path / "b"
    with BudgetRecord(str(path)) as watcher:
        child = subprocess.Popen([sys.executable, "-c", PAUSED_CLOSE, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        try:
            index = int(child.stdout.readline())
            assert kb._held_elsewhere(watcher._fd, kb._SLOT_LOCKS + index), "held while live"
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "writing"
            held = kb._held_elsewhere(watcher._fd, kb._SLOT_LOCKS + index)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "closed"
        finally:
            child.kill()
            child.wait(TIMEOUT)
        assert not held, "the slot's lock was still held when the record showed it free"
        assert watcher.snapshot(include_dead=True).slots == ()


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


GiB = 1 << 30


@pytest.mark.parametrize("order", ["A claims first", "B claims first", "open_slot's steps, B claims first"])
def test_a_concurrent_start_never_silently_replaces_a_limit(tmp_path: Path, order: str) -> None:
    """Engine A opens the record asking for 1 GiB and claims its slot in a later step;
    engine B, asking for 8 GiB, opens in between. Before, B's limit replaced A's and A ran
    under it. Now whichever claims second is refused with `BudgetConflict`, and the first
    runs under its own limit. The steps are driven one by one, in two processes."""
    path = tmp_path / "b"
    a, b = Stepper(path), Stepper(path)
    try:
        if order.startswith("open_slot"):  # `open_slot`: open asking nothing, ask at the claim
            assert a.do("open", None) == b.do("open", None) == "ok None"
            assert b.do("claim", 8 * GiB) == f"ok {8 * GiB}"
            assert a.do("claim", GiB) == "conflict"
        else:
            assert a.do("open", GiB) == f"ok {GiB}"
            assert b.do("open", 8 * GiB) == f"ok {8 * GiB}"  # nobody live yet: its ask stands, for now
            first, second, limit = (a, b, GiB) if order == "A claims first" else (b, a, 8 * GiB)
            assert first.do("claim", None) == f"ok {limit}"
            assert second.do("claim", None) == "conflict", "the second claimer is refused, not switched"
        with BudgetRecord(str(path)) as record:
            assert len(record.snapshot().slots) == 1, "only the first claimer is live"
    finally:
        a.close()
        b.close()


def test_a_stale_limit_never_caps_a_later_default_engine(tmp_path: Path) -> None:
    """A record outlives its engines (``/dev/shm``). An engine started with 1 GiB left it
    as the record's limit, and every later engine without an explicit limit was capped by
    it (a CPU engine's derived default was min(that, available memory)). Now with nobody
    live a claim starts a new epoch: its own default applies. A device limit set by hand
    (``kvctl limit --global``) still does."""
    path = tmp_path / "b"

    def an_earlier_run_with_1_gib() -> None:
        script = f"from kvcached.budget import open_slot; open_slot({str(path)!r}, {GiB}, 'cpu', rank=0)"
        run = subprocess.run([sys.executable, "-c", script], check=False, timeout=TIMEOUT)
        assert run.returncode == 0
        with BudgetRecord(str(path)) as record:
            assert record.snapshot().limit == GiB and record.snapshot().slots == (), "what the earlier run left"

    an_earlier_run_with_1_gib()
    opened = kb.open_slot(str(path), None, "cpu", rank=0, default_limit=8 * GiB)
    assert opened is not None
    record, _ = opened
    assert record.snapshot().limit == 8 * GiB, "the earlier run's 1 GiB is not inherited"
    record.close()
    an_earlier_run_with_1_gib()
    assert kb.expected_limit(str(path), "cpu", 8 * GiB) == 8 * GiB  # what the worker reports to vLLM
    gpu = kb.open_slot(str(path), None, "cpu", rank=0)  # no default (a GPU): no limit
    assert gpu is not None and gpu[0].snapshot().limit is None
    gpu[0].set_limit(2 * GiB)  # by hand: the device limit
    gpu[0].close()
    assert kb.expected_limit(str(path), "cpu", 8 * GiB) == 2 * GiB
    again = kb.open_slot(str(path), None, "cpu", rank=0, default_limit=8 * GiB)
    assert again is not None and again[0].snapshot().limit == 2 * GiB
    again[0].close()


def test_a_default_limit_applies_only_with_nobody_live_and_only_lowers(tmp_path: Path) -> None:
    """A CPU host's derived budget (`kvcached.host`), offered at the claim: it sets the limit
    of a record nobody holds, is lowered by a device limit (``kvctl limit --global``), and
    joins live engines'."""
    path = str(tmp_path / "b")
    with BudgetRecord(path) as first:
        first.slot(rank=0, device="cpu", default_limit=8 * PAGE)
        assert first.snapshot().limit == 8 * PAGE  # none before
        with BudgetRecord(path) as joining:
            joining.slot(rank=0, device="cpu", default_limit=PAGE)
            assert joining.snapshot().limit == 8 * PAGE, "live: joined"
        first.set_limit(4 * PAGE)  # kvctl: the live limit, and the device limit from now on
    with BudgetRecord(path) as later:
        later.slot(rank=0, device="cpu", default_limit=16 * PAGE)
        assert later.snapshot().limit == 4 * PAGE, "the device limit is lower: it stays"
    with BudgetRecord(path) as later:
        later.slot(rank=0, device="cpu", default_limit=2 * PAGE)
        assert later.snapshot().limit == 2 * PAGE, "the default is lower: it applies"
        assert later.snapshot().device_limit == 4 * PAGE, "and the device limit is kept for later"
    with pytest.raises(ConfigError, match="not both"):
        BudgetRecord(path).slot(rank=0, device="cpu", limit=PAGE, default_limit=PAGE)
    with pytest.raises(ConfigError, match=">= 0|within"):
        BudgetRecord(path).slot(rank=0, device="cpu", default_limit=-1)


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


def test_a_fresh_per_user_folder_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_BUDGET_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    opened = kb.open_slot(None, None, "cpu", rank=0)
    assert opened is not None
    opened[0].close()
    folder = tmp_path / f"kvcached-{os.geteuid()}"
    assert kb.default_path("host") == str(folder / "host.budget") and (folder / "host.budget").is_file()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("planted", ["another user's", "world-writable", "group-writable", "a symbolic link"])
def test_a_per_user_folder_someone_else_could_change_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                planted: str) -> None:
    """The default folder is a name in a world-writable folder (``/dev/shm``): another user
    could create it first, and then remove, rename or plant the records in it. It is
    refused, saying why, unless it is this user's alone."""
    monkeypatch.delenv("KVCACHED_BUDGET_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / f"kvcached-{os.geteuid()}"
    if planted == "a symbolic link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
        why = "symbolic link"
    else:
        folder.mkdir(mode=0o700)
        if planted == "another user's":
            if os.geteuid() != 0:
                pytest.skip("only root can give a folder away")
            os.chown(folder, 12345, 12345)
            why = "belongs to uid 12345"
        else:
            mode = 0o777 if planted == "world-writable" else 0o770
            folder.chmod(mode)
            why = f"mode {mode:o}"
    with pytest.raises(kb.BudgetFolderError, match=why):
        kb.open_slot(None, None, "cpu", rank=0)
    with pytest.raises(kb.BudgetFolderError, match=why):
        BudgetRecord(kb.default_path("host"), create=False)  # kvctl's read: refused alike
    assert not (tmp_path / "elsewhere" / "host.budget").exists(), "nothing was written through the link"


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
    """A tool's read (`snapshot`, what kvctl does) raises, naming the damage; a live slot's
    charge is refused instead (see tests/test_budget_degrades.py)."""
    path = tmp_path / "b"
    record = BudgetRecord(str(path), limit=4 * PAGE)
    slot = record.slot(rank=0, device="cpu")
    os.truncate(path, 10)
    with pytest.raises(BudgetRecordError, match="truncated"):
        record.snapshot()
    assert not slot.charge(PAGE) and record.failure is not None and "truncated" in record.failure
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


def test_a_reader_slow_in_its_liveness_queries_holds_no_charge_back(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader (kvtop, kvctl, a test's sampler) starved while it asks each entry's liveness
    must not hold the record: an engine's charge goes through meanwhile. The reader's liveness
    query is held on a gate (the seam ``_held_elsewhere``, for the reader's thread only); with the
    shared lock kept across those queries the charge waited for the gate (the sharing scenario
    beside a CPU hog, 12-05: an engine admitted nothing for 13 s)."""
    import threading

    path = tmp_path / "host.budget"
    engine = BudgetRecord(str(path), limit=1 << 20)
    slot = engine.slot(rank=0, device="cpu", label="engine")
    assert slot.charge(PAGE)
    reader = BudgetRecord(str(path), create=False)
    gate, asking = threading.Event(), threading.Event()
    held_elsewhere = kb._held_elsewhere

    def slow(fd: int, offset: int) -> bool:
        if threading.current_thread().name == "reader":
            asking.set()
            gate.wait(TIMEOUT)
        return held_elsewhere(fd, offset)

    monkeypatch.setattr(kb, "_held_elsewhere", slow)
    seen: list[int] = []
    read = threading.Thread(target=lambda: seen.append(reader.snapshot().used), name="reader")
    read.start()
    try:
        assert asking.wait(TIMEOUT)
        charged = threading.Thread(target=lambda: seen.append(int(slot.charge(PAGE))), name="engine")
        charged.start()
        charged.join(TIMEOUT)
        assert not charged.is_alive() and seen == [1], "the charge waited for the reader"
    finally:
        gate.set()
        read.join(TIMEOUT)
    assert seen == [1, PAGE] or seen == [1, 2 * PAGE]  # the reader's view: before or after the charge
    assert slot.charged == 2 * PAGE
    reader.close()
    engine.close()
