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


#: Under xdist, plugins whose hazard is several workers (pytest-randomly's order must be
#: the same in each; pytest-cov combines the workers' data) run two; for the others one
#: worker is xdist's controller and worker paths, at half the processes.
SEVERAL_WORKERS = {"randomly", "cov"}


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
@pytest.mark.parametrize("plugin", sorted(COMBINATIONS))
def test_same_outcomes_with_the_plugin_on_and_off(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, plugin: str, xdist: bool
) -> None:
    if plugin == "randomly":
        # The suite's pytester turns randomly off (tests/conftest.py's OFF_IN_PROJECTS).
        monkeypatch.delenv("PYTEST_ADDOPTS")
    pytester.makepyfile(test_suite=SUITE)
    workers = ["-n", "2" if plugin in SEVERAL_WORKERS else "1"] if xdist else []
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
    result = pytester.runpytest(*args, "-v", "--ct-report-json", "report.json")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    result.stdout.fnmatch_lines(
        [
            "reruns (another plugin ran failed attempts again): 1 test(s) ran again, 1 attempt(s) in all; each is reported by its last"
        ]
    )
    import json

    report = json.loads((pytester.path / "report.json").read_text())
    assert report["reruns"] == {"test_flaky.py::test_flaky": 1}
    # The record is the final attempt's: passed, not the first attempt's failure.
    (record,) = report["tests"]
    assert (record["nodeid"], record["outcome"]) == ("test_flaky.py::test_flaky", "passed")


# --- Inert unless asked (settings/activation.py) ------------------------------------------------
#: The three ways a project can meet the plugin: it asks for it (here by one of its ini keys,
#: given with -o), it is installed and not asked, and it is not installed.
MODES = {
    "asked": ["-o", "ct_cleanup=auto"],
    "not-asked": [],
    "not-installed": ["-p", "no:ctresources"],
}


def _run_modes(
    pytester: pytest.Pytester, *args: str, subprocess: bool = False
) -> dict[str, pytest.RunResult]:
    run = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    return {mode: run(*extra, *args) for mode, extra in MODES.items()}


FRAGILE = """
class HalfBuilt:
    def __del__(self):
        raise RuntimeError("half-built")


def test_a_fails_holding_it():
    held = HalfBuilt()
    assert held is None


def test_b_next():
    pass


def test_c_last():
    pass
"""


def test_a_del_that_raises_never_errors_the_next_test(pytester: pytest.Pytester) -> None:
    # Under filterwarnings = error, a warning from a __del__ that the plugin's release of a
    # failed test's frames triggers must not land on the next test (which it errored).
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_fragile=FRAGILE)
    results = _run_modes(pytester, "-p", "no:cacheprovider", subprocess=True)
    baseline = results["not-installed"].parseoutcomes()
    assert baseline == {"failed": 1, "passed": 2}
    assert results["not-asked"].parseoutcomes() == baseline
    asked = results["asked"]
    outcomes = asked.parseoutcomes()
    assert outcomes.get("passed") == 2, asked.stdout.str()
    # Where the plugin acts, the warning lands on the test that made the object.
    asked.stdout.no_fnmatch_line("*ERROR at setup of test_b_next*")
    asked.stdout.fnmatch_lines(["*ERROR at teardown of test_a_fails_holding_it*"])


def test_a_projects_own_ct_properties_are_kept(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        def pytest_collection_modifyitems(items):
            for item in items:
                item.user_properties.append(("ct_series", "A"))
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("attempt", [1, 2])
        def test_keeps_its_property(request, attempt):
            assert ("ct_series", "A") in request.node.user_properties

        @pytest.mark.ct_config(batch_size=4)
        def test_asks_and_keeps_it(request):
            assert ("ct_series", "A") in request.node.user_properties
        """
    )
    for mode, result in _run_modes(pytester, "--junitxml", "junit.xml").items():
        assert result.parseoutcomes() == {"passed": 3}, (mode, result.stdout.str())


def test_the_plugin_adds_no_frame_to_other_projects_tracebacks(pytester: pytest.Pytester) -> None:
    # A decorated test (as matplotlib's image comparison makes) and a broken module fixture:
    # native tracebacks show every frame on the stack.
    pytester.makepyfile(
        """
        import functools
        import pytest

        def decorated(test):
            @functools.wraps(test)
            def wrapper(*args, **kwargs):
                return test(*args, **kwargs)
            return wrapper

        @decorated
        def test_decorated():
            assert False, "the project's own failure"

        @pytest.fixture(scope="module")
        def broken():
            raise ValueError("the project's broken fixture")

        def test_uses_it(broken):
            pass
        """
    )
    for style in ("native", "long"):
        for mode, result in _run_modes(pytester, f"--tb={style}").items():
            assert result.parseoutcomes() == {"failed": 1, "errors": 1}, mode
            # A project that asks has the plugin's hooks on the stack: pytest's own styles
            # hide them (__tracebackhide__), Python's native one shows every frame.
            if style == "long" or mode != "asked":
                assert "pytest_ctresources" not in result.stdout.str(), (style, mode)


def test_reruns_alone_print_no_summary_and_the_rerun_line_counts_right(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_flaky="""
        import pathlib
        import pytest
        HERE = pathlib.Path(__file__).parent

        def flaky(name, fails):
            counter = HERE / f"{name}.count"
            attempts = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(attempts + 1))
            assert attempts >= fails

        @pytest.mark.parametrize("name", ["a", "b", "c"])
        def test_flaky(name):
            flaky(name, 2 if name == "a" else 1)
        """
    )
    results = {}
    for mode, extra in MODES.items():
        for counter in pytester.path.glob("*.count"):
            counter.unlink()
        results[mode] = pytester.runpytest("--reruns", "2", *extra)
        assert results[mode].parseoutcomes() == {"passed": 3, "rerun": 4}, mode
    for result in results.values():
        result.stdout.no_fnmatch_line("*ctresources summary*")
    # Where tests the plugin acts for are run again, the line says tests and attempts.
    for counter in pytester.path.glob("*.count"):
        counter.unlink()
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(
        test_flaky="""
        import pathlib
        import pytest
        HERE = pathlib.Path(__file__).parent

        @pytest.mark.parametrize("name", ["a", "b", "c"])
        def test_flaky(ct_config, name):
            from conftest import FAKE

            FAKE.alloc(0.25)
            FAKE.free(0.25)
            counter = HERE / f"{name}.count"
            attempts = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(attempts + 1))
            assert attempts >= (2 if name == "a" else 1)
        """
    )
    result = pytester.runpytest("--reruns", "2", "-v")
    assert result.parseoutcomes() == {"passed": 3, "rerun": 4}
    result.stdout.fnmatch_lines(
        [
            "reruns (another plugin ran failed attempts again): 3 test(s) ran again, 4 "
            "attempt(s) in all; each is reported by its last"
        ]
    )


ENVIRONMENT_PROBE = """
import json
import os
import pathlib
import subprocess
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def test_environment_and_child(request):
    mode = request.config.getoption("--mode")
    child = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        capture_output=True, text=True, check=True,
    )
    pathlib.Path(f"env-{mode}.json").write_text(
        json.dumps({"test": dict(os.environ), "child": json.loads(child.stdout)})
    )


def test_leaves_a_figure_open():
    plt.figure()


def test_figure_still_open():
    assert plt.get_fignums()
"""


def test_a_project_that_does_not_ask_sees_no_difference(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This suite's own run asks for the plugin (pyproject's ct_notebook_configs): its
    # allocator default is in the environment every pytester process inherits.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pytester.makeconftest(
        """
        def pytest_addoption(parser):
            parser.addoption("--mode")
        """
    )
    pytester.makepyfile(test_probe=ENVIRONMENT_PROBE)
    outputs = {}
    for mode, extra in MODES.items():
        result = pytester.runpytest_subprocess(
            *extra,
            "--mode",
            mode,
            "-v",
            "--junitxml",
            f"junit-{mode}.xml",
            "-p",
            "no:cacheprovider",
        )
        outputs[mode] = result
    import json
    import re

    env = {mode: json.loads((pytester.path / f"env-{mode}.json").read_text()) for mode in MODES}
    assert env["not-asked"] == env["not-installed"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env["not-asked"]["child"]
    assert env["asked"]["test"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"

    def junit(mode: str) -> str:
        text = (pytester.path / f"junit-{mode}.xml").read_text()
        return re.sub(r'(time|timestamp|hostname)="[^"]*"', "", text)

    assert junit("not-asked") == junit("not-installed")
    assert "ct_figures_closed" in junit("asked")
    # Not asked: the figure stays open, as without the plugin; asked, the cleanup closed it.
    assert outputs["not-asked"].parseoutcomes() == {"passed": 3}
    assert outputs["asked"].parseoutcomes() == {"passed": 2, "failed": 1}
    outputs["not-asked"].stdout.fnmatch_lines(
        ["ctresources: inactive (nothing in this project asks for it)*"]
    )
    outputs["asked"].stdout.fnmatch_lines(["ctresources: active (-o ct_cleanup asks for it)"])
    assert "ctresources summary" not in outputs["not-asked"].stdout.str()


def test_pytest_html_reports_of_a_project_that_does_not_ask_are_unchanged(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        def test_one():
            pass

        def test_two():
            assert 1
        """
    )
    sizes = {}
    for mode, extra in MODES.items():
        result = pytester.runpytest(*extra, "--html", f"{mode}.html", "--self-contained-html")
        assert result.parseoutcomes() == {"passed": 2}
        text = (pytester.path / f"{mode}.html").read_text()
        sizes[mode] = len(text)
        if mode != "asked":
            assert "VRAM" not in text, mode
    assert abs(sizes["not-asked"] - sizes["not-installed"]) <= 0.02 * sizes["not-installed"]
    # Asked, with no test that used CUDA: no picture ("No CUDA data").
    asked = (pytester.path / "asked.html").read_text()
    assert "ctresources-vram-plot" not in asked


@pytest.mark.parametrize(
    "args", [["--ct-shard", "1/2"], ["--ct-plan-workers", "2"], ["--ct-report"]]
)
def test_every_option_of_the_plugin_asks_for_it(pytester: pytest.Pytester, args: list[str]) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-v", *args)
    result.stdout.fnmatch_lines([f"ctresources: active ({args[0]} asks for it)"])
