"""The summary's levels: quiet by default (what went wrong or needs action, one line of
totals), ``-v`` the VRAM table and details, ``-vv`` every auto choice, ``-q`` counts only;
every list capped at ``--ct-report-top``; a failing run says its settings."""

from __future__ import annotations

import re

import pytest

from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

SUITE = """
import pytest

from conftest import FAKE

KEPT = []


@pytest.mark.parametrize("n", range(6))
@pytest.mark.vram(gib=0.5)
def test_under_declared(n):
    FAKE.alloc(1.0)
    FAKE.free(1.0)


@pytest.mark.parametrize("n", range(3))
def test_leaks(n):
    FAKE.alloc(0.5)
    KEPT.append(n)


def test_small():
    FAKE.alloc(0.01)
    FAKE.free(0.01)
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "Fake GPU=24")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def section(result: pytest.RunResult) -> list[str]:
    lines = result.stdout.lines
    try:
        start = next(i for i, line in enumerate(lines) if "ctresources summary" in line)
    except StopIteration:
        return []
    # The section ends at pytest's next one, or at -q's closing line of outcomes.
    closing = re.compile(r"^(=|\d+ (passed|failed))")
    end = next((i for i in range(start + 1, len(lines)) if closing.match(lines[i])), len(lines))
    return lines[start + 1 : end]


def test_default_is_actions_and_one_line_of_totals(project: pytest.Pytester) -> None:
    result = project.runpytest("-o", "ct_leak_threshold=100MiB", "--ct-report-top", "4")
    lines = section(result)
    text = "\n".join(lines)
    assert "batch_size=" not in text  # no settings block: every test passed
    assert "peak alloc" not in text  # the table is -v's
    kinds = ("UNDER-DECLARED", "UNMARKED", "LEAK")
    flags = [line for line in lines if line.startswith(kinds)]
    assert len(flags) == 4, lines  # capped at --ct-report-top
    assert any(line.startswith("  ... and ") for line in lines), lines
    assert any(line.startswith("10 test(s) used CUDA, highest peak ") for line in lines), lines
    assert len(lines) == 6, lines


def test_verbose_adds_the_table_and_quiet_gives_counts(project: pytest.Pytester) -> None:
    verbose = section(project.runpytest("-v", "-o", "ct_leak_threshold=100MiB"))
    assert any("peak alloc" in line for line in verbose)
    quiet = section(project.runpytest("-q", "-o", "ct_leak_threshold=100MiB"))
    assert len(quiet) == 1 and quiet[0].startswith("flagged: "), quiet
    assert "UNDER-DECLARED" in quiet[0] and "LEAK" in quiet[0]


def test_a_failing_run_says_its_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_fails(ct_config):
            assert ct_config.batch_size == 1
        """
    )
    lines = section(pytester.runpytest("--ct-batch-size", "8"))
    assert any("batch_size=8 (--ct-batch-size)" in line for line in lines), lines
    passing = pytester.makepyfile(
        """
        def test_fails(ct_config):
            assert ct_config.batch_size == 8
        """
    )
    assert passing.exists()
    assert section(pytester.runpytest("--ct-batch-size", "8")) == []


def test_a_wrong_attribute_keyword_shows_the_test_not_the_session(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        def test_typo(ct_session):
            ct_session.attribute("a prompt", batchsize=4)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "unexpected keyword argument(s) batchsize" in out
    assert "pytest_ctresources/session/session.py" not in out  # its method, docstring and all


def test_quiet_counts_each_flag_by_its_whole_kind() -> None:
    """Kinds of two words are counted by both (``-q``): ``1 ESTIMATE LOW``, not ``1 ESTIMATE``."""
    from pytest_ctresources.report.run_summary import RunSummary

    flags = [
        ("ESTIMATE LOW", "ESTIMATE LOW t.py::a: peak 3.00 GiB reserved > 2.0 GiB"),
        ("OOM RECOVERED", "OOM RECOVERED t.py::b: OOM at batch 256, passed at 64"),
        ("OOM RECOVERED", "OOM RECOVERED t.py::c: OOM at batch 64, passed at 32"),
    ]
    quiet = RunSummary().action_lines(flags, top=10, quiet=True)
    assert quiet == ["flagged: 1 ESTIMATE LOW, 2 OOM RECOVERED"]
    assert RunSummary().action_lines(flags, top=10, quiet=False) == [line for _, line in flags]
