"""``--ct-snapshot`` on the CPU: the allocation sites read from a hand-built snapshot, the
file names, and the wiring through the fake CUDA seam (tests/fake_cuda.py), whose
``_record_memory_history`` and ``_snapshot`` trace the fake allocations with their frames.
The real recording is exercised on the GPU (tests/gpu/test_snapshots.py)."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest

from pytest_ctresources.gpu.measure import VramFigures
from pytest_ctresources.report.snapshot_sites import Site, alive_at_peak, allocated, top_sites
from pytest_ctresources.report.snapshots import MAX_STEM, file_name, reasons
from pytest_ctresources.settings.markers import VramNeed
from pytest_ctresources.settings.sources import Source
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

GIB = 1 << 30
SITE_PACKAGES = "/venv/lib/python3.11/site-packages"


def frame(filename: str, line: int, name: str) -> dict[str, object]:
    return {"filename": filename, "line": line, "name": name}


TORCH = frame(f"{SITE_PACKAGES}/torch/nn/functional.py", 2000, "linear")
CIRCUIT = frame(f"{SITE_PACKAGES}/circuit_tracer/attribution/attribute.py", 120, "attribute")
USER = frame("/home/me/proj/tests/test_big.py", 12, "test_big")
RUNNER = frame(f"{SITE_PACKAGES}/_pytest/python.py", 159, "pytest_pyfunc_call")
STDLIB = frame("/usr/lib/python3.11/runpy.py", 88, "_run_code")


def alloc(address: int, gib: float, *frames: dict[str, object]) -> dict[str, object]:
    return {"action": "alloc", "addr": address, "size": int(gib * GIB), "frames": list(frames)}


def free(address: int) -> dict[str, object]:
    return {"action": "free_completed", "addr": address, "size": 0}


def test_the_sites_alive_at_the_peak_name_the_users_line_and_the_librarys() -> None:
    events = [
        alloc(1, 2, TORCH, CIRCUIT, USER, RUNNER, STDLIB),
        alloc(2, 1, TORCH, CIRCUIT, USER, RUNNER),
        alloc(3, 0.5, USER, RUNNER),
        free(3),
        alloc(4, 0.25, frame("/home/me/proj/tests/test_big.py", 20, "test_big"), RUNNER),
        free(1),  # after the peak (3.5 GiB): not what matters
        alloc(5, 0.1, USER),
    ]
    alive, moment = alive_at_peak({"segments": [], "device_traces": [[], events]})
    assert moment == "at the peak"
    sites = top_sites(alive, root="/home/me/proj")
    assert sites == [
        Site(
            3 * GIB,
            2,
            "tests/test_big.py:12 (test_big)",
            "circuit_tracer/attribution/attribute.py:120 (attribute)",
        ),
        Site(GIB // 2, 1, "tests/test_big.py:12 (test_big)", None),
    ]
    assert sites[0].text() == (
        "3.00 GiB in 2 block(s) at tests/test_big.py:12 (test_big) via "
        "circuit_tracer/attribution/attribute.py:120 (attribute)"
    )
    assert sites[1].text() == "512 MiB in 1 block(s) at tests/test_big.py:12 (test_big)"


def test_an_oom_is_the_moment_and_without_a_trace_what_is_still_allocated() -> None:
    events = [alloc(1, 4, USER), free(1), alloc(2, 1, CIRCUIT), {"action": "oom", "size": GIB}]
    block = {"size": GIB, "state": "active_allocated", "frames": [USER]}
    snapshot = {
        "segments": [{"blocks": [block, {**block, "state": "inactive"}]}],
        "device_traces": [events],
    }
    alive, moment = alive_at_peak(snapshot)
    assert moment == "when it ran out of memory"
    assert top_sites(alive, limit=3) == [
        Site(GIB, 1, None, "circuit_tracer/attribution/attribute.py:120 (attribute)")
    ]
    assert alive_at_peak({**snapshot, "device_traces": [[]]}) == (
        allocated(snapshot),
        "still allocated",
    )
    assert top_sites(allocated(snapshot), limit=3) == [
        Site(GIB, 1, "/home/me/proj/tests/test_big.py:12 (test_big)", None)
    ]


def test_a_file_name_has_no_separator_a_bounded_length_and_is_unique() -> None:
    long_a = "tests/test_x.py::test_p[" + "a" * 300 + "-1]"
    long_b = "tests/test_x.py::test_p[" + "a" * 300 + "-2]"
    names = {file_name(nodeid) for nodeid in (long_a, long_b, "a/b.py::t", "a_b.py::t")}
    assert len(names) == 4
    for name in names:
        assert "/" not in name and "\\" not in name and "\0" not in name
        assert len(name) <= MAX_STEM + 20 and name.endswith(".pickle")
    assert file_name("tests/test_x.py::test_a[../../etc]").startswith("tests_test_x.py_test_a_.._")
    assert file_name("../..").startswith("test-")


def test_kept_for_an_oom_a_leak_or_going_over_the_declared_need_not_an_estimate() -> None:
    figures = VramFigures(0, 0, 3 * GIB, 3 * GIB, GIB)
    marker = VramNeed(2.0, Source.marker("vram", "t"))
    estimate = VramNeed(2.0, Source.estimate("x"))
    threshold = 256 << 20
    assert reasons(out_of_memory=True, figures=figures, need=marker, leak_threshold=threshold) == [
        "out of memory",
        "leak",
        "over its declared need",
    ]
    assert (
        reasons(out_of_memory=False, figures=figures, need=estimate, leak_threshold=2 * GIB) == []
    )
    assert reasons(out_of_memory=False, figures=None, need=marker, leak_threshold=0) == []


SUITE = """
import pytest
from conftest import FAKE

def test_passes():
    FAKE.alloc(1); FAKE.free(1)

LEAKED = []
def test_leaks():
    FAKE.alloc(0.5)  # line 9

@pytest.mark.vram(gib=1)
def test_over_need():
    FAKE.alloc(2)  # line 13
    FAKE.free(2)

def test_out_of_memory():
    FAKE.alloc(3)  # line 17
    try:
        FAKE.oom(8)
    finally:
        FAKE.free(3)

def test_recording_calls():
    assert FAKE.history_calls == EXPECTED
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA H200=139.8")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    return pytester


def suite(pytester: pytest.Pytester, expected: object) -> None:
    pytester.makepyfile(test_suite=SUITE.replace("EXPECTED", repr(expected)))


def test_off_by_default_records_nothing(project: pytest.Pytester) -> None:
    suite(project, [])
    result = project.runpytest("-p", "no:randomly", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=4, failed=1, warnings=1)
    result.stdout.no_fnmatch_line("*memory snapshot*")
    assert json.loads((project.path / "r.json").read_text())["snapshots"] == []
    assert not (project.path / "r-snapshots").exists()


def test_on_failure_keeps_the_three_findings_beside_the_json_report(
    project: pytest.Pytester,
) -> None:
    # Each test's recording starts at its setup and stops after its teardown.
    suite(project, ["all", None] * 4 + ["all"])
    result = project.runpytest(
        "-p", "no:randomly", "--ct-snapshot=on-failure", "--ct-report-json", "r.json"
    )
    result.assert_outcomes(passed=4, failed=1, warnings=1)
    folder = project.path / "r-snapshots"
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    kept = {
        "test_suite.py::test_leaks": "leak",
        "test_suite.py::test_over_need": "over its declared need",
        "test_suite.py::test_out_of_memory": "out of memory",
    }
    assert sorted(path.name for path in folder.iterdir()) == sorted(map(file_name, kept))
    for nodeid in kept:
        path = folder / file_name(nodeid)
        # A regular file, never a link, inside the private folder (0700): written as the
        # reports are (report/files.py's write_file).
        assert stat.S_ISREG(os.lstat(path).st_mode)
        assert "segments" in pickle.loads(path.read_bytes())
    entries = {
        e["nodeid"]: e for e in json.loads((project.path / "r.json").read_text())["snapshots"]
    }
    assert {nodeid: entry["why"] for nodeid, entry in entries.items()} == kept
    leak = entries["test_suite.py::test_leaks"]
    assert leak["file"] == str(folder / file_name("test_suite.py::test_leaks"))
    assert leak["moment"] == "at the peak"
    assert leak["sites"] == [
        {"bytes": GIB // 2, "blocks": 1, "user": "test_suite.py:9 (test_leaks)", "library": None}
    ]
    oom = entries["test_suite.py::test_out_of_memory"]
    assert oom["moment"] == "when it ran out of memory"
    assert oom["sites"][0]["user"] == "test_suite.py:17 (test_out_of_memory)"
    result.stdout.fnmatch_lines(
        [
            "memory snapshots: 3 test(s) (open in https://pytorch.org/memory_viz)",
            f"  test_suite.py::test_leaks (leak): {folder / file_name('test_suite.py::test_leaks')}",
            "      512 MiB in 1 block(s) at test_suite.py:9 (test_leaks) at the peak",
            "  test_suite.py::test_out_of_memory (out of memory): *",
            "      3.00 GiB in 1 block(s) at test_suite.py:17 (test_out_of_memory) when it ran "
            "out of memory",
            "  test_suite.py::test_over_need (over its declared need): *",
            "      2.00 GiB in 1 block(s) at test_suite.py:13 (test_over_need) at the peak",
        ]
    )


def test_always_keeps_every_test_in_the_named_directory(project: pytest.Pytester) -> None:
    suite(project, ["all", None] * 4 + ["all"])
    project.makeini("[pytest]\nct_snapshot = always\nct_snapshot_dir = snaps\n")
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=4, failed=1, warnings=1)
    names = {path.name for path in (project.path / "snaps").iterdir()}
    assert len(names) == 5
    assert file_name("test_suite.py::test_passes") in names
    result.stdout.fnmatch_lines(
        [
            "memory snapshots: 3 test(s)*",
            "memory snapshots of 2 other test(s) (--ct-snapshot always)",
        ]
    )


def test_passing_tests_leave_nothing_and_the_default_is_the_cache(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_SNAPSHOT", "on-failure")
    project.makepyfile(
        test_cache="from conftest import FAKE\n\ndef test_a():\n    FAKE.alloc(1); FAKE.free(1)\n\n"
        "def test_b():\n    FAKE.alloc(1)\n"
    )
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, warnings=1)
    folder = project.path / ".pytest_cache/d/ctresources-snapshots"
    nodeid = "test_cache.py::test_b"
    assert [path.name for path in folder.iterdir()] == [file_name(nodeid)]
    result.stdout.fnmatch_lines([f"  {nodeid} (leak): {folder / file_name(nodeid)}"])


LEAKS = "from conftest import FAKE\n\ndef test_b():\n    FAKE.alloc(1)\n"


@pytest.mark.parametrize("case", ["earlier-snapshot", "not-a-snapshot", "fifo-for-the-directory"])
def test_only_its_own_snapshot_is_replaced_and_a_bad_directory_is_a_warning(
    project: pytest.Pytester, case: str
) -> None:
    """A snapshot replaces an earlier one (a pickle of this user's) and nothing else: a file
    of another kind with its name is left as it is. A FIFO where the default directory goes
    (in pytest's cache) once errored every test's teardown with a traceback. Each is one
    warning, and the test's outcome is its own."""
    project.makepyfile(test_cache=LEAKS)
    folder = project.path / ".pytest_cache/d/ctresources-snapshots"
    path = folder / file_name("test_cache.py::test_b")
    folder.parent.mkdir(parents=True)
    if case == "fifo-for-the-directory":
        os.mkfifo(folder)
    else:
        folder.mkdir(mode=0o700)
        path.write_bytes(pickle.dumps("earlier") if case == "earlier-snapshot" else b"mine")
    result = project.runpytest("-p", "no:randomly", "--ct-snapshot=on-failure")
    output = result.stdout.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output
    if case == "earlier-snapshot":
        result.assert_outcomes(passed=1, warnings=1)  # (the leak's)
        assert "segments" in pickle.loads(path.read_bytes())
        return
    result.assert_outcomes(passed=1, warnings=2)
    result.stdout.fnmatch_lines(["*the memory snapshot of test_cache.py::test_b was not written*"])
    if case == "not-a-snapshot":
        assert "exists and is not a memory snapshot (a pickle)" in output
        assert path.read_bytes() == b"mine"
    else:
        assert stat.S_ISFIFO(os.lstat(folder).st_mode)


@pytest.mark.nbmake
def test_a_notebooks_kernel_snapshot_is_kept(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPU stand-in for a kernel that used CUDA (as in tests/test_notebooks.py): the kernel's
    # peak and its snapshot, written by hand where the start-up file would write them.
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    snapshot = {"segments": [], "device_traces": [[alloc(1, 5, USER)]]}
    nb = new_notebook(metadata={"ctresources": {"vram_gib": 1}})
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells.append(
        new_code_cell(
            "import json, os, pickle\n"
            "json.dump({'device': 0, 'peak_allocated_bytes': 5 * 2**30, "
            "'peak_reserved_bytes': 5 * 2**30}, open(os.environ['CT_NOTEBOOK_VRAM_FILE'], 'w'))\n"
            f"pickle.dump({snapshot!r}, open(os.environ['CT_NOTEBOOK_SNAPSHOT_FILE'], 'wb'))"
        )
    )
    nbformat.write(nb, pytester.path / "nb.ipynb")
    result = pytester.runpytest("--nbmake", "--ct-snapshot=on-failure", "--ct-report-json=r.json")
    result.assert_outcomes(passed=1, warnings=1)  # (this CPU process records nothing)
    path = pytester.path / "r-snapshots" / file_name("nb.ipynb::nb.ipynb")
    assert pickle.loads(path.read_bytes()) == snapshot
    (entry,) = json.loads((pytester.path / "r.json").read_text())["snapshots"]
    assert entry["why"] == "over its declared need"
    assert entry["sites"][0]["user"] == "/home/me/proj/tests/test_big.py:12 (test_big)"
    result.stdout.fnmatch_lines(["      5.00 GiB in 1 block(s) at /home/me/proj/tests/*"])


def test_under_xdist_workers_write_and_the_controller_reports(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_two="from conftest import FAKE\n\ndef test_a():\n    FAKE.alloc(1)\n\n"
        "def test_b():\n    FAKE.alloc(1); FAKE.free(1)\n"
    )
    result = project.runpytest("-n", "2", "--ct-snapshot=on-failure", "--ct-report-json=r.json")
    result.assert_outcomes(passed=2)
    folder = project.path / "r-snapshots"
    assert [path.name for path in folder.iterdir()] == [file_name("test_two.py::test_a")]
    (entry,) = json.loads((project.path / "r.json").read_text())["snapshots"]
    assert entry["sites"][0]["user"] == "test_two.py:4 (test_a)"
    result.stdout.fnmatch_lines(["  test_two.py::test_a (leak): *"])
