"""The allocator variables: which one the plugin sets, and that it never sets one beside yours.

Environment variables are process state: each run is a subprocess, started without the
PYTORCH_CUDA_ALLOC_CONF that this suite's own pytest set.
"""

from __future__ import annotations

import pytest

from pytest_ctresources.gpu.allocator import ALLOC_CONF_ENV, AllocConf

pytest_plugins = ["pytester"]

SHOW_ENVIRONMENT = """
import os

def test_show():
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        print("ENV", name, os.environ.get(name, "(unset)"))
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_env=SHOW_ENVIRONMENT)
    # A project that asks for the plugin (settings/activation.py): only there is the
    # allocator default the plugin's to set.
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    return pytester


def test_the_default_is_set_under_the_name_every_torch_reads(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-v", "-s")
    result.stdout.fnmatch_lines(
        [
            "*PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (default)",
            "*ENV PYTORCH_CUDA_ALLOC_CONF expandable_segments:True",
            "*ENV PYTORCH_ALLOC_CONF (unset)",
        ]
    )


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_variable_is_respected_and_nothing_set_beside_it(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # torch reads PYTORCH_CUDA_ALLOC_CONF first: set beside PYTORCH_ALLOC_CONF, ours would win.
    monkeypatch.setenv(name, "max_split_size_mb:64")
    project.makeini("[pytest]\nct_alloc_conf = backend:native\n")
    result = project.runpytest_subprocess("-v", "-s")
    other = "PYTORCH_CUDA_ALLOC_CONF" if name == "PYTORCH_ALLOC_CONF" else "PYTORCH_ALLOC_CONF"
    result.stdout.fnmatch_lines(
        [
            f"*{name}=max_split_size_mb:64 (env {name})",
            f"*ENV {name} max_split_size_mb:64",
        ]
    )
    result.stdout.fnmatch_lines([f"*ENV {other} (unset)"])


def test_an_empty_ct_alloc_conf_sets_nothing(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nct_alloc_conf =\n")
    result = project.runpytest_subprocess("-v", "-s")
    result.stdout.fnmatch_lines(
        [
            "*PYTORCH_CUDA_ALLOC_CONF=(not set) (ini ct_alloc_conf in *tox.ini)",
            "*ENV PYTORCH_CUDA_ALLOC_CONF (unset)",
        ]
    )


def test_a_value_torch_would_reject_is_never_set() -> None:
    # Applied before conftests, when no error can be reported yet: it is left unset, and
    # the settings make it the usage error (tests/test_bad_inputs.py, ini-alloc-conf-*).
    environ: dict[str, str] = {}
    AllocConf("expandable_segment:True", environ).apply()
    assert environ == {}
    AllocConf("expandable_segments:True", environ).apply()
    assert environ == {ALLOC_CONF_ENV: "expandable_segments:True"}


def test_a_project_that_asks_only_through_a_test_gets_the_default_before_it_runs(
    project: pytest.Pytester,
) -> None:
    project.makeini("[pytest]\n")
    project.makepyfile(
        test_env="""
        import os

        def test_show(ct_config):
            print("ENV", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(unset)"))
        """
    )
    project.runpytest_subprocess("-s").stdout.fnmatch_lines(["*ENV expandable_segments:True"])


def test_a_project_that_does_not_ask_gets_no_default(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\n")
    project.runpytest_subprocess("-s").stdout.fnmatch_lines(
        ["*ENV PYTORCH_CUDA_ALLOC_CONF (unset)"]
    )
