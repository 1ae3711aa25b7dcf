"""``--ct-snapshot``: the CUDA caching allocator's history during each test, kept as a file
for a test that ran out of memory, leaked or went over its declared need (or every test).

Recording starts before the test's fixtures are set up and stops after its teardown and
cleanup (:class:`SnapshotRecorder`, registered only when the setting is not ``off``: with
``off`` nothing here runs). It records allocations with their Python stacks only
(``context="alloc"``, ``stacks="python"``: the cheapest form that still says where each
block came from). The snapshot is written with :func:`~pytest_ctresources.report.files.write_file`
(mode 0600, never through a link) into a directory made private, one file per test named
after its node id (:func:`file_name`), and its top allocation sites
(:mod:`~pytest_ctresources.report.snapshot_sites`) go into the test's record. A notebook's
kernel records and dumps in its own process (notebooks/kernels.py); its snapshot is used
instead.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from pytest_ctresources.core.state import state_of
from pytest_ctresources.exceptions import CtResourcesWarning, ReportFileWarning
from pytest_ctresources.gpu import oom
from pytest_ctresources.gpu.measure import VramFigures
from pytest_ctresources.gpu.memory_history import start_recording, stop_recording, take_snapshot
from pytest_ctresources.report import files
from pytest_ctresources.report.snapshot_sites import alive_at_peak, top_sites
from pytest_ctresources.settings.activation import activation_of
from pytest_ctresources.settings.markers import VramNeed
from pytest_ctresources.settings.report_paths import SNAPSHOT_FLAG, TargetError

SNAPSHOT_SUFFIX = ".pickle"
#: How much of a node id a file name keeps (its hash keeps names of longer ones apart).
MAX_STEM = 120
_RECORDING_KEY = pytest.StashKey[bool]()
_OOM_KEY = pytest.StashKey[bool]()


def file_name(nodeid: str) -> str:
    """A file name for ``nodeid``'s snapshot: its readable characters (no path separator),
    at most :data:`MAX_STEM` of them, and a hash of the whole id that keeps it unique."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("._-")[:MAX_STEM]
    digest = hashlib.sha256(nodeid.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{stem or 'test'}-{digest}{SNAPSHOT_SUFFIX}"


def reasons(
    *,
    out_of_memory: bool,
    figures: VramFigures | None,
    need: VramNeed | None,
    leak_threshold: int,
) -> list[str]:
    """Why a test's snapshot is kept under ``on-failure``: the three findings the report
    flags (an estimate is not a declaration: going over it is not counted)."""
    found = ["out of memory"] if out_of_memory else []
    if figures is not None and figures.leaked_bytes > leak_threshold:
        found.append("leak")
    if figures is not None and need is not None and need.exceeded_by(figures.peak_reserved_gib):
        found.append("over its declared need")
    return found


def ran_out_of_memory(exc: BaseException) -> bool:
    """CUDA out of memory in the test, or in a notebook's kernel (nbmake's failure carries
    the kernel's error by name)."""
    if oom.is_oom(exc):
        return True
    error = getattr(exc.args[0] if exc.args else None, "error", None)
    return "OutOfMemoryError" in str(getattr(error, "summary", ""))


class SnapshotRecorder:
    """Records each test the plugin acts for, and keeps the snapshots that are asked for."""

    name = "ctresources-snapshots"

    def __init__(self, mode: str, directory: Callable[[], Path], root: Path) -> None:
        self.mode = mode
        self._directory = directory
        self.root = root
        self.unavailable: str | None = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Before the test's fixtures: they allocate too."""
        if self.unavailable is not None or not activation_of(item.config).acts_for(item):
            return
        self.unavailable = start_recording()
        if self.unavailable is not None:
            warnings.warn(
                CtResourcesWarning(
                    f"ctresources: --ct-snapshot records nothing here ({self.unavailable})"
                ),
                stacklevel=1,
            )
            return
        item.stash[_RECORDING_KEY] = True
        item.stash[_OOM_KEY] = False

    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> None:
        if call.excinfo is not None and ran_out_of_memory(call.excinfo.value):
            item.stash[_OOM_KEY] = True

    def finish(self, item: pytest.Item, leak_threshold: int) -> None:
        """After the test's teardown and cleanup: keep its snapshot if asked, put the file
        and the top sites into its record; stop recording."""
        recording = item.stash.get(_RECORDING_KEY, False)
        item.stash[_RECORDING_KEY] = False
        state = state_of(item)
        if not recording and state.kernel_snapshot is None:
            return
        try:
            found = reasons(
                out_of_memory=item.stash.get(_OOM_KEY, False),
                figures=state.figures,
                need=state.need,
                leak_threshold=leak_threshold,
            )
            if not found and self.mode != "always":
                return
            data = state.kernel_snapshot
            path = Path(file_name(item.nodeid))
            try:
                # The directory is made here, inside the warning's reach: the default one,
                # in pytest's cache, may be a FIFO or a file someone left there.
                path = self._directory() / path
                snapshot = pickle.loads(data) if data is not None else take_snapshot()
                content = data or pickle.dumps(snapshot)
                files.private_directory(path.parent)
                files.write_file(path, functools.partial(_write, content), SNAPSHOT_FLAG)
            except (OSError, RuntimeError, pickle.UnpicklingError, TargetError) as exc:
                # A snapshot that cannot be written never changes the test's outcome.
                warnings.warn(
                    ReportFileWarning(
                        f"ctresources: the memory snapshot of {item.nodeid} was not written: {exc}"
                    ),
                    stacklevel=1,
                )
                return
            alive, moment = alive_at_peak(snapshot)
            record = state.record
            record.snapshot_file = str(path)
            record.snapshot_why = ", ".join(found) or "always"
            record.snapshot_moment = moment
            record.snapshot_sites = [site.to_dict() for site in top_sites(alive, str(self.root))]
        finally:
            if recording:
                stop_recording()


def _write(content: bytes, handle: IO[bytes]) -> None:
    handle.write(content)


def default_directory(config: pytest.Config, report_json: Path | None) -> Path:
    """Beside the JSON report (``report.json`` -> ``report-snapshots/``), else in pytest's
    cache directory (else, without the cache plugin, under the rootdir)."""
    if report_json is not None:
        return report_json.parent / f"{report_json.stem}-snapshots"
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("ctresources-snapshots"))
    return config.rootpath / "ctresources-snapshots"


def register(
    config: pytest.Config, mode: str, directory: Path | None, report: Path | None
) -> SnapshotRecorder:
    """Record each test (``mode`` on-failure or always); the recorder, registered, whose
    :meth:`SnapshotRecorder.finish` the per-test teardown calls."""
    recorder = SnapshotRecorder(
        mode, lambda: directory or default_directory(config, report), config.rootpath
    )
    config.pluginmanager.register(recorder, SnapshotRecorder.name)
    return recorder
