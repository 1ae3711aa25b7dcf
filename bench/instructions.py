"""What the plugin costs a project that asks for it, in instructions executed: its start and
each test, apart, without the machine's noise.

    python bench/instructions.py [--tests 2000]

``bench/startup.py`` times whole runs, and on a shared machine their spread (several percent
between invocations) is as large as what it measures near 1.02. This script counts the
instructions each pytest process executes instead, under ``valgrind --tool=cachegrind
--cache-sim=no``, which repeats to a fraction of a percent, whatever else loads the machine.
Instructions are not time (they leave out I/O, waits and cache misses), but a change that
saves work shows in them at once, and the two counts a workload differs by split into what
the plugin pays once and what it pays per test.

The workloads are one test and ``--tests`` trivial tests (20 files of 100, as in
``bench/startup.py``), each in a project that does not ask for the plugin and in one that asks
(``ct_cleanup = auto`` in the ini). Each runs with the plugin and with ``-p
no:ctresources``, the two at the same time (one run under cachegrind takes some 30 s; counts
do not depend on what else runs), with a fixed hash seed and pytest-randomly off so the two
execute the same tests in the same order. A count repeats to within a few million (well under
1%). Prints each count and the plugin's share; what loading the plugin costs every project
(the first workload's difference); what a project that asks pays once more (its start, the
end of the run); what it pays per test (the two asking projects' differences apart, over the
tests between them); and the count 1.02 would allow on the large project. Needs valgrind.

It measures the plugin as the interpreter running it imports it: run it with the Python of a
virtual environment where the package is installed from a wheel to see what users pay
(docs/benchmarks.md says why that differs from an editable checkout).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from startup import _ENV as STARTUP_ENV  # bench/ is the script's directory, so on sys.path
from startup import make_project

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")

#: ``bench/startup.py``'s environment (bytecode caching on, for its reason) with a fixed hash
#: seed: sets and dicts of strings iterate alike in every run.
_ENV = {**STARTUP_ENV, "PYTHONHASHSEED": "0"}
_PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]


def instructions(root: Path, extra: list[str]) -> int:
    """Instructions one pytest run in ``root`` executes (the whole process)."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            *_PYTEST,
            *extra,
        ],
        cwd=root,
        env=_ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    found = _REFS.search(run.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{run.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def pair(root: Path, extra: list[str]) -> tuple[int, int]:
    """The counts with and without the plugin, run side by side (``extra``: more pytest
    arguments for both)."""
    subprocess.run(  # the bytecode, pytest's rewritten one included, written before counting
        [*_PYTEST, *extra], cwd=root, env=_ENV, check=True, stdout=subprocess.DEVNULL
    )
    with ThreadPoolExecutor(2) as pool:
        with_plugin = pool.submit(instructions, root, extra)
        without = pool.submit(instructions, root, [*extra, "-p", "no:ctresources"])
        return with_plugin.result(), without.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        help="a further argument for every pytest run (repeatable): --pytest-arg=--assert=plain",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("bench/instructions.py needs valgrind (apt install valgrind)")
    labels = (
        "1 test, not asking",
        "1 test, asking",
        f"{args.tests} tests, not asking",
        f"{args.tests} tests, asking",
    )
    with tempfile.TemporaryDirectory() as tmp:
        roots = [Path(tmp) / name for name in ("one-plain", "one", "many-plain", "many")]
        for index, root in enumerate(roots):
            root.mkdir()
            if index < 2:
                (root / "test_one.py").write_text("def test_one():\n    assert True\n")
            else:
                make_project(root, args.tests)
            ini = "[pytest]\n" if index % 2 == 0 else "[pytest]\nct_cleanup = auto\n"
            (root / "pytest.ini").write_text(ini)
        counts = [pair(root, args.pytest_arg) for root in roots]
    print(f"python {sys.version.split()[0]}; instructions, millions (valgrind cachegrind)")
    print(f"{'workload':<24} {'with plugin':>12} {'without':>10} {'plugin':>8} {'ratio':>7}")
    for label, (with_plugin, without) in zip(labels, counts, strict=True):
        print(
            f"{label:<24} {with_plugin / 1e6:>12,.1f} {without / 1e6:>10,.1f} "
            f"{(with_plugin - without) / 1e6:>8,.1f} {with_plugin / without:>7.3f}"
        )
    loading, once, _, large = (with_plugin - without for with_plugin, without in counts)
    per_test = (large - once) / (args.tests - 1)
    print(
        f"loading the plugin: {loading / 1e6:,.1f} M; a project that asks, once more: "
        f"{(once - loading) / 1e6:,.1f} M; per test: {per_test / 1e3:,.1f} thousand"
    )
    allowed = 0.02 * counts[3][1]
    print(
        f"1.02 on {args.tests} tests allows {allowed / 1e6:,.1f} M; the plugin executes "
        f"{large / 1e6:,.1f} M, {once / large:.0%} of it once per run"
    )


if __name__ == "__main__":
    main()
