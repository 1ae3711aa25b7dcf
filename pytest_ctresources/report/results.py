"""One test as the end-of-run report sees it: :class:`TestResult`, its last attempt's record
with what only the controller knows (outcome, seconds, reruns), and the flags it earns.

The type the run's summary (report/run_summary.py), the JSON report and the plot
(report/files.py), pytest-html's columns, the placements and the GPU coverage read; it
imports nothing of theirs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import NamedTuple

from pytest_ctresources.core.accounting import UNMARKED_BYTES, suggested_marker
from pytest_ctresources.core.record import UNKNOWN_GPU, TestRecord
from pytest_ctresources.units import GIB

#: How bad each phase's outcome is for the test's final outcome; an outcome another plugin
#: reports that is not listed (other than a rerun) ranks with "skipped".
_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2}
#: pytest-rerunfailures' outcome of a failed attempt that it runs again: not final.
RERUN_OUTCOME = "rerun"
_NEED_KIND_NAMES = {"marker": "marker", "learned": "learned", "estimate": "estimate"}
#: The record of a test whose reports carried none: one, shared, never changed (a result's
#: record is replaced by the one its teardown report carries, never written to), so that the
#: thousands of tests of a run that the plugin had nothing to say about allocate none.
_NO_RECORD = TestRecord()


@dataclass
class TestResult:
    """One test as the controller (or the only process) saw it: its last attempt's record,
    and beside it what only the controller knows. The record is written in the test's process
    at the end of its teardown, before its outcome is final (another plugin may report it, or
    run the test again), and is what the teardown report carried (junit XML's properties).

    Its properties read the CUDA figures as the report shows them, with a default (0, the node
    id, today, "unknown GPU") where a record from a worker of another version lacks one."""

    nodeid: str
    record: TestRecord = field(default_factory=lambda: _NO_RECORD)
    """The last attempt's record; empty where its teardown report carried none."""
    outcome: str = "passed"
    """The worst of the last attempt's setup, call and teardown outcomes."""
    reruns: int = 0
    """How many failed attempts another plugin (pytest-rerunfailures) ran again."""
    acted: bool = False
    """Some attempt's report carried a record: the plugin had something to say of the test."""
    rerun_attempt: bool = False
    """The attempt under way will be run again: its record is superseded by the next one's."""
    seconds: float = 0.0
    """The last attempt's setup, call and teardown, as its reports give them."""
    ran: bool = False
    """The last attempt's call ran and no phase of it skipped: its duration says how long the
    test takes (report/durations.py learns it)."""

    @property
    def peak_allocated(self) -> int:
        return self.record.peak_allocated_bytes or 0

    @property
    def peak_reserved(self) -> int:
        return self.record.peak_reserved_bytes or 0

    @property
    def leaked(self) -> int:
        return self.record.leaked_bytes or 0

    @property
    def gpu(self) -> str:
        return self.record.gpu or UNKNOWN_GPU

    @property
    def date(self) -> str:
        return self.record.date or datetime.date.today().isoformat()

    @property
    def memory_key(self) -> str:
        """The learned-need key (the node id where the record has none)."""
        return self.record.memory_key or self.nodeid

    @property
    def need_kind_name(self) -> str:
        """marker, config, estimate or learned."""
        if self.record.need_kind is None:
            return "none"
        return _NEED_KIND_NAMES.get(self.record.need_kind, "config")

    def flags(self, leak_threshold: int) -> list[Flag]:
        """What the report flags of a test that used CUDA: ESTIMATE LOW, UNDER-DECLARED,
        UNMARKED, LEAK and OOM RECOVERED."""
        record, peak = self.record, self.peak_reserved
        out: list[Flag] = []
        write = f"write {suggested_marker(peak, self.nodeid)}"
        most = record.need_most_gib if record.need_most_gib is not None else record.need_gib
        if record.need_kind == "estimate":
            # Against the most the estimate allows (batch_size_max for auto), not the least.
            if most is not None and peak > most * GIB:
                out.append(
                    Flag(
                        "ESTIMATE LOW",
                        f"peak {peak / GIB:.2f} GiB reserved > {most:.1f} GiB, the most it "
                        f"may take ({record.need_source}); {write}",
                    )
                )
        elif most is not None and peak > most * GIB:
            out.append(
                Flag(
                    "UNDER-DECLARED",
                    f"peak {peak / GIB:.2f} GiB reserved > declared {most:.1f} GiB "
                    f"({record.need_source}); {write}",
                )
            )
        if record.need_gib is None and peak > UNMARKED_BYTES:
            out.append(
                Flag(
                    "UNMARKED", f"peak {peak / GIB:.2f} GiB reserved and no declared need; {write}"
                )
            )
        if self.leaked > leak_threshold:
            out.append(
                Flag(
                    "LEAK",
                    f"{self.leaked / GIB:.2f} GiB still allocated after teardown and cleanup",
                )
            )
        if record.oom_halvings:
            out.append(Flag("OOM RECOVERED", record.oom_halvings))
        return out


class Flag(NamedTuple):
    """One finding on a test's memory: its ``kind`` (``LEAK``, ...) and what it says; the
    JSON report's ``flags`` hold it as ``"KIND: detail"``."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def worse(current: str, outcome: str) -> str:
    """The test's outcome so far combined with one more phase's."""
    rank = _OUTCOME_RANK.get
    return outcome if rank(outcome, 1) > rank(current, 1) else current
