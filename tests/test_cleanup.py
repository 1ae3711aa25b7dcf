"""Per-test cleanup: figures, failed-test frames, gc; the allocator environment variable."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from pytest_ctresources.gpu import cleanup
from pytest_ctresources.gpu import cleanup_between_tests as between
from pytest_ctresources.gpu.allocator import AllocConf, memory_fraction
from tests.conftest import TINY_YAML
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def asks_for_the_plugin(request: pytest.FixtureRequest) -> None:
    """Every project of these tests asks for the plugin (one ini key): its cleanup acts only
    where asked (settings/activation.py). A test that writes its own ini replaces this one;
    tests/test_coexistence.py runs projects that do not ask."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester").makeini("[pytest]\nct_cleanup = auto\n")


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


WIDER_SCOPE_FIGURES = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

@pytest.fixture(scope="module")
def dashboard():
    yield plt.figure()

@pytest.fixture
def scratch():
    plt.figure()

def test_one(dashboard, scratch):
    plt.figure()

def test_two(dashboard):
    assert plt.fignum_exists(dashboard.number), "the module fixture's figure was closed"
    assert plt.get_fignums() == [dashboard.number]
"""


def test_only_the_figures_a_test_opened_are_closed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_figs=WIDER_SCOPE_FIGURES)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["ctresources: closed 2 matplotlib figure(s) left open by test_figs.py::test_one"]
    )


def test_a_figure_number_a_closed_module_figure_had_is_the_tests_own(
    pytester: pytest.Pytester,
) -> None:
    # matplotlib reuses the number of a closed figure: once the module fixture's figure is
    # gone, figure 1 in another module is that test's own, and closed after it.
    # The run is in-process: figure numbers start at 1 only if this worker has none open
    # (figures another test opened before this one are not this test's, so they stay).
    import matplotlib.pyplot as plt

    plt.close("all")
    head = (
        'import matplotlib\nmatplotlib.use("Agg")\nimport matplotlib.pyplot as plt\nimport pytest\n'
    )
    pytester.makepyfile(
        test_a=head
        + "@pytest.fixture(scope='module')\ndef board():\n    f = plt.figure()\n    yield f\n"
        "    plt.close(f)\n\ndef test_uses(board):\n    assert board.number == 1\n",
        test_b=head + "def test_opens():\n    assert plt.figure().number == 1\n\n"
        "def test_after():\n    assert plt.get_fignums() == []\n",
    )
    pytester.runpytest().assert_outcomes(passed=3)


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
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, passed=1 if released else 0, errors=0 if released else 1)


# A fixture of module scope keeps an exception it caught at setup; a failing test chains to it.
# That exception's traceback holds the fixture's suspended generator frame: clearing it would
# finalise the generator, running the fixture's teardown in the middle of the module.
SUSPENDED_FIXTURE = """
import pytest

EVENTS = []

@pytest.fixture(scope="module")
def resource():
    try:
        raise KeyError("handled at setup")
    except KeyError as exc:
        caught = exc
    try:
        yield caught
    finally:  # runs when the generator is finalised, too
        EVENTS.append("teardown")

def test_fails(resource):
    raise AssertionError("boom") from resource

def test_still_set_up(resource):
    assert EVENTS == [], "the module fixture was torn down after the first test"
"""


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_a_failure_never_finalises_a_suspended_fixture(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makeini(f"[pytest]\nct_cleanup = {mode}\n")
    pytester.makepyfile(test_fixture=SUSPENDED_FIXTURE)
    pytester.runpytest().assert_outcomes(failed=1, passed=1)


# Stands for a tensor on the GPU caught in a reference cycle: only a collection frees it. The
# automatic collector is off in this project, so only the plugin's cleanup can collect it.
GARBAGE_CYCLE = """
import gc, weakref
import pytest
from conftest import FAKE

REFS = []

class Holder:
    def __init__(self, gib):
        FAKE.alloc(gib)
        self.gib = gib
        self.me = self

    def __del__(self):
        FAKE.free(self.gib)

@pytest.fixture(scope="session", autouse=True)
def no_automatic_collections():
    gc.disable()
    yield
    gc.enable()

def test_leaves_a_cycle_holding_cuda_memory():
    REFS.append(weakref.ref(Holder(1.0)))

@pytest.fixture
def next_setup():
    assert REFS[0]() is None, "the cycle is still alive at the next test's setup"
    assert FAKE.allocated == 0, "its memory is still allocated"

def test_next(next_setup):
    pass
"""


@pytest.mark.parametrize(("mode", "freed"), [("auto", True), ("never", False)])
def test_a_cycle_holding_cuda_memory_is_freed_before_the_next_setup(
    pytester: pytest.Pytester, mode: str, freed: bool
) -> None:
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makeini(f"[pytest]\nct_cleanup = {mode}\n")
    pytester.makepyfile(test_cycle=GARBAGE_CYCLE)
    result = pytester.runpytest("-W", "ignore::pytest_ctresources.exceptions.CtLeakWarning")
    result.assert_outcomes(passed=2 if freed else 1, errors=0 if freed else 1)


# The same after a test that swapped ct_session's resident model for a smaller one: the
# evicted model no longer counts in the baseline, so the cycle still shows as memory beyond it.
GARBAGE_AFTER_A_MODEL_SWAP = """
import gc, weakref
import pytest
from conftest import FAKE
import pytest_ctresources.session.cache as session_module

SIZES = {"big/model": 9, "small/model": 2}
REFS = []

class Model:
    def __init__(self, gib):
        FAKE.alloc(gib)
        self.gib = gib

    def __del__(self):
        FAKE.free(self.gib)

class Holder(Model):
    def __init__(self, gib):
        super().__init__(gib)
        self.me = self

def build(cfg, device):
    return Model(SIZES[cfg.model_name])

@pytest.fixture(autouse=True)
def stand_in_builder(monkeypatch):
    monkeypatch.setattr(session_module, "build_model", build)

@pytest.fixture(scope="session", autouse=True)
def no_automatic_collections():
    gc.disable()
    yield
    gc.enable()

@pytest.mark.ct_config(model_name="big/model")
def test_loads_the_big_model(ct_session):
    ct_session.load_model(device="cuda")

@pytest.mark.ct_config(model_name="small/model")
def test_swaps_it_and_leaves_a_cycle(ct_session):
    ct_session.load_model(device="cuda")
    REFS.append(weakref.ref(Holder(1.0)))

@pytest.fixture
def next_setup():
    assert REFS[0]() is None, "the cycle is still alive at the next test's setup"

def test_next(next_setup):
    pass
"""


def test_a_cycle_is_freed_after_a_test_that_swapped_the_resident_model(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_swap=GARBAGE_AFTER_A_MODEL_SWAP)
    result = pytester.runpytest(
        "--ct-config", "exp.yaml", "-W", "ignore::pytest_ctresources.exceptions.CtLeakWarning"
    )
    result.assert_outcomes(passed=3)


# Under ct_cleanup = always, CPU garbage too is collected after every test, in whichever
# generation it sits: the first test's included (nothing of it may be frozen for the run).
OLD_CPU_GARBAGE = """
import gc, weakref

REFS = []

class Node:
    pass

def test_leaves_a_cycle_in_the_oldest_generation():
    node = Node()
    node.me = node
    REFS.append(weakref.ref(node))
    gc.collect()  # alive here: it survives into the oldest generation, then becomes garbage

def test_next():
    assert REFS[0]() is None, "the first test's cycle is still alive"
"""


def test_always_collects_the_first_tests_old_garbage(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nct_cleanup = always\n")
    pytester.makepyfile(test_old=OLD_CPU_GARBAGE)
    pytester.runpytest().assert_outcomes(passed=2)


def test_cleanup_python_cuda_collects_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cleanup.gc, "collect", lambda: calls.append("gc") or 0)
    cleanup.cleanup_python_cuda()
    assert calls == ["gc"]


class _FakeCuda:
    """torch.cuda as the cleanup reads it: allocated and reserved bytes, empty_cache."""

    def __init__(self, log: list[str], allocated: int = 0, reserved: int = 0) -> None:
        self.log = log
        self.allocated = allocated
        self.reserved = reserved

    def is_initialized(self) -> bool:
        return True

    def memory_stats_as_nested_dict(self, device: object = None) -> dict[str, Any]:
        return {
            "allocated_bytes": {"all": {"current": self.allocated}},
            "reserved_bytes": {"all": {"current": self.reserved}},
        }

    def empty_cache(self) -> None:
        self.log.append("empty_cache")
        self.reserved = self.allocated


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple[_FakeCuda, list[str]]:
    log: list[str] = []
    cuda = _FakeCuda(log)
    fake_torch = type(sys)("torch")
    fake_torch.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(between.gc, "collect", lambda generation=2: log.append("gc") or 0)
    monkeypatch.setattr(cleanup.gc, "collect", lambda generation=2: log.append("gc") or 0)
    return cuda, log


def _finish(cleaner: between.BetweenTests, beyond: int | None, resident: int = 0) -> None:
    cleaner.finish(cleaner.begin(0), lambda: beyond, resident)


def test_gc_runs_before_empty_cache(fake_cuda: tuple[_FakeCuda, list[str]]) -> None:
    # The order matters: empty_cache can only return blocks whose tensors gc has freed.
    cuda, log = fake_cuda
    cuda.reserved = 1 << 30
    cleanup.cleanup_python_cuda()
    assert log == ["gc", "empty_cache"]


def test_a_test_that_left_nothing_costs_no_collection(
    fake_cuda: tuple[_FakeCuda, list[str]],
) -> None:
    cuda, log = fake_cuda
    cuda.reserved = 2 << 20  # a small test's cached segment: not worth a device sync
    _finish(between.BetweenTests("auto"), beyond=0)
    assert log == []


def test_garbage_holding_cuda_memory_is_collected_then_the_cache_returned(
    fake_cuda: tuple[_FakeCuda, list[str]],
) -> None:
    cuda, log = fake_cuda
    cuda.reserved = 1 << 30
    _finish(between.BetweenTests("auto"), beyond=256 << 20)
    assert log == ["gc", "empty_cache"]


def test_a_model_the_test_made_resident_is_no_garbage(
    fake_cuda: tuple[_FakeCuda, list[str]],
) -> None:
    _cuda, log = fake_cuda
    _finish(between.BetweenTests("auto"), beyond=9 << 30, resident=9 << 30)
    assert log == []
    _finish(between.BetweenTests("auto"), beyond=(9 << 30) + (1 << 20), resident=9 << 30)
    assert log == ["gc"]


class _Mediator:
    """Stands in for nnsight's ``Mediator``: a mediator thread's first argument."""


def _pyplot_with(monkeypatch: pytest.MonkeyPatch, figures: list[int]) -> None:
    pyplot = type(sys)("matplotlib.pyplot")
    pyplot.get_fignums = lambda: list(figures)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)


def test_nothing_to_do_with_pyplot_loaded_asks_for_open_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A suite that imported pyplot keeps the shortcut for a test that left no figure open,
    # and loses it for one that did.
    monkeypatch.delitem(sys.modules, "nnsight.intervention.interleaver", raising=False)
    cleaner = between.BetweenTests("auto")
    figures: list[int] = []
    _pyplot_with(monkeypatch, figures)
    start = cleaner.begin(0)
    assert cleaner.nothing_to_do(start)
    figures.append(1)
    assert not cleaner.nothing_to_do(start)
    assert not cleaner.nothing_to_do(cleaner.begin(0))  # open before the test: not ours to skip


def test_nothing_to_do_with_nnsight_loaded_asks_for_a_live_mediator_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _pyplot_with(monkeypatch, [])
    interleaver = type(sys)("nnsight.intervention.interleaver")
    interleaver.Mediator = _Mediator  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nnsight.intervention.interleaver", interleaver)
    cleaner = between.BetweenTests("auto")
    start = cleaner.begin(0)
    assert cleaner.nothing_to_do(start)  # loaded, but no trace left a thread
    release = threading.Event()
    thread = threading.Thread(target=lambda mediator: release.wait(), args=(_Mediator(),))
    thread.start()
    try:
        assert not cleaner.nothing_to_do(start)  # a mediator thread: finish must look
    finally:
        release.set()
        thread.join()
    assert cleaner.nothing_to_do(start)


def test_auto_without_cuda_does_not_collect_and_always_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(
        between.gc, "collect", lambda generation=2: log.append(f"gc{generation}") or 0
    )
    _finish(between.BetweenTests("auto"), beyond=None)
    assert log == []
    if between.gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    always = between.BetweenTests("always")
    try:
        # What exists before the first test is frozen at its start; every collection is full
        # (the first test's garbage included) and costs what the tests allocated since.
        always.begin(0)
        assert between.gc.get_freeze_count() > 0
        _finish(always, beyond=None)
        _finish(always, beyond=None)
    finally:
        always.close()
    assert log == ["gc2", "gc2"]
    assert between.gc.get_freeze_count() == 0


def test_a_slow_collection_freezes_the_long_lived_and_close_unfreezes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if __import__("gc").get_freeze_count():
        pytest.skip("something in this process froze objects already")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(between, "POLICY", between.CleanupPolicy(freeze_after_s=0.0))
    cleaner = between.BetweenTests("always")
    try:
        _finish(cleaner, beyond=None)
        assert between.gc.get_freeze_count() > 0
    finally:
        cleaner.close()
    assert between.gc.get_freeze_count() == 0


def test_a_watcher_eviction_that_leaves_gc_unfrozen_makes_the_cleaner_freeze_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model cache, freeing an idle model from the lease watcher's thread, unfreezes the
    collector and leaves it so; it counts that, and the between-test cleanup that froze
    before reads the count and freezes again at its next collection."""
    from pytest_ctresources.session.cache import ModelCache

    gc = between.gc
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    cache = ModelCache()
    cleaner = between.BetweenTests("auto", lambda: cache.unfreezes)
    try:
        cleaner._freeze()
        cache._model, cache._key = object(), ("a model",)  # resident, used by no test
        cache.evict_if_idle()
        assert (cache.unfreezes, gc.get_freeze_count()) == (1, 0)
        cleaner._collect(between.POLICY, lambda: False, needs_full=False)
        assert gc.get_freeze_count() > 0, "the cleaner froze again"
    finally:
        cleaner.close()
        gc.unfreeze()


def test_collect_everything_reaches_frozen_garbage() -> None:
    import gc
    import weakref

    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")

    class Node:
        pass

    node = Node()
    node.self = node  # type: ignore[attr-defined]  # a reference cycle
    ref = weakref.ref(node)
    gc.freeze()
    try:
        del node
        gc.collect()
        assert ref() is not None, "a frozen cycle survives a plain collection"
        cleanup.collect_everything()
        assert ref() is None
    finally:
        gc.unfreeze()


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
        ("ct_cleanup = auto", "expandable_segments:True"),
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
    result = pytester.runpytest_subprocess("-s", "-o", "ct_cleanup=auto")
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
        from pytest_ctresources.core.runtime import runtime_of

        def test_armed(request):
            cap = runtime_of(request.config).capacity_cap
            assert cap is not None and cap.armed
            import torch
            assert not torch.cuda.is_initialized()
        """
    )
    pytester.runpytest_subprocess("--ct-vram-capacity", "8").assert_outcomes(passed=1)


def test_safe_clean_cuda_without_cuda_says_so_in_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here (the GPU suite covers safe_clean_cuda)")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"^safe_clean_cuda: CUDA is not available \(torch "):
        with cleanup.safe_clean_cuda(model):
            pass
    assert next(model.parameters()).device.type == "cpu"  # untouched


def test_a_stand_in_pyplot_is_no_figures(pytester: pytest.Pytester) -> None:
    """A project that puts a stand-in for pyplot in ``sys.modules`` (a Mock, a module of its
    own): the cleanup once errored every test from its own code (``get_fignums``)."""
    pytester.makeconftest(
        "import sys, types\nfrom unittest import mock\n"
        "sys.modules['matplotlib.pyplot'] = mock.Mock()\n"
    )
    pytester.makepyfile(
        test_it="import sys, types\n\ndef test_a():\n    pass\n\n"
        "def test_b():\n    sys.modules['matplotlib.pyplot'] = types.ModuleType('pyplot')\n\n"
        "def test_c():\n    pass\n"
    )
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=3)
