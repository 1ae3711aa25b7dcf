"""Start-up cost of the plugin, measured side by side in one run.

    python bench/startup.py [--repeats 7]

Times, in subprocesses alternating with and without the plugin (``-p no:ctresources``):
``pytest --co`` of a 2,000-test project, a full run of those 2,000 trivial tests, and a
one-test project writing a pytest-html report. None of these projects asks for the plugin
(settings/activation.py), so the plugin should cost nothing measurable. A fourth workload is
the 2,000 trivial tests in a project that asks (``ct_cleanup = auto`` in its ini): there
the plugin acts around every test, and what a test that uses nothing of it costs shows. A
fifth, where nnsight is installed, is that project with a conftest importing nnsight, as a
circuit-tracer suite's does (its trivial tests run beside nnsight, torch and
transformers).
Prints the fastest and the median wall times, the medians of the ratios of paired runs (wall
and CPU time, user + system of the pytest process: CPU time moves less with what else loads
the machine), how many of the plugin's modules a one-test run imports where the project
asks and where it does not, with their import time under ``-X importtime`` (self times
summed), and which heavy modules loading the plugin imported (must be none). The
fastest run is the estimate of the code's cost (as ``timeit`` uses it): on a shared machine
the median also carries the noise of whatever else ran, and alternating the two variants
keeps that noise from favouring one.

It measures the plugin as the interpreter running it imports it: run it with the Python of a
virtual environment where the package is installed from a wheel to see what users pay
(pytest loads an installed plugin's modules through its assertion-rewriting loader, an
editable checkout's not: docs/benchmarks.md). ``bench/instructions.py`` counts the same
workloads' instructions, which the machine's noise does not move.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "pytest_ctresources"
HEAVY = ("torch", "matplotlib", "circuit_tracer", "nnsight", "nbformat", "transformers")


def make_project(root: Path, n_tests: int) -> None:
    per_file = 100
    for index in range(n_tests // per_file):
        body = "\n".join(f"def test_{i}():\n    assert True\n" for i in range(per_file))
        (root / f"test_trivial_{index:03d}.py").write_text(body)
    (root / "pytest.ini").write_text("[pytest]\n")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


#: The runs' environment: this one's, with bytecode caching on. An installed plugin has its
#: bytecode (pip compiles at install); with ``PYTHONDONTWRITEBYTECODE`` set, an editable
#: checkout's modules would be compiled afresh in every run, some 60 ms the plugin's users
#: never pay, while the other plugins' installed bytecode is read.
_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def timed(root: Path, args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one pytest run in ``root``."""
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=_ENV,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start, _children_cpu() - cpu


def heavy_imports_of_plugin() -> list[str]:
    code = (
        "import sys, pytest_ctresources.plugin; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def plugin_imports(root: Path, runs: int = 5) -> tuple[float, int]:
    """The plugin's modules a pytest run in ``root`` imports, under ``-X importtime``: the
    median over ``runs`` of their self times summed, in ms (importtime's own overhead
    included), and how many they are."""
    totals: list[float] = []
    modules: dict[str, int] = {}
    for _ in range(runs):
        run = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "pytest", "-q", "-p", "no:cacheprovider"],
            cwd=root,
            env=_ENV,
            capture_output=True,
            text=True,
            check=True,
        )
        modules = {}
        for line in run.stderr.splitlines():
            fields = line.removeprefix("import time:").split("|")
            name = fields[-1].strip()
            if len(fields) == 3 and fields[0].strip().isdigit() and name.startswith(PACKAGE):
                modules[name] = int(fields[0])
        totals.append(sum(modules.values()) / 1000)
    return statistics.median(totals), len(modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument(
        "--only", default="", help="run only the workloads whose label contains this text"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "trivial"
        root.mkdir()
        make_project(root, args.tests)
        one = Path(tmp) / "one-test"
        one.mkdir()
        (one / "test_one.py").write_text("def test_one():\n    assert True\n")
        (one / "pytest.ini").write_text("[pytest]\n")
        one_asking = Path(tmp) / "one-test-asking"
        one_asking.mkdir()
        (one_asking / "test_one.py").write_text("def test_one():\n    assert True\n")
        (one_asking / "pytest.ini").write_text("[pytest]\nct_cleanup = auto\n")
        asking = Path(tmp) / "asking"
        asking.mkdir()
        make_project(asking, args.tests)
        (asking / "pytest.ini").write_text("[pytest]\nct_cleanup = auto\n")
        workloads = [
            ("pytest --co", root, ["--co"]),
            (f"{args.tests} trivial tests", root, []),
            ("1 test, --html", one, ["--html", "report.html", "--self-contained-html"]),
            (f"{args.tests} trivial tests, asking", asking, []),
        ]
        if importlib.util.find_spec("nnsight") is not None:
            beside = Path(tmp) / "asking-nnsight"
            beside.mkdir()
            make_project(beside, args.tests)
            (beside / "pytest.ini").write_text("[pytest]\nct_cleanup = auto\n")
            (beside / "conftest.py").write_text("import nnsight  # noqa: F401\n")
            workloads.append((f"{args.tests} trivial tests, asking, nnsight", beside, []))
        rows = []
        paired: list[tuple[str, float, float]] = []
        for label, where, extra in workloads:
            if args.only not in label:
                continue
            with_plugin: list[tuple[float, float]] = []
            without: list[tuple[float, float]] = []
            timed(where, extra)  # warm the filesystem and bytecode caches
            for _ in range(args.repeats):
                with_plugin.append(timed(where, extra))
                without.append(timed(where, [*extra, "-p", "no:ctresources"]))
            walls = [w for w, _ in with_plugin], [w for w, _ in without]
            rows.append((f"{label}, fastest", min(walls[0]), min(walls[1])))
            medians = statistics.median(walls[0]), statistics.median(walls[1])
            rows.append((f"{label}, median", *medians))
            pairs = list(zip(with_plugin, without, strict=True))
            paired.append(
                (
                    label,
                    statistics.median(a[0] / b[0] for a, b in pairs),
                    statistics.median(a[1] / b[1] for a, b in pairs),
                )
            )
        imports = [
            (what, *plugin_imports(where))
            for what, where in (("not asking", one), ("asking", one_asking))
        ]
    print(f"python {sys.version.split()[0]}, {args.repeats} alternating runs each")
    print(f"{'workload':<46} {'with plugin':>12} {'without':>12} {'ratio':>7}")
    for label, with_s, without_s in rows:
        print(f"{label:<46} {with_s:>11.3f}s {without_s:>11.3f}s {with_s / without_s:>7.3f}")
    for label, wall, cpu in paired:
        print(f"{label}: median of paired ratios, wall {wall:.3f}, CPU {cpu:.3f}")
    for what, milliseconds, count in imports:
        print(
            f"the plugin's modules a one-test run imports, {what}: {count}, "
            f"{milliseconds:.1f} ms under -X importtime (self times summed, median of 5)"
        )
    heavy = heavy_imports_of_plugin()
    print("heavy modules imported by loading the plugin:", ", ".join(heavy) or "none")


if __name__ == "__main__":
    main()
