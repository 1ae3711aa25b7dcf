"""A hostile host, round two (issue 21: causes 6 and 7, and N3): code that takes SIGTERM over,
a waiter for a VRAM lease that is stopped (Ctrl-Z), and report paths and ledger directories
that hold something that is not the plugin's.

Every row is one hostile input. Rows are cheap where they can be: the report paths and the
ledger directory through the functions that check them (the option's one-line usage error
is the function's message, proved end to end by a few rows in one in-process run each);
processes only where process state is the point (signals, a stopped process). Nothing here
synchronises by sleeping: a child says where it is with a line on its stdout, and the few
polls (a lock's holder) have a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

NOBODY = 65534
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
#: The bound on any one child process: a row that hangs fails here, never waits for a default.
CHILD_TIMEOUT_S = 120


def _own_session(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a process and session of its own, as ``timeout`` or Slurm would run it."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *args],
        cwd=path,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=CHILD_TIMEOUT_S,
    )


# --- cause 6: SIGTERM after code that took the handler over --------------------------------

TERMINATES_ITSELF = """
import os, signal

def test_z_terminated():
    os.kill(os.getpid(), signal.SIGTERM)

def test_zz_never_runs():
    pass
"""

NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "id": "only",
            "metadata": {},
            "outputs": [],
            "source": ["print('ran')"],
        }
    ],
    "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}

# Their handler, installed by a test: it proves it ran after ours by copying our report.
THEIR_HANDLER = """
import os, shutil, signal

def _theirs(signum, frame):
    shutil.copy("r.json", "report-when-theirs-ran.json")
    os._exit(3)

def test_a_installs_its_own_handler():
    signal.signal(signal.SIGTERM, _theirs)
"""


@dataclass(frozen=True)
class TermRow:
    id: str
    files: dict[str, str]
    args: tuple[str, ...] = ()
    returncode: int = -signal.SIGTERM
    snapshot: bool = False
    """Their handler ran after ours: it copied the report ours had written."""


TERM_ROWS = [
    TermRow(
        "after-a-notebook-item",
        {"nb.ipynb": json.dumps(NOTEBOOK), "test_term.py": TERMINATES_ITSELF},
        ("--nbmake", "nb.ipynb", "test_term.py"),
    ),
    TermRow(
        # nbclient's own calls: what they leave behind is SIG_DFL.
        "after-asyncio-add-and-remove-signal-handler",
        {
            "test_term.py": """
import asyncio, signal

def test_a_runs_a_loop_as_nbclient_does():
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    loop.remove_signal_handler(signal.SIGTERM)
    loop.close()
"""
            + TERMINATES_ITSELF
        },
    ),
    TermRow(
        "after-a-test-set-sig-dfl",
        {
            "test_term.py": """
import signal

def test_a_resets_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
"""
            + TERMINATES_ITSELF
        },
    ),
    TermRow(
        "after-a-fixture-teardown-set-sig-dfl",
        {
            "test_term.py": """
import signal
import pytest

@pytest.fixture
def resets():
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

def test_a_uses_it(resets):
    pass
"""
            + TERMINATES_ITSELF
        },
    ),
    TermRow(
        "after-a-test-installed-its-own-handler",
        {"test_term.py": THEIR_HANDLER + TERMINATES_ITSELF},
        returncode=3,
        snapshot=True,
    ),
]


@pytest.mark.parametrize("row", TERM_ROWS, ids=[row.id for row in TERM_ROWS])
def test_sigterm_writes_the_report_whatever_took_the_handler_over(
    row: TermRow, tmp_path: Path
) -> None:
    for name, text in row.files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    process = _own_session(tmp_path, *row.args, "--ct-report-json", "r.json")
    assert process.returncode == row.returncode, process.stdout + process.stderr
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["signal"] == "SIGTERM"
    assert "test_term.py::test_zz_never_runs" not in {t["nodeid"] for t in document["tests"]}
    if row.snapshot:
        snapshot = json.loads((tmp_path / "report-when-theirs-ran.json").read_text())
        assert snapshot["signal"] == "SIGTERM"


# --- cause 7: a stopped waiter must not hold the queue ------------------------------------

# Another process of the user's on one budget file: "hold" (or "hold-resident", as a resident
# model's lease) GIB and say "held"; or "wait" for GIB, saying "waiting" once it waits (then
# it holds the turnstile, and WANTED where idle resident models would make room) and
# "granted" when it has it. Each keeps what it has until its stdin is closed.
CHILD = """
import sys
from pathlib import Path
from pytest_ctresources.leases.ledger import Lease, VramLedger

path, budget, role, gib = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
ledger = VramLedger(path, budget).open()
if role == "wait":
    ledger.acquire(gib, 60, before_waiting=lambda: print("waiting", flush=True))
    print("granted", flush=True)
else:
    lease = ledger.acquire(gib, 10)
    if role == "hold-resident":
        ledger.move(lease, Lease(0.0, [], 0.0, resident=True), gib)
    print("held", flush=True)
sys.stdin.read()
"""


class Child:
    """A child process of :data:`CHILD`; its lines are read with a deadline."""

    def __init__(self, path: Path, budget: float, role: str, gib: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(budget), role, str(gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() sees every byte the child wrote
        )
        self.pid = self.proc.pid

    def expect(self, line: str, timeout_s: float = CHILD_TIMEOUT_S) -> None:
        import select
        import time

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        got = b""
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            assert ready, f"child {self.pid}: no {line!r} after {timeout_s} s (got {got!r})"
            byte = self.proc.stdout.read(1)
            assert byte, f"child {self.pid} ended before saying {line!r}: {got!r}"
            got += byte
        assert got.decode().strip() == line

    def stop(self, signum: int) -> None:
        os.kill(self.pid, signum)
        _until(lambda: _state(self.pid) == "T", f"child {self.pid} stopped")

    def end(self) -> None:
        """Close its stdin: it exits, and the system drops its locks."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=CHILD_TIMEOUT_S)

    def kill(self) -> None:
        self.proc.kill()  # (a stopped process is killed too)
        self.proc.wait(timeout=CHILD_TIMEOUT_S)


def _state(pid: int) -> str:
    """The process's state letter, read here independently of the code under test."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 1 :].split()[0]


def _until(condition: object, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (a state of another process, which no file can signal) with a
    deadline."""
    import time
    from collections.abc import Callable

    assert callable(condition)
    check: Callable[[], bool] = condition
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.01)


@dataclass(frozen=True)
class QueueRow:
    id: str
    hold: float
    """A first child holds this much of the 2 GiB budget."""
    wait: float | None = None
    """A second child then waits for this much (None: no waiter)."""
    stop: str = "waiter"
    """Which child is stopped ("waiter", "holder" or "": none)."""
    signum: int = signal.SIGSTOP
    free: bool = True
    """The holder ends once the waiter is stopped."""
    resident: bool = False
    own: float = 0.0
    """This process leases this much before the children start."""
    act: str = "acquire"
    """What this process then does: "acquire" 1 GiB, "resume" (acquire, then the waiter
    resumes and gets its lease too), "wanted" (is a cache wanted elsewhere?), "extend"."""
    timeout_s: float = 10.0
    expect: str | None = None
    """A pattern for the LeaseTimeout message ({waiter}, {holder}: pids); None: granted."""
    lanes: int | None = None
    """Only this many lanes of the turnstile."""


BUDGET = 2.0
QUEUE_ROWS = [
    QueueRow("a-waiter-stopped-by-sigstop", hold=2, wait=1),
    QueueRow("a-waiter-stopped-by-ctrl-z-sigtstp", hold=2, wait=1, signum=signal.SIGTSTP),
    QueueRow("a-stopped-waiter-resumed-is-served-after", hold=2, wait=1, act="resume"),
    QueueRow("a-stopped-waiter-holding-wanted", hold=2, wait=1, resident=True, act="wanted"),
    QueueRow("a-stopped-waiter-and-a-models-extension", hold=1, wait=1, own=0.5, act="extend"),
    QueueRow(
        "behind-a-running-waiter-the-timeout-says-so",
        hold=1,
        wait=2,
        stop="",
        free=False,
        timeout_s=1.0,
        expect="*, queued behind another run's request (pid {waiter}), itself waiting*",
    ),
    QueueRow(
        "units-leased-by-a-stopped-run-the-timeout-says-so",
        hold=2,
        stop="holder",
        signum=signal.SIGTSTP,
        free=False,
        timeout_s=1.0,
        expect="*2.0 GiB of it is leased by stopped process (pid {holder}: Ctrl-Z*",
    ),
    QueueRow(
        "every-lane-stopped-the-timeout-says-so",
        hold=2,
        wait=1,
        lanes=1,
        timeout_s=1.0,
        expect="*, queued behind stopped process (pid {waiter}: Ctrl-Z or SIGSTOP)*",
    ),
]


@pytest.mark.parametrize("row", QUEUE_ROWS, ids=[row.id for row in QUEUE_ROWS])
def test_a_stopped_waiter_does_not_hold_the_queue(
    row: QueueRow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fnmatch import fnmatch

    from pytest_ctresources.leases import ledger as ledger_module

    if row.lanes is not None:
        lanes = getattr(ledger_module, "GATE_LANES", (ledger_module.TURNSTILE,))
        monkeypatch.setattr(ledger_module, "GATE_LANES", lanes[: row.lanes], raising=False)
    path = tmp_path / "card.ledger"
    ledger = ledger_module.VramLedger(path, BUDGET).open()
    own = ledger.acquire(row.own, 1) if row.own else None
    children: list[Child] = []
    try:
        holder = Child(path, BUDGET, "hold-resident" if row.resident else "hold", row.hold)
        children.append(holder)
        holder.expect("held")
        waiter = None
        if row.wait is not None:
            waiter = Child(path, BUDGET, "wait", row.wait)
            children.append(waiter)
            waiter.expect("waiting")
        if row.act == "wanted":
            assert ledger.wanted_elsewhere()  # a running waiter's WANTED counts
        stopped = {"waiter": waiter, "holder": holder}.get(row.stop)
        if stopped is not None:
            stopped.stop(row.signum)
        if row.free:
            holder.end()
        if row.act == "wanted":
            assert not ledger.wanted_elsewhere()
            return
        if row.act == "extend":
            assert own is not None
            assert ledger.try_extend(own, 0.5)
            return
        try:
            lease = ledger.acquire(1.0, row.timeout_s)
        except ledger_module.LeaseTimeout as exc:
            pids = {"waiter": waiter.pid if waiter else 0, "holder": holder.pid}
            assert row.expect is not None, str(exc)
            assert fnmatch(str(exc), row.expect.format(**pids)), str(exc)
            return
        assert row.expect is None, f"granted, where {row.expect!r} was expected"
        assert lease.units
        if row.act == "resume":
            assert waiter is not None
            os.kill(waiter.pid, signal.SIGCONT)
            waiter.expect("granted")
            assert ledger.free_gib() == 0
    finally:
        for child in children:
            child.kill()
        ledger.close()
