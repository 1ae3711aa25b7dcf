"""VRAM leases of tests in xdist workers bound to a GPU.

Before a test with a known need runs, its worker takes that many GiB from its GPU's budget
(:mod:`~pytest_ctresources.ledger`), waiting while other workers hold it; after the test's
teardown and cleanup the lease is given back. A worker that has to wait first frees the
models it cached, so a waiting worker holds no GPU memory. Every test run by a bound worker
carries its placement (worker, GPU, lease, wait) to the controller as ``ct_*`` properties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.binding import Binding
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
    budget_gib: float


def start_worker_gpu(binding: Binding, testrun: str, budget_gib: float, leases: bool) -> WorkerGpu:
    """Open the ledger of the bound GPU (one per GPU and run on this host)."""
    ledger = None
    if leases:
        from pytest_ctresources.ledger import VramLedger, ledger_path, prune_old_runs

        prune_old_runs()
        key = binding.gpu.uuid or f"gpu{binding.gpu.index}"
        ledger = VramLedger(ledger_path(testrun, key), budget_gib).open()
    return WorkerGpu(binding, ledger, budget_gib)


def take(item: pytest.Item, runtime: Runtime, need_gib: float | None, *, skipped: bool) -> None:
    """Record the test's placement and, unless it is skipped, take its lease (fails the test
    when the lease is not granted within ``ct_lease_timeout``)."""
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
    settings = runtime.settings
    if skipped:
        item.user_properties += [("ct_lease_gib", 0.0), ("ct_lease_wait_s", 0.0)]
        return
    gib = need_gib if need_gib is not None else settings.default_vram_gib.value
    if worker.ledger is None or gib <= 0:
        item.user_properties += [("ct_lease_gib", 0.0), ("ct_lease_wait_s", 0.0)]
        return
    from pytest_ctresources.ledger import LeaseTimeout

    try:
        lease = worker.ledger.acquire(
            gib, settings.lease_timeout_s.value, before_waiting=runtime.free_cached_models
        )
    except (LeaseTimeout, ValueError) as exc:
        item.user_properties += [("ct_lease_gib", gib), ("ct_lease_wait_s", -1.0)]
        pytest.fail(f"{worker.binding.describe()}: {exc}", pytrace=False)
    item.stash[LEASE_KEY] = lease
    item.user_properties += [("ct_lease_gib", gib), ("ct_lease_wait_s", round(lease.waited_s, 3))]


def give_back(item: pytest.Item, runtime: Runtime) -> None:
    """Release the test's lease, if it took one."""
    lease = item.stash.get(LEASE_KEY, None)
    worker = runtime.worker_gpu
    if lease is not None and worker is not None and worker.ledger is not None:
        worker.ledger.release(lease)
        del item.stash[LEASE_KEY]
