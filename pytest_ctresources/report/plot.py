"""The VRAM plot: one horizontal bar per test that used CUDA, against the declared needs and
the capacity.

``--ct-report-plot`` writes it to a file (report/files.py); the pytest-html summary embeds it
(report/html.py). matplotlib is imported only here, when a plot is drawn, and only through
its object API with the Agg canvas, never pyplot: the user's pyplot state and backend are
left alone.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from pytest_ctresources.units import GIB

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from pytest_ctresources.report.results import TestResult
    from pytest_ctresources.report.run_summary import RunSummary

#: The most tests the plot draws (the top ones by peak): matplotlib refuses images over
#: 2**16 pixels a side, which :data:`BAR_INCHES` per bar at :data:`DPI` reaches at about
#: 2150 bars.
MOST_PLOTTED = 1000
#: Height of one test's row: its 8-point label stays readable with 60 or 600 tests.
BAR_INCHES = 0.3
DPI = 100
#: The longest bar label; a longer node id is cut in the middle (the JSON report has it whole).
LABEL_CHARS = 60
#: Beyond this many times the largest figure, the capacity line would squeeze every bar into
#: the left edge: it is then named in the legend instead of drawn.
CAPACITY_SCALE = 4.0
#: From this many tests the x axis is labelled at the top too, where a tall chart is read.
TOP_AXIS_FROM = 25

# The Okabe-Ito palette: told apart with the common colour-vision deficiencies.
RESERVED_COLOUR = "#56B4E9"  # sky blue, the wide bar
ALLOCATED_COLOUR = "#0072B2"  # blue, the narrow bar inside it
NEED_COLOUR = "#E69F00"  # orange, a tick across the bar
CAPACITY_COLOUR = "#D55E00"  # vermillion, dashed
TITLE = "VRAM per test (pytest-ctresources)"
NO_DATA = "No CUDA data: no test of this run used CUDA"


def shortened(label: str, most: int = LABEL_CHARS) -> str:
    """``label`` cut in the middle to ``most`` characters. Its start (the file) and its end
    (the test's parameters) are what tell tests apart: the file is kept whole when it takes
    at most half the label, the cut falls in the test's name."""
    if len(label) <= most:
        return label
    file, separator, _ = label.partition("::")
    head = len(file) + 2 if separator and len(file) + 2 <= most // 2 else most // 3
    tail = most - head - 1
    return f"{label[:head]}…{label[-tail:]}"


def common_prefix(nodeids: list[str]) -> str:
    """What every node id starts with and the labels leave out: their file and ``::`` where
    they share one (``tests/test_a.py::``), else their common directories
    (``tests/experiments/``), else ``""``.

    Only whole parts of the file path: a shared beginning of test names or parameters
    (``test_a.py::test[x/1]``, ``test_a.py::test[x/2]``) is never cut."""
    if not nodeids:
        return ""
    files = {nodeid.partition("::")[0] for nodeid in nodeids}
    if len(files) == 1 and all("::" in nodeid for nodeid in nodeids):
        return f"{files.pop()}::"
    shortest, longest = min(files), max(files)  # the common prefix of all is theirs
    length = 0
    while length < len(shortest) and shortest[length] == longest[length]:
        length += 1
    return shortest[: shortest.rfind("/", 0, length) + 1]


def bar_labels(nodeids: list[str]) -> tuple[list[str], str]:
    """Each test's label (its node id without the :func:`common_prefix`, shortened) and the
    prefix left out."""
    prefix = common_prefix(nodeids)
    return [shortened(nodeid[len(prefix) :]) for nodeid in nodeids], prefix


def figure(summary: RunSummary, capacity_gib: float | None, capacity_note: str) -> Figure:
    """The plot of ``summary``'s tests that used CUDA, highest peak at the top; at most
    :data:`MOST_PLOTTED` of them. Without any, a figure that says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import offset_copy

    ranked = sorted(summary.used_cuda, key=lambda r: r.peak_reserved)
    if not ranked:
        drawn = Figure(figsize=(8, 2.4), dpi=DPI)
        FigureCanvasAgg(drawn)
        _say_no_data(drawn, summary, capacity_note)
        return drawn
    drawn_tests = ranked[-MOST_PLOTTED:]
    labels, prefix = bar_labels([result.nodeid for result in drawn_tests])
    title = f"{TITLE}: {len(ranked)} test(s) used CUDA"
    if len(ranked) > len(drawn_tests):
        title += f", the {len(drawn_tests)} highest peaks drawn"
    if prefix.endswith("::"):
        title += f"\nin {prefix[:-2]}"
    elif prefix:
        title += f"\nunder {prefix}"
    top_axis = len(drawn_tests) >= TOP_AXIS_FROM
    # The bars, and above them the title, the legend and (top_axis) the x axis's labels.
    header = 0.25 * (title.count("\n") + 1) + 0.35 + (0.25 if top_axis else 0.0)
    height = max(3.0, BAR_INCHES * len(drawn_tests) + 0.6 + header)
    # Constrained layout makes room for the labels, the title and the legend outside the axes.
    drawn = Figure(figsize=(11, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(drawn)
    axes = drawn.add_subplot()
    handles = _draw_bars(axes, drawn_tests, labels, capacity_gib)
    if top_axis:
        axes.tick_params(axis="x", top=True, labeltop=True)
    axes.set_xlabel(f"GiB ({capacity_note})", fontsize=9)
    # The legend just above the axes (and above the top axis's labels), the title above it.
    axes.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        bbox_transform=offset_copy(axes.transAxes, drawn, y=16 if top_axis else 2, units="points"),
        ncol=len(handles),
        frameon=False,
        fontsize=8,
        borderaxespad=0.0,
    )
    axes.set_title(title, fontsize=11, pad=38 if top_axis else 22)
    return drawn


def _draw_bars(
    axes: Axes, tests: list[TestResult], labels: list[str], capacity_gib: float | None
) -> list[Artist]:
    """The bars, the needs and the capacity; returns the legend's entries."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    positions = list(range(len(tests)))
    reserved = [result.peak_reserved / GIB for result in tests]
    axes.barh(positions, reserved, height=0.8, color=RESERVED_COLOUR)
    axes.barh(
        positions,
        [result.peak_allocated / GIB for result in tests],
        height=0.4,
        color=ALLOCATED_COLOUR,
    )
    # Legend entries stand in for what they name (a need or a capacity may not be drawn).
    handles: list[Artist] = [
        Patch(color=RESERVED_COLOUR, label="peak reserved"),
        Patch(color=ALLOCATED_COLOUR, label="peak allocated"),
    ]
    declared = [(p, need) for p, r in enumerate(tests) if (need := r.record.need_gib)]
    if declared:
        axes.vlines(
            [need for _, need in declared],
            [position - 0.45 for position, _ in declared],
            [position + 0.45 for position, _ in declared],
            colors=NEED_COLOUR,
            linewidth=3,
        )
        handles.append(Line2D([], [], color=NEED_COLOUR, linewidth=3, label="declared need"))
    largest = max([*reserved, *(need for _, need in declared), 1 / 1024])
    right = 1.1 * largest
    if capacity_gib is not None:
        label = f"capacity {capacity_gib:.1f} GiB"
        if capacity_gib <= CAPACITY_SCALE * largest:
            axes.axvline(capacity_gib, color=CAPACITY_COLOUR, linestyle="--", linewidth=1.5)
            right = max(right, 1.04 * capacity_gib)
        else:
            label += " (off the scale, right)"
        handles.append(
            Line2D([], [], color=CAPACITY_COLOUR, linestyle="--", linewidth=1.5, label=label)
        )
    axes.set_xlim(0, right)
    axes.set_ylim(-0.6, len(tests) - 0.4)
    axes.set_yticks(positions, labels, fontsize=8)
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    return handles


def _say_no_data(drawn: Figure, summary: RunSummary, capacity_note: str) -> None:
    details = [capacity_note]
    if skips := summary.by_test(lambda r: r.vram_skip):
        details.append(f"{len(skips)} test(s) skipped for VRAM")
    drawn.text(0.5, 0.86, TITLE, ha="center", va="top", fontsize=11)
    drawn.text(0.5, 0.55, NO_DATA, ha="center", va="center", fontsize=13, weight="bold")
    drawn.text(0.5, 0.3, "; ".join(details), ha="center", va="center", fontsize=9)


def png(drawn: Figure) -> bytes:
    """``drawn`` as PNG bytes, in memory."""
    buffer = io.BytesIO()
    drawn.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
