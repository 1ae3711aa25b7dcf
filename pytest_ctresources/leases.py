"""VRAM leases of tests in xdist workers bound to a GPU.

Before a test with a known need runs, its worker takes that many GiB from its GPU's budget
(:mod:`~pytest_ctresources.ledger`), waiting while other workers hold it; after the test's
teardown and cleanup the lease is given back. A worker that has to wait first frees the
models it cached, so a waiting worker holds no GPU memory. Every test run by a bound worker
carries its placement (worker, GPU, lease, wait) to the controller as ``ct_*`` properties.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.binding import Binding
from pytest_ctresources.exceptions import CtResourcesWarning
from pytest_ctresources.placement import WORKER_PROPERTY

if TYPE_CHECKING:
    # (imported lazily at run time: fcntl, which ledger uses, is POSIX-only)
    from pytest_ctresources.ledger import Lease, VramLedger  # noqa: F401  (Lease: in a string)
    from pytest_ctresources.runtime import Runtime

LEASE_KEY = pytest.StashKey["Lease"]()


@dataclass
class WorkerGpu:
    """This worker's GPU and, when leases are on, the GPU's shared budget."""

    binding: Binding
    ledger: VramLedger | None


def start_worker_gpu(binding: Binding, testrun: str, budget_gib: float, leases: bool) -> WorkerGpu:
    """Open the ledger of the bound GPU (one per GPU and run on this host)."""
    ledger = None
    if leases:
        try:
            from pytest_ctresources.ledger import VramLedger, ledger_path, prune_old_runs
        except ImportError:  # no fcntl: not a POSIX system
            warnings.warn(
                CtResourcesWarning(
                    "VRAM leases need POSIX record locks (fcntl), which this platform lacks: "
                    "workers sharing a GPU run without a shared budget"
                ),
                stacklevel=1,
            )
        else:
            prune_old_runs()
            key = binding.gpu.uuid or f"gpu{binding.gpu.index}"
            ledger = VramLedger(ledger_path(testrun, key), budget_gib).open()
    return WorkerGpu(binding, ledger)


def record_placement(item: pytest.Item, runtime: Runtime) -> None:
    """Attach the worker and its GPU to the test's reports (bound workers only)."""
    worker = runtime.worker_gpu
    if worker is None:
        return
    gpu = worker.binding.gpu
    item.user_properties += [
        (WORKER_PROPERTY, worker.binding.worker),
        ("ct_gpu_name", gpu.name),
        ("ct_gpu_physical_index", gpu.physical_index),
        ("ct_gpu_uuid", gpu.uuid),
    ]


class LeaseHooks:
    """Registered in bound workers with leases on. Its setup hook is an ordinary one, so it
    runs after pytest's skipping plugin (a skipped test takes no lease) and before fixtures
    are set up (the lease covers the models they load)."""

    name = "ctresources-leases"

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        from pytest_ctresources.accounting import NEED_KEY

        need = item.stash.get(NEED_KEY, None)
        take(item, self.runtime, need.lease_gib if need is not None else None)


def take(item: pytest.Item, runtime: Runtime, need_gib: float | None) -> None:
    """Take the test's lease; fail the test when it is not granted in ``ct_lease_timeout``."""
    worker = runtime.worker_gpu
    if worker is None or worker.ledger is None:
        return
    settings = runtime.settings
    gib = need_gib if need_gib is not None else settings.default_vram_gib.value
    if gib <= 0:
        return
    from pytest_ctresources.ledger import LeaseTimeout

    try:
        lease = worker.ledger.acquire(
            gib, settings.lease_timeout_s.value, before_waiting=runtime.free_cached_models
        )
    except (LeaseTimeout, ValueError) as exc:
        failure = f"{worker.binding.describe()}: {exc}"
    else:
        item.stash[LEASE_KEY] = lease
        wait = round(lease.waited_s, 3)
        item.user_properties += [("ct_lease_gib", gib), ("ct_lease_wait_s", wait)]
        return
    item.user_properties += [("ct_lease_gib", gib), ("ct_lease_wait_s", -1.0)]
    pytest.fail(failure, pytrace=False)


def give_back(item: pytest.Item, runtime: Runtime) -> None:
    """Release the test's lease, if it took one."""
    lease = item.stash.get(LEASE_KEY, None)
    worker = runtime.worker_gpu
    if lease is not None and worker is not None and worker.ledger is not None:
        worker.ledger.release(lease)
        del item.stash[LEASE_KEY]
