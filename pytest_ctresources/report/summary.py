"""The end-of-run report's plugin: :class:`SummaryReporter` takes each test report into the
run's :class:`~pytest_ctresources.report.run_summary.RunSummary`, prints the ``ctresources
summary`` section, writes the report files (report/files.py) and remembers the measured
needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core.record import TestRecord
from pytest_ctresources.report.run_summary import RunSummary, session_value, wrapped
from pytest_ctresources.settings.activation import activation_of

if TYPE_CHECKING:
    from pytest_ctresources.core.runtime import Runtime


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
        if not self.verbose:
            return
        for own in first_overrides:
            session = session_value(own["session_source"], own["session_value"])
            self.terminal.write_line(
                f"ctresources: {report.nodeid} keeps its own {own['field']}={own['value']} "
                f"({own['source']}) over {session}; said once per setting, the summary counts them"
            )
        if report.when == "teardown":
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

        self.written = report_files.write_reports(
            self.config, self.runtime, self.summary, self.capacity, exitstatus, signal_name
        )

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
