"""pytest-html: each test's row carries its VRAM figures, the summary
carries the VRAM plot as an inline PNG, serial and under ``-n 2``; nothing changes without
``--html`` or without pytest-html. Fed by the stand-in for torch.cuda (tests/fake_cuda.py).
"""

from __future__ import annotations

import base64
import html
import json
import re
import struct
from typing import Any

import pytest

from pytest_ctresources.report import html as html_module
from pytest_ctresources.settings.report_paths import PNG_MAGIC
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

SUITE = """
import pytest
from conftest import FAKE

def test_no_cuda():
    pass

@pytest.mark.vram(gib=2)
def test_under_declared():
    FAKE.alloc(3.5); FAKE.free(3.5)

LEAKED = []
def test_leaks():
    FAKE.alloc(0.5)
"""
#: Says, at the end of the run, whether the plugin's pytest-html part was registered.
REGISTERED = """
def pytest_sessionfinish(session):
    plugin = session.config.pluginmanager.get_plugin("ctresources-html")
    open("registered.txt", "w").write(str(plugin is not None))
"""
HEADINGS = [
    "VRAM peak allocated",
    "VRAM peak reserved",
    "VRAM declared need",
    "VRAM leaked",
]


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeconftest(FAKE_CUDA_CONFTEST + REGISTERED)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def _tests(report: str) -> dict[str, list[dict[str, Any]]]:
    """pytest-html's per-test data: the rows, as it keeps them in the page (JSON, escaped)."""
    match = re.search(r'data-jsonblob="([^"]*)"', report)
    assert match is not None
    tests: dict[str, list[dict[str, Any]]] = json.loads(html.unescape(match.group(1)))["tests"]
    return tests


def _vram_cells(row: dict[str, Any]) -> list[str]:
    """The row's VRAM cells as a reader sees them (figure spaces shown as spaces)."""
    cells: list[str] = row["resultsTableRow"][-len(HEADINGS) :]
    return [
        html.unescape(re.sub(r"<[^>]+>", "", cell)).replace("\u2007", " ").strip() for cell in cells
    ]


def _headings(report: str) -> list[str]:
    head = report[report.index('<thead id="results-table-head">') :]
    head = head[: head.index("</thead>")]
    return re.findall(r"<th[^>]*>([^<]*)</th>", head)


def _check_rows(report: str) -> None:
    assert _headings(report)[-4:] == HEADINGS
    rows = _tests(report)
    assert _vram_cells(rows["test_suite.py::test_under_declared"][0]) == [
        "3.50 GiB",
        "3.50 GiB",
        "2.0 GiB (marker)",
        "0.00 GiB",
    ]
    assert _vram_cells(rows["test_suite.py::test_leaks"][0]) == [
        "0.50 GiB",
        "0.50 GiB",
        "",
        "0.50 GiB",
    ]
    # A test that never touched CUDA has no figures (but its row keeps the columns).
    assert _vram_cells(rows["test_suite.py::test_no_cuda"][0]) == ["", "", "", ""]


def _embedded_png(report: str) -> bytes:
    match = re.search(
        r'<details class="ctresources-vram" open><summary>([^<]*)</summary>'
        r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
        report,
    )
    assert match is not None, "no inline PNG in the summary"
    assert html.unescape(match.group(1)) == (
        "VRAM per test (pytest-ctresources): 2 test(s) used CUDA; "
        "GPU 0 (NVIDIA GeForce RTX 4090) 23.6 GiB"
    )
    return base64.b64decode(match.group(2))


def test_rows_carry_the_figures_and_the_summary_the_plot(project: pytest.Pytester) -> None:
    result = project.runpytest("--html", "report.html")
    result.assert_outcomes(passed=3, warnings=1)  # the CtLeakWarning of test_leaks
    report = (project.path / "report.html").read_text()
    _check_rows(report)
    image = _embedded_png(report)
    assert image.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", image[16:24])  # the PNG's IHDR
    assert (width, height) == (1100, 300)  # report/plot.py's figure for two tests
    # Drawn in memory: no plot file anywhere (pytest-html's own assets/ has only its CSS).
    assert not list(project.path.rglob("*.png"))
    assert (project.path / "registered.txt").read_text() == "True"


def test_under_xdist_the_controller_fills_rows_and_summary(project: pytest.Pytester) -> None:
    # One worker: the rows the controller fills from shipped reports are the subject.
    result = project.runpytest("-n", "1", "--html", "report.html")
    result.assert_outcomes(passed=3, warnings=1)
    report = (project.path / "report.html").read_text()
    _check_rows(report)
    assert _embedded_png(report).startswith(PNG_MAGIC)


def test_self_contained_report_too(project: pytest.Pytester) -> None:
    project.runpytest("--html", "report.html", "--self-contained-html").assert_outcomes(
        passed=3, warnings=1
    )
    report = (project.path / "report.html").read_text()
    _check_rows(report)
    assert _embedded_png(report).startswith(PNG_MAGIC)


def test_a_rerun_attempts_row_has_no_figures(project: pytest.Pytester) -> None:
    # The record is the last attempt's: the failed attempt's row must not claim its figures.
    project.makepyfile(
        test_suite="""
        import pathlib
        from conftest import FAKE

        def test_flaky():
            counter = pathlib.Path(__file__).with_name("flaky.count")
            attempts = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(attempts + 1))
            FAKE.alloc(1.25); FAKE.free(1.25)
            assert attempts > 0
        """
    )
    result = project.runpytest("--reruns", "1", "--html", "report.html")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    rows = _tests((project.path / "report.html").read_text())["test_suite.py::test_flaky"]
    by_result = {row["result"]: _vram_cells(row) for row in rows}
    assert by_result == {
        "Rerun": ["", "", "", ""],
        "Passed": ["1.25 GiB", "1.25 GiB", "", "0.00 GiB"],
    }


def test_a_row_another_plugin_removed_stays_removed(project: pytest.Pytester) -> None:
    (project.path / "conftest.py").write_text(
        FAKE_CUDA_CONFTEST
        + """
def pytest_html_results_table_row(report, cells):
    if report.nodeid.endswith("test_no_cuda"):
        del cells[:]  # pytest-html's documented way to leave a row out
"""
    )
    project.runpytest("--html", "report.html").assert_outcomes(passed=3, warnings=1)
    rows = _tests((project.path / "report.html").read_text())
    assert "test_suite.py::test_no_cuda" not in rows
    assert _vram_cells(rows["test_suite.py::test_leaks"][0])[3] == "0.50 GiB"


def test_without_cuda_the_summary_plot_says_so(pytester: pytest.Pytester) -> None:
    # Without a test that used CUDA the picture is drawn only when asked (--ct-report).
    pytester.makepyfile("def test_cpu(): pass")
    pytester.runpytest("--html", "other.html", "-o", "ct_cleanup=auto").assert_outcomes(passed=1)
    assert "ctresources-vram-plot" not in (pytester.path / "other.html").read_text()
    pytester.runpytest("--html", "report.html", "--ct-report").assert_outcomes(passed=1)
    report = (pytester.path / "report.html").read_text()
    assert "VRAM per test (pytest-ctresources): 0 test(s) used CUDA; no CUDA GPU detected" in (
        html.unescape(report)
    )
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', report)
    assert match is not None
    image = base64.b64decode(match.group(1))
    assert struct.unpack(">II", image[16:24]) == (800, 240)  # the "No CUDA data" figure


def test_without_matplotlib_the_summary_says_what_is_missing(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_ctresources.settings import report_paths

    monkeypatch.setattr(
        report_paths, "check_plot_support", lambda: "needs matplotlib, which is not installed"
    )
    project.runpytest("--html", "report.html").assert_outcomes(passed=3, warnings=1)
    report = (project.path / "report.html").read_text()
    assert "<p>The VRAM plot needs matplotlib, which is not installed.</p>" in report
    assert "data:image/png" not in report
    _check_rows(report)  # the figures do not need it


def test_nothing_changes_without_html(project: pytest.Pytester) -> None:
    # pytest-html loaded but no --html: not registered, no file. (No cache: the second run
    # would use the needs the first one learned.)
    plain = project.runpytest("-p", "no:cacheprovider")
    plain.assert_outcomes(passed=3, warnings=1)
    assert (project.path / "registered.txt").read_text() == "False"
    # pytest-html not loaded at all: the same run, the same summary.
    (project.path / "registered.txt").unlink()
    without = project.runpytest("-p", "no:cacheprovider", "-p", "no:html")
    without.assert_outcomes(passed=3, warnings=1)
    assert (project.path / "registered.txt").read_text() == "False"

    def summary(result: pytest.RunResult) -> list[str]:
        lines = result.stdout.lines
        start = next(i for i, line in enumerate(lines) if "ctresources summary" in line)
        end = next(i for i, line in enumerate(lines) if " passed" in line and i > start)
        return lines[start:end]

    assert summary(plain) == summary(without)
    assert not list(project.path.rglob("*.html"))


def test_padded_figures_sort_as_numbers_in_pytest_htmls_string_order() -> None:
    # pytest-html compares the cells' HTML as strings.
    values = [0.0, 0.25, 3.5, 9.99, 10.0, 139.8, 1024.0]
    texts = [html_module.padded(value) for value in values]
    assert sorted(texts) == texts
    assert {len(html.unescape(text)) for text in texts} == {html_module.FIGURE_WIDTH}
    assert "" < texts[0]  # a test without figures sorts below every figure


def test_nothing_heavy_is_imported_before_the_summary_draws(pytester: pytest.Pytester) -> None:
    # In a process of its own: this suite has torch and matplotlib imported already.
    # (The conftest's sessionfinish runs before pytest-html's, which asks for the summary.)
    pytester.makeconftest(
        """
        import sys
        def pytest_sessionfinish(session):
            loaded = [m for m in ("torch", "matplotlib") if m in sys.modules]
            print("HEAVY:" + ",".join(loaded) + ":END")
        """
    )
    pytester.makepyfile("def test_cpu(): pass")
    result = pytester.runpytest_subprocess(
        "-s", "-p", "no:nbmake", "--html", "report.html", "--ct-report"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*HEAVY::END*"])
    assert "data:image/png;base64," in (pytester.path / "report.html").read_text()
