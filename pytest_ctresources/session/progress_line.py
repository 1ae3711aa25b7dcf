"""A live progress line on the terminal while a long attribution runs (without pytest-xdist).

A real-size attribution takes seconds to minutes, and pytest's output capture hides
circuit-tracer's own progress. Once an ``attribute()`` call has run ``ct_progress_after``
seconds, the line shows its phase, backward batches and time after the test's own line
(``test_x.py::test_y  ctresources: backward 7/17 batches of 64, 12.3 s (setup 0.4, forward
2.1)``), shortened to the terminal's width, and is erased when the call ends, so pytest's own
output (the test's outcome on that line, its ``[100%]`` at the right edge) reads as without it.
A ``ct_session.graph_files`` or ``ct_session.prune`` call gets the same line (``pruning 12,345
nodes on cuda:0, 3.2 s``, then ``writing the graph files, ...``).

It is redrawn when circuit-tracer moves on (a phase starts, a backward batch ends) and, since
one forward pass or one batch of a large model takes many seconds, by a ticker thread twice a
second, so its timer moves. Both write to a duplicate of the terminal's descriptor, taken
while pytest's capture is suspended: pytest's capture is left alone (suspending it from a
second thread would let the test's own output through), and pytest's terminal writer, whose
count of the current line aligns the ``[ 50%]`` column, never sees the line. The line starts
where that count says pytest's text ends, and the width is the one pytest's writer uses
(``COLUMNS``, else the terminal's size), read from the terminal itself: while a test runs,
pytest's own reading of it sees the capture file and falls back to 80 columns.

Off under ``-q``, when the terminal is not a terminal (a pipe, a CI log), in xdist workers
(whose output is not the terminal: the summary reports their attributions' times instead),
and where the test's own output or pytest's live logging writes to the terminal meanwhile
(``-s``, ``--capture=tee-sys``, ``log_cli``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest

from pytest_ctresources.session.progress import Progress

#: Redrawn at most this often, and at least this often while shown (the ticker).
INTERVAL_S = 0.5
PREFIX = "ctresources: "
#: Between pytest's text and the line.
GAP = "  "
#: The least room worth showing the line in (the prefix and a timer).
MIN_ROOM = len(PREFIX) + len("setup 0.0 s")
# ANSI: save the cursor, restore it, clear to the end of the line.
_SAVE, _RESTORE, _CLEAR = "\x1b7", "\x1b8", "\x1b[K"


def enabled(config: pytest.Config) -> bool:
    """Whether this run shows live lines at all."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return (
        reporter is not None
        and config.get_verbosity() >= 0
        and not hasattr(config, "workerinput")
        and bool(getattr(reporter, "isatty", False))
        and os.environ.get("TERM") != "dumb"
        and config.getoption("capture", "fd") not in ("no", "tee-sys")
        # pytest's own test for live logging (LoggingPlugin._log_cli_enabled)
        and config.getoption("log_cli_level", None) is None
        and not config.getini("log_cli")
    )


def terminal_width(fd: int) -> int:
    """The width pytest's terminal writer uses (``_pytest._io.terminalwriter``'s
    ``get_terminal_width``, which is ``shutil.get_terminal_size``'s), of the terminal ``fd``
    is open on rather than of the captured stdout."""
    try:  # as shutil.get_terminal_size reads it: '²' passes isdigit() and fails int()
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        width = 0
    if width <= 0:
        try:
            width = os.get_terminal_size(fd).columns
        except OSError:
            width = 0
    return width if width >= 40 else 80  # pytest's floor for a bogus size


def fitted(timing: Progress, room: int) -> str:
    """The longest description of ``timing`` that fits ``room`` columns, with the prefix;
    the shortest cut to ``room`` when none does."""
    lines = [PREFIX + text for text in timing.descriptions()]
    return next((line for line in lines if len(line) <= room), lines[-1][: max(room, 0)])


class LiveLine:
    """The progress line of a test's attributions and prunings (the listener of their
    timings). Erased as each call ends, before pytest reports the test's outcome on that line."""

    def __init__(self, config: pytest.Config, after_s: float) -> None:
        self._config = config
        self._after_s = after_s
        # Draws come from the test's thread (the probe) and the ticker.
        self._lock = threading.Lock()
        self._timing: Progress | None = None
        self._fd: int | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._shown = False
        self._started = False  # this call's terminal and ticker were asked for
        self._last = 0.0

    def update(self, timing: Progress) -> None:
        """The call moved on (the probe, in the test's thread)."""
        self._timing = timing
        if self._ticker is None and not self._started:
            self._started = True
            self._start()
        self._draw()

    def done(self) -> None:
        """Take the line back off the terminal (the attribution ended)."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            self._stop.set()
            ticker.join()
        with self._lock:
            if self._shown:
                self._write(_RESTORE + _CLEAR + "\b" * len(GAP) + _CLEAR)
                self._shown = False
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._timing, self._last, self._started = None, 0.0, False

    def _start(self) -> None:
        """The terminal's descriptor and the ticker, once per call (in the test's thread)."""
        self._fd = _terminal_fd(self._config)
        if self._fd is None:  # not a terminal after all: nothing to tick for
            return
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="ctresources-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            timing, now = self._timing, time.monotonic()
            if (
                timing is None
                or self._fd is None
                or timing.elapsed_s < self._after_s
                or now - self._last < INTERVAL_S * 0.9  # the ticker's wait is not exact
            ):
                return
            self._last = now
            start = self._config.get_terminal_writer().width_of_current_line
            # One column short of the edge: a character there leaves a terminal about to wrap.
            room = terminal_width(self._fd) - start - len(GAP) - 1
            if not self._shown:
                if room < MIN_ROOM:
                    return
                self._write(GAP + _SAVE + fitted(timing, room))
                self._shown = True
            else:
                self._write(_RESTORE + _CLEAR + fitted(timing, room))

    def _write(self, text: str) -> None:
        if self._fd is None:
            return
        data = text.encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # the terminal went away: no more lines
            os.close(self._fd)
            self._fd = None


def _terminal_fd(config: pytest.Config) -> int | None:
    """A duplicate of the descriptor pytest's terminal output goes to, or None (not a
    terminal). Taken with the capture suspended: while a test runs, fd 1 is the capture's file."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    suspended = (
        capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
    )
    with suspended:
        try:
            fd = os.dup(sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):  # a stdout without a descriptor
            return None
    if not os.isatty(fd):
        os.close(fd)
        return None
    return fd
