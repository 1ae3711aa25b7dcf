"""pytest-xdist on GPUs without a GPU: worker binding, the shared VRAM lease budget, placement.

pytester projects run with ``-n 2`` / ``-n 3`` and fake GPUs (``CT_FAKE_GPUS``); the ledger's
locks are real (the operating system's record locks), so waits, timeouts and the release by
a killed process are real too.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_ctresources.binding import (
    bind_worker,
    choose_gpu,
    choose_position,
    plan_line,
    sharing_count,
    worker_number,
)
from pytest_ctresources.gpus import detect_gpus
from pytest_ctresources.ledger import (
    LeaseTimeout,
    VramLedger,
    ledger_path,
    prune_old_runs,
    units_for,
)
from pytest_ctresources.placement import Placement, placement_lines

pytest_plugins = ["pytester"]

# --- binding: pure parts ---------------------------------------------------------------------


def test_worker_number() -> None:
    assert worker_number("gw0") == 0
    assert worker_number("gw12") == 12
    assert worker_number("master") is None


def test_round_robin_respects_the_users_visible_devices() -> None:
    facts = detect_gpus({"CT_FAKE_GPUS": "A=10;B=20;C=30", "CUDA_VISIBLE_DEVICES": "2,0"})
    picked = [choose_gpu(facts, n) for n in range(3)]
    assert [gpu.physical_index for gpu in picked if gpu] == [2, 0, 2]
    assert [sharing_count(3, 2, position) for position in (0, 1)] == [2, 1]


def test_bind_worker_narrows_visible_devices_to_a_uuid() -> None:
    env = {
        "CT_FAKE_GPUS": "A=10;B=20",
        "PYTEST_XDIST_WORKER": "gw3",
        "PYTEST_XDIST_WORKER_COUNT": "4",
    }
    binding = bind_worker(env, detect_gpus(env))
    assert binding is not None
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-fake-1"
    assert binding.sharing == 2
    assert binding.describe() == "gw3 -> GPU 1 (B), physical 1"
    assert detect_gpus(env).gpus[0].name == "B"  # the worker now sees its GPU only
    binding.undo(env)
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_no_binding_outside_workers_or_without_gpus() -> None:
    assert bind_worker({"CT_FAKE_GPUS": "A=10"}, detect_gpus({"CT_FAKE_GPUS": "A=10"})) is None
    no_gpu = {"CT_FAKE_GPUS": "", "PYTEST_XDIST_WORKER": "gw0"}
    assert bind_worker(no_gpu, detect_gpus(no_gpu)) is None
    assert "CUDA_VISIBLE_DEVICES" not in no_gpu


def test_plan_line() -> None:
    line = plan_line(detect_gpus({"CT_FAKE_GPUS": "A=10;B=20"}), 3)
    assert line is not None
    assert "3 worker(s) bound round robin to 2 GPU(s)" in line
    assert "gw0 -> GPU 0, gw1 -> GPU 1, gw2 -> GPU 0" in line


# --- ledger: real locks, a second process ------------------------------------------------------

HOLDER = """
import sys
from pathlib import Path
from pytest_ctresources.ledger import VramLedger
ledger = VramLedger(Path(sys.argv[1]), float(sys.argv[2])).open()
ledger.acquire(float(sys.argv[3]), timeout_s=5)
print("held", flush=True)
sys.stdin.read()  # hold until killed
"""


def hold_lease(path: Path, budget_gib: float, gib: float) -> subprocess.Popen[str]:
    """Another process holding ``gib`` of the budget (as another worker would)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(budget_gib), str(gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_units_round_up_to_64_mib() -> None:
    assert units_for(1.0) == 16
    assert units_for(0.01) == 1
    assert units_for(0) == 0


def test_a_lease_waits_times_out_and_is_released_by_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "gpu.ledger"
    holder = hold_lease(path, 10, 8)
    ledger = VramLedger(path, 10).open()
    try:
        small = ledger.acquire(2, timeout_s=1)  # 2 of the 2 GiB left: granted at once
        assert small.waited_s == 0
        ledger.release(small)
        start = time.monotonic()
        with pytest.raises(LeaseTimeout, match=r"lease of 8\.0 GiB.* 10\.0 GiB and 2\.0 GiB"):
            ledger.acquire(8, timeout_s=0.5)
        assert time.monotonic() - start >= 0.5
        holder.send_signal(signal.SIGKILL)  # no cleanup runs in the holder
        holder.wait()
        assert ledger.acquire(8, timeout_s=5).gib == 8  # granted: the dead holder's units are free
    finally:
        holder.kill()
        ledger.close()


def test_a_waiting_lease_frees_models_first_and_is_granted(tmp_path: Path) -> None:
    path = tmp_path / "gpu.ledger"
    holder = hold_lease(path, 10, 6)
    ledger = VramLedger(path, 10).open()
    freed: list[str] = []

    def give_back_soon() -> None:
        freed.append("models")
        holder.kill()

    try:
        lease = ledger.acquire(6, timeout_s=10, before_waiting=give_back_soon)
        assert freed == ["models"]
        assert lease.waited_s > 0
    finally:
        holder.kill()
        ledger.close()


def test_newcomers_queue_behind_a_waiting_lease(tmp_path: Path) -> None:
    # 8 of 10 GiB held; a second process waits for 8 (holding the turnstile). A newcomer
    # asking for 1 GiB must queue behind it, not take the 2 GiB that are free.
    path = tmp_path / "gpu.ledger"
    holder = hold_lease(path, 10, 8)
    waiter = subprocess.Popen(
        [sys.executable, "-c", HOLDER.replace("timeout_s=5", "timeout_s=30"), str(path), "10", "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ledger = VramLedger(path, 10).open()
    try:
        time.sleep(1.0)  # the waiter is queued on the turnstile by now
        with pytest.raises(LeaseTimeout):
            ledger.acquire(1, timeout_s=0.5)
        holder.kill()
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "held"
        assert ledger.acquire(1, timeout_s=5).gib == 1  # 2 GiB free again
    finally:
        holder.kill()
        waiter.kill()
        ledger.close()


def test_old_run_directories_are_pruned_only_when_unused() -> None:
    run = f"prune-test-{os.getpid()}"
    path = ledger_path(run, "GPU-x")
    holder = hold_lease(path, 10, 1)
    try:
        two_days_ago = time.time() - 2 * 86400
        os.utime(path.parent, (two_days_ago, two_days_ago))
        prune_old_runs()
        assert path.exists()  # a process of that run still has its ledger open
        holder.kill()
        holder.wait()
        prune_old_runs()
        assert not path.parent.exists()
    finally:
        holder.kill()


def test_a_lease_larger_than_the_budget_is_refused_at_once(tmp_path: Path) -> None:
    ledger = VramLedger(tmp_path / "gpu.ledger", 10).open()
    with pytest.raises(ValueError, match=r"exceeds the whole budget of 10\.0 GiB"):
        ledger.acquire(11, timeout_s=100)
    ledger.close()


def test_placement_lines() -> None:
    def placed(worker: str, gpu: int, wait: float) -> Placement:
        return Placement("t", "passed", worker, "H200", gpu, f"GPU-{gpu}", 18.0, wait)

    lines = placement_lines([placed("gw0", 0, 0), placed("gw2", 0, 2.5), placed("gw1", 1, -1)])
    assert lines[0] == "GPU placement (pytest-xdist): 3 test(s) on 2 GPU(s)"
    assert lines[1] == (
        "  GPU 0 (H200): gw0, gw2; 2 test(s), 2 with a lease, waited 2.5 s in all (longest 2.5 s)"
    )
    assert lines[2].endswith("1 lease timeout(s)")


# --- end to end: pytester with -n 2 / -n 3 -----------------------------------------------------

RECORDING_TEST = """
import json, os, time, pytest

def record(name):
    with open(f"run-{name}.json", "w") as handle:
        json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"],
                   "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "start": time.time()}, handle)
    time.sleep(SLEEP)
    with open(f"run-{name}.json") as handle:
        data = json.load(handle)
    data["end"] = time.time()
    with open(f"run-{name}.json", "w") as handle:
        json.dump(data, handle)

@pytest.mark.parametrize("i", range(COUNT))
@pytest.mark.vram(gib=NEED)
def test_x(i):
    record(i)
"""


def recording_suite(pytester: pytest.Pytester, count: int, need: float, sleep: float) -> None:
    pytester.makepyfile(
        RECORDING_TEST.replace("SLEEP", str(sleep))
        .replace("COUNT", str(count))
        .replace("NEED", str(need))
    )


def runs(pytester: pytest.Pytester) -> dict[str, dict[str, object]]:
    return {
        path.stem.removeprefix("run-"): json.loads(path.read_text())
        for path in pytester.path.glob("run-*.json")
    }


def test_each_worker_is_bound_to_a_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "A=10;B=10;C=10")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # the user's choice: spread over these
    recording_suite(pytester, count=6, need=1, sleep=0.2)
    result = pytester.runpytest_subprocess("-n", "3", "-v", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(
        ["ctresources: xdist: 3 worker(s) bound round robin to 2 GPU(s)*gw2 -> GPU 0*"]
    )
    expected = {"gw0": "GPU-fake-2", "gw1": "GPU-fake-0", "gw2": "GPU-fake-2"}
    for run in runs(pytester).values():
        assert run["visible"] == expected[str(run["worker"])]
    placements = json.loads((pytester.path / "r.json").read_text())["placements"]
    assert {(p["worker"], p["gpu_physical_index"]) for p in placements} <= {
        ("gw0", 2),
        ("gw1", 0),
        ("gw2", 2),
    }
    result.stdout.fnmatch_lines(["GPU placement (pytest-xdist): 6 test(s) on 2 GPU(s)"])


def test_binding_off_and_nested_runs_leave_visible_devices_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "A=10;B=10")
    recording_suite(pytester, count=2, need=1, sleep=0)
    pytester.makeini("[pytest]\nct_gpu_binding = off\n")
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=2)
    assert {run["visible"] for run in runs(pytester).values()} == {None}
    # A pytest started from inside a worker inherits PYTEST_XDIST_WORKER but is no worker.
    pytester.makeini("[pytest]\n")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    pytester.makepyfile(
        test_nested="import os\ndef test_sees_all():\n"
        "    assert 'CUDA_VISIBLE_DEVICES' not in os.environ"
    )
    pytester.runpytest_subprocess("test_nested.py").assert_outcomes(passed=1)


def test_leases_make_workers_wait_and_never_overlap_beyond_the_budget(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One 10 GiB GPU, two workers, tests needing 6 GiB: never two at once.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    recording_suite(pytester, count=4, need=6, sleep=0.4)
    result = pytester.runpytest_subprocess("-n", "2", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=4)
    spans = sorted((float(r["start"]), float(r["end"])) for r in runs(pytester).values())  # type: ignore[arg-type]
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert second_start >= first_end - 0.05, spans
    report = json.loads((pytester.path / "r.json").read_text())
    waits = [p["lease_wait_s"] for p in report["placements"]]
    assert len(waits) == 4 and max(waits) > 0.2, waits  # someone waited for a lease
    assert {p["lease_gib"] for p in report["placements"]} == {6.0}


def test_need_above_capacity_is_skipped_and_default_need_applies(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=12)
        def test_too_big(): pass

        def test_unmarked(): pass
        """
    )
    pytester.makeini("[pytest]\nct_default_vram_gib = 2.5\nct_lease_timeout = 5\n")
    result = pytester.runpytest_subprocess("-n", "2", "-rs", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs 12.0 GiB VRAM; GPU 0 (Card) has 10.0 GiB"])
    leases = {
        p["nodeid"].rsplit("::", 1)[1]: p["lease_gib"]
        for p in json.loads((pytester.path / "r.json").read_text())["placements"]
    }
    assert leases == {"test_too_big": 0.0, "test_unmarked": 2.5}


def test_lease_timeout_fails_the_test_and_a_killed_holder_frees_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process of the same run (same --testrunuid) holds 8 of the GPU's 10 GiB.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    holder = hold_lease(ledger_path("run-under-test", "GPU-fake-0"), 10, 8)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=8)
        def test_big(): pass

        @pytest.mark.skip(reason="not today")
        @pytest.mark.vram(gib=8)
        def test_skipped_takes_no_lease(): pass
        """
    )
    args = ("-n", "2", "--testrunuid", "run-under-test", "-o", "ct_lease_timeout=1")
    try:
        result = pytester.runpytest_subprocess(*args)
        result.assert_outcomes(errors=1, skipped=1)
        result.stdout.fnmatch_lines(
            [
                "*gw* -> GPU 0 (Card), physical 0: waited 1 s for a VRAM lease of 8.0 GiB; "
                "the GPU's budget is 10.0 GiB and 2.0 GiB of it is free (ct_lease_timeout)"
            ]
        )
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        pytester.runpytest_subprocess(*args).assert_outcomes(passed=1, skipped=1)
        # --ct-no-leases: nothing waits, whatever the budget.
        holder = hold_lease(ledger_path("run-under-test", "GPU-fake-0"), 10, 8)
        pytester.runpytest_subprocess(*args, "--ct-no-leases").assert_outcomes(passed=1, skipped=1)
    finally:
        holder.kill()


def test_a_worker_killed_mid_test_gives_its_lease_back(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(
        """
        import os, time, pytest

        @pytest.mark.vram(gib=8)
        def test_a_dies():
            time.sleep(0.3)
            os._exit(1)

        @pytest.mark.vram(gib=8)
        @pytest.mark.parametrize("i", range(3))
        def test_b_after(i):
            time.sleep(0.1)
        """
    )
    result = pytester.runpytest_subprocess(
        "-n", "2", "-p", "no:randomly", "-o", "ct_lease_timeout=20", "--ct-report-json", "r.json"
    )
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running*test_a_dies*"])
    placements = json.loads((pytester.path / "r.json").read_text())["placements"]
    assert sorted(p["nodeid"].rsplit("::", 1)[1] for p in placements) == [
        "test_b_after[0]",
        "test_b_after[1]",
        "test_b_after[2]",
    ]  # the crashed test's reports come from the controller, not from a worker


def test_choose_position_round_robin_then_fewest_workers() -> None:
    # The usual start: round robin, whatever order the workers arrive in.
    assert [choose_position(n, 3, [0, 0]) for n in range(3)] == [0, 1, 0]
    assert choose_position(0, 3, [1, 0]) == 0  # gw2 sat first on GPU 0; gw0 still fits
    # gw1 crashed on GPU 1 of two; its replacement gw2 would double up on GPU 0.
    assert choose_position(2, 2, [1, 0]) == 1


def test_a_replacement_worker_takes_the_crashed_workers_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "A=10;B=10")
    pytester.makepyfile(
        """
        import os, time, pytest

        def test_a_dies():
            if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
                os._exit(1)
            time.sleep(3)

        @pytest.mark.parametrize("i", range(6))
        def test_b_after(i):
            with open(f"after-{i}-{os.environ['PYTEST_XDIST_WORKER']}.txt", "w") as handle:
                handle.write(os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["CUDA_VISIBLE_DEVICES"])
            time.sleep(0.3)
        """
    )
    # --dist each: every worker runs every test, so gw1 dies and xdist starts gw2.
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly", "--dist", "each")
    result.stdout.fnmatch_lines(["*worker 'gw1' crashed*"])
    seen = {path.read_text() for path in pytester.path.glob("after-*.txt")}
    # gw2 sits on GPU 1, where gw1 sat, not beside gw0 on GPU 0 (round robin's choice).
    assert seen == {"gw0 GPU-fake-0", "gw2 GPU-fake-1"}, seen
