"""The report files never destroy anything (docs/security.md, "Report files").

What is refused at start-up is in the table of tests/test_bad_inputs.py. Here: what
happens at session end when the target changed under the run or the disk fails, and
SIGTERM, whose tests run pytest in a process (and a session) of its own.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ctresources.core import record as record_module
from pytest_ctresources.report import files as report_files
from pytest_ctresources.report import results as results_module
from pytest_ctresources.report import run_summary as summary_module
from pytest_ctresources.report.files import SigtermReport
from pytest_ctresources.settings.report_paths import PNG_MAGIC
from pytest_ctresources.units import GIB
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

VICTIM_TEXT = "precious\n"
CUDA_TEST = """
from conftest import FAKE

def test_uses_cuda():
    FAKE.alloc(1); FAKE.free(1)
"""


def _temporaries(directory: Path, *names: str) -> list[str]:
    """The temporary files write_file leaves behind for ``names`` (none, it must)."""
    prefixes = tuple(f".{name}." for name in names)
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefixes))


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(test_cuda=CUDA_TEST)
    return pytester


@pytest.fixture
def umask_027() -> Iterator[None]:
    previous = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("umask_027")
def test_a_report_replaces_the_previous_one_under_the_umask_and_leaves_no_temporary(
    project: pytest.Pytester,
) -> None:
    """In the user's own tree a report follows the umask, as --junitxml's does; missing
    directories are created, as --junitxml and --html create them."""
    for _ in range(2):  # the second run replaces the first run's report
        # In-process: the fake CUDA conftest gives torch.cuda back when its run ends.
        project.runpytest(
            "--ct-report-json", "results/ci/r.json", "--ct-report-plot", "plots/p.png"
        ).assert_outcomes(passed=1)
        document = json.loads((project.path / "results/ci/r.json").read_text())
        assert [t["nodeid"] for t in document["tests"]] == ["test_cuda.py::test_uses_cuda"]
        assert (project.path / "plots/p.png").read_bytes().startswith(PNG_MAGIC)
    for name in ("results/ci/r.json", "plots/p.png"):
        assert _mode(project.path / name) == 0o640
    for name in ("results", "results/ci", "plots"):
        assert _mode(project.path / name) == 0o750
    assert _temporaries(project.path / "results/ci", "r.json") == []
    assert _temporaries(project.path / "plots", "p.png") == []


@pytest.mark.usefixtures("umask_027")
def test_a_report_in_a_shared_place_stays_private(project: pytest.Pytester) -> None:
    """A directory anyone may write to (the system temporary directory): the report and the
    directories made for it there are the user's alone."""
    shared = project.path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    result = project.runpytest(
        "--ct-report-json", "shared/r.json", "--ct-report-plot", "shared/mine/p.png"
    )
    result.assert_outcomes(passed=1)
    assert _mode(shared / "r.json") == 0o600
    assert _mode(shared / "mine") == 0o700
    assert _mode(shared / "mine" / "p.png") == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another user's is made as root")
def test_a_link_another_user_planted_in_a_shared_place_is_not_followed(
    pytester: pytest.Pytester,
) -> None:
    """A link in a shared directory (sticky, anyone may write to it) made by another user who
    does not own that directory leads nowhere the plugin writes (the kernel's
    fs.protected_symlinks rule, kept where that is off): the report went into its target,
    a directory of the victim's. The user's own link there is followed."""
    shared, victim = pytester.path / "shared", pytester.path / "victim"
    shared.mkdir()
    shared.chmod(0o1777)
    victim.mkdir()
    link = shared / "ci-reports"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    pytester.makepyfile(test_it="def test_one():\n    pass\n")
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    for option, value in (("--ct-report-json", "r.json"), ("--ct-snapshot-dir", "snaps")):
        result = pytester.runpytest(option, f"{link}/{value}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(
            [f"*{option}*ci-reports is a symbolic link that uid 65534 made in a shared dir*"]
        )
    assert list(victim.iterdir()) == []
    os.lchown(link, os.geteuid(), os.getegid())
    pytester.runpytest("--ct-report-json", f"{link}/r.json").assert_outcomes(passed=1)
    assert (victim / "r.json").is_file()


@pytest.mark.parametrize(
    ("name", "start"), [("p.png", PNG_MAGIC), ("p.svg", b"<?xml"), ("p.PDF", b"%PDF-")]
)
def test_the_plot_is_written_in_the_format_its_extension_names_and_replaced_next_time(
    project: pytest.Pytester, name: str, start: bytes
) -> None:
    for _ in range(2):  # the second run recognises the first one's plot as its own
        project.runpytest("--ct-report-plot", name).assert_outcomes(passed=1)
        assert (project.path / name).read_bytes().startswith(start)


def test_a_plot_of_another_format_is_not_replaced(project: pytest.Pytester) -> None:
    """An SVG or PDF that is not the plugin's plot (no mark) is someone's: refused."""
    (project.path / "p.svg").write_text('<?xml version="1.0"?><svg/>')
    result = project.runpytest("--ct-report-plot", "p.svg")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --ct-report-plot: p.svg exists and is not an SVG image that pytest-ctresources"
            " wrote (its VRAM plot): it is not replaced*"
        ]
    )


@pytest.mark.parametrize(
    ("name", "said"), [("vram.jpg", "the extension .jpg"), ("vram", "no extension")]
)
def test_a_plot_extension_it_cannot_write_is_one_line(
    pytester: pytest.Pytester, name: str, said: str
) -> None:
    pytester.makepyfile("def test_it(): pass")
    result = pytester.runpytest("--ct-report-plot", name)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.stderr.lines if line.strip()] == [
        f"ERROR: --ct-report-plot: {name} has {said}: the plot's format comes from it, and it "
        "can be written as .png, .svg, .pdf"
    ]
    assert not (pytester.path / name).exists()


PLANT = """
import os, stat
def test_plant():
    os.remove("r.json")
    {what}
"""


@pytest.mark.parametrize(
    ("what", "kind"),
    [
        ("os.symlink('victim.txt', 'r.json')", stat.S_ISLNK),
        ("os.mkfifo('r.json')", stat.S_ISFIFO),
        ("os.mknod('r.json', stat.S_IFCHR | 0o600, os.makedev(1, 7))", stat.S_ISCHR),
    ],
    ids=["symlink", "fifo", "char-device"],
)
def test_what_is_planted_at_the_path_during_the_run_is_left_alone(
    pytester: pytest.Pytester, what: str, kind: object
) -> None:
    if "mknod" in what and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    (pytester.path / "victim.txt").write_text(VICTIM_TEXT)
    (pytester.path / "r.json").write_text("")  # passes the start-up check: empty
    pytester.makepyfile(test_plant=PLANT.format(what=what))
    result = pytester.runpytest("--ct-report-json", "r.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*ReportFileWarning: ctresources: --ct-report-json *r.json was not written: *r.json is "
            "now a *; it is left alone; the file there, if any, is unchanged"
        ]
    )
    assert kind(os.lstat(pytester.path / "r.json").st_mode)  # type: ignore[operator]
    assert (pytester.path / "victim.txt").read_text() == VICTIM_TEXT
    assert _temporaries(pytester.path, "r.json") == []


REMOVE_DIRECTORY = """
import shutil
def test_removes_the_report_directory():
    shutil.rmtree("out")
    open("out", "w").close()  # a file where the directory was: no directory can be made
def test_fails():
    assert False
"""


def test_a_directory_replaced_by_a_file_during_the_run_is_one_warning_and_changes_nothing(
    pytester: pytest.Pytester,
) -> None:
    (pytester.path / "out").mkdir()
    pytester.makepyfile(test_it=REMOVE_DIRECTORY)
    result = pytester.runpytest(
        "--ct-report-json", "out/r.json", "--ct-report-plot", "out/p.png", "--ct-report"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the failing test's, unchanged
    result.assert_outcomes(passed=1, failed=1, warnings=2)
    text = result.stdout.str()
    for flag, name in (("--ct-report-json", "r.json"), ("--ct-report-plot", "p.png")):
        lines = [
            line
            for line in result.stdout.lines
            if f"ReportFileWarning: ctresources: {flag}" in line
        ]
        assert len(lines) == 1
        assert lines[0].endswith(
            f"out/{name} was not written: Not a directory; the file there, if any, is unchanged"
        )
    assert "ctresources summary" in text  # the terminal summary is still printed
    assert "Traceback" not in text and "INTERNALERROR" not in text


FULL_DISK = """
import resource
def test_fills_the_disk():
    # Files can no longer grow past 4 KiB: writes fail with EFBIG, as a full disk fails them
    # with ENOSPC (Python ignores SIGXFSZ, so the write raises instead of the process dying).
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
"""


def test_a_full_disk_keeps_the_old_report_and_leaves_no_png(pytester: pytest.Pytester) -> None:
    previous = '{"schema": "pytest-ctresources-report", "from": "the previous run"}\n'
    (pytester.path / "r.json").write_text(previous)
    # The report carries the experiment's PARAMS: 64 KiB of them make it outgrow the limit.
    pytester.makefile(".yaml", exp="PARAMS:\n  blob: " + "x" * 65536 + "\n")
    pytester.makepyfile(test_it=FULL_DISK)
    # stdout goes to a pipe: the limit binds files only. No cache, no bytecode (files too).
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "--ct-config",
            "exp.yaml",
            "--ct-report-json",
            "r.json",
            "--ct-report-plot",
            "p.png",
        ],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=300,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    warnings = [line for line in process.stdout.splitlines() if "ReportFileWarning" in line]
    assert len(warnings) == 2
    assert all("was not written: File too large; the file there" in line for line in warnings)
    assert (pytester.path / "r.json").read_text() == previous
    assert not (pytester.path / "p.png").exists()
    assert _temporaries(pytester.path, "r.json", "p.png") == []
    assert "1 passed, 2 warnings" in process.stdout


def _result(index: int) -> results_module.TestResult:
    record = record_module.TestRecord(
        device=0,
        gpu="H200",
        date="2026-12-01",
        memory_key="",
        baseline_bytes=0,
        peak_allocated_bytes=index * (GIB // 16),
        peak_reserved_bytes=index * (GIB // 16),
        after_bytes=0,
        leaked_bytes=0,
    )
    return results_module.TestResult(f"test_many.py::test_{index}", record)


def test_a_plot_of_thousands_of_tests_draws_the_highest_peaks(tmp_path: Path) -> None:
    # 0.3 inch a bar at 100 dpi: 2400 bars would pass matplotlib's 2**16-pixel limit.
    summary = summary_module.RunSummary(results={str(i): _result(i) for i in range(2400)})
    report_files.write_plot(tmp_path / "p.png", summary, 139.8, "H200")
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


# --- SIGTERM ------------------------------------------------------------------------------

TERMINATED = """
import os, signal, time
from conftest import FAKE

def test_1_uses_cuda():
    FAKE.alloc(1); FAKE.free(1)

def test_2_is_terminated():
    {wait}
    os.kill({target}, signal.SIGTERM)
    time.sleep(30)  # no wait for anything: SIGTERM ends the process in here

def test_3_never_runs():
    pass
"""


# Under xdist the controller must have taken in test_1's report before the signal: the
# controller says so with a file (after the plugin's own hook), which test_2 waits for.
CONTROLLER_HAS_TEST_1 = """
import os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if (
        "PYTEST_XDIST_WORKER" not in os.environ
        and report.when == "teardown"
        and report.nodeid.endswith("::test_1_uses_cuda")
    ):
        open("controller-has-test-1", "w").close()
"""

WAIT_FOR_THE_CONTROLLER = """deadline = time.time() + 120
    while not os.path.exists("controller-has-test-1"):
        assert time.time() < deadline, "the controller never took in test_1's report"
        time.sleep(0.05)"""


def _run_own_session(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a new session (process group), as `timeout` or Slurm would run it: a
    signal to the whole group then reaches its xdist workers but not this test run."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", *args],
        cwd=path,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=300,
    )


def test_sigterm_writes_the_json_report_then_ends_the_process_of_sigterm(
    project: pytest.Pytester,
) -> None:
    project.makepyfile(test_cuda=TERMINATED.format(target="os.getpid()", wait="pass"))
    process = _run_own_session(project.path, "--ct-report-json", "r.json")
    assert process.returncode == -signal.SIGTERM, process.stdout + process.stderr
    document = json.loads((project.path / "r.json").read_text())
    assert document["interrupted"] is True
    assert document["signal"] == "SIGTERM"
    assert document["exitstatus"] is None
    assert [t["nodeid"] for t in document["tests"]] == ["test_cuda.py::test_1_uses_cuda"]
    assert _temporaries(project.path, "r.json") == []


def test_sigterm_to_the_whole_group_under_xdist(project: pytest.Pytester) -> None:
    # timeout(1) and Slurm signal the process group: the workers die at once, the
    # controller writes the report from what they had sent.
    conftest = project.path / "conftest.py"
    conftest.write_text(conftest.read_text() + CONTROLLER_HAS_TEST_1)
    project.makepyfile(
        test_cuda=TERMINATED.format(target="-os.getpgid(0)", wait=WAIT_FOR_THE_CONTROLLER)
    )
    process = _run_own_session(
        project.path, "-n", "2", "--dist", "loadfile", "--ct-report-json", "r.json"
    )
    assert process.returncode == -signal.SIGTERM, process.stdout + process.stderr
    document = json.loads((project.path / "r.json").read_text())
    assert document["signal"] == "SIGTERM"
    assert [t["nodeid"] for t in document["tests"]] == ["test_cuda.py::test_1_uses_cuda"]


CHAINED = """
import shutil, signal, sys

def _theirs(signum, frame):
    shutil.copy("r.json", "report-when-their-handler-ran.json")
    sys.exit(7)

signal.signal(signal.SIGTERM, _theirs)  # a conftest's own handler, installed before ours
"""

TERMINATES_ITSELF = """
import os, signal

def test_terminated():
    os.kill(os.getpid(), signal.SIGTERM)

def test_after():
    pass
"""


def test_sigterm_chains_to_the_handler_that_was_there_before(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CHAINED)
    pytester.makepyfile(test_it=TERMINATES_ITSELF)
    process = _run_own_session(pytester.path, "--ct-report-json", "r.json")
    # Ours ran first (the report existed when theirs ran), then theirs: its sys.exit fails
    # the test, the session goes on, and its end writes the report again, complete.
    snapshot = json.loads((pytester.path / "report-when-their-handler-ran.json").read_text())
    assert snapshot["signal"] == "SIGTERM"
    assert process.returncode == pytest.ExitCode.TESTS_FAILED
    assert json.loads((pytester.path / "r.json").read_text())["signal"] is None
    assert "1 failed, 1 passed" in process.stdout


def test_no_handler_without_a_json_report_and_the_previous_one_restored(
    pytester: pytest.Pytester,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    pytester.makepyfile(
        test_it="""
        import signal
        def test_handler():
            handler = signal.getsignal(signal.SIGTERM)
            name = getattr(handler, "__qualname__", repr(handler))
            print("HANDLER", name)
        """
    )
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*HANDLER *"])
    assert "SigtermReport" not in result.stdout.str()
    result = pytester.runpytest("-s", "--ct-report-json", "r.json")
    result.stdout.fnmatch_lines(["*HANDLER SigtermReport._handle"])
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_ignored_sigterm_stays_ignored(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_it="""
        import os, signal
        def test_survives():
            os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "--ct-report-json", "r.json"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
        timeout=300,
    )
    assert process.returncode == 0, process.stdout
    assert json.loads((pytester.path / "r.json").read_text())["signal"] is None


def test_a_sigterm_during_a_write_waits_for_the_file_to_be_whole() -> None:
    events: list[str] = []
    guard = SigtermReport(lambda: events.append("report"))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: events.append("previous"))
    try:
        assert guard.install()
        with guard.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs in this (the main) thread at its next check, which comes late
            # where another thread took the signal: wait until it has noted it.
            deadline = time.monotonic() + 60
            while not guard._pending:
                assert time.monotonic() < deadline, "the SIGTERM handler never ran"
                time.sleep(0.01)
            assert events == []  # only noted
            events.append("write done")
        assert events == ["write done", "report", "previous"]
        assert signal.getsignal(signal.SIGTERM) is not guard._handle  # given back
    finally:
        guard.restore()
        signal.signal(signal.SIGTERM, previous)


def test_a_folded_line_keeps_its_indent_when_its_first_word_is_wide() -> None:
    # A node id wider than the terminal stands on its own line, still indented as its list.
    nodeid = "tests/test_a_very_long_module_name.py::test_" + "x" * 60
    lines = summary_module.wrapped(f"  {nodeid}: needs 30.0 GiB VRAM; GPU 0 has 24.0 GiB", 60)
    assert lines[0] == f"  {nodeid}:"
    assert all(line.startswith("      ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == (
        f"{nodeid}: needs 30.0 GiB VRAM; GPU 0 has 24.0 GiB"
    )
