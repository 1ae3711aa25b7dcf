"""Everything the plugin knows about one test, in one typed object in ``item.stash``.

Each phase writes what it learns and later phases read it: the config (resolved once, at
collection for a notebook item), the need and the meter (setup), the lease's size (setup,
in the record; the lease itself is the leases feature's), the session's calls (the test),
the cleanup's start and the figures (teardown), and the record the end-of-run report gets
(:class:`~pytest_ctresources.core.record.TestRecord`, written as ``ct_*`` user properties at
the end of the teardown, once). A rerun of the same item (pytest-rerunfailures) starts a new
attempt: what is per attempt starts afresh, the config stays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core.record import TestRecord

if TYPE_CHECKING:
    from pytest_ctresources.gpu.cleanup_between_tests import TestStart
    from pytest_ctresources.gpu.measure import VramFigures, VramMeter
    from pytest_ctresources.session.cache import ResidentModel
    from pytest_ctresources.session.session import CtSession
    from pytest_ctresources.settings.config import CircuitTracerConfig
    from pytest_ctresources.settings.markers import VramNeed


@dataclass
class TestState:
    """One test: what its phases found out, and what it will report."""

    # -- for the item, whatever attempt -------------------------------------------------
    config: CircuitTracerConfig | None = None
    """The test's resolved config (tests using ct_config or ct_session; notebook items)."""
    config_error: str | None = None
    """A config or metadata problem found at collection; fails the item at setup."""
    # -- for one attempt ------------------------------------------------------------------
    meter: VramMeter | None = None
    need: VramNeed | None = None
    memory_key: str = ""
    """The key of its learned need ("": nothing learned, nothing looked up)."""
    resident_at_start: ResidentModel | None = None
    resident_bytes_at_start: int = 0
    cleanup_start: TestStart | None = None
    session: CtSession | None = None
    figures: VramFigures | None = None
    """Its CUDA figures after teardown and cleanup."""
    kernel_figures: VramFigures | None = None
    """A notebook's figures, measured in its kernel (used instead of the meter's)."""
    kernel_snapshot: bytes | None = None
    """A notebook's CUDA memory snapshot, pickled by its kernel (``--ct-snapshot``)."""
    record: TestRecord = field(default_factory=TestRecord)

    def new_attempt(self) -> None:
        """Forget the previous attempt's findings; the config stays, and with it the
        settings it keeps over the session's."""
        config, config_error = self.config, self.config_error
        own_settings = self.record.own_settings
        self.__init__()  # type: ignore[misc]
        self.config, self.config_error = config, config_error
        self.record.own_settings = own_settings


STATE_KEY = pytest.StashKey[TestState]()


def new_attempt_of(item: pytest.Item) -> TestState:
    """The test's state for the attempt that starts: a new one for its first, the earlier
    attempt's forgotten for a rerun."""
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        state = item.stash[STATE_KEY] = TestState()
    else:
        state.new_attempt()
    return state


def state_of(item: pytest.Item) -> TestState:
    """The test's state, created on first use (with its deferred start, if it has one)."""
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        state = item.stash[STATE_KEY] = TestState()
        start = item.stash.get(_DEFERRED_KEY, None)
        if start is not None:
            del item.stash[_DEFERRED_KEY]
            start(state)
    return state


#: What a test's setup left to do for its state, should anything need one (:func:`defer_start`).
_DEFERRED_KEY = pytest.StashKey[Callable[[TestState], None]]()


def defer_start(item: pytest.Item, start: Callable[[TestState], None]) -> None:
    """Leave ``start`` to fill in the test's state when something first asks for it
    (:func:`state_of`: a fixture, an OOM, a check, the teardown), so that a test nothing
    asks about has no state at all."""
    item.stash[_DEFERRED_KEY] = start


def has_deferred(item: pytest.Item) -> bool:
    """Whether the test's deferred start is still pending: nothing asked for its state
    since :func:`defer_start`."""
    return _DEFERRED_KEY in item.stash


def drop_deferred(item: pytest.Item) -> None:
    """Forget the test's deferred start (its teardown found nothing to measure)."""
    if _DEFERRED_KEY in item.stash:
        del item.stash[_DEFERRED_KEY]
