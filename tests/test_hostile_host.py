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
