"""The plan against the simulated run, and the plan's own time (no GPU).

1. For the 1,000-test suites of ``bench/placement_sim.py`` (2x80 + 4x24 GiB, two workers per
   GPU), the wall time ``ct-resources plan`` predicts (``xdist.plan.make_plan``) against the
   simulated run of the VRAM scheduler (``placement_sim.run_suite``), as a ratio.
2. ``pytest --ct-plan 2x80,4x24 --ct-plan-workers 2`` (what ``ct-resources plan`` runs) timed
   on a synthetic project of the same 1,000 tests (50 files, ``vram`` markers, the durations
   in pytest's cache) and on this repository's ``examples/``, in fresh processes: start-up,
   collection, and the plan itself (needs read, placement simulated, the plan printed).

Run: ``python bench/plan_timing.py`` (``--seeds N``, ``--repeat N``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from placement_sim import run_suite, suite  # noqa: E402

from pytest_ctresources.report.durations import CACHE_KEY  # noqa: E402
from pytest_ctresources.xdist.placement import Demand  # noqa: E402
from pytest_ctresources.xdist.plan import make_plan, parse_gpus  # noqa: E402

GPUS = "2x80,4x24"


def predicted_against_simulated(seeds: int) -> list[tuple[int, float, float]]:
    """Per seed: (seed, the plan's predicted wall time, the simulated run's)."""
    out = []
    for seed in range(seeds):
        demands = suite(seed)
        plan = make_plan(parse_gpus(GPUS), 2, demands)
        out.append((seed, plan.predicted_wall_s, run_suite(demands)["placement"]["wall_s"]))
    return out


def write_project(root: Path, demands: list[Demand], *, sleep: bool = False) -> None:
    """The suite as a project: ``tests/test_NNN.py::test_I`` with its ``vram`` marker, and the
    durations in pytest's cache as a run would have learned them. With ``sleep`` each test
    sleeps for its duration (its work, for a real run of the suite)."""
    files: dict[str, list[str]] = {}
    for demand in demands:
        path, _, name = demand.nodeid.partition("::")
        mark = "" if demand.need_gib is None else f"@pytest.mark.vram(gib={demand.need_gib:.2f})\n"
        body = f"time.sleep({demand.duration_s!r})" if sleep else "pass"
        header = "import time\n\nimport pytest\n" if sleep else "import pytest\n"
        files.setdefault(path, [header]).append(f"\n{mark}def {name}():\n    {body}\n")
    for path, parts in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("".join(parts))
    (root / "pytest.ini").write_text("[pytest]\n")
    cache = root / ".pytest_cache" / "v" / CACHE_KEY
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({d.nodeid: d.duration_s for d in demands}))


class Clock:
    """Times a ``pytest --ct-plan`` run's phases: start-up (to collection), collection, and
    the plan (the ``pytest_collection_finish`` hooks, where the plan is made and printed)."""

    def __init__(self, began: float) -> None:
        self.marks = {"began": began}

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self) -> Generator[None, object, object]:
        self.marks["collecting"] = time.perf_counter()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_finish(self) -> Generator[None, None, None]:
        self.marks["collected"] = time.perf_counter()
        try:
            return (yield)
        finally:
            self.marks["planned"] = time.perf_counter()


def clocked(args: list[str]) -> dict[str, float]:
    """One ``pytest --ct-plan`` run in this process: seconds per phase."""
    clock = Clock(time.perf_counter())
    plan = ["--ct-plan", GPUS, "--ct-plan-workers", "2", "-q", "-p", "no:xdist"]
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*args, *plan], plugins=[clock])
    m = clock.marks
    return {
        "start_s": m["collecting"] - m["began"],
        "collect_s": m["collected"] - m["collecting"],
        "plan_s": m["planned"] - m["collected"],
    }


def plan_time(cwd: Path, args: list[str], repeat: int) -> dict[str, float]:
    """Medians over ``repeat`` fresh processes of :func:`clocked`."""
    runs = []
    for _ in range(repeat):
        code = f"import plan_timing, json; print(json.dumps(plan_timing.clocked({args!r})))"
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])},
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="suites drawn (seeds 0..N-1)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs, median kept")
    args = parser.parse_args(argv)
    print(f"predicted (ct-resources plan) against simulated wall time, {GPUS} GiB, 2 per GPU")
    for seed, predicted, simulated in predicted_against_simulated(args.seeds):
        print(
            f"  seed {seed}: {predicted:8.1f} s / {simulated:8.1f} s = {predicted / simulated:.3f}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        write_project(Path(tmp), suite(0))
        cases = [("synthetic 1,000 tests", Path(tmp), ["tests"])]
        cases.append(("examples/", ROOT, ["examples", "-p", "no:cacheprovider"]))
        print(f"pytest --ct-plan {GPUS} --ct-plan-workers 2, median of {args.repeat} runs")
        for name, cwd, pytest_args in cases:
            took = plan_time(cwd, pytest_args, args.repeat)
            print(
                f"  {name}: start-up {took['start_s']:.2f} s, collection "
                f"{took['collect_s']:.2f} s, the plan {took['plan_s']:.3f} s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
