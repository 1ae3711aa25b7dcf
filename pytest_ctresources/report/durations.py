"""Test durations learned from earlier runs, kept in pytest's cache like the learned needs.

A test's duration is the sum of its setup, call and teardown as its reports give them (the
last attempt's, for a rerun), keyed by node id; a skipped test's is not learned (a skip
costs nothing and says nothing of its run). The VRAM scheduler orders work by them (LPT),
``--ct-shard`` balances shares by them and ``ct-resources plan`` predicts wall time from
them. Read and written by the controller (or the plain run) only: reports reach it from
every worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest

CACHE_KEY = "ctresources/learned-durations"


def read(cache: pytest.Cache | None) -> dict[str, float]:
    """The learned durations (a malformed entry is left out)."""
    raw = cache.get(CACHE_KEY, {}) if cache is not None else {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float] = {}
    for nodeid, seconds in raw.items():
        if isinstance(nodeid, str) and isinstance(seconds, int | float):
            if math.isfinite(seconds) and seconds >= 0:
                out[nodeid] = float(seconds)
    return out


class LearnedDurations:
    """Saves this run's durations (``measured()``: ``RunSummary.durations``,
    report/run_summary.py, which reads every report once) over the learned ones at the end."""

    name = "ctresources-learned-durations"

    def __init__(
        self, cache: pytest.Cache | None, measured: Callable[[], Mapping[str, float]]
    ) -> None:
        self._cache = cache
        self._measured = measured
        self._known: dict[str, float] | None = None

    def known(self) -> Mapping[str, float]:
        """What earlier runs learned (read once)."""
        if self._known is None:
            self._known = read(self._cache)
        return self._known

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        measured = self._measured()
        if self._cache is None or not measured:
            return
        merged = dict(self.known())
        merged.update(measured)
        self._cache.set(CACHE_KEY, merged)
