"""pytest-xdist on GPUs without a GPU: worker binding, the shared VRAM lease budget, placement.

pytester projects run with ``-n 2`` / ``-n 3`` and fake GPUs (``CT_FAKE_GPUS``); the ledger's
locks are real (the operating system's record locks), so waits, timeouts and the release by
a killed process are real too.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_ctresources.core import record as record_module
from pytest_ctresources.gpu.detect import detect_gpus
from pytest_ctresources.leases.ledger import (
    LeaseTimeout,
    VramLedger,
    ensure_root,
    ledger_path,
    units_for,
)
from pytest_ctresources.report.placement import placement_lines
from pytest_ctresources.xdist.binding import (
    bind_worker,
    choose_gpu,
    choose_position,
    plan_line,
    worker_number,
)
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

# --- binding: pure parts ---------------------------------------------------------------------


def test_worker_number() -> None:
    assert worker_number("gw0") == 0
    assert worker_number("gw12") == 12
    assert worker_number("master") is None
    # ASCII digits, and few: a 5000-digit id was a ValueError traceback at start-up.
    assert worker_number("gw" + "9" * 5000) is None
    assert worker_number("gw\u0661") is None


def test_round_robin_respects_the_users_visible_devices() -> None:
    facts = detect_gpus({"CT_FAKE_GPUS": "A=10;B=20;C=30", "CUDA_VISIBLE_DEVICES": "2,0"})
    picked = [choose_gpu(facts, n) for n in range(3)]
    assert [gpu.physical_index for gpu in picked if gpu] == [2, 0, 2]


def test_bind_worker_narrows_visible_devices_to_a_uuid() -> None:
    env = {
        "CT_FAKE_GPUS": "A=10;B=20",
        "PYTEST_XDIST_WORKER": "gw3",
        "PYTEST_XDIST_WORKER_COUNT": "4",
    }
    binding = bind_worker(env, detect_gpus(env))
    assert binding is not None
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-fake-1"
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
from pytest_ctresources.leases.ledger import VramLedger
ledger = VramLedger(Path(sys.argv[1]), float(sys.argv[2])).open()
ledger.acquire(float(sys.argv[3]), timeout_s=5)
print("held", flush=True)
sys.stdin.read()  # hold until killed
"""


def hold_lease(path: Path, budget_gib: float, gib: float) -> subprocess.Popen[str]:
    """Another process holding ``gib`` of the budget (as another worker or run would)."""
    if path.parent == ledger_path("x").parent:
        ensure_root()
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
    waits: list[float] = []
    ledger = VramLedger(path, 10, sleep=waits.append).open()  # waits counted, not slept
    try:
        small = ledger.acquire(2, timeout_s=1)  # 2 of the 2 GiB left: granted at once
        assert small.waited_s == 0 and not waits
        ledger.release(small)
        # The other process's locks are probed until the timeout, however slow the probes.
        ledger.clock = iter(0.1 * step for step in itertools.count()).__next__
        with pytest.raises(LeaseTimeout, match=r"lease of 8\.0 GiB.* 10\.0 GiB and 2\.0 GiB"):
            ledger.acquire(8, timeout_s=0.5)
        assert waits, "timed out without waiting"
        ledger.clock, ledger.sleep = time.monotonic, time.sleep
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
        lease = ledger.acquire(6, timeout_s=60, before_waiting=give_back_soon)
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
    # before_waiting runs once the waiter holds the turnstile and finds its units taken (no
    # one else can hold the turnstile here): its line says it is queued, however slow the
    # machine (a fixed pause was not enough under load).
    waiting = HOLDER.replace(
        "timeout_s=5", "timeout_s=120, before_waiting=lambda: print('waiting', flush=True)"
    )
    waiter = subprocess.Popen(
        [sys.executable, "-c", waiting, str(path), "10", "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ledger = VramLedger(path, 10).open()
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "waiting"
        with pytest.raises(LeaseTimeout):
            ledger.acquire(1, timeout_s=0.5)
        holder.kill()
        assert waiter.stdout.readline().strip() == "held"
        assert ledger.acquire(1, timeout_s=5).gib == 1  # 2 GiB free again
    finally:
        holder.kill()
        waiter.kill()
        ledger.close()


def test_a_lease_larger_than_the_budget_is_refused_at_once(tmp_path: Path) -> None:
    ledger = VramLedger(tmp_path / "gpu.ledger", 10).open()
    with pytest.raises(ValueError, match=r"exceeds the whole budget of 10\.0 GiB"):
        ledger.acquire(11, timeout_s=100)
    ledger.close()


def test_placement_lines() -> None:
    def placed(
        worker: str, gpu: int, wait: float, lease_gib: float = 18.0, **lease: float
    ) -> record_module.TestRecord:
        return record_module.TestRecord(
            worker=worker,
            gpu_name="H200",
            gpu_physical_index=gpu,
            gpu_uuid=f"GPU-{gpu}",
            lease_gib=lease_gib,
            lease_wait_s=wait,
            lease_gave_up_after_s=lease.get("gave_up_after_s"),
            lease_reused_gib=lease.get("reused_gib"),
        )

    lines = placement_lines([placed("gw0", 0, 0), placed("gw2", 0, 2.5), placed("gw1", 1, -1)])
    assert lines[0] == "GPU placement (pytest-xdist): 3 test(s) on 2 GPU(s)"
    assert lines[1] == (
        "  GPU 0 (H200): gw0, gw2; 2 test(s), 2 with a lease, waited 2.5 s in all (longest 2.5 s)"
    )
    assert lines[2].endswith("1 lease timeout(s)")
    # A wait that ended in a timeout is counted in the time waited.
    (_, line) = placement_lines([placed("gw1", 1, -1, gave_up_after_s=5.0)])
    assert line == (
        "  GPU 1 (H200): gw1; 1 test(s), 1 with a lease, waited 5.0 s in all (longest 5.0 s), "
        "1 lease timeout(s)"
    )
    # A plain run: a line only when its leases made a test wait (another run held the GPU).
    assert placement_lines([placed("main", 0, 0)]) == []
    reused = placed("main", 0, 1.5, lease_gib=16.0, reused_gib=9.0)
    assert placement_lines([placed("main", 0, 0), reused]) == [
        "VRAM leases: 2 test(s) on 1 GPU(s)",
        "  GPU 0 (H200): 2 test(s), 2 with a lease, waited 1.5 s in all (longest 1.5 s), "
        "1 reused the resident model's lease",
    ]


# --- end to end: pytester with -n 2 / -n 3 -----------------------------------------------------
# The controllers run in-process: the workers, where binding and leases happen, are processes
# of their own anyway. Plain runs that take leases keep a process (the ledger's record locks are
# per process), and so do the resident-model projects (their conftest registers atexit hooks).

# A project's conftest: the ledger calls ``before_waiting`` once when a lease is not granted
# at once, so wrapping it says "this process waited for a lease" with a file (it changes
# nothing else); patched only around tests, so that an in-process controller (which shares
# the ledger module with this test run) is never patched. Tests needing more than half the
# card get leases one at a time: the first of a run to get one holds it until another worker
# (or the other run, RUN_LABEL) has waited for one, a condition rather than a pause, since
# under load the other may ask late. Only the first holds: a later holder could be left with
# no one to wait.
WAITER_CONFTEST = """
import glob, os, time
import pytest
from pytest_ctresources.leases import ledger

RUN = os.environ.get("RUN_LABEL", "run")
WHO = os.environ.get("RUN_LABEL") or os.environ.get("PYTEST_XDIST_WORKER", "main")

def saying_so(acquire):
    def acquire_saying_so(self, gib, timeout_s, before_waiting=None):
        def waiting():
            if before_waiting is not None:
                before_waiting()
            open(f"waited-{WHO}", "w").close()
        return acquire(self, gib, timeout_s, before_waiting=waiting)
    return acquire_saying_so

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    plain = ledger.VramLedger.acquire
    ledger.VramLedger.acquire = saying_so(plain)
    try:
        return (yield)
    finally:
        ledger.VramLedger.acquire = plain

def until(condition, what, seconds=120):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.05)

def wait_for_file(name):
    until(lambda: os.path.exists(name), name)

def first_of_its_run():
    try:
        os.close(os.open(f"first-{RUN}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

def hold_until_another_waited(or_else=lambda: False):
    # Keep the lease the test holds until another worker or run has waited for one.
    until(
        lambda: set(glob.glob("waited-*")) - {f"waited-{WHO}"} or or_else(),
        "other worker or run waiting for a lease",
    )
"""

RECORDING_TEST = """
import json, os, time, pytest
from conftest import first_of_its_run, hold_until_another_waited

def record(name):
    with open(f"run-{name}.json", "w") as handle:
        json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"],
                   "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "start": time.time()}, handle)
    if HOLD and first_of_its_run():
        hold_until_another_waited()
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


def recording_suite(pytester: pytest.Pytester, count: int, need: float, hold: bool) -> None:
    """``hold``: the first test to get a lease keeps it until another worker has waited."""
    pytester.makeconftest(WAITER_CONFTEST)
    pytester.makepyfile(
        RECORDING_TEST.replace("HOLD", str(hold))
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
    recording_suite(pytester, count=6, need=1, hold=False)
    result = pytester.runpytest("-n", "3", "-v", "--ct-report-json", "r.json")
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
    recording_suite(pytester, count=2, need=1, hold=False)
    pytester.makeini("[pytest]\nct_gpu_binding = off\n")
    pytester.runpytest("-n", "2").assert_outcomes(passed=2)
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
    # One 10 GiB GPU, two workers, tests needing 6 GiB: never two at once. The first test to
    # get a lease holds it until the other worker has waited for one, so the two do contend.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    recording_suite(pytester, count=4, need=6, hold=True)
    result = pytester.runpytest("-n", "2", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=4)
    spans = sorted((float(r["start"]), float(r["end"])) for r in runs(pytester).values())  # type: ignore[arg-type]
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert second_start >= first_end - 0.05, spans
    report = json.loads((pytester.path / "r.json").read_text())
    waits = [p["lease_wait_s"] for p in report["placements"]]
    assert len(waits) == 4 and max(waits) > 0, waits  # someone waited for a lease
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
    result = pytester.runpytest("-n", "2", "-rs", "--ct-report-json", "r.json")
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
    # Another process (of this run or any other of the user's) holds 8 of the GPU's 10 GiB.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    holder = hold_lease(ledger_path("GPU-fake-0"), 10, 8)
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
    args = ("-n", "2", "-o", "ct_lease_timeout=1")
    try:
        result = pytester.runpytest(*args)
        result.assert_outcomes(errors=1, skipped=1)
        result.stdout.fnmatch_lines(
            [
                # ("waited [0-9]* s": the timeout is 1 s; a loaded machine may wake the waiter
                # ten or more seconds late.)
                "*gw* -> GPU 0 (Card), physical 0: waited [0-9]* s for a VRAM lease of 8.0 GiB; "
                "the GPU's budget is 10.0 GiB and 2.0 GiB of it is free (ct_lease_timeout)"
            ]
        )
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        pytester.runpytest(*args).assert_outcomes(passed=1, skipped=1)
        # --ct-no-leases: nothing waits, whatever the budget.
        holder = hold_lease(ledger_path("GPU-fake-0"), 10, 8)
        pytester.runpytest(*args, "--ct-no-leases").assert_outcomes(passed=1, skipped=1)
    finally:
        holder.kill()


def test_a_worker_killed_mid_test_gives_its_lease_back(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    # test_a_dies takes its lease first (the others ask only once it holds it) and dies
    # while another worker waits for one: that waiter gets it only from the dead worker.
    pytester.makeconftest(
        WAITER_CONFTEST
        + """
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    # Before the plugin's setup asks for the test's lease.
    if item.name.startswith("test_b_after"):
        wait_for_file("a-holds")
    return (yield)
"""
    )
    pytester.makepyfile(
        """
        import os, pytest
        from conftest import hold_until_another_waited

        @pytest.mark.vram(gib=8)
        def test_a_dies():
            open("a-holds", "w").close()
            hold_until_another_waited()
            os._exit(1)

        @pytest.mark.vram(gib=8)
        @pytest.mark.parametrize("i", range(3))
        def test_b_after(i):
            pass
        """
    )
    result = pytester.runpytest(
        "-n", "2", "-p", "no:randomly", "-o", "ct_lease_timeout=120", "--ct-report-json", "r.json"
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
        import glob, os, time, pytest

        def test_a_dies():
            if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
                os._exit(1)
            # gw0 stays on GPU 0 until the replacement has chosen its GPU (its first file
            # says so): then that choice had gw0 to avoid.
            deadline = time.time() + 120
            while not glob.glob("after-*-gw2.txt"):
                assert time.time() < deadline, "no replacement worker ran a test"
                time.sleep(0.05)

        @pytest.mark.parametrize("i", range(6))
        def test_b_after(i):
            with open(f"after-{i}-{os.environ['PYTEST_XDIST_WORKER']}.txt", "w") as handle:
                handle.write(os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["CUDA_VISIBLE_DEVICES"])
        """
    )
    # --dist each: every worker runs every test, so gw1 dies and xdist starts gw2.
    result = pytester.runpytest("-n", "2", "-p", "no:randomly", "--dist", "each")
    result.stdout.fnmatch_lines(["*worker 'gw1' crashed*"])
    seen = {path.read_text() for path in pytester.path.glob("after-*.txt")}
    # gw2 sits on GPU 1, where gw1 sat, not beside gw0 on GPU 0 (round robin's choice).
    assert seen == {"gw0 GPU-fake-0", "gw2 GPU-fake-1"}, seen


# --- one budget per GPU for every run of the user ------------------------------------------------

SPANS_TEST = """
import glob, json, os, time, pytest
from conftest import first_of_its_run, hold_until_another_waited

LABEL = os.environ["RUN_LABEL"]
OTHER = "xdist" if LABEL == "plain" else "plain"

@pytest.mark.parametrize("i", range(3))
@pytest.mark.vram(gib=6)
def test_x(i):
    # The first test of each run holds its lease until the other run has waited for one (or
    # has run all its tests): then each run waits for the other at least once.
    start = time.time()
    if first_of_its_run():
        hold_until_another_waited(or_else=lambda: len(glob.glob(f"span-{OTHER}-*")) == 3)
    with open(f"span-{LABEL}-{i}.json", "w") as handle:
        json.dump([start, time.time()], handle)
"""


def test_two_concurrent_runs_queue_on_one_gpus_budget(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two runs of the user at once on one 10 GiB card (two terminals, two CI jobs), one plain,
    # one with -n 2: tests needing 6 GiB never overlap, whichever run they belong to.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makeconftest(WAITER_CONFTEST)
    pytester.makepyfile(SPANS_TEST)
    runs = {}
    for label, args in (("plain", []), ("xdist", ["-n", "2"])):
        monkeypatch.setenv("RUN_LABEL", label)
        command = [sys.executable, "-m", "pytest", "-o", "ct_lease_timeout=300"]
        with open(pytester.path / f"{label}.log", "w") as log:
            runs[label] = pytester.popen(
                [*command, *args, "--ct-report-json", f"{label}.json"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    for label, run in runs.items():
        assert run.wait(timeout=300) == 0, (pytester.path / f"{label}.log").read_text()
    spans = sorted(
        tuple(json.loads(path.read_text())) for path in pytester.path.glob("span-*.json")
    )
    assert len(spans) == 6
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert second_start >= first_end - 0.05, spans
    waits = {
        label: [
            placement["lease_wait_s"]
            for placement in json.loads((pytester.path / f"{label}.json").read_text())["placements"]
        ]
        for label in ("plain", "xdist")
    }
    assert all(len(run) == 3 and max(run) > 0 for run in waits.values()), waits  # both queued


def test_a_plain_run_takes_leases_and_waits_for_another_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=8)
        def test_big(): pass
        """
    )
    holder = hold_lease(ledger_path("GPU-fake-0"), 10, 8)  # another run's test, say
    try:
        result = pytester.runpytest_subprocess("-o", "ct_lease_timeout=1")
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(
            [
                "*GPU 0 (Card): waited [0-9]* s for a VRAM lease of 8.0 GiB; the GPU's budget is "
                "10.0 GiB and 2.0 GiB of it is free (ct_lease_timeout)",
                "VRAM leases: 1 test(s) on 1 GPU(s)",
                "  GPU 0 (Card): 1 test(s), 1 with a lease, waited ?.* s in all (longest ?.* s), "
                "1 lease timeout(s)",
            ]
        )
        holder.kill()
        holder.wait()
        result = pytester.runpytest_subprocess(
            "-o", "ct_lease_timeout=1", "--ct-report-json=r.json"
        )
        result.assert_outcomes(passed=1)
        placements = json.loads((pytester.path / "r.json").read_text())["placements"]
        assert [(p["worker"], p["lease_gib"], p["gpu_uuid"]) for p in placements] == [
            ("main", 8.0, "GPU-fake-0")
        ]
        assert "VRAM leases" not in str(result.stdout)  # nobody waited: nothing to say
    finally:
        holder.kill()


def test_memory_other_processes_use_counts_against_the_budget(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML says 6 of the card's 10 GiB are in use, and no lease of the user's holds them.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    monkeypatch.setenv("CT_FAKE_GPUS_USED", "6")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=6)
        def test_does_not_fit_beside_them(): pass

        @pytest.mark.vram(gib=4)
        def test_fits_beside_them(): pass
        """
    )
    for args in ((), ("-n", "2")):
        # The plain run takes its leases in a process of its own (the ledger's record locks
        # are per process); under xdist the workers do, and the controller runs in-process.
        run = pytester.runpytest if args else pytester.runpytest_subprocess
        result = run("-o", "ct_lease_timeout=1", *args)
        outcomes = result.parseoutcomes()
        if args:
            # Two workers at once: when the 6 GiB waiter gets the turnstile first, the 4 GiB
            # test queues behind it (no overtaking) and times out too; either order is right.
            assert (
                outcomes.get("errors") in (1, 2)
                and outcomes.get("passed", 0) == 2 - outcomes["errors"]
            )
        else:
            result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines(
            [
                "*waited [0-9]* s for a VRAM lease of 6.0 GiB; the GPU's budget is 10.0 GiB and "
                "10.0 GiB of it is free, but 6.0 GiB of the card's 10.0 GiB is used beyond the "
                "leases (other processes, CUDA contexts) (ct_lease_timeout)"
            ]
        )


def test_a_malformed_fake_used_memory_is_one_usage_error_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile("def test_a(): pass\n")
    for value, problem in (
        ("lots", "entry 1 'lots' is not a number of GiB >= 0"),
        ("4;12", "entry 2 '12' exceeds fake GPU 1's"),
        ("11", "entry 1 '11' exceeds fake GPU 0's 10 GiB (CT_FAKE_GPUS)"),
    ):
        monkeypatch.setenv("CT_FAKE_GPUS_USED", value)
        result = pytester.runpytest()
        if "GPU 1" in problem:
            assert result.ret == pytest.ExitCode.OK  # one fake GPU: a second entry is not checked
            continue
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert [line for line in result.stderr.lines if line.strip()] == [
            f"ERROR: CT_FAKE_GPUS_USED: {problem}"
            + (
                "; expected GiB in use per fake GPU separated by ';', e.g. '6;0.5'"
                if "number" in problem
                else ""
            )
        ]


# --- resident models hold leases ------------------------------------------------------------------

# The fake CUDA allocator (tests/fake_cuda.py), a card shared by every process of the test (a
# log of allocations, so the test can check what was on it at once), and ct_session's model
# build replaced by one that puts MODEL_GIB on the card until the model is freed.
RESIDENT_CONFTEST = (
    FAKE_CUDA_CONFTEST
    + """
import atexit, fcntl, json, os, threading, time, weakref
import pytest
from pytest_ctresources.session import cache

MODEL_GIB = 9

@atexit.register
def threads_left():  # after pytest's end, its config cleanup included
    names = [thread.name for thread in threading.enumerate() if thread.is_alive()]
    with open(f"threads-{os.getpid()}.json", "w") as handle:
        json.dump(names, handle)

def card(delta, what):
    with open(os.environ["CT_TEST_CARD"], "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        lines = handle.read().splitlines()
        now = (json.loads(lines[-1])["now"] if lines else 0) + delta
        event = {"now": now, "what": what, "pid": os.getpid(), "t": time.time()}
        handle.write(json.dumps(event) + "\\n")

def use(gib, what):
    FAKE.alloc(gib)
    card(gib, what)

def done(gib, what):
    FAKE.free(gib)
    card(-gib, what)

class Model:
    pass

def build(cfg, device):
    model = Model()
    use(MODEL_GIB, "model loaded")
    weakref.finalize(model, done, MODEL_GIB, "model freed")
    return model

@pytest.fixture(autouse=True)
def stand_in_builder(monkeypatch):
    monkeypatch.setattr(cache, "build_model", build)

def mark(name):
    open(name, "w").close()

def wait_for(name, seconds=60):
    deadline = time.time() + seconds
    while not os.path.exists(name):
        assert time.time() < deadline, f"no {name} after {seconds} s"
        time.sleep(0.05)
"""
)


def card_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def resident_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Path:
    """A 24 GiB fake card and a 9 GiB cached model; returns the card's log."""
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    monkeypatch.setenv("CT_TEST_CARD", str(tmp_path / "card.jsonl"))
    pytester.makeconftest(RESIDENT_CONFTEST)
    return tmp_path / "card.jsonl"


def test_another_workers_wait_frees_an_idle_resident_model(
    pytester: pytest.Pytester, resident_project: Path
) -> None:
    # Two workers on a 24 GiB card; gw-A keeps a 9 GiB model cached while it
    # runs a test that does not use it; gw-B's test needs 16 GiB. Before resident models held
    # leases, B got 16 GiB beside the model: 25 GiB on a 24 GiB card.
    # (--dist loadfile: one file per worker; xdist 3.8's loadgroup cannot rename pytest 9's
    # node ids, so its groups do not hold.)
    pytester.makepyfile(
        test_a="""
        import pytest
        from conftest import done, mark, use, wait_for

        @pytest.mark.vram(gib=16)
        def test_a1_loads_the_model(ct_session):
            ct_session.load_model("cuda:0")
            use(2, "a1")
            done(2, "a1")
            mark("a-loaded")

        def test_a2_idles_with_the_model_cached():
            wait_for("b-done")
        """,
        test_b="""
        import pytest
        from conftest import done, mark, use, wait_for

        def test_b1_waits_for_the_model():
            wait_for("a-loaded")

        @pytest.mark.vram(gib=16)
        def test_b2_needs_16_gib():
            use(16, "b2")
            done(16, "b2")
            mark("b-done")
        """,
    )
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadfile", "-o", "ct_lease_timeout=30", "--ct-report-json=r.json"
    )
    result.assert_outcomes(passed=4)
    events = card_events(resident_project)
    assert max(float(e["now"]) for e in events) <= 24, events  # type: ignore[arg-type]
    order = [e["what"] for e in events]
    assert order == ["model loaded", "a1", "a1", "model freed", "b2", "b2"], order
    placements = {
        p["nodeid"].rsplit("::", 1)[1]: p
        for p in json.loads((pytester.path / "r.json").read_text())["placements"]
    }
    assert placements["test_b2_needs_16_gib"]["lease_wait_s"] > 0  # until the model was freed
    assert (
        placements["test_a1_loads_the_model"]["worker"]
        != placements["test_b2_needs_16_gib"]["worker"]
    )


def test_a_resident_model_is_reused_within_its_lease_and_freed_for_a_test_that_needs_room(
    pytester: pytest.Pytester, resident_project: Path
) -> None:
    # One process; another run holds 8 GiB of the card. A test reusing the cached model
    # leases 16 - 9 GiB, so it fits beside the model at once; a 16 GiB test that does not use
    # the model gets it freed (its own idle cache, before waiting).
    holder = hold_lease(ledger_path("GPU-fake-0"), 24, 8)
    pytester.makepyfile(
        """
        import threading, pytest
        from conftest import done, use

        @pytest.mark.vram(gib=16)
        def test_1_loads(ct_session):
            ct_session.load_model("cuda:0")
            use(4, "t1")
            done(4, "t1")

        @pytest.mark.vram(gib=16)
        def test_2_reuses(ct_session):
            ct_session.load_model("cuda:0")
            use(7, "t2")
            done(7, "t2")
            # the model holds a lease: its process watches for waiters
            assert "ctresources-idle-cache-watcher" in [t.name for t in threading.enumerate()]

        @pytest.mark.vram(gib=16)
        def test_3_needs_room():
            use(16, "t3")
            done(16, "t3")
        """
    )
    try:
        result = pytester.runpytest_subprocess(
            "-o", "ct_lease_timeout=60", "--ct-report-json=r.json"
        )
    finally:
        holder.kill()
    result.assert_outcomes(passed=3)
    order = [e["what"] for e in card_events(resident_project)]
    assert order == ["model loaded", "t1", "t1", "t2", "t2", "model freed", "t3", "t3"], order
    leases = {
        p["nodeid"].rsplit("::", 1)[1]: (
            p["lease_gib"],
            p["lease_reused_gib"],
            p["lease_wait_s"] > 0,
        )
        for p in json.loads((pytester.path / "r.json").read_text())["placements"]
    }
    assert leases == {
        "test_1_loads": (16.0, 0.0, False),
        "test_2_reuses": (16.0, 9.0, False),
        "test_3_needs_room": (16.0, 0.0, True),
    }
    result.stdout.fnmatch_lines(
        ["*GPU 0 (Card): 3 test(s), 3 with a lease, *1 reused the resident*"]
    )
    (left,) = pytester.path.glob("threads-*.json")
    assert "ctresources-idle-cache-watcher" not in json.loads(left.read_text())  # stopped


REUSING_TESTS = """
import pytest
from conftest import done, first_of_its_run, hold_until_another_waited, use

@pytest.mark.parametrize("i", range(3))
@pytest.mark.vram(gib=16)
def test_reuses(ct_session, i):
    ct_session.load_model("cuda:0")
    use(7, "test")
    if first_of_its_run():
        hold_until_another_waited()
    done(7, "test")
"""


def test_workers_whose_tests_reuse_their_cached_models_take_turns(
    pytester: pytest.Pytester, resident_project: Path
) -> None:
    # Each worker's model (9 GiB) and test (7 GiB more) fill 16 of the 24 GiB card: the two
    # cannot both keep a model and run. A test that reuses its model and cannot get its lease
    # at once frees the model and waits for its whole need, so neither waits for ever. The
    # first test to get a lease holds it until the other worker has waited: the two contend.
    pytester.makeconftest(RESIDENT_CONFTEST + WAITER_CONFTEST)
    pytester.makepyfile(test_a=REUSING_TESTS, test_b=REUSING_TESTS)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadfile", "-o", "ct_lease_timeout=60"
    )
    result.assert_outcomes(passed=6)
    events = card_events(resident_project)
    assert max(float(e["now"]) for e in events) <= 24, events  # type: ignore[arg-type]
    assert len({e["pid"] for e in events if e["what"] == "model loaded"}) == 2


def test_a_model_its_lease_cannot_cover_is_freed_after_its_test(
    pytester: pytest.Pytester, resident_project: Path
) -> None:
    # 18 GiB of the card are leased elsewhere; the test declared 4 GiB and loaded a 9 GiB
    # model. The model cannot stay resident without a lease of its size.
    holder = hold_lease(ledger_path("GPU-fake-0"), 24, 18)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=4)
        def test_under_declared(ct_session):
            ct_session.load_model("cuda:0")

        def test_after():
            pass
        """
    )
    try:
        result = pytester.runpytest_subprocess(
            "-W", "always::pytest_ctresources.exceptions.CtResourcesWarning"
        )
    finally:
        holder.kill()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*(float32) (9.00 GiB on the GPU), loaded by *test_under_declared, was freed "
            "after the test: its lease covered only 4.00 GiB and the GPU's budget had no more "
            "free; declare the test's need with the model included*"
        ]
    )
    order = [e["what"] for e in card_events(resident_project)]
    assert order == ["model loaded", "model freed"], order
