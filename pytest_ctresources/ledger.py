"""The VRAM budget of one GPU, shared by the processes of a run on one host.

The budget is a file of ``units`` bytes, one byte per 1/16 GiB (64 MiB). A lease of N GiB is
``ceil(16 N)`` of those bytes, each held with an exclusive POSIX record lock (``lockf``). The
operating system releases a process's record locks when it exits, however it exits (SIGKILL
and ``os._exit`` included), so a dead worker gives its lease back without anyone cleaning up:
there is no PID file to go stale.

Fairness and deadlock:

- A process waiting for a lease holds no units, so waits can never form a cycle.
- A turnstile byte: every process takes it before taking units, and a process that cannot
  get its units keeps it while it waits, so newcomers queue behind the waiter and a large
  lease is not starved by a stream of small ones.
- A presence byte, held shared by every process with the ledger open: a run's directory is
  pruned (after a day) only when no process holds it, even between tests.

POSIX record locks belong to the process and are dropped when *any* descriptor of the file
is closed by it, so each process opens a ledger file once (:meth:`VramLedger.open`) and
keeps it.
Locks never conflict within one process: a process holds at most one lease per GPU at a time.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

UNITS_PER_GIB = 16
POLL_SECONDS = 0.05
# Byte offsets past any budget's units (record locks may lie beyond the end of the file).
TURNSTILE = 1 << 40
PRESENCE = TURNSTILE + 1


class LeaseTimeout(Exception):
    """A lease was not granted within the timeout."""


def units_for(gib: float) -> int:
    """Units covering ``gib`` (rounded up to the next 64 MiB)."""
    return max(0, math.ceil(round(gib * UNITS_PER_GIB, 6)))


def _safe(name: str) -> str:
    """``name`` as a file name (run ids and GPU UUIDs come from outside)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _root() -> Path:
    """This user's directory of run directories in the temp dir."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"pytest-ctresources-{uid}"


def ledger_dir(testrun: str) -> Path:
    """Where a run's ledger files live on this host (one directory per run)."""
    return _root() / f"run-{_safe(testrun)}"


def prune_old_runs(max_age_s: float = 86400.0) -> None:
    """Remove the ledger directories of runs older than ``max_age_s`` (empty files, but one
    directory per run would pile up in the temp dir otherwise)."""
    import shutil

    now = time.time()
    for run in _root().glob("run-*"):
        try:
            if now - run.stat().st_mtime > max_age_s and not _in_use(run):
                shutil.rmtree(run, ignore_errors=True)
        except OSError:
            continue


def _in_use(run: Path) -> bool:
    """Whether any process holds a lock on a file of ``run`` (ledgers hold a presence lock,
    workers their seat, for as long as they live)."""
    for path in run.iterdir():
        fd = os.open(path, os.O_RDWR)
        try:
            # Length 0: from offset 0 to infinity, so any lock anywhere in the file conflicts.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0, os.SEEK_SET)
        except OSError:
            return True
        finally:
            os.close(fd)  # (this process never holds locks on another run's ledgers)
    return False


def ledger_path(testrun: str, gpu_key: str) -> Path:
    return ledger_dir(testrun) / f"{_safe(gpu_key)}.ledger"


@dataclass
class _LockFile:
    """A file whose bytes this process locks one at a time (``lockf`` record locks)."""

    path: Path
    _fd: int = field(default=-1, repr=False, kw_only=True)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def close(self) -> None:
        """Close the file: drops every lock this process holds on it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _try_lock(self, byte: int) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte, os.SEEK_SET)
        except OSError:
            return False
        return True

    def _unlock(self, byte: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, byte, os.SEEK_SET)

    def _held_elsewhere(self, byte: int) -> bool:
        """Whether another process holds ``byte`` (probes by locking and unlocking it)."""
        if not self._try_lock(byte):
            return True
        self._unlock(byte)
        return False


@dataclass
class Lease:
    """Units held by this process; give them back with :meth:`VramLedger.release`."""

    gib: float
    units: list[int]
    waited_s: float


@dataclass
class VramLedger(_LockFile):
    """One GPU's budget of ``budget_gib`` on one host."""

    budget_gib: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    @property
    def units(self) -> int:
        return units_for(self.budget_gib)

    def open(self) -> VramLedger:
        self._open()
        fcntl.lockf(self._fd, fcntl.LOCK_SH, 1, PRESENCE, os.SEEK_SET)
        return self

    def acquire(
        self, gib: float, timeout_s: float, before_waiting: Callable[[], None] | None = None
    ) -> Lease:
        """Take ``gib`` from the budget, waiting up to ``timeout_s`` seconds.

        ``before_waiting`` runs once if the lease is not granted at once (the plugin frees the
        worker's cached models there, so a waiting worker holds no GPU memory). Raises
        :class:`LeaseTimeout` after ``timeout_s``, and ``ValueError`` for a lease larger than
        the whole budget (it could never be granted: such tests are skipped instead).
        """
        need = units_for(gib)
        if need > self.units:
            raise ValueError(
                f"a lease of {gib:.1f} GiB exceeds the whole budget of {self.budget_gib:.1f} GiB"
            )
        start = self.clock()
        waited = False

        def wait() -> None:
            nonlocal waited
            if not waited and before_waiting is not None:
                before_waiting()
            waited = True
            self._wait_or_fail(start, gib, timeout_s)

        # Through the turnstile first, newcomers included: while a process waits for its
        # units holding it, everyone else queues behind it.
        while not self._try_lock(TURNSTILE):
            wait()
        try:
            while (got := self._try_units(need)) is None:
                wait()
        finally:
            self._unlock(TURNSTILE)
        return Lease(gib, got, self.clock() - start if waited else 0.0)

    def release(self, lease: Lease) -> None:
        for unit in lease.units:
            self._unlock(unit)
        lease.units = []

    def free_gib(self) -> float:
        """The budget not leased by other processes right now (probes each unit)."""
        free = sum(not self._held_elsewhere(unit) for unit in range(self.units))
        return free / UNITS_PER_GIB

    def _wait_or_fail(self, start: float, gib: float, timeout_s: float) -> None:
        waited = self.clock() - start
        if waited >= timeout_s:
            raise LeaseTimeout(
                f"waited {waited:.0f} s for a VRAM lease of {gib:.1f} GiB; the GPU's budget is "
                f"{self.budget_gib:.1f} GiB and {self.free_gib():.1f} GiB of it is free "
                "(ct_lease_timeout)"
            )
        self.sleep(POLL_SECONDS)

    def _try_units(self, need: int) -> list[int] | None:
        got: list[int] = []
        if need == 0:
            return got
        for unit in range(self.units):
            if self._try_lock(unit):
                got.append(unit)
                if len(got) == need:
                    return got
        for unit in got:
            self._unlock(unit)
        return None


SLOTS_PER_GPU = 1024
BINDING_LOCK = TURNSTILE  # the same gate byte, in the seats file


@dataclass
class SeatBoard(_LockFile):
    """Which of a run's workers on this host sit on which GPU: one exclusive lock byte per
    (GPU position, slot), held by a worker for its life and released by the operating system
    when it exits. A worker that replaces a crashed one (xdist restarts them) sees the freed
    seat, so it can sit where the crashed one sat instead of doubling up elsewhere."""

    def open(self) -> SeatBoard:
        self._open()
        return self

    def choose_and_sit(self, choose: Callable[[list[int]], int], n_gpus: int) -> int:
        """Under an exclusive lock: count the seats taken per GPU, let ``choose`` pick a GPU
        position from those counts, take a free seat there, and return the position."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, BINDING_LOCK, os.SEEK_SET)  # a short wait
        try:
            taken = [
                sum(self._held_elsewhere(first + slot) for slot in range(SLOTS_PER_GPU))
                for first in range(0, n_gpus * SLOTS_PER_GPU, SLOTS_PER_GPU)
            ]
            position = choose(taken)
            first = position * SLOTS_PER_GPU
            for byte in range(first, first + SLOTS_PER_GPU):
                if self._try_lock(byte):
                    break
            return position
        finally:
            self._unlock(BINDING_LOCK)


def seat_board(testrun: str) -> SeatBoard:
    """The seat board of a run on this host (opened; keep it for the process's life)."""
    return SeatBoard(ledger_dir(testrun) / "seats").open()
