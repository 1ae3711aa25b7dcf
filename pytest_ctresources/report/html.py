"""pytest-html 4.x: each test's VRAM figures in its row of the results table, the VRAM plot
in the report's summary.

:class:`HtmlReport` is registered (plugin.py) only where pytest-html is loaded and ``--html``
is given, on the process that writes the HTML file: the controller under pytest-xdist, which
is where the summary's records are. The figures are those of the terminal summary and the
JSON report (``RunSummary.results``, keyed by node id); the plot is report/plot.py's, drawn
in memory and embedded as an inline PNG (``--ct-report-plot`` is not needed).
"""

from __future__ import annotations

import base64
import html
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.report.results import RERUN_OUTCOME
from pytest_ctresources.units import GIB

if TYPE_CHECKING:
    from pytest_ctresources.report.results import TestResult
    from pytest_ctresources.report.summary import SummaryReporter

#: (column key, heading): a key is what pytest-html sorts the column by (``col-<key>``).
COLUMNS = (
    ("ctPeakAllocated", "VRAM peak allocated"),
    ("ctPeakReserved", "VRAM peak reserved"),
    ("ctDeclaredNeed", "VRAM declared need"),
    ("ctLeaked", "VRAM leaked"),
)
#: pytest-html sorts a column by comparing its cells' HTML as strings: each figure is padded
#: to this many characters with figure spaces (as wide as a digit, and written as an entity
#: that sorts before every digit), so that string order is numeric order and the decimal
#: points line up.
FIGURE_WIDTH = 8
FIGURE_SPACE = "&#8199;"


def padded(value: float, decimals: int = 2) -> str:
    """``value`` with :data:`FIGURE_WIDTH` characters at least: ``&#8199;&#8199;&#8199;3.50``."""
    text = f"{value:.{decimals}f}"
    return FIGURE_SPACE * max(0, FIGURE_WIDTH - len(text)) + text


def row_cells(result: TestResult | None) -> list[str]:
    """The cells of :data:`COLUMNS` for one row; empty for a test that did not use CUDA."""
    if result is None or not result.record.used_cuda:
        texts = ["", "", "", ""]
    else:
        need = result.record.need_gib
        texts = [
            f"{padded(result.peak_allocated / GIB)} GiB",
            f"{padded(result.peak_reserved / GIB)} GiB",
            f"{padded(need, 1)} GiB ({result.need_kind_name})" if need is not None else "",
            f"{padded(result.leaked / GIB)} GiB",
        ]
    return [
        f'<td class="col-{key}">{text}</td>' for (key, _), text in zip(COLUMNS, texts, strict=True)
    ]


def summary_html(reporter: SummaryReporter) -> str:
    """The report summary's VRAM section: the plot as an inline PNG (or why there is none)."""
    from pytest_ctresources.settings.report_paths import check_plot_support

    capacity, note = reporter.capacity()
    count = len(reporter.summary.used_cuda)
    heading = html.escape(f"VRAM per test (pytest-ctresources): {count} test(s) used CUDA; {note}")
    unsupported = check_plot_support()
    if unsupported is not None:
        body = f"<p>The VRAM plot {html.escape(unsupported)}.</p>"
    else:
        try:
            from pytest_ctresources.report import plot

            image = plot.png(plot.figure(reporter.summary, capacity, note))
        except Exception as exc:  # the HTML report is written whatever the plot does
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            body = f"<p>The VRAM plot could not be drawn: {html.escape(reason)}</p>"
        else:
            encoded = base64.b64encode(image).decode("ascii")
            body = (
                f'<img class="ctresources-vram-plot" alt="{heading}" '
                f'style="max-width: 100%" src="data:image/png;base64,{encoded}">'
            )
    return f'<details class="ctresources-vram" open><summary>{heading}</summary>{body}</details>'


class HtmlReport:
    """The VRAM columns and plot of pytest-html's report (its hooks, 4.x signatures).

    Each runs last and appends: other plugins' cells stay where they put them, and a row that
    one of them removed (by emptying ``cells``, as pytest-html's documentation shows) stays
    removed."""

    name = "ctresources-html"

    def __init__(self, reporter: SummaryReporter) -> None:
        self._reporter = reporter

    @pytest.hookimpl(trylast=True)
    def pytest_html_results_table_header(self, cells: list[str]) -> None:
        cells.extend(
            f'<th class="sortable" data-column-type="{key}">{heading}</th>'
            for key, heading in COLUMNS
        )

    @pytest.hookimpl(trylast=True)
    def pytest_html_results_table_row(
        self, report: pytest.TestReport | pytest.CollectReport, cells: list[str]
    ) -> None:
        # pytest-html builds a test's rows from its teardown report, after the summary has
        # recorded it (pytest-html's logreport hook runs last).
        if not cells:
            return
        result = None
        if report.outcome != RERUN_OUTCOME:  # an attempt run again: the record is the last's
            result = self._reporter.summary.results.get(report.nodeid)
        cells.extend(row_cells(result))

    @pytest.hookimpl(trylast=True)
    def pytest_html_results_summary(self, postfix: list[str]) -> None:
        # After the summary's own session-end work (pytest-html calls this from its
        # trylast pytest_sessionfinish): the records are complete, from every worker. The
        # picture only where some test used CUDA, or --ct-report / --ct-report-plot asks.
        settings = self._reporter.runtime.settings
        asked = settings.report.value or settings.report_plot_path is not None
        if self._reporter.summary.used_cuda or asked:
            postfix.append(summary_html(self._reporter))
