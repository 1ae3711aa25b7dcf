"""The plan before a run (pytest --ct-plan, ct-resources plan) and CI shards (--ct-shard)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import bench_module

from pytest_ctresources.estimator.cli import main
from pytest_ctresources.xdist.placement import (
    Demand,
    Dispatcher,
    Gpu,
    PlacementPolicy,
    fits_of,
    simulate,
)
from pytest_ctresources.xdist.plan import PlanGpu, make_plan, parse_gpus

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
import pytest

@pytest.mark.parametrize("gib", [
    pytest.param(gib, marks=pytest.mark.vram(gib=gib), id=f"{gib}GiB")
    for gib in (10, 20, 30, 60, 90)
])
def test_size(gib):
    pass

def test_no_need():
    pass
"""


def test_gpu_lists_and_names() -> None:
    assert parse_gpus("2x80, RTX-4090") == [
        PlanGpu("80 GiB", 80.0),
        PlanGpu("80 GiB", 80.0),
        PlanGpu("RTX-4090", 23.6),
    ]
    assert parse_gpus("h200")[0].capacity_gib == 139.8
    with pytest.raises(ValueError, match="names known: H200"):
        parse_gpus("2xV100")


def test_a_plan_of_1000_tests_places_each_on_a_gpu_that_holds_it() -> None:
    # How long the plan takes is bench/plan_timing.py's figure, not a test's assertion.
    demands = [
        Demand(f"t{i}", (None, 5.0, 20.0, 30.0, 70.0, 90.0)[i % 6], float(1 + i % 17))
        for i in range(1000)
    ]
    plan = make_plan(parse_gpus("2x80,4x24"), 2, demands)
    assert len(plan.lines()) == 1000 + 9
    skipped = [t for t in plan.tests if t.skip_reason]
    assert len(skipped) == 1000 // 6  # the 90 GiB ones
    assert all(
        t.gpu in ("GPU 0 (80 GiB)", "GPU 1 (80 GiB)")
        for t in plan.tests
        if (t.need_gib or 0) > 24 and t.skip_reason is None
    )
    assert plan.predicted_wall_s >= plan.fitted_lower_bound_s


def test_the_predicted_wall_time_is_the_scheduler_simulations() -> None:
    # An 80 and a 24 GiB card, one worker each: the 60 and 30 GiB tests can only run one
    # after the other on the 80 GiB card (15 s) while the 24 GiB card runs the 10 GiB ones
    # (8 s). Dividing the work by the workers would say 11.5 s.
    demands = [
        Demand("small-a", 10.0, 4.0),
        Demand("big", 60.0, 10.0),
        Demand("small-b", 10.0, 4.0),
        Demand("middle", 30.0, 5.0),
    ]
    plan = make_plan(parse_gpus("80,24"), 1, demands)
    gpus = [Gpu("gpu0", "GPU 0 (80 GiB)", 80.0), Gpu("gpu1", "GPU 1 (24 GiB)", 24.0)]
    fits = fits_of(gpus, demands)
    simulated = simulate(gpus, fits, PlacementPolicy(Dispatcher(gpus, fits)))
    assert plan.predicted_wall_s == simulated.wall_s == 15.0
    assert {t.nodeid: t.gpu for t in plan.tests} == {
        "small-a": "GPU 1 (24 GiB)",
        "big": "GPU 0 (80 GiB)",
        "small-b": "GPU 1 (24 GiB)",
        "middle": "GPU 0 (80 GiB)",
    }


def test_ct_plan_collects_only_and_prints_where_each_test_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--ct-plan", "24,80", "--ct-plan-workers", "2", "-p", "no:randomly")
    assert result.ret == 0
    result.assert_outcomes()  # nothing ran
    out = result.stdout.str()
    assert "ctresources plan: 6 test(s) on 2 GPU(s), 2 worker(s) each; predicted wall time" in out
    result.stdout.fnmatch_lines(
        [
            "*test_size?30GiB?: GPU 1 (80 GiB) ?gw*; 30.0 GiB, 1.00 s",
            "*test_size?60GiB?: GPU 1 (80 GiB) ?gw*; 60.0 GiB, 1.00 s",
            "*test_size?90GiB?: skips: needs 90.0 GiB VRAM; the largest GPU in this run, "
            "GPU 1 (80 GiB), has 80.0 GiB; 90.0 GiB, 0.00 s",
        ]
    )


def test_a_plan_on_a_detected_gpu_of_a_sliver_of_a_gib(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detected GPUs are rounded as the plan shows them, never to nothing: a capacity of
    1e-4 GiB (a valid --ct-vram-capacity) was a ZeroDivisionError, an INTERNALERROR."""
    monkeypatch.setenv("CT_FAKE_GPUS", "H200=80")
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--ct-plan", "--ct-vram-capacity", "1e-4", "-p", "no:randomly")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["ctresources plan: 6 test(s) on 1 GPU(s)*"])


def test_ct_resources_plan_prints_json(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(SUITE)
    assert (
        main(["plan", "--gpus", "24,80", "--json", "--", str(pytester.path), "-p", "no:randomly"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    by_id = {t["nodeid"].split("[")[-1].rstrip("]"): t for t in plan["tests"]}
    assert by_id["30GiB"]["gpu"] == "GPU 1 (80 GiB)"
    assert by_id["10GiB"]["skip_reason"] is None
    assert "largest GPU in this run" in by_id["90GiB"]["skip_reason"]
    assert [g["capacity_gib"] for g in plan["gpus"]] == [24.0, 80.0]


def test_shards_run_every_test_once_on_the_smallest_class_that_fits(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(SUITE)
    seen: dict[int, list[str]] = {}
    for job in (1, 2, 3):
        result = pytester.runpytest(
            "--ct-shard",
            f"{job}/3",
            "--ct-runner-gpus",
            "2x24,80",
            "--co",
            "-q",
            "-p",
            "no:randomly",
        )
        seen[job] = [line for line in result.stdout.lines if "::" in line]
    everything = sorted(line for lines in seen.values() for line in lines)
    assert len(everything) == 6 and len(set(everything)) == 6
    big = " ".join(seen[3])
    assert "30GiB" in big and "60GiB" in big and "90GiB" in big
    assert not any("30GiB" in line or "60GiB" in line for line in seen[1] + seen[2])


def test_bad_shard_options_are_one_line_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--ct-shard", "4/3")
    result.stderr.fnmatch_lines(["*argument --ct-shard: '4/3': expected K/N with 1 <= K <= N"])
    result = pytester.runpytest("--ct-shard", "1/3", "--ct-runner-gpus", "24,80")
    result.stderr.fnmatch_lines(
        ["*--ct-runner-gpus names 2 job(s) but --ct-shard has 3: give one GPU for all jobs*"]
    )


def test_the_bench_compares_the_plan_with_a_run_of_the_same_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench/plan_vs_run.py end to end on 12 tests of its suite, two 24 GiB cards: the plan's
    # prediction and an xdist run on fake GPUs, each test counted once with its outcome (the
    # five over 24 GiB skip, as planned). Its ratio is the H200 host's figure, not checked here.
    pytest.importorskip("xdist")
    plan_vs_run = bench_module("plan_vs_run")
    args = ["--tests", "12", "--scale", "0.002", "--gpus", "2x24", "--workers-per-gpu", "1"]
    plan_vs_run.main([*args, "--out", str(tmp_path / "suite")])
    out = capsys.readouterr().out
    assert "tests: 7 passed, 5 skipped, 0 other; planned to skip: 5" in out
    assert "pytest exit status 0" in out
    phase = json.loads((tmp_path / "suite" / "phase.json").read_text())
    assert len(phase["outcomes"]) == 12 and phase["start"] < phase["stop"]
    plan = json.loads((tmp_path / "suite" / "plan.json").read_text())
    assert plan["predicted_wall_s"] > 0 and all(t["duration_learned"] for t in plan["tests"])


def test_durations_are_the_last_attempts_phases_of_tests_whose_call_ran() -> None:
    # What the plan, shards and the scheduler learn: setup + call + teardown of a test's last
    # attempt (a rerun starts afresh); none for a test skipped in any phase (xfail included)
    # or whose setup failed.
    from pytest_ctresources.report.run_summary import RunSummary

    summary = RunSummary()

    def phases(nodeid: str, *outcomes: str, seconds: float = 1.0) -> None:
        for when, outcome in zip(("setup", "call", "teardown"), outcomes, strict=False):
            summary.record(
                pytest.TestReport(nodeid, ("f.py", 0, nodeid), {}, outcome, None, when, [], seconds)
            )

    phases("f.py::passed", "passed", "passed", "passed", seconds=0.5)
    phases("f.py::failed", "passed", "failed", "passed")
    phases("f.py::skipped_in_call", "passed", "skipped", "passed")
    phases("f.py::skipped_at_setup", "skipped", seconds=0.0)
    phases("f.py::teardown_only", "failed")
    summary.record(
        pytest.TestReport("f.py::teardown_only", ("f.py", 0, ""), {}, "passed", None, "teardown")
    )
    phases("f.py::rerun", "passed", "rerun", "passed", seconds=7.0)
    phases("f.py::rerun", "passed", "passed", "passed", seconds=2.0)
    assert summary.durations() == {"f.py::passed": 1.5, "f.py::failed": 3.0, "f.py::rerun": 6.0}
