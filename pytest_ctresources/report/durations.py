"""Test durations learned from earlier runs, kept in pytest's cache like the learned needs.

A test's duration is the sum of its setup, call and teardown as its reports give them (the
last attempt's, for a rerun), keyed by node id; a skipped test's is not learned (a skip
costs nothing and says nothing of its run). The VRAM scheduler orders work by them (LPT),
``--ct-shard`` balances shares by them and ``ct-resources plan`` predicts wall time from
them. Written by the controller (or the plain run) only, which reports reach from every
worker; read there, and by each xdist worker of a ``--ct-shard`` run, which selects its share
as it collects. The cache is read and saved as the learned needs are (core/learned.py): a
FIFO there does not block the run, nothing is written through a link, and what cannot be
used is a warning (``LearnedNeedsWarning``) and taken as nothing learned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from pytest_ctresources.core.learned import MAX_KEY_CHARS, read_cache_or_warn, write_cache

CACHE_KEY = "ctresources/learned-durations"
WHAT = "learned test durations"
#: The longest duration taken from the cache (a week): a larger one is no test's run.
MAX_SECONDS = 7 * 24 * 3600


def _cached(cache: pytest.Cache | None) -> tuple[dict[str, float], bool]:
    """The learned durations (a malformed entry is left out; a cache that cannot be read is
    one warning), and whether saving may replace them."""
    if cache is None:
        return {}, False
    raw, writable = read_cache_or_warn(cache, CACHE_KEY, WHAT)
    out: dict[str, float] = {}
    for nodeid, seconds in raw.items() if isinstance(raw, dict) else ():
        if not isinstance(nodeid, str) or len(nodeid) > MAX_KEY_CHARS:
            continue
        # Compared before float(): float() of an int over a float's range raises; NaN and
        # infinity fail the comparison.
        if isinstance(seconds, int | float) and not isinstance(seconds, bool):
            if 0 <= seconds <= MAX_SECONDS:
                out[nodeid] = float(seconds)
    return out, writable


def read(cache: pytest.Cache | None) -> dict[str, float]:
    """The learned durations (a malformed entry is left out; a cache that cannot be read is
    one warning)."""
    return _cached(cache)[0]


class LearnedDurations:
    """Saves this run's durations (``measured()``: ``RunSummary.durations``,
    report/run_summary.py, which reads every report once) over the learned ones at the end,
    unless what is at the cache's path is left alone (a link, a FIFO: ``read_cache``)."""

    name = "ctresources-learned-durations"

    def __init__(
        self, cache: pytest.Cache | None, measured: Callable[[], Mapping[str, float]]
    ) -> None:
        self._cache = cache
        self._measured = measured
        self._known: dict[str, float] | None = None
        self._writable = False

    def known(self) -> Mapping[str, float]:
        """What earlier runs learned (read once)."""
        if self._known is None:
            self._known, self._writable = _cached(self._cache)
        return self._known

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        measured = self._measured()
        if self._cache is None or not measured:
            return
        known = self.known()
        if self._writable:
            write_cache(self._cache, {**known, **measured}, CACHE_KEY, WHAT)
