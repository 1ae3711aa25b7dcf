"""Placement on one GPU shared by two capped workers: bench/placement_suite on the H200.

Runs ``bench/placement_suite`` with two xdist workers on the one GPU, capped at 20 and
60 GiB through their own environments::

    --tx popen//env:CT_VRAM_CAPACITY=20 --tx popen//env:CT_VRAM_CAPACITY=60

(``CT_VRAM_CAPACITY`` is ``--ct-vram-capacity``'s variable), with ``--ct-report-json``, and
prints from the report each test's worker, that worker's cap, its lease and measured peak,
then the out-of-memory count, the skip count, and whether every test ran on a worker whose
cap holds its declared need. Exit status 0 when every test passed on such a worker, no OOM.

    python bench/placement_h200.py [--out DIR]
    python bench/placement_h200.py --tiny   # the bundled tiny model, fake GPU: CPU is fine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pytest_ctresources.units import GIB

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "placement_suite"
CAPS = {"gw0": 20.0, "gw1": 60.0}  # xdist numbers the --tx workers in order
#: Without CUDA (--tiny): one fake H200.
FAKE_GPUS = "NVIDIA H200=139.8"


def command(report: Path) -> list[str]:
    tx = [arg for cap in CAPS.values() for arg in ("--tx", f"popen//env:CT_VRAM_CAPACITY={cap:g}")]
    return [
        *(
            sys.executable,
            "-m",
            "pytest",
            str(SUITE),
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
        ),
        *(*tx, "--dist", "load", "-rfEs", "--ct-report-json", str(report)),
    ]


def summarise(report: dict[str, object], log: str) -> tuple[list[str], bool]:
    """The lines to print and whether the run is what the acceptance asks."""
    placements = report["placements"]
    tests = report["tests"]
    assert isinstance(placements, list) and isinstance(tests, list)
    peaks = {t["nodeid"]: t["peak_reserved_bytes"] / GIB for t in tests}
    needs = {t["nodeid"]: t["need_gib"] for t in tests}
    lines = [f"{'test':<34} {'worker':>6} {'cap':>5} {'lease':>6} {'peak':>6} outcome"]
    fits = True
    for p in sorted(placements, key=lambda p: p["nodeid"]):
        name = p["nodeid"].rpartition("::")[2]
        cap = CAPS.get(p["worker"], 0.0)
        need = needs.get(p["nodeid"], p["lease_gib"])
        fits &= p["outcome"] == "passed" and (need or 0.0) <= cap
        peak = peaks.get(p["nodeid"])
        shown = "-" if peak is None else f"{peak:.2f}"
        worker, lease = p["worker"], p["lease_gib"]
        lines.append(f"{name:<34} {worker:>6} {cap:>5g} {lease:>6.1f} {shown:>6} {p['outcome']}")
    ooms = sum(
        1 for line in log.splitlines() if line.startswith("FAILED") and "out of memory" in line
    )
    skipped = sum(1 for p in placements if p["outcome"] == "skipped")
    lines += [
        f"tests: {len(placements)}, OOM: {ooms}, skipped: {skipped}",
        f"every test passed on a worker whose cap holds its need: {'yes' if fits else 'NO'}",
    ]
    return lines, fits and ooms == 0 and skipped == 0 and bool(placements)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the JSON report and log go (default: temp)")
    parser.add_argument("--tiny", action="store_true", help="the bundled tiny model (CPU is fine)")
    args = parser.parse_args(argv)
    out: Path = (args.out or Path(tempfile.mkdtemp(prefix="ct-placement-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.tiny:
        env["CT_BENCH_TINY"] = "1"
        env.setdefault("CT_FAKE_GPUS", FAKE_GPUS)
    report = out / "report.json"
    done = subprocess.run(command(report), cwd=ROOT, env=env, capture_output=True, text=True)
    (out / "pytest.log").write_text(done.stdout + done.stderr)
    if not report.is_file():
        print(done.stdout[-4000:] + done.stderr[-4000:])
        print(f"no JSON report (pytest exit status {done.returncode}); log in {out}")
        return 1
    lines, ok = summarise(json.loads(report.read_text()), done.stdout)
    print("\n".join([*done.stdout.splitlines()[-1:], *lines, f"report and log in {out}"]))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
