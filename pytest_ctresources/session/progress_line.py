"""A live progress line on the terminal while a long attribution runs (without pytest-xdist).

A real-size attribution takes seconds to minutes, and pytest's output capture hides
circuit-tracer's own progress. Once an ``attribute()`` call has run ``ct_progress_after``
seconds, the line shows its phase and backward batches after the test's own line
(``test_x.py::test_y  ctresources: backward 7/17 batches of 64, 12.3 s (setup 0.4, forward
2.1)``), rewritten at most twice a second, and is erased when the call ends, so pytest's own
output (the test's outcome on that line) reads as without it.

It is written from the test's own thread, between circuit-tracer's steps (the probe of
:mod:`pytest_ctresources.session.progress` calls it), with pytest's capture suspended for
the write as pytest's live logging does, so it never interleaves with the test's output. Off
under ``-q``,
when the terminal is not a terminal (a pipe, a CI log), and in xdist workers (whose output is
not the terminal: the summary reports their attributions' times instead).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from pytest_ctresources.session.progress import AttributionTiming

#: Rewrites at most this often.
INTERVAL_S = 0.5
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
    )


class LiveLine:
    """The progress line of a test's attributions (the listener of their probes). Erased as
    each call ends, before pytest reports the test's outcome on that line."""

    def __init__(self, config: pytest.Config, after_s: float) -> None:
        self._config = config
        self._after_s = after_s
        self._shown = False
        self._last = 0.0

    def update(self, timing: AttributionTiming) -> None:
        now = time.monotonic()
        if timing.elapsed_s < self._after_s or now - self._last < INTERVAL_S:
            return
        self._last = now
        writer = self._config.get_terminal_writer()
        room = writer.fullwidth - writer.width_of_current_line - 2
        text = f"ctresources: {timing.describe()}"[: max(room, 0)]
        self._write((_RESTORE + _CLEAR if self._shown else "  " + _SAVE) + text)
        self._shown = True

    def done(self) -> None:
        """Take the line back off the terminal (the attribution ended)."""
        if self._shown:
            self._write(_RESTORE + _CLEAR)
            self._shown = False

    def _write(self, text: str) -> None:
        # Straight to the terminal, not through pytest's TerminalWriter: its count of what
        # the current line holds (which aligns the "[ 50%]" column) must not see this text.
        capture = self._config.pluginmanager.get_plugin("capturemanager")
        if capture is None:
            _write_out(text)
            return
        with capture.global_and_fixture_disabled():
            _write_out(text)


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
