"""The end-of-run report: the ``ctresources summary`` terminal section and its VRAM table.

It is built only from test reports (``ct_*`` ``user_properties`` and outcomes), which
pytest-xdist ships from workers to the controller, so a distributed run gets one complete
report: a :class:`TestResult` per test, which the JSON file and the plot (report/files.py),
pytest-html's columns, the placements, the GPU coverage and the learned needs read too.
"""

from __future__ import annotations

import datetime
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from pytest_ctresources.core.accounting import UNMARKED_BYTES, suggested_marker
from pytest_ctresources.core.learned import LearnedNeed
from pytest_ctresources.core.record import AT_TOP, TestRecord
from pytest_ctresources.core.regression import Increase
from pytest_ctresources.report.placement import made_wait, placement_lines
from pytest_ctresources.report.snapshot_sites import Site
from pytest_ctresources.settings.activation import activation_of
from pytest_ctresources.units import GIB, bytes_text

if TYPE_CHECKING:
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.report.coverage import GpuCoverage


#: How bad each phase's outcome is for the test's final outcome; an outcome another plugin
#: reports that is not listed (other than a rerun) ranks with "skipped".
_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2}
#: pytest-rerunfailures' outcome of a failed attempt that it runs again: not final.
RERUN_OUTCOME = "rerun"
_NEED_KIND_NAMES = {"marker": "marker", "learned": "learned", "estimate": "estimate"}
T = TypeVar("T")
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
        return self.record.gpu or "unknown GPU"

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

    def flags(self, leak_threshold: int) -> list[str]:
        """What the report flags of a test that used CUDA: ESTIMATE LOW, UNDER-DECLARED,
        UNMARKED, LEAK and OOM RECOVERED."""
        record, peak = self.record, self.peak_reserved
        out: list[str] = []
        write = f"write {suggested_marker(peak, self.nodeid)}"
        most = record.need_most_gib if record.need_most_gib is not None else record.need_gib
        if record.need_kind == "estimate":
            # Against the most the estimate allows (batch_size_max for auto), not the least.
            if most is not None and peak > most * GIB:
                out.append(
                    f"ESTIMATE LOW: peak {peak / GIB:.2f} GiB reserved > {most:.1f} GiB, the "
                    f"most it may take ({record.need_source}); {write}"
                )
        elif most is not None and peak > most * GIB:
            out.append(
                f"UNDER-DECLARED: peak {peak / GIB:.2f} GiB reserved > declared "
                f"{most:.1f} GiB ({record.need_source}); {write}"
            )
        if record.need_gib is None and peak > UNMARKED_BYTES:
            out.append(
                f"UNMARKED: peak {peak / GIB:.2f} GiB reserved and no declared need; {write}"
            )
        if self.leaked > leak_threshold:
            out.append(
                f"LEAK: {self.leaked / GIB:.2f} GiB still allocated after teardown and cleanup"
            )
        if record.oom_halvings:
            out.append(f"OOM RECOVERED: {record.oom_halvings}")
        return out


def wrapped(line: str, width: int) -> list[str]:
    """``line`` folded at the terminal's width, its continuation indented under it."""
    if len(line) <= width or width < 40:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    # The line's own indent is given, not left in the text: textwrap would drop it when the
    # first word (a long node id) does not fit beside it.
    return textwrap.wrap(
        line.lstrip(),
        width=width,
        initial_indent=lead,
        subsequent_indent=lead + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]


def capped(lines: list[str], top: int) -> list[str]:
    """The first ``top`` lines, and how many more there are (``--ct-report-top``)."""
    if len(lines) <= top:
        return lines
    return [*lines[:top], f"  ... and {len(lines) - top} more (in the JSON report)"]


def session_value(source: str, value: str) -> str:
    """``--ct-batch-size 64``, ``env CT_BATCH_SIZE=64``, ``-o ct_batch_size=64``,
    ``BATCH_SIZE in x.yaml (64)``."""
    if source.startswith("--"):
        return f"{source} {value}"
    if source.startswith(("env ", "-o ")):
        return f"{source}={value}"
    return f"{source} ({value})"


def _worse(current: str, outcome: str) -> str:
    """The test's outcome so far combined with one more phase's."""
    rank = _OUTCOME_RANK.get
    return outcome if rank(outcome, 1) > rank(current, 1) else current


@dataclass
class RunSummary:
    """What the run did: one :class:`TestResult` per test, and what spans tests.

    Built from reports alone, whatever plugin made them: an outcome it does not know ranks as
    a skip, and a failed attempt that pytest-rerunfailures runs again (outcome ``rerun``) is
    counted as a rerun and superseded by the next attempt: each test is recorded by its last.
    """

    results: dict[str, TestResult] = field(default_factory=dict)
    """Node id -> the test, in the order the tests finished (their last teardown)."""
    resident_models: list[dict[str, Any]] = field(default_factory=list)
    own_settings: dict[tuple[str, str, str], set[str]] = field(default_factory=dict)
    """(field, session-wide source, its value) -> the tests whose own marker overrode it."""
    coverage: GpuCoverage | None = None
    """The skipped GPU tests' last real runs, found at the end of the run."""

    def record(self, report: pytest.TestReport) -> list[list[str]]:
        """Take one report in; returns the session-wide settings it shows a test's own marker
        overriding for the first time (``[field, source, value, the test's value]``)."""
        nodeid = report.nodeid
        result = self.results.get(nodeid)
        if result is None:
            result = self.results[nodeid] = TestResult(nodeid)
        first: list[list[str]] = []
        if report.when == "setup":  # a new attempt of the test
            result.outcome = "passed"
            result.rerun_attempt = False
            result.seconds = 0.0
            result.ran = False
        result.seconds += report.duration
        if report.skipped:
            result.ran = False
        elif report.when == "call":
            result.ran = True
        if report.outcome == RERUN_OUTCOME:
            if not result.rerun_attempt:
                result.rerun_attempt = True
                result.reruns += 1
        elif report.outcome != "passed":
            result.outcome = _worse(result.outcome, report.outcome)
        if report.when != "teardown":
            return first
        if not result.rerun_attempt:
            self.results[nodeid] = self.results.pop(nodeid)  # finished: the order it did
        if not TestRecord.carries(report.user_properties):
            return first  # the common case: a test the plugin had nothing to say about
        result.acted = True
        record = TestRecord.from_properties(report.user_properties)
        for name, source, value, own, own_source in record.own_settings:
            if (name, source, value) not in self.own_settings:
                first.append([name, source, value, own, own_source])
            self.own_settings.setdefault((name, source, value), set()).add(nodeid)
        if record.resident_model is not None:
            # Even from an attempt run again: the next one reuses the model it loaded.
            self.resident_models.append(dict(record.resident_model))
        if not result.rerun_attempt:  # an attempt run again is superseded by the next
            result.record = record
        return first

    def durations(self) -> dict[str, float]:
        """This run's durations, in seconds: the tests whose last attempt ran (not those
        skipped, nor those whose setup failed)."""
        return {nodeid: round(r.seconds, 4) for nodeid, r in self.results.items() if r.ran}

    @property
    def used_cuda(self) -> list[TestResult]:
        """The tests that used CUDA in their process."""
        return [result for result in self.results.values() if result.record.used_cuda]

    @property
    def placed(self) -> list[TestResult]:
        """The tests whose record says where they ran (report/placement.py)."""
        return [result for result in self.results.values() if result.record.placed]

    def by_test(self, value: Callable[[TestRecord], T | None]) -> dict[str, T]:
        """Node id -> what ``value`` reads of the test's record, for the tests where it has
        one (neither None nor empty)."""
        return {nodeid: found for nodeid, r in self.results.items() if (found := value(r.record))}

    @property
    def snapshots(self) -> dict[str, TestRecord]:
        """The tests whose CUDA memory snapshot was kept (``--ct-snapshot``): their records."""
        return self.by_test(lambda r: r if r.snapshot_file is not None else None)

    def learned(self, versions: dict[str, str] | None = None) -> dict[str, LearnedNeed]:
        """Needs to remember: the peak reserved of every passed test that used CUDA, except
        a test that passed only after ct_session halved its batch size (its peak is that of a
        smaller batch than its key says) and one whose key is empty (``batch_size: auto``:
        core/learned.py's ``memory_key``); each with the libraries' ``versions``."""
        return {
            result.record.memory_key: LearnedNeed(
                result.peak_reserved / GIB, result.gpu, result.date, versions
            )
            for result in self.used_cuda
            if result.outcome == "passed"
            and result.record.memory_key
            and not result.record.oom_halvings
        }

    def slowest_lines(self, top: int) -> list[str]:
        """The slowest attributions, ``--durations`` style, with their phases and batches."""
        calls = [
            (timing, nodeid)
            for nodeid, timings in self.by_test(lambda r: r.attribution_timings).items()
            for timing in timings
        ]
        if not calls:
            return []
        calls.sort(key=lambda entry: -float(entry[0].get("total_s", 0.0)))
        out = [f"slowest attributions (top {min(top, len(calls))} of {len(calls)}):"]
        for timing, nodeid in calls[:top]:
            total = timing.get("batches_total")
            batches = f"{timing.get('batches_done', 0)}" + (f"/{total}" if total else "")
            out.append(
                f"  {float(timing.get('total_s', 0.0)):7.2f} s  {nodeid}: batch size "
                f"{timing.get('batch_size')}, {batches} backward batches; setup "
                f"{float(timing.get('setup_s', 0.0)):.2f} s, forward "
                f"{float(timing.get('forward_s', 0.0)):.2f} s, backward "
                f"{float(timing.get('backward_s', 0.0)):.2f} s"
            )
        return out

    def totals_line(self) -> str | None:
        """One line of totals: the attributions, the tests that used CUDA and the highest
        peak (None when there is nothing to count; skips for VRAM are among the actions)."""
        parts = []
        attributions = self.by_test(lambda r: r.attribution_batch_sizes)
        calls = sum(len(sizes) for sizes in attributions.values())
        if calls:
            sizes = sorted({size for values in attributions.values() for size in values})
            parts.append(
                f"attributions: {calls} in {len(attributions)} test(s)"
                + (f", batch size(s) {', '.join(map(str, sizes))}" if sizes else "")
            )
        if used := self.used_cuda:
            top = max(used, key=lambda r: r.peak_reserved)
            parts.append(
                f"{len(used)} test(s) used CUDA, highest peak "
                f"{bytes_text(top.peak_reserved)} reserved ({top.nodeid})"
            )
        return "; ".join(parts) if parts else None

    def action_lines(self, flags: list[tuple[str, str]], top: int, *, quiet: bool) -> list[str]:
        """What went wrong or needs action (flags, skips for VRAM, lease waits), each list
        capped at ``top``; under ``-q`` the counts alone (``flags``: each flag's kind and line)."""
        out: list[str] = []
        # Attributions that ran out of memory and passed at a smaller batch.
        halvings = [
            f"  {nodeid}: {text}"
            for nodeid, text in sorted(self.by_test(lambda r: r.oom_halvings).items())
        ]
        if halvings:
            out += [f"out of memory, recovered: {len(halvings)} test(s)"]
            out += [] if quiet else capped(halvings, top)
        if flags:
            if quiet:
                kinds: dict[str, int] = {}
                for kind, _line in flags:
                    kinds[kind] = kinds.get(kind, 0) + 1
                out.append(
                    "flagged: " + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
                )
            else:
                out += capped([line for _kind, line in flags], top)
        increases = [
            f"  {Increase.from_dict(found).line()}"
            for found in self.by_test(lambda r: r.peak_increase).values()
        ]
        if increases:
            out.append(
                f"VRAM peak increased: {len(increases)} test(s), over the last passing peak on "
                "the same GPU and config"
            )
            out += [] if quiet else capped(sorted(increases), top)
        if skips := self.by_test(lambda r: r.vram_skip):
            out.append(f"skipped for VRAM: {len(skips)} test(s)")
            if not quiet:
                out += capped(
                    [f"  {nodeid}: {reason}" for nodeid, reason in sorted(skips.items())], top
                )
        out += self.coverage_lines(top, quiet=quiet)
        placed = [result.record for result in self.placed]
        if made_wait(placed):
            out += placement_lines(placed) if not quiet else placement_lines(placed)[:1]
        out += self.snapshot_lines(top, quiet=quiet)
        return out

    def snapshot_lines(self, top: int, *, quiet: bool) -> list[str]:
        """The tests whose memory snapshot was kept for a finding, each with its file and the
        sites that held most; the count of the others (``--ct-snapshot always``)."""
        snapshots = self.snapshots
        found = {n: record for n, record in snapshots.items() if record.snapshot_why != "always"}
        out = []
        if found:
            out.append(
                f"memory snapshots: {len(found)} test(s) (open in https://pytorch.org/memory_viz)"
            )
        if found and not quiet:
            lines = []
            for nodeid, record in sorted(found.items()):
                lines.append(f"  {nodeid} ({record.snapshot_why}): {record.snapshot_file}")
                lines += [
                    f"      {Site(**site).text()} {record.snapshot_moment}"
                    for site in record.snapshot_sites
                ]
            out += capped(lines, top * 6)
        others = len(snapshots) - len(found)
        if others:
            out.append(f"memory snapshots of {others} other test(s) (--ct-snapshot always)")
        return out

    def detail_lines(self, top: int, verbosity: int) -> list[str]:
        """``-v``: the settings tests kept of their own, notebook values, placements, resident
        models, reruns, the slowest attributions; ``-vv`` also each ``auto`` choice."""
        out: list[str] = []
        auto_choices = self.by_test(lambda r: r.auto_batch_sizes)
        if verbosity >= 2:
            for nodeid, choices in sorted(auto_choices.items()):
                out += [f"  {nodeid}: auto {text}" for text in choices]
        elif auto_choices:
            count = sum(len(choices) for choices in auto_choices.values())
            out.append(f"auto chose {count} batch size(s) (each with its reasons under -vv)")
        for (name, source, value), nodeids in sorted(self.own_settings.items()):
            out.append(
                f"{len(nodeids)} test(s) keep their own {name} over {session_value(source, value)}"
            )
        out += capped(self.notebook_lines(), top + 1)
        placed = [result.record for result in self.placed]
        if not made_wait(placed):
            out += placement_lines(placed)  # with waits, it is among the actions
        out += capped(self.resident_lines(), top + 1)
        # Reruns of tests the plugin said nothing of are another plugin's business.
        reruns = [r.reruns for r in self.results.values() if r.reruns and r.acted]
        if reruns:
            out.append(
                f"reruns (another plugin ran failed attempts again): {len(reruns)} test(s) "
                f"ran again, {sum(reruns)} attempt(s) in all; each is reported by its last"
            )
        out += self.slowest_lines(min(top, 5))
        return out

    def coverage_lines(self, top: int, *, quiet: bool) -> list[str]:
        """The GPU tests skipped in this run and when each last really ran on a GPU; the
        failure of ``--ct-require-gpu-run-within``."""
        coverage = self.coverage
        if coverage is None or not coverage.skipped:
            return []
        out = [
            f"GPU tests skipped here: {len(coverage.skipped)} test(s); when each last really "
            "ran on a GPU:"
        ]
        if not quiet:
            out += capped([f"  {test.nodeid}: {test.text()}" for test in coverage.skipped], top)
        failure = coverage.failure_line()
        return [*out, failure] if failure is not None else out

    @property
    def acted(self) -> bool:
        """Whether some test's report carried a record: the plugin acted for it."""
        return any(result.acted for result in self.results.values())

    def notebook_lines(self) -> list[str]:
        """The values each notebook item ran with (what the header's session-wide settings do
        not show: an item's own experiment config beats them)."""
        notebook_values = self.by_test(lambda r: r.notebook_values)
        if not notebook_values:
            return []
        out = ["notebook items ran with (injected; the rest as each notebook sets it):"]
        for nodeid, entries in sorted(notebook_values.items()):
            groups: dict[str, list[str]] = {}  # by source, in the order they first appear
            for name, literal, where, _injected in entries:
                shown = literal if len(literal) <= 40 else literal[:37] + "..."
                groups.setdefault(where, []).append(f"{name}={shown}")
            text = "; ".join(f"{', '.join(values)} ({where})" for where, values in groups.items())
            if entries[0][3] == AT_TOP:
                text += " [injected at the top: the notebook may have overwritten them]"
            out.append(f"  {nodeid}: {text}")
        return out

    def resident_lines(self) -> list[str]:
        """The models ct_session kept loaded between tests, per worker and GPU."""
        if not self.resident_models:
            return []
        out = ["resident models (kept loaded between tests by ct_session; not leaks):"]
        for model in self.resident_models:
            loaded_by = f", loaded by {model['loaded_by']}" if model.get("loaded_by") else ""
            out.append(
                f"  {model.get('worker', 'main')} GPU {model.get('device', '?')}: "
                f"{model.get('model')} {int(model.get('bytes', 0)) / GIB:.2f} GiB{loaded_by}"
            )
        return out

    def vram_lines(
        self, top: int, capacity_gib: float | None, capacity_note: str, leak_threshold: int
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """The VRAM table (the top tests by peak), and every flag: its kind and its line."""
        ranked = sorted(self.used_cuda, key=lambda r: -r.peak_reserved)
        out = [
            f"VRAM per test ({capacity_note}); {len(ranked)} test(s) used CUDA"
            + (f", top {min(top, len(ranked))} by peak reserved:" if ranked else "")
        ]
        if ranked:
            out.append(
                f"{'peak alloc':>11} {'peak resv':>10} {'declared (source)':>22} "
                f"{'headroom':>9} {'leaked':>9}  test"
            )
        for result in ranked[:top]:
            need = result.record.need_gib
            declared = f"{need:.1f} GiB ({result.need_kind_name})" if need is not None else "-"
            reserved = result.peak_reserved / GIB
            headroom = f"{capacity_gib - reserved:.2f}" if capacity_gib is not None else "?"
            out.append(
                f"{result.peak_allocated / GIB:>7.2f} GiB {reserved:>6.2f} GiB {declared:>22} "
                f"{headroom:>5} GiB {result.leaked / GIB:>5.2f} GiB  {result.nodeid}"
            )
        flags = [
            (kind, f"{kind} {result.nodeid}:{rest}")
            for result in ranked
            for kind, rest in (flag.split(":", 1) for flag in result.flags(leak_threshold))
        ]
        return out, flags


class SummaryReporter:
    """Registered on the controller (or the only process): collects reports, prints the report,
    writes the JSON and the plot, and remembers the measured needs."""

    name = "ctresources-summary"

    def __init__(self, runtime: Runtime, config: pytest.Config) -> None:
        self.runtime = runtime
        self.summary = RunSummary()
        self.verbose = config.get_verbosity() > 0
        self.config = config
        self._finished = False
        #: Learned needs of tests that no longer exist (found where the tests are collected).
        self.stale_learned: set[str] = set()
        #: How many learned needs ``--ct-forget`` cleared (None: not asked).
        self.forgotten: int | None = None
        #: The report files written at the end: (what, path).
        self.written: list[tuple[str, Path]] = []

    @property
    def terminal(self) -> pytest.TerminalReporter:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        assert reporter is not None  # registered whenever the terminal is in use
        return reporter  # type: ignore[no-any-return]

    def capacity(self) -> tuple[float | None, str]:
        """The capacity the report compares with, and how it is described."""
        gpu = self.runtime.gpu_facts(may_import_torch=False).gpu(0)
        emulated = self.runtime.vram_capacity
        if emulated is not None:
            where = f"{gpu.describe()} " if gpu is not None else ""
            return emulated.value, f"{where}capacity {emulated.value:.1f} GiB by {emulated.source}"
        if gpu is not None:
            return gpu.total_gib, f"{gpu.describe()} {gpu.total_gib:.1f} GiB"
        return None, "no CUDA GPU detected"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        first_overrides = self.summary.record(report)
        if self.verbose:
            for name, source, value, own, own_source in first_overrides:
                self.terminal.write_line(
                    f"ctresources: {report.nodeid} keeps its own {name}={own} ({own_source}) "
                    f"over {session_value(source, value)}; said once per setting, the summary "
                    "counts them"
                )
        if report.when == "teardown" and self.verbose:
            closed = TestRecord.from_properties(report.user_properties).figures_closed
            if closed:
                self.terminal.write_line(
                    f"ctresources: closed {closed} matplotlib figure(s) "
                    f"left open by {report.nodeid}"
                )

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        # Runs on Ctrl-C and on internal errors too: the JSON report is written whatever happens.
        self.finish(int(exitstatus))

    def pytest_unconfigure(self) -> None:
        self.finish(None)

    def finish(self, exitstatus: int | None, signal_name: str | None = None) -> None:
        """Remember the measured needs and the GPU tests' runs, write the report files.

        ``signal_name``: the run is being terminated (``files.SigtermReport``); the
        session may still finish after that, and then writes the files again."""
        if self._finished:
            return
        self._finished = signal_name is None
        settings = self.runtime.settings
        # The versions are read (from metadata, a few milliseconds) only when there is a peak.
        versions = self.runtime.library_versions() if self.summary.used_cuda else None
        measured = self.summary.learned(versions)
        stale = self.stale_learned
        if measured or stale:
            learned = self.runtime.learned()
            learned.prune(stale)
            learned.update(measured)
            learned.save()
        from pytest_ctresources.report import coverage

        self.summary.coverage = coverage.update(
            getattr(self.config, "cache", None),
            self.summary.results.values(),
            settings.require_gpu_run_within.value,
        )
        if settings.report_json_path is None and settings.report_plot_path is None:
            return
        from pytest_ctresources.report import files as report_files

        self.written = report_files.write_reports(self, exitstatus, signal_name)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """Quiet by default, as pytest-timeout and pytest-memray are: what went wrong or needs
        action and one line of totals; ``-v`` adds the VRAM table and the details, ``-vv``
        every ``auto`` choice; ``-q`` shortens the actions to counts. Every list is capped at
        ``--ct-report-top``; the JSON report keeps everything."""
        settings = self.runtime.settings
        verbosity = self.config.get_verbosity()
        top = settings.report_top.value
        if self.forgotten is not None:
            terminalreporter.write_line(
                f"ctresources: --ct-forget cleared {self.forgotten} learned VRAM need(s)"
            )
        used_cuda = bool(self.summary.used_cuda)
        show_table = (used_cuda and verbosity >= 1) or settings.report.value
        table: list[str] = []
        flags: list[tuple[str, str]] = []
        if used_cuda or settings.report.value:
            capacity, note = self.capacity()
            table, flags = self.summary.vram_lines(
                top, capacity, note, settings.leak_threshold.value
            )
        actions = self.summary.action_lines(flags, top, quiet=verbosity < 0)
        details = self.summary.detail_lines(top, verbosity) if verbosity >= 1 else []
        totals = self.summary.totals_line() if verbosity >= 0 else None
        here = self.config.invocation_params.dir
        written = [
            f"wrote the {what}: {path.relative_to(here) if path.is_relative_to(here) else path}"
            for what, path in self.written
        ]
        # A failing run says the settings it ran with (under -v the header said them).
        failed = terminalreporter.stats.get("failed") or terminalreporter.stats.get("error")
        described = []
        acted = self.summary.acted or activation_of(self.config).project_wide
        if failed and verbosity == 0 and acted:
            described = [
                *(
                    line.removeprefix("ctresources: ")
                    for line in settings.header_lines(self.runtime.vram_capacity)
                ),
                *self.runtime.gpu_facts(may_import_torch=False).summary_lines(),
            ]
        lines = [*described, *actions, *([totals] if totals else []), *details]
        if not (lines or show_table or written):
            return
        terminalreporter.section("ctresources summary")
        width = terminalreporter.config.get_terminal_writer().fullwidth
        for line in described:
            self._write_folded(terminalreporter, line, width)
        if show_table:
            for index, line in enumerate(table):  # the rows' columns line up: never folded
                if index == 0:
                    self._write_folded(terminalreporter, line, width)
                else:
                    terminalreporter.write_line(line)
        for line in lines[len(described) :]:
            self._write_folded(terminalreporter, line, width)
        for line in written:
            self._write_folded(terminalreporter, line, width)

    @staticmethod
    def _write_folded(terminalreporter: pytest.TerminalReporter, line: str, width: int) -> None:
        for part in wrapped(line, width):
            terminalreporter.write_line(part)
