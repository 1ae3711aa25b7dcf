"""VRAM leases: a test with a known need takes it from its GPU's budget before it runs.

Every process that runs tests (a plain pytest run, each xdist worker) takes, before a test with
a known need runs, that many GiB from the budget of the GPU the test runs on, waiting while
others hold it; after the test's teardown and cleanup the lease is given back. The budget
(:mod:`~pytest_ctresources.leases.ledger`) is one per GPU for every run of the user on the host, and
the memory that other processes use on the card counts against it.

Resident models: the model ``ct_session`` keeps loaded between tests holds a lease of its
measured size for as long as it stays on the GPU. It is carved out of the lease of the test
that loaded it (so the model is never on the card without a lease), and a later test that
reuses it leases only its need less the model. A process that must wait for its lease frees
its own idle cached model first; one whose wait idle models elsewhere could end holds the
ledger's ``WANTED`` byte, and every process with a resident model runs a watcher thread
(:class:`IdleCacheWatcher`) that frees its model then, unless a test is using it.

Every test run by a bound xdist worker carries its placement (worker, GPU, lease, wait) to the
controller as ``ct_*`` properties; in other processes, every test that took a lease does.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core.record import PLAIN_RUN_WORKER
from pytest_ctresources.core.state import STATE_KEY, state_of
from pytest_ctresources.exceptions import CtResourcesWarning
from pytest_ctresources.settings.activation import activation_of
from pytest_ctresources.units import GIB

if TYPE_CHECKING:
    # (imported lazily at run time: fcntl, which ledger uses, is POSIX-only)
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.gpu.detect import GpuInfo, UsedMemory
    from pytest_ctresources.leases.ledger import Lease, VramLedger
    from pytest_ctresources.session.cache import ModelCache, ResidentModel
    from pytest_ctresources.xdist.binding import Seats

#: How often a watcher looks for a waiter while its process holds a resident model's lease.
WATCH_SECONDS = 0.2
#: How long a test that reuses the resident model may wait for its lease with the model's
#: lease kept; after that it frees the model and waits for its whole need.
REUSE_GRACE_SECONDS = 0.2


@dataclass
class TestLease:
    """A test's lease: the need it covers and the units the test itself holds."""

    gib: float
    """The test's need, the resident model it reuses included (what ``auto`` may fill)."""
    lease: Lease
    reused_gib: float = 0.0
    """The part of the need the resident model's own lease covers."""
    counted: ResidentModel | None = field(default=None, repr=False)
    """The resident model this test's need covers (reused, or loaded under its lease): if it
    is freed during the test, its units go to the test, which still needs them."""


class IdleCacheWatcher:
    """A daemon thread that frees this process's idle cached model while another process
    waits for the units it holds (the ledger's ``WANTED`` byte).

    Parked on an event while the process holds no resident model's lease, so it costs
    nothing then; with one, a single lock probe every :data:`WATCH_SECONDS`.
    """

    def __init__(self, ledger: VramLedger, cache: ModelCache) -> None:
        self.ledger = ledger
        self.cache = cache
        self._resident = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """A resident model holds a lease now: look for waiters."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="ctresources-idle-cache-watcher", daemon=True
            )
            self._thread.start()
        self._resident.set()

    def park(self) -> None:
        """No resident model's lease any more: stop looking."""
        self._resident.clear()

    def stop(self) -> None:
        self._stopping.set()
        self._resident.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while True:
            self._resident.wait()
            if self._stopping.wait(WATCH_SECONDS):
                return
            if not self._resident.is_set():
                continue
            try:
                if self.ledger.wanted_elsewhere():
                    self.cache.evict_if_idle()
            except (OSError, RuntimeError):
                return  # the ledger was closed under it: the run is ending


class GpuLeases:
    """This process's leases on the GPU its tests run on: the running test's and the
    resident model's. Observes the run's :class:`~pytest_ctresources.session.cache.ModelCache`.

    The ledger is opened at the first test that needs a lease; a ledger that cannot be used
    (no POSIX record locks, an unsafe ledger file) fails leased tests with one line, or, on
    a platform without record locks, lets them run without a budget after one warning.
    """

    def __init__(self, runtime: Runtime, worker: str) -> None:
        self.runtime = runtime
        self.worker = worker
        self.cache = runtime.model_cache
        self._lock = threading.Lock()
        self._opened = False
        self._ledger: VramLedger | None = None
        self._used: UsedMemory | None = None
        self._gpu: GpuInfo | None = None
        self._error: str | None = None
        self._watcher: IdleCacheWatcher | None = None
        self._test: TestLease | None = None
        self._reserve = ExitStack()
        self._model: Lease | None = None
        self._model_of: ResidentModel | None = None
        self._model_short_gib = 0.0
        self.cache.observers.append(self)

    # -- the ledger ------------------------------------------------------------------------

    def describe(self) -> str:
        binding = self.runtime.binding
        if binding is not None:
            return binding.describe()
        return self._gpu.describe() if self._gpu is not None else "no GPU"

    def ledger(self) -> VramLedger | None:
        """The ledger of this process's GPU, opened on first use; None without one."""
        if self._opened:
            return self._ledger
        self._opened = True
        binding = self.runtime.binding
        gpu = binding.gpu if binding is not None else self.runtime.test_gpu()
        if gpu is None:
            return None
        self._gpu = gpu
        try:
            from pytest_ctresources.leases import ledger as ledger_module
        except ImportError:  # no fcntl: not a POSIX system
            warnings.warn(
                CtResourcesWarning(
                    "VRAM leases need POSIX record locks (fcntl), which this platform lacks: "
                    "tests sharing a GPU run without a shared budget"
                ),
                stacklevel=1,
            )
            return None
        from pytest_ctresources.gpu.detect import used_memory_reader
        from pytest_ctresources.xdist.binding import testrun_id

        capacity = self.runtime.vram_capacity
        budget = min(capacity.value, gpu.total_gib) if capacity else gpu.total_gib
        try:
            ledger_module.prune_old_runs(current=testrun_id(os.environ))
            self._used = used_memory_reader(gpu)
            key = gpu.uuid or f"gpu-index-{gpu.physical_index}"
            self._ledger = ledger_module.VramLedger(
                ledger_module.ledger_path(key),
                budget,
                card_gib=gpu.total_gib,
                used_bytes=self._used,
            ).open()
        except (ledger_module.LedgerDirError, ValueError) as exc:
            self._error = str(exc)
            return None
        self._watcher = IdleCacheWatcher(self._ledger, self.cache)
        return self._ledger

    def close(self) -> None:
        """Stop the watcher and give every unit back (at the end of the run)."""
        if self._watcher is not None:
            self._watcher.stop()
        if self in self.cache.observers:
            self.cache.observers.remove(self)
        with self._lock:
            if self._ledger is not None:
                for lease in (self._model, self._test.lease if self._test else None):
                    if lease is not None:
                        self._ledger.release(lease)
                self._ledger.close()
            self._model = self._model_of = self._test = None
            self._ledger = None
        self._reserve.close()
        if self._used is not None:
            self._used.close()

    # -- tests -----------------------------------------------------------------------------

    def take(self, item: pytest.Item, need_gib: float | None) -> None:
        """Take the test's lease; fail the test when it is not granted in
        ``ct_lease_timeout`` (or when the ledger cannot be used)."""
        settings = self.runtime.settings
        gib = need_gib if need_gib is not None else settings.default_vram_gib.value
        if gib <= 0:
            return
        ledger = self.ledger()
        if self._error is not None:
            pytest.fail(self._error, pytrace=False)
        if ledger is None or self._gpu is None:
            return
        from pytest_ctresources.leases.ledger import LeaseTimeout

        gib = min(gib, most_grantable_gib(ledger.budget_gib, ledger.card_gib))
        timeout = settings.lease_timeout.value
        lease = None
        grace = 0.0
        reused, reused_gib = self._reserve_reused_model(item)
        began = time.monotonic()
        try:
            if reused is not None:
                try:
                    lease = ledger.acquire(gib - reused_gib, min(REUSE_GRACE_SECONDS, timeout))
                except LeaseTimeout:
                    # Waiting while the model keeps its lease could leave a waiter ahead of
                    # this one, which needs those units, waiting for ever: free the model and
                    # wait for the whole need, holding nothing, as any waiter does.
                    self._reserve.close()
                    reused, reused_gib = None, 0.0
                    self.runtime.free_cached_models()
                    grace = time.monotonic() - began
            if lease is None:
                lease = ledger.acquire(
                    gib, max(0.0, timeout - grace), before_waiting=self.runtime.free_cached_models
                )
                lease.waited_s += grace
        except (LeaseTimeout, ValueError) as exc:
            self._reserve.close()
            failure = f"{self.describe()}: {exc}"
        else:
            test = TestLease(gib, lease, reused_gib, counted=reused)
            with self._lock:
                self._test = test
            state = state_of(item)
            state.record.lease_gib = gib
            state.record.lease_wait_s = round(lease.waited_s, 3)
            state.record.lease_reused_gib = round(reused_gib, 3)
            self._add_placement_if_unbound(item)
            return
        record = state_of(item).record
        record.lease_gib, record.lease_wait_s = gib, -1.0
        record.lease_gave_up_after_s = round(time.monotonic() - began, 3)
        self._add_placement_if_unbound(item)
        pytest.fail(failure, pytrace=False)

    def _add_placement_if_unbound(self, item: pytest.Item) -> None:
        if self.runtime.binding is None and self._gpu is not None:
            state_of(item).record.place(self.worker, self._gpu)

    def _reserve_reused_model(self, item: pytest.Item) -> tuple[ResidentModel | None, float]:
        """The resident model a ``ct_session`` test will reuse, kept from every eviction but
        its own (held in use until the lease is given back), and the GiB its lease covers."""
        cfg = state_of(item).config
        if cfg is None or "ct_session" not in getattr(item, "fixturenames", ()):
            return None, 0.0
        self._reserve.enter_context(self.cache.in_use())  # before looking: no watcher races
        resident = self.cache.resident_for(cfg)
        with self._lock:
            model = self._model if resident is not None and self._model_of is resident else None
            covered = model.gib if model is not None else 0.0
        if model is None or covered <= 0:
            self._reserve.close()
            return None, 0.0
        return resident, covered

    def give_back(self, item: pytest.Item) -> None:
        """After the test's teardown and cleanup: settle the resident model's lease, release
        the test's."""
        if self._test is None and self._model is None:
            return  # nothing held, nothing reserved (the watcher thread only ever clears them)
        self._settle_model(item.nodeid)
        with self._lock:
            if self._test is not None and self._ledger is not None:
                self._ledger.release(self._test.lease)
            self._test = None
        self._reserve.close()

    def _settle_model(self, nodeid: str) -> None:
        """A model that could not get a lease of its size does not stay on the card."""
        with self._lock:
            ledger, model, resident = self._ledger, self._model, self._model_of
            short = self._model_short_gib
            if ledger is None or model is None or short <= 0:
                return
            if ledger.try_extend(model, short):
                self._model_short_gib = 0.0
                return
            covered = model.gib
        if resident is not None and self.cache.resident is resident:
            self.cache.evict()
            warnings.warn(
                CtResourcesWarning(
                    f"{resident.label} ({resident.bytes / GIB:.2f} GiB on the GPU), loaded by "
                    f"{resident.loaded_by or nodeid}, was freed after the test: its lease covered "
                    f"only {covered:.2f} GiB and the GPU's budget had no more free; declare "
                    "the test's need with the model included (@pytest.mark.vram or VRAM_GIB)"
                ),
                stacklevel=1,
            )

    # -- the resident model (CacheObserver) ------------------------------------------------

    def model_loaded(self, resident: ResidentModel) -> None:
        """Carve the model's lease out of the running test's; top it up if that is short."""
        gib = resident.bytes / GIB
        if gib <= 0 or self.cache.resident is not resident:
            return
        ledger = self.ledger()
        if ledger is None:
            return
        from pytest_ctresources.leases.ledger import Lease

        with self._lock:
            model = Lease(0.0, [], 0.0, resident=True)
            test = self._test
            if test is not None:
                ledger.move(test.lease, model, gib)
                test.counted = resident
            short = max(0.0, gib - model.gib)
            if short > 0 and ledger.try_extend(model, short):
                short = 0.0
            self._model, self._model_of, self._model_short_gib = model, resident, short
        if self._watcher is not None:
            self._watcher.watch()

    def model_freed(self, resident: ResidentModel) -> None:
        """Give the model's lease back, to the running test if its need counted on it."""
        with self._lock:
            if self._model_of is not resident or self._model is None or self._ledger is None:
                return
            model, test = self._model, self._test
            if test is not None and test.counted is resident:
                self._ledger.move(model, test.lease, model.gib)
                test.counted = None
            self._ledger.release(model)
            self._model = self._model_of = None
            self._model_short_gib = 0.0
        if self._watcher is not None:
            self._watcher.park()


BOOK_KEY = pytest.StashKey[GpuLeases]()


class LeaseHooks:
    """Registered where tests run with leases on. Its setup hook is an ordinary one, so it
    runs after pytest's skipping plugin (a skipped test takes no lease) and before fixtures
    are set up (the lease covers the models they load)."""

    name = "ctresources-leases"

    def __init__(self, book: GpuLeases) -> None:
        self.book = book
        # Read once: this hook runs before every test of the run.
        self._every_test_leases = book.runtime.settings.default_vram_gib.value > 0

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # ``in`` and then ``[]``: ``Stash.get`` of a missing key raises and catches a KeyError.
        state = item.stash[STATE_KEY] if STATE_KEY in item.stash else None
        if state is None and not self._every_test_leases:
            return  # a test with nothing to measure takes no lease, nor one not acted for
        if not activation_of(item.config).acts_for(item):
            return
        need = state.need if state is not None else None
        self.book.take(item, need.lease_gib if need is not None else None)


def give_back(item: pytest.Item) -> None:
    """Release the test's lease, if it took one (called after its cleanup)."""
    book = item.config.stash.get(BOOK_KEY, None)
    if book is not None:
        book.give_back(item)


def open_seats(environ: Mapping[str, str] | None = None) -> Seats | None:
    """The run's seat board on this host; None without POSIX record locks or a safe ledger
    directory (then plain round robin; the controller reports an unsafe directory)."""
    from pytest_ctresources.xdist.binding import testrun_id

    try:
        from pytest_ctresources.leases.ledger import LedgerDirError, seat_board
    except ImportError:  # no fcntl
        return None
    try:
        return seat_board(testrun_id(os.environ if environ is None else environ))
    except LedgerDirError:
        return None


def start(config: pytest.Config, runtime: Runtime) -> None:
    """At configure: register the lease hooks in a process that runs tests with leases on;
    on an xdist controller, check the ledger directory its workers will use.

    Raises ``pytest.UsageError`` (one line) for a malformed ``CT_FAKE_GPUS_USED`` and, on a
    controller whose host shows a GPU (NVML or the fake seam), an unsafe ledger directory.
    A plain run checks the directory at its first lease instead (failing leased tests with
    that line), so that a run which leases nothing never imports pynvml.
    """
    from pytest_ctresources.xdist.roles import runs_no_tests

    settings = runtime.settings
    controller = runs_no_tests(config)
    worker = hasattr(config, "workerinput")
    if not (settings.leases.value or (controller and settings.gpu_binding.value == "auto")):
        return
    _check_fake_used()
    if controller:
        # Workers start after this: one clear line here, not a failure in each of them. (A
        # project that asks only through its tests has its workers check at the first lease.)
        if activation_of(config).project_wide:
            _check_ledger_dir()
        return
    if not settings.leases.value:
        return
    name = config.workerinput["workerid"] if worker else PLAIN_RUN_WORKER  # type: ignore[attr-defined]
    book = GpuLeases(runtime, str(name))
    config.stash[BOOK_KEY] = book
    config.add_cleanup(book.close)
    config.pluginmanager.register(LeaseHooks(book), LeaseHooks.name)


def _check_fake_used() -> None:
    from pytest_ctresources.gpu.fake import fake_used_gib

    try:
        fake_used_gib(os.environ)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _check_ledger_dir() -> None:
    from pytest_ctresources.gpu.detect import detect_gpus

    try:
        facts = detect_gpus(torch_fallback=False)  # NVML only, as the workers' binding
    except ValueError:
        return  # a malformed CT_FAKE_GPUS: reported by the settings
    if not facts.gpus:
        return
    try:
        from pytest_ctresources.leases.ledger import LedgerDirError, ensure_root
    except ImportError:
        return  # no fcntl: warned about at the first lease
    try:
        ensure_root()
    except LedgerDirError as exc:
        raise pytest.UsageError(str(exc)) from None


def most_grantable_gib(budget_gib: float, card_gib: float | None) -> float:
    """The largest lease that can ever be granted: a card's used memory (which the grant
    counts) always holds this process's own CUDA context, so a lease of the whole card would
    wait for ever; a need that large (an estimate capped at the card, a declaration of all
    of it) leases what is left beside the context. Under a ``--ct-vram-capacity`` below the
    card less the context, the budget itself."""
    from pytest_ctresources.estimator.estimate import CALIBRATION

    card = card_gib if card_gib is not None else budget_gib
    return min(budget_gib, card - CALIBRATION.context_bytes / GIB)
