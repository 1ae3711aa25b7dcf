"""Per-test cleanup: figures, failed-test frames, gc; the allocator environment variable."""

from __future__ import annotations

import sys

import pytest

from pytest_ctresources import cleanup
from pytest_ctresources.allocator import AllocConf, memory_fraction

pytest_plugins = ["pytester"]

FIGURE_TESTS = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

def test_leaves_two_figures():
    plt.figure(); plt.figure()

def test_sees_none_left():
    assert plt.get_fignums() == []
"""


def test_open_figures_are_closed_and_counted_in_verbose(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_figs=FIGURE_TESTS)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "ctresources: closed 2 matplotlib figure(s) left open by test_figs.py::test_leaves_two_figures"
        ]
    )
    quiet = pytester.runpytest()
    assert "closed 2 matplotlib" not in quiet.stdout.str()


def test_cleanup_never_leaves_figures(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nct_cleanup = never\n")
    pytester.makepyfile(test_figs=FIGURE_TESTS)
    pytester.runpytest().assert_outcomes(passed=1, failed=1)


# pytest keeps a failed test's exception in sys.last_value until the *call* of the next test,
# so without the plugin the next test's setup (where models get loaded) still sees it.
FAILED_TEST_FRAMES = """
import gc, weakref
import pytest
import torch

REFS = []

def test_fails_holding_a_tensor():
    big = torch.ones(1024, 1024)
    REFS.append(weakref.ref(big))
    assert big.sum() == 0

@pytest.fixture
def loads_a_model():
    gc.collect()
    assert REFS[0]() is None, "the failed test's tensor is still alive at the next setup"

def test_next_setup_sees_it_gone(loads_a_model):
    pass
"""


@pytest.mark.parametrize(("mode", "released"), [("auto", True), ("always", True), ("never", False)])
def test_failed_test_traceback_does_not_keep_its_tensors(
    pytester: pytest.Pytester, mode: str, released: bool
) -> None:
    pytester.makeini(f"[pytest]\nct_cleanup = {mode}\n")
    pytester.makepyfile(test_frames=FAILED_TEST_FRAMES)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1, passed=1 if released else 0, errors=0 if released else 1)


def test_cleanup_python_cuda_collects_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cleanup.gc, "collect", lambda: calls.append("gc") or 0)
    cleanup.cleanup_python_cuda()
    assert calls == ["gc"]


class _FakeCuda:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def is_initialized(self) -> bool:
        return True

    def empty_cache(self) -> None:
        self.log.append("empty_cache")


def test_gc_runs_before_empty_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # The order matters: empty_cache can only return blocks whose tensors gc has freed.
    log: list[str] = []
    fake_torch = type(sys)("torch")
    fake_torch.cuda = _FakeCuda(log)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(cleanup.gc, "collect", lambda: log.append("gc") or 0)
    result = cleanup.cleanup_after_test("auto")
    assert log == ["gc", "empty_cache"]
    assert result.cuda_cache_emptied


def test_auto_without_cuda_does_not_collect(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(cleanup.gc, "collect", lambda: log.append("gc") or 0)
    assert cleanup.cleanup_after_test("auto") == cleanup.CleanupResult()
    assert log == []
    assert cleanup.cleanup_after_test("always").collected


def test_alloc_conf_setdefault_and_undo() -> None:
    env: dict[str, str] = {}
    conf = AllocConf("expandable_segments:True", env)
    conf.apply()
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    conf.undo()
    assert env == {}
    user = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    conf = AllocConf("expandable_segments:True", user)
    conf.apply()
    conf.undo()
    assert user == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    empty: dict[str, str] = {}
    AllocConf("", empty).apply()
    assert empty == {}


def test_memory_fraction() -> None:
    assert memory_fraction(24 << 30, 96 << 30) == 0.25
    assert memory_fraction(200 << 30, 96 << 30) is None


ALLOC_ENV_TEST = """
import os
def test_env():
    print("ALLOC", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
"""


@pytest.mark.parametrize(
    ("ini", "expected"),
    [
        ("", "expandable_segments:True"),
        ("ct_alloc_conf =", "None"),
        ("ct_alloc_conf = garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ],
)
def test_alloc_conf_reaches_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ini: str, expected: str
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_alloc=ALLOC_ENV_TEST)
    result = pytester.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines([f"*ALLOC {expected}"])


def test_alloc_conf_set_in_conftest_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Conftests run after pytest_load_initial_conftests: they already see the variable.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pytester.makeconftest(
        "import os\nprint('CONFTEST', os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
    )
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(["CONFTEST expandable_segments:True"])


def test_warning_when_cuda_was_initialised_before_configure(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU here: a conftest stands in a torch whose CUDA reports initialised, which is all
    # the plugin checks (it never initialises CUDA itself).
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pytester.makeconftest(
        """
        import sys, types
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(is_initialized=lambda: True, empty_cache=lambda: None)
        sys.modules["torch"] = torch
        """
    )
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        ["*AllocConfIneffectiveWarning: CUDA was initialised before pytest-ctresources configured*"]
    )


def test_capacity_cap_is_armed_when_torch_is_imported_later(pytester: pytest.Pytester) -> None:
    # A test that imports torch itself (not at collection) must still run capped: the plugin
    # imports torch at configure when --ct-vram-capacity is given (CUDA stays uninitialised).
    pytester.makepyfile(
        """
        import sys
        from pytest_ctresources.runtime import runtime_of

        def test_armed(request):
            cap = runtime_of(request.config).capacity_cap
            assert cap is not None and cap.armed
            import torch
            assert not torch.cuda.is_initialized()
        """
    )
    pytester.runpytest_subprocess("--ct-vram-capacity", "8").assert_outcomes(passed=1)
