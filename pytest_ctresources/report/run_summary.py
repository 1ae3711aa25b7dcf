"""What the run did, for the end-of-run report: :class:`RunSummary`, one
:class:`~pytest_ctresources.report.results.TestResult` per test taken in from the test
reports (``ct_*`` ``user_properties`` and outcomes, which pytest-xdist ships from workers to
the controller, so a distributed run gets one complete summary), and the text of the
``ctresources summary`` section and its VRAM table.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from pytest_ctresources.core.learned import LearnedNeed
from pytest_ctresources.core.record import AT_TOP, PLAIN_RUN_WORKER, OwnSetting, TestRecord
from pytest_ctresources.report.results import RERUN_OUTCOME, TestResult, worse
from pytest_ctresources.units import GIB, bytes_text

if TYPE_CHECKING:
    from pytest_ctresources.report.coverage import GpuCoverage

T = TypeVar("T")


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

    def record(self, report: pytest.TestReport) -> Sequence[OwnSetting]:
        """Take one report in; returns the session-wide settings it shows a test's own marker
        overriding for the first time.

        Three times per test of the run: each attribute of the report is read once."""
        nodeid, when, outcome = report.nodeid, report.when, report.outcome
        results = self.results
        result = results.get(nodeid)
        if result is None:
            result = results[nodeid] = TestResult(nodeid)
        if when == "setup":  # a new attempt of the test
            result.outcome = "passed"
            result.rerun_attempt = False
            result.seconds = 0.0
            result.ran = False
        result.seconds += report.duration
        if outcome == "skipped":
            result.ran = False
        elif when == "call":
            result.ran = True
        if outcome == RERUN_OUTCOME:
            if not result.rerun_attempt:
                result.rerun_attempt = True
                result.reruns += 1
        elif outcome != "passed":
            result.outcome = worse(result.outcome, outcome)
        if when != "teardown":
            return ()
        if not result.rerun_attempt:
            results[nodeid] = results.pop(nodeid)  # finished: the order it did
        properties = report.user_properties
        if not properties or not TestRecord.carries(properties):
            return ()  # the common case: a test the plugin had nothing to say about
        first: list[OwnSetting] = []
        result.acted = True
        record = TestRecord.from_properties(report.user_properties)
        for own in record.own_settings:
            key = (own["field"], own["session_source"], own["session_value"])
            if key not in self.own_settings:
                first.append(own)
            self.own_settings.setdefault(key, set()).add(nodeid)
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
        if found_increases := self.by_test(lambda r: r.peak_increase):
            from pytest_ctresources.core.regression import Increase

            increases = [
                f"  {Increase.from_dict(found).line()}" for found in found_increases.values()
            ]
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
        placement = self._placement_lines(waited=True)
        out += placement if not quiet else placement[:1]
        out += self.snapshot_lines(top, quiet=quiet)
        return out

    def _placement_lines(self, *, waited: bool) -> list[str]:
        """How the tests were placed on GPUs (report/placement.py): among the actions where
        it made a test wait (``waited``), else among the details."""
        if not (placed := [result.record for result in self.placed]):
            return []
        from pytest_ctresources.report.placement import made_wait, placement_lines

        return placement_lines(placed) if made_wait(placed) == waited else []

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
            from pytest_ctresources.report.snapshot_sites import Site

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
        out += self._placement_lines(waited=False)  # with waits, it is among the actions
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
            for entry in entries:
                literal = entry["value"]
                shown = literal if len(literal) <= 40 else literal[:37] + "..."
                groups.setdefault(entry["source"], []).append(f"{entry['name']}={shown}")
            text = "; ".join(f"{', '.join(values)} ({where})" for where, values in groups.items())
            if entries[0]["injected"] == AT_TOP:
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
                f"  {model.get('worker', PLAIN_RUN_WORKER)} GPU {model.get('device', '?')}: "
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
            (flag.kind, f"{flag.kind} {result.nodeid}: {flag.detail}")
            for result in ranked
            for flag in result.flags(leak_threshold)
        ]
        return out, flags
