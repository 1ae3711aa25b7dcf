"""What ``--ct-snapshot`` costs, recording against not recording, side by side in one run.

    python bench/snapshot_cost.py --out $OUT/snapshot_cost.md        # on a GPU machine
    python bench/snapshot_cost.py --workloads trivial --repeats 5   # anywhere

Workloads, each a fresh pytest process per run, variants alternating, ``--repeats`` times:

- ``small-cuda``: 200 tests that each allocate one small CUDA tensor (the plugin asked for
  with ``--ct-report``); ``--ct-snapshot off`` against ``on-failure`` (every test recorded,
  none kept) and ``always`` (every test recorded and written).
- ``attribution``: the first ``--attributions`` real-size gemma-2-2b attributions of
  bench/xdist_suite (one model build per process, then ``circuit_tracer.attribute`` at batch
  256); ``off`` against ``on-failure``.
- ``trivial``: 2,000 trivial tests on the CPU: ``-p no:ctresources``, the plugin installed
  and not asked (``--ct-snapshot`` is then off), the plugin asked (``--ct-report``: it acts
  for every test) without and with ``--ct-snapshot off`` (nothing of the recorder is
  registered: the last two differ by noise only).

Prints, per variant, the fastest and the median wall time (process start to exit) and the
ratio of each to the workload's first variant. A workload that needs CUDA is skipped
without it. On a shared machine quote the fastest (docs/development.md, Benchmarks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUITE = Path(__file__).parent / "xdist_suite"

SMALL_CUDA = """
import pytest, torch

@pytest.mark.parametrize("i", range(200))
def test_small(i):
    x = torch.ones(1024, device="cuda")
    assert x.sum().item() == 1024
"""


@dataclass
class Variant:
    name: str
    args: list[str]
    walls: list[float] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    needs_cuda: bool
    root: Path
    args: list[str]
    variants: list[Variant]


def trivial_project(root: Path) -> Path:
    root.mkdir()
    for index in range(20):
        body = "\n".join(f"def test_{i}():\n    assert True\n" for i in range(100))
        (root / f"test_trivial_{index:02d}.py").write_text(body)
    (root / "pytest.ini").write_text("[pytest]\n")
    return root


def workloads(scratch: Path, attributions: int) -> list[Workload]:
    small = scratch / "small"
    small.mkdir()
    (small / "test_small.py").write_text(SMALL_CUDA)
    (small / "pytest.ini").write_text("[pytest]\n")
    return [
        Workload(
            "small-cuda",
            True,
            small,
            ["-p", "no:randomly"],
            [
                Variant(mode, ["--ct-report", f"--ct-snapshot={mode}"])
                for mode in ("off", "on-failure", "always")
            ],
        ),
        Workload(
            "attribution",
            True,
            SUITE,
            [
                "-p",
                "no:randomly",
                *(f"test_attribution_suite.py::test_attribution[{i}]" for i in range(attributions)),
            ],
            [
                Variant("off", ["--ct-snapshot=off"]),
                Variant("on-failure", ["--ct-snapshot=on-failure"]),
            ],
        ),
        Workload(
            "trivial",
            False,
            trivial_project(scratch / "trivial"),
            ["-p", "no:randomly"],
            [
                Variant("-p no:ctresources", ["-p", "no:ctresources"]),
                Variant("installed, not asked", []),
                Variant("asked (--ct-report)", ["--ct-report"]),
                Variant("asked, --ct-snapshot off", ["--ct-report", "--ct-snapshot=off"]),
            ],
        ),
    ]


def run(workload: Workload, variant: Variant, snapshots: Path) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CT_SNAPSHOT_DIR": str(snapshots)}
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *workload.args,
            *variant.args,
        ],
        cwd=workload.root,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(
            f"{workload.name} / {variant.name} failed:\n"
            f"{result.stdout[-3000:]}{result.stderr[-2000:]}"
        )
    return wall


def table(workload: Workload) -> list[str]:
    first = workload.variants[0]
    out = [
        f"### {workload.name}",
        "",
        "| variant | fastest s | median s | fastest / first | median / first |",
        "|---|---|---|---|---|",
    ]
    for variant in workload.variants:
        out.append(
            f"| {variant.name} | {min(variant.walls):.2f} | {statistics.median(variant.walls):.2f} "
            f"| {min(variant.walls) / min(first.walls):.3f} "
            f"| {statistics.median(variant.walls) / statistics.median(first.walls):.3f} |"
        )
    return [*out, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="small-cuda,attribution,trivial")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attributions", type=int, default=4)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    wanted = options.workloads.split(",")
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        for workload in workloads(Path(scratch), options.attributions):
            if workload.name not in wanted:
                continue
            if workload.needs_cuda and not cuda:
                print(f"{workload.name}: skipped, no CUDA")
                continue
            for _ in range(options.repeats):
                for variant in workload.variants:  # alternating: the noise favours none
                    variant.walls.append(run(workload, variant, Path(scratch) / "snapshots"))
            lines += table(workload)
            print("\n".join(table(workload)), flush=True)
    if options.out is not None:
        options.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
