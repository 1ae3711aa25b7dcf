"""The VRAM plot: distinct colours for the peaks and the declared need,
the capacity line, labels readable for 60 tests (truncated, the full node id in the JSON
report), and without CUDA data an image that says so. Unit tests on the matplotlib figure
object, and on the PNG that ``--ct-report-plot`` writes.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

# record and summary as modules: pytest would try to collect a class named Test* imported here.
from pytest_ctresources.core import record as record_module
from pytest_ctresources.report import plot
from pytest_ctresources.report import results as results_module
from pytest_ctresources.report import run_summary as summary_module
from pytest_ctresources.settings.report_paths import PNG_MAGIC
from pytest_ctresources.units import GIB
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

RTX = "GPU 0 (NVIDIA GeForce RTX 4090) 23.6 GiB"


def _record(
    nodeid: str, reserved_gib: float, need_gib: float | None = None
) -> results_module.TestResult:
    record = record_module.TestRecord(
        device=0,
        gpu="NVIDIA GeForce RTX 4090",
        date="2026-12-01",
        memory_key=nodeid,
        baseline_bytes=0,
        peak_allocated_bytes=int(0.7 * reserved_gib * GIB),
        peak_reserved_bytes=int(reserved_gib * GIB),
        after_bytes=0,
        leaked_bytes=0,
        need_gib=need_gib,
        need_kind="marker" if need_gib is not None else None,
    )
    return results_module.TestResult(nodeid, record)


def _summary(*results: results_module.TestResult) -> summary_module.RunSummary:
    return summary_module.RunSummary(results={result.nodeid: result for result in results})


def _png_size(image: bytes) -> tuple[int, int]:
    assert image.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", image[16:24])  # the IHDR chunk comes first
    return width, height


def _legend(drawn: Figure) -> list[str]:
    legend = drawn.axes[0].get_legend()
    assert legend is not None
    return [text.get_text() for text in legend.get_texts()]


SIXTY = [
    _record(
        f"tests/experiments/test_attribution_{i % 4}.py::test_attribution_matches_reference"
        f"[gemma-2-2b-prompt{i}-batch{2 ** (i % 6 + 4)}]",
        1 + i / 4,
        need_gib=2 + i / 4 if i % 3 else None,
    )
    for i in range(60)
]


def test_sixty_tests_get_one_readable_label_each_and_a_figure_tall_enough() -> None:
    drawn = plot.figure(_summary(*SIXTY), 23.6, RTX)
    (axes,) = drawn.axes
    labels = axes.get_yticklabels()
    texts = [label.get_text() for label in labels]
    assert len(texts) == 60
    assert len(set(texts)) == 60  # truncation kept them apart
    assert all(len(text) <= plot.LABEL_CHARS for text in texts)
    # The directory all share is said once, in the title, not 60 times.
    assert not any(text.startswith("tests/") for text in texts)
    assert "under tests/experiments/" in axes.get_title()
    # Highest peak at the top: the last tick is the 60th test's.
    assert texts[-1].startswith("test_attribution_3.py::")
    assert texts[-1].endswith("prompt59-batch512]")
    # Readable: no two labels overlap, and none is cut off at the figure's edge.
    drawn.canvas.draw()
    boxes = sorted((label.get_window_extent() for label in labels), key=lambda box: float(box.y0))
    assert all(lower.y1 <= upper.y0 for lower, upper in itertools.pairwise(boxes))
    assert min(float(box.x0) for box in boxes) >= 0
    assert drawn.get_size_inches()[1] >= 60 * plot.BAR_INCHES
    # The PNG that is written has that height, in pixels at the plot's resolution.
    width, height = _png_size(plot.png(drawn))
    assert height == round(drawn.get_size_inches()[1] * plot.DPI)
    assert height >= 60 * plot.BAR_INCHES * plot.DPI
    assert width == 11 * plot.DPI


def test_peaks_need_and_capacity_have_distinct_colours_and_a_legend() -> None:
    drawn = plot.figure(_summary(*SIXTY[55:]), 23.6, RTX)  # peaks of 14.75 to 15.75 GiB
    (axes,) = drawn.axes
    reserved, allocated = (
        {to_hex(bar.get_facecolor()) for bar in container} for container in axes.containers
    )
    (needs,) = axes.collections  # the declared needs: one tick per test that has one
    need_colours = {to_hex(colour) for colour in needs.get_colors()}
    (capacity,) = axes.lines
    assert capacity.get_xdata()[0] == pytest.approx(23.6)
    colours = [reserved, allocated, need_colours, {to_hex(capacity.get_color())}]
    assert all(len(group) == 1 for group in colours)
    assert len(set().union(*colours)) == 4
    assert len(needs.get_segments()) == 4  # all but test 57 declare a need
    assert _legend(drawn) == [
        "peak reserved",
        "peak allocated",
        "declared need",
        "capacity 23.6 GiB",
    ]
    assert axes.get_xlim()[1] > 23.6  # the capacity line is inside the chart


def test_a_capacity_far_above_every_peak_is_named_rather_than_squeezing_the_bars() -> None:
    drawn = plot.figure(_summary(_record("t.py::test_small", 0.5)), 139.8, "H200 139.8 GiB")
    (axes,) = drawn.axes
    assert not axes.lines
    assert axes.get_xlim()[1] < 1
    assert _legend(drawn) == [
        "peak reserved",
        "peak allocated",
        "capacity 139.8 GiB (off the scale, right)",
    ]


def test_no_cuda_data_says_so_on_the_image() -> None:
    skipped = record_module.TestRecord(vram_skip="needs 40.0 GiB VRAM; ...")
    summary = _summary(results_module.TestResult("t.py::test_big", skipped))
    drawn = plot.figure(summary, None, "no CUDA GPU detected")
    assert not drawn.axes  # no empty chart
    assert [text.get_text() for text in drawn.texts] == [
        plot.TITLE,
        "No CUDA data: no test of this run used CUDA",
        "no CUDA GPU detected; 1 test(s) skipped for VRAM",
    ]


def test_a_run_without_cuda_writes_the_image_that_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_cpu(): pass")
    pytester.runpytest("--ct-report-plot", "p.png").assert_outcomes(passed=1)
    # The "No CUDA data" figure's size, not the chart's.
    assert _png_size((pytester.path / "p.png").read_bytes()) == (800, 240)


LONG = """
import pytest
from conftest import FAKE

@pytest.mark.parametrize("prompt", ["the capital of the country whose capital is paris is"])
def test_attribution_of_a_prompt_long_enough_to_be_cut(prompt):
    FAKE.alloc(1); FAKE.free(1)
"""


def test_a_long_node_id_is_cut_on_the_plot_and_whole_in_the_json_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(test_long=LONG)
    result = pytester.runpytest("--ct-report-json", "r.json", "--ct-report-plot", "p.png")
    result.assert_outcomes(passed=1)
    # The summary names what it wrote.
    result.stdout.fnmatch_lines(["wrote the JSON report: r.json", "wrote the VRAM plot: p.png"])
    (test,) = json.loads((pytester.path / "r.json").read_text())["tests"]
    nodeid = test["nodeid"]
    assert nodeid == (
        "test_long.py::test_attribution_of_a_prompt_long_enough_to_be_cut"
        "[the capital of the country whose capital is paris is]"
    )
    (label,), prefix = plot.bar_labels([nodeid])
    assert prefix == "test_long.py::"
    assert len(label) == plot.LABEL_CHARS
    head, tail = label.split("…")
    assert nodeid.removeprefix(prefix).startswith(head)
    assert nodeid.endswith(tail)
    assert _png_size((pytester.path / "p.png").read_bytes())[0] == 11 * plot.DPI


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("test_a.py::test_short", "test_a.py::test_short"),
        # The file kept whole (it takes at most half), the cut in the test's name.
        (
            "test_attribution.py::test_matches_reference[gemma-2-2b-prompt12-batch256-float32]",
            "test_attribution.py::…[gemma-2-2b-prompt12-batch256-float32]",
        ),
        # A file too long to keep whole: a third of the label from the start.
        (
            "a_very_long_directory_name/and_another/test_file.py::test_x[abcdefghijklmnopqrstuvwxyz]",
            "a_very_long_director….py::test_x[abcdefghijklmnopqrstuvwxyz]",
        ),
    ],
)
def test_shortened(label: str, expected: str) -> None:
    assert plot.shortened(label) == expected
    assert len(plot.shortened(label)) <= plot.LABEL_CHARS


@pytest.mark.parametrize(
    ("nodeids", "expected"),
    [
        ([], ""),
        (["tests/a/test_x.py::test_1", "tests/a/test_y.py::test_2"], "tests/a/"),
        (["tests/a/test_x.py::test_1", "tests/ab/test_y.py::test_2"], "tests/"),
        (["tests/test_x.py::test_1", "tests/test_x.py::test_2"], "tests/test_x.py::"),
        # Test names and parameters are never cut, even where they share a "/".
        (["test_a.py::test[x/1]", "test_b.py::test[x/2]"], ""),
        (["test_x.py::test_1", "other.py::test_2"], ""),
    ],
)
def test_common_prefix(nodeids: list[str], expected: str) -> None:
    assert plot.common_prefix(nodeids) == expected


def test_thousands_of_tests_draw_the_highest_peaks(tmp_path: Path) -> None:
    records = [_record(f"t.py::test_{i}", i / 100) for i in range(1200)]
    drawn = plot.figure(_summary(*records), 23.6, RTX)
    (axes,) = drawn.axes
    texts = [label.get_text() for label in axes.get_yticklabels()]
    assert len(texts) == plot.MOST_PLOTTED
    assert texts[0] == "test_200" and texts[-1] == "test_1199"
    assert "1200 test(s) used CUDA, the 1000 highest peaks drawn" in axes.get_title()
