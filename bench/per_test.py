"""What the plugin's own per-test hooks cost a test that uses nothing of it, in-process.

    python bench/per_test.py [--tests 2000] [--rounds 5]

``bench/startup.py`` times whole runs, where the machine's spread (tens of milliseconds on
a 2-second run) hides a few microseconds per test. This script collects the 2,000 trivial
tests of a project that asks for the plugin (``ct_cleanup = auto``) in one pytest session,
then drives, for every collected test and in the order pytest calls them, the hooks the
plugin runs around it: the lease hook's setup, ``PerTestHooks``' setup, call and teardown
wrappers (each generator run to its end, as pluggy does), and the summary's three reports
(a passed test's setup, call and teardown). Nothing of the tests themselves runs, and
neither does pytest's dispatch of these hooks, which any plugin with the same hooks pays.
Prints, per round, the microseconds per test of each part and their sum, and the median
sum.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
from startup import make_project  # bench/ is the script's directory, so on sys.path

PARTS = ("lease setup", "setup", "call", "teardown", "summary")


def _drive(wrapper: Generator[None, Any, Any]) -> None:
    """Run a new-style hook wrapper as pluggy does: to its yield, then on with the result."""
    next(wrapper)
    try:
        wrapper.send(None)
    except StopIteration:
        return
    raise RuntimeError("a hook wrapper yielded twice")


class Driver:
    """Registered beside the plugin: at the end of collection, times the plugin's per-test
    hooks over the collected tests, then leaves pytest nothing to run."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.sums: list[float] = []
        self.lines: list[str] = []  # printed after the session: pytest captures its output

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        manager = session.config.pluginmanager
        leases = manager.get_plugin("ctresources-leases")
        per_test = manager.get_plugin("ctresources-per-test")
        summary = manager.get_plugin("ctresources-summary")
        if per_test is None or summary is None:
            raise RuntimeError("the plugin does not act in this project")
        items = list(session.items)
        reports = {
            item.nodeid: [
                pytest.TestReport(
                    item.nodeid,
                    item.location,
                    {},
                    "passed",
                    None,
                    when,
                    duration=0.001,
                    user_properties=[],
                )
                for when in ("setup", "call", "teardown")
            ]
            for item in items
        }

        def summarise(item: pytest.Item) -> None:
            for report in reports[item.nodeid]:
                summary.pytest_runtest_logreport(report)

        steps: list[tuple[str, Callable[[pytest.Item], None]]] = [
            ("lease setup", leases.pytest_runtest_setup if leases else lambda item: None),
            ("setup", lambda item: _drive(per_test.pytest_runtest_setup(item))),
            ("call", lambda item: _drive(per_test.pytest_runtest_call(item))),
            ("teardown", lambda item: _drive(per_test.pytest_runtest_teardown(item))),
            ("summary", summarise),
        ]
        for round_ in range(self.rounds):
            spent = dict.fromkeys(PARTS, 0.0)
            clock = time.perf_counter
            for item in items:
                for part, step in steps:
                    start = clock()
                    step(item)
                    spent[part] += clock() - start
            micro = {part: spent[part] / len(items) * 1e6 for part in PARTS}
            self.sums.append(sum(micro.values()))
            shown = ", ".join(f"{part} {value:.2f}" for part, value in micro.items())
            self.lines.append(f"round {round_ + 1}: {shown}; sum {self.sums[-1]:.2f} µs per test")
        session.items[:] = []  # timed: nothing left to run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_project(root, args.tests)
        (root / "pytest.ini").write_text("[pytest]\nct_cleanup = auto\n")
        driver = Driver(args.rounds)
        pytest.main(
            [str(root), "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
            plugins=[driver],
        )
    print("\n".join(driver.lines))
    print(f"median of the rounds' sums: {statistics.median(driver.sums):.2f} µs per test")


if __name__ == "__main__":
    main()
