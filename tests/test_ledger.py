"""The VRAM ledger: its private directory, its budget per GPU, several leases in one process.

Locks never conflict within one process, so every claim about another holder is made with a
second process (``hold``); each test has a ledger directory of its own (the conftest's
``private_temp_dir``). Attacks on the shared ledger directory are reproduced as another user would
mount them, with ``nobody`` played by ``os.chown`` (or ``setpriv``) where the suite runs as root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_ctresources.leases.leases import IdleCacheWatcher
from pytest_ctresources.leases.ledger import (
    Lease,
    LeaseTimeout,
    LedgerDirError,
    VramLedger,
    ensure_root,
    ledger_path,
    ledger_root,
    prune_old_runs,
    run_dir,
    seat_board,
)

pytest_plugins = ["pytester"]

NOBODY = 65534
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="plays another user with chown, which needs root",
)

# A second process: opens a budget (path, budget GiB, card GiB) and runs commands from stdin,
# one per line, answering each with a line: "take GIB [resident]", "free" (its last lease),
# "watch" (an idle-cache watcher whose eviction frees its resident lease and says "evicted"),
# "free-gib", "held-gib".
HOLDER = """
import sys
from pathlib import Path
from pytest_ctresources.leases.leases import IdleCacheWatcher
from pytest_ctresources.leases.ledger import Lease, VramLedger

ledger = VramLedger(Path(sys.argv[1]), float(sys.argv[2]), card_gib=float(sys.argv[3])).open()
leases = []

class Cache:
    def evict_if_idle(self):
        for lease in leases:
            if lease.resident:
                ledger.release(lease)
                print("evicted", flush=True)

for line in sys.stdin:
    command, *args = line.split()
    if command == "take":
        lease = ledger.acquire(float(args[0]), timeout_s=60)
        if args[1:] == ["resident"]:  # as GpuLeases.model_loaded carves a model's lease
            model = Lease(0.0, [], 0.0, resident=True)
            ledger.move(lease, model, lease.gib)
            lease = model
        leases.append(lease)
        print("held", flush=True)
    elif command == "free":
        ledger.release(leases.pop())
        print("freed", flush=True)
    elif command == "watch":
        IdleCacheWatcher(ledger, Cache()).watch()
        print("watching", flush=True)
    elif command == "free-gib":
        print(ledger.free_gib(), flush=True)
    elif command == "held-gib":
        print(ledger.held_gib(), flush=True)
"""


class Holder:
    """Another process of the user's, holding leases on one budget file."""

    def __init__(self, path: Path, budget_gib: float, card_gib: float | None = None) -> None:
        card = budget_gib if card_gib is None else card_gib
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), str(budget_gib), str(card)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holders() -> list[Holder]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.kill()


def hold(holders: list[Holder], path: Path, budget: float, card: float | None = None) -> Holder:
    holder = Holder(path, budget, card)
    holders.append(holder)
    return holder


# --- several leases in one process ------------------------------------------------------------


def test_leases_in_one_process_never_share_a_unit(tmp_path: Path, holders: list[Holder]) -> None:
    path = tmp_path / "gpu.ledger"
    ledger = VramLedger(path, 10).open()
    try:
        first = ledger.acquire(6, timeout_s=1)
        second = ledger.acquire(4, timeout_s=1)  # a resident model's and a test's, say
        assert not set(first.units) & set(second.units)
        with pytest.raises(LeaseTimeout, match=r"0\.0 GiB of it is free"):
            ledger.acquire(1, timeout_s=0.2)  # locks never conflict in-process: the record does
        watcher = hold(holders, path, 10)
        assert watcher.ask("free-gib") == "0.0"  # another process sees all 10 GiB held
        ledger.release(second)
        assert watcher.ask("free-gib") == "4.0"
    finally:
        ledger.close()


def test_a_model_lease_carved_from_a_test_keeps_its_units_held_throughout(
    tmp_path: Path, holders: list[Holder]
) -> None:
    path = tmp_path / "gpu.ledger"
    ledger = VramLedger(path, 24).open()
    watcher = hold(holders, path, 24)
    try:
        test = ledger.acquire(16, timeout_s=1)
        model = Lease(0.0, [], 0.0, resident=True)
        ledger.move(test, model, 9)  # the model the test loaded keeps 9 GiB
        assert (len(test.units), len(model.units)) == (7 * 16, 9 * 16)
        ledger.release(test)  # the test ends
        assert watcher.ask("free-gib") == "15.0"
        ledger.move(model, test, 9)  # freed during a test that counted on it: back to the test
        assert model.units == [] and len(test.units) == 9 * 16
        assert watcher.ask("free-gib") == "15.0"
        ledger.release(test)
        assert watcher.ask("free-gib") == "24.0"
    finally:
        ledger.close()


def test_two_ledgers_of_one_file_in_one_process_share_its_record(tmp_path: Path) -> None:
    # Closing any descriptor drops every lock of the process on the file: a second user of
    # the file in the process (an in-process pytest run, a test) must not open it again.
    path = tmp_path / "gpu.ledger"
    first, second = VramLedger(path, 10).open(), VramLedger(path, 10).open()
    try:
        lease = first.acquire(8, timeout_s=1)
        with pytest.raises(LeaseTimeout):
            second.acquire(8, timeout_s=0.2)
        second.close()
        with pytest.raises(LeaseTimeout):  # still held: closing `second` closed no descriptor
            VramLedger(path, 10).open().acquire(8, timeout_s=0.2)
        first.release(lease)
    finally:
        first.close()


# --- one budget per card -------------------------------------------------------------------------


def test_a_capped_run_and_an_uncapped_one_share_the_card(
    tmp_path: Path, holders: list[Holder]
) -> None:
    # A 24 GiB card; this run is capped at 8 GiB (--ct-vram-capacity 8), another one is not.
    path = tmp_path / "gpu.ledger"
    other = hold(holders, path, 24)
    assert other.ask("take 16") == "held"  # from the top of the card: a capped run's units stay
    capped = VramLedger(path, 8, card_gib=24).open()
    try:
        lease = capped.acquire(8, timeout_s=1)  # granted at once
        assert max(lease.units) < 8 * 16
        assert other.ask("free-gib") == "0.0"  # the card is full for everyone
        with pytest.raises(ValueError, match=r"exceeds the whole budget of 8\.0 GiB"):
            capped.acquire(9, timeout_s=1)
    finally:
        capped.close()


def test_memory_used_beyond_the_leases_counts_against_the_budget(
    tmp_path: Path, holders: list[Holder]
) -> None:
    path = tmp_path / "gpu.ledger"
    used = {"bytes": 6 << 30}  # what NVML reports in use on the 10 GiB card
    ledger = VramLedger(path, 10, used_bytes=lambda: used["bytes"]).open()
    try:
        with pytest.raises(
            LeaseTimeout,
            match=r"10\.0 GiB of it is free, but 6\.0 GiB of the card's 10\.0 GiB is used beyond "
            r"the leases",
        ):
            ledger.acquire(6, timeout_s=0.3)
        ledger.release(ledger.acquire(4, timeout_s=1))
        # Memory the user's own leases hold is not counted twice: 8 GiB leased and in use.
        other = hold(holders, path, 10)
        assert other.ask("take 8") == "held"
        used["bytes"] = 8 << 30
        ledger.release(ledger.acquire(2, timeout_s=1))
    finally:
        ledger.close()


def test_a_waiter_gets_another_processes_idle_resident_model_freed(
    tmp_path: Path, holders: list[Holder]
) -> None:
    # A 24 GiB card: another worker keeps a 9 GiB model cached, idle; a test here needs 16.
    path = tmp_path / "gpu.ledger"
    worker = hold(holders, path, 24)
    assert worker.ask("take 9 resident") == "held"
    assert worker.ask("watch") == "watching"
    ledger = VramLedger(path, 24).open()
    try:
        lease = ledger.acquire(16, timeout_s=60)
        assert worker.line() == "evicted"
        assert lease.waited_s > 0
    finally:
        ledger.close()


def test_a_waiter_that_freeing_caches_cannot_help_frees_none(
    tmp_path: Path, holders: list[Holder]
) -> None:
    # 18 GiB of running tests' leases and a 2 GiB idle model on a 24 GiB card: a test needing
    # 8 must wait for the tests, and freeing the model (4 + 2 < 8) would only cost a reload.
    path = tmp_path / "gpu.ledger"
    worker = hold(holders, path, 24)
    assert worker.ask("take 2 resident") == "held"
    assert worker.ask("take 18") == "held"
    assert worker.ask("watch") == "watching"
    ledger = VramLedger(path, 24).open()
    try:
        with pytest.raises(LeaseTimeout):
            ledger.acquire(8, timeout_s=1)
        assert worker.ask("held-gib") == "20.0"  # the model still holds its lease
    finally:
        ledger.close()


def test_the_watcher_thread_is_a_daemon_that_starts_only_with_a_resident_model(
    tmp_path: Path,
) -> None:
    ledger = VramLedger(tmp_path / "gpu.ledger", 10).open()

    class Cache:
        evictions = 0

        def evict_if_idle(self) -> None:
            self.evictions += 1

    watcher = IdleCacheWatcher(ledger, Cache())  # type: ignore[arg-type]
    try:
        assert watcher._thread is None  # no resident model: no thread at all
        watcher.watch()
        assert watcher._thread is not None and watcher._thread.daemon
        watcher.park()
        watcher.stop()
        assert watcher._thread is None
    finally:
        ledger.close()


# --- the private directory ---------------------------------------------------------------------


def test_the_ledger_directory_is_private_and_an_old_0755_one_is_made_private() -> None:
    root = ledger_root()
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # (whatever the umask): as versions before 0.x created it
    assert ensure_root() == root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    seats = seat_board("run-a")
    try:
        assert stat.S_IMODE(run_dir("run-a").stat().st_mode) == 0o700
        assert stat.S_IMODE((run_dir("run-a") / "seats").stat().st_mode) == 0o600
    finally:
        seats.close()


def test_a_symlink_planted_as_the_ledger_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attack: another user creates pytest-ctresources-<victim uid> as a link to the
    # victim's own experiments, where an old run-2024-ablation/ sits; pruning used to delete it.
    victim = tmp_path / "experiments"
    ablation = victim / "run-2024-ablation"
    ablation.mkdir(parents=True)
    (ablation / "results.csv").write_text("irreplaceable")
    two_days_ago = time.time() - 2 * 86400
    os.utime(ablation, (two_days_ago, two_days_ago))
    ledger_root().symlink_to(victim)
    with pytest.raises(LedgerDirError, match=r"is a symbolic link \(to '.*experiments'\)"):
        prune_old_runs(current=None)
    with pytest.raises(LedgerDirError):
        seat_board("run-b")
    assert (ablation / "results.csv").read_text() == "irreplaceable"


def test_a_file_planted_as_the_ledger_directory_is_refused() -> None:
    ledger_root().write_text("")
    with pytest.raises(
        LedgerDirError,
        match=r"^pytest-ctresources: the VRAM ledger directory .* is not a directory but a "
        r"regular file; it must be a directory of your own",
    ):
        ensure_root()


@as_root
def test_a_directory_of_another_user_is_refused() -> None:
    root = ledger_root()
    root.mkdir(mode=0o777)
    os.chown(root, NOBODY, NOBODY)  # created by the attacker before the victim's first run
    with pytest.raises(LedgerDirError, match=r"belongs to uid 65534, not to you \(uid 0\)"):
        ensure_root()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
@as_root
def test_another_user_cannot_move_or_read_the_ledger(tmp_path: Path) -> None:
    # Moving the budget file away mid-run let an attacker split one card's budget in two.
    ensure_root()
    ledger = VramLedger(ledger_path("GPU-x"), 10).open()
    try:
        attack = (
            f"ls {ledger_root()} || mv {ledger_path('GPU-x')} {tmp_path}/moved || "
            f"mv {ledger_root()} {tmp_path}/moved-dir; exit 0"
        )
        os.chmod(tmp_path, 0o777)
        as_nobody = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
        result = subprocess.run(
            [*as_nobody, "sh", "-c", attack],
            capture_output=True,
            text=True,
        )
        assert "Permission denied" in result.stderr
        assert ledger_path("GPU-x").is_file() and not (tmp_path / "moved").exists()
    finally:
        ledger.close()


def test_a_link_planted_as_a_ledger_file_is_refused_and_not_followed(tmp_path: Path) -> None:
    ensure_root()
    target = tmp_path / "victim.txt"
    target.write_text("data")
    ledger_path("GPU-x").symlink_to(target)
    with pytest.raises(
        LedgerDirError, match=r"cannot open the VRAM ledger file .*: it is a symbolic link"
    ):
        VramLedger(ledger_path("GPU-x"), 10).open()
    assert target.read_text() == "data"


# --- pruning ---------------------------------------------------------------------------------


def _age(path: Path, days: float = 2) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then), follow_symlinks=False)


def test_pruning_removes_only_old_unused_run_directories_the_plugin_made(
    tmp_path: Path, holders: list[Holder]
) -> None:
    ensure_root()
    for name in ("old", "current", "in-use", "with-notes", "recent"):
        seat_board(name).close()
    (run_dir("with-notes") / "notes.txt").write_text("mine, not the plugin's")
    live = hold(holders, run_dir("in-use") / "seats", 1)  # a live worker of that run
    assert live.ask("take 1") == "held"
    victim = tmp_path / "victim"
    victim.mkdir()
    run_dir("link").symlink_to(victim)
    for name in ("old", "current", "in-use", "with-notes", "link"):
        _age(run_dir(name))
    _age(victim)
    assert prune_old_runs(current="current") == ["run-old"]
    left = {path.name for path in ledger_root().iterdir()}
    assert left == {"run-current", "run-in-use", "run-with-notes", "run-recent", "run-link"}
    assert victim.is_dir()


@as_root
def test_pruning_leaves_another_users_run_directory_alone() -> None:
    ensure_root()
    seat_board("theirs").close()
    os.chown(run_dir("theirs"), NOBODY, NOBODY)
    _age(run_dir("theirs"))
    assert prune_old_runs(current=None) == []
    assert run_dir("theirs").is_dir()


LONG_RUNNING_WORKER = """
import os, sys, time
from pytest_ctresources.leases.ledger import prune_old_runs, run_dir, seat_board

board = seat_board("long")
board.choose_and_sit(lambda taken: 0, 1)
then = time.time() - 2 * 86400
os.utime(run_dir("long"), (then, then))  # the run started two days ago
prune_old_runs(current="long")  # as its worker's ledger does when it opens
print("pruned", flush=True)
sys.stdin.read()
"""


def test_a_long_running_workers_seat_survives_its_own_pruning() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", LONG_RUNNING_WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "pruned"
        assert run_dir("long").is_dir()
        board = seat_board("long")
        try:
            seats: list[int] = []
            board.choose_and_sit(lambda taken: seats.extend(taken) or 0, 1)
            assert seats == [1]  # the worker still sits: its lock was not dropped
        finally:
            board.close()
    finally:
        worker.kill()
        worker.wait()


# --- end to end: the errors a run shows -------------------------------------------------------


def test_an_unsafe_ledger_directory_is_one_line_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=1)
        def test_leased(): pass

        def test_unleased(): pass
        """
    )
    ledger_root().write_text("")  # a regular file: every xdist run used to end "no tests ran"
    refusal = (
        f"pytest-ctresources: the VRAM ledger directory {ledger_root()} is not a directory but "
        "a regular file; it must be a directory of your own that only you can use: remove it, "
        "or set TMPDIR to a directory of your own"
    )
    result = pytester.runpytest_subprocess("-n", "2")  # refused before any worker starts
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.stderr.lines if line.strip()] == [f"ERROR: {refusal}"]
    # A plain run finds out at its first lease (it imports nothing for GPUs before): the
    # leased test fails with the line, the others run.
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([refusal])
    assert "Traceback" not in str(result.stdout) + str(result.stderr)
    ledger_root().unlink()
    victim = tmp_path / "victim"
    (victim / "run-2024-ablation").mkdir(parents=True)
    _age(victim / "run-2024-ablation")
    ledger_root().symlink_to(victim)
    for args in (("-n", "2"), ()):
        result = pytester.runpytest_subprocess(*args)
        assert "is a symbolic link (to " in str(result.stderr) + str(result.stdout)
        assert (victim / "run-2024-ablation").is_dir()


def test_a_planted_ledger_file_fails_the_leased_tests_with_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    ensure_root()
    target = tmp_path / "victim.txt"
    ledger_path("GPU-fake-0").symlink_to(target)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram(gib=1)
        def test_leased(): pass

        def test_unleased(): pass
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*cannot open the VRAM ledger file *GPU-fake-0.ledger: it is a symbolic link (to *"]
    )
    assert "Traceback" not in str(result.stdout)
    assert not target.exists()  # never created through the link
