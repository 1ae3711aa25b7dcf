"""The xdist scheduler (xdist/scheduler.py) and the worker's side of the channel
(xdist/exchange.py), driven without processes: fake nodes and a fake channel."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ctresources.gpu.detect import detect_gpus
from pytest_ctresources.xdist.exchange import Placed, PlacementWorker, WorkerGpu, worker_gpu
from pytest_ctresources.xdist.scheduler import PlacementController, VramScheduling

pytest.importorskip("xdist")


class FakeNode:
    def __init__(self, worker: str) -> None:
        self.workerinput = {"workerid": worker}
        self.gateway = SimpleNamespace(id=worker)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


class FakeConfig:
    """What the schedulers read of the config: the gateways and the chunk limit."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str) -> Any:
        return [f"{self.workers}*popen"] if name == "tx" else None

    def getoption(self, name: str, default: Any = None) -> Any:
        return default


class FakeChannel:
    TimeoutError = TimeoutError

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.inbox: list[Any] = []

    def send(self, message: Any) -> None:
        self.out.append(message)

    def receive(self, timeout: float | None = None) -> Any:
        if not self.inbox:
            raise self.TimeoutError
        return self.inbox.pop(0)


def test_a_workers_needs_are_read_as_data() -> None:
    """What a worker sends is data: an entry that is not a [node id, GiB] pair, or a need
    no float holds, raised in execnet's receiver thread, which closed the channel and errored
    every placed test. Such entries are left out, and a need out of range is no need."""
    controller = PlacementController(lambda: {})
    needs = [5, ["a", "b", "c"], [7, 1.0], ["t.py::big", 10**400], ["t.py::nan", float("nan")]]
    needs += [["t.py::true", True], ["t.py::ok", 60], ("t.py::small", 0.5), ["t.py::none", None]]
    controller._received("gw0", {"needs": needs})
    assert controller.needs == {
        "t.py::big": None,
        "t.py::nan": None,
        "t.py::true": None,
        "t.py::ok": 60.0,
        "t.py::small": 0.5,
        "t.py::none": None,
    }


def scheduler(
    gpus: dict[str, float], needs: dict[str, float | None]
) -> tuple[VramScheduling, list[FakeNode]]:
    controller = PlacementController(lambda: {})
    controller.gpus = {
        w: WorkerGpu(f"key-{gib}", f"GPU ({gib:g} GiB)", gib) for w, gib in gpus.items()
    }
    controller.needs = needs
    sched = VramScheduling(FakeConfig(len(gpus)), None, controller)  # type: ignore[arg-type]
    nodes = [FakeNode(w) for w in gpus]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, list(needs))
    sched.schedule()
    return sched, nodes


def run_all(sched: VramScheduling, nodes: list[FakeNode]) -> dict[str, str]:
    """Complete tests in turn until the run is done; the worker each test ran on."""
    ran: dict[str, str] = {}
    assert sched.collection is not None
    for _ in range(100):
        busy = [n for n in nodes if sched.node2pending[n]]
        if not busy:
            break
        for node in busy:
            pending = sched.node2pending[node]
            if len(pending) >= 2 or node.shutting_down:
                index = pending[0]
                ran[sched.collection[index]] = node.workerinput["workerid"]
                sched.mark_test_complete(node, index)
    return ran


def test_each_test_goes_to_a_worker_whose_gpu_holds_it() -> None:
    gpus = {"gw0": 24.0, "gw1": 80.0, "gw2": 24.0, "gw3": 80.0}
    needs: dict[str, float | None] = {
        "t10": 10,
        "t20": 20,
        "t30": 30,
        "t60": 60,
        "t90": 90,
        "none": None,
    }
    sched, nodes = scheduler(gpus, needs)
    ran = run_all(sched, nodes)
    assert sorted(ran) == sorted(needs)
    for test, worker in ran.items():
        if test in ("t30", "t60", "t90"):  # the 90 goes to the largest, which skips it
            assert gpus[worker] == 80.0, (test, worker)
    assert sched.tests_finished and not sched.has_pending
    assert all(node.shutting_down for node in nodes)


def test_gpus_all_alike_hand_the_run_to_xdists_load_scheduling() -> None:
    from xdist.scheduler import LoadScheduling

    sched, nodes = scheduler({"gw0": 24.0, "gw1": 24.0}, {"a": 5, "b": None})
    assert isinstance(sched.load, LoadScheduling)
    assert sorted(nodes[0].sent + nodes[1].sent) == [0, 1]


def test_a_crashed_workers_tests_are_handed_out_again() -> None:
    needs: dict[str, float | None] = {f"t{i}": 30.0 for i in range(6)}
    sched, nodes = scheduler({"gw0": 24.0, "gw1": 80.0, "gw2": 80.0}, needs)
    crashed = nodes[1]
    held = list(sched.node2pending[crashed])
    assert sched.remove_node(crashed) == sched.collection[held[0]]  # type: ignore[index]
    ran = run_all(sched, [nodes[0], nodes[2]])
    assert set(ran.values()) == {"gw2"}  # only the other 80 GiB worker holds them
    assert len(ran) == 6 - 1


def test_a_worker_reports_its_gpu_and_its_needs_and_names_the_largest_in_a_skip() -> None:
    facts = detect_gpus({"CT_FAKE_GPUS": "Small=24;Big=80"})
    gpu = worker_gpu(facts.gpus[1], facts, None, {"CT_FAKE_GPUS": "Small=24;Big=80"})
    assert gpu == WorkerGpu("Small=24;Big=80|GPU-fake-1", "GPU 1 (Big)", 80.0)
    capped = worker_gpu(facts.gpus[1], facts, 20.0, {"CT_FAKE_GPUS": "Small=24;Big=80"})
    assert capped is not None and capped.capacity_gib == 20.0 and capped.key.endswith("@20")
    channel = FakeChannel()
    worker = PlacementWorker(channel, lambda item: 12.0)
    worker.report_gpu(capped)
    assert channel.out == [capped.to_message()]
    channel.inbox.append(
        {"largest": [gpu.key, gpu.label, 80.0], "why": {"t": ["every", 1, "fits"], "u": "old"}}
    )
    assert worker.why("t") == Placed("every", 1, "fits")
    assert worker.why("u") is None  # not a reason this version sends: left out
    assert worker.explain_skip("needs 90.0 GiB VRAM; x", 90.0) == (
        "needs 90.0 GiB VRAM; x; the largest GPU in this run is GPU 1 (Big), 80.0 GiB"
    )
    assert worker.explain_skip("needs 30.0 GiB VRAM; x", 30.0) == "needs 30.0 GiB VRAM; x"
