"""Loading the plugin imports no heavy library; the plugin works under xdist."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

HEAVY = ("torch", "matplotlib", "circuit_tracer", "nnsight", "nbformat", "pynvml", "yaml")
# The plugin's own modules that a run of trivial tests has no use for, also in a project
# that asks (each would be a fixed cost of every run): ct_session and its estimate, the
# features that are off (snapshots, the regression check, notebooks under nbmake, the
# placement channel of xdist workers), and what only a measured test or an OOM needs.
UNUSED = (
    "pytest_ctresources.estimator",
    "pytest_ctresources.session.session",
    "pytest_ctresources.report.snapshot",
    "pytest_ctresources.core.regression",
    "pytest_ctresources.notebooks.items",
    "pytest_ctresources.notebooks.kernels",
    "pytest_ctresources.xdist.exchange",
    "pytest_ctresources.gpu.measure",
    "pytest_ctresources.gpu.oom",
)
# Nor, in a project that does not ask, what only a run the plugin acts in needs: the settings'
# resolution and what it checks (the experiment YAML, the report paths, the allocator
# setting), and the store of learned needs (pytester's projects have pytest's cache on, so the
# search for stale learned needs is registered).
UNUSED_UNLESS_ASKED = (
    "pytest_ctresources.settings.resolve",
    "pytest_ctresources.settings.experiment_yaml",
    "pytest_ctresources.settings.report_paths",
    "pytest_ctresources.gpu.allocator",
    "pytest_ctresources.core.learned",
)


@pytest.mark.parametrize(
    ("as_worker", "verbose"),
    [(False, False), (False, True), (True, False)],
    ids=["serial", "verbose", "worker"],
)
def test_a_run_that_does_not_use_the_plugin_imports_nothing_heavy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, as_worker: bool, verbose: bool
) -> None:
    # -v prints the GPU in the header: without NVML (this machine) it must not ask torch,
    # whose import costs seconds, for a project that never uses it.
    heavy = HEAVY
    if verbose:  # the header asks NVML (pynvml is light), never torch
        heavy = tuple(name for name in HEAVY if name != "pynvml")
    if as_worker:
        # In an xdist worker the plugin asks NVML for the host's GPUs to bind one (pynvml is
        # light), never torch. (A pytest started inside a worker inherits its environment.)
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
        heavy = tuple(name for name in HEAVY if name != "pynvml")
    pytester.makeconftest(
        f"""
        import sys
        def pytest_sessionfinish(session):
            loaded = [m for m in {heavy!r} if m in sys.modules]
            print("HEAVY:" + ",".join(loaded) + ":END")
            unused = [m for m in sys.modules if m.startswith({UNUSED!r})]
            print("UNUSED:" + ",".join(unused) + ":END")
            idle = [m for m in {UNUSED_UNLESS_ASKED!r} if m in sys.modules]
            print("IDLE:" + ",".join(idle) + ":END")
        """
    )
    pytester.makepyfile("def test_a(): pass")
    args = ["-s", "-p", "no:nbmake", *(["-v"] if verbose else [])]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*HEAVY::END*", "*UNUSED::END*", "*IDLE::END*"])
    if verbose:
        # Not asked, the header says so and nothing more; asked, it names the GPU, from
        # NVML, still without torch.
        result.stdout.fnmatch_lines(["ctresources: inactive (nothing in this project asks*"])
        asked = pytester.runpytest_subprocess(*args, "-o", "ct_cleanup=auto")
        asked.stdout.fnmatch_lines(
            [
                "ctresources: no CUDA GPU detected (NVML unavailable*",
                "*HEAVY::END*",
                "*UNUSED::END*",
            ]
        )


def test_options_and_fixtures_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_cfg(ct_config, i):
            assert ct_config.batch_size == 8
            assert str(ct_config.source_of("batch_size")) == "--ct-batch-size"

        @pytest.mark.vram(gib=100)
        def test_big(): pass
        """
    )
    result = pytester.runpytest_subprocess(
        "-n", "2", "--ct-config", "exp.yaml", "--ct-batch-size", "8", "-rs"
    )
    result.assert_outcomes(passed=4, skipped=1)
    result.stdout.fnmatch_lines(
        ["*ctresources summary*", "skipped for VRAM: 1 test(s)", "*test_big: needs 100.0 GiB VRAM*"]
    )
