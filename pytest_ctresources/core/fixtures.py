"""The ``ct_config`` and ``ct_session`` fixtures: thin wrappers over public classes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_ctresources.session.session import CtSession
    from pytest_ctresources.settings.config import CircuitTracerConfig

# What the fixtures run on is imported when a test uses them: this module is imported by the
# plugin at every pytest start-up, in projects that never use the fixtures too.


@pytest.fixture
def ct_config(request: pytest.FixtureRequest) -> CircuitTracerConfig:
    """The resolved :class:`~pytest_ctresources.CircuitTracerConfig` of this test.

    Layers, lowest to highest: defaults < ini < experiment YAML (``--ct-config``) < ``CT_*``
    environment < ``--ct-*`` options < the test's own ``ct_config`` marker (its ``path=`` YAML,
    then its fields). ``ct_config.source_of("batch_size")`` says where a value came from.
    """
    from pytest_ctresources.core.runtime import runtime_of
    from pytest_ctresources.settings.markers import MarkerError

    try:
        return runtime_of(request.config).config_for(request.node)
    except MarkerError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def ct_session(
    request: pytest.FixtureRequest, ct_config: CircuitTracerConfig
) -> Iterator[CtSession]:
    """A :class:`~pytest_ctresources.CtSession` for this test.

    ``ct_session.cfg`` is the test's config; ``ct_session.load_model()`` builds its
    ReplacementModel once per session (a different model evicts the previous one);
    ``ct_session.attribute(prompt)`` runs ``circuit_tracer.attribute`` with the config's
    arguments; ``ct_session.graph_files(graph, slug, output_path)`` and
    ``ct_session.prune(graph)`` the pruning after it. After the test, the per-test cleanup
    (``ct_cleanup``) returns its memory.
    """
    from pytest_ctresources.core.accounting import halving_summary
    from pytest_ctresources.core.runtime import runtime_of
    from pytest_ctresources.core.state import state_of
    from pytest_ctresources.session.progress_line import LiveLine
    from pytest_ctresources.session.progress_line import enabled as progress_on
    from pytest_ctresources.session.session import CtSession

    runtime = runtime_of(request.config)
    node = request.node
    state = state_of(node)
    session = CtSession(
        ct_config,
        runtime.model_cache,
        oom_retry=runtime.settings.oom_retry.value,
        oom_retry_floor=runtime.settings.oom_retry_floor.value,
        meter=state.meter,
        auto_budget=runtime.auto_budget(node),
        estimate_prompt_tokens=runtime.settings.estimate_prompt_tokens.value,
    )
    state.session = session
    after = runtime.settings.progress_after.value
    live = (
        LiveLine(request.config, after)
        if after is not None and progress_on(request.config)
        else None
    )
    session.progress = live
    cache = runtime.model_cache
    cache.current_test = node.nodeid
    try:
        with cache.in_use():  # an idle-cache watcher leaves the model alone meanwhile
            yield session
    finally:
        cache.current_test = None
        record = state.record
        record.attribution_batch_sizes = [call.kwargs["batch_size"] for call in session.calls]
        record.attribution_timings = [c.timing.to_dict() for c in session.calls if c.timing]
        record.pruning_calls = [call.to_dict() for call in session.prunings]
        record.auto_batch_sizes = [choice.describe() for choice in session.auto_choices]
        if session.halvings:
            record.oom_halvings = halving_summary(session)
        session.close()


def one_line_message(exc: BaseException) -> str | None:
    """The one line a test fails with when ``exc`` is a model ``ct_session`` cannot load
    (the model, its config source, the cause: not the hub's chained tracebacks), whether the
    test body or a fixture asked for it
    (:class:`~pytest_ctresources.session.model_load.ModelLoadError`), or a prompt
    ``--ct-batch-size auto`` refuses (``estimator.auto.WillNotFit``); None for anything else.
    per_test.py asks it of whatever a test's setup or call raised."""
    return str(exc) if isinstance(exc, _one_line_classes()) else None


def _one_line_classes() -> tuple[type[Exception], ...]:
    # Imported only once a test raised: a run whose tests pass loads neither module for this.
    from pytest_ctresources.estimator.auto import WillNotFit
    from pytest_ctresources.session.model_load import ModelLoadError

    return ModelLoadError, WillNotFit
