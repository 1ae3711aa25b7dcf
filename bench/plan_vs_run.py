"""The plan's predicted wall time against a real run of the same suite (no GPU: fake GPUs).

Writes a pytest project of a ``bench/placement_sim.py`` suite (``--tests`` tests of its mix,
drawn with ``--seed``): each test declares its need with ``@pytest.mark.vram(gib=...)`` and
sleeps for its duration times ``--scale``. The sleeps are the work being scheduled, not
synchronisation. The scaled durations are in pytest's cache where the plugin learns them
(``report/durations.py``), so the plan and the scheduler both know them. Then:

1. ``ct-resources plan --gpus GPUS --workers-per-gpu W --json``: the predicted wall time;
2. the suite run under xdist on the same GPUs, fake ones (``CT_FAKE_GPUS``), each with its
   own workers (``--tx W*popen//env:CUDA_VISIBLE_DEVICES=<i>``), placed by the plugin's
   scheduler. The measured wall time is the test phase: from the earliest setup start to the
   latest teardown end among the reports the controller receives (``TestReport.start`` and
   ``stop``, the system clock, one host), so interpreter and worker start-up and collection
   are left out;
3. predicted, measured, their ratio, tests run and skipped. Exit status 0 when the run had
   no failure and the prediction is within 15 % of the measurement.

Run (1,000 tests at ``--scale 0.02``: about 2 minutes of tests on 12 workers)::

    python bench/plan_vs_run.py [--seed 0] [--tests 1000] [--scale 0.02]
        [--gpus 2x80,4x24] [--workers-per-gpu 2] [--out DIR]

On a small machine: ``--tests 60 --gpus 1x80,1x24 --workers-per-gpu 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from placement_sim import suite  # noqa: E402
from plan_timing import write_project  # noqa: E402

from pytest_ctresources.xdist.placement import Demand  # noqa: E402
from pytest_ctresources.xdist.plan import parse_gpus  # noqa: E402

#: Records the test phase on the controller from the reports it receives.
PHASE_CONFTEST = """
import json

import pytest

PHASE = {"start": float("inf"), "stop": 0.0, "outcomes": {}}


def pytest_runtest_logreport(report):
    if report.when == "setup":
        PHASE["start"] = min(PHASE["start"], report.start)
    if report.when == "teardown":
        PHASE["stop"] = max(PHASE["stop"], report.stop)
    outcomes = PHASE["outcomes"]
    if (report.when == "call" or report.outcome != "passed") and (
        outcomes.get(report.nodeid) != "failed"
    ):
        outcomes[report.nodeid] = report.outcome


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):
        (session.config.rootpath / "phase.json").write_text(json.dumps(PHASE))
"""


def write_suite(root: Path, seed: int, tests: int, scale: float) -> None:
    drawn = suite(seed, n=tests)
    demands = [Demand(d.nodeid, d.need_gib, (d.duration_s or 0.0) * scale) for d in drawn]
    write_project(root, demands, sleep=True)
    (root / "conftest.py").write_text(PHASE_CONFTEST)


def predicted(root: Path, gpus: str, per_gpu: int, env: dict[str, str]) -> dict[str, Any]:
    """``ct-resources plan --json`` of the project."""
    plan = [sys.executable, "-m", "pytest_ctresources.estimator.cli", "plan", "--gpus", gpus]
    plan += ["--workers-per-gpu", str(per_gpu), "--json", "--", "tests", "-p", "no:randomly"]
    done = subprocess.run(plan, cwd=root, env=env, capture_output=True, text=True, check=True)
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def measured(root: Path, gpus: str, per_gpu: int, env: dict[str, str]) -> tuple[int, str]:
    """The suite under xdist on fake GPUs: pytest's exit status and output."""
    cards = parse_gpus(gpus)
    fake = ";".join(f"{card.name}={card.capacity_gib:g}" for card in cards)
    tx = [
        arg
        for index in range(len(cards))
        for arg in ("--tx", f"{per_gpu}*popen//env:CUDA_VISIBLE_DEVICES={index}")
    ]
    run = [sys.executable, "-m", "pytest", "tests", "-p", "no:randomly", "-q", "--dist", "load"]
    done = subprocess.run(
        [*run, *tx],
        cwd=root,
        env={**env, "CT_FAKE_GPUS": fake},
        capture_output=True,
        text=True,
    )
    return done.returncode, done.stdout + done.stderr


def compare(root: Path, args: argparse.Namespace) -> int:
    write_suite(root, args.seed, args.tests, args.scale)
    private_tmp = root / "tmp"  # this run's lease ledger, apart from other runs of the user's
    private_tmp.mkdir(mode=0o700)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "TMPDIR": str(private_tmp)}
    plan = predicted(root, args.gpus, args.workers_per_gpu, env)
    (root / "plan.json").write_text(json.dumps(plan, indent=2))
    status, log = measured(root, args.gpus, args.workers_per_gpu, env)
    (root / "run.log").write_text(log)
    phase = json.loads((root / "phase.json").read_text())
    outcomes = list(phase["outcomes"].values())
    wall = phase["stop"] - phase["start"]
    predicted_s = float(plan["predicted_wall_s"])
    ratio = predicted_s / wall
    print(
        f"seed {args.seed}, {args.tests} tests at scale {args.scale:g} on {args.gpus} GiB, "
        f"{args.workers_per_gpu} worker(s) per GPU"
    )
    print(f"  predicted (ct-resources plan) {predicted_s:8.2f} s")
    print(f"  measured (test phase)         {wall:8.2f} s")
    print(f"  predicted / measured          {ratio:8.3f}")
    print(
        f"  tests: {outcomes.count('passed')} passed, {outcomes.count('skipped')} skipped, "
        f"{len(outcomes) - outcomes.count('passed') - outcomes.count('skipped')} other; "
        f"planned to skip: {sum(1 for t in plan['tests'] if t['skip_reason'])}"
    )
    within = abs(ratio - 1.0) <= 0.15
    print(f"  within 15 %: {'yes' if within else 'NO'}; pytest exit status {status}")
    return 0 if within and status == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the suite drawn (default 0)")
    parser.add_argument("--tests", type=int, default=1000, help="tests drawn (default 1000)")
    parser.add_argument("--scale", type=float, default=0.02, help="sleep per simulated second")
    parser.add_argument("--gpus", default="2x80,4x24", help="GPUs, as ct-resources plan takes")
    parser.add_argument("--workers-per-gpu", type=int, default=2, help="default 2")
    parser.add_argument("--out", type=Path, help="keep the project, plan.json and run.log here")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True)
        return compare(args.out, args)
    with tempfile.TemporaryDirectory() as tmp:
        return compare(Path(tmp), args)


if __name__ == "__main__":
    raise SystemExit(main())
