"""Which GPU tests really run: the last real run of each, kept in pytest's cache.

A *GPU test* is a test the plugin acts for that has a VRAM need (a ``vram`` marker, a
config's ``VRAM_GIB``, a learned peak or an estimate) or that used CUDA. It *really ran*
when it was not skipped and ran where a GPU was detected; the controller (or the only
process) writes the GPU and the time (UTC) of each such run to the cache at the end of the
run. A GPU test the plugin skipped in this run for VRAM (no GPU, or one too small;
gpu/skips.py) is listed with its last real run, or as never having run;
``--ct-require-gpu-run-within DAYS`` fails the run when one has not really run for that long.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core.learned import (
    MAX_KEY_CHARS,
    MAX_TEXT_CHARS,
    read_cache_or_warn,
    write_cache,
)

if TYPE_CHECKING:
    from pytest_ctresources.report.results import TestResult

CACHE_KEY = "ctresources/gpu-runs"
WHAT = "last GPU runs of GPU tests"
#: How many of the stalest tests the failure line names.
NAMED = 3


@dataclass(frozen=True)
class LastRun:
    """When and where a GPU test last really ran."""

    gpu: str
    at: datetime.datetime

    def text(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} UTC on {self.gpu}"


@dataclass(frozen=True)
class SkippedGpuTest:
    """A GPU test the plugin skipped in this run, and its last real run (None: never)."""

    nodeid: str
    reason: str
    last: LastRun | None

    def text(self) -> str:
        return self.last.text() if self.last else "never"


@dataclass(frozen=True)
class GpuCoverage:
    """The GPU tests skipped in this run, and the requirement of ``--ct-require-gpu-run-within``."""

    skipped: tuple[SkippedGpuTest, ...]
    within_days: float | None
    now: datetime.datetime

    def stale(self) -> list[SkippedGpuTest]:
        """The skipped tests that have not really run within the days required, the stalest
        (never run) first; empty without the requirement."""
        if self.within_days is None:
            return []
        limit = datetime.timedelta(days=self.within_days)
        late = [t for t in self.skipped if t.last is None or self.now - t.last.at >= limit]
        return sorted(late, key=lambda t: (t.last.at.timestamp() if t.last else 0.0, t.nodeid))

    def failure_line(self) -> str | None:
        """One line naming the stalest tests, when the requirement fails."""
        stale = self.stale()
        if not stale:
            return None
        named = ", ".join(f"{t.nodeid} ({t.text()})" for t in stale[:NAMED])
        more = f" and {len(stale) - NAMED} more" if len(stale) > NAMED else ""
        return (
            f"--ct-require-gpu-run-within {self.within_days:g}: {len(stale)} GPU test(s) have "
            f"not really run within {self.within_days:g} day(s): {named}{more}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "require_within_days": self.within_days,
            "skipped": [
                {
                    "nodeid": test.nodeid,
                    "reason": test.reason,
                    "last_gpu": test.last.gpu if test.last else None,
                    "last_ran": test.last.at.isoformat() if test.last else None,
                }
                for test in self.skipped
            ],
            "stale": [test.nodeid for test in self.stale()],
        }


def last_run(nodeid: object, entry: object) -> LastRun | None:
    """A cached entry, read as data that may be corrupt (None: not one this module wrote)."""
    if not isinstance(nodeid, str) or len(nodeid) > MAX_KEY_CHARS or not isinstance(entry, dict):
        return None
    gpu, at = entry.get("gpu"), entry.get("at")
    if not all(
        isinstance(text, str) and len(text) <= MAX_TEXT_CHARS and text.isprintable()
        for text in (gpu, at)
    ):
        return None
    try:
        when = datetime.datetime.fromisoformat(str(at))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return LastRun(str(gpu), when)


def update(
    cache: pytest.Cache | None,
    results: Collection[TestResult],
    within_days: float | None,
    now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc),
) -> GpuCoverage | None:
    """Record the GPU tests that really ran and return the coverage of the ones skipped for
    VRAM against what the cache held (None, the cache untouched: no GPU test did either)."""
    skipped = {r.nodeid: r.record.vram_skip for r in results if r.record.vram_skip is not None}
    ran = {
        r.nodeid: r.record.gpu_ran
        for r in results
        if r.record.gpu_ran is not None and r.record.vram_skip is None and r.outcome != "skipped"
    }
    if not (ran or skipped):
        return None
    moment = now().replace(microsecond=0)
    raw: object = {}
    writable = cache is not None
    if cache is not None:
        raw, writable = read_cache_or_warn(cache, CACHE_KEY, WHAT)
    runs = {
        nodeid: last
        for nodeid, entry in (raw.items() if isinstance(raw, dict) else ())
        if (last := last_run(nodeid, entry)) is not None
    }
    coverage = GpuCoverage(
        tuple(
            SkippedGpuTest(nodeid, reason, runs.get(nodeid))
            for nodeid, reason in sorted(skipped.items())
        ),
        within_days,
        moment,
    )
    if ran and cache is not None and writable:
        runs.update({nodeid: LastRun(gpu, moment) for nodeid, gpu in ran.items()})
        write_cache(
            cache,
            {nodeid: {"gpu": last.gpu, "at": last.at.isoformat()} for nodeid, last in runs.items()},
            CACHE_KEY,
            WHAT,
        )
    return coverage


class GpuRunRequirement:
    """``--ct-require-gpu-run-within``: registered only then, where the summary is made.
    Fails the run (exit status 1) when a GPU test skipped in it has not really run within the
    days required; the summary's line names the stalest."""

    name = "ctresources-require-gpu-run"

    def __init__(self, coverage: Callable[[], GpuCoverage | None]) -> None:
        self._coverage = coverage

    @pytest.hookimpl(trylast=True)  # after the summary's own, which finds the coverage
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        coverage = self._coverage()
        if coverage is not None and coverage.stale() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
