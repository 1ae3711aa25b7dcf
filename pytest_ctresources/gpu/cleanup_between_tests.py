"""Where cleanup happens between tests: what the plugin undoes after each test's teardown.

Registered as a plugin unless ``ct_cleanup = never``. Every step is cheap when there is nothing
to do, because it runs after every test of suites of hundreds (bench/cleanup_cost.py measures
it, docs/benchmarks.md has the figures): the expensive one, a garbage collection over a heap
that torch, transformers and nnsight made large (0.17-0.3 s), runs only when CUDA memory says
the test's garbage holds some, and long-lived objects are frozen out of it.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import pytest

from pytest_ctresources.gpu.cleanup import (
    close_figures,
    collect_everything,
    failure_kept,
    open_figure_numbers,
    release_failed_test_frames,
)
from pytest_ctresources.gpu.nnsight_threads import may_hold_threads, release_quietly


@dataclass(frozen=True)
class CleanupPolicy:
    """How the between-test cleanup decides what to do. The defaults are the levers
    ``bench/cleanup_cost.py`` measured as cheapest for the same effect (docs/benchmarks.md);
    the other values exist so that the benchmark can measure the alternatives side by side.

    Attributes:
        conditional: under ``ct_cleanup = auto``, collect garbage only when the test left more
            CUDA memory allocated than it started with (its baseline, plus the models it made
            resident): then something a collection could free holds CUDA memory. False: collect
            after every test that used CUDA.
        freeze: ``gc.freeze()`` the long-lived objects, so that collections cost what the
            tests themselves allocate: under ``always`` before the first test; otherwise at the
            first collection of the run (then only the young generations are collected first,
            unless CUDA memory says the test's garbage holds some, which takes a full
            collection), and after any collection that took longer than ``freeze_after_s`` (many
            long-lived objects joined the heap: imports, a model). Undone at the end of the
            run, unless something else in the process had frozen objects before it (gc cannot
            unfreeze only some).
        freeze_after_s: see ``freeze``.
        empty_cache_min_bytes: return the CUDA caching allocator's free memory
            (``torch.cuda.empty_cache()``) only when it holds at least this much: a few cached
            MiB cost a device synchronisation now and a ``cudaMalloc`` in the next test, and
            leave the next test's reserved peak within this much of its own. 0: always.
    """

    conditional: bool = True
    freeze: bool = True
    freeze_after_s: float = 0.002
    empty_cache_min_bytes: int = 64 << 20


#: The policy in force. (bench/cleanup_cost.py replaces it from a conftest to measure others.)
POLICY = CleanupPolicy()


@dataclass(frozen=True)
class TestStart:
    """What one test started with, taken before its setup (kept in the test's state)."""

    figures: frozenset[int]
    resident_bytes: int


#: The start of a test before which nothing was open or resident (immutable, so shared).
_NOTHING_OPEN = TestStart(frozenset(), 0)


class BetweenTests:
    """The cleanup of one run after each test's teardown (``ct_cleanup``), registered as a
    plugin unless it is ``never``. It touches only what is the test's own:

    - the matplotlib figures the test opened (during its setup, call and teardown), not those
      open before it nor those a fixture of wider scope opened (``pytest_fixture_setup``);
    - the locals of a failed test's frames (see :func:`release_failed_test_frames`), never a
      suspended generator's;
    - nnsight threads an aborted trace left blocked (:mod:`pytest_ctresources.gpu.nnsight_threads`);
    - garbage: with ``auto``, collected when CUDA was used and the test left more allocated
      than it started with (beyond the models it made resident); with ``always``, after every
      test. Long-lived objects are frozen (see :class:`CleanupPolicy`), so a collection costs
      what the test allocated, not what torch, transformers and the model hold;
    - the CUDA cache, returned when it holds something worth returning.
    """

    name = "ctresources-cleanup"

    def __init__(self, mode: str, unfreezes: Callable[[], int] = lambda: 0) -> None:
        """``unfreezes()``: how many times something else (the model cache, freeing an idle
        model from the lease watcher's thread) unfroze the collector and left it so."""
        self.mode = mode
        self._unfreezes = unfreezes
        self._wider_figures: set[int] = set()
        self._froze = False
        self._unfrozen_seen = 0
        # Unfreezing at the end gives back the collector's usual view only if nothing else
        # froze objects before the run (a server that freezes before forking, say).
        self._unfreeze_at_close = gc.get_freeze_count() == 0

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[object]
    ) -> Generator[None, object, object]:
        __tracebackhide__ = True  # a failing fixture's traceback is the project's, not ours
        if fixturedef.scope == "function":
            return (yield)
        before = open_figure_numbers()
        try:
            return (yield)
        finally:
            self._wider_figures.update(open_figure_numbers() - before)

    def begin(self, resident_bytes: int) -> TestStart:
        """Before the test's setup: what is open and resident already."""
        if self.mode == "always" and POLICY.freeze and not self._froze:
            # ``always`` collects after every test, the first one included: what is alive
            # before any test ran is long-lived (imports, collection), so it is frozen now,
            # and each test's garbage, in whichever generation, stays collectable.
            self._freeze()
        open_now = open_figure_numbers()
        # A wider-scoped figure closed since frees its number for a test's own figure.
        self._wider_figures &= open_now
        if not open_now and not resident_bytes:
            return _NOTHING_OPEN  # most tests of most suites: one start, shared
        return TestStart(open_now, resident_bytes)

    def nothing_to_do(self, start: TestStart | None) -> bool:
        """Whether :meth:`finish` would find nothing to undo after a test that did not use
        CUDA: no figure open then or now, no failed test's frames, no nnsight mediator
        thread alive, under ``auto`` (``always`` collects after every test). A few look-ups
        (pyplot's figure numbers, ``sys``, the threads), so that a test with nothing to clean
        costs little in a suite that imported pyplot or nnsight too."""
        return (
            self.mode != "always"
            and (start is None or not start.figures)
            and not failure_kept()
            and not open_figure_numbers()
            and not may_hold_threads()
        )

    def finish(
        self,
        start: TestStart | None,
        allocated_beyond_baseline: Callable[[], int | None],
        resident_bytes: int,
    ) -> int:
        """After the test's teardown (``start``: what :meth:`begin` returned for it, None if
        it did not run). ``allocated_beyond_baseline()`` measures the CUDA memory
        allocated now beyond what the test started with (None when the test used no CUDA);
        ``resident_bytes``: what the resident models hold now. Returns how many figures it
        closed."""
        policy = POLICY
        figures = 0
        if start is not None:
            opened = open_figure_numbers() - start.figures - self._wider_figures
            figures = close_figures(opened) if opened else 0
            resident_bytes -= start.resident_bytes
        release_failed_test_frames()
        # A trace an exception aborted (in the test, a fixture, or caught by the test itself)
        # can leave nnsight threads blocked with its tensors; a no-op unless nnsight is loaded.
        release_quietly()
        # What the test made resident (a model ct_session keeps loaded) is no garbage; a
        # model it evicted (a test of another model) no longer counts in the baseline, so
        # ``resident_bytes`` (the change in resident bytes) may be negative.
        beyond = allocated_beyond_baseline()
        cuda = beyond is not None
        garbage_held = _above(beyond, resident_bytes)
        if self.mode == "always":
            collect = True
        elif not cuda:
            collect = False
        else:
            collect = garbage_held or not policy.conditional
        if collect:
            self._collect(
                policy,
                lambda: _above(allocated_beyond_baseline(), resident_bytes),
                needs_full=garbage_held,
            )
        if cuda:
            self._empty_cache(policy)
        return figures

    def _collect(
        self, policy: CleanupPolicy, still_held: Callable[[], bool], *, needs_full: bool
    ) -> None:
        if self._froze and self._unfreezes() != self._unfrozen_seen:
            self._froze = False  # unfrozen since (a watcher thread freeing an idle model)
        if policy.freeze and not self._froze and not needs_full:
            # The first collection of a run would walk everything torch, transformers and
            # nnsight imported (0.13-0.3 s); the young generations hold what the test just
            # dropped. Freeze what is left: later full collections skip it, and it is
            # unfrozen (and collected as usual) at the end of the run.
            gc.collect(1)
            self._freeze()
            return
        began = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - began
        if self._froze and still_held():
            # Still more allocated: garbage set aside by an earlier freeze may hold it (a
            # wider-scoped fixture's objects that died since).
            collect_everything()
        if policy.freeze and took > policy.freeze_after_s:
            self._freeze()

    def _freeze(self) -> None:
        """Set what is alive now aside from later collections (see :class:`CleanupPolicy`),
        noting how many unfreezes others had done by then."""
        gc.freeze()
        self._froze = True
        self._unfrozen_seen = self._unfreezes()

    def _empty_cache(self, policy: CleanupPolicy) -> None:
        # Imported here: only a test that used CUDA gets this far (the meter, in the same
        # module, is loaded by then), and a run of tests that never touch CUDA loads neither.
        from pytest_ctresources.gpu.measure import cached_bytes

        cached = cached_bytes()
        if cached is not None and cached >= policy.empty_cache_min_bytes:
            sys.modules["torch"].cuda.empty_cache()

    def close(self) -> None:
        """At the end of the run: give the garbage collector its usual view back."""
        if self._froze and self._unfreeze_at_close:
            gc.unfreeze()
        self._froze = False


@contextlib.contextmanager
def unraisable_as_warnings() -> Iterator[None]:
    """Turn what ``sys.unraisablehook`` receives meanwhile (a ``__del__`` that raised while the
    cleanup freed a failed test's frames or collected its garbage) into
    ``pytest.PytestUnraisableExceptionWarning`` raised here, as pytest's own collection of
    unraisable exceptions words them. pytest collects those at the end of each phase, before
    the plugin's cleanup runs: without this, they would surface in the *next* test, and fail it
    under ``-W error``."""
    caught: list[str] = []
    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        message = unraisable.err_msg or "Exception ignored in"
        lines = traceback.format_exception(
            unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback
        )
        caught.append(f"{message}: {unraisable.object!r}\n\n{''.join(lines).rstrip()}")

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
        for text in caught:
            warnings.warn(pytest.PytestUnraisableExceptionWarning(text), stacklevel=1)


def _above(beyond: int | None, resident_change: int) -> bool:
    """Whether CUDA memory allocated beyond the test's baseline is more than the change in
    what the resident models hold: then something else, garbage or a leak, holds it."""
    return beyond is not None and beyond > resident_change
