"""The plan of a run before it runs: which tests run on which GPU, which skip and why, and the
predicted wall time (``pytest --ct-plan`` and ``ct-resources plan``).

Pure: GPUs and tests in, a :class:`Plan` out, as text or JSON. The plan is the VRAM
scheduler's own policy (:mod:`~pytest_ctresources.xdist.placement`) run over simulated
workers, with the durations learned in earlier runs (a test without one is assumed to take
the median of those learned, 1 s when none is).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_ctresources.units import MAX_GIB, shown
from pytest_ctresources.xdist.placement import (
    Demand,
    Dispatcher,
    Gpu,
    PlacementPolicy,
    fits_of,
    fitted_lower_bound,
    lower_bound,
    simulate,
    typical_duration,
)

#: GPU names ``--gpus`` accepts, and the GiB a test may take on them: the H200's is CUDA's
#: total as measured here (docs/architecture.md), the RTX 4090's CUDA's usual 23.6 GiB; the
#: others are the vendor's nominal memory (CUDA reports slightly less: give GiB to be exact).
GPU_NAMES: Mapping[str, float] = {
    "H200": 139.8,
    "H100": 80.0,
    "H100-80GB": 80.0,
    "A100-80GB": 80.0,
    "A100-40GB": 40.0,
    "L40S": 48.0,
    "L4": 24.0,
    "A10G": 24.0,
    "RTX-4090": 23.6,
    "RTX-3090": 24.0,
    "T4": 16.0,
}

_COUNT = re.compile(r"^([0-9]+)\s*[xX*]\s*(.+)$")
#: The most GPUs a plan or a shard's runners name: more than any matrix has, few enough
#: that simulating them stays instant.
MAX_GPUS = 256


@dataclass(frozen=True)
class PlanGpu:
    """A GPU of the plan: its name (as given) and capacity."""

    name: str
    capacity_gib: float


def parse_gpus(text: str) -> list[PlanGpu]:
    """``"2x80,4x24"``, ``"H200"``, ``"2xA100-80GB,RTX-4090"`` -> the GPUs, in order.
    ValueError naming the bad entry and the names known."""
    out: list[PlanGpu] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        match = _COUNT.match(entry)
        digits, what = (match.group(1), match.group(2).strip()) if match else ("1", entry)
        # Many digits are over MAX_GPUS anyway (and int() refuses more than 4300 of them).
        count = int(digits) if len(digits) <= 6 else MAX_GPUS + 1
        if count < 1:
            raise ValueError(f"{shown(entry)}: the count must be at least 1")
        name = what.upper()
        gib = GPU_NAMES.get(name) or _gib(what)
        if gib is not None and not 0 < gib <= MAX_GIB:  # NaN too
            raise ValueError(f"{shown(entry)}: a GPU of more than 0 and at most {MAX_GIB:g} GiB")
        if gib is None:
            known = ", ".join(GPU_NAMES)
            raise ValueError(
                f"{shown(entry)} is neither GiB (e.g. 2x80) nor a GPU name; names known: {known}"
            )
        name = name if name in GPU_NAMES else f"{gib:g} GiB"
        if len(out) + count > MAX_GPUS:
            raise ValueError(f"{shown(text)} names more than {MAX_GPUS} GPUs")
        out.extend([PlanGpu(name, gib)] * count)
    if not out:
        raise ValueError(f"{shown(text)} names no GPU (e.g. 2x80,4x24)")
    return out


def _gib(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class PlannedTest:
    nodeid: str
    need_gib: float | None
    duration_s: float
    duration_learned: bool
    gpu: str | None
    """Label of the GPU it is planned on (None: skipped)."""
    worker: str | None
    skip_reason: str | None


@dataclass(frozen=True)
class Plan:
    gpus: tuple[Gpu, ...]
    tests: tuple[PlannedTest, ...]
    predicted_wall_s: float
    lower_bound_s: float
    fitted_lower_bound_s: float
    assumed_duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [
                {"label": g.label, "capacity_gib": g.capacity_gib, "workers": g.workers}
                for g in self.gpus
            ],
            "predicted_wall_s": round(self.predicted_wall_s, 3),
            "lower_bound_s": round(self.lower_bound_s, 3),
            "fitted_lower_bound_s": round(self.fitted_lower_bound_s, 3),
            "assumed_duration_s": self.assumed_duration_s,
            "tests": [
                {
                    "nodeid": t.nodeid,
                    "need_gib": t.need_gib,
                    "duration_s": round(t.duration_s, 4),
                    "duration_learned": t.duration_learned,
                    "gpu": t.gpu,
                    "worker": t.worker,
                    "skip_reason": t.skip_reason,
                }
                for t in self.tests
            ],
        }

    def lines(self, *, per_test: bool = True) -> list[str]:
        skipped = [t for t in self.tests if t.skip_reason is not None]
        learned = sum(1 for t in self.tests if t.duration_learned)
        workers = sorted({g.workers for g in self.gpus})
        each = f"{workers[0]} worker(s) each" if len(workers) == 1 else "workers as given"
        out = [
            f"ctresources plan: {len(self.tests)} test(s) on {len(self.gpus)} GPU(s), {each}; "
            f"predicted wall time {self.predicted_wall_s:.1f} s (lower bound "
            f"{self.fitted_lower_bound_s:.1f} s)",
            f"  durations: {learned} learned, {len(self.tests) - learned} assumed "
            f"{self.assumed_duration_s:.2f} s",
        ]
        for gpu in self.gpus:
            mine = [t for t in self.tests if t.gpu == gpu.label and t.skip_reason is None]
            work = sum(t.duration_s for t in mine)
            out.append(
                f"  {gpu.label}, {gpu.capacity_gib:.1f} GiB: {len(mine)} test(s), "
                f"{work:.1f} s of work"
            )
        if skipped:
            out.append(f"  skipped: {len(skipped)} test(s)")
        if per_test:
            for t in self.tests:
                need = "no need" if t.need_gib is None else f"{t.need_gib:.1f} GiB"
                where = f"skips: {t.skip_reason}" if t.skip_reason else f"{t.gpu} [{t.worker}]"
                out.append(f"    {t.nodeid}: {where}; {need}, {t.duration_s:.2f} s")
        return out


def make_plan(gpus: Sequence[PlanGpu], workers_per_gpu: int, demands: Sequence[Demand]) -> Plan:
    """The plan for ``demands`` on ``gpus`` with ``workers_per_gpu`` workers each."""
    run = tuple(
        Gpu(f"gpu{n}", f"GPU {n} ({gpu.name})", gpu.capacity_gib, workers_per_gpu)
        for n, gpu in enumerate(gpus)
    )
    assumed = typical_duration(demands)
    fits = fits_of(run, demands, assumed)
    outcome = simulate(run, fits, PlacementPolicy(Dispatcher(run, fits)))
    labels = {gpu.key: gpu.label for gpu in run}
    tests = tuple(
        PlannedTest(
            demand.nodeid,
            demand.need_gib,
            fit.duration_s,
            demand.duration_s is not None,
            labels.get(outcome.ran.get(i, ""), None),
            outcome.workers.get(i),
            fit.skip_reason,
        )
        for i, (demand, fit) in enumerate(zip(demands, fits, strict=True))
    )
    return Plan(
        run,
        tests,
        outcome.wall_s,
        lower_bound(run, fits),
        fitted_lower_bound(run, fits),
        assumed,
    )
