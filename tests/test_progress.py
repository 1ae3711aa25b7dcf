"""Progress of long attributions: phases and batches counted, a live line on a terminal
(tested through a pseudo-terminal), the slowest attributions in the summary and the report."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ctresources.session.progress import AttributionProbe, AttributionTiming
from pytest_ctresources.session.progress_line import terminal_width
from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]


class _Context:
    def __init__(self) -> None:
        self.activation_matrix = SimpleNamespace(_nnz=lambda: 100)

    def compute_batch(self, **kwargs: Any) -> str:
        return "rows"


class _Model:
    def setup_attribution(self, input_ids: Any) -> _Context:
        return _Context()

    def run_forward_pass(self, input_ids: Any, batch_size: int, ctx: Any) -> None:
        pass


class _Listener:
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def update(self, timing: AttributionTiming) -> None:
        self.seen.append(timing.phase)

    def done(self) -> None:
        self.seen.append("done")


def _attribute(model: _Model) -> None:
    """What circuit-tracer's attribute() does with the model, in order."""
    ctx = model.setup_attribution("ids")
    model.run_forward_pass("ids", 32, ctx)
    for _ in range(1 + 4):  # the logits' batch, then the features' (100 rows, 32 a batch)
        ctx.compute_batch(layers=None)


def test_the_probe_counts_phases_and_batches_and_puts_the_model_back() -> None:
    model = _Model()
    seen: list[str] = []
    probe = AttributionProbe(32, max_feature_nodes=None, max_n_logits=10, listener=_Listener(seen))
    with probe.watching(model) as timing:
        _attribute(model)
    assert "setup_attribution" not in vars(model) and "run_forward_pass" not in vars(model)
    assert (timing.batches_done, timing.batches_total) == (5, 1 + 4)
    assert seen[0] == "setup" and "forward" in seen and seen[-2:] == ["backward", "done"]
    assert timing.total_s >= timing.setup_s + timing.forward_s
    assert set(timing.to_dict()) >= {"batch_size", "setup_s", "forward_s", "backward_s", "total_s"}


def test_the_probe_keeps_a_callers_own_patch() -> None:
    model = _Model()
    mine = lambda input_ids: _Context()  # noqa: E731
    model.setup_attribution = mine  # type: ignore[method-assign]
    with AttributionProbe(8, 16, 10).watching(model):
        _attribute(model)
    assert vars(model)["setup_attribution"] is mine


def test_a_timing_describes_where_it_is() -> None:
    timing = AttributionTiming(64, phase="backward", setup_s=0.4, forward_s=2.1)
    timing.batches_done, timing.batches_total = 7, 17
    assert timing.describe().startswith("backward 7/17 batches of 64, ")
    assert timing.describe().endswith("(setup 0.4, forward 2.1)")


ATTRIBUTIONS = """
def test_attribution(ct_session):
    ct_session.attribute("the capital of france is")
"""


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["-v"], True),
        ([], True),
        (["-q"], False),
        (["-s"], False),
        (["-o", "log_cli=true"], False),
        (["-p", "xdist", "-n", "1"], True),  # the controller: its workers never show one
    ],
    ids=["-v", "default", "-q", "-s", "log_cli", "xdist-controller"],
)
def test_the_live_line_shows_only_on_a_terminal_at_default_verbosity_or_more(
    pytester: pytest.Pytester, args: list[str], shown: bool
) -> None:
    """On a terminal (``tests/test_progress_terminal.py`` runs one), not under ``-q``, ``-s``
    or live logging; the terminal is what pytest's reporter found its output to be."""
    from pytest_ctresources.session.progress_line import enabled

    config = pytester.parseconfigure(*args)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reporter.isatty = True
    assert enabled(config) is shown
    reporter.isatty = False
    assert not enabled(config)


def test_no_live_line_where_the_output_is_not_a_terminal(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makeini("[pytest]\nct_progress_after = 0\n")
    pytester.makepyfile(test_live=ATTRIBUTIONS)
    # In-process: its output is captured, not a terminal, and the attribution reuses the
    # stack this process has imported.
    piped = pytester.runpytest("--ct-config", "exp.yaml", "-v")
    piped.assert_outcomes(passed=1)
    assert "ctresources: setup pass" not in piped.stdout.str()


def test_the_slowest_attributions_are_in_the_summary_and_the_report(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(
        test_slow=ATTRIBUTIONS + ATTRIBUTIONS.replace("test_attribution", "test_two")
    )
    # The controller in-process: it attributes nothing (its one worker, a process of its own,
    # does) and reads the timings the worker ships.
    result = pytester.runpytest(
        "--ct-config", "exp.yaml", "-n", "1", "-v", "--ct-report-json", "report.json"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "slowest attributions (top 2 of 2):",
            "  * s  test_slow.py::test_*: batch size 128, */* backward batches; setup * s, forward * s, backward * s",
        ]
    )
    timings = json.loads((pytester.path / "report.json").read_text())["attribution_timings"]
    assert set(timings) == {"test_slow.py::test_attribution", "test_slow.py::test_two"}
    (one,) = timings["test_slow.py::test_two"]
    assert one["batch_size"] == 128 and one["batches_done"] >= 1


@pytest.mark.parametrize(
    ("columns", "width"),
    [("120", 120), ("\u0661\u0662\u0660", 120), ("\u00b2", 80), ("", 80), ("30", 80), ("x", 80)],
)
def test_the_terminal_width_is_read_as_pytest_reads_it(
    monkeypatch: pytest.MonkeyPatch, columns: str, width: int
) -> None:
    """COLUMNS as ``shutil.get_terminal_size`` reads it (``int()``, else the terminal's, else
    80; pytest's floor of 40): ``'²'`` passes ``str.isdigit()`` and failed the test from the
    plugin's own ``int()``."""
    monkeypatch.setenv("COLUMNS", columns)
    read, write = os.pipe()  # not a terminal: no size of its own
    try:
        assert terminal_width(write) == width
    finally:
        os.close(read)
        os.close(write)
