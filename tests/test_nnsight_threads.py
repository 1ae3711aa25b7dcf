"""An OOM inside circuit-tracer's nnsight trace leaves an intervention thread blocked for
good, holding the attribution's tensors; ``nnsight_threads`` frees it (``ct_session``'s OOM retry
depends on it: on a GPU the thread held about 10 GiB per OOM)."""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("circuit_tracer")

from pytest_ctresources import testing  # noqa: E402
from pytest_ctresources.gpu import oom  # noqa: E402
from pytest_ctresources.gpu.nnsight_threads import release_nnsight_threads, release_quietly  # noqa: E402
from pytest_ctresources.session.session import CtSession  # noqa: E402
from pytest_ctresources.settings.config import CircuitTracerConfig  # noqa: E402

PROMPT = "the capital of france is paris and the capital of italy is"

pytest_plugins = ["pytester"]


def mediator_threads(leaving: int = 0) -> list[str]:
    """nnsight's intervention threads still alive once no more than ``leaving`` of them are:
    a thread that is finishing is waited for (up to a minute, for a loaded machine), one that
    stays blocked is counted as soon as only ``leaving`` are left."""
    deadline = time.monotonic() + 60
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("Mediator")]
        if len(alive) <= leaving or time.monotonic() > deadline:
            return [t.name for t in alive]
        alive[-1].join(0.05)  # returns at once when it ends


def attribution_contexts() -> int:
    from circuit_tracer.attribution.context_nnsight import AttributionContext

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        return sum(isinstance(obj, AttributionContext) for obj in gc.get_objects())


@pytest.fixture(scope="module")
def model() -> Any:
    return testing.build_replacement_model(testing.TINY_GEMMA2_DIMS, device="cpu")


@pytest.fixture
def oom_from_batch_64(model: Any) -> Iterator[None]:
    """An OOM raised in layer 1's MLP forward for batches of 64 or more: where a real one
    strikes, while circuit-tracer's residual-caching invoke waits at its barrier."""
    mlp = model._module.get_submodule("model.layers.1.mlp")
    original = mlp.__nnsight_forward__

    def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        if args and args[0].shape[0] >= 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(module, *args, **kwargs)

    mlp.__nnsight_forward__ = forward
    yield
    mlp.__nnsight_forward__ = original
    release_nnsight_threads()


def test_an_oom_in_the_trace_leaves_a_blocked_thread_that_release_frees(
    model: Any, oom_from_batch_64: None
) -> None:
    from circuit_tracer import attribute

    assert not mediator_threads()
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        attribute(PROMPT, model, batch_size=64, verbose=False)
    exc = caught.value
    del caught
    from pytest_ctresources.gpu.cleanup import clear_exception_frames

    clear_exception_frames(exc)
    del exc
    # nnsight 0.6.1 (the pinned version): the frames are cleared, and still the thread and
    # the AttributionContext with its batch-sized caches stay.
    assert len(mediator_threads(leaving=1)) == 1
    assert attribution_contexts() == 1

    # A released thread counts once it has ended: on a loaded machine that may take longer
    # than the cleanup's default wait of a second (join returns as soon as it ends).
    assert release_nnsight_threads(model, timeout=60) == 1
    assert not mediator_threads()
    assert attribution_contexts() == 0
    # Nothing left to release; attribution still works afterwards and leaves no thread.
    assert release_nnsight_threads(model) == 0
    graph = attribute(PROMPT, model, batch_size=16, verbose=False)
    assert len(graph.selected_features) > 0
    assert not mediator_threads()


def test_ct_session_retry_frees_the_failed_attempt_entirely(
    model: Any, oom_from_batch_64: None
) -> None:
    cfg = CircuitTracerConfig.defaults().layered(
        {"batch_size": 128}, CircuitTracerConfig.defaults().source_of("batch_size")
    )
    session = CtSession(cfg, oom_retry=True)
    graph = session.attribute(PROMPT, model)
    assert [(h.failed_batch_size, h.next_batch_size) for h in session.halvings] == [
        (128, 64),
        (64, 32),
    ]
    assert len(graph.selected_features) > 0
    assert not mediator_threads()
    del graph
    assert attribution_contexts() == 0


def test_release_only_touches_the_given_models_threads(
    model: Any, oom_from_batch_64: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from circuit_tracer import attribute

    from pytest_ctresources.gpu import nnsight_threads

    # oom.release waits the cleanup's default second for the thread to end: longer here, as
    # above, for a loaded machine.
    monkeypatch.setattr(
        nnsight_threads,
        "release_nnsight_threads",
        functools.partial(release_nnsight_threads, timeout=60),
    )

    with pytest.raises(torch.cuda.OutOfMemoryError):
        attribute(PROMPT, model, batch_size=64, verbose=False)

    class Other:
        _interleaver = object()

    assert release_nnsight_threads(Other()) == 0
    assert len(mediator_threads(leaving=1)) == 1
    assert oom.release(RuntimeError("any"), model) == 1
    assert not mediator_threads()


def test_release_is_a_no_op_without_nnsight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "nnsight.intervention.interleaver", raising=False)
    assert release_nnsight_threads() == 0
    assert release_quietly() == 0


def test_an_unknown_nnsight_counts_as_nothing_released(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        Mediator = type("Mediator", (), {})

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("internals changed")

    monkeypatch.setitem(sys.modules, "nnsight.intervention.interleaver", Broken())
    with pytest.raises(RuntimeError):
        release_nnsight_threads()
    assert release_quietly() == 0


def test_a_trace_running_in_another_thread_is_left_alone(model: Any) -> None:
    from circuit_tracer import attribute

    mlp = model._module.get_submodule("model.layers.1.mlp")
    original = mlp.__nnsight_forward__
    inside, go_on = threading.Event(), threading.Event()

    def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        inside.set()
        go_on.wait()  # set by the test, or by its finally block
        return original(module, *args, **kwargs)

    results: list[Any] = []
    mlp.__nnsight_forward__ = forward
    try:
        worker = threading.Thread(
            target=lambda: results.append(
                attribute(PROMPT, model, batch_size=16, max_feature_nodes=16, verbose=False)
            )
        )
        worker.start()
        assert inside.wait(60)
        # Its mediators wait for values the paused forward pass will give: not orphans.
        assert release_nnsight_threads() == 0
        assert release_nnsight_threads(model) == 0
        go_on.set()
        worker.join(300)
    finally:
        go_on.set()
        mlp.__nnsight_forward__ = original
    assert len(results) == 1 and len(results[0].selected_features) > 0
    assert not mediator_threads()


def test_auto_and_the_retry_after_an_oom_in_the_trace(
    model: Any, oom_from_batch_64: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_ctresources.estimator import auto as autobatch

    # auto as on a roomy GPU: the choice (its setup pass handed to the first attempt) takes
    # every active feature in one pass; the forward pass then runs out of memory.
    monkeypatch.setattr(autobatch, "_device_of", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    # What auto also reads there: this process's cache, the device's free memory, the peak.
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    cfg = CircuitTracerConfig.defaults().layered(
        {"batch_size": "auto", "max_feature_nodes": 128},
        CircuitTracerConfig.defaults().source_of("batch_size"),
    )
    session = CtSession(cfg, oom_retry=True, auto_budget=autobatch.Budget(8.0, "fake", 0.05))
    graph = session.attribute(PROMPT, model)
    (choice,) = session.auto_choices
    assert choice.batch_size >= 64
    assert session.halvings and session.halvings[-1].next_batch_size < 64
    assert len(graph.selected_features) > 0
    assert "setup_attribution" not in vars(model)
    assert not mediator_threads()
    del graph
    assert attribution_contexts() == 0


CAUGHT_OOM_PROJECT = """
import os
import threading
import time

import pytest
import torch

from pytest_ctresources import testing

PROMPT = "the capital of france is paris and the capital of italy is"


@pytest.fixture(scope="module")
def model():
    return testing.build_replacement_model(testing.TINY_GEMMA2_DIMS, device="cpu")


def test_catches_an_oom_itself(model):
    from circuit_tracer import attribute

    mlp = model._module.get_submodule("model.layers.1.mlp")
    original = mlp.__nnsight_forward__

    def forward(module, *args, **kwargs):
        if args and args[0].shape[0] >= 8:  # the batched forward pass, not the setup's
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(module, *args, **kwargs)

    mlp.__nnsight_forward__ = forward
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            attribute(PROMPT, model, batch_size=8, verbose=False)
    finally:
        mlp.__nnsight_forward__ = original
    stuck = [t for t in threading.enumerate() if t.name.startswith("Mediator")]
    for thread in stuck:
        thread.join(0.5)
    assert any(t.is_alive() for t in stuck)  # nnsight 0.6.1 leaves one blocked


def test_next_test_finds_none(model):
    stuck = [t for t in threading.enumerate() if t.name.startswith("Mediator")]
    for thread in stuck:
        # Returns as soon as a released thread ends, however loaded the machine; one never
        # released (ct_cleanup=never) stays blocked for good, so a short wait shows it.
        thread.join(float(os.environ["RELEASE_WAIT_S"]))
    assert not [t.name for t in stuck if t.is_alive()]
"""


@pytest.mark.parametrize("cleanup", ["auto", "never"])
def test_cleanup_after_a_test_frees_threads_even_when_it_passed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, cleanup: str
) -> None:
    pytester.makepyfile(test_caught=CAUGHT_OOM_PROJECT)
    monkeypatch.setenv("RELEASE_WAIT_S", "60" if cleanup == "auto" else "0.5")
    result = pytester.runpytest("-p", "no:randomly", "-o", f"ct_cleanup={cleanup}")
    if cleanup == "auto":
        result.assert_outcomes(passed=2)
    else:  # without the plugin's cleanup the thread stays: the run above is not vacuous
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines(["FAILED test_caught.py::test_next_test_finds_none*"])
