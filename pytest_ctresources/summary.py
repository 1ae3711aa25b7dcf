"""The end-of-run ``ctresources`` terminal summary.

It is built only from test reports (``user_properties`` and skip reasons), which pytest-xdist
ships from workers to the controller, so a distributed run gets one complete summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_ctresources.runtime import Runtime

#: user_properties key under which ct_session records the batch sizes of its attributions.
ATTRIBUTIONS_PROPERTY = "ct_attribution_batch_sizes"
#: user_properties key under which the cleanup records how many figures it closed.
FIGURES_PROPERTY = "ct_figures_closed"
VRAM_SKIP_PATTERN = re.compile(r"needs [0-9.]+ GiB VRAM")


@dataclass
class RunSummary:
    """What the run did with circuit-tracer: attributions per test, VRAM skips."""

    attributions: dict[str, list[int]] = field(default_factory=dict)
    vram_skips: dict[str, str] = field(default_factory=dict)

    def record(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == ATTRIBUTIONS_PROPERTY and isinstance(value, list):
                self.attributions.setdefault(report.nodeid, []).extend(value)
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            if VRAM_SKIP_PATTERN.match(reason):
                self.vram_skips[report.nodeid] = reason

    def is_empty(self) -> bool:
        return not self.attributions and not self.vram_skips

    def lines(self, settings_lines: list[str], gpu_lines: list[str]) -> list[str]:
        calls = sum(len(sizes) for sizes in self.attributions.values())
        sizes = sorted({size for values in self.attributions.values() for size in values})
        out = [line.removeprefix("ctresources: ") for line in settings_lines]
        out += gpu_lines
        out.append(
            f"attributions: {calls} in {len(self.attributions)} test(s)"
            + (f", batch size(s) {', '.join(map(str, sizes))}" if sizes else "")
        )
        out.append(f"skipped for VRAM: {len(self.vram_skips)} test(s)")
        out += [f"  {nodeid}: {reason}" for nodeid, reason in sorted(self.vram_skips.items())]
        return out


class SummaryReporter:
    """Registered on the controller (or the only process): collects reports, prints the summary."""

    name = "ctresources-summary"

    def __init__(self, runtime: Runtime, config: pytest.Config) -> None:
        self.runtime = runtime
        self.summary = RunSummary()
        self.verbose = config.get_verbosity() > 0
        self.config = config

    @property
    def terminal(self) -> pytest.TerminalReporter:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        assert reporter is not None  # registered whenever the terminal is in use
        return reporter  # type: ignore[no-any-return]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.summary.record(report)
        if report.when == "teardown" and self.verbose:
            closed = dict(report.user_properties).get(FIGURES_PROPERTY)
            if closed:
                self.terminal.write_line(
                    f"ctresources: closed {closed} matplotlib figure(s) "
                    f"left open by {report.nodeid}"
                )

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.summary.is_empty():
            return
        terminalreporter.section("ctresources summary")
        gpu_lines = self.runtime.gpu_facts().summary_lines()
        for line in self.summary.lines(self.runtime.settings.header_lines(), gpu_lines):
            terminalreporter.write_line(line)
