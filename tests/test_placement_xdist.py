"""VRAM placement under pytest-xdist, end to end with fake GPUs (CT_FAKE_GPUS): a test goes
to a worker whose GPU holds it, and skips only where no GPU of the run does."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("xdist")

SIZES_TEST = """
import json, os, time, pytest

@pytest.mark.parametrize("gib", [
    pytest.param(gib, marks=pytest.mark.vram(gib=gib), id=f"{gib}GiB")
    for gib in (10, 20, 30, 60, 90)
])
def test_size(gib):
    with open(f"ran-{gib}.json", "w") as handle:
        json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"],
                   "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, handle)
    time.sleep(0.05)

def test_no_need():
    pass
"""

#: Fake GPU UUIDs by capacity (CT_FAKE_GPUS "Small=24;Big=80").
CARD = {"GPU-fake-0": 24, "GPU-fake-1": 80}


def placed(pytester: pytest.Pytester) -> dict[int, dict[str, Any]]:
    return {
        int(path.stem.removeprefix("ran-")): json.loads(path.read_text())
        for path in pytester.path.glob("ran-*.json")
    }


def check_sizes(pytester: pytest.Pytester, result: pytest.RunResult) -> None:
    result.assert_outcomes(passed=5, skipped=1)
    ran = placed(pytester)
    assert sorted(ran) == [10, 20, 30, 60]
    for gib, where in ran.items():
        assert gib <= CARD[where["visible"]], (gib, where)  # nothing ran where it did not fit
    assert CARD[ran[30]["visible"]] == 80 and CARD[ran[60]["visible"]] == 80
    result.stdout.fnmatch_lines(
        ["*SKIPPED*needs 90.0 GiB VRAM; GPU 0 (Big) has 80.0 GiB, the largest GPU in this run"]
    )
    report = json.loads((pytester.path / "r.json").read_text())
    why = {
        p["nodeid"].split("[")[-1].rstrip("]"): p["placed_because"] for p in report["placements"]
    }
    assert why["30GiB"].startswith("needs 30.0 GiB: only GPU 1 (Big) hold(s) it")
    assert why["10GiB"].startswith("fits every GPU")
    assert why["90GiB"] == "too big for every GPU: sent to the largest, which skips it"
    result.stdout.fnmatch_lines(
        [
            "  placed by VRAM: 2 test(s) on the only GPUs that hold them, 3 that fit every GPU, "
            "1 too big for every GPU (skipped on the largest); * packed beside other workers' tests"
        ]
    )


def test_tests_go_to_a_gpu_that_holds_them_and_skip_only_where_none_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # -n 4 over a 24 and an 80 GiB card: two workers each (round-robin binding).
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    result = pytester.runpytest_subprocess("-n", "4", "-rs", "--ct-report-json", "r.json")
    check_sizes(pytester, result)


def test_workers_with_their_own_environment_report_their_own_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each --tx group sees one card (CUDA_VISIBLE_DEVICES in its own environment).
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    result = pytester.runpytest_subprocess(
        "--tx",
        "2*popen//env:CUDA_VISIBLE_DEVICES=0",
        "--tx",
        "2*popen//env:CUDA_VISIBLE_DEVICES=1",
        "--dist",
        "load",
        "-rs",
        "--ct-report-json",
        "r.json",
    )
    check_sizes(pytester, result)


def test_other_dist_modes_keep_xdists_own_scheduler(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    result = pytester.runpytest_subprocess(
        "-n", "4", "--dist", "loadfile", "-rs", "--ct-report-json", "r.json"
    )
    assert "the largest GPU in this run" not in result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    assert all(p["placed_because"] is None for p in report["placements"])
