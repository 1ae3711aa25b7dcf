"""The VRAM budget of each GPU, shared by every pytest process of one user on a host.

Files live in ``pytest-ctresources-<uid>`` in the system temp directory (``TMPDIR``), a
directory only its owner can use (mode 0700, checked on every use, never a symbolic link:
:func:`ensure_root`):

- ``<GPU UUID>.ledger``: one GPU's budget, shared by every run of the user on the host, xdist
  or not, so that concurrent runs queue instead of over-committing the card;
- ``run-<testrunuid>/seats``: which workers of one xdist run sit on which GPU
  (:class:`SeatBoard`); pruned a day after the run ends (:func:`prune_old_runs`).

A budget file has one byte per 1/16 GiB (64 MiB) of the card. A lease of N GiB is
``ceil(16 N)`` of those bytes, each held with an exclusive POSIX record lock (``lockf``). The
operating system releases a process's record locks when it exits, however it exits (SIGKILL
and ``os._exit`` included), so a dead holder gives its lease back without anyone cleaning up:
there is no PID file to go stale. A run whose budget is smaller than the card
(``--ct-vram-capacity``) leases from the card's first units only, so it shares them with
every other run and never takes more than its own budget; units are taken from the top of a
run's range down, so uncapped runs leave a capped run's units for last.

What else counts:

- Memory other processes hold on the card: a lease is granted only while the card's used
  memory (NVML's figure, which includes this user's allocations) plus the lease fits the
  card. Since ``max(leased, used) + lease <= card`` is what "leases plus memory used beyond
  them" amounts to, and the units already bound the leases, the used figure is all it takes.
- Resident models (``ct_session``'s cache) hold a lease of their own, marked in a mirror
  range (``RESIDENT + unit``), so that a waiter can tell whether freeing idle caches would
  let it in; it then holds the ``WANTED`` byte and every process's watcher frees its cache if
  no test is using it (:mod:`~pytest_ctresources.leases.leases`).

Fairness and deadlock:

- A process waiting for units holds none for a test; its resident model's, if any, are
  freed by its watcher once a waiter needs them and no test uses the model, and a test that
  reuses the model keeps it for at most a short grace while it waits
  (:mod:`~pytest_ctresources.leases.leases`), so waits can never form a cycle.
- A turnstile byte: every process takes it before taking units, and a process that cannot
  get its units keeps it while it waits, so newcomers queue behind the waiter and a large
  lease is not starved by a stream of small ones.
- A stopped process (Ctrl-Z, SIGSTOP, a debugger) keeps its locks but does nothing with
  them: a waiter that is stopped must not hold the queue. The turnstile has
  :data:`GATE_LANES` lanes; a newcomer that finds a lane held by a stopped process (state
  ``T`` or ``t`` in ``/proc/<pid>/stat``, the holder's pid from ``F_GETLK``) goes on to the
  next lane, and queues only behind a waiter that can run. ``WANTED`` has lanes too, and a
  stopped process's ``WANTED`` frees no one's cache. A stopped waiter that is resumed waits
  on in its lane, beside the one that went past it (for a while two waiters, not one, go
  first). Where the holder cannot be seen (no ``/proc``, another pid namespace: ``F_GETLK``
  says pid 0) it is taken to be running, as before.

POSIX record locks belong to the process: they never conflict within it, and closing *any*
descriptor of a file drops all of them. So each process opens a file once (a shared handle
per path, :class:`_LockFile`) and keeps its own record of the bytes it holds: it never probes
those (a probe would succeed and then unlock them) and never hands a unit to two leases.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from pytest_ctresources.gpu.measure import cached_bytes
from pytest_ctresources.units import GIB, file_kind, named

UNITS_PER_GIB = 16
POLL_SECONDS = 0.05
POLL_MAX_SECONDS = 0.5
# Byte offsets past any budget's units (record locks may lie beyond the end of the file).
TURNSTILE = 1 << 40
WANTED = TURNSTILE + 2
RESIDENT = 1 << 41
#: Lanes of the turnstile and of ``WANTED``: the first is the byte older versions use, so
#: that they queue with this one; the next ones are taken only past stopped holders.
LANE_COUNT = 16
GATE_LANES = (TURNSTILE, *range(TURNSTILE + 16, TURNSTILE + 16 + LANE_COUNT - 1))
WANTED_LANES = (WANTED, *range(TURNSTILE + 48, TURNSTILE + 48 + LANE_COUNT - 1))
_FLOCK = "hhqqi"  # struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid)
SEATS_NAME = "seats"
LEDGER_SUFFIX = ".ledger"
RUN_PREFIX = "run-"


class LeaseTimeout(Exception):
    """A lease was not granted within the timeout."""


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T``: SIGSTOP, SIGTSTP, Ctrl-Z; ``t``: stopped
    by a tracer). False where it cannot be told (no ``/proc``, no such process, pid 0)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read(4096)
    except OSError:
        return False
    # "pid (comm) state ...": the name may hold spaces and parentheses, the state follows
    # the last ")".
    _, _, rest = text.rpartition(b")")
    fields = rest.split()
    return bool(fields) and fields[0] in (b"T", b"t")


class LedgerDirError(Exception):
    """A ledger directory or file is not safe to use; the message is one line for the user."""


def units_for(gib: float) -> int:
    """Units covering ``gib`` (rounded up to the next 64 MiB)."""
    return max(0, math.ceil(round(gib * UNITS_PER_GIB, 6)))


def _safe(name: str) -> str:
    """``name`` as a file name (run ids and GPU UUIDs come from outside)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def _uid() -> int:
    return os.getuid()


# --------------------------------------------------------------------------- directories


def ledger_root() -> Path:
    """This user's ledger directory: ``pytest-ctresources-<uid>`` in the temp directory."""
    return Path(tempfile.gettempdir()) / f"pytest-ctresources-{_uid()}"


def _refuse(path: Path, problem: str) -> LedgerDirError:
    return LedgerDirError(
        f"pytest-ctresources: the VRAM ledger directory {named(str(path))} {problem}; it must be a "
        "directory of your own that only you can use: remove it, or set TMPDIR to a directory "
        "of your own"
    )


def _private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check the one there, as pytest's ``tmpdir.py`` does.

    Refuses a symbolic link, anything but a directory, and a directory of another user;
    takes away the group's and others' permissions from one of ours (older versions created
    it 0755). Raises :class:`LedgerDirError`.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _refuse(path, f"cannot be created ({exc.strerror})") from None
    try:
        # O_NOFOLLOW: a link planted in its place is refused, not followed; the checks are made
        # on what was opened, so nothing can be swapped in between.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse(path, _what_is(path, exc)) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != _uid():
            raise _refuse(path, f"belongs to uid {info.st_uid}, not to you (uid {_uid()})")
        if info.st_mode & 0o077:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o700)
    finally:
        os.close(fd)
    return path


def _what_is(path: Path, exc: OSError) -> str:
    try:
        info = os.lstat(path)
    except OSError:
        return f"cannot be opened ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return f"is a symbolic link (to {os.readlink(path)!r})"
    if not stat.S_ISDIR(info.st_mode):
        return f"is not a directory but {file_kind(info.st_mode)}"
    return f"cannot be opened ({exc.strerror})"


def ensure_root() -> Path:
    """This user's ledger directory, created or checked (raises :class:`LedgerDirError`)."""
    return _private_dir(ledger_root())


def run_dir(testrun: str) -> Path:
    """Where an xdist run's seat board lives on this host (one directory per run)."""
    return ledger_root() / f"{RUN_PREFIX}{_safe(testrun)}"


def ledger_path(gpu_key: str) -> Path:
    """The budget file of the GPU named ``gpu_key`` (its UUID), shared by the user's runs."""
    return ledger_root() / f"{_safe(gpu_key)}{LEDGER_SUFFIX}"


def _open_lock_file(path: Path) -> int:
    """Open (creating it 0600) a lock file: never through a link, only a regular file of ours."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        seen = os.lstat(path)
    except OSError:
        seen = None
    if seen is not None and not (stat.S_ISREG(seen.st_mode) or stat.S_ISLNK(seen.st_mode)):
        # Refused before it is opened: opening a device node can have effects of its own.
        # (A link is refused by O_NOFOLLOW below, which names its target.)
        raise _file_error(path, f"it is {file_kind(seen.st_mode)}, not a regular file; remove it")
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        remedy = "; remove it" if seen is not None else ""
        raise _file_error(path, f"{_what_is_file(path, exc)}{remedy}", "open") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"it is {file_kind(info.st_mode)}, not a regular file"
    elif info.st_uid != _uid():
        problem = f"it belongs to uid {info.st_uid}, not to you (uid {_uid()})"
    if problem is not None:
        os.close(fd)
        raise _file_error(path, f"{problem}; remove it")
    return fd


def _file_error(path: Path, problem: str, verb: str = "use") -> LedgerDirError:
    return LedgerDirError(
        f"pytest-ctresources: cannot {verb} the VRAM ledger file {named(str(path))}: {problem}"
    )


def _what_is_file(path: Path, exc: OSError) -> str:
    try:
        info = os.lstat(path)
    except OSError:
        return exc.strerror or type(exc).__name__
    if stat.S_ISLNK(info.st_mode):
        return f"it is a symbolic link (to {os.readlink(path)!r})"
    return f"it is {file_kind(info.st_mode)} ({exc.strerror})"


def prune_old_runs(current: str | None, max_age_s: float = 86400.0) -> list[str]:
    """Remove the seat directories of runs that ended more than ``max_age_s`` ago.

    Only what the plugin made is removed: a directory named ``run-*`` in the ledger
    directory (never through a link), owned by this user, holding nothing but this plugin's
    lock files (``seats``, ``*.ledger`` of older versions), none of which a live process
    holds a lock on. The current run's directory is never examined: probing a file of it
    would drop this process's own locks on it. Returns the names removed; raises
    :class:`LedgerDirError` when the ledger directory itself is not safe to use.
    """
    root = ensure_root()
    current_name = None if current is None else f"{RUN_PREFIX}{_safe(current)}"
    removed: list[str] = []
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(RUN_PREFIX) or entry.name == current_name:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != _uid():
            continue  # a link, a file, another user's: not ours to touch
        if now - info.st_mtime <= max_age_s:
            continue
        if _remove_unused_run(root / entry.name, info):
            removed.append(entry.name)
    return removed


def _remove_unused_run(run: Path, seen: os.stat_result) -> bool:
    """Remove ``run`` if it holds only unlocked lock files of ours; False otherwise."""
    try:
        dir_fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    held: list[int] = []
    try:
        opened = os.fstat(dir_fd)
        if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            return False  # replaced since it was listed
        names = os.listdir(dir_fd)
        if not all(name == SEATS_NAME or name.endswith(LEDGER_SUFFIX) for name in names):
            return False  # something the plugin did not make: leave the whole directory
        for name in names:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except OSError:
                return False
            held.append(fd)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != _uid():
                return False
            try:
                # Length 0: the whole file, so any lock anywhere in it conflicts. Kept until
                # the files are unlinked, so no process of that run can take one meanwhile.
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0, os.SEEK_SET)
            except OSError:
                return False  # a live process holds it: the run is still going
        for name in names:
            os.unlink(name, dir_fd=dir_fd)
        os.rmdir(run)
        return True
    except OSError:
        return False
    finally:
        for fd in held:
            os.close(fd)  # (this process holds no other lock on another run's files)
        os.close(dir_fd)


# --------------------------------------------------------------------------- lock files

_OPEN_FILES: dict[str, _LockFile] = {}
_OPEN_FILES_LOCK = threading.Lock()


class _LockFile:
    """One lock file, opened once per process however many users it has in the process.

    Keeps the record of the bytes this process holds (``mine``): record locks never conflict
    within a process, so without it two leases could get the same unit, and probing one of
    our own bytes would succeed and then unlock it. ``lock`` serialises the process's threads
    (a watcher thread releases a resident model's units while the main thread leases).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.users = 0
        self.mine: set[int] = set()
        self.lock = threading.RLock()

    @classmethod
    def open(cls, path: Path) -> _LockFile:
        key = str(path)
        with _OPEN_FILES_LOCK:
            handle = _OPEN_FILES.get(key)
            if handle is None:
                handle = cls(path, _open_lock_file(path))
                _OPEN_FILES[key] = handle
            handle.users += 1
            return handle

    def close(self) -> None:
        """One user less; the last closes the file, which drops every lock left on it."""
        with _OPEN_FILES_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            _OPEN_FILES.pop(str(self.path), None)
            with self.lock:
                self.mine.clear()
                os.close(self.fd)
                self.fd = -1

    def _lock_now(self, byte: int) -> bool:
        """The record lock on ``byte`` without waiting: False where another process holds
        it. Called under ``self.lock``, for a byte this process does not hold."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte, os.SEEK_SET)
        except OSError:
            return False
        return True

    def try_lock(self, byte: int) -> bool:
        """Take ``byte`` without waiting; False if held here or elsewhere."""
        with self.lock:
            if byte in self.mine or not self._lock_now(byte):
                return False
            self.mine.add(byte)
            return True

    def lock_waiting(self, byte: int) -> None:
        """Take ``byte``, waiting for it (the seat board's short critical section)."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, byte, os.SEEK_SET)
        with self.lock:
            self.mine.add(byte)

    def unlock(self, byte: int) -> None:
        with self.lock:
            if byte in self.mine:
                self.mine.discard(byte)
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, byte, os.SEEK_SET)

    def holder(self, byte: int) -> int | None:
        """The pid of another process holding ``byte`` (0: held, by a process this one
        cannot see), or None if no other process holds it."""
        import struct

        with self.lock:
            if byte in self.mine:
                return None
            query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0) + bytes(8)
            answer = fcntl.fcntl(self.fd, fcntl.F_GETLK, query)
        kind, _whence, _start, _length, pid = struct.unpack_from(_FLOCK, answer)
        return None if kind == fcntl.F_UNLCK else pid

    def held_elsewhere(self, byte: int) -> bool:
        """Whether another process holds ``byte`` (False for this process's own bytes)."""
        with self.lock:
            if byte in self.mine:
                return False
            if not self._lock_now(byte):
                return True
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, byte, os.SEEK_SET)
            return False


@dataclass
class Queue:
    """What one request saw at the turnstile, for the timeout's message."""

    at_gate: bool = True
    """Not through the turnstile yet."""
    ahead: int | None = None
    """The pid of the running waiter it queues behind (0: not visible from here)."""
    stopped: set[int] = field(default_factory=set)
    """Stopped processes whose lanes it went past."""


def _stopped(pids: set[int]) -> str:
    listed = ", ".join(str(pid) for pid in sorted(pids))
    which = "process" if len(pids) == 1 else "processes"
    return (
        f"stopped {which} (pid {listed}: Ctrl-Z or SIGSTOP); resume (fg, or kill -CONT) or end "
        f"{'it' if len(pids) == 1 else 'them'}"
    )


@dataclass
class Lease:
    """Units held by this process; give them back with :meth:`VramLedger.release`."""

    gib: float
    units: list[int]
    waited_s: float
    resident: bool = False
    """Held for a resident model (marked in the ``RESIDENT`` mirror range)."""


_Opened = TypeVar("_Opened", bound="_OnLockFile")


@dataclass
class _OnLockFile:
    """Something kept in one lock file, opened once per process (:class:`_LockFile`)."""

    path: Path
    _file: _LockFile | None = field(default=None, init=False, repr=False)
    _what: ClassVar[str] = "lock file"

    def open(self: _Opened) -> _Opened:
        """Open the file (once per process; raises :class:`LedgerDirError` if unsafe)."""
        if self._file is None:
            self._file = _LockFile.open(self.path)
        return self

    def close(self) -> None:
        """Stop using the file; the process's last user closes it, dropping its locks."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def file(self) -> _LockFile:
        if self._file is None:
            raise RuntimeError(f"the {self._what} is not open")
        return self._file


@dataclass
class VramLedger(_OnLockFile):
    """One GPU's budget on one host, as this process sees it.

    ``budget_gib`` is what this run may lease (the card, or ``--ct-vram-capacity``);
    ``card_gib`` the whole card (default: the budget); ``used_bytes`` reads the memory used
    on the card now (NVML; None: unknown), which must leave room for a lease.
    """

    budget_gib: float
    card_gib: float | None = None
    used_bytes: Callable[[], int | None] | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _what: ClassVar[str] = "ledger"
    _last_used: int | None = field(default=None, init=False, repr=False)
    _queue: Queue = field(default_factory=Queue, init=False, repr=False)

    @property
    def units(self) -> int:
        """Units this run may lease: the first ``units`` of the card."""
        return min(units_for(self.budget_gib), self.card_units)

    @property
    def card_units(self) -> int:
        return units_for(self.card_gib if self.card_gib is not None else self.budget_gib)

    def acquire(
        self, gib: float, timeout_s: float, before_waiting: Callable[[], None] | None = None
    ) -> Lease:
        """Take ``gib`` from the budget, waiting up to ``timeout_s`` seconds.

        ``before_waiting`` runs once if the lease is not granted at once (the plugin frees the
        process's idle cached model there). Raises :class:`LeaseTimeout` after ``timeout_s``,
        and ``ValueError`` for a lease larger than the whole budget (it could never be
        granted: such tests are skipped instead).
        """
        need = units_for(gib)
        if need > self.units:
            raise ValueError(
                f"a lease of {gib:.1f} GiB exceeds the whole budget of {self.budget_gib:.1f} GiB"
            )
        start = self.clock()
        waited = False
        pause = POLL_SECONDS

        def wait() -> None:
            nonlocal waited, pause
            if not waited and before_waiting is not None:
                before_waiting()
            waited = True
            self._fail_if_late(start, gib, timeout_s)
            # Each poll probes every unit: back off, so a long wait costs little CPU (about
            # 2.6% of a core on a 140 GiB card), but never sleep past the timeout.
            self.sleep(min(pause, max(0.0, timeout_s - (self.clock() - start))))
            pause = min(POLL_MAX_SECONDS, pause * 1.5)

        handle = self.file
        self._queue = Queue()
        lane = None
        try:
            # Through the turnstile first, newcomers included: while a process waits for its
            # units holding it, everyone else queues behind it (unless it is stopped).
            while (lane := self._through_gate(GATE_LANES, self._queue)) is None:
                wait()
            self._queue.at_gate = False
            while (got := self._take(need, check_used=True)) is None:
                self._want_idle_caches(need)
                wait()
        finally:
            for wanted in WANTED_LANES:
                handle.unlock(wanted)
            if lane is not None:
                handle.unlock(lane)
        return Lease(gib, got, self.clock() - start if waited else 0.0)

    def _through_gate(self, lanes: tuple[int, ...], queue: Queue | None = None) -> int | None:
        """Take the first lane of ``lanes`` that is free, going past those a stopped process
        holds; None while a process that can run holds one first (it goes first). ``queue``
        notes who was in the way, for the timeout's message."""
        handle = self.file
        ahead = None
        for lane in lanes:
            if handle.try_lock(lane):
                return lane
            holder = handle.holder(lane)
            if holder is None:
                break  # let go since: taken at the next poll, in turn
            if not process_stopped(holder):
                ahead = holder
                break
            if queue is not None:
                queue.stopped.add(holder)
        if queue is not None:
            queue.ahead = ahead
        return None

    def try_extend(self, lease: Lease, gib: float) -> bool:
        """Add ``gib`` to ``lease`` if free now, behind no waiter (never waits).

        For a model that outgrew its test's lease: its memory is already allocated, so the
        card's used memory is not checked again, only the units.
        """
        need = units_for(gib)
        handle = self.file
        lane = self._through_gate(GATE_LANES)
        if lane is None:
            return False  # someone waits: they go first
        try:
            got = self._take(need, check_used=False)
        finally:
            handle.unlock(lane)
        if got is None:
            return False
        with handle.lock:
            lease.units += got
            lease.gib += len(got) / UNITS_PER_GIB
            if lease.resident:
                for unit in got:
                    handle.try_lock(RESIDENT + unit)
        return True

    def release(self, lease: Lease) -> None:
        """Give ``lease``'s units back."""
        handle = self.file
        with handle.lock:
            for unit in lease.units:
                handle.unlock(unit)
                handle.unlock(RESIDENT + unit)
            lease.units = []
            lease.gib = 0.0

    def move(self, source: Lease, target: Lease, gib: float) -> None:
        """Move up to ``gib`` of ``source``'s units into ``target`` (a freed model's lease to
        the test that had counted on the model)."""
        count = min(units_for(gib), len(source.units))
        handle = self.file
        with handle.lock:
            moved = source.units[len(source.units) - count :]
            del source.units[len(source.units) - count :]
            source.gib = len(source.units) / UNITS_PER_GIB
            for unit in moved:
                if target.resident:
                    handle.try_lock(RESIDENT + unit)
                else:
                    handle.unlock(RESIDENT + unit)
            target.units += moved
            target.gib = len(target.units) / UNITS_PER_GIB

    def wanted_elsewhere(self) -> bool:
        """Whether another process that can run waits for units that idle resident models
        hold (a stopped one's ``WANTED`` would free caches for no one)."""
        handle = self.file
        for wanted in WANTED_LANES:
            holder = handle.holder(wanted)
            if holder is not None and not process_stopped(holder):
                return True
        return False

    def free_gib(self) -> float:
        """The budget not leased by anyone right now (probes each unit)."""
        return (self.units - self._held_units(self.units)) / UNITS_PER_GIB

    def held_gib(self) -> float:
        """What every process of the user leases on the card now, this one included."""
        return self._held_units(self.card_units) / UNITS_PER_GIB

    def _held_units(self, count: int) -> int:
        """How many of the first ``count`` units someone holds, this process included."""
        handle = self.file
        with handle.lock:
            return sum(unit in handle.mine or handle.held_elsewhere(unit) for unit in range(count))

    def _fail_if_late(self, start: float, gib: float, timeout_s: float) -> None:
        waited = self.clock() - start
        if waited < timeout_s:
            return
        message = f"waited {waited:.0f} s for a VRAM lease of {gib:.1f} GiB"
        queue = self._queue
        if queue.at_gate and queue.ahead is not None:
            # Held at the turnstile: what is free is not the reason, the queue is.
            who = f"pid {queue.ahead}" if queue.ahead else "a process not visible here"
            message += (
                f", queued behind another run's request ({who}), itself waiting for its lease; "
                "requests are served in turn"
            )
        elif queue.at_gate and queue.stopped:
            message += f", queued behind {_stopped(queue.stopped)}, every lane of the queue"
        message += (
            f"; the GPU's budget is {self.budget_gib:.1f} GiB and {self.free_gib():.1f} GiB of "
            "it is free"
        )
        stopped = self._stopped_holders()
        if stopped:
            held = sum(stopped.values()) / UNITS_PER_GIB
            message += f"; {held:.1f} GiB of it is leased by {_stopped(set(stopped))}"
        if self._last_used is not None:
            beyond = self._last_used / GIB - self.held_gib()
            if beyond > 0:
                message += (
                    f", but {beyond:.1f} GiB of the card's {self.card_units / UNITS_PER_GIB:.1f}"
                    " GiB is used beyond the leases (other processes, CUDA contexts)"
                )
        raise LeaseTimeout(message + " (ct_lease_timeout)")

    def _stopped_holders(self) -> dict[int, int]:
        """Units of this run's range held by stopped processes, by pid (at a timeout only:
        one ``F_GETLK`` a unit)."""
        handle = self.file
        counts: dict[int, int] = {}
        stopped: dict[int, bool] = {}
        for unit in range(self.units):
            pid = handle.holder(unit)
            if pid is None:
                continue
            if pid not in stopped:
                stopped[pid] = process_stopped(pid)
            if stopped[pid]:
                counts[pid] = counts.get(pid, 0) + 1
        return counts

    def _take(self, need: int, check_used: bool) -> list[int] | None:
        """Lock ``need`` free units of this run's range, from the top down, or none."""
        got: list[int] = []
        if need == 0:
            return got
        handle = self.file
        with handle.lock:
            for unit in range(self.units - 1, -1, -1):
                if len(got) == need:
                    break
                if handle.try_lock(unit):
                    got.append(unit)
            if len(got) == need and (not check_used or self._room_on_card(need)):
                return got
            for unit in got:
                handle.unlock(unit)
        return None

    def _room_on_card(self, need: int) -> bool:
        """Whether the card's used memory leaves room for ``need`` more units. What this
        process's allocator caches but has not allocated is left out: the test the lease is
        for reuses it (NVML counts it as used)."""
        self._last_used = used = self.used_bytes() if self.used_bytes is not None else None
        if used is None:
            return True
        return units_for(max(0, used - (cached_bytes() or 0)) / GIB) + need <= self.card_units

    def _want_idle_caches(self, need: int) -> None:
        """Hold ``WANTED`` (once) if idle resident models elsewhere would make room."""
        handle = self.file
        with handle.lock:
            if handle.mine.intersection(WANTED_LANES):
                return
            free = resident = 0
            for unit in range(self.units):
                if unit in handle.mine:
                    continue
                if not handle.held_elsewhere(unit):
                    free += 1
                elif handle.held_elsewhere(RESIDENT + unit):
                    resident += 1
            if resident and free + resident >= need:
                self._through_gate(WANTED_LANES)


# --------------------------------------------------------------------------- seats

SLOTS_PER_GPU = 1024
BINDING_LOCK = TURNSTILE  # the same gate byte, in the seats file


@dataclass
class SeatBoard(_OnLockFile):
    """Which of a run's workers on this host sit on which GPU: one exclusive lock byte per
    (GPU position, slot), held by a worker for its life and released by the operating system
    when it exits. A worker that replaces a crashed one (xdist restarts them) sees the freed
    seat, so it can sit where the crashed one sat instead of doubling up elsewhere."""

    _what: ClassVar[str] = "seat board"

    def choose_and_sit(self, choose: Callable[[list[int]], int], n_gpus: int) -> int:
        """Under an exclusive lock: count the seats taken per GPU, let ``choose`` pick a GPU
        position from those counts, take a free seat there, and return the position."""
        handle = self.file
        handle.lock_waiting(BINDING_LOCK)  # a short wait
        try:
            taken = [
                sum(handle.held_elsewhere(first + slot) for slot in range(SLOTS_PER_GPU))
                for first in range(0, n_gpus * SLOTS_PER_GPU, SLOTS_PER_GPU)
            ]
            position = choose(taken)
            first = position * SLOTS_PER_GPU
            for byte in range(first, first + SLOTS_PER_GPU):
                if handle.try_lock(byte):
                    break
            return position
        finally:
            handle.unlock(BINDING_LOCK)


def seat_board(testrun: str) -> SeatBoard:
    """The seat board of a run on this host (opened; keep it for the process's life).

    Raises :class:`LedgerDirError` when the ledger directory is not safe to use.
    """
    ensure_root()
    path = _private_dir(run_dir(testrun))
    return SeatBoard(path / SEATS_NAME).open()
