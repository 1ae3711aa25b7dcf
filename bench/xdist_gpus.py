"""One GPU per xdist worker and a shared VRAM lease budget, against a serial run.

    python bench/xdist_gpus.py --workers 6 [--two-gpus] [--out DIR] [--tiny]

Runs bench/xdist_suite (16 real-size attributions, each ``@pytest.mark.vram(gib=19)``) one
variant after the other, each in its own ``python -m pytest`` subprocess:

- serial, one GPU;
- ``-n W`` with leases, one GPU;
- ``-n W --ct-no-leases``, one GPU;
- ``-n W`` with each worker's CPU threads limited to its share of the cores;
- ``-n W`` under CUDA MPS (``leases-1gpu-mps``): a control daemon of the script's own, with
  private pipe and log directories, started for the variant and stopped after it;
- with ``--two-gpus``: ``-n 2W`` with leases over two GPUs;
- with ``--crowded W2``: ``-n W2`` on one GPU with and without leases (more workers than
  their needs fit at once, so the budget has something to prevent).

For each it prints the wall time, its ratio to the serial time (>1 is faster), the outcomes
from the JUnit XML (OOM failures counted apart), and from the ``--ct-report-json`` placements
the tests per GPU and the lease waits. OOM failures are results; the exit status is non-zero
only when a variant could not run at all (a usage error, a crash, no JUnit XML).

``--tiny`` runs the suite on the bundled tiny model (``CT_BENCH_TINY=1``); without CUDA it
presents two fake 8 GiB GPUs (``CT_FAKE_GPUS``, unless already set) so the harness runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = "bench/xdist_suite"
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")
FAKE_GPUS = "Fake=8;Fake=8"
# pytest's exit statuses for "ran, all passed" and "ran, some failed"; anything else means the
# variant did not run (interrupted, internal error, usage error, nothing collected).
RAN = (0, 1)


@dataclass(frozen=True)
class Variant:
    name: str
    pytest_args: list[str]
    gpus: list[str]
    env: dict[str, str] = field(default_factory=dict)
    #: Run under CUDA MPS: a control daemon of this script's own (private pipe and log
    #: directories), started before the variant and told to quit after it.
    mps: bool = False


@dataclass
class Result:
    variant: Variant
    command: str
    wall_s: float
    problem: str | None = None
    outcomes: Counter[str] = field(default_factory=Counter)
    per_gpu: Counter[str] = field(default_factory=Counter)
    lease_waits: list[float] = field(default_factory=list)
    #: Per test (JUnit time: setup, call and teardown), split into each worker's first test,
    #: which pays the worker's imports and model build, and the rest.
    first_s: list[float] = field(default_factory=list)
    rest_s: list[float] = field(default_factory=list)
    workers: int = 1


def gpu_indexes() -> list[str] | None:
    """The GPUs to use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list; None if no CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    if shutil.which("nvidia-smi") is None:
        return None
    listed = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    indexes = listed.stdout.split()
    return indexes if listed.returncode == 0 and indexes else None


def junit_outcomes(path: Path) -> Counter[str]:
    """Count passed, failed, errors, skipped and OOM (a failure or error naming one) tests."""
    counts: Counter[str] = Counter()
    for case in ET.parse(path).iter("testcase"):
        problems = [child for child in case if child.tag in ("failure", "error")]
        for child in problems:
            counts["failed" if child.tag == "failure" else "errors"] += 1
        texts = [f"{child.get('message', '')}\n{child.text or ''}" for child in problems]
        if any(marker in text for text in texts for marker in OOM_MARKERS):
            counts["oom"] += 1
        if case.find("skipped") is not None:
            counts["skipped"] += 1
        elif not problems:
            counts["passed"] += 1
    return counts


def split_durations(junit: Path, report: Path, result: Result) -> None:
    """Fill ``first_s`` and ``rest_s`` from the JUnit times, in each worker's order."""
    times = {
        f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}": float(
            case.get("time", 0)
        )
        for case in ET.parse(junit).iter("testcase")
    }
    placements = json.loads(report.read_text()).get("placements", []) if report.exists() else []
    order: dict[str, list[str]] = {}
    for placement in placements:  # in the order the tests finished, per worker
        order.setdefault(placement.get("worker") or "main", []).append(placement["nodeid"])
    if not order:  # serial: the JUnit order is the run order
        order = {"main": list(times)}
    result.workers = len(order)
    for nodeids in order.values():
        durations = [times[nodeid] for nodeid in nodeids if nodeid in times]
        result.first_s += durations[:1]
        result.rest_s += durations[1:]


def read_placements(path: Path, result: Result) -> None:
    """Tests per GPU and lease waits from the report's ``placements``, when it has them."""
    if not path.exists():
        return
    for placement in json.loads(path.read_text()).get("placements", []):
        result.per_gpu[f"{placement['gpu_physical_index']}:{placement['gpu_name']}"] += 1
        if placement.get("lease_wait_s") is not None:
            result.lease_waits.append(float(placement["lease_wait_s"]))


def run_variant(variant: Variant, env: dict[str, str], out: Path) -> Result:
    junit, report, log = (out / f"{variant.name}.{ext}" for ext in ("xml", "json", "log"))
    for stale in (junit, report):
        stale.unlink(missing_ok=True)
    args = [sys.executable, "-m", "pytest", SUITE, "-p", "no:randomly", "-p", "no:cacheprovider"]
    args += ["--durations=3"]  # where the time goes: in the log
    args += ["-q", *variant.pytest_args, f"--junitxml={junit}", f"--ct-report-json={report}"]
    variant_env = {**env, **variant.env, "CUDA_VISIBLE_DEVICES": ",".join(variant.gpus)}
    changed = {k: v for k, v in variant_env.items() if os.environ.get(k) != v}
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changed.items()))
    command = f"{command} {shlex.join(args)}".strip()
    print(f"running {variant.name}: {command}", flush=True)
    mps_env: dict[str, str] = {}
    if variant.mps:
        mps_env, problem = start_mps(variant_env, out / f"{variant.name}-mps")
        if problem is not None:
            return Result(variant, command, 0.0, problem=problem)
        variant_env |= mps_env
    start = time.perf_counter()
    try:
        with log.open("w") as log_file:
            completed = subprocess.run(
                args, cwd=REPO, env=variant_env, stdout=log_file, stderr=subprocess.STDOUT
            )
    finally:
        if mps_env:
            stop_mps(variant_env)
    result = Result(variant, command, time.perf_counter() - start)
    if completed.returncode not in RAN or not junit.exists():
        lines = log.read_text().strip().splitlines() or ["(no output)"]
        errors = [line for line in lines if "error" in line.lower()]
        result.problem = f"exit status {completed.returncode}: {(errors or lines)[-1]} (see {log})"
        return result
    result.outcomes = junit_outcomes(junit)
    read_placements(report, result)
    split_durations(junit, report, result)
    return result


def start_mps(env: dict[str, str], directory: Path) -> tuple[dict[str, str], str | None]:
    """Start an MPS control daemon with its own pipe and log directories.

    Only processes started with the returned environment connect to it; the GPU's compute
    mode and every other setting are left as they are.
    """
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {}, "nvidia-cuda-mps-control is not installed"
    pipes, logs = directory / "pipe", directory / "log"
    pipes.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipes), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    started = subprocess.run([control, "-d"], env={**env, **mps_env}, capture_output=True)
    if started.returncode != 0:
        message = (started.stderr or started.stdout).decode().strip()
        return {}, f"nvidia-cuda-mps-control -d failed: {message or started.returncode}"
    return mps_env, None


def stop_mps(env: dict[str, str]) -> None:
    """Tell the MPS control daemon started by :func:`start_mps` to quit (it stops its server)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is not None:
        subprocess.run([control], input=b"quit\n", env=env, capture_output=True, timeout=60)


def print_table(results: list[Result]) -> None:
    serial = next((r for r in results if r.variant.name == "serial" and not r.problem), None)
    header = f"{'variant':<22} {'wall s':>8} {'vs serial':>9} {'pass':>5} {'fail':>5}"
    print(f"\n{header} {'err':>4} {'skip':>5} {'OOM':>4}  {'tests per GPU':<24} lease wait s")
    for r in results:
        if r.problem:
            print(f"{r.variant.name:<22} did not run: {r.problem}")
            continue
        ratio = f"{serial.wall_s / r.wall_s:.2f}" if serial else "-"
        per_gpu = " ".join(f"{gpu}={n}" for gpu, n in sorted(r.per_gpu.items())) or "-"
        waits = (
            f"total {sum(r.lease_waits):.1f}, max {max(r.lease_waits):.1f}"
            if r.lease_waits
            else "-"
        )
        o = r.outcomes
        print(
            f"{r.variant.name:<22} {r.wall_s:>8.1f} {ratio:>9} {o['passed']:>5} {o['failed']:>5}"
            f" {o['errors']:>4} {o['skipped']:>5} {o['oom']:>4}  {per_gpu:<24} {waits}"
        )
    print_durations(results, serial)
    by_name = {r.variant.name: r for r in results if not r.problem}
    one, two = by_name.get("leases-1gpu"), by_name.get("leases-2gpus")
    if one and two:
        print(f"\ntwo GPUs vs one GPU, both with leases: {one.wall_s / two.wall_s:.2f}x faster")


def print_durations(results: list[Result], serial: Result | None) -> None:
    """Where the wall time goes: each worker's first test (imports, model build, first
    attribution) against the others, and how many of the others ran at once in effect."""
    print(
        f"\n{'variant':<22} {'workers':>7} {'first test s':>12} {'other tests s':>13} "
        f"{'overlap':>8}"
    )
    serial_rest = statistics.median(serial.rest_s) if serial and serial.rest_s else None
    for r in results:
        if r.problem or not r.rest_s:
            continue
        rest = statistics.median(r.rest_s)
        first = statistics.median(r.first_s) if r.first_s else float("nan")
        # Tests completed per second by W workers over one process' rate: W * serial / rest.
        overlap = f"{r.workers * serial_rest / rest:.2f}" if serial_rest else "-"
        print(f"{r.variant.name:<22} {r.workers:>7} {first:>12.1f} {rest:>13.2f} {overlap:>8}")
    print(
        "(medians of JUnit times; 'overlap' = workers x serial other-test time / this "
        "variant's: how many attributions' worth of work the GPU did at once)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=6, help="xdist workers per GPU")
    parser.add_argument("--two-gpus", action="store_true", help="also run 2W workers on 2 GPUs")
    parser.add_argument("--out", type=Path, help="where the XML, JSON and logs go (default: temp)")
    parser.add_argument("--tiny", action="store_true", help="the bundled tiny model (CPU is fine)")
    parser.add_argument(
        "--crowded",
        type=int,
        metavar="W2",
        help="also run -n W2 on one GPU with and without leases (more workers than fit at once)",
    )
    parser.add_argument(
        "--two-gpus-n",
        metavar="N[,N]",
        help="also run these total worker counts over two GPUs (e.g. 2,4: fewer model builds)",
    )
    parser.add_argument(
        "--only", help="comma-separated variant names to run (default: all); 'serial' first"
    )
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    # Absolute: pytest runs in the repository root, not in the caller's directory.
    out: Path = (args.out or Path(tempfile.mkdtemp(prefix="ct-xdist-bench-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    gpus = gpu_indexes()
    if gpus is None:
        gpus = ["0", "1"]
        if args.tiny:
            env.setdefault("CT_FAKE_GPUS", FAKE_GPUS)
    if args.tiny:
        env["CT_BENCH_TINY"] = "1"

    w = args.workers
    variants = [
        Variant("serial", [], gpus[:1]),
        Variant("leases-1gpu", ["-n", str(w)], gpus[:1]),
        Variant("no-leases-1gpu", ["-n", str(w), "--ct-no-leases"], gpus[:1]),
    ]
    # The same run with each worker's CPU threads limited to its share of the cores (torch
    # otherwise starts one thread per core in every worker).
    threads = str(max(1, (os.cpu_count() or 1) // w))
    variants.append(
        Variant("leases-1gpu-threads", ["-n", str(w)], gpus[:1], {"OMP_NUM_THREADS": threads})
    )
    # The same run under CUDA MPS, where kernels of the workers' processes run concurrently
    # instead of taking turns (time slicing).
    variants.append(Variant("leases-1gpu-mps", ["-n", str(w)], gpus[:1], mps=True))
    if args.crowded:
        c = str(args.crowded)
        variants += [
            Variant(f"leases-1gpu-n{c}", ["-n", c], gpus[:1]),
            Variant(f"no-leases-1gpu-n{c}", ["-n", c, "--ct-no-leases"], gpus[:1]),
        ]
    missing_gpu = bool(args.two_gpus or args.two_gpus_n) and len(gpus) < 2
    if missing_gpu:
        print(f"leases-2gpus cannot run: only GPU {gpus[0]} is visible", flush=True)
    elif args.two_gpus:
        variants.append(Variant("leases-2gpus", ["-n", str(2 * w)], gpus[:2]))

    if args.two_gpus_n and not missing_gpu:
        for n in args.two_gpus_n.split(","):
            variants.append(Variant(f"leases-2gpus-n{n}", ["-n", n], gpus[:2]))
    if args.only:
        wanted = set(args.only.split(","))
        variants = [v for v in variants if v.name in wanted]
    results: list[Result] = []
    for variant in variants:
        results.append(run_variant(variant, env, out))
        r = results[-1]
        with (out / "results.jsonl").open("a") as handle:  # survives a run cut short
            handle.write(
                json.dumps(
                    {
                        "variant": variant.name,
                        "wall_s": round(r.wall_s, 2),
                        "outcomes": dict(r.outcomes),
                        "per_gpu": dict(r.per_gpu),
                        "lease_wait_total_s": round(sum(r.lease_waits), 2),
                        "problem": r.problem,
                        "command": r.command,
                    }
                )
                + "\n"
            )
        print(f"  {variant.name}: {r.wall_s:.1f} s {dict(r.outcomes)}", flush=True)
        if results[-1].problem:
            print(f"  {variant.name} did not run: {results[-1].problem}", flush=True)
    print_table(results)
    print(f"\noutputs in {out}\ncommands run (from {REPO}):")
    for r in results:
        print(f"  {r.command}")
    return 1 if missing_gpu or any(r.problem for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
