"""Where the CPU suite's CPU time goes: each test's CPU time, in its worker and in the
processes it started (pytester subprocesses, xdist workers, notebook kernels), summed per file.

    python bench/suite_cpu.py [--top 25] [pytest arguments, default: tests -n 2]

``/usr/bin/time -v`` gives the suite's total (docs/development.md's line of 8 CPU-minutes);
this script says which tests make it up, in one run of the suite, without the 12 CPU-s each
extra process of ``/usr/bin/time -v python -m pytest tests/test_X.py`` pays for
``tests/conftest.py``'s imports. A test's share is what ``getrusage`` counts across its
``pytest_runtest_protocol``: its own process's user and system time, and its children's
that ended and were waited for within it (the processes a test starts and waits for). The
rest of the total is each worker's start, collection and what the controller does.

Run from the repository root; the script loads itself into every process of the run as a
plugin (``-p suite_cpu``, with ``bench/`` on ``PYTHONPATH``), and each worker writes its
rows into a temporary folder named by ``SUITE_CPU_DIR``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

_ROWS_ENV = "SUITE_CPU_DIR"
_rows: list[tuple[str, float, float]] = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    before = _cpu()
    try:
        return (yield)
    finally:
        after = _cpu()
        _rows.append((item.nodeid, after[0] - before[0], after[1] - before[1]))


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get(_ROWS_ENV)
    if folder and _rows:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder, f"{name}.json").write_text(json.dumps(_rows))


def main() -> None:
    # bench/startup.py's environment: bytecode caching on, as CI runs. (Imported here: this
    # module is also the plugin every process of the measured run loads.)
    from startup import _ENV as STARTUP_ENV  # bench/ is the script's directory, so on sys.path

    argv = sys.argv[1:]
    top = 25
    if argv[:1] == ["--top"]:
        top, argv = int(argv[1]), argv[2:]
    bench = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as folder:
        env = {
            **STARTUP_ENV,
            _ROWS_ENV: folder,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(bench), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "pytest", "-p", "suite_cpu", "-q"]
        subprocess.run([*command, *(argv or ["tests", "-n", "2"])], env=env, check=False)
        rows = [row for path in Path(folder).glob("*.json") for row in json.loads(path.read_text())]
    own, children = sum(row[1] for row in rows), sum(row[2] for row in rows)
    print(
        f"\n{len(rows)} tests: {own:.0f} CPU-s in their workers, {children:.0f} in their children"
    )
    by_file: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for nodeid, own_s, children_s in rows:
        totals = by_file[nodeid.split("::")[0]]
        totals[0] += own_s
        totals[1] += children_s
    print(f"{'CPU-s':>7} {'own':>6} {'children':>8}  file (top {top})")
    for path, (own_s, children_s) in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{own_s + children_s:7.1f} {own_s:6.1f} {children_s:8.1f}  {path}")
    print(f"{'CPU-s':>7} {'own':>6} {'children':>8}  test (top {top})")
    for nodeid, own_s, children_s in sorted(rows, key=lambda row: -(row[1] + row[2]))[:top]:
        print(f"{own_s + children_s:7.1f} {own_s:6.1f} {children_s:8.1f}  {nodeid}")


if __name__ == "__main__":
    main()
