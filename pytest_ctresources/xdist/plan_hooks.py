"""``pytest --ct-plan`` and ``--ct-shard K/N``: the hooks, over the pure
:mod:`~pytest_ctresources.xdist.plan` and :mod:`~pytest_ctresources.xdist.placement`.

Both read each collected test's need the way its setup will (``need_of``) and the durations
learned in earlier runs (:mod:`~pytest_ctresources.report.durations`). Registered only when
their option is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest

from pytest_ctresources.gpu.detect import GpuFacts
from pytest_ctresources.xdist.placement import Demand, shard
from pytest_ctresources.xdist.plan import Plan, PlanGpu, make_plan, parse_gpus

__all__ = ["PLAN_KEY", "PlanGpu", "PlanReporter", "ShardSelection", "detected_gpus", "plan_gpus"]

#: The plan ``--ct-plan`` made (read by ``ct-resources plan``).
PLAN_KEY = pytest.StashKey[Plan]()

NeedOf = Callable[[pytest.Item], float | None]


def demands_of(
    items: Sequence[pytest.Item], need_of: NeedOf, durations: Mapping[str, float]
) -> list[Demand]:
    return [Demand(item.nodeid, need_of(item), durations.get(item.nodeid)) for item in items]


def detected_gpus(facts: GpuFacts, capacity_gib: float | None) -> list[PlanGpu]:
    """The GPUs detected, each capped at ``--ct-vram-capacity`` where given."""
    out = []
    for gpu in facts.gpus:
        gib = gpu.total_gib if capacity_gib is None else min(capacity_gib, gpu.total_gib)
        # Rounded as the plan shows it, never to nothing (a capacity of 1e-4 GiB divided by 0).
        out.append(PlanGpu(gpu.name, round(gib, 3) or gib))
    return out


class PlanReporter:
    """``--ct-plan``: the run collects only; the plan is printed after collection."""

    name = "ctresources-plan"

    def __init__(
        self,
        config: pytest.Config,
        gpus: Callable[[], list[PlanGpu]],
        workers: int,
        need_of: NeedOf,
        durations: Callable[[], Mapping[str, float]],
    ) -> None:
        self._config = config
        self._gpus = gpus
        self._workers = workers
        self._need_of = need_of
        self._durations = durations

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        gpus = self._gpus()
        if not gpus:
            raise pytest.UsageError(
                "--ct-plan: no GPU detected; name the GPUs (e.g. --ct-plan 2x80,4x24)"
            )
        plan = make_plan(
            gpus, self._workers, demands_of(session.items, self._need_of, self._durations())
        )
        self._config.stash[PLAN_KEY] = plan
        reporter = self._config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            for line in plan.lines(per_test=self._config.get_verbosity() >= 0):
                reporter.write_line(line)


def plan_gpus(text: str, detected: Callable[[], list[PlanGpu]]) -> Callable[[], list[PlanGpu]]:
    if text.strip().lower() == "detected":
        return detected
    return lambda: parse_gpus(text)


class ShardSelection:
    """``--ct-shard K/N``: keep job K's share of the collected tests, deselect the rest."""

    name = "ctresources-shard"

    def __init__(
        self,
        job: int,
        jobs: int,
        runner_gib: Callable[[], list[float]],
        need_of: NeedOf,
        durations: Callable[[], Mapping[str, float]],
    ) -> None:
        self._job = job
        self._jobs = jobs
        self._runner_gib = runner_gib
        self._need_of = need_of
        self._durations = durations

    def runners(self) -> list[float]:
        gib = self._runner_gib()
        if len(gib) == 1:
            return gib * self._jobs
        if len(gib) != self._jobs:
            raise pytest.UsageError(
                f"--ct-runner-gpus names {len(gib)} job(s) but --ct-shard has {self._jobs}: "
                "give one GPU for all jobs or one per job"
            )
        return gib

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        shares = shard(demands_of(items, self._need_of, self._durations()), self.runners())
        keep = set(shares[self._job - 1].tests)
        kept = [item for i, item in enumerate(items) if i in keep]
        dropped = [item for i, item in enumerate(items) if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
