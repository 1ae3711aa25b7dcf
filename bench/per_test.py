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

Then what that dispatch adds, timed apart: what pluggy's call of a hook costs with one more
implementation, plain and new-style wrapper, beside one plain implementation (the fastest
of 15 ``timeit`` rounds, the three hooks alternating), and the sum over the implementations
a trivial test passes through in such a run (the plugin's implementations of
``PER_TEST_HOOKS``, counted in the run).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
from startup import make_project  # bench/ is the script's directory, so on sys.path

PARTS = ("lease setup", "setup", "call", "teardown", "summary")
#: The hooks a trivial test passes through, with how many times each is called for it.
PER_TEST_HOOKS = {
    "pytest_generate_tests": 1,
    "pytest_runtest_setup": 1,
    "pytest_runtest_call": 1,
    "pytest_runtest_teardown": 1,
    "pytest_runtest_logreport": 3,
}


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
        #: The plugin's implementations a trivial test passes through: plain, wrappers.
        self.implementations = {"plain": 0, "wrapper": 0}
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
        for hook, calls in PER_TEST_HOOKS.items():
            for found in getattr(manager.hook, hook).get_hookimpls():
                if found.plugin_name.startswith("ctresources"):
                    kind = "wrapper" if found.wrapper or found.hookwrapper else "plain"
                    self.implementations[kind] += calls
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


def dispatch_costs(number: int = 100_000, repeat: int = 15) -> dict[str, float]:
    """Microseconds pluggy adds to a hook call for one more implementation, plain and
    wrapper, beside one plain implementation (as pytest's own hooks always have one)."""
    import pluggy

    spec, impl = pluggy.HookspecMarker("bench"), pluggy.HookimplMarker("bench")

    class Spec:
        @spec
        def hook(self, item: object) -> None: ...

    class Plain:
        @impl
        def hook(self, item: object) -> None:
            pass

    class Wrapper:
        @impl(wrapper=True)
        def hook(self, item: object) -> Generator[None, None, None]:
            return (yield)

    def caller(*extra: object) -> Callable[[], object]:
        manager = pluggy.PluginManager("bench")
        manager.add_hookspecs(Spec)
        for plugin in (Plain(), *extra):
            manager.register(plugin)
        call = manager.hook.hook
        return lambda: call(item=None)

    calls = {"alone": caller(), "plain": caller(Plain()), "wrapper": caller(Wrapper())}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):  # the three alternate, so that the machine's noise hits all alike
        for name, call in calls.items():
            best[name] = min(best[name], timeit.timeit(call, number=number) / number * 1e6)
    return {kind: best[kind] - best["alone"] for kind in ("plain", "wrapper")}


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
    costs = dispatch_costs()
    counts = driver.implementations
    dispatch = sum(costs[kind] * count for kind, count in counts.items())
    print(
        f"pluggy's dispatch of one more implementation: plain {costs['plain']:.2f} µs, wrapper "
        f"{costs['wrapper']:.2f} µs; a trivial test passes through {counts['plain']} plain "
        f"implementations and {counts['wrapper']} wrappers of the plugin: {dispatch:.2f} µs"
    )


if __name__ == "__main__":
    main()
