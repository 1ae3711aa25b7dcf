"""The end-of-run report: the ``ctresources summary`` terminal section and its VRAM table.

It is built only from test reports (``ct_*`` ``user_properties`` and skip reasons), which
pytest-xdist ships from workers to the controller, so a distributed run gets one complete
report. The JSON file and the plot are written from the same records (``report/files.py``).
"""

from __future__ import annotations

import datetime
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_ctresources.core.accounting import UNMARKED_BYTES, suggested_marker
from pytest_ctresources.core.learned import LearnedNeed
from pytest_ctresources.core.record import AT_TOP, TestRecord
from pytest_ctresources.core.regression import Increase
from pytest_ctresources.report.placement import Placement, placement_from, placement_lines
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


@dataclass
class VramRecord:
    """One test that used CUDA, as the summary and the JSON report show it: its figures, its
    declared need, and what the report flags."""

    nodeid: str
    outcome: str
    device: int
    gpu: str
    date: str
    memory_key: str
    baseline_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    after_bytes: int
    leaked_bytes: int
    need_gib: float | None = None
    need_source: str | None = None
    need_kind: str | None = None
    need_most_gib: float | None = None
    oom_halvings: str | None = None
    resident_bytes: int = 0
    """What the models kept loaded between tests grew by during the test (not a leak)."""
    others_resident_bytes: int = 0
    """Another test's resident model, left out of this test's peaks."""
    reruns: int = 0
    """How many failed attempts another plugin (pytest-rerunfailures) ran again."""
    flags: list[str] = field(default_factory=list)

    @property
    def need_kind_name(self) -> str:
        """marker, config, estimate or learned."""
        if self.need_kind is None:
            return "none"
        return _NEED_KIND_NAMES.get(self.need_kind, "config")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def vram_record(nodeid: str, outcome: str, record: TestRecord) -> VramRecord | None:
    """The VRAM row of a test's record (None: the test used no CUDA)."""
    if record.peak_allocated_bytes is None:
        return None
    return VramRecord(
        nodeid=nodeid,
        outcome=outcome,
        device=int(record.device or 0),
        gpu=record.gpu or "unknown GPU",
        date=record.date or datetime.date.today().isoformat(),
        memory_key=record.memory_key or nodeid,
        baseline_bytes=int(record.baseline_bytes or 0),
        peak_allocated_bytes=int(record.peak_allocated_bytes),
        peak_reserved_bytes=int(record.peak_reserved_bytes or 0),
        after_bytes=int(record.after_bytes or 0),
        leaked_bytes=int(record.leaked_bytes or 0),
        need_gib=record.need_gib,
        need_source=record.need_source,
        need_kind=record.need_kind,
        need_most_gib=record.need_most_gib,
        oom_halvings=record.oom_halvings,
        resident_bytes=int(record.resident_bytes),
        others_resident_bytes=int(record.others_resident_bytes),
    )


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
    """What the run did: attributions, VRAM skips, and a record per test that used CUDA.

    Built from reports alone, whatever plugin made them: an outcome it does not know ranks as
    a skip, and a failed attempt that pytest-rerunfailures runs again (outcome ``rerun``) is
    counted as a rerun and superseded by the next attempt: each test is recorded by its last.
    """

    attributions: dict[str, list[int]] = field(default_factory=dict)
    vram_skips: dict[str, str] = field(default_factory=dict)
    """Tests the plugin skipped for VRAM (the need did not fit) -> the reason, from their
    records (report/coverage.py reads them too)."""
    records: dict[str, VramRecord] = field(default_factory=dict)
    halvings: dict[str, str] = field(default_factory=dict)
    auto_choices: dict[str, list[str]] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    resident_models: list[dict[str, Any]] = field(default_factory=list)
    reruns: dict[str, int] = field(default_factory=dict)
    timings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    own_settings: dict[tuple[str, str, str], set[str]] = field(default_factory=dict)
    """(field, session-wide source, its value) -> the tests whose own marker overrode it."""
    notebook_values: dict[str, list[list[str]]] = field(default_factory=dict)
    """Notebook item -> the values injected into it (``[NAME, literal, where from]``)."""
    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Test -> its CUDA memory snapshot: file, why, moment and top sites (``--ct-snapshot``)."""
    increases: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tests whose peak grew over their last passing peak (core/regression.py)."""
    gpu_runs: dict[str, str] = field(default_factory=dict)
    """GPU tests that really ran -> the GPU."""
    coverage: GpuCoverage | None = None
    """The skipped GPU tests' last real runs, found at the end of the run."""
    _outcomes: dict[str, str] = field(default_factory=dict)
    _rerun_attempt: set[str] = field(default_factory=set)
    _acted: set[str] = field(default_factory=set)
    """The tests whose reports carried a record: the plugin had something to say of them."""

    def record(self, report: pytest.TestReport) -> list[list[str]]:
        """Take one report in; returns the session-wide settings it shows a test's own marker
        overriding for the first time (``[field, source, value, the test's value]``)."""
        nodeid = report.nodeid
        first: list[list[str]] = []
        if report.when == "setup":  # a new attempt of the test
            self._outcomes[nodeid] = "passed"
            self._rerun_attempt.discard(nodeid)
        if report.outcome == RERUN_OUTCOME:
            if nodeid not in self._rerun_attempt:
                self._rerun_attempt.add(nodeid)
                self.reruns[nodeid] = self.reruns.get(nodeid, 0) + 1
        elif report.outcome != "passed":
            self._outcomes[nodeid] = _worse(self._outcomes.get(nodeid, "passed"), report.outcome)
        if report.when != "teardown" or not TestRecord.carries(report.user_properties):
            return first  # the common case: a test the plugin had nothing to say about
        self._acted.add(nodeid)
        record = TestRecord.from_properties(report.user_properties)
        for name, source, value, own, own_source in record.own_settings:
            if (name, source, value) not in self.own_settings:
                first.append([name, source, value, own, own_source])
            self.own_settings.setdefault((name, source, value), set()).add(nodeid)
        if record.resident_model is not None:
            # Even from an attempt run again: the next one reuses the model it loaded.
            self.resident_models.append(dict(record.resident_model))
        if nodeid in self._rerun_attempt:
            return first  # superseded by the next attempt, which reports its own
        if record.attribution_batch_sizes:
            self.attributions[nodeid] = list(record.attribution_batch_sizes)
        if record.attribution_timings:
            self.timings[nodeid] = list(record.attribution_timings)
        if record.oom_halvings is not None:
            self.halvings[nodeid] = record.oom_halvings
        if record.auto_batch_sizes:
            self.auto_choices[nodeid] = list(map(str, record.auto_batch_sizes))
        if record.notebook_values:
            self.notebook_values[nodeid] = [
                list(map(str, entry)) for entry in record.notebook_values
            ]
        if record.snapshot_file is not None:
            self.snapshots[nodeid] = {
                "file": record.snapshot_file,
                "why": record.snapshot_why,
                "moment": record.snapshot_moment,
                "sites": list(record.snapshot_sites),
            }
        outcome = self._outcomes.get(nodeid, "passed")
        if record.peak_increase is not None:
            self.increases[nodeid] = record.peak_increase
        if record.vram_skip is not None:
            self.vram_skips[nodeid] = record.vram_skip
        elif record.gpu_ran is not None and outcome != "skipped":
            self.gpu_runs[nodeid] = record.gpu_ran
        row = vram_record(nodeid, outcome, record)
        if row is not None:
            row.reruns = self.reruns.get(nodeid, 0)
            self.records[nodeid] = row
        placement = placement_from(nodeid, outcome, record)
        if placement is not None:
            self.placements[nodeid] = placement
        return first

    def flag(self, leak_threshold: int) -> None:
        """Attach UNDER-DECLARED, UNMARKED, LEAK and OOM RECOVERED flags to the records."""
        for record in self.records.values():
            flags = []
            peak = record.peak_reserved_bytes
            most = record.need_most_gib if record.need_most_gib is not None else record.need_gib
            if record.need_kind == "estimate":
                # Against the most the estimate allows (batch_size_max for auto), not the least.
                if most is not None and peak > most * GIB:
                    flags.append(
                        f"ESTIMATE LOW: peak {peak / GIB:.2f} GiB reserved > {most:.1f} GiB, the "
                        f"most it may take ({record.need_source}); write "
                        f"{suggested_marker(peak, record.nodeid)}"
                    )
            elif most is not None and peak > most * GIB:
                flags.append(
                    f"UNDER-DECLARED: peak {peak / GIB:.2f} GiB reserved > declared "
                    f"{most:.1f} GiB ({record.need_source}); write "
                    f"{suggested_marker(peak, record.nodeid)}"
                )
            if record.need_gib is None and peak > UNMARKED_BYTES:
                flags.append(
                    f"UNMARKED: peak {peak / GIB:.2f} GiB reserved and no declared need; "
                    f"write {suggested_marker(peak, record.nodeid)}"
                )
            if record.leaked_bytes > leak_threshold:
                flags.append(
                    f"LEAK: {record.leaked_bytes / GIB:.2f} GiB still allocated after "
                    "teardown and cleanup"
                )
            if record.oom_halvings:
                flags.append(f"OOM RECOVERED: {record.oom_halvings}")
            record.flags = flags

    def learned(self, versions: dict[str, str] | None = None) -> dict[str, LearnedNeed]:
        """Needs to remember: the peak reserved of every passed test that used CUDA, except
        a test that passed only after ct_session halved its batch size (its peak is that of a
        smaller batch than its key says); each with the libraries' ``versions``."""
        return {
            record.memory_key: LearnedNeed(
                record.peak_reserved_bytes / GIB, record.gpu, record.date, versions
            )
            for record in self.records.values()
            if record.outcome == "passed" and record.memory_key and not record.oom_halvings
        }

    def slowest_lines(self, top: int) -> list[str]:
        """The slowest attributions, ``--durations`` style, with their phases and batches."""
        calls = [(timing, nodeid) for nodeid, timings in self.timings.items() for timing in timings]
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
        calls = sum(len(sizes) for sizes in self.attributions.values())
        if calls:
            sizes = sorted({size for values in self.attributions.values() for size in values})
            parts.append(
                f"attributions: {calls} in {len(self.attributions)} test(s)"
                + (f", batch size(s) {', '.join(map(str, sizes))}" if sizes else "")
            )
        if self.records:
            top = max(self.records.values(), key=lambda r: r.peak_reserved_bytes)
            parts.append(
                f"{len(self.records)} test(s) used CUDA, highest peak "
                f"{bytes_text(top.peak_reserved_bytes)} reserved ({top.nodeid})"
            )
        return "; ".join(parts) if parts else None

    def action_lines(self, flags: list[str], top: int, *, quiet: bool) -> list[str]:
        """What went wrong or needs action (flags, skips for VRAM, lease waits), each list
        capped at ``top``; under ``-q`` the counts alone."""
        out: list[str] = []
        # Attributions that ran out of memory and passed at a smaller batch.
        halvings = [f"  {nodeid}: {text}" for nodeid, text in sorted(self.halvings.items())]
        if halvings:
            out += [f"out of memory, recovered: {len(halvings)} test(s)"]
            out += [] if quiet else capped(halvings, top)
        if flags:
            if quiet:
                kinds: dict[str, int] = {}
                for flag in flags:
                    kind = flag.split(" ", 1)[0]
                    kinds[kind] = kinds.get(kind, 0) + 1
                out.append(
                    "flagged: " + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
                )
            else:
                out += capped(flags, top)
        increases = [f"  {Increase.from_dict(found).line()}" for found in self.increases.values()]
        if increases:
            out.append(
                f"VRAM peak increased: {len(increases)} test(s), over the last passing peak on "
                "the same GPU and config"
            )
            out += [] if quiet else capped(sorted(increases), top)
        if self.vram_skips:
            out.append(f"skipped for VRAM: {len(self.vram_skips)} test(s)")
            if not quiet:
                out += capped(
                    [f"  {nodeid}: {reason}" for nodeid, reason in sorted(self.vram_skips.items())],
                    top,
                )
        out += self.coverage_lines(top, quiet=quiet)
        placements = list(self.placements.values())
        if any(p.waited_s > 0 or p.lease_wait_s < 0 for p in placements):
            out += placement_lines(placements) if not quiet else placement_lines(placements)[:1]
        out += self.snapshot_lines(top, quiet=quiet)
        return out

    def snapshot_lines(self, top: int, *, quiet: bool) -> list[str]:
        """The tests whose memory snapshot was kept for a finding, each with its file and the
        sites that held most; the count of the others (``--ct-snapshot always``)."""
        found = {
            nodeid: entry for nodeid, entry in self.snapshots.items() if entry["why"] != "always"
        }
        out = []
        if found:
            out.append(
                f"memory snapshots: {len(found)} test(s) (open in https://pytorch.org/memory_viz)"
            )
        if found and not quiet:
            lines = []
            for nodeid, entry in sorted(found.items()):
                lines.append(f"  {nodeid} ({entry['why']}): {entry['file']}")
                lines += [
                    f"      {Site(**site).text()} {entry['moment']}" for site in entry["sites"]
                ]
            out += capped(lines, top * 6)
        others = len(self.snapshots) - len(found)
        if others:
            out.append(f"memory snapshots of {others} other test(s) (--ct-snapshot always)")
        return out

    def detail_lines(self, top: int, verbosity: int) -> list[str]:
        """``-v``: the settings tests kept of their own, notebook values, placements, resident
        models, reruns, the slowest attributions; ``-vv`` also each ``auto`` choice."""
        out: list[str] = []
        if verbosity >= 2:
            for nodeid, choices in sorted(self.auto_choices.items()):
                out += [f"  {nodeid}: auto {text}" for text in choices]
        elif self.auto_choices:
            count = sum(len(choices) for choices in self.auto_choices.values())
            out.append(f"auto chose {count} batch size(s) (each with its reasons under -vv)")
        for (name, source, value), nodeids in sorted(self.own_settings.items()):
            out.append(
                f"{len(nodeids)} test(s) keep their own {name} over {session_value(source, value)}"
            )
        out += capped(self.notebook_lines(), top + 1)
        placements = list(self.placements.values())
        if not any(p.waited_s > 0 or p.lease_wait_s < 0 for p in placements):
            out += placement_lines(placements)  # with waits, it is among the actions
        out += capped(self.resident_lines(), top + 1)
        # Reruns of tests the plugin said nothing of are another plugin's business.
        reruns = [count for nodeid, count in self.reruns.items() if nodeid in self._acted]
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
        return bool(self._acted)

    def notebook_lines(self) -> list[str]:
        """The values each notebook item ran with (what the header's session-wide settings do
        not show: an item's own experiment config beats them)."""
        if not self.notebook_values:
            return []
        out = ["notebook items ran with (injected; the rest as each notebook sets it):"]
        for nodeid, entries in sorted(self.notebook_values.items()):
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
        self, top: int, capacity_gib: float | None, capacity_note: str
    ) -> tuple[list[str], list[str]]:
        """The VRAM table (the top tests by peak), and the lines of every flag."""
        ranked = sorted(self.records.values(), key=lambda r: -r.peak_reserved_bytes)
        out = [
            f"VRAM per test ({capacity_note}); {len(ranked)} test(s) used CUDA"
            + (f", top {min(top, len(ranked))} by peak reserved:" if ranked else "")
        ]
        if ranked:
            out.append(
                f"{'peak alloc':>11} {'peak resv':>10} {'declared (source)':>22} "
                f"{'headroom':>9} {'leaked':>9}  test"
            )
        for record in ranked[:top]:
            declared = (
                f"{record.need_gib:.1f} GiB ({record.need_kind_name})"
                if record.need_gib is not None
                else "-"
            )
            headroom = (
                f"{capacity_gib - record.peak_reserved_bytes / GIB:.2f}"
                if capacity_gib is not None
                else "?"
            )
            allocated = record.peak_allocated_bytes / GIB
            reserved = record.peak_reserved_bytes / GIB
            out.append(
                f"{allocated:>7.2f} GiB {reserved:>6.2f} GiB {declared:>22} {headroom:>5} GiB "
                f"{record.leaked_bytes / GIB:>5.2f} GiB  {record.nodeid}"
            )
        flags = [
            f"{flag.split(':', 1)[0]} {record.nodeid}:{flag.split(':', 1)[1]}"
            for record in ranked
            for flag in record.flags
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
        emulated = self.runtime.settings.vram_capacity_gib
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
        """Flag the records, remember the measured needs, write the report files.

        ``signal_name``: the run is being terminated (``files.SigtermReport``); the
        session may still finish after that, and then writes the files again."""
        if self._finished:
            return
        self._finished = signal_name is None
        settings = self.runtime.settings
        self.summary.flag(settings.leak_threshold_bytes.value)
        # The versions are read (from metadata, a few milliseconds) only when there is a peak.
        versions = self.runtime.library_versions() if self.summary.records else None
        measured = self.summary.learned(versions)
        stale = self.stale_learned
        if measured or stale:
            learned = self.runtime.learned()
            learned.prune(stale)
            learned.update(measured)
            learned.save()
        if self.summary.gpu_runs or self.summary.vram_skips:
            from pytest_ctresources.report import coverage

            self.summary.coverage = coverage.update(
                getattr(self.config, "cache", None),
                self.summary.gpu_runs,
                self.summary.vram_skips,
                settings.require_gpu_run_within.value,
            )
        if settings.report_json is None and settings.report_plot is None:
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
        top = settings.report_top
        if self.forgotten is not None:
            terminalreporter.write_line(
                f"ctresources: --ct-forget cleared {self.forgotten} learned VRAM need(s)"
            )
        self.summary.flag(settings.leak_threshold_bytes.value)
        show_table = (bool(self.summary.records) and verbosity >= 1) or settings.report_forced
        table: list[str] = []
        flags: list[str] = []
        if self.summary.records or settings.report_forced:
            capacity, note = self.capacity()
            table, flags = self.summary.vram_lines(top, capacity, note)
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
                *(line.removeprefix("ctresources: ") for line in settings.header_lines()),
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
