"""Placing tests on GPUs by VRAM: the pure policy (no pytest, no torch, no I/O).

Given the run's GPUs (their capacity and how many workers share each) and its tests (a need
in GiB or None, a learned duration or None), this module decides

- which GPUs can hold each test (:func:`fitting`), and which tests no GPU of the run can hold
  (:func:`too_big_reason` names the largest GPU);
- the order in which they are handed out: largest first by duration, then by need (LPT), the
  tests that fewer GPUs can hold before those any GPU can (:class:`Dispatcher`), with a test
  started only where it fits the room left on its GPU;
- the share of each job of a CI matrix (:func:`shard`): every test once, on the smallest
  runner class that fits it, balanced by duration within the class;
- the predicted wall time of a plan (:func:`simulate`), by running the same dispatcher over
  simulated workers that need two queued tests to start one, as pytest-xdist's do.

Used by the xdist scheduler (:mod:`~pytest_ctresources.xdist.scheduler`), ``ct-resources
plan`` / ``pytest --ct-plan``, ``--ct-shard`` and ``bench/placement_sim.py``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pytest_ctresources.units import shown

#: Duration assumed for a test with no learned duration, when no test has one.
DEFAULT_DURATION_S = 1.0


@dataclass(frozen=True)
class Gpu:
    """One GPU of the run, as the scheduler sees it."""

    key: str
    """Identity: the GPU's UUID (a fake GPU's is qualified by its host's fake list)."""
    label: str
    """How messages name it: ``GPU 1 (NVIDIA H200)``."""
    capacity_gib: float
    """What the tests on it may lease in all (``--ct-vram-capacity`` where it caps)."""
    workers: int = 1


@dataclass(frozen=True)
class Demand:
    """One test as the scheduler sees it."""

    nodeid: str
    need_gib: float | None = None
    """GiB it leases (None: unknown or none; fits any worker)."""
    duration_s: float | None = None
    """Learned duration (None: not learned)."""


def fitting(need_gib: float | None, gpus: Sequence[Gpu]) -> tuple[str, ...]:
    """The keys of the GPUs that can hold a test of ``need_gib`` (all of them for None)."""
    if need_gib is None:
        return tuple(gpu.key for gpu in gpus)
    return tuple(gpu.key for gpu in gpus if need_gib <= gpu.capacity_gib)


def largest(gpus: Sequence[Gpu]) -> Gpu | None:
    """The run's largest GPU (the first of equals), None without GPUs."""
    return max(gpus, key=lambda gpu: gpu.capacity_gib, default=None)


def too_big_reason(need_gib: float, gpus: Sequence[Gpu]) -> str:
    """Why a test no GPU of the run can hold is skipped: the reason names the largest."""
    big = largest(gpus)
    if big is None:
        return f"needs {need_gib:.1f} GiB VRAM; no GPU in this run"
    return (
        f"needs {need_gib:.1f} GiB VRAM; the largest GPU in this run, {big.label}, "
        f"has {big.capacity_gib:.1f} GiB"
    )


def typical_duration(demands: Iterable[Demand]) -> float:
    """The duration assumed for a test with none learned: the median of the learned ones."""
    known = sorted(d.duration_s for d in demands if d.duration_s is not None)
    if not known:
        return DEFAULT_DURATION_S
    return known[len(known) // 2]


@dataclass(frozen=True)
class Fit:
    """What the plan says of one test."""

    gpus: tuple[str, ...]
    """Keys of the GPUs that may run it (for a skipped test: the largest, which reports it)."""
    skip_reason: str | None
    duration_s: float
    need_gib: float


def fits_of(
    gpus: Sequence[Gpu], demands: Sequence[Demand], default_duration: float | None = None
) -> list[Fit]:
    """Per test: where it may run, or why it is skipped. Without GPUs every test may run
    anywhere (the workers decide, as without this scheduler)."""
    default = typical_duration(demands) if default_duration is None else default_duration
    big = largest(gpus)
    out: list[Fit] = []
    for demand in demands:
        duration = demand.duration_s if demand.duration_s is not None else default
        need = demand.need_gib or 0.0
        keys = fitting(demand.need_gib, gpus) if gpus else ()
        reason = None
        if gpus and not keys and demand.need_gib is not None:
            assert big is not None
            keys, reason, duration, need = (
                (big.key,),
                too_big_reason(demand.need_gib, gpus),
                0.0,
                0.0,
            )
        out.append(Fit(keys, reason, duration, need))
    return out


class Dispatcher:
    """The pending tests of a run, handed out one at a time to a worker on a given GPU.

    A worker on GPU ``g`` gets, among the pending tests ``g`` can hold and that fit the room
    left on it, the first in this order: skipped tests (they cost nothing), then the tests the
    fewest GPUs can hold, then the longest, then the largest need (LPT). When none fits the
    room it gets nothing for now (:meth:`next_for` returns None) and asks again when a test
    on the GPU ends; :meth:`can_use` tells a worker with nothing left for its GPU apart.
    """

    def __init__(self, gpus: Sequence[Gpu], fits: Sequence[Fit]) -> None:
        self.gpus = {gpu.key: gpu for gpu in gpus}
        self.fits = list(fits)
        self._any_gpu = not gpus
        # One ordered list per GPU; the pending set is shared, lists are pruned lazily.
        self._pending: set[int] = set(range(len(fits)))
        self._queues: dict[str | None, list[int]] = {}
        for key in [*self.gpus, None]:
            eligible = [i for i, fit in enumerate(fits) if self._fits_on(i, key)]
            eligible.sort(key=self._rank)
            self._queues[key] = eligible
        self._cursor: dict[str | None, int] = dict.fromkeys(self._queues, 0)

    def _fits_on(self, i: int, key: str | None) -> bool:
        fit = self.fits[i]
        if self._any_gpu or key is None:
            # A worker without a GPU takes what needs none; without GPUs in the run, anything.
            return self._any_gpu or (fit.need_gib == 0.0 and fit.skip_reason is None)
        return key in fit.gpus

    def _rank(self, i: int) -> tuple[int, int, float, float, int]:
        fit = self.fits[i]
        skipped = 0 if fit.skip_reason is not None else 1
        return (skipped, len(fit.gpus), -fit.duration_s, -fit.need_gib, i)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def can_use(self, key: str | None) -> bool:
        """Whether a pending test is left that a worker on GPU ``key`` could run."""
        queue = self._queues.get(key, [])
        return any(i in self._pending for i in queue[self._cursor.get(key, 0) :])

    def next_for(self, key: str | None, room_gib: float | None) -> int | None:
        """Take the next test for a worker on GPU ``key`` with ``room_gib`` left on it
        (None: no limit); None when no pending test fits."""
        queue = self._queues.get(key, [])
        start = self._cursor.get(key, 0)
        while start < len(queue) and queue[start] not in self._pending:
            start += 1  # taken by another GPU's worker
        self._cursor[key] = start
        for position in range(start, len(queue)):
            i = queue[position]
            if i not in self._pending:
                continue
            if room_gib is None or self.fits[i].need_gib <= room_gib + 1e-9:
                self._pending.discard(i)
                return i
        return None

    def put_back(self, i: int) -> None:
        """A test handed out that must be handed out again (its worker went down)."""
        self._pending.add(i)
        for key, queue in self._queues.items():
            if i in queue:
                self._cursor[key] = min(self._cursor[key], queue.index(i))


# ----------------------------------------------------------------------------- simulation


@dataclass
class Worker:
    """A simulated worker: its GPU and its queue (xdist's workers run a test only once the
    next one is known, or a shutdown)."""

    name: str
    gpu: str | None
    queue: list[int] = field(default_factory=list)
    shutdown: bool = False
    running: int | None = None


@dataclass
class Outcome:
    """What a simulated run did."""

    wall_s: float
    ran: dict[int, str]
    """Test index -> the GPU it ran on."""
    skipped: dict[int, str]
    """Test index -> skip reason."""
    waited_s: float
    """Seconds workers spent waiting for room on their GPU, in all."""
    workers: dict[int, str] = field(default_factory=dict)
    """Test index -> the worker that ran (or skipped) it."""


class Policy:
    """How a simulated controller hands out tests (the xdist scheduler's decisions)."""

    def start(self, workers: list[Worker]) -> None:
        """Hand out the first tests."""
        raise NotImplementedError

    def completed(self, worker: Worker, workers: list[Worker]) -> None:
        """A test of ``worker`` ended: hand out more, or shut workers down."""
        raise NotImplementedError


class PlacementPolicy(Policy):
    """This scheduler's decisions, as :mod:`~pytest_ctresources.xdist.scheduler` makes them:
    :class:`Dispatcher` choices, two tests queued per worker (:func:`refill`)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def start(self, workers: list[Worker]) -> None:
        queues = [w.queue for w in workers]
        for depth in (1, 2):  # one test each first, so that the largest spread out
            for worker in workers:
                worker.shutdown = refill(
                    self.dispatcher,
                    worker.gpu,
                    worker.queue,
                    self._others(worker, workers, queues),
                    depth,
                )

    def completed(self, worker: Worker, workers: list[Worker]) -> None:
        queues = [w.queue for w in workers]
        for other in sorted(workers, key=lambda w: len(w.queue)):  # idle workers first
            if not other.shutdown:
                other.shutdown = refill(
                    self.dispatcher, other.gpu, other.queue, self._others(other, workers, queues)
                )

    def _others(
        self, worker: Worker, workers: list[Worker], queues: list[list[int]]
    ) -> list[list[float]]:
        fits = self.dispatcher.fits
        return [
            [fits[i].need_gib for i in queues[n]]
            for n, other in enumerate(workers)
            if other.gpu == worker.gpu and other is not worker
        ]


def room_for(capacity_gib: float, held_by_others: Iterable[Sequence[float]]) -> float:
    """The room a worker's next test may count on: the GPU less, for each other worker on it,
    the largest need among the tests queued there (one of them runs at a time)."""
    return capacity_gib - sum(max(needs, default=0.0) for needs in held_by_others)


def refill(
    dispatcher: Dispatcher,
    gpu_key: str | None,
    queue: list[int],
    others: Iterable[Sequence[float]],
    depth: int = 2,
) -> bool:
    """Top ``queue`` (a worker's tests not yet finished, the running one first) up to
    ``depth`` tests; returns whether the worker is to be shut down (nothing is left for it).

    The next test is one that fits the room the other workers on the GPU leave
    (:func:`room_for`); an idle worker with nothing that fits waits for room. A worker with
    one test queued gets a second whatever the room (it waits for its lease then), since an
    xdist worker starts a test only once it knows the next.
    """
    gpu = dispatcher.gpus.get(gpu_key) if gpu_key is not None else None
    others = [list(needs) for needs in others]
    room = None if gpu is None else room_for(gpu.capacity_gib, others)
    # Where nothing fits beside everything queued on the GPU, beside what runs there now.
    running = None if gpu is None else room_for(gpu.capacity_gib, [n[:1] for n in others])
    while len(queue) < depth:
        i = dispatcher.next_for(gpu_key, room)
        if i is None and len(queue) == 1:
            i = dispatcher.next_for(gpu_key, running)
            if i is None:
                i = dispatcher.next_for(gpu_key, None)
        if i is None:
            break
        queue.append(i)
    return len(queue) < depth and not dispatcher.can_use(gpu_key)


def simulate(
    gpus: Sequence[Gpu],
    fits: Sequence[Fit],
    policy: Policy,
    *,
    runs_on: Callable[[int, Gpu | None], str | None] | None = None,
) -> Outcome:
    """Run ``policy`` over simulated workers (``gpu.workers`` per GPU, ``gw<i>`` bound GPU
    after GPU round robin, as xdist's binding does) and return what happened.

    A test starts when its worker knows its next test (or is shut down) and its need fits
    what the tests running on its GPU leave (leases, the longest waiter first);
    ``runs_on(i, gpu)`` may return a skip reason for a test on a GPU it does not fit (the
    status quo's skip); by default the test's own :class:`Fit` decides.
    """
    by_key = {gpu.key: gpu for gpu in gpus}
    per_gpu = max((gpu.workers for gpu in gpus), default=1)
    order: list[str | None] = [
        gpu.key for depth in range(per_gpu) for gpu in gpus if depth < gpu.workers
    ]
    workers = [Worker(f"gw{n}", key) for n, key in enumerate(order or [None])]
    leased: dict[str | None, float] = {worker.gpu: 0.0 for worker in workers}
    waiting: dict[str | None, list[int]] = {key: [] for key in leased}
    ran: dict[int, str] = {}
    skipped: dict[int, str] = {}
    ran_by: dict[int, str] = {}
    events: list[tuple[float, int, int]] = []  # (end, sequence, worker position)
    state = {"now": 0.0, "waited": 0.0, "sequence": 0}
    wait_since: dict[int, float] = {}

    def try_start(position: int) -> None:
        worker = workers[position]
        if worker.running is not None or not worker.queue:
            return
        if len(worker.queue) < 2 and not worker.shutdown:
            return
        i = worker.queue[0]
        gpu = by_key.get(worker.gpu) if worker.gpu is not None else None
        reason = runs_on(i, gpu) if runs_on is not None else fits[i].skip_reason
        need = fits[i].need_gib if reason is None else 0.0
        if gpu is not None and leased[worker.gpu] + need > gpu.capacity_gib + 1e-9:
            if position not in waiting[worker.gpu]:
                waiting[worker.gpu].append(position)
                wait_since[position] = state["now"]
            return
        if position in waiting[worker.gpu]:
            waiting[worker.gpu].remove(position)
            state["waited"] += state["now"] - wait_since.pop(position)
        worker.running = i
        ran_by[i] = worker.name
        if reason is not None:
            skipped[i] = reason
            duration = 0.0
        else:
            ran[i] = worker.gpu or "cpu"
            leased[worker.gpu] += need
            duration = fits[i].duration_s
        state["sequence"] += 1
        heapq.heappush(events, (state["now"] + duration, int(state["sequence"]), position))

    policy.start(workers)
    for position in range(len(workers)):
        try_start(position)
    while events:
        state["now"], _sequence, position = heapq.heappop(events)
        worker = workers[position]
        i = worker.running
        assert i is not None
        worker.running = None
        worker.queue.pop(0)
        if i in ran:
            leased[worker.gpu] -= fits[i].need_gib
        policy.completed(worker, workers)
        for waiter in list(waiting[worker.gpu]):  # the longest waiter on this GPU first
            try_start(waiter)
        for candidate in range(len(workers)):
            try_start(candidate)
    return Outcome(state["now"], ran, skipped, state["waited"], ran_by)


def lower_bound(gpus: Sequence[Gpu], fits: Sequence[Fit]) -> float:
    """max(total work / worker slots, the longest test): the bound no schedule
    beats (it ignores which GPUs can hold which tests)."""
    slots = sum(gpu.workers for gpu in gpus) or 1
    run = [fit.duration_s for fit in fits if fit.skip_reason is None]
    return max(sum(run) / slots, max(run, default=0.0))


def fitted_lower_bound(gpus: Sequence[Gpu], fits: Sequence[Fit]) -> float:
    """A bound that counts where tests fit: for each capacity ``c`` of the run, the tests
    that only GPUs of at least ``c`` GiB hold, over those GPUs' worker slots (work) and over
    their GiB (need times duration) and, on equal GPUs, what cannot run beside the tests
    over half a GPU (:func:`_alone_bound`); and the longest test. No schedule beats it
    either."""
    bound = lower_bound(gpus, fits)
    run = [fit for fit in fits if fit.skip_reason is None]
    for c in sorted({gpu.capacity_gib for gpu in gpus}):
        below = [g.capacity_gib for g in gpus if g.capacity_gib < c]
        floor = max(below, default=-1.0)
        big = [g for g in gpus if g.capacity_gib >= c]
        only = [fit for fit in run if fit.need_gib > floor]
        slots = sum(g.workers for g in big)
        gib = sum(g.capacity_gib for g in big)
        bound = max(
            bound,
            sum(f.duration_s for f in only) / slots,
            sum(f.duration_s * f.need_gib for f in only) / gib,
            _alone_bound(big, only),
        )
    return bound


def _alone_bound(big: Sequence[Gpu], only: Sequence[Fit]) -> float:
    """Per GPU of the set: the tests over half its GiB run one at a time, and the tests that
    fit beside none of them run only while none of them does (at most as many at once as
    its workers and GiB allow). Exact for a set of equal GPUs, 0 otherwise."""
    capacity = big[0].capacity_gib
    if any(g.capacity_gib != capacity or g.workers != big[0].workers for g in big):
        return 0.0
    heavy = [f for f in only if f.need_gib > capacity / 2]
    if not heavy:
        return 0.0
    room = capacity - min(f.need_gib for f in heavy)
    apart = [f for f in only if room < f.need_gib <= capacity / 2]
    together = big[0].workers
    if apart:
        least = min(f.need_gib for f in apart)
        together = max(1, min(together, int(capacity // least)))
    heavy_s = sum(f.duration_s for f in heavy)
    apart_s = sum(f.duration_s for f in apart)
    return (heavy_s + apart_s / together) / len(big)


# -------------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class Share:
    """One job's share of a CI matrix."""

    job: int
    """1-based, as in ``--ct-shard K/N``."""
    runner_gib: float
    tests: tuple[int, ...]
    """Test indices, in the order given."""
    predicted_s: float


def shard(
    demands: Sequence[Demand], runner_gib: Sequence[float], default_duration: float | None = None
) -> list[Share]:
    """Split ``demands`` over the jobs of a matrix whose job ``k`` (1-based) has a GPU of
    ``runner_gib[k - 1]`` GiB: each test exactly once, in the smallest runner class that fits
    it (a test none fits goes to the largest class, which skips it), balanced by duration
    within the class (longest first to the least loaded job; ties to the lower job). The
    result depends only on the inputs, so every job of the matrix computes the same split."""
    if not runner_gib:
        raise ValueError("a matrix needs at least one job")
    default = typical_duration(demands) if default_duration is None else default_duration
    classes = sorted(set(runner_gib))
    jobs_of = {gib: [k for k, g in enumerate(runner_gib) if g == gib] for gib in classes}
    load = [0.0] * len(runner_gib)
    members: list[list[int]] = [[] for _ in runner_gib]

    def duration(i: int) -> float:
        d = demands[i].duration_s
        return default if d is None else d

    order = sorted(range(len(demands)), key=lambda i: (-duration(i), demands[i].nodeid))
    for i in order:
        need = demands[i].need_gib
        target = next((g for g in classes if need is None or need <= g), classes[-1])
        job = min(jobs_of[target], key=lambda k: (load[k], k))
        load[job] += duration(i) if need is None or need <= target else 0.0
        members[job].append(i)
    return [
        Share(k + 1, runner_gib[k], tuple(sorted(members[k])), load[k])
        for k in range(len(runner_gib))
    ]


#: The most jobs ``--ct-shard`` divides a suite among: more than any CI matrix runs.
MAX_JOBS = 1024


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/5"`` -> (2, 5); ValueError naming what is wrong."""
    k_text, sep, n_text = text.partition("/")
    try:
        k, n = int(k_text), int(n_text)
    except ValueError:
        raise ValueError(f"{shown(text)} is not K/N (e.g. 2/5)") from None
    if not sep or n < 1 or not 1 <= k <= n:
        raise ValueError(f"{shown(text)}: expected K/N with 1 <= K <= N")
    if n > MAX_JOBS:
        raise ValueError(f"{shown(text)}: at most {MAX_JOBS} jobs")
    return k, n
