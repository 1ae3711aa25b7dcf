"""Scheduling simulation (no GPU): the status quo, xdist's worksteal and VRAM placement.

A suite of 1,000 tests drawn from a seeded mix (many small CPU-bound or tiny-model tests,
some 10-40 GiB attributions, a few 60-90 GiB ones) on 2x80 + 4x24 GiB GPUs with two workers
per GPU. Each policy runs over the same simulated workers (``pytest_ctresources.xdist
.placement.simulate``): a worker starts a test once it knows the next one (or is shut down),
as xdist's do, and waits while the test's need does not fit what the tests running on its GPU
leave (the VRAM lease). Workers are bound round robin (``gw<i>`` -> GPU ``i mod 6``).

- ``load``: xdist 3.8's LoadScheduling (initial chunks of a quarter of each worker's share
  in collection order, refills when a worker's queue falls below its low watermark), the
  test skipped where its worker's GPU is too small (the plugin today);
- ``worksteal``: xdist 3.8's WorkStealingScheduling (the collection split evenly, an idle
  worker steals half the longest queue), same binding and skips;
- ``placement``: this plugin's scheduler (``Dispatcher``, ``refill``).

Also a suite where every test fits every GPU (needs <= 24 GiB), for the cost of placement
where it is not needed. Run: ``python bench/placement_sim.py`` (``--json`` for the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence

from pytest_ctresources.xdist.placement import (
    Demand,
    Dispatcher,
    Fit,
    Gpu,
    PlacementPolicy,
    Policy,
    Worker,
    fits_of,
    fitted_lower_bound,
    lower_bound,
    simulate,
)

GPUS = [
    Gpu("A", "GPU 0 (80 GiB)", 80.0, 2),
    Gpu("B", "GPU 1 (80 GiB)", 80.0, 2),
    *(Gpu(k, f"GPU {n} (24 GiB)", 24.0, 2) for n, k in enumerate("CDEF", start=2)),
]


def suite(seed: int, *, all_fit: bool = False, n: int = 1000) -> list[Demand]:
    """The mix: 70 % small (no need or 0.5-4 GiB, 0.2-6 s), 25 % attributions (10-40 GiB,
    15-120 s), 5 % large (60-90 GiB, 60-300 s); collection order shuffled. ``all_fit``
    draws the same durations with every need at most 24 GiB."""
    rng = random.Random(seed)
    out: list[Demand] = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.70:
            need = None if rng.random() < 0.5 else rng.uniform(0.5, 4.0)
            duration = rng.lognormvariate(0.0, 0.9) * 1.0
            duration = min(max(duration, 0.2), 6.0)
        elif kind < 0.95:
            need = rng.uniform(10.0, 40.0)
            duration = rng.uniform(15.0, 120.0)
        else:
            need = rng.uniform(60.0, 90.0)
            duration = rng.uniform(60.0, 300.0)
        if all_fit and need is not None:
            need = min(need, rng.uniform(1.0, 24.0))
        out.append(Demand(f"tests/test_{i // 20:03d}.py::test_{i}", need, duration))
    return out


def status_quo_skip(demands: Sequence[Demand]) -> Callable[[int, Gpu | None], str | None]:
    """Today's skip: the test's need against its own worker's GPU."""

    def runs_on(i: int, gpu: Gpu | None) -> str | None:
        need = demands[i].need_gib
        if gpu is None or need is None or need <= gpu.capacity_gib:
            return None
        return f"needs {need:.1f} GiB VRAM; {gpu.label} has {gpu.capacity_gib:.1f} GiB"

    return runs_on


def raw_fits(demands: Sequence[Demand]) -> list[Fit]:
    """Each test's duration and need as it is, for the status quo (no plan of the run)."""
    return [Fit((), None, d.duration_s or 1.0, d.need_gib or 0.0) for d in demands]


class LoadPolicy(Policy):
    """xdist 3.8 LoadScheduling: ``schedule`` and ``check_schedule``."""

    def __init__(self, count: int, maxschedchunk: int | None = None) -> None:
        self.pending = list(range(count))
        self.maxschedchunk = maxschedchunk if maxschedchunk is not None else count

    def start(self, workers: list[Worker]) -> None:
        if len(self.pending) < 2 * len(workers):
            for n in range(len(self.pending)):
                self._send(workers[n % len(workers)], 1)
        else:
            per = len(self.pending) // len(workers)
            chunk = max(min(per // 4, self.maxschedchunk), 2)
            for worker in workers:
                self._send(worker, chunk)
        if not self.pending:
            for worker in workers:
                worker.shutdown = True

    def completed(self, worker: Worker, workers: list[Worker]) -> None:
        if worker.shutdown:
            return
        if self.pending:
            low = max(2, len(self.pending) // len(workers) // 4)
            high = max(2, len(self.pending) // len(workers) // 2)
            if len(worker.queue) < low:
                self._send(
                    worker,
                    min(high - len(worker.queue), max(2 - len(worker.queue), self.maxschedchunk)),
                )
        else:
            worker.shutdown = True

    def _send(self, worker: Worker, num: int) -> None:
        worker.queue.extend(self.pending[:num])
        del self.pending[:num]


class WorkStealPolicy(Policy):
    """xdist 3.8 WorkStealingScheduling's ``check_schedule`` (a steal answered at once)."""

    MIN_PENDING = 2

    def __init__(self, count: int) -> None:
        self.pending = list(range(count))

    def start(self, workers: list[Worker]) -> None:
        self._check(workers)

    def completed(self, worker: Worker, workers: list[Worker]) -> None:
        self._check(workers)

    def _check(self, workers: list[Worker]) -> None:
        up = [w for w in workers if not w.shutdown]
        idle = [w for w in up if len(w.queue) < self.MIN_PENDING]
        if not idle:
            return
        if self.pending:
            for n, worker in enumerate(idle):
                num = len(self.pending) // (len(idle) - n)
                worker.queue.extend(self.pending[:num])
                del self.pending[:num]
            idle = [w for w in up if len(w.queue) < self.MIN_PENDING]
            if not idle:
                return
        victim = max(up, key=lambda w: len(w.queue), default=None)
        steal = 0
        if victim is not None:
            steal = min(len(victim.queue) // 2, max(0, len(victim.queue) - self.MIN_PENDING))
        if steal == 0:
            for worker in idle:
                worker.shutdown = True
            return
        assert victim is not None
        stolen = victim.queue[-steal:]
        del victim.queue[-steal:]
        self.pending.extend(stolen)
        self._check(workers)


def run_suite(demands: list[Demand]) -> dict[str, dict[str, float]]:
    fits = fits_of(GPUS, demands)
    raw = raw_fits(demands)
    holdable = sum(1 for fit in fits if fit.skip_reason is None)
    bound = lower_bound(GPUS, fits)
    fitted = fitted_lower_bound(GPUS, fits)
    out: dict[str, dict[str, float]] = {}
    for name, make_policy, use_fits, runs_on in (
        ("load", lambda: LoadPolicy(len(demands)), raw, status_quo_skip(demands)),
        ("worksteal", lambda: WorkStealPolicy(len(demands)), raw, status_quo_skip(demands)),
        ("placement", lambda: PlacementPolicy(Dispatcher(GPUS, fits)), fits, None),
    ):
        started = time.perf_counter()
        outcome = simulate(GPUS, use_fits, make_policy(), runs_on=runs_on)
        cpu = time.perf_counter() - started
        out[name] = {
            "ran": len(outcome.ran),
            "skipped": len(outcome.skipped),
            "skipped_holdable": len(outcome.skipped) - (len(demands) - holdable),
            "wall_s": round(outcome.wall_s, 1),
            "lower_bound_s": round(bound, 1),
            "wall_over_bound": round(outcome.wall_s / bound, 3),
            "fitted_bound_s": round(fitted, 1),
            "wall_over_fitted_bound": round(outcome.wall_s / fitted, 3),
            "lease_wait_s": round(outcome.waited_s, 1),
            "simulated_in_s": round(cpu, 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="suites drawn (seeds 0..N-1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = {
        "mixed": [run_suite(suite(seed)) for seed in range(args.seeds)],
        "all_fit": [run_suite(suite(seed, all_fit=True)) for seed in range(args.seeds)],
    }
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    for title, runs in results.items():
        print(
            f"{title} suite, 1,000 tests, 2x80 + 4x24 GiB, 2 workers per GPU, "
            f"seeds 0-{args.seeds - 1}"
        )
        print(
            f"  {'seed':>4} {'policy':<10} {'ran':>5} {'skipped':>7} {'holdable':>8} "
            f"{'wall s':>8} {'bound s':>8} {'/bound':>7} {'fitted':>8} {'/fitted':>7} "
            f"{'/load':>6} {'wait s':>8}"
        )
        for seed, run in enumerate(runs):
            for name, fig in run.items():
                print(
                    f"  {seed:>4} {name:<10} {fig['ran']:>5} {fig['skipped']:>7} "
                    f"{fig['skipped_holdable']:>8} {fig['wall_s']:>8.1f} "
                    f"{fig['lower_bound_s']:>8.1f} {fig['wall_over_bound']:>7.3f} "
                    f"{fig['fitted_bound_s']:>8.1f} {fig['wall_over_fitted_bound']:>7.3f} "
                    f"{fig['wall_s'] / run['load']['wall_s']:>6.3f} "
                    f"{fig['lease_wait_s']:>8.1f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
