"""What earlier runs tell: the VRAM regression gate (``--ct-fail-on-increase``) and the GPU
tests' last real runs (``--ct-require-gpu-run-within``), on the stand-in for CUDA."""

from __future__ import annotations

import datetime
import json

import pytest

from pytest_ctresources.core import learned, regression
from pytest_ctresources.report import coverage
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

GROWING = """
import os
import pytest

from conftest import FAKE


@pytest.mark.vram(gib=8)
def test_grows():
    gib = float(os.environ["GROW_GIB"])
    FAKE.alloc(gib)
    FAKE.free(gib)


@pytest.mark.vram(gib=8)
def test_steady():
    FAKE.alloc(1.0)
    FAKE.free(1.0)
"""

OLD = {"torch": "2.4.0", "transformers": "4.57.3", "nnsight": "0.6.1"}
NEW = {"torch": "2.5.1", "transformers": "4.57.3"}


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "Fake GPU=24")
    monkeypatch.setenv("COLUMNS", "300")  # the summary's lines unfolded
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    return pytester


def test_a_peak_that_grows_fails_under_the_gate_and_warns_without_it(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_suite=GROWING)
    today = datetime.date.today().isoformat()
    monkeypatch.setattr(learned, "library_versions", lambda: dict(OLD))
    monkeypatch.setenv("GROW_GIB", "1.0")
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=2)
    # 50% more, under ct_fail_on_increase = 60: no failure, no warning; the new peak is learned.
    monkeypatch.setenv("GROW_GIB", "1.5")
    result = project.runpytest("-p", "no:randomly", "-o", "ct_fail_on_increase=60")
    result.assert_outcomes(passed=2)
    assert "VRAM peak increased" not in result.stdout.str()
    # A third more, with new library versions: the gate's default 10% fails it.
    monkeypatch.setattr(learned, "library_versions", lambda: dict(NEW))
    monkeypatch.setenv("GROW_GIB", "2.0")
    line = (
        f"test_suite.py::test_grows: peak 2.00 GiB reserved on {today}, up 33% from 1.50 GiB on "
        f"{today} (Fake GPU); changed since: torch 2.4.0 -> 2.5.1, nnsight 0.6.1 -> none"
    )
    result = project.runpytest("-p", "no:randomly", "--ct-fail-on-increase")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"ctresources --ct-fail-on-increase: {line}"])
    assert "transformers" not in result.stdout.str()
    # A failed run learns nothing: the same growth without the option passes, with a warning.
    result = project.runpytest("-p", "no:randomly", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "VRAM peak increased: 1 test(s), over the last passing peak on the same GPU and config",
            f"  {line}",
        ]
    )
    (found,) = json.loads((project.path / "r.json").read_text())["peak_increases"]
    assert found["before_gib"] == 1.5 and found["peak_gib"] == 2.0 and found["percent"] == 33.3
    assert found["changed_versions"] == ["torch 2.4.0 -> 2.5.1", "nnsight 0.6.1 -> none"]
    # That pass learned 2.0 GiB: the next run says nothing.
    result = project.runpytest("-p", "no:randomly", "--ct-fail-on-increase=0")
    result.assert_outcomes(passed=2)


def test_a_peak_learned_on_another_gpu_is_not_compared(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_suite=GROWING)
    monkeypatch.setenv("GROW_GIB", "1.0")
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=2)
    monkeypatch.setenv("CT_FAKE_GPUS", "Other GPU=24")
    monkeypatch.setenv("GROW_GIB", "3.0")
    project.runpytest("-p", "no:randomly", "--ct-fail-on-increase").assert_outcomes(passed=2)


def test_workers_compare_with_the_peaks_the_controller_ships(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_suite=GROWING)
    monkeypatch.setenv("GROW_GIB", "1.0")
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=2)
    monkeypatch.setenv("GROW_GIB", "1.5")
    # One worker: what the controller ships is the subject, not how tests spread.
    result = project.runpytest("-n", "1", "--ct-fail-on-increase=20")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*ctresources --ct-fail-on-increase: test_suite.py::test_grows: peak 1.50 GiB *, up 50%*"]
    )


COVERED = """
import pytest

from conftest import FAKE


@pytest.mark.vram(gib=2)
def test_on_gpu():
    FAKE.alloc(1.0)
    FAKE.free(1.0)


@pytest.mark.vram(gib=4)
def test_too_big():
    pass


def test_cpu():
    pass
"""


def test_skipped_gpu_tests_say_when_and_where_they_last_ran(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_cov=COVERED)
    monkeypatch.setenv("CT_FAKE_GPUS", "Fake GPU=3")
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=2, skipped=1)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    monkeypatch.delenv("CT_FAKE_GPUS")
    result = project.runpytest("-p", "no:randomly", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "skipped for VRAM: 2 test(s)",
            "  test_cov.py::test_on_gpu: needs 2.0 GiB VRAM; no CUDA GPU detected",
            "  test_cov.py::test_too_big: needs 4.0 GiB VRAM; no CUDA GPU detected",
            "GPU tests skipped here: 2 test(s); when each last really ran on a GPU:",
            f"  test_cov.py::test_on_gpu: {today} ??:?? UTC on Fake GPU",
            "  test_cov.py::test_too_big: never",
        ]
    )
    coverage = json.loads((project.path / "r.json").read_text())["gpu_coverage"]
    assert coverage["require_within_days"] is None and coverage["stale"] == []
    on_gpu, too_big = coverage["skipped"]
    assert on_gpu["nodeid"] == "test_cov.py::test_on_gpu" and on_gpu["last_gpu"] == "Fake GPU"
    assert on_gpu["last_ran"].startswith(today)
    assert too_big["last_gpu"] is None and too_big["last_ran"] is None

    result = project.runpytest("-p", "no:randomly", "--ct-require-gpu-run-within", "0")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "--ct-require-gpu-run-within 0: 2 GPU test(s) have not really run within 0 day(s): "
            "test_cov.py::test_too_big (never), test_cov.py::test_on_gpu "
            f"({today} ??:?? UTC on Fake GPU)"
        ]
    )
    # Within a day, the test that ran earlier is fresh; one that never ran never is.
    result = project.runpytest("-p", "no:randomly", "-o", "ct_require_gpu_run_within=1")
    result.stdout.fnmatch_lines(["*: 1 GPU test(s) * test_cov.py::test_too_big (never)"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result = project.runpytest(
        "-p", "no:randomly", "-k", "on_gpu", "-o", "ct_require_gpu_run_within=1"
    )
    assert result.ret == 0


# --- the pure parts ------------------------------------------------------------------------


def test_an_increase_is_more_than_the_percentage_on_the_same_gpu() -> None:
    before = learned.LearnedNeed(1.0, "H200", "2026-11-01", {"torch": "2.4.0"})
    now = {"torch": "2.4.0"}
    assert regression.increase("t", before, 1.1, "H200", "2026-12-01", now, 10) is None
    assert regression.increase("t", before, 2.0, "A100", "2026-12-01", now, 10) is None
    assert regression.increase("t", None, 2.0, "H200", "2026-12-01", now, 10) is None
    found = regression.increase("t", before, 1.25, "H200", "2026-12-01", now, 10)
    assert found is not None and found == regression.Increase.from_dict(found.to_dict())
    assert found.line() == (
        "t: peak 1.25 GiB reserved on 2026-12-01, up 25% from 1.00 GiB on 2026-11-01 (H200); "
        "no library version changed"
    )


def test_an_entry_of_an_earlier_version_is_compared_on_its_peak_alone() -> None:
    # What the plugin wrote before it recorded versions: a peak, a GPU, a date.
    key = learned.memory_key("t.py::t", None)
    needs = learned.LearnedNeeds(None, {key: {"gib": 1.0, "gpu": "H200", "date": "2026-11-01"}})
    before = needs.get(key)
    assert before is not None and before.versions is None
    found = regression.increase(
        "t.py::t", before, 2.0, "H200", "2026-12-01", {"torch": "2.5.1"}, 10
    )
    assert found is not None and found.line().endswith("; library versions not recorded then")
    # Once it passes again, its entry has the versions.
    needs.update({key: learned.LearnedNeed(2.0, "H200", "2026-12-01", {"torch": "2.5.1"})})
    assert needs.to_mapping()[key]["versions"] == {"torch": "2.5.1"}


def test_the_stalest_gpu_tests_come_first_and_bad_cache_entries_are_dropped() -> None:
    now = datetime.datetime(2026, 12, 2, 12, tzinfo=datetime.timezone.utc)
    day = datetime.timedelta(days=1)

    def at(days: float) -> coverage.LastRun:
        return coverage.LastRun("H200", now - days * day)

    skipped = (
        coverage.SkippedGpuTest("t::fresh", "no GPU", at(0.5)),
        coverage.SkippedGpuTest("t::old", "no GPU", at(9)),
        coverage.SkippedGpuTest("t::older", "no GPU", at(20)),
        coverage.SkippedGpuTest("t::never", "no GPU", None),
    )
    report = coverage.GpuCoverage(skipped, 1, now)
    assert [t.nodeid for t in report.stale()] == ["t::never", "t::older", "t::old"]
    line = report.failure_line()
    assert line is not None and line.startswith("--ct-require-gpu-run-within 1: 3 GPU test(s) ")
    assert coverage.GpuCoverage(skipped, None, now).failure_line() is None
    assert coverage.GpuCoverage(skipped, 30, now).stale() == [skipped[3]]
    good = {"gpu": "H200", "at": "2026-12-01T00:00:00+00:00"}
    assert coverage.last_run("t", good) == coverage.LastRun(
        "H200", datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
    )
    for bad in ({"gpu": "H200", "at": "2026-12-01T00:00:00"}, {"gpu": 3, "at": good["at"]}, []):
        assert coverage.last_run("t", bad) is None
