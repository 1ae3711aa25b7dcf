"""What the plugin does around each test it acts for (settings/activation.py): the test's
need, lease and accounting at setup, the out-of-memory explanation at call, the cleanup, the
snapshot and the one write of its record at teardown; around every test of such a run, the
one-line failure of a model that cannot load (core/fixtures.py).

Registered by ``plugin.py`` only in a run the plugin acts in, and imported only then: a
project that does not ask has none of these hooks on any test's stack, and pays for none of
these imports.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core import accounting
from pytest_ctresources.core.fixtures import one_line_message
from pytest_ctresources.core.record import TestRecord
from pytest_ctresources.core.runtime import Runtime
from pytest_ctresources.core.state import (
    defer_start,
    drop_deferred,
    has_deferred,
    new_attempt_of,
    state_of,
)
from pytest_ctresources.gpu.cleanup import cuda_initialised
from pytest_ctresources.gpu.cleanup_between_tests import (
    BetweenTests,
    TestStart,
    unraisable_as_warnings,
)
from pytest_ctresources.leases import leases
from pytest_ctresources.settings import markers
from pytest_ctresources.settings.activation import Activation

if TYPE_CHECKING:
    from pytest_ctresources.report.snapshots import SnapshotRecorder
    from pytest_ctresources.xdist.exchange import PlacementWorker

#: The user properties the plugin wrote for the item's last attempt (a rerun replaces them).
_WRITTEN_KEY = pytest.StashKey[list[tuple[str, object]]]()


#: The cleanup's start of a test with nothing to measure, from its setup to its teardown.
_QUIET_KEY = pytest.StashKey[TestStart | None]()


class PerTestHooks:
    """Around each test the plugin acts for (settings/activation.py): its need, lease and
    accounting at setup, the OOM explanation at call, the cleanup and its record at teardown;
    a model that cannot load fails any test of the run in one line. Registered only in a run
    the plugin acts in. (The one-line failures ride on its setup and call wrappers rather
    than on two wrappers of their own: every test of the run would pay for those.)

    Given what it works with when it is made: the run's ``activation``, its ``runtime``, the
    between-test ``cleaner`` (None under ``ct_cleanup = never``) and the snapshot
    ``recorder`` (None under ``--ct-snapshot off``).
    """

    name = "ctresources-per-test"

    def __init__(
        self,
        activation: Activation,
        runtime: Runtime,
        cleaner: BetweenTests | None,
        recorder: SnapshotRecorder | None = None,
    ) -> None:
        self._activation = activation
        self._runtime = runtime
        self._cleaner = cleaner
        self._recorder = recorder
        self._may_skip: bool | None = None  # decided at the first test (_may_skip_accounting)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        # The innermost wrapper: its part before the yield runs after the other wrappers'
        # (inside output capture) and before every implementation, pytest's skipping plugin
        # included, which evaluates the skip mark it may add; the yield runs the fixtures.
        __tracebackhide__ = True  # a failing fixture's traceback is the project's, not ours
        self._setup(item)
        try:
            return (yield)
        except Exception as exc:
            message = one_line_message(exc)
            if message is None:
                raise
        # Outside the except block: no "During handling of the above exception" either.
        pytest.fail(message, pytrace=False)

    def _setup(self, item: pytest.Item) -> None:
        if not self._activation.acts_for(item):
            return
        runtime, cleaner = self._runtime, self._cleaner
        if runtime.capacity_cap is not None:
            runtime.capacity_cap.arm()
        if self._may_skip_accounting(item) and accounting.nothing_to_measure(item, runtime):
            # A test that asks for nothing, before CUDA is initialised: no state, meter or
            # record until something asks for its state (state_of runs the deferred start)
            # or CUDA is initialised by its teardown. The cleanup's start stays.
            resident, resident_bytes = runtime.model_cache.resident, runtime.resident_bytes()
            start = cleaner.begin(resident_bytes) if cleaner is not None else None
            item.stash[_QUIET_KEY] = start
            defer_start(
                item,
                lambda state: accounting.begin_late(
                    state, item, runtime, resident, resident_bytes, start
                ),
            )
            return
        # A rerun (pytest-rerunfailures) runs the same item again: its earlier attempt's findings
        # must not travel with this one's reports. Only the properties the plugin wrote go: a
        # project's own ``ct_*`` properties stay.
        written = item.stash.get(_WRITTEN_KEY, None)
        if written:
            item.user_properties[:] = [p for p in item.user_properties if p not in written]
        state = new_attempt_of(item)
        if cleaner is not None:
            state.cleanup_start = cleaner.begin(runtime.resident_bytes())
        try:
            reason = accounting.begin(item, runtime)
        except markers.MarkerError as exc:
            failure = str(exc)
        else:
            placement = _placement_worker(item.config)
            if reason is not None:
                if placement is not None and state.need is not None:
                    reason = placement.explain_skip(reason, state.need.gib)
                state.record.vram_skip = reason
                # A skip mark, evaluated by pytest's skipping plugin right after this hook, reports
                # the test's own location rather than this file's.
                item.add_marker(pytest.mark.skip(reason=reason))
            if runtime.binding is not None:  # a bound xdist worker: its worker and GPU
                state.record.place(runtime.binding.worker, runtime.binding.gpu)
            placed = placement.why(item.nodeid) if placement is not None else None
            if placed is not None:
                record = state.record
                record.placed_kind, record.placed_beside, record.placed_because = placed
            return
        pytest.fail(failure, pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # a failing fixture's traceback is the project's, not ours
        if not self._activation.acts_for(item):
            return (yield)
        try:
            return (yield)
        finally:
            self._teardown(item)

    def _may_skip_accounting(self, item: pytest.Item) -> bool:
        """Whether this run lets a test that asks for nothing skip the accounting until it
        uses CUDA: not where every test takes a lease, collects garbage, records a
        snapshot or is placed on a GPU (each its own per-test work)."""
        if self._may_skip is None:
            config = item.config
            runtime, cleaner = self._runtime, self._cleaner
            self._may_skip = (
                runtime.settings.default_vram_gib.value <= 0
                and (cleaner is None or cleaner.mode != "always")
                and runtime.binding is None
                and _placement_worker(config) is None
                and self._recorder is None
            )
        return self._may_skip

    def _teardown(self, item: pytest.Item) -> None:
        runtime, cleaner = self._runtime, self._cleaner
        quiet = _QUIET_KEY in item.stash  # its setup skipped the accounting
        if quiet:
            start = item.stash[_QUIET_KEY]
            del item.stash[_QUIET_KEY]
            if (
                has_deferred(item)
                and (cleaner is None or cleaner.nothing_to_do(start))
                and not cuda_initialised()
            ):
                # Nothing asked for its state, and the cleanup has nothing to free (so no
                # ``__del__`` can initialise CUDA now): nothing to measure, clean or write.
                drop_deferred(item)
                leases.give_back(item)
                return

        def measured() -> bool:
            # A quiet test is measured as any other once anything asked for its state or CUDA
            # is initialised: during the test, or by what the cleanup frees (a ``__del__``).
            return not quiet or not has_deferred(item) or cuda_initialised()

        def beyond() -> int | None:
            return accounting.allocated_beyond_baseline(item)() if measured() else None

        closed = 0
        try:
            # What the cleanup frees may run ``__del__`` methods that raise: their warnings
            # belong to this test's teardown, not to the next test's setup.
            with unraisable_as_warnings():
                if cleaner is not None:
                    # Reported through the teardown report: output written here is captured.
                    closed = cleaner.finish(
                        start if quiet else state_of(item).cleanup_start,
                        beyond,
                        runtime.resident_bytes(),
                    )
            if measured():
                state_of(item).record.figures_closed = closed
                accounting.end(item, runtime)
        finally:
            try:
                leases.give_back(item)  # whatever raised (-W error::CtLeakWarning, ...)
            finally:
                if measured():
                    if self._recorder is not None:
                        self._recorder.finish(item, runtime.settings.leak_threshold.value)
                    _write_record(item, state_of(item).record)
                else:  # nothing to say but the figures the cleanup closed, if any
                    drop_deferred(item)
                    if closed:
                        record = state_of(item).record
                        record.figures_closed = closed
                        _write_record(item, record)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # the test's failure is the project's, not ours
        try:
            return (yield)
        except BaseException as exc:
            message = one_line_message(exc)
            if message is None:
                if self._activation.acts_for(item):
                    accounting.explain_oom(item, self._runtime, exc)
                raise
        pytest.fail(message, pytrace=False)  # outside the except block, as at setup


def _placement_worker(config: pytest.Config) -> PlacementWorker | None:
    """The run's placement worker (xdist/exchange.py), in an xdist worker of a run placed by
    VRAM. Its module is imported only in an xdist worker, the one place it is registered."""
    if not hasattr(config, "workerinput"):
        return None
    from pytest_ctresources.xdist.exchange import PlacementWorker

    worker: PlacementWorker | None = config.pluginmanager.get_plugin(PlacementWorker.name)
    return worker


def _write_record(item: pytest.Item, record: TestRecord) -> None:
    """The one place a test's record is written: its teardown report carries it to the
    controller, the summary and junit XML (core/record.py)."""
    written = record.to_properties()
    item.stash[_WRITTEN_KEY] = written
    item.user_properties.extend(written)
