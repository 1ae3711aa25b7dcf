"""Learned needs of tests that no longer exist, found as collection goes:
:class:`StaleLearnedNeeds`, registered in every process that collects, whether or not the
plugin acts there (a project that asks only through some tests has learned needs too).

Apart from core/learned.py, whose store it prunes, so that a run of a project that does not
ask (where nothing learned is read) does not import the store at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_ctresources.core.learned import LearnedNeeds


class StaleLearnedNeeds:
    """Finds the learned needs of tests that no longer exist, from what collection found:
    every test of every collected module or class (its collect report lists them all, before
    node-id selection or ``-k`` deselect any), so selecting tests never forgets the others.

    A file named with tests (``file.py::test_x``) is not collected whole (pytest then reports
    only the chosen tests): its other tests are kept. Registered where tests are collected
    (the only process, or each xdist worker); ``learned`` gives the needs at the end of
    collection (None where the plugin does not act: nothing is read then), and ``report``
    receives the stale keys."""

    name = "ctresources-stale-learned"

    def __init__(
        self,
        learned: Callable[[], LearnedNeeds | None],
        exists: Callable[[str], bool],
        report: Callable[[set[str]], None],
        narrowed: frozenset[str] = frozenset(),
    ) -> None:
        self._learned = learned
        self._exists = exists
        self._report = report
        self._narrowed = narrowed
        self._seen: set[str] = set()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.passed:
            self._seen.update(
                node.nodeid for node in report.result if isinstance(node, pytest.Item)
            )

    @pytest.hookimpl(trylast=True)  # after the plugin decided, at this hook, whether it acts
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        learned = self._learned()
        if not learned:
            return
        from pytest_ctresources.core.learned import stale_keys

        self._seen.update(item.nodeid for item in session.items)
        self._report(stale_keys(learned.keys(), self._seen, self._exists, self._narrowed))


def narrowed_files(config: pytest.Config) -> frozenset[str]:
    """The files (as node ids name them) whose tests the command line picked by node id."""
    root = config.rootpath
    out = set()
    for arg in config.args:
        if "::" not in arg:
            continue
        path = (config.invocation_params.dir / arg.split("::", 1)[0]).resolve()
        try:
            out.add(path.relative_to(root).as_posix())
        except ValueError:  # outside the rootdir: node ids name it otherwise; never pruned
            continue
    return frozenset(out)
