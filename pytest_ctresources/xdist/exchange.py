"""What the controller and its workers tell each other for VRAM placement, over xdist's own
execnet gateway.

The controller opens one execnet channel per worker on that worker's gateway and ships it in
``workerinput`` (``pytest_configure_node``), as pytest-randomly ships its seed; execnet
carries channels inside the data it sends. Over it:

- the worker, at configure, sends its GPU: the one it was bound to (or the one it sees), its
  capacity (``--ct-vram-capacity`` where that caps it) and an identity (a real GPU's UUID; a
  fake GPU's is qualified by the worker's ``CT_FAKE_GPUS``, since every fake list numbers
  from ``GPU-fake-0``);
- the worker, at the end of its collection and before xdist's ``collectionfinish`` event,
  sends each collected test's need (marker, config, learned need, estimate: what its setup
  will decide by); messages of one gateway arrive in order, so the scheduler has them when
  every worker's collection is in;
- the controller sends, before handing a worker a test, why it placed the test there, and
  once the run's largest GPU, which the worker names in a VRAM skip.

Nothing here initialises CUDA or imports a test module in the controller: the worker knows
its GPU from NVML (or ``CT_FAKE_GPUS``) and its tests' needs from its own collection.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from pytest_ctresources.gpu.detect import GpuFacts, GpuInfo
from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV

#: ``workerinput`` key of the channel.
PLACEMENT_INPUT = "ct_placement_channel"

#: The scheduler's reasons (:attr:`Placed.kind`): the test fits only some of the run's GPUs,
#: fits every GPU, is too big for every GPU (sent to the largest, which skips it), or the run
#: has no GPU.
ONLY_SOME, EVERY, TOO_BIG, NO_GPU = "only some", "every", "too big", "no GPU"


class Placed(NamedTuple):
    """Why the VRAM scheduler sent a test to its worker: its ``kind`` of fit, how many other
    workers' tests on that GPU it was packed ``beside`` (0: alone), and the sentence a
    reader gets (``placed_because`` in the JSON report)."""

    kind: str
    beside: int
    because: str


@dataclass(frozen=True)
class WorkerGpu:
    """The GPU a worker runs its tests on, as it reports it."""

    key: str
    label: str
    capacity_gib: float

    def to_message(self) -> dict[str, Any]:
        return {"gpu": {"key": self.key, "label": self.label, "capacity_gib": self.capacity_gib}}

    @classmethod
    def from_message(cls, data: Mapping[str, Any]) -> WorkerGpu | None:
        try:
            return cls(str(data["key"]), str(data["label"]), float(data["capacity_gib"]))
        except (KeyError, TypeError, ValueError):
            return None


def worker_gpu(
    gpu: GpuInfo | None,
    facts: GpuFacts,
    capacity_gib: float | None,
    environ: Mapping[str, str] | None = None,
) -> WorkerGpu | None:
    """What a worker reports of ``gpu`` (None: it has none)."""
    if gpu is None:
        return None
    env = os.environ if environ is None else environ
    key = gpu.uuid or f"index-{gpu.index}"
    if facts.source == "fake":
        key = f"{env.get(FAKE_GPUS_ENV, '')}|{key}"
    capacity = gpu.total_gib
    if capacity_gib is not None and capacity_gib < capacity:
        capacity = capacity_gib
        key = f"{key}@{capacity_gib:g}"  # capped workers of one card are a class of their own
    # Named by its physical index, as the summary's placement lines do: a worker whose
    # CUDA_VISIBLE_DEVICES shows it one card calls that card GPU 0, whichever it is.
    number = gpu.physical_index if gpu.physical_index is not None else gpu.index
    return WorkerGpu(key, f"GPU {number} ({gpu.name})", capacity)


class PlacementWorker:
    """A worker's side: report the GPU and the needs, take the controller's notes."""

    name = "ctresources-xdist-placement-worker"

    def __init__(self, channel: Any, need_of: Callable[[pytest.Item], float | None]) -> None:
        self._channel = channel
        self._need_of = need_of
        self._why: dict[str, Placed] = {}
        self._largest: tuple[str, str, float] | None = None
        self._key: str | None = None

    def report_gpu(self, gpu: WorkerGpu | None) -> None:
        self._key = gpu.key if gpu is not None else None
        self._send(gpu.to_message() if gpu is not None else {"gpu": None})

    @pytest.hookimpl(tryfirst=True)  # before xdist's own hook sends "collectionfinish"
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._send({"needs": [[item.nodeid, self._need_of(item)] for item in session.items]})

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._channel.send(message)
        except (OSError, EOFError, ValueError):  # the controller closed it: xdist says why
            pass

    def _drain(self) -> None:
        while True:
            try:
                message = self._channel.receive(timeout=0)
            except self._channel.TimeoutError:
                return
            except (OSError, EOFError, ValueError):
                return
            if not isinstance(message, dict):
                continue
            why = message.get("why")
            if isinstance(why, dict):
                self._why.update(
                    {
                        str(nodeid): Placed(str(placed[0]), int(placed[1]), str(placed[2]))
                        for nodeid, placed in why.items()
                        if isinstance(placed, list) and len(placed) == 3
                    }
                )
            largest = message.get("largest")
            if isinstance(largest, list) and len(largest) == 3:
                self._largest = (str(largest[0]), str(largest[1]), float(largest[2]))

    def why(self, nodeid: str) -> Placed | None:
        """Why the controller placed this test here (None: it did not say)."""
        self._drain()
        return self._why.get(nodeid)

    def explain_skip(self, reason: str, need_gib: float) -> str:
        """A VRAM skip names the run's largest GPU, where no GPU of the run holds the test."""
        self._drain()
        if self._largest is None or need_gib <= self._largest[2]:
            return reason
        key, label, capacity = self._largest
        if key == self._key:
            return f"{reason}, the largest GPU in this run"
        return f"{reason}; the largest GPU in this run is {label}, {capacity:.1f} GiB"


def placement_channel(config: pytest.Config) -> Any:
    """In a worker: the controller's placement channel (None: not a worker, or a controller
    that does not place)."""
    workerinput = getattr(config, "workerinput", None)
    if not isinstance(workerinput, dict):
        return None
    return workerinput.get(PLACEMENT_INPUT)
