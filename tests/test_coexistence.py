"""The plugin beside other plugins: a suite that uses none of its features has the same
outcomes with the plugin on and off, serial and under ``-n 2``.

The suite exercises what the plugin's per-test work could break: a failed attempt that
pytest-rerunfailures runs again (outcome ``rerun``), a module-scoped yield fixture whose caught
exception a failure chains to (its suspended generator frame sits in the failure's traceback),
a figure a module-scoped fixture keeps open, a timeout marker, pytest-randomly's shuffling and
reseeding, coverage measurement, and pytest-html's report.
"""

from __future__ import annotations

import pytest

from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

SUITE = """
import pathlib
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def resource():
    try:
        raise KeyError("handled at setup")
    except KeyError as exc:
        caught = exc
    try:
        yield caught
    finally:
        (HERE / "teardowns.log").open("a").write("resource\\n")


@pytest.fixture(scope="module")
def dashboard():
    figure = plt.figure()
    yield figure
    plt.close(figure)


def test_passes(resource):
    assert isinstance(resource, KeyError)


def test_fails_chained_to_the_fixture(resource):
    raise AssertionError("boom") from resource


def test_fixture_still_set_up(resource):
    assert not (HERE / "teardowns.log").exists(), "the module fixture was torn down early"


def test_draws(dashboard):
    plt.figure()


def test_dashboard_still_open(dashboard):
    assert plt.fignum_exists(dashboard.number)


def test_flaky_fails_its_first_attempt():
    counter = HERE / "flaky.count"
    attempts = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(attempts + 1))
    assert attempts > 0, "first attempt"


@pytest.mark.timeout(60)
def test_with_a_timeout(tmp_path):
    (tmp_path / "x").write_text("x")


@pytest.mark.skip(reason="skipped on purpose")
def test_skipped():
    pass


@pytest.mark.xfail(reason="expected", strict=True)
def test_expected_failure():
    assert False


@pytest.mark.parametrize("n", range(4))
def test_parametrized(n):
    assert n < 3
"""

#: Each other plugin, switched on by its own options (pytest-randomly by not disabling it).
COMBINATIONS = {
    "rerunfailures": ["--reruns", "1"],
    "randomly": ["-p", "randomly", "--randomly-seed", "1234"],
    "timeout": ["--timeout", "120"],
    "cov": ["--cov", "test_suite", "--cov-report", "term"],
    # The plugin adds its VRAM columns and plot to pytest-html's report (report/html.py).
    "html": ["--html", "report.html"],
}


#: Plugins that must run in a process of their own: pytest-cov traces the whole process, and
#: pytest-timeout arms SIGALRM in it.
OWN_PROCESS = {"cov", "timeout"}


def _outcomes(
    pytester: pytest.Pytester, args: list[str], plugin: str
) -> tuple[int, dict[str, int]]:
    for leftover in ("flaky.count", "teardowns.log"):
        (pytester.path / leftover).unlink(missing_ok=True)
    run = pytester.runpytest_subprocess if plugin in OWN_PROCESS else pytester.runpytest
    result = run(*args)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    return int(result.ret), result.parseoutcomes()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
@pytest.mark.parametrize("plugin", sorted(COMBINATIONS))
def test_same_outcomes_with_the_plugin_on_and_off(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, plugin: str, workers: list[str]
) -> None:
    if plugin == "randomly":
        monkeypatch.delenv("PYTEST_ADDOPTS")  # the suite's pytester turns randomly off
    pytester.makepyfile(test_suite=SUITE)
    args = [*COMBINATIONS[plugin], *workers]
    on = _outcomes(pytester, args, plugin)
    off = _outcomes(pytester, [*args, "-p", "no:ctresources"], plugin)
    assert on == off
    expected = {"failed", "passed", "skipped", "xfailed"}
    assert expected <= set(on[1])
    if plugin == "rerunfailures":
        assert on[1].get("rerun", 0) >= 1


@pytest.mark.parametrize(
    ("marker", "args"),
    [("", ["--reruns", "2"]), ("@pytest.mark.flaky(reruns=2)", [])],
    ids=["option", "marker"],
)
def test_reruns_are_counted_and_the_final_attempt_recorded(
    pytester: pytest.Pytester, marker: str, args: list[str]
) -> None:
    pytester.makepyfile(
        test_flaky=f"""
        import pathlib
        import pytest
        HERE = pathlib.Path(__file__).parent

        {marker}
        def test_flaky(ct_config):
            from conftest import FAKE

            FAKE.alloc(0.25)  # some CUDA use, so that the test has a record with figures
            FAKE.free(0.25)
            counter = HERE / "flaky.count"
            attempts = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(attempts + 1))
            assert attempts > 0
        """
    )
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    result = pytester.runpytest(*args, "--ct-report-json", "report.json")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    result.stdout.fnmatch_lines(
        [
            "reruns (another plugin ran failed attempts again): 1 of 1 test(s); each is reported by its last attempt"
        ]
    )
    import json

    report = json.loads((pytester.path / "report.json").read_text())
    assert report["reruns"] == {"test_flaky.py::test_flaky": 1}
    # The record is the final attempt's: passed, not the first attempt's failure.
    (record,) = report["tests"]
    assert (record["nodeid"], record["outcome"]) == ("test_flaky.py::test_flaky", "passed")
