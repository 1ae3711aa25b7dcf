"""The report files: ``--ct-report-json`` (docs/report-schema.md) and ``--ct-report-plot``.

They never destroy anything (docs/security.md): the path is checked at start-up
(settings/report_paths.py: a symlink, a directory, a device node or a file that is not a
report is refused), and each file is written to a temporary file created exclusively beside it,
then renamed over it only if it is still a regular file or absent (:func:`write_file`). A
failure at session end is one warning (:func:`write_reports`); the run's outcome stands.
:class:`SigtermReport` writes the JSON report when the run is terminated (``timeout``,
Slurm, CI cancellation), as at Ctrl-C.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import pytest

from pytest_ctresources.exceptions import ReportFileWarning
from pytest_ctresources.report.placement import placement_row
from pytest_ctresources.settings.report_paths import (
    JSON_FLAG,
    PLOT_FLAG,
    PLOT_FORMATS,
    PLOT_METADATA,
    SCHEMA,
    TargetError,
    existing_ancestor,
    refusal,
    refused_kind,
)
from pytest_ctresources.units import file_kind, named

if TYPE_CHECKING:
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.report.results import TestResult
    from pytest_ctresources.report.run_summary import RunSummary
    from pytest_ctresources.settings.sources import Sourced

SCHEMA_VERSION = 2


def _shared(directory: Path) -> bool:
    """Whether ``directory`` is a shared place (anyone may write to it: the system temporary
    directory, ``/dev/shm``): a report and the directories made for it there stay private."""
    return bool(os.stat(directory).st_mode & stat.S_IWOTH)


def _make_directories(directory: Path) -> bool:
    """Create ``directory`` and its missing parents (under the umask in the user's own tree,
    0700 in a shared place; never over an entry, such as a link planted meanwhile). Returns
    whether the report goes into a shared place."""
    folder = existing_ancestor(directory)
    shared = _shared(folder)
    for part in directory.relative_to(folder).parts:
        folder = folder / part
        os.mkdir(folder, 0o700 if shared else 0o777)
    return shared


def private_directory(path: Path) -> Path:
    """``path`` as a directory to write into: made with mode 0700 if absent (its parents
    too); an existing one must be a real directory of this user's, never a link. Raises
    ``OSError`` or :class:`TargetError`."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise TargetError(f"{named(str(path))} is {file_kind(info.st_mode)}, not a directory")
    if info.st_uid != os.geteuid():
        raise TargetError(f"{named(str(path))} belongs to uid {info.st_uid}, not to you")
    return path


def _with_source(setting: Sourced[Any]) -> dict[str, Any]:
    """A setting as the report writes it: its value and where the value came from."""
    return {"value": setting.value, "source": str(setting.source)}


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
    capacity = runtime.vram_capacity
    leak_threshold = settings.leak_threshold.value
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
            "cleanup": _with_source(settings.cleanup),
            "alloc_conf": _with_source(settings.alloc_conf),
            "leak_threshold_bytes": _with_source(settings.leak_threshold),
            "oom_retry": _with_source(settings.oom_retry),
            "oom_retry_floor": settings.oom_retry_floor.value,
            "strict": settings.strict.value,
            "snapshot": _with_source(settings.snapshot),
        },
        "tests": [vram_row(result, leak_threshold) for result in summary.used_cuda],
        "placements": [placement_row(result) for result in summary.placed],
        "attributions": summary.by_test(lambda r: r.attribution_batch_sizes),
        "auto_batch_sizes": summary.by_test(lambda r: r.auto_batch_sizes),
        "vram_skips": summary.by_test(lambda r: r.vram_skip),
        "resident_models": summary.resident_models,
        "attribution_timings": summary.by_test(lambda r: r.attribution_timings),
        "pruning_calls": summary.by_test(lambda r: r.pruning_calls),
        "reruns": {nodeid: r.reruns for nodeid, r in summary.results.items() if r.reruns},
        "notebook_values": summary.by_test(lambda r: r.notebook_values),
        "snapshots": [
            {
                "nodeid": nodeid,
                "file": record.snapshot_file,
                "why": record.snapshot_why,
                "moment": record.snapshot_moment,
                "sites": record.snapshot_sites,
            }
            for nodeid, record in summary.snapshots.items()
        ],
        "peak_increases": list(summary.by_test(lambda r: r.peak_increase).values()),
        "gpu_coverage": summary.coverage.to_dict() if summary.coverage is not None else None,
    }


def vram_row(result: TestResult, leak_threshold: int) -> dict[str, Any]:
    """A test that used CUDA, as the report's ``tests`` list has it."""
    record = result.record
    return {
        "nodeid": result.nodeid,
        "outcome": result.outcome,
        "device": record.device or 0,
        "gpu": result.gpu,
        "date": result.date,
        "memory_key": result.memory_key,
        "baseline_bytes": record.baseline_bytes or 0,
        "peak_allocated_bytes": result.peak_allocated,
        "peak_reserved_bytes": result.peak_reserved,
        "after_bytes": record.after_bytes or 0,
        "leaked_bytes": result.leaked,
        "need_gib": record.need_gib,
        "need_source": record.need_source,
        "need_kind": record.need_kind,
        "need_most_gib": record.need_most_gib,
        "oom_halvings": record.oom_halvings,
        "resident_bytes": record.resident_bytes,
        "others_resident_bytes": record.others_resident_bytes,
        "reruns": result.reruns,
        "flags": [str(flag) for flag in result.flags(leak_threshold)],
    }


def write_file(path: Path, write: Callable[[IO[bytes]], None], flag: str) -> None:
    """Write ``path`` without ever destroying what is there if it fails or is not ours.

    ``write`` fills a temporary file created exclusively (``O_EXCL``, mode 0600, never
    through a link) in the same directory; it is synced, then renamed over ``path`` only if
    nothing is there or a file of ``flag``'s kind (a report, a snapshot) that the plugin
    wrote for this user (:func:`refusal`: what another user put there is theirs). A reader
    never sees a half-written file, a failure (disk full, directory gone, read-only file
    system) leaves the old file intact and no temporary behind, and a device node or a link
    planted at ``path`` during the run is left alone. Raises ``OSError`` or
    :class:`TargetError`.
    """
    private = _make_directories(path.parent)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if not private:
            # What the user's umask gives a file (0644 under 022), as pytest's --junitxml and
            # pytest-html's files get. It is read by setting the strictest mask for a moment:
            # a file another thread creates meanwhile can only come out more private.
            umask = os.umask(0o077)
            os.umask(umask)
            os.fchmod(descriptor, 0o666 & ~umask)
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # a full disk shows here, before the old file goes
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise TargetError(f"{named(str(path))} is now {refused_kind(mode)}; it is left alone")
        if (problem := refusal(path, named(str(path)), flag)) is not None:
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
    """The VRAM plot (report/plot.py) at ``path``, in the format its extension names
    (:data:`PLOT_FORMATS`; :func:`write_file`)."""
    from pytest_ctresources.report import plot

    drawn = plot.figure(summary, capacity_gib, capacity_note)
    kind = PLOT_FORMATS[path.suffix.lower()][0]
    # The mark tells a later run this file is the plugin's to replace (refusal).
    write_file(
        path,
        lambda handle: drawn.savefig(
            handle, format=kind, dpi=plot.DPI, metadata=PLOT_METADATA[kind]
        ),
        PLOT_FLAG,
    )


def _reason(exc: BaseException) -> str:
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
                f"ctresources: {flag} {named(str(path))} was not written: {_reason(exc)}; "
                "the file "
                "there, if any, is unchanged"
            ),
            stacklevel=1,
        )
        return False
    return True


def write_reports(
    config: pytest.Config,
    runtime: Runtime,
    summary: RunSummary,
    capacity_of: Callable[[], tuple[float | None, str]],
    exitstatus: int | None,
    signal_name: str | None = None,
) -> list[tuple[str, Path]]:
    """Write the report files the run asked for; a failure is one :class:`ReportFileWarning`.
    Returns what was written: (what, path) pairs. ``capacity_of()``: the capacity the report
    compares with, and how it is described.

    Called once by ``SummaryReporter.finish`` (report/summary.py) at session end, and by
    :class:`SigtermReport` (``signal_name``) when the run is terminated.
    """
    settings = runtime.settings
    written: list[tuple[str, Path]] = []
    guard = config.stash.get(SIGTERM_KEY, None)
    with guard.deferred() if guard is not None else nullcontext():
        capacity, note = capacity_of()
        if settings.report_json_path is not None:
            path = settings.report_json_path
            if _attempt(
                JSON_FLAG,
                path,
                lambda: write_json(
                    path,
                    build_report(summary, runtime, exitstatus, capacity, note, signal_name),
                ),
            ):
                written.append(("JSON report", path))
        if settings.report_plot_path is not None:
            plot = settings.report_plot_path
            if _attempt(PLOT_FLAG, plot, lambda: write_plot(plot, summary, capacity, note)):
                written.append(("VRAM plot", plot))
    return written


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


def on_sigterm(config: pytest.Config, finish: Callable[[str], None]) -> None:
    """Have ``finish(signal_name)`` (the summary's end, which writes the reports) run on
    SIGTERM for this run (when a JSON report is asked)."""
    guard = SigtermReport(lambda: finish(signal.Signals.SIGTERM.name))
    if guard.install():
        config.stash[SIGTERM_KEY] = guard
        config.pluginmanager.register(guard, SigtermReport.name)
        config.add_cleanup(guard.restore)
