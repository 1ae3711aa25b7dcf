"""A hostile host: code that takes SIGTERM over, a waiter for a VRAM lease that is stopped
(Ctrl-Z), and report paths and ledger directories that hold something that is not the
plugin's.

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
from typing import Any

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


# --- SIGTERM after code that took the handler over -----------------------------------------

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


@pytest.mark.nbmake  # a row runs a notebook item
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


# --- a stopped waiter must not hold the queue ---------------------------------------------

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
    lease = ledger.acquire(gib, 60)
    if role == "hold-resident":
        ledger.move(lease, Lease(0.0, [], 0.0, resident=True), gib)
    print("held", flush=True)
sys.stdin.read()
"""


_OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


class Child:
    """A child process of :data:`CHILD`; its lines are read with a deadline."""

    def __init__(self, path: Path, budget: float, role: str, gib: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(budget), role, str(gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() sees every byte the child wrote
            # Its own process group in this session: the kernel discards SIGTSTP sent to a
            # process of an orphaned group, and pytest's group is orphaned where CI starts it
            # from a daemon (setsid). A group whose parent is in another group of the same
            # session is never orphaned, so Ctrl-Z's signal stops the child everywhere.
            **_OWN_GROUP,
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
    timeout_s: float = 60.0
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


# --- the report paths: only a report the plugin wrote for this user is replaced -----------

OTHER = "needs root: plays another user with chown, or makes device nodes"
as_root = pytest.mark.skipif(not IS_ROOT, reason=OTHER)
VICTIM = b"another user's precious bytes\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    import zlib

    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _png(*chunks: bytes) -> bytes:
    """A PNG of one transparent pixel, with ``chunks`` (made by _chunk) after its header."""
    import zlib

    from pytest_ctresources.settings.report_paths import PNG_MAGIC

    header = _chunk(b"IHDR", (1).to_bytes(4, "big") * 2 + bytes([8, 6, 0, 0, 0]))
    pixels = _chunk(b"IDAT", zlib.compress(b"\0" + bytes(4)))
    end = _chunk(b"IEND", b"")
    head = [c for c in chunks if not c.startswith(b"late")]
    late = [c[4:] for c in chunks if c.startswith(b"late")]
    return PNG_MAGIC + header + b"".join(head) + pixels + b"".join(late) + end


MARK = b"pytest-ctresources\0vram-plot"
PHOTO = _png(_chunk(b"tEXt", b"Software\0Darktable"))


def _our_json(path: Path) -> None:
    from pytest_ctresources.report.files import SCHEMA, SCHEMA_VERSION, write_json

    write_json(path, {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "tests": []})


def _our_plot(path: Path) -> None:
    from pytest_ctresources.report.files import write_plot
    from pytest_ctresources.report.run_summary import RunSummary

    made = path.with_name("made.png")  # the plot's format comes from its extension
    write_plot(made, RunSummary(), None, "no GPU")
    made.rename(path)


def _file(content: bytes, owner: int | None = None) -> object:
    def make(path: Path) -> None:
        path.write_bytes(content)
        if owner is not None:
            os.chown(path, owner, owner)

    return make


def _theirs(make: object) -> object:
    """``make``'s file, then given to another user."""

    def give(path: Path) -> None:
        assert callable(make)
        make(path)
        os.chown(path, NOBODY, NOBODY)

    return give


def _symlink(target: str) -> object:
    return lambda path: os.symlink(target, path)


def _socket(path: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))


def _node(kind: int, major: int, minor: int) -> object:
    return lambda path: os.mknod(path, kind | 0o600, os.makedev(major, minor))


def _dir_of(owner: int) -> object:
    def make(path: Path) -> None:
        path.mkdir()
        os.chown(path, owner, owner)

    return make


@dataclass(frozen=True)
class PathRow:
    id: str
    flag: str
    value: str
    make: object = None
    """Makes what is at the path (given the path of ``value``'s last component)."""
    expect: str | None = "*"
    """The refusal, an fnmatch pattern; None: the path is accepted."""
    root: bool = False
    extra: tuple[tuple[str, bytes], ...] = ()
    """Other files of the directory, (name, content)."""


def _both(id: str, make: object, expect: str | None, root: bool = False) -> list[PathRow]:
    """The same entry at the JSON report's path and at the plot's."""
    return [
        PathRow(f"json-{id}", "--ct-report-json", "r.json", make, expect, root),
        PathRow(f"plot-{id}", "--ct-report-plot", "p.png", make, expect, root),
    ]


NOT_OURS_JSON = "* exists and is not a pytest-ctresources JSON report: it is not replaced*"
NOT_OURS_PLOT = (
    "* exists and is not a PNG image that pytest-ctresources wrote*: it is not replaced*"
)
NOT_MINE = "* belongs to uid 65534, not to you (uid 0): it is not replaced (remove it*"

PATH_ROWS = [
    # -- what was taken for a report --
    PathRow(
        "plot-another-users-photo",
        "--ct-report-plot",
        "p.png",
        _file(PHOTO, NOBODY),
        NOT_MINE,
        root=True,
    ),
    PathRow("plot-my-own-photo", "--ct-report-plot", "p.png", _file(PHOTO), NOT_OURS_PLOT),
    PathRow(
        "plot-another-users-earlier-plot",
        "--ct-report-plot",
        "p.png",
        _theirs(_our_plot),
        NOT_MINE,
        root=True,
    ),
    PathRow(
        "json-another-users-earlier-report",
        "--ct-report-json",
        "r.json",
        _theirs(_our_json),
        NOT_MINE,
        root=True,
    ),
    *_both("another-users-empty-file", _file(b"", NOBODY), NOT_MINE, root=True),
    PathRow(
        "json-mentions-the-schema-but-is-not-a-report",
        "--ct-report-json",
        "r.json",
        _file(b'{"see": "pytest-ctresources-report", "mine": true}'),
        NOT_OURS_JSON,
    ),
    PathRow(
        "json-schema-key-not-first",
        "--ct-report-json",
        "r.json",
        _file(b'{"x": 1, "schema": "pytest-ctresources-report"}'),
        NOT_OURS_JSON,
    ),
    PathRow(
        "json-indented-schema-line",
        "--ct-report-json",
        "r.json",
        _file(b'   {"schema": "pytest-ctresources-report", "v": 1}'),
        NOT_OURS_JSON,
    ),
    PathRow(
        "plot-matplotlib-png-without-the-mark",
        "--ct-report-plot",
        "p.png",
        _file(_png(_chunk(b"tEXt", b"Software\0Matplotlib version3.11.2"))),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-the-mark-after-the-image-data",
        "--ct-report-plot",
        "p.png",
        _file(_png(b"late" + _chunk(b"tEXt", MARK))),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-the-mark-key-with-another-value",
        "--ct-report-plot",
        "p.png",
        _file(_png(_chunk(b"tEXt", b"pytest-ctresources\0holiday"))),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-the-mark-in-a-ztxt-chunk",
        "--ct-report-plot",
        "p.png",
        _file(_png(_chunk(b"zTXt", MARK))),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-the-png-signature-alone",
        "--ct-report-plot",
        "p.png",
        _file(b"\x89PNG\r\n\x1a\n"),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-a-chunk-length-of-4-gib",
        "--ct-report-plot",
        "p.png",
        _file(b"\x89PNG\r\n\x1a\n\xff\xff\xff\xfftEXt" + MARK),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-a-truncated-chunk",
        "--ct-report-plot",
        "p.png",
        _file(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x1ctEXtpytest-ctre"),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-the-mark-past-the-first-4-kib",
        "--ct-report-plot",
        "p.png",
        _file(_png(_chunk(b"tEXt", b"Comment\0" + b"x" * 5000), _chunk(b"tEXt", MARK))),
        NOT_OURS_PLOT,
    ),
    PathRow(
        "plot-a-json-report-at-the-plot-path", "--ct-report-plot", "p.png", _our_json, NOT_OURS_PLOT
    ),
    PathRow("json-a-plot-at-the-json-path", "--ct-report-json", "r.json", _our_plot, NOT_OURS_JSON),
    *_both("a-text-file", _file(b"notes\n"), "* exists and is not *"),
    *_both("a-one-byte-file", _file(b"{"), "* exists and is not *"),
    *_both("a-binary-file", _file(bytes(range(256)) * 64), "* exists and is not *"),
    *_both("a-hard-link-to-another-users-file", None, NOT_MINE, root=True),
    # -- what is not a regular file --
    *_both("a-symlink-to-my-own-report", _symlink("mine"), "* is a symbolic link*"),
    *_both("a-symlink-to-a-victim", _symlink("/etc/passwd"), "* is a symbolic link*"),
    *_both("a-dangling-symlink", _symlink("nowhere"), "* is a symbolic link*"),
    *_both("a-symlink-to-itself", None, "* is a symbolic link*"),
    *_both("a-symlink-to-a-directory", _symlink("/"), "* is a symbolic link*"),
    *_both("a-directory", lambda path: path.mkdir(), "* is a directory*"),
    *_both("another-users-directory", _dir_of(NOBODY), "* is a directory*", root=True),
    *_both("a-fifo", os.mkfifo, "* is a FIFO*"),
    *_both("a-socket", _socket, "* is a socket*"),
    *_both("a-char-device-like-dev-full", _node(0o020000, 1, 7), "* is a device node*", root=True),
    *_both(
        "a-block-device-like-a-loop-disk", _node(0o060000, 7, 0), "* is a device node*", root=True
    ),
    # -- paths --
    *[
        PathRow(f"{flag[12:]}-{id}", flag, value, None, expect)
        for flag in ("--ct-report-json", "--ct-report-plot")
        for id, value, expect in [
            ("the-empty-path", "", "* is a directory*"),
            ("the-root-directory", "/", "* is a directory*"),
            ("dot-dot", "..", "* is a directory*"),
            (
                "a-name-of-300-characters",
                "x" * 300,
                "cannot write '*' (300 characters): File name too long",
            ),
            (
                "a-path-of-5000-characters",
                "d/" * 2500 + "r",
                "cannot write '*' (5001 characters): File name too long",
            ),
            ("under-a-file", "notes.txt/r", "cannot write notes.txt/r: Not a directory"),
            ("under-dev-null", "/dev/null/r", "cannot write /dev/null/r: Not a directory"),
            ("a-nul", "r\0x", "* contains a NUL character*"),
            ("dev-null", "/dev/null", "/dev/null is a device node*"),
            ("proc-self-mem", "/proc/self/mem", "cannot write /proc/self/mem: *"),
            ("etc-passwd", "/etc/passwd", "/etc/passwd * not *"),
            ("a-newline-in-an-existing-name", "notes\nx", "'notes\\nx' exists and is not *"),
            ("an-escape-sequence-in-an-existing-name", "\x1b[2J", "'\\x1b[2J' exists and is not *"),
        ]
    ],
    # -- accepted: what the plugin may replace (controls: the rule is not "refuse all") --
    PathRow("json-my-own-earlier-report", "--ct-report-json", "r.json", _our_json, None),
    PathRow("plot-my-own-earlier-plot", "--ct-report-plot", "p.png", _our_plot, None),
    # a missing directory is made when the report is written, as --junitxml makes it
    PathRow("json-a-missing-directory", "--ct-report-json", "missing/r", None, None),
    PathRow("plot-a-missing-directory", "--ct-report-plot", "missing/p.svg", None, None),
    PathRow("json-a-tilde-not-expanded", "--ct-report-json", "~nosuchuser/r", None, None),
    PathRow("plot-no-extension", "--ct-report-plot", "p", None, "p has no extension: *"),
    *_both("my-own-empty-file-from-mktemp", _file(b""), None),
    *_both("nothing-there-yet", None, None),
]
_EXTRA = {"notes.txt": b"notes\n", "notes\nx": b"notes\n", "\x1b[2J": b"notes\n", "mine": b"{}"}


def _entries(directory: Path) -> dict[str, tuple[object, ...]]:
    """What a directory holds, link targets, owners and contents included."""
    import stat

    found: dict[str, tuple[object, ...]] = {}
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        info = os.lstat(path)
        content: object = None
        if stat.S_ISLNK(info.st_mode):
            content = os.readlink(path)
        elif stat.S_ISREG(info.st_mode):
            content = path.read_bytes()
        found[entry] = (info.st_mode, info.st_uid, info.st_ino, content)
    return found


def _prepare(row: PathRow, directory: Path) -> None:
    for name, content in _EXTRA.items():
        (directory / name).write_bytes(content)
    target = directory / row.value if row.value and "\0" not in row.value else None
    if target is None or len(row.value) > 200 or "/" in row.value:
        return
    if row.id.endswith("a-hard-link-to-another-users-file"):
        victim = directory / "victim"
        victim.write_bytes(VICTIM)
        os.chown(victim, NOBODY, NOBODY)
        os.link(victim, target)
    elif row.id.endswith("a-symlink-to-itself"):
        os.symlink(row.value, target)
    elif row.make is not None:
        assert callable(row.make)
        row.make(target)
    elif row.value in ("notes\nx", "\x1b[2J"):
        pass  # in _EXTRA


@pytest.mark.parametrize("row", PATH_ROWS, ids=[row.id for row in PATH_ROWS])
def test_a_report_path_replaces_only_a_report_the_plugin_wrote_for_you(
    row: PathRow, tmp_path: Path
) -> None:
    from fnmatch import fnmatch

    from pytest_ctresources.settings.report_paths import TargetError, check_target

    if row.root and not IS_ROOT:
        pytest.skip(OTHER)
    _prepare(row, tmp_path)
    before = _entries(tmp_path)
    if row.expect is None:
        assert check_target(row.value, row.flag, tmp_path) == tmp_path / row.value
        return
    with pytest.raises(TargetError) as refused:
        check_target(row.value, row.flag, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "\x1b" not in message, repr(message)
    assert fnmatch(message, row.expect), message
    assert _entries(tmp_path) == before  # nothing touched


E2E = {
    "plot-another-users-photo",
    "plot-my-own-photo",
    "json-another-users-earlier-report",
    "json-another-users-empty-file",
    "json-a-newline-in-an-existing-name",
}
E2E_ROWS = [row for row in PATH_ROWS if row.id in E2E]


@pytest.mark.parametrize("row", E2E_ROWS, ids=[row.id for row in E2E_ROWS])
def test_the_option_refuses_such_a_path_in_one_line(
    row: PathRow, pytester: pytest.Pytester
) -> None:
    if row.root and not IS_ROOT:
        pytest.skip(OTHER)
    pytester.makepyfile(test_it="def test_it(): pass")
    _prepare(row, pytester.path)
    before = _entries(pytester.path)
    result = pytester.runpytest(row.flag, row.value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"ERROR: {row.flag}: ")
    from fnmatch import fnmatch

    assert row.expect is not None and fnmatch(errors[0], f"*{row.expect}"), errors[0]
    assert _entries(pytester.path) == before


PLANTS = """
import os, shutil

def test_plants():
    # Another user's report, and an image of the user's own, swapped in during the run.
    os.remove("r.json")
    shutil.copy("theirs.json", "r.json")
    os.chown("r.json", 65534, 65534)
    os.remove("p.png")
    shutil.copy("photo.png", "p.png")
"""


@as_root
def test_what_is_swapped_in_during_the_run_is_left_alone(pytester: pytest.Pytester) -> None:
    # Two rows in one run: at the end, the JSON report's path holds another user's report,
    # the plot's the user's own photo; each is one warning and stays as it is.
    _our_json(pytester.path / "r.json")
    _our_json(pytester.path / "theirs.json")
    _our_plot(pytester.path / "p.png")
    (pytester.path / "photo.png").write_bytes(PHOTO)
    pytester.makepyfile(test_it=PLANTS)
    result = pytester.runpytest("--ct-report-json", "r.json", "--ct-report-plot", "p.png")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "*ReportFileWarning: ctresources: --ct-report-json *r.json was not written: *r.json "
            "belongs to uid 65534, not to you (uid 0); it is left alone*",
            "*ReportFileWarning: ctresources: --ct-report-plot *p.png was not written: *p.png "
            "exists and is not a PNG image that pytest-ctresources wrote (its VRAM plot); it is "
            "left alone*",
        ],
        consecutive=False,
    )
    assert (pytester.path / "r.json").read_bytes() == (pytester.path / "theirs.json").read_bytes()
    assert os.stat(pytester.path / "r.json").st_uid == NOBODY
    assert (pytester.path / "p.png").read_bytes() == PHOTO


# --- the ledger directory: refused in one line, and nothing of anyone's touched -----------

DAY_AND_MORE = 2 * 86400.0


def _in(directory: Path, name: str, make: object) -> None:
    assert callable(make)
    make(directory / name)


def _old(path: Path) -> None:
    import time

    then = time.time() - DAY_AND_MORE
    os.utime(path, (then, then), follow_symlinks=False)


@dataclass(frozen=True)
class LedgerRow:
    id: str
    act: str
    """"root" (the ledger directory), "file:KEY" (a GPU's budget file), "seat:RUN" (a run's
    seat board) or "prune" (old runs' seat directories)."""
    make: object = None
    """Called with (ledger directory, temp directory, victim directory) before the act."""
    expect: str | None = "*"
    """The refusal (an fnmatch pattern); None: accepted."""
    root: bool = False
    tmpdir: str | None = None
    """The temp directory, relative to the test's own (None: the test's own)."""
    survives: tuple[str, ...] = ()
    """Entries of the ledger directory that must still be there after the act."""
    gone: tuple[str, ...] = ()


def _made(ledger: Path) -> None:
    ledger.mkdir(mode=0o700)


def _victim_dir(victim: Path) -> None:
    victim.mkdir()
    (victim / "results.json").write_bytes(VICTIM)


def _root_is(make: object) -> object:
    return lambda ledger, tmp, victim: _in(ledger.parent, ledger.name, make)


def _inside(name: str, make: object, old: bool = False) -> object:
    """The ledger directory made, then ``make`` at ``name`` in it."""

    def prepare(ledger: Path, tmp: Path, victim: Path) -> None:
        _made(ledger)
        assert callable(make)
        make(ledger / name, victim)
        if old:
            _old(ledger / name)

    return prepare


def _run_dir(*files: tuple[str, object], owner: int | None = None) -> object:
    """A run's seat directory holding ``files`` ((name, make(path, victim)))."""

    def make(path: Path, victim: Path) -> None:
        path.mkdir(mode=0o700)
        for name, make_file in files:
            assert callable(make_file)
            make_file(path / name, victim)
        if owner is not None:
            os.chown(path, owner, owner)

    return make


def _plain(path: Path, victim: Path) -> None:
    path.write_bytes(b"")


def _theirs_file(path: Path, victim: Path) -> None:
    path.write_bytes(b"")
    os.chown(path, NOBODY, NOBODY)


def _link_to_victim_file(path: Path, victim: Path) -> None:
    os.symlink(victim / "results.json", path)


def _link_to_victim_dir(path: Path, victim: Path) -> None:
    os.symlink(victim, path)


def _hard_link_to_theirs(path: Path, victim: Path) -> None:
    theirs = victim / "theirs"
    theirs.write_bytes(VICTIM)
    os.chown(theirs, NOBODY, NOBODY)
    os.link(theirs, path)


def _as(make: object) -> object:
    """A maker of one path (as the report rows use) as one of (path, victim)."""
    assert callable(make)
    return lambda path, victim: make(path)


def _dir_mode(mode: int, owner: int | None = None) -> object:
    def make(path: Path) -> None:
        path.mkdir()
        os.chmod(path, mode)
        if owner is not None:
            os.chown(path, owner, owner)

    return make


REFUSED_DIR = "pytest-ctresources: the VRAM ledger directory * {}; it must be a directory of yo*"
CANNOT_USE = "pytest-ctresources: cannot use the VRAM ledger file *: it is a {}; remove it"
CANNOT_OPEN = "pytest-ctresources: cannot open the VRAM ledger file *: {}"
MODES = {"0755": 0o755, "0777": 0o777, "02770": 0o2770, "01777": 0o1777, "0000": 0o000}

LEDGER_ROWS = [
    # -- what stands where the ledger directory goes --
    LedgerRow(
        "root-a-symlink-to-my-own-directory",
        "root",
        lambda ledger, tmp, victim: (
            tmp.joinpath("mine").mkdir(mode=0o700),
            os.symlink(tmp / "mine", ledger),
        ),
        REFUSED_DIR.format("is a symbolic link (to *)"),
    ),
    LedgerRow(
        "root-a-symlink-to-a-victims-directory",
        "root",
        lambda ledger, tmp, victim: os.symlink(victim, ledger),
        REFUSED_DIR.format("is a symbolic link (to *)"),
    ),
    LedgerRow(
        "root-a-dangling-symlink",
        "root",
        _root_is(_symlink("nowhere")),
        REFUSED_DIR.format("is a symbolic link (to 'nowhere')"),
    ),
    LedgerRow(
        "root-a-symlink-to-itself",
        "root",
        lambda ledger, tmp, victim: os.symlink(ledger.name, ledger),
        REFUSED_DIR.format("is a symbolic link (to *)"),
    ),
    LedgerRow(
        "root-a-symlink-to-etc",
        "root",
        _root_is(_symlink("/etc")),
        REFUSED_DIR.format("is a symbolic link (to '/etc')"),
    ),
    LedgerRow(
        "root-a-regular-file",
        "root",
        _root_is(_file(b"x")),
        REFUSED_DIR.format("is not a directory but a regular file"),
    ),
    LedgerRow(
        "root-an-empty-file",
        "root",
        _root_is(_file(b"")),
        REFUSED_DIR.format("is not a directory but a regular file"),
    ),
    LedgerRow(
        "root-another-users-file",
        "root",
        _root_is(_file(b"", NOBODY)),
        REFUSED_DIR.format("is not a directory but a regular file"),
        root=True,
    ),
    LedgerRow(
        "root-a-fifo",
        "root",
        _root_is(os.mkfifo),
        REFUSED_DIR.format("is not a directory but a FIFO"),
    ),
    LedgerRow(
        "root-a-socket",
        "root",
        _root_is(_socket),
        REFUSED_DIR.format("is not a directory but a socket"),
    ),
    LedgerRow(
        "root-a-char-device",
        "root",
        _root_is(_node(0o020000, 1, 7)),
        REFUSED_DIR.format("is not a directory but a device node"),
        root=True,
    ),
    LedgerRow(
        "root-a-block-device",
        "root",
        _root_is(_node(0o060000, 7, 0)),
        REFUSED_DIR.format("is not a directory but a device node"),
        root=True,
    ),
    *[
        LedgerRow(
            f"root-another-users-directory-{name}",
            "root",
            _root_is(_dir_mode(mode, NOBODY)),
            REFUSED_DIR.format("belongs to uid 65534, not to you (uid 0)"),
            root=True,
        )
        for name, mode in MODES.items()
    ],
    *[
        LedgerRow(
            f"root-my-own-directory-{name}-is-made-private", "root", _root_is(_dir_mode(mode)), None
        )
        for name, mode in MODES.items()
    ],
    # -- the temp directory it goes in --
    LedgerRow(
        "tmpdir-missing",
        "root",
        None,
        REFUSED_DIR.format("cannot be created (No such file or directory)"),
        tmpdir="missing",
    ),
    LedgerRow(
        "tmpdir-a-regular-file",
        "root",
        lambda ledger, tmp, victim: tmp.joinpath("afile").write_bytes(b""),
        REFUSED_DIR.format("cannot be created (Not a directory)"),
        tmpdir="afile",
    ),
    LedgerRow(
        "tmpdir-of-4000-characters",
        "root",
        None,
        REFUSED_DIR.format("cannot be created (File name too long)"),
        tmpdir="t" * 4000,
    ),
    LedgerRow(
        "tmpdir-with-a-newline-and-a-symlink-in-it",
        "root",
        lambda ledger, tmp, victim: (ledger.parent.mkdir(), os.symlink("/", ledger)),
        REFUSED_DIR.format("is a symbolic link (to '/')"),
        tmpdir="new\nline",
    ),
    LedgerRow(
        "tmpdir-with-an-escape-sequence-and-a-file-in-it",
        "root",
        lambda ledger, tmp, victim: (ledger.parent.mkdir(), ledger.write_bytes(b"")),
        REFUSED_DIR.format("is not a directory but a regular file"),
        tmpdir="\x1b[2J",
    ),
    LedgerRow(
        "tmpdir-with-a-newline-is-usable",
        "root",
        lambda ledger, tmp, victim: ledger.parent.mkdir(),
        None,
        tmpdir="new\nline",
    ),
    # -- a GPU's budget file --
    LedgerRow(
        "file-a-symlink-to-a-victims-file",
        "file:GPU-0",
        _inside("GPU-0.ledger", _link_to_victim_file),
        CANNOT_OPEN.format("it is a symbolic link (to *results.json'); remove it"),
    ),
    LedgerRow(
        "file-a-dangling-symlink",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(_symlink("nowhere"))),
        CANNOT_OPEN.format("it is a symbolic link (to 'nowhere'); remove it"),
    ),
    LedgerRow(
        "file-a-fifo",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(os.mkfifo)),
        CANNOT_USE.format("FIFO, not a regular file"),
    ),
    LedgerRow(
        "file-a-directory",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(lambda path: path.mkdir())),
        CANNOT_USE.format("directory, not a regular file"),
    ),
    LedgerRow(
        "file-a-socket",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(_socket)),
        CANNOT_USE.format("socket, not a regular file"),
    ),
    LedgerRow(
        "file-a-char-device",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(_node(0o020000, 1, 7))),
        CANNOT_USE.format("device node, not a regular file"),
        root=True,
    ),
    LedgerRow(
        "file-a-block-device",
        "file:GPU-0",
        _inside("GPU-0.ledger", _as(_node(0o060000, 7, 0))),
        CANNOT_USE.format("device node, not a regular file"),
        root=True,
    ),
    LedgerRow(
        "file-another-users-file",
        "file:GPU-0",
        _inside("GPU-0.ledger", _theirs_file),
        "*cannot use the VRAM ledger file *: it belongs to uid 65534, not to you*",
        root=True,
    ),
    LedgerRow(
        "file-a-hard-link-to-another-users-file",
        "file:GPU-0",
        _inside("GPU-0.ledger", _hard_link_to_theirs),
        "*cannot use the VRAM ledger file *: it belongs to uid 65534, not to you*",
        root=True,
    ),
    *[
        LedgerRow(f"file-a-gpu-key-{name}", f"file:{key}", None, None)
        for name, key in [
            ("climbing-out", "../../victim"),
            ("absolute", "/etc/passwd"),
            ("empty", ""),
            ("a-slash", "a/b"),
            ("a-nul", "a\0b"),
            ("dot", "."),
            ("dot-dot", ".."),
            ("a-newline", "GPU\n0"),
            ("an-escape-sequence", "\x1b[2J"),
            ("non-ascii", "GPU-é-0"),
        ]
    ],
    LedgerRow(
        "file-a-gpu-key-of-300-characters",
        "file:" + "g" * 300,
        None,
        CANNOT_OPEN.format("File name too long"),
    ),
    # -- a run's seat board --
    LedgerRow(
        "seat-the-run-directory-a-symlink-to-a-victim",
        "seat:r1",
        _inside("run-r1", _link_to_victim_dir),
        REFUSED_DIR.format("is a symbolic link (to *)"),
    ),
    LedgerRow(
        "seat-the-run-directory-a-file",
        "seat:r1",
        _inside("run-r1", _plain),
        REFUSED_DIR.format("is not a directory but a regular file"),
    ),
    LedgerRow(
        "seat-the-run-directory-another-users",
        "seat:r1",
        _inside("run-r1", _run_dir(owner=NOBODY)),
        REFUSED_DIR.format("belongs to uid 65534, not to you (uid 0)"),
        root=True,
    ),
    LedgerRow(
        "seat-the-seats-file-a-symlink-to-a-victim",
        "seat:r1",
        _inside("run-r1", _run_dir(("seats", _link_to_victim_file))),
        CANNOT_OPEN.format("it is a symbolic link (to *results.json'); remove it"),
    ),
    LedgerRow(
        "seat-the-seats-file-a-fifo",
        "seat:r1",
        _inside("run-r1", _run_dir(("seats", _as(os.mkfifo)))),
        CANNOT_USE.format("FIFO, not a regular file"),
    ),
    LedgerRow(
        "seat-the-seats-file-another-users",
        "seat:r1",
        _inside("run-r1", _run_dir(("seats", _theirs_file))),
        "*it belongs to uid 65534, not to you*",
        root=True,
    ),
    *[
        LedgerRow(f"seat-a-run-id-{name}", f"seat:{run}", None, None)
        for name, run in [
            ("climbing-out", "../../victim"),
            ("empty", ""),
            ("a-newline", "r\n1"),
            ("an-escape-sequence", "\x1b]0;title\x07"),
        ]
    ],
    LedgerRow(
        "seat-a-run-id-of-300-characters",
        "seat:" + "r" * 300,
        None,
        REFUSED_DIR.format("cannot be created (File name too long)"),
    ),
    # -- pruning old runs: only what the plugin made goes --
    *[
        LedgerRow(
            f"prune-{name}",
            "prune",
            _inside(entry, make, old=True),
            None,
            root=root,
            survives=(entry,),
        )
        for name, entry, make, root in [
            ("a-symlink-to-a-victims-directory", "run-a", _link_to_victim_dir, False),
            ("a-regular-file", "run-b", _plain, False),
            ("another-users-directory", "run-c", _run_dir(("seats", _plain), owner=NOBODY), True),
            (
                "a-foreign-file-inside",
                "run-d",
                _run_dir(("seats", _plain), ("notes", _plain)),
                False,
            ),
            (
                "seats-a-symlink-to-a-victim",
                "run-e",
                _run_dir(("seats", _link_to_victim_file)),
                False,
            ),
            (
                "a-subdirectory-inside",
                "run-f",
                _run_dir(("seats", _plain), ("sub.ledger", _as(lambda path: path.mkdir()))),
                False,
            ),
            ("seats-a-fifo", "run-g", _run_dir(("seats", _as(os.mkfifo))), False),
            ("seats-another-users", "run-h", _run_dir(("seats", _theirs_file)), True),
            (
                "seats-a-hard-link-to-another-users-file",
                "run-i",
                _run_dir(("seats", _hard_link_to_theirs)),
                True,
            ),
            ("not-a-run-directory", "experiments", _run_dir(("seats", _plain)), False),
            ("a-recent-run", "run-k", _run_dir(("seats", _plain)), False),
        ]
        if name != "a-recent-run"
    ],
    LedgerRow(
        "prune-a-recent-run-stays",
        "prune",
        _inside("run-k", _run_dir(("seats", _plain))),
        None,
        survives=("run-k",),
    ),
    LedgerRow(
        "prune-an-old-run-of-ours-goes",
        "prune",
        _inside("run-j", _run_dir(("seats", _plain), ("x.ledger", _plain)), old=True),
        None,
        gone=("run-j",),
    ),
]


@pytest.mark.parametrize("row", LEDGER_ROWS, ids=[row.id for row in LEDGER_ROWS])
def test_the_ledger_directory_refuses_what_is_not_its_own_in_one_line(
    row: LedgerRow, private_temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stat
    import tempfile
    from fnmatch import fnmatch

    from pytest_ctresources.leases import ledger as ledger_module

    if row.root and not IS_ROOT:
        pytest.skip(OTHER)
    tmp = private_temp_dir
    if row.tmpdir is not None:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp / row.tmpdir))
    ledger = ledger_module.ledger_root()
    victim = tmp / "victim"
    _victim_dir(victim)
    if callable(row.make):
        row.make(ledger, tmp, victim)
    victim_before = _entries(victim)
    try:
        before = _entries(ledger) if ledger.is_dir() and not ledger.is_symlink() else {}
    except OSError:
        before = {}
    kind, _, argument = row.act.partition(":")
    try:
        if kind == "root":
            ledger_module.ensure_root()
        elif kind == "file":
            ledger_module.ensure_root()
            opened = ledger_module.VramLedger(ledger_module.ledger_path(argument), 1.0).open()
            assert ledger_module.ledger_path(argument).parent == ledger
            opened.close()
        elif kind == "seat":
            ledger_module.ensure_root()
            ledger_module.seat_board(argument).close()
            assert ledger_module.run_dir(argument).parent == ledger
        else:
            ledger_module.prune_old_runs(current=None)
    except ledger_module.LedgerDirError as exc:
        message = str(exc)
        assert row.expect is not None, message
        assert "\n" not in message and "\x1b" not in message, repr(message)
        assert fnmatch(message, row.expect), message
        if before:
            assert _entries(ledger) == before
    else:
        assert row.expect is None, f"accepted, where {row.expect!r} was expected"
        info = os.lstat(ledger)
        assert stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o077
    assert _entries(victim) == victim_before
    for name in row.survives:
        assert os.path.lexists(ledger / name), name
        assert _entries(ledger)[name] == before[name]
    for name in row.gone:
        assert not os.path.lexists(ledger / name), name
