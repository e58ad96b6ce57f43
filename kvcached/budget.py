"""The budget record: one device's physical KV bytes, shared by every engine that maps there.

One small file per device (the CPU host, or one GPU) holds who is charged for what:

* **slots**, one per process that maps KV pages (a worker rank), each with the bytes it has
  mapped or is about to map (its *charge*). The record's usage is the sum of the live
  slots' charges; it is never stored, so it cannot disagree with them;
* **engine rows**, one per engine (its scheduler process), with the engine's name, its
  limit (set at run time by ``kvctl``), the slots of its ranks, and the in-use and
  reserved bytes it last published (for ``kvctl``/``kvtop``);
* the **global limit** (none, or bytes), which every charge is checked against, and the
  **device limit**: one set for the device by hand (``kvctl limit --global``), which
  outlives the engines.

Correctness rules, each the fix of a defect of an earlier design:

* **Liveness is a lock, not a PID.** A slot's (or row's) owner holds an open-file-description
  lock (``F_OFD_SETLK``) on that slot's byte, past the end of the file, for as long as it
  lives. The kernel drops it when the process dies in any way (SIGKILL, OOM kill; before it
  becomes a zombie), and a lock means the same in every PID namespace sharing the file, and
  whatever PIDs get reused. Whoever next changes the record reclaims dead entries first.
  An owner gives an entry up by freeing it and dropping its lock in one transaction (the
  lock first), and a claimer skips a free entry whose lock is still held: a claimer never
  meets a lock it cannot take.
* **The folder is the user's**: a record's folder (the per-user ``kvcached-<uid>`` one, or
  the folder of ``KVCACHED_BUDGET_PATH``) must be a real folder (not a symbolic link),
  owned by this user, and writable by nobody else, or it is refused with
  `BudgetFolderError`, saying which of these fails. It is opened ``O_NOFOLLOW |
  O_DIRECTORY`` and checked with ``fstat``, and the record is opened inside it.
* **Every read is validated**: a regular file owned by this user, mode 0600, the exact size,
  the magic, this layout's version, a CRC over the whole record, and sane fields. Anything
  else raises `BudgetRecordError`, naming the file and the problem: never a wrong number.
  Nothing is unpickled: the record is fixed binary fields (``struct``).
* **A running engine never crashes on the record**: while it cannot be read (truncated,
  foreign, another version) a live entry's operations degrade, all in `BudgetRecord._tolerant`:
  a charge is refused (`Slot.charge` returns False: a scheduling miss, so nothing grows),
  a refund is kept in the process (`Slot`'s charge is the truth) and written later, the
  bytes available are 0, and `EngineRow.publish` answers None, on which `EngineBudget`
  caps the engine at what it maps now. The handle's `failure` says why (logged once, and
  ``kvcached.stats()``'s ``budget_error``); ``kvctl`` reports the record unreadable. The
  first transaction that reads a valid record again writes this process's entries back
  as they are (its charges, its rows), and everything goes on as before.
* **Writes are whole-record** ``pwrite``\\ s under an exclusive ``flock`` (with a thread lock
  beside it: ``flock`` does not exclude threads sharing one open file).
* **The global limit belongs to the engines that live, and no one overrides it silently.**
  Settling the limit and claiming the slot is one transaction (`BudgetRecord.slot`):
  - with a live entry, a claim joins the live limit; one asking for another limit
    (``KVCACHED_BUDGET_BYTES``) is refused with `BudgetConflict`, so two engines started
    at once never both run, one under the other's limit: the first to claim wins;
  - with none live (a new *epoch*), the claim sets it: its explicit limit; else the lower
    of the device limit and its default limit (a CPU host's derived budget,
    `kvcached.host`); else the device limit, or none. The limit of an earlier epoch is
    never inherited: a record left in ``/dev/shm`` by an engine started with 1 GiB caps no
    later engine.
  ``kvctl limit --global`` (`set_limit`) changes the live limit for everyone and is the
  device limit from then on; opening a handle with a ``limit`` (no claim) asks the same
  as a device limit, and that handle's later claims ask it again.
* **A fork never touches the parent's charge**: a handle is bound to the process that opened
  it; in a forked child every operation raises `InvariantError` and closing it only drops
  the child's copy of the descriptor (which releases no lock: OFD locks go with the last
  descriptor of the open file description, the parent's).

The record is the *mechanism*: a charge either fits under the global limit or is refused
(`Slot.charge` returns False, and the caller reports `PhysicalMemoryExhausted`, a scheduling
miss). Per-engine limits are *policy*, enforced by the engine's own pool, which alone decides
what that engine maps (``kvcached.integration.vllm.block_pool``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import stat
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from kvcached.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    from typing_extensions import Self

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Record layout version; another version is refused, naming it.
VERSION = 3
MAGIC = b"KVCBUDGT"
NO_LIMIT = (1 << 64) - 1  # the on-disk value of "no limit"
#: The largest byte count the record holds (a limit, a charge): above it values are reserved
#: (`NO_LIMIT` means "no limit"), and a size at or above ``2**64`` cannot be stored at all.
#: The one bound: `kvcached.config` checks settings and the CLI's sizes against it.
MAX_BYTES = NO_LIMIT // 2
NUM_SLOTS = 64
NUM_ENGINES = 32
NAME_BYTES = 48

# header: magic, version, header bytes, slots, engines, owner uid, limit, generation, crc,
# device limit + 1 (0: none; it lies in what version 3 first wrote as zero padding, so a
# record written before it has no device limit), padding
_HEADER = struct.Struct("<8sHHHHIQQIQ12x")
# slot: used, rank, pid (informational: the owner's own namespace), charge, started, device, label
_SLOT = struct.Struct("<B3xiIQd16s48s")
# engine: used, pid, limit, mapped, in_use, reserved, slot mask, updated, name
_ENGINE = struct.Struct("<B3xIQQQQQd48s")
_SLOTS_AT = _HEADER.size
_ENGINES_AT = _SLOTS_AT + NUM_SLOTS * _SLOT.size
RECORD_BYTES = _ENGINES_AT + NUM_ENGINES * _ENGINE.size
_CRC_AT = _HEADER.size - 24  # offset of the crc field inside the header
# Lock bytes lie past the end of the file: a lock there guards nothing but liveness.
_SLOT_LOCKS = RECORD_BYTES + 64
_ENGINE_LOCKS = _SLOT_LOCKS + NUM_SLOTS


class BudgetRecordError(ConfigError):
    """The budget record is corrupt, truncated, foreign or of another layout version."""


class BudgetFolderError(ConfigError):
    """The folder of a budget record is not this user's alone (another owner, writable by
    others, a symbolic link, or not a folder)."""


class BudgetConflict(ConfigError):
    """An engine asked for a global limit other than the one live engines share."""


# ---- the record's contents ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One mapping process. ``pid`` is as that process saw itself (its PID namespace)."""

    index: int
    rank: int
    pid: int
    charge: int
    started: float
    device: str
    label: str


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One engine. ``limit`` None: no limit of its own. Byte counts are what it last published."""

    index: int
    name: str
    pid: int
    limit: int | None
    mapped: int
    in_use: int
    reserved: int
    slots: tuple[int, ...]
    updated: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A validated read of the record (live entries only). ``device_limit``: the limit set
    for the device by hand, which a new epoch starts from (see the module docstring)."""

    path: str
    limit: int | None
    generation: int
    slots: tuple[SlotInfo, ...]
    engines: tuple[EngineInfo, ...]
    device_limit: int | None = None

    @property
    def used(self) -> int:
        return sum(s.charge for s in self.slots)

    @property
    def available(self) -> int | None:
        """Bytes still chargeable under the global limit; None: no limit."""
        return None if self.limit is None else max(0, self.limit - self.used)

    def engine(self, name: str) -> EngineInfo | None:
        return next((e for e in self.engines if e.name == name), None)

    def charge_of(self, engine: EngineInfo) -> int:
        """Bytes charged by the engine's ranks' slots."""
        return sum(s.charge for s in self.slots if s.index in engine.slots)


@dataclass
class _State:
    """The record decoded for one transaction (free entries are None)."""

    limit: int | None
    generation: int
    slots: list[SlotInfo | None] = field(default_factory=lambda: [None] * NUM_SLOTS)
    engines: list[EngineInfo | None] = field(default_factory=lambda: [None] * NUM_ENGINES)
    device_limit: int | None = None

    def copy(self) -> _State:
        return replace(self, slots=list(self.slots), engines=list(self.engines))

    @property
    def live(self) -> bool:
        """Whether any entry is live (call after dead ones are dropped)."""
        return any(self.slots) or any(self.engines)

    def snapshot(self, path: str) -> Snapshot:
        return Snapshot(path, self.limit, self.generation, tuple(s for s in self.slots if s),
                        tuple(e for e in self.engines if e), self.device_limit)


def _check_limit(value: int | None, what: str = "a budget limit") -> None:
    if value is not None and not 0 <= value <= MAX_BYTES:
        raise ConfigError(f"{what} must be within [0, {MAX_BYTES}] bytes, got {value}")


def _conflict(path: str, live: int | None, asked: int) -> BudgetConflict:
    return BudgetConflict(
        f"budget record {path}: live engines share the limit {_bytes(live)}, this one asks for {_bytes(asked)}; "
        "unset KVCACHED_BUDGET_BYTES to join with theirs, or change it for all with `kvctl limit --global BYTES`")


def _claimed_limit(state: _State, *, limit: int | None, default_limit: int | None, path: str) -> int | None:
    """The global limit a slot claimed now is under (the rule of the module docstring):
    the live one (another ``limit`` is a `BudgetConflict`), else the new epoch's."""
    if state.live:
        if limit is not None and limit != state.limit:
            raise _conflict(path, state.limit, limit)
        return state.limit
    return limit if limit is not None else _epoch_default(state.device_limit, default_limit)


def _epoch_default(device_limit: int | None, default_limit: int | None) -> int | None:
    """A new epoch's limit without an explicit one: the lower of the device limit and the
    claimer's default limit, either if only one is set, or none."""
    known = [x for x in (device_limit, default_limit) if x is not None]
    return min(known) if known else None


def _text(raw: bytes, what: str, path: str) -> str:
    try:
        return raw.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise BudgetRecordError(f"budget record {path}: {what} is not UTF-8 (corrupt record)") from None


def _fit(text: str, what: str, size: int = NAME_BYTES) -> bytes:
    raw = text.encode()
    if len(raw) > size or "\0" in text:
        raise ConfigError(f"{what} {text!r} must be at most {size} UTF-8 bytes, without NUL")
    return raw


def _decode(data: bytes, path: str) -> _State:
    if len(data) != RECORD_BYTES:
        raise BudgetRecordError(f"budget record {path} is {len(data)} bytes, expected {RECORD_BYTES} (truncated?)")
    magic, version, hdr, nslots, nengines, _uid, limit, gen, crc, device_limit = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BudgetRecordError(f"{path} is not a kvcached budget record (bad magic)")
    if version != VERSION:
        raise BudgetRecordError(f"budget record {path} has layout version {version}; this kvcached reads "
                                f"version {VERSION} (stop the engines of the other version, then remove it)")
    if (hdr, nslots, nengines) != (_HEADER.size, NUM_SLOTS, NUM_ENGINES):
        raise BudgetRecordError(f"budget record {path}: unexpected layout ({hdr}, {nslots}, {nengines})")
    if zlib.crc32(data[:_CRC_AT] + b"\0\0\0\0" + data[_CRC_AT + 4:]) != crc:
        raise BudgetRecordError(f"budget record {path} fails its checksum (corrupt record)")
    state = _State(None if limit == NO_LIMIT else limit, gen, device_limit=device_limit - 1 if device_limit else None)
    # Only live entries are unpacked: their "used" bytes, read in one slice, say which.
    for i in _used(data, _SLOTS_AT, _SLOT.size, NUM_SLOTS, "slot", path):
        _, rank, pid, charge, started, dev, label = _SLOT.unpack_from(data, _SLOTS_AT + i * _SLOT.size)
        if charge > MAX_BYTES:
            raise BudgetRecordError(f"budget record {path}: slot {i} is corrupt")
        state.slots[i] = SlotInfo(i, rank, pid, charge, started, _text(dev, "a device", path),
                                  _text(label, "a label", path))
    for i in _used(data, _ENGINES_AT, _ENGINE.size, NUM_ENGINES, "engine row", path):
        _, pid, lim, mapped, in_use, reserved, mask, updated, name = _ENGINE.unpack_from(
            data, _ENGINES_AT + i * _ENGINE.size)
        if mask >> NUM_SLOTS:
            raise BudgetRecordError(f"budget record {path}: engine row {i} is corrupt")
        slots = tuple(s for s in range(NUM_SLOTS) if mask >> s & 1)
        state.engines[i] = EngineInfo(i, _text(name, "an engine name", path), pid,
                                      None if lim == NO_LIMIT else lim, mapped, in_use, reserved, slots, updated)
    return state


def _used(data: bytes, at: int, size: int, count: int, what: str, path: str) -> list[int]:
    """Indices of the live entries of a table (each entry's first byte: 0 free, 1 live)."""
    flags = data[at:at + count * size:size]
    if flags.count(0) + flags.count(1) != count:
        bad = next(i for i, f in enumerate(flags) if f > 1)
        raise BudgetRecordError(f"budget record {path}: {what} {bad} is corrupt")
    return [i for i, f in enumerate(flags) if f]


_FREE_SLOT, _FREE_ENGINE = bytes(_SLOT.size), bytes(_ENGINE.size)


@functools.lru_cache(maxsize=4 * (NUM_SLOTS + NUM_ENGINES))
def _slot_bytes(s: SlotInfo) -> bytes:
    return _SLOT.pack(1, s.rank, s.pid, s.charge, s.started, _fit(s.device, "device", 16), _fit(s.label, "label"))


@functools.lru_cache(maxsize=4 * (NUM_SLOTS + NUM_ENGINES))
def _engine_bytes(e: EngineInfo) -> bytes:
    return _ENGINE.pack(1, e.pid, NO_LIMIT if e.limit is None else e.limit, e.mapped, e.in_use, e.reserved,
                        sum(1 << s for s in e.slots), e.updated, _fit(e.name, "engine name"))


def _encode(state: _State) -> bytes:
    """The record's bytes (entries are immutable, so each one's bytes are packed once)."""
    limit = NO_LIMIT if state.limit is None else state.limit
    device_limit = 0 if state.device_limit is None else state.device_limit + 1
    out = bytearray(_HEADER.pack(MAGIC, VERSION, _HEADER.size, NUM_SLOTS, NUM_ENGINES, os.geteuid(), limit,
                                 state.generation, 0, device_limit))
    out += b"".join(_FREE_SLOT if s is None else _slot_bytes(s) for s in state.slots)
    out += b"".join(_FREE_ENGINE if e is None else _engine_bytes(e) for e in state.engines)
    struct.pack_into("<I", out, _CRC_AT, zlib.crc32(out))
    return bytes(out)


# ---- liveness locks ----------------------------------------------------------------------
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid)


def _ofd(fd: int, cmd: int, kind: int, offset: int) -> int:
    """One OFD lock call on byte ``offset``; returns the lock type (F_OFD_GETLK's answer)."""
    got = fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
    return int(_FLOCK.unpack(got)[0])


def _held_elsewhere(fd: int, offset: int) -> bool:
    """Whether another open file description holds the lock byte ``offset`` (a live owner)."""
    return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset) != fcntl.F_UNLCK


def _try_lock(fd: int, offset: int) -> bool:
    """Take the lock byte ``offset``; False if another open file description holds it."""
    try:
        _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


# ---- where records live ------------------------------------------------------------------
def default_dir() -> str:
    """Where the default records live: ``$KVCACHED_BUDGET_DIR``, else a per-user folder
    under ``$XDG_RUNTIME_DIR``, else ``/dev/shm``, else the temp directory."""
    if explicit := os.environ.get("KVCACHED_BUDGET_DIR"):
        return explicit
    base = os.environ.get("XDG_RUNTIME_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(base, f"kvcached-{os.geteuid()}")


def default_path(device: str) -> str:
    """The default record of ``device`` (a `device_key`: ``host`` or a GPU's UUID)."""
    return os.path.join(default_dir(), f"{device}.budget")


def _open_folder(folder: str, path: str) -> int:
    """A descriptor of ``folder`` (the folder of the record ``path``) once it is known to be
    this user's alone: not a symbolic link, owned by this user, writable by no one else
    (`BudgetFolderError` otherwise). Another user who owned or could write the folder could
    remove, rename or plant the records in it."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"no budget record at {path} (no engine has opened it yet)") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise BudgetFolderError(f"the budget folder {folder} is a symbolic link or not a folder; records are "
                                    "kept only in a real folder of this user's (remove it, or set "
                                    "KVCACHED_BUDGET_DIR)") from None
        raise BudgetFolderError(f"cannot open the budget folder {folder}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise BudgetFolderError(f"the budget folder {folder} belongs to uid {st.st_uid}, not to this user "
                                    f"(uid {os.geteuid()}): its owner could replace the records in it (remove it, "
                                    "or set KVCACHED_BUDGET_DIR to a folder of your own)")
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise BudgetFolderError(f"the budget folder {folder} has mode {stat.S_IMODE(st.st_mode):o}: other users "
                                    "could replace the records in it; it must be writable by its owner alone "
                                    "(chmod 700)")
    except BaseException:
        os.close(fd)
        raise
    return fd


_open_records: weakref.WeakSet[BudgetRecord] = weakref.WeakSet()


def _forget_in_child() -> None:
    for record in list(_open_records):
        record._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class BudgetRecord:
    """An open handle on one budget record (one per process and file is enough).

    `snapshot` reads; `slot`, `engine`, `set_limit` and `set_engine_limit` change it, each
    one all-or-nothing transaction. Entries this handle owns (its slots and engine rows)
    stay alive while it is open; `close` gives them up (their charges go with them).

    Invariant: the handle keeps each entry it owns as it should stand (``_owned_*``: a
    slot's charge is the bytes its process has charged and not refunded), holds that
    entry's lock, and every transaction that reads the record writes those entries back
    where they differ (a record restored after a failure gets them again).
    """

    def __init__(self, path: str, *, limit: int | None = None, create: bool = True) -> None:
        """Open (or, with ``create``, create) the record at ``path``.

        ``limit``: a global limit for the device (None: none asked). With a live entry it
        must equal the record's (`BudgetConflict`); with none it becomes the record's limit
        and its device limit. This handle's claims ask it again (`slot`).
        """
        _check_limit(limit)
        self.path = path
        #: Why the record could not be read at a live entry's last try (None: it could).
        self.failure: str | None = None
        self._asked = limit
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._owned_slots: dict[int, SlotInfo] = {}
        self._owned_engines: dict[int, EngineInfo] = {}
        self._decoded: tuple[bytes, _State] | None = None  # the last bytes read, validated and decoded
        self._fd = self._open(path, create)
        # A handle dropped without `close` still closes its descriptor (its locks go, so
        # its entries are reclaimed by the next transaction).
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        try:
            with self._transaction() as state:
                if limit is not None and state.live and limit != state.limit:
                    raise _conflict(path, state.limit, limit)
                if limit is not None and not state.live:
                    state.limit = state.device_limit = limit
        except BaseException:
            self._finalizer()
            raise
        _open_records.add(self)

    @staticmethod
    def _open(path: str, create: bool) -> int:
        folder = os.path.dirname(path) or "."
        if create:
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            except OSError as e:
                raise BudgetFolderError(f"cannot make the budget folder {folder}: {e.strerror}") from None
        dir_fd = _open_folder(folder, path)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(os.path.basename(path), flags | (os.O_CREAT if create else 0), 0o600, dir_fd=dir_fd)
        except FileNotFoundError:
            raise ConfigError(f"no budget record at {path} (no engine has opened it yet)") from None
        except OSError as e:
            raise BudgetRecordError(f"cannot open the budget record {path}: {e.strerror}") from None
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                st = os.fstat(fd)
                if st.st_size == 0 and create and st.st_uid == os.geteuid():  # new: ours by creation
                    os.pwrite(fd, _encode(_State(None, 0)), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ---- reading ------------------------------------------------------------------------
    def _read(self) -> _State:
        return self._state_of(self._read_bytes())

    def _read_bytes(self) -> bytes:
        """The record's bytes, after checking the file is the user's private regular file."""
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            raise BudgetRecordError(f"budget record {self.path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise BudgetRecordError(f"budget record {self.path} belongs to uid {st.st_uid}, not to this user "
                                    f"(uid {os.geteuid()}); engines sharing a budget must run as one user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise BudgetRecordError(f"budget record {self.path} has mode {stat.S_IMODE(st.st_mode):o}; it must be "
                                    "private to its user (0600)")
        return os.pread(self._fd, RECORD_BYTES + 1, 0)

    def _state_of(self, data: bytes) -> _State:
        """``data`` decoded (the last decoding reused for the same bytes), as a copy to change."""
        if self._decoded is None or data != self._decoded[0]:
            self._decoded = (data, _decode(data, self.path))  # the same bytes decode the same
        return self._decoded[1].copy()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise InvariantError(f"budget record {self.path} was opened by process {self._pid}; a forked child "
                                 "must not change its charges (open a record of its own)")
        if self._fd < 0:
            raise InvariantError(f"budget record {self.path} is closed")

    def snapshot(self, *, include_dead: bool = False) -> Snapshot:
        """The record now, validated, with dead entries left out (nothing is changed).

        ``include_dead``: every entry the file holds, those of processes that are gone too
        (they are reclaimed by the next transaction; tests check that a clean exit left none).
        """
        self._check_process()
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                data = self._read_bytes()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            # A reader (kvtop, kvctl, a sampler) holds the shared lock for one read only: every
            # engine's next charge waits for it. Decoding, and liveness (each entry's own byte
            # lock, not the record's), come after it is gone.
            state = self._state_of(data)
            if not include_dead:
                self._drop_dead(state)
        return state.snapshot(self.path)

    def current(self) -> Snapshot | None:
        """The record as a live entry sees it (one transaction, so a record readable again
        gets this handle's entries back); None while it cannot be read (`failure` says why)."""
        state = self._tolerant(lambda state: state, None)  # as written: its generation is the record's
        return None if state is None else state.snapshot(self.path)

    def _drop_dead(self, state: _State) -> bool:
        """Forget entries whose owner is gone (no lock on their byte); True if any was."""
        changed = False
        for i, s in enumerate(state.slots):
            if s is not None and i not in self._owned_slots and not _held_elsewhere(self._fd, _SLOT_LOCKS + i):
                state.slots[i] = None
                changed = True
        for i, e in enumerate(state.engines):
            if e is not None and i not in self._owned_engines and not _held_elsewhere(self._fd, _ENGINE_LOCKS + i):
                state.engines[i] = None
                changed = True
        return changed

    def _restore_owned(self, state: _State) -> None:
        """Put this handle's entries back as they stand: its slots as its process charged
        them (nobody else writes a slot), its rows where missing (kvctl may change a row's
        limit, so a row that is there is taken as it is)."""
        for i, mine in self._owned_slots.items():
            state.slots[i] = mine
        for i, row in self._owned_engines.items():
            if state.engines[i] is None:
                state.engines[i] = row

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_State]:
        """Exclusive read-modify-write; dead entries are reclaimed and this handle's own
        are set right first. Writes only if something changed and the body returned
        normally (a raising body changes nothing); once written (or unchanged), the owned
        entries are taken from what the record now holds."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                state = self._read()
                reclaimed = self._drop_dead(state)
                before = state.copy()
                self._restore_owned(state)
                yield state
                if reclaimed or state != before:
                    state.generation += 1
                    data = _encode(state)
                    os.pwrite(self._fd, data, 0)
                    self._decoded = (data, state.copy())
                self._owned_slots = {i: state.slots[i] or mine for i, mine in self._owned_slots.items()}
                self._owned_engines = {i: state.engines[i] or row for i, row in self._owned_engines.items()}
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _tolerant(self, change: Callable[[_State], _T], unreadable: _T) -> _T:
        """``change`` in one transaction, for a live entry of a running engine: the one place
        where the record being unreadable (corrupt, truncated, foreign, unwritable) is met.
        Then nothing is changed, `failure` says why (logged once) and ``unreadable`` is the
        answer; the next transaction that succeeds clears it (logged), having written this
        handle's entries back (`_restore_owned`)."""
        self._check_process()
        try:
            with self._transaction() as state:
                result = change(state)
        except (BudgetRecordError, OSError) as e:
            why = str(e) if isinstance(e, BudgetRecordError) else f"budget record {self.path}: {e.strerror}"
            if self.failure is None:
                _logger.warning("kvcached: %s; this process keeps what it has mapped and maps no more until the "
                                "record can be read again", why)
            self.failure = why
            return unreadable
        if self.failure is not None:
            _logger.warning("kvcached: budget record %s can be read again; this process's entries are written "
                            "back (was: %s)", self.path, self.failure)
            self.failure = None
        return result

    # ---- changing it ----------------------------------------------------------------------
    def set_limit(self, limit: int | None) -> None:
        """Set (or with None clear) the global limit, for every engine sharing the record,
        and the device limit (what the next epoch starts from; see the module docstring).

        Lowering it below the usage takes nothing back by itself: each engine over it gives
        back its idle memory at its next step, and no charge fits until usage is under it.
        """
        _check_limit(limit)
        self._check_process()
        with self._transaction() as state:
            state.limit = state.device_limit = limit

    def set_engine_limit(self, name: str, limit: int | None) -> EngineInfo:
        """Set (None: clear) the limit of the live engine ``name``; raises ConfigError if none."""
        _check_limit(limit, "an engine limit")
        self._check_process()
        with self._transaction() as state:
            for i, e in enumerate(state.engines):
                if e is not None and e.name == name:
                    state.engines[i] = replace(e, limit=limit)
                    return state.engines[i]  # type: ignore[return-value]
            names = sorted(e.name for e in state.engines if e)
            raise ConfigError(f"no live engine named {name!r} in {self.path} (live: {', '.join(names) or 'none'})")

    def slot(self, *, rank: int, device: str, label: str = "", limit: int | None = None,
             default_limit: int | None = None) -> Slot:
        """Claim a slot for this process's charges (it lives until `Slot.close` or death),
        settling the global limit in the same transaction: ``limit`` (else the one this
        handle was opened with) is this process's explicit ask, ``default_limit`` what is
        safe without one (a CPU host's derived budget, `kvcached.host`). The rule is the
        module docstring's: with a live entry the claim joins (another explicit limit is a
        `BudgetConflict`, and nothing is claimed); with none, it starts a new epoch."""
        _check_limit(limit)
        _check_limit(default_limit, "a default budget limit")
        asked = self._asked if limit is None else limit
        if asked is not None and default_limit is not None:
            raise ConfigError("claim a budget slot asking for a limit or for a default limit, not both")
        self._check_process()
        _fit(device, "device", 16)
        _fit(label, "label")

        def claim(state: _State) -> int:
            state.limit = _claimed_limit(state, limit=asked, default_limit=default_limit, path=self.path)
            index = self._lock_free(state.slots, _SLOT_LOCKS, "slots are held by live processes")
            self._owned_slots[index] = SlotInfo(index, rank, os.getpid(), 0, time.time(), device, label)
            state.slots[index] = self._owned_slots[index]
            return index

        return Slot(self, self._claim(claim, self._owned_slots, _SLOT_LOCKS))

    def engine(self, name: str, slots: tuple[int, ...]) -> EngineRow:
        """Register the engine ``name`` whose ranks charge ``slots``; a live engine of that
        name is a `ConfigError` (names identify engines for ``kvctl``)."""
        self._check_process()
        _fit(name, "engine name")

        def claim(state: _State) -> int:
            if any(e is not None and e.name == name for e in state.engines):
                raise ConfigError(f"an engine named {name!r} is already live in {self.path}; "
                                  "give this one another KVCACHED_ENGINE_NAME")
            index = self._lock_free(state.engines, _ENGINE_LOCKS, "engine rows are live")
            self._owned_engines[index] = EngineInfo(index, name, os.getpid(), None, 0, 0, 0, tuple(sorted(slots)),
                                                    time.time())
            state.engines[index] = self._owned_engines[index]
            return index

        return EngineRow(self, self._claim(claim, self._owned_engines, _ENGINE_LOCKS), name)

    def _claim(self, claim: Callable[[_State], int], owned: dict[int, SlotInfo] | dict[int, EngineInfo],
               locks: int) -> int:
        """One transaction running ``claim`` (which locks and records an entry); if the
        transaction then fails, the entry and its lock are given up again."""
        taken: list[int] = []
        with self._lock:
            try:
                with self._transaction() as state:
                    taken.append(claim(state))
            except BaseException:
                for index in taken:
                    owned.pop(index, None)
                    self._release(locks + index)
                raise
        return taken[0]

    def _lock_free(self, entries: list[SlotInfo | None] | list[EngineInfo | None], locks: int, full: str) -> int:
        """Lock the first free entry nobody else holds the lock of, and return its index.

        A free entry whose lock is held elsewhere has a live owner whose entry the record
        does not show (an older kvcached between freeing it and unlocking, or a record
        restored from before it claimed): it is not free, and is skipped."""
        for i, entry in enumerate(entries):
            if entry is None and _try_lock(self._fd, locks + i):
                return i
        raise BudgetRecordError(f"budget record {self.path}: all {len(entries)} {full}")

    def _release(self, offset: int) -> None:
        with contextlib.suppress(OSError):
            _ofd(self._fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset)

    def _release_owned(self) -> None:
        """Drop every owned entry's lock and forget the entries."""
        for i in self._owned_slots:
            self._release(_SLOT_LOCKS + i)
        for i in self._owned_engines:
            self._release(_ENGINE_LOCKS + i)
        self._owned_slots.clear()
        self._owned_engines.clear()

    def _forked(self) -> None:
        """In a forked child: drop this copy of the descriptor, never the parent's locks."""
        if self._fd >= 0 and os.getpid() != self._pid:
            with contextlib.suppress(OSError):
                self._finalizer()  # this copy only: the parent's descriptor keeps the locks
            self._fd = -1
            self._owned_slots.clear()
            self._owned_engines.clear()

    def close(self) -> None:
        """Give up every entry this handle owns and close it (idempotent; silent).

        The entries are freed and their locks dropped in one transaction, the locks first:
        whoever next finds an entry free can take its lock."""
        if self._fd < 0:
            return
        if os.getpid() != self._pid:
            self._forked()
            return
        with self._lock:
            # A record that cannot be read: its entries die with the locks, dropped below.
            with contextlib.suppress(BudgetRecordError, OSError), self._transaction() as state:
                for i in self._owned_slots:
                    state.slots[i] = None
                for i in self._owned_engines:
                    state.engines[i] = None
                self._release_owned()
            self._release_owned()
            self._finalizer()
            self._fd = -1
        _open_records.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class Slot:
    """This process's charges in one record (see `BudgetRecord.slot`). While the record
    cannot be read, charges are refused and refunds kept here, written back once it can
    (`BudgetRecord._tolerant`); none of these raises `BudgetRecordError`."""

    record: BudgetRecord
    index: int

    @property
    def charged(self) -> int:
        """Bytes this slot holds charged (this process's truth, even while the record is unreadable)."""
        return self.record._owned_slots[self.index].charge

    def charge(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if they fit under the global limit; False (nothing charged) if
        not, or if the record cannot be read (`BudgetRecord.failure` says why)."""
        if nbytes < 0:
            raise InvariantError(f"charge({nbytes})")

        def fits(state: _State) -> bool:
            used = sum(s.charge for s in state.slots if s)
            if state.limit is not None and used + nbytes > state.limit:
                return False
            mine = self._mine(state)
            state.slots[self.index] = replace(mine, charge=mine.charge + nbytes)
            return True

        return self.record._tolerant(fits, False)

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` of this slot's charge (more than it holds is an `InvariantError`).
        The refund stands even if the record cannot be written now (it is, once it can)."""
        record = self.record
        record._check_process()
        with record._lock:
            mine = record._owned_slots.get(self.index)
            if mine is None:
                raise InvariantError(f"budget record {record.path}: slot {self.index} is not held")
            if not 0 <= nbytes <= mine.charge:
                raise InvariantError(f"refund of {nbytes} bytes from slot {self.index} charged {mine.charge}")
            record._owned_slots[self.index] = replace(mine, charge=mine.charge - nbytes)
            record._tolerant(lambda state: None, None)  # writes the owned entry as it now stands

    def available(self) -> int | None:
        """Bytes still chargeable under the global limit (None: no limit; 0 while the
        record cannot be read: nothing may be charged then)."""
        snap = self.record.current()
        return 0 if snap is None else snap.available

    def _mine(self, state: _State) -> SlotInfo:
        mine = state.slots[self.index]
        if mine is None or self.index not in self.record._owned_slots:
            raise InvariantError(f"budget record {self.record.path}: slot {self.index} is not held")
        return mine


@dataclass(eq=False)
class EngineRow:
    """An engine's row (see `BudgetRecord.engine`): its limit, and what it publishes."""

    record: BudgetRecord
    index: int
    name: str

    def publish(self, *, mapped: int, in_use: int, reserved: int) -> Snapshot | None:
        """Record the engine's bytes now; returns the record as it stands (one transaction),
        or None while the record cannot be read (`BudgetRecord.failure` says why)."""

        def write(state: _State) -> _State:
            mine = state.engines[self.index]
            if mine is None or self.index not in self.record._owned_engines:
                raise InvariantError(f"budget record {self.record.path}: engine row {self.index} is not held")
            state.engines[self.index] = replace(mine, mapped=mapped, in_use=in_use, reserved=reserved,
                                                updated=time.time())
            return state

        written = self.record._tolerant(write, None)  # as written: its generation is the record's
        return None if written is None else written.snapshot(self.record.path)


class LocalBudget:
    """A budget of this process alone (tests, probes): the `Charger` protocol over a counter.

    ``limit`` may be changed at any time; lowering it below ``used`` takes nothing back, it
    only refuses charges until usage is under it (as the shared record does).
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 0:
            raise ConfigError(f"a budget limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> bool:
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def refund(self, nbytes: int) -> None:
        with self._lock:
            if not 0 <= nbytes <= self.used:
                raise InvariantError(f"refund of {nbytes} bytes from a budget charged {self.used}")
            self.used -= nbytes

    def available(self) -> int | None:
        with self._lock:
            return None if self.limit is None else max(0, self.limit - self.used)


def _bytes(n: int | None) -> str:
    return "none" if n is None else f"{n} bytes"


def device_key(device: str) -> str:
    """The record name of a device: ``host`` for the CPU (one host budget), else the GPU's UUID
    (the same in every process, whatever ``CUDA_VISIBLE_DEVICES`` renumbers)."""
    if device == "cpu":
        return "host"
    from kvcached import _vmm

    index = 0 if device == "cuda" else int(device.partition(":")[2])
    return _vmm.cuda_device_uuid(index).lower()


def record_path(budget_path: str | None, device: str) -> str | None:
    """Where ``device``'s record lives: ``KVCACHED_BUDGET_PATH`` (``off``: nowhere, no sharing),
    else the per-user default (`default_path`)."""
    if budget_path == "off":
        return None
    return budget_path or default_path(device_key(device))


def open_slot(budget_path: str | None, limit: int | None, device: str, *, rank: int,
              label: str = "", default_limit: int | None = None) -> tuple[BudgetRecord, Slot] | None:
    """Open ``device``'s record and claim a slot there for this process, asking for the
    global ``limit`` (or offering ``default_limit``) in the claim's transaction (see
    `BudgetRecord.slot`); None when budgets are off. All or nothing."""
    path = record_path(budget_path, device)
    if path is None:
        return None
    record = BudgetRecord(path)
    try:
        return record, record.slot(rank=rank, device=device[:16], label=label, limit=limit,
                                   default_limit=default_limit)
    except BaseException:
        record.close()
        raise


def expected_limit(budget_path: str | None, device: str, default_limit: int | None) -> int | None:
    """The global limit a slot claimed now on ``device`` without an explicit limit would be
    under (`BudgetRecord.slot`'s rule): the live engines' limit, else the lower of the device
    limit and ``default_limit``. None: no limit, or budgets off. Changes nothing."""
    path = record_path(budget_path, device)
    if path is None:
        return None
    if not os.path.exists(path):
        return default_limit
    with BudgetRecord(path, create=False) as record:
        snap = record.snapshot()
    return snap.limit if snap.slots or snap.engines else _epoch_default(snap.device_limit, default_limit)


# ---- an engine's side: its limit in, its bytes out ---------------------------------------
#: How often an engine reads its limits and publishes its bytes (its pool's `collect`).
POLL_S = 0.1


@dataclass(eq=False)
class EngineShare:
    """One engine's row in one device's record. ``page_bytes``: what one kv page of the
    engine costs on that device (the kv page's bytes on each rank there, times those ranks)."""

    row: EngineRow
    page_bytes: int


class EngineBudget:
    """An engine's rows on the devices it maps on: the limits its pool must keep, in kv pages.

    `poll` (the pool calls it after every step) publishes the engine's bytes and reads its
    rows at most every `POLL_S`, or at once when pages were given back (so ``kvctl`` sees
    an idle engine as it is). The answer is the most kv pages the engine may have mapped:
    its own limit on each device, and, while a device's usage is over the global limit,
    what it maps now less that excess (every engine there gives back idle memory until
    the device is under it); while a record cannot be read, what it maps now (it keeps
    serving on that, grows no more, and `failure` says why). None: no limit applies.
    """

    def __init__(self, shares: list[EngineShare], period_s: float = POLL_S) -> None:
        self.shares = shares
        self.period_s = period_s
        self._last = -1.0
        self._published: tuple[int, int, int] | None = None
        self._limit: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.row.name for s in self.shares)

    def poll(self, *, mapped: int, in_use: int, reserved: int) -> int | None:
        """The engine's page limit now, given the pages it has ``mapped`` (``in_use`` +
        ``reserved`` idle ones)."""
        now = time.monotonic()
        state = (mapped, in_use, reserved)
        shrank = self._published is not None and mapped < self._published[0]
        if now - self._last < self.period_s and not shrank:
            return self._limit
        self._last = now
        limits: list[int] = []
        readable = True
        for share in self.shares:
            pb = share.page_bytes
            if state != self._published:
                snap = share.row.publish(mapped=mapped * pb, in_use=in_use * pb, reserved=reserved * pb)
            else:
                snap = share.row.record.current()
            if snap is None:  # unreadable: serve on with what is mapped, map no more
                limits.append(mapped)
                readable = False
                continue
            mine = snap.engine(share.row.name)
            if mine is not None and mine.limit is not None:
                limits.append(mine.limit // pb)
            if snap.limit is not None and snap.used > snap.limit:
                limits.append(max(0, mapped - -(-(snap.used - snap.limit) // pb)))
        self._published = state if readable else None  # publish again once readable
        self._limit = min(limits) if limits else None
        return self._limit

    @property
    def failure(self) -> str | None:
        """Why one of the engine's records cannot be read now (None: all can); the engine
        then maps no more than it has (see `poll`)."""
        return next((s.row.record.failure for s in self.shares if s.row.record.failure), None)

    def close(self) -> None:
        """Leave every record (the rows go; the ranks' slots are theirs). Idempotent."""
        records = {id(s.row.record): s.row.record for s in self.shares}
        self.shares = []
        for record in records.values():
            record.close()


def limiter_failure(limiter: object) -> str:
    """Why an engine's budget records cannot be read now, for ``kvcached.stats()``: ``""``
    while they can, or when ``limiter`` is no `EngineBudget` (no records)."""
    return (limiter.failure or "") if isinstance(limiter, EngineBudget) else ""
