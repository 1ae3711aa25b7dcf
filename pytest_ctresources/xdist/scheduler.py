"""The xdist scheduler that places tests by VRAM (``pytest_xdist_make_scheduler``).

Taken by a run that asks for the plugin as a whole and distributes with xdist's ``load``
(what ``-n N`` uses; ``--dist loadfile``, ``loadscope``, ``each`` and the others keep
xdist's own schedulers). It follows xdist 3.8's ``LoadScheduling`` (every worker collects,
the collections must agree, a worker runs a test once it knows the next one), but hands out
one test at a time, chosen by :mod:`~pytest_ctresources.xdist.placement`'s
:class:`~pytest_ctresources.xdist.placement.Dispatcher`: only to a worker whose GPU holds it,
first where it fits the room the other workers on that GPU leave, largest first. A test no
GPU of the run holds goes to a worker on the largest, which skips it naming that GPU.
Where the workers' GPUs all have the same capacity (or there are none), every worker holds
what any holds: the scheduler hands the run to xdist's own ``LoadScheduling``, unchanged.

The workers' GPUs and the tests' needs come over :mod:`~pytest_ctresources.xdist.exchange`'s
channel; durations from earlier runs (:mod:`~pytest_ctresources.report.durations`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from pytest_ctresources.units import MAX_GIB, named_pair
from pytest_ctresources.xdist.exchange import (
    EVERY,
    NO_GPU,
    ONLY_SOME,
    PLACEMENT_INPUT,
    TOO_BIG,
    Placed,
    WorkerGpu,
)
from pytest_ctresources.xdist.placement import (
    Demand,
    Dispatcher,
    Fit,
    Gpu,
    fits_of,
    largest,
    refill,
)


class PlacementController:
    """The controller's side: a channel per worker, what the workers report, the scheduler."""

    name = "ctresources-xdist-placement"

    def __init__(self, durations: Callable[[], Mapping[str, float]]) -> None:
        self._durations = durations
        self._lock = threading.Lock()
        self.gpus: dict[str, WorkerGpu | None] = {}
        """Worker id -> its GPU (None: it has none)."""
        self.needs: dict[str, float | None] | None = None
        self.channels: dict[str, Any] = {}
        self.scheduler: VramScheduling | None = None

    def pytest_configure_node(self, node: Any) -> None:
        worker = str(node.workerinput.get("workerid", node.gateway.id))
        channel = node.gateway.newchannel()
        channel.setcallback(lambda message: self._received(worker, message))
        node.workerinput[PLACEMENT_INPUT] = channel
        self.channels[worker] = channel

    def _received(self, worker: str, message: object) -> None:
        # Runs in execnet's receiver thread, before the same worker's later xdist events.
        if not isinstance(message, dict):
            return
        with self._lock:
            if "gpu" in message:
                data = message["gpu"]
                self.gpus[worker] = WorkerGpu.from_message(data) if data else None
            needs = message.get("needs")
            if self.needs is None and isinstance(needs, list):
                self.needs = dict(_needs(needs))

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "load":
            return None
        self.scheduler = VramScheduling(config, log, self)
        return self.scheduler

    def tell(self, worker: str, message: dict[str, Any]) -> None:
        channel = self.channels.get(worker)
        if channel is None:
            return
        try:
            channel.send(message)
        except (OSError, EOFError, ValueError):
            pass  # the worker is gone: xdist reports it

    def durations(self) -> Mapping[str, float]:
        return self._durations()


def _worker_id(node: Any) -> str:
    return str(node.workerinput.get("workerid", node.gateway.id))


class VramScheduling:
    """xdist's ``Scheduling`` protocol, placing by VRAM (see the module)."""

    def __init__(self, config: pytest.Config, log: Any, controller: PlacementController) -> None:
        from xdist.workermanage import parse_tx_spec_config

        self.numnodes = len(parse_tx_spec_config(config))
        self.config = config
        self.log = log.vramsched if log is not None else (lambda *args: None)
        self.controller = controller
        self.node2collection: dict[Any, list[str]] = {}
        self.node2pending: dict[Any, list[int]] = {}
        self.collection: list[str] | None = None
        self.dispatcher: Dispatcher | None = None
        self.fits: list[Fit] = []
        self._log = log
        self.load: Any = None
        """xdist's own LoadScheduling, where the run's GPUs are all alike (see schedule)."""

    # -- the protocol's state -------------------------------------------------------------
    @property
    def nodes(self) -> list[Any]:
        return list(self.node2pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if self.load is not None:
            return bool(self.load.tests_finished)
        if not self.collection_is_completed or self.dispatcher is None:
            return False
        if self.dispatcher.pending:
            return False
        return all(len(pending) < 2 for pending in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        if self.load is not None:
            return bool(self.load.has_pending)
        if self.dispatcher is not None and self.dispatcher.pending:
            return True
        return any(self.node2pending.values())

    # -- nodes ----------------------------------------------------------------------------
    def add_node(self, node: Any) -> None:
        if self.load is not None:
            return self.load.add_node(node)  # type: ignore[no-any-return]
        assert node not in self.node2pending
        self.node2pending[node] = []

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        if self.load is not None:
            return self.load.add_node_collection(node, collection)  # type: ignore[no-any-return]
        assert node in self.node2pending
        if self.collection_is_completed and self.collection is not None:
            if list(collection) != self.collection:
                from xdist.report import report_collection_diff

                other = next(iter(self.node2collection))
                self.log(
                    report_collection_diff(
                        self.collection, collection, other.gateway.id, node.gateway.id
                    )
                )
                return
        self.node2collection[node] = list(collection)

    def remove_node(self, node: Any) -> str | None:
        if self.load is not None:
            return self.load.remove_node(node)  # type: ignore[no-any-return]
        pending = self.node2pending.pop(node)
        if not pending:
            return None
        assert self.collection is not None and self.dispatcher is not None
        crashitem = self.collection[pending.pop(0)]
        for index in pending:
            self.dispatcher.put_back(index)
        self._check_all()
        return crashitem

    # -- tests ----------------------------------------------------------------------------
    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        if self.load is not None:
            return self.load.mark_test_complete(node, item_index, duration)  # type: ignore[no-any-return]
        self.node2pending[node].remove(item_index)
        self._check_all()

    def mark_test_pending(self, item: str) -> None:
        if self.load is not None:
            return self.load.mark_test_pending(item)  # type: ignore[no-any-return]
        assert self.collection is not None and self.dispatcher is not None
        self.dispatcher.put_back(self.collection.index(item))
        self._check_all()

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        raise NotImplementedError()

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.load is not None:
            return self.load.schedule()  # type: ignore[no-any-return]
        if self.collection is None and len({g.capacity_gib for g in self._gpus()}) <= 1:
            # GPUs all alike (or none): every worker's GPU holds what any does; xdist's own
            # scheduler, with the state gathered so far, as a run without placement has.
            from xdist.scheduler import LoadScheduling

            self.load = LoadScheduling(self.config, self._log)
            self.load.numnodes = self.numnodes
            self.load.node2collection = self.node2collection
            self.load.node2pending = self.node2pending
            return self.load.schedule()  # type: ignore[no-any-return]
        if self.collection is not None:
            self._check_all()
            return
        if not self._same_collections():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        gpus = self._gpus()
        needs = self.controller.needs or {}
        durations = self.controller.durations()
        demands = [
            Demand(nodeid, needs.get(nodeid), durations.get(nodeid)) for nodeid in self.collection
        ]
        self.fits = fits_of(gpus, demands)
        self.dispatcher = Dispatcher(gpus, self.fits)
        big = largest(gpus)
        if big is not None and len(gpus) > 1:
            for node in self.nodes:
                self.controller.tell(
                    _worker_id(node), {"largest": [big.key, big.label, big.capacity_gib]}
                )
        if not self.collection:
            for node in self.nodes:
                node.shutdown()
            return
        for depth in (1, 2):  # one test each first, so that the largest spread out
            for node in self.nodes:
                self._check(node, depth)

    def _gpus(self) -> list[Gpu]:
        reports = [self.controller.gpus.get(_worker_id(node)) for node in self.nodes]
        count: dict[str, int] = {}
        first: dict[str, WorkerGpu] = {}
        for report in reports:
            if report is not None:
                count[report.key] = count.get(report.key, 0) + 1
                first.setdefault(report.key, report)
        return [Gpu(key, first[key].label, first[key].capacity_gib, n) for key, n in count.items()]

    def _key(self, node: Any) -> str | None:
        report = self.controller.gpus.get(_worker_id(node))
        return report.key if report is not None else None

    def _check_all(self) -> None:
        # The idlest workers first: a busy worker must not take what an idle one could run.
        for node in sorted(self.nodes, key=lambda node: len(self.node2pending[node])):
            self._check(node)

    def _check(self, node: Any, depth: int = 2) -> None:
        if node.shutting_down or self.dispatcher is None:
            return
        key = self._key(node)
        pending = self.node2pending[node]
        others = [
            [self.fits[i].need_gib for i in other_pending]
            for other, other_pending in self.node2pending.items()
            if other is not node and self._key(other) == key
        ]
        before = len(pending)
        shut = refill(self.dispatcher, key, pending, others, depth)
        new = pending[before:]
        if new:
            self._explain(node, key, new, others)
            node.send_runtest_some(new)
        if shut:
            node.shutdown()

    def _explain(
        self, node: Any, key: str | None, indices: list[int], others: list[list[float]]
    ) -> None:
        assert self.collection is not None and self.dispatcher is not None
        gpus = self.dispatcher.gpus
        busy = [max(needs) for needs in others if needs]
        beside = (
            f"packed beside {len(busy)} worker(s) holding up to {sum(busy):.1f} GiB"
            if busy
            else "alone on its GPU"
        )
        why: dict[str, Placed] = {}
        for index in indices:
            fit = self.fits[index]
            nodeid = self.collection[index]
            if fit.skip_reason is not None:
                why[nodeid] = Placed(
                    TOO_BIG, 0, "too big for every GPU: sent to the largest, which skips it"
                )
            elif key is None or not gpus:
                why[nodeid] = Placed(NO_GPU, 0, "no GPU: any worker")
            elif len(fit.gpus) == len(gpus):
                why[nodeid] = Placed(EVERY, len(busy), f"fits every GPU; {beside}")
            else:
                names = ", ".join(gpus[k].label for k in fit.gpus)
                because = f"needs {fit.need_gib:.1f} GiB: only {names} hold(s) it; {beside}"
                why[nodeid] = Placed(ONLY_SOME, len(busy), because)
        # execnet carries lists, not named tuples.
        self.controller.tell(_worker_id(node), {"why": {k: list(v) for k, v in why.items()}})

    def _same_collections(self) -> bool:
        from xdist.report import report_collection_diff

        items = list(self.node2collection.items())
        first_node, first = items[0]
        same = True
        for node, collection in items[1:]:
            message = report_collection_diff(
                first, collection, first_node.gateway.id, node.gateway.id
            )
            if message:
                same = False
                self.log(message)
                self.config.hook.pytest_collectreport(
                    report=pytest.CollectReport(
                        nodeid=node.gateway.id, outcome="failed", longrepr=message, result=[]
                    )
                )
        return same


def _needs(entries: list[Any]) -> Iterator[tuple[str, float | None]]:
    """A worker's ``needs`` message, read as data: ``[node id, GiB or None]`` pairs, a need
    a float holds and no more than a GPU can (an entry that is not a pair, or a 400-digit
    need, raised in execnet's receiver thread, which closed the channel: every placed test
    errored). Anything else is no need."""
    for entry in entries:
        if (pair := named_pair(entry)) is None:
            continue
        nodeid, gib = pair
        if isinstance(gib, int | float) and not isinstance(gib, bool) and 0 < gib <= MAX_GIB:
            yield nodeid, float(gib)
        else:
            yield nodeid, None
