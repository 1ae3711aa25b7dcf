"""Which GPU each pytest-xdist worker uses.

A worker is bound to one GPU by narrowing its ``CUDA_VISIBLE_DEVICES`` to that GPU before
anything in it can initialise CUDA (``pytest_load_initial_conftests``, before conftests are
imported). The choice is made on the worker's own host, from that host's visible GPUs (a
``CUDA_VISIBLE_DEVICES`` the user set is respected: workers are spread over those devices
only), round robin by worker number: ``gw<i>`` gets visible GPU ``i mod n``; a worker that
replaces a crashed one takes the GPU with the fewest workers (a seat board of OS-released
locks, :class:`~pytest_ctresources.leases.ledger.SeatBoard`). Several workers on one GPU share it
under the VRAM lease budget (:mod:`~pytest_ctresources.leases.ledger`).

The GPU is named by its UUID in the new ``CUDA_VISIBLE_DEVICES``: NVML numbers GPUs in PCI bus
order while CUDA's default order is fastest first, so an index could name another GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

from pytest_ctresources.gpu.detect import GpuFacts, GpuInfo
from pytest_ctresources.gpu.visible_devices import VISIBLE_DEVICES_ENV
from pytest_ctresources.xdist.roles import WORKER_ENV

WORKER_COUNT_ENV = "PYTEST_XDIST_WORKER_COUNT"
TESTRUN_ENV = "PYTEST_XDIST_TESTRUNUID"
#: xdist's worker ids, ``gw0`` to ...: ASCII digits, and few (a 5000-digit one was a
#: traceback at start-up: int() reads at most 4300).
_WORKER_ID = re.compile(r"gw([0-9]{1,9})$")


@dataclass(frozen=True)
class Binding:
    """The GPU an xdist worker was bound to."""

    worker: str
    gpu: GpuInfo
    """The GPU as the host lists it before binding (its index among the visible GPUs)."""
    visible_before: str | None
    """``CUDA_VISIBLE_DEVICES`` before binding (None: unset)."""

    def undo(self, environ: MutableMapping[str, str]) -> None:
        """Give ``CUDA_VISIBLE_DEVICES`` back its value from before the binding."""
        if self.visible_before is None:
            environ.pop(VISIBLE_DEVICES_ENV, None)
        else:
            environ[VISIBLE_DEVICES_ENV] = self.visible_before

    def describe(self) -> str:
        physical = self.gpu.physical_index
        where = f", physical {physical}" if physical is not None else ""
        return f"{self.worker} -> {self.gpu.describe()}{where}"


def worker_number(worker: str) -> int | None:
    """``gw3`` -> 3; None for anything else (not an xdist worker id)."""
    match = _WORKER_ID.match(worker)
    return int(match.group(1)) if match else None


def choose_gpu(facts: GpuFacts, number: int) -> GpuInfo | None:
    """The visible GPU for worker ``gw<number>``: round robin, None when there is no GPU."""
    if not facts.gpus:
        return None
    return facts.gpus[number % len(facts.gpus)]


def choose_position(number: int, worker_count: int, taken: list[int]) -> int:
    """The GPU position for worker ``gw<number>``, given the seats ``taken`` per GPU.

    Round robin (``number mod n``) while that GPU has fewer workers than its share
    (``ceil(worker_count / n)``): the usual start. Otherwise, as for a worker that replaces a
    crashed one, the GPU with the fewest workers (ties: the next after the round-robin one).
    """
    n = len(taken)
    preferred = number % n
    share = -(-max(worker_count, 1) // n)
    if taken[preferred] < share:
        return preferred
    return min(range(n), key=lambda i: (taken[i], (i - preferred) % n))


class Seats(Protocol):
    """Where the run's workers on this host sit
    (:class:`~pytest_ctresources.leases.ledger.SeatBoard`)."""

    def choose_and_sit(self, choose: Callable[[list[int]], int], n_gpus: int) -> int: ...


def bind_worker(
    environ: MutableMapping[str, str], facts: GpuFacts, seats: Seats | None = None
) -> Binding | None:
    """Bind this process to its GPU if it is an xdist worker and GPUs are visible.

    ``facts`` are the host's visible GPUs, detected before binding; ``seats``, when given,
    lets a worker that replaces a crashed one take the GPU the crashed one left (without it:
    plain round robin). Narrows ``environ["CUDA_VISIBLE_DEVICES"]`` and returns the binding;
    None when not a worker or no GPU is visible (nothing changes).
    """
    worker = environ.get(WORKER_ENV)
    number = worker_number(worker) if worker else None
    if worker is None or number is None or not facts.gpus:
        return None
    count = _int(environ.get(WORKER_COUNT_ENV)) or number + 1
    n = len(facts.gpus)
    if seats is not None:
        position = seats.choose_and_sit(lambda taken: choose_position(number, count, taken), n)
    else:
        position = number % n
    gpu = facts.gpus[position]
    before = environ.get(VISIBLE_DEVICES_ENV)
    environ[VISIBLE_DEVICES_ENV] = gpu.uuid if gpu.uuid is not None else str(gpu.index)
    return Binding(worker, gpu, before)


def plan_line(facts: GpuFacts, worker_count: int | None) -> str | None:
    """The controller's ``-v`` header line: how workers will be spread over this host's GPUs."""
    if not facts.gpus or not worker_count:
        return None
    names = ", ".join(
        f"gw{i} -> GPU {choose_gpu(facts, i).index}"  # type: ignore[union-attr]
        for i in range(min(worker_count, 8))
    )
    more = ", ..." if worker_count > 8 else ""
    return (
        f"xdist: {worker_count} worker(s) bound round robin to {len(facts.gpus)} GPU(s) "
        f"on their host ({names}{more}); ct_gpu_binding=auto"
    )


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def testrun_id(environ: Mapping[str, str]) -> str:
    """The run's id, shared by its workers (xdist's ``--testrunuid``)."""
    return environ.get(TESTRUN_ENV) or "local"
