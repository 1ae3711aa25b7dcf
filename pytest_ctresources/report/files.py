"""The report files: ``--ct-report-json`` (docs/report-schema.md) and ``--ct-report-plot``.

They never destroy anything (docs/security.md): the path is checked at start-up
(:func:`check_target`: a symlink, a directory, a device node or a file that is not a report
is refused), and each file is written to a temporary file created exclusively beside it,
then renamed over it only if it is still a regular file or absent (:func:`write_file`). A
failure at session end is one warning (:func:`write_reports`); the run's outcome stands.
:class:`SigtermReport` writes the JSON report when the run is terminated (``timeout``,
Slurm, CI cancellation), as at Ctrl-C.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import pytest

from pytest_ctresources.exceptions import ReportFileWarning
from pytest_ctresources.settings.config import shown

if TYPE_CHECKING:
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.report.summary import RunSummary, SummaryReporter

SCHEMA = "pytest-ctresources-report"
SCHEMA_VERSION = 2
JSON_FLAG = "--ct-report-json"
PLOT_FLAG = "--ct-report-plot"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: How every JSON report begins: an object whose first key is ``schema``, the report's
#: (``json.dumps`` keeps it first; any spacing, as a tool that rewrites the file may leave).
JSON_MARK = re.compile(rb'\{\s*"schema"\s*:\s*"' + re.escape(SCHEMA.encode()) + rb'"\s*,')
#: The PNG ``tEXt`` chunk that marks a VRAM plot the plugin wrote (matplotlib writes it,
#: after ``IHDR``, from ``savefig(metadata=...)``): any other PNG is someone's image.
PLOT_MARK_KEY = "pytest-ctresources"
PLOT_MARK_VALUE = "vram-plot"
#: How much of an existing file is read to recognise a report (the marks are at its start).
HEAD_BYTES = 4096


class TargetError(ValueError):
    """A report path that the plugin will not write; the message is one line."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link (a report is never written through one: name its target)"
    if stat.S_ISDIR(mode):
        return "a directory, not a file path"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node, not a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def named(value: str) -> str:
    """A path as a one-line message shows it: as typed, or, holding a control character
    (a newline, an escape sequence) or too long to read, escaped and shortened as pytest
    shows a node id."""
    return value if value.isprintable() and len(value) <= 200 else shown(value)


def _png_marked(head: bytes) -> bool:
    """Whether ``head`` is the start of a PNG holding the plugin's ``tEXt`` mark before its
    image data (chunks: 4-byte length, 4-byte type, data, 4-byte CRC)."""
    if not head.startswith(PNG_MAGIC):
        return False
    mark = PLOT_MARK_KEY.encode("latin-1") + b"\0" + PLOT_MARK_VALUE.encode("latin-1")
    offset = len(PNG_MAGIC)
    while offset + 8 <= len(head):
        length = int.from_bytes(head[offset : offset + 4], "big")
        kind = head[offset + 4 : offset + 8]
        if kind in (b"IDAT", b"IEND") or offset + 12 + length > len(head):
            return False  # (a chunk cut short, or longer than the file: not ours)
        if kind == b"tEXt" and head[offset + 8 : offset + 8 + length] == mark:
            return True
        offset += 12 + length
    return False


def _recognised(head: bytes, flag: str) -> bool:
    """Whether ``head`` (the start of a file) is a report of ``flag``'s kind the plugin wrote."""
    return _png_marked(head) if flag == PLOT_FLAG else JSON_MARK.match(head) is not None


def refusal(path: Path, value: str, flag: str) -> str | None:
    """Why the entry at ``path`` may not be replaced by a report of ``flag``, in one line; None
    when nothing is there or it is a report of that kind the plugin wrote for this user.

    Only such a file is replaced (issue 21, N3): not any PNG, not another user's report (root
    would make it root's and 0600), not another user's empty file. The user's own empty file
    is a name reserved for the report (``mktemp``) and is replaced. Never follows a link and
    never opens anything but a regular file (opening a device can have effects); the checks
    are made on what was opened.
    """
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(seen.st_mode):
        return f"{value} is {_kind(seen.st_mode)}"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        return f"{value} cannot be read to tell whether it is a report ({exc.strerror})"
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(
            info.st_mode
        ):
            return f"{value} changed while it was looked at"
        if info.st_uid != os.geteuid():
            return f"{value} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
        if info.st_size == 0:
            return None
        head = handle.read(HEAD_BYTES)
    if _recognised(head, flag):
        return None
    what = (
        "a PNG image that pytest-ctresources wrote (its VRAM plot)"
        if flag == PLOT_FLAG
        else "a pytest-ctresources JSON report"
    )
    return f"{value} exists and is not {what}"


def check_target(value: str, flag: str, invocation_dir: Path) -> Path:
    """The path a report of ``flag`` goes to, checked at start-up rather than after an hour
    of tests. Raises :class:`TargetError` for a path the plugin will not write."""
    if "\0" in value:
        raise TargetError(f"{shown(value)} is not a valid path (it contains a NUL character)")
    path = invocation_dir / value
    value = named(value)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # ENOTDIR (a component is a file), ENAMETOOLONG, ELOOP, EACCES
        raise TargetError(f"cannot write {value}: {exc.strerror}") from None
    parent = path.parent
    if mode is not None and not stat.S_ISREG(mode):
        raise TargetError(f"{value} is {_kind(mode)}")
    if not parent.is_dir():
        raise TargetError(f"cannot write {value}: directory {named(str(parent))} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        mode is not None and not os.access(path, os.W_OK)
    ):
        raise TargetError(f"cannot write {value}: permission denied")
    if mode is not None and (problem := refusal(path, value, flag)) is not None:
        raise TargetError(f"{problem}: it is not replaced (remove it, or name another path)")
    return path


def check_plot_support() -> str | None:
    """Why ``--ct-report-plot`` cannot work here (matplotlib is an optional dependency)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def build_report(
    summary: RunSummary,
    runtime: Runtime,
    exitstatus: int | None,
    capacity_gib: float | None,
    capacity_note: str,
    signal_name: str | None = None,
) -> dict[str, Any]:
    """The JSON document: every per-test record, GPU facts, settings with provenance.

    ``signal_name``: the signal that is terminating the run (the report is then written
    from the signal handler, before the run has finished)."""
    settings = runtime.settings
    capacity = settings.vram_capacity_gib
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exitstatus": exitstatus,
        "interrupted": exitstatus == 2 or signal_name is not None,
        "signal": signal_name,
        "gpus": runtime.gpu_facts(may_import_torch=False).to_dict(),
        "capacity": {
            "gib": capacity_gib,
            "description": capacity_note,
            "emulated": capacity is not None,
            "source": str(capacity.source) if capacity is not None else None,
        },
        "settings": {
            "config": settings.session_config().to_dict(),
            "experiment_config": settings.experiment.path if settings.experiment else None,
            "cleanup": {"value": settings.cleanup.value, "source": str(settings.cleanup.source)},
            "alloc_conf": {
                "value": settings.alloc_conf.value,
                "source": str(settings.alloc_conf.source),
            },
            "leak_threshold_bytes": {
                "value": settings.leak_threshold_bytes.value,
                "source": str(settings.leak_threshold_bytes.source),
            },
            "oom_retry": {
                "value": settings.oom_retry.value,
                "source": str(settings.oom_retry.source),
            },
            "oom_retry_floor": settings.oom_retry_floor.value,
            "strict": settings.strict,
        },
        "tests": [record.to_dict() for record in summary.records.values()],
        "placements": [placement.to_dict() for placement in summary.placements.values()],
        "attributions": summary.attributions,
        "auto_batch_sizes": summary.auto_choices,
        "vram_skips": summary.vram_skips,
        "resident_models": summary.resident_models,
        "attribution_timings": summary.timings,
        "reruns": summary.reruns,
        "notebook_values": {
            nodeid: [
                {"name": name, "value": value, "source": where} for name, value, where in entries
            ]
            for nodeid, entries in summary.notebook_values.items()
        },
        "peak_increases": list(summary.increases.values()),
        "gpu_coverage": summary.coverage.to_dict() if summary.coverage is not None else None,
    }


def write_file(path: Path, write: Callable[[IO[bytes]], None], flag: str | None = None) -> None:
    """Write ``path`` without ever destroying what is there if it fails or is not ours.

    ``write`` fills a temporary file created exclusively (``O_EXCL``, mode 0600, never
    through a link) in the same directory; it is synced, then renamed over ``path`` only if
    ``path`` is still a regular file or absent, and, for a report of ``flag``, one the plugin
    wrote for this user (:func:`refusal`: what another user put there during the run is
    theirs). A reader never sees a half-written file, a failure (disk full, directory gone,
    read-only file system) leaves the old file intact and no temporary behind, and a device
    node or a link planted at ``path`` during the run is left alone. Raises ``OSError`` or
    :class:`TargetError`.
    """
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # a full disk shows here, before the old file goes
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise TargetError(f"{named(str(path))} is now {_kind(mode)}; it is left alone")
        if flag is not None and (problem := refusal(path, named(str(path)), flag)) is not None:
            raise TargetError(f"{problem}; it is left alone")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as the JSON report at ``path`` (:func:`write_file`)."""

    def dump(handle: IO[bytes]) -> None:
        handle.write(json.dumps(document, indent=2, default=str).encode("utf-8") + b"\n")

    write_file(path, dump, JSON_FLAG)


def write_plot(
    path: Path, summary: RunSummary, capacity_gib: float | None, capacity_note: str
) -> None:
    """The VRAM plot (report/plot.py) as a PNG at ``path`` (:func:`write_file`)."""
    from pytest_ctresources.report import plot

    drawn = plot.figure(summary, capacity_gib, capacity_note)
    # The mark tells a later run this file is the plugin's to replace (refusal).
    metadata = {PLOT_MARK_KEY: PLOT_MARK_VALUE}
    write_file(
        path,
        lambda handle: drawn.savefig(handle, format="png", dpi=plot.DPI, metadata=metadata),
        PLOT_FLAG,
    )


def _reason(exc: BaseException, path: Path) -> str:
    if isinstance(exc, FileNotFoundError) and not path.parent.is_dir():
        return f"its directory {named(str(path.parent))} no longer exists"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror  # the temporary file's name, in exc.filename, would only confuse
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _attempt(flag: str, path: Path, write: Callable[[], None]) -> bool:
    try:
        write()
    except Exception as exc:  # a report that cannot be written never changes the outcome
        warnings.warn(
            ReportFileWarning(
                f"ctresources: {flag} {named(str(path))} was not written: {_reason(exc, path)}; "
                "the file "
                "there, if any, is unchanged"
            ),
            stacklevel=1,
        )
        return False
    return True


def write_reports(
    reporter: SummaryReporter, exitstatus: int | None, signal_name: str | None = None
) -> list[tuple[str, Path]]:
    """Write the report files the run asked for; a failure is one :class:`ReportFileWarning`.
    Returns what was written: (what, path) pairs.

    Called once by :meth:`SummaryReporter.finish` at session end, and by
    :class:`SigtermReport` (``signal_name``) when the run is terminated.
    """
    settings = reporter.runtime.settings
    written: list[tuple[str, Path]] = []
    guard = reporter.config.stash.get(SIGTERM_KEY, None)
    with guard.deferred() if guard is not None else _nothing():
        capacity, note = reporter.capacity()
        if settings.report_json is not None:
            path = settings.report_json
            if _attempt(
                JSON_FLAG,
                path,
                lambda: write_json(
                    path,
                    build_report(
                        reporter.summary, reporter.runtime, exitstatus, capacity, note, signal_name
                    ),
                ),
            ):
                written.append(("JSON report", path))
        if settings.report_plot is not None:
            plot = settings.report_plot
            if _attempt(
                PLOT_FLAG, plot, lambda: write_plot(plot, reporter.summary, capacity, note)
            ):
                written.append(("VRAM plot", plot))
    return written


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class SigtermReport:
    """Writes the reports when SIGTERM arrives, then lets SIGTERM do what it did before.

    ``timeout``, Slurm and CI cancellation stop a run with SIGTERM, whose default action
    ends the process at once: no ``pytest_sessionfinish``, no report. Installed (on the
    process that writes the reports: the controller under xdist, never a worker) only when
    a JSON report was asked for; the handler writes it, then chains to the previous
    disposition (the default one: the process ends of SIGTERM, its exit status as before; a
    Python handler: it is called), as coverage.py's ``sigterm`` option does. A SIGTERM
    that arrives while a report is being written waits until the file is complete.
    ``restore`` (at unconfigure) puts the previous handler back if ours is still there.

    Code the run runs may take SIGTERM over: nbclient runs each notebook under an asyncio
    loop whose ``add_signal_handler``/``remove_signal_handler`` leave ``SIG_DFL`` behind, so
    after one notebook a SIGTERM would end the run with no report. As a plugin, the guard
    looks after each phase of each test (:meth:`pytest_runtest_makereport`) and takes
    SIGTERM back (:meth:`reassert`).
    """

    name = "ctresources-sigterm-report"

    def __init__(self, write: Callable[[], None]) -> None:
        self._write = write
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False
        self._deferring = False
        self._pending = False

    def install(self) -> bool:
        """Install the handler; False where it cannot be chained (SIGTERM ignored, a handler
        not set from Python, or not the main thread, where signals cannot be handled)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous == signal.SIG_IGN:
            return False
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def reassert(self) -> None:
        """Take SIGTERM back if something replaced our handler since :meth:`install`.

        ``SIG_DFL`` (what asyncio's ``remove_signal_handler`` leaves, after nbclient) is
        taken back keeping what we chain to: the state before the test is restored. Another
        Python handler is chained to, as one there at start-up would be. ``SIG_IGN`` (and a
        handler not set from Python) is the code's explicit choice and is left as it is.
        """
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current == self._handle or current is None or current == signal.SIG_IGN:
            return
        if current != signal.SIG_DFL:
            self._previous = current
        signal.signal(signal.SIGTERM, self._handle)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Right after each phase of a test (setup, call, teardown), before its report is
        processed: a notebook item replaces the handler in its call phase."""
        try:
            return (yield)
        finally:
            self.reassert()

    def restore(self) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A SIGTERM during the block is handled after it (a report is written whole)."""
        if self._deferring:
            yield
            return
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._pending:
                self._pending = False
                self._handle(signal.SIGTERM, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:
            self._pending = True
            return
        self._deferring = True
        try:
            self._write()
        finally:
            self._deferring = False
            self._pending = False
        previous = self._previous
        self.restore()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end the process of SIGTERM, as it would have without us
            os.kill(os.getpid(), signum)


SIGTERM_KEY = pytest.StashKey[SigtermReport]()


def on_sigterm(config: pytest.Config, reporter: SummaryReporter) -> None:
    """Write ``reporter``'s reports on SIGTERM for this run (when a JSON report is asked)."""
    guard = SigtermReport(lambda: reporter.finish(None, signal.Signals.SIGTERM.name))
    if guard.install():
        config.stash[SIGTERM_KEY] = guard
        config.pluginmanager.register(guard, SigtermReport.name)
        config.add_cleanup(guard.restore)
