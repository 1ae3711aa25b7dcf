"""The live progress line on a real pseudo-terminal of a given size.

pytest runs in a subprocess whose stdout is a pty with its window size set through
``TIOCSWINSZ`` and no ``COLUMNS``, as in a user's terminal (bash does not export it). The
test's forward pass is held until this test has seen the line's timer move twice, so the
timer can only move through the periodic refresh, not through circuit-tracer's own steps.
What the terminal shows is replayed through :class:`Screen`, a small terminal model, to
check that nothing the line wrote wrapped and that pytest's ``[100%]`` ends on the test's
own row.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

#: Bounds every wait of this file; an attribution of the tiny model takes well under this.
DEADLINE_S = 240.0
#: The live line refreshes twice a second; on this loaded machine, allow far more.
MOVE_WITHIN_S = 60.0

HELD_FORWARD = """
import os
import select


def test_attribution(ct_session):
    model = ct_session.load_model()
    forward = model.run_forward_pass

    def held(*args, **kwargs):
        # The outer test writes a byte once it has seen the line's timer move.
        ready, _, _ = select.select([int(os.environ["RELEASE_FD"])], [], [], 200)
        assert ready, "never released"
        return forward(*args, **kwargs)

    model.run_forward_pass = held
    try:
        ct_session.attribute(ct_session.cfg.params["PROMPT"])
    finally:
        del model.run_forward_pass
"""

#: The live line during the forward pass, in any of its lengths; group 1 is its timer.
FORWARD = re.compile(r"ctresources: forward(?: pass of \d+ copies,)? (\d+\.\d) s")


@dataclass
class Screen:
    """What a VT100-like terminal of ``width`` columns shows after the bytes it was given:
    printable characters (with xterm's deferred wrap at the last column), CR, LF, BS, tab,
    ESC 7 / ESC 8 (save / restore the cursor), CSI K (erase to the end of the line) and CSI D
    (cursor back); other CSI sequences (colours) change nothing here. Rows never scroll
    away, and every automatic wrap is remembered with the row it left."""

    width: int
    rows: list[list[str]] = field(default_factory=lambda: [[]])
    row: int = 0
    col: int = 0
    pending_wrap: bool = False
    saved: tuple[int, int] = (0, 0)
    wrapped_rows: list[str] = field(default_factory=list)

    def _line(self) -> list[str]:
        while len(self.rows) <= self.row:
            self.rows.append([])
        return self.rows[self.row]

    def _put(self, char: str) -> None:
        if self.pending_wrap:
            self.wrapped_rows.append("".join(self._line()))
            self.row, self.col, self.pending_wrap = self.row + 1, 0, False
        line = self._line()
        line.extend(" " * (self.col + 1 - len(line)))
        line[self.col] = char
        if self.col == self.width - 1:
            self.pending_wrap = True
        else:
            self.col += 1

    def feed(self, text: str) -> None:
        index = 0
        while index < len(text):
            char = text[index]
            index += 1
            if char == "\x1b":
                if text.startswith("[", index):
                    match = re.compile(r"\[([0-9;?]*)([@-~])").match(text, index)
                    assert match, f"an unfinished escape sequence: {text[index : index + 10]!r}"
                    index = match.end()
                    self._csi(match.group(1), match.group(2))
                else:
                    code = text[index : index + 1]
                    index += 1
                    if code == "7":
                        self.saved = (self.row, self.col)
                    elif code == "8":
                        (self.row, self.col), self.pending_wrap = self.saved, False
            elif char == "\r":
                self.col, self.pending_wrap = 0, False
            elif char == "\n":
                self.row, self.pending_wrap = self.row + 1, False
            elif char == "\b":
                self.col, self.pending_wrap = max(self.col - 1, 0), False
            elif char == "\t":
                for _ in range(8 - self.col % 8):
                    self._put(" ")
            elif char >= " ":
                self._put(char)

    def _csi(self, params: str, final: str) -> None:
        count = int(params) if params.isdigit() else 1
        if final == "K" and params in ("", "0"):
            del self._line()[self.col :]
        elif final == "D":
            self.col, self.pending_wrap = max(self.col - count, 0), False

    def lines(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.rows]


def _run_held(path: Path, width: int) -> tuple[str, list[float], int]:
    """pytest -v in ``path`` on a pty ``width`` columns wide; releases the held forward pass
    once the line's timer has shown two values. What the terminal got, the forward timers
    seen before the release, and pytest's exit status."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    release_read, release_write = os.pipe()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(TERM="xterm", PYTHONUNBUFFERED="1", RELEASE_FD=str(release_read))
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-v"],
        cwd=path,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env=env,
        pass_fds=(release_read,),
    )
    os.close(secondary)
    os.close(release_read)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text, timers, released = "", [], False
    deadline = time.monotonic() + DEADLINE_S
    # Once the forward pass shows, its timer has this long to move before it is released
    # anyway (and the test fails on the timers): a stalled timer must not cost DEADLINE_S.
    give_up: float | None = None
    try:
        while time.monotonic() < deadline:
            wait = min(deadline, give_up or deadline) - time.monotonic()
            ready, _, _ = select.select([main], [], [], max(wait, 0))
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                text += decoder.decode(chunk)
            if not released:
                timers = [float(value) for value in FORWARD.findall(text)]
                if timers and give_up is None:
                    give_up = time.monotonic() + MOVE_WITHIN_S
                if len(set(timers)) >= 2 or (give_up is not None and time.monotonic() > give_up):
                    os.write(release_write, b"x")
                    released, give_up = True, None
            elif not ready:
                break
        status = child.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(release_write)
        os.close(main)
    return text, timers, status


@pytest.mark.parametrize("width", [160, 64])
def test_the_live_line_fits_the_terminal_moves_and_leaves_pytests_line_whole(
    pytester: pytest.Pytester, width: int
) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makeini("[pytest]\nct_config = exp.yaml\nct_progress_after = 0\n")
    pytester.makepyfile(test_live=HELD_FORWARD)
    out, timers, status = _run_held(pytester.path, width)
    screen = Screen(width)
    screen.feed(out)
    assert status == 0, "\n".join(screen.lines())
    # The timer moved while circuit-tracer was inside one step (the forward pass was held).
    assert len(set(timers)) >= 2 and timers == sorted(timers), timers
    assert not [row for row in screen.wrapped_rows if "test_attribution" in row], (
        screen.wrapped_rows
    )
    # Drawn after the test's own text with the cursor saved, erased by restoring it and
    # clearing to the end of the line; pytest's PASSED follows the last erasure.
    assert "test_live.py::test_attribution " in out.split("\x1b7ctresources: ", 1)[0]
    assert "\x1b8\x1b[K" in out[out.index("\x1b7ctresources:") :]
    assert "PASSED" in out[out.rindex("\x1b8\x1b[K") :].split("\n", 1)[0]
    shown = list(FORWARD.finditer(out))
    if width >= 120:  # room for the whole line: the phases done so far are there too
        assert all(out.startswith(" (setup ", line.end()) for line in shown), out
    (row,) = [line for line in screen.lines() if line.startswith("test_live.py::test_attr")]
    # Erased: pytest's own line as without the live line, its [100%] at the right edge.
    assert "ctresources" not in row
    assert row.startswith("test_live.py::test_attribution PASSED")
    assert row.endswith("[100%]") and len(row) == width - 1, row
