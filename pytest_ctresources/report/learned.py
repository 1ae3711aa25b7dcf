"""VRAM needs learned from earlier runs, kept in pytest's cache (``.pytest_cache``).

A need is keyed by the test's node id and the config values that change its memory, so
running with another batch size or model does not reuse a peak measured under a different
one. The controller reads and writes the cache; xdist workers get the controller's needs
(:mod:`~pytest_ctresources.xdist.learned_exchange`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_ctresources.settings.config import AUTO, CircuitTracerConfig
from pytest_ctresources.settings.sources import Source

CACHE_KEY = "ctresources/learned-needs"
#: The config fields whose values change a test's peak memory.
MEMORY_FIELDS = (
    "model_name",
    "transcoder_set",
    "backend",
    "dtype",
    "batch_size",
    "max_feature_nodes",
    "max_n_logits",
    "offload",
    "lazy_encoder",
    "lazy_decoder",
)


def memory_key(
    nodeid: str, cfg: CircuitTracerConfig | None, capacity_gib: float | None = None
) -> str:
    """The cache key of a test's need: its node id, plus its memory-relevant config, plus the
    ``--ct-vram-capacity`` it ran under (a capped allocator gives its cache back before it
    fails, so a peak measured under a cap is that cap's, not the card's).

    Empty (nothing learned, nothing looked up) for ``batch_size: auto``: its peak follows
    the card it ran on, so a peak measured on one card is no need on another.
    """
    capped = f"|capacity={capacity_gib:g}GiB" if capacity_gib is not None else ""
    if cfg is None:
        return nodeid + capped
    if cfg.batch_size == AUTO:
        return ""
    values = {name: getattr(cfg, name) for name in MEMORY_FIELDS}
    return f"{nodeid}|{json.dumps(values, sort_keys=True)}{capped}"


def nodeid_of(key: str) -> str:
    """The test a key belongs to."""
    return key.split("|", 1)[0]


def stale_keys(
    keys: Iterable[str],
    collected: set[str],
    exists: Callable[[str], bool],
    narrowed: frozenset[str] = frozenset(),
) -> set[str]:
    """The keys of tests that no longer exist: their file is gone, or their file was
    collected whole (``collected`` holds every node id collected, before any deselection;
    ``narrowed`` the files the command line named tests of, ``file.py::test_x``, whose other
    tests were not collected) and the test was not in it."""
    files = {nodeid.split("::", 1)[0] for nodeid in collected} - narrowed
    stale = set()
    for key in keys:
        nodeid = nodeid_of(key)
        file = nodeid.split("::", 1)[0]
        if (file in files and nodeid not in collected) or not exists(file):
            stale.add(key)
    return stale


@dataclass(frozen=True)
class LearnedNeed:
    """A peak measured in an earlier run."""

    gib: float
    gpu: str
    date: str

    @property
    def source(self) -> Source:
        return Source.learned(self.gib, self.gpu, self.date)


class LearnedNeeds:
    """The learned needs of this project, loaded once per process."""

    def __init__(
        self, cache: pytest.Cache | None, shipped: Mapping[str, Any] | None = None
    ) -> None:
        """From ``cache``; or, in an xdist worker, from the needs its controller ``shipped``
        (then nothing is saved here: the controller saves)."""
        self._cache = cache if shipped is None else None
        if shipped is not None:
            raw: object = dict(shipped)
        else:
            raw = cache.get(CACHE_KEY, {}) if cache is not None else {}
        self._needs: dict[str, dict[str, Any]] = raw if isinstance(raw, dict) else {}

    def to_mapping(self) -> dict[str, dict[str, Any]]:
        """The needs as the cache keeps them (what a controller ships to its workers)."""
        return {key: dict(entry) for key, entry in self._needs.items() if isinstance(entry, dict)}

    def __bool__(self) -> bool:
        return bool(self._needs)

    def get(self, key: str) -> LearnedNeed | None:
        entry = self._needs.get(key)
        if entry is None:
            return None
        try:
            return LearnedNeed(float(entry["gib"]), str(entry["gpu"]), str(entry["date"]))
        except (TypeError, KeyError, ValueError):
            return None

    def update(self, learned: Mapping[str, LearnedNeed]) -> None:
        for key, need in learned.items():
            self._needs[key] = {"gib": round(need.gib, 3), "gpu": need.gpu, "date": need.date}

    def save(self) -> None:
        if self._cache is not None:
            self._cache.set(CACHE_KEY, self._needs)

    def keys(self) -> list[str]:
        return list(self._needs)

    def prune(self, keys: Iterable[str]) -> None:
        """Drop the needs of ``keys`` (tests that no longer exist)."""
        for key in keys:
            self._needs.pop(key, None)

    def forget(self) -> int:
        """Clear every learned need; returns how many there were."""
        count = len(self._needs)
        self._needs = {}
        self.save()
        return count


class StaleLearnedNeeds:
    """Finds the learned needs of tests that no longer exist, from what collection found:
    every test of every collected module or class (its collect report lists them all, before
    node-id selection or ``-k`` deselect any), so selecting tests never forgets the others.

    A file named with tests (``file.py::test_x``) is not collected whole (pytest then reports
    only the chosen tests): its other tests are kept. Registered where tests are collected
    (the only process, or each xdist worker) when there are learned needs; ``report``
    receives the stale keys at the end of collection."""

    name = "ctresources-stale-learned"

    def __init__(
        self,
        learned: LearnedNeeds,
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

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._seen.update(item.nodeid for item in session.items)
        self._report(stale_keys(self._learned.keys(), self._seen, self._exists, self._narrowed))


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
