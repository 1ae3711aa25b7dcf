"""VRAM needs learned from earlier runs, kept in pytest's cache (``.pytest_cache``).

A need is keyed by the test's node id and the config values that change its memory, so
running with another batch size or model does not reuse a peak measured under a different
one. The controller reads and writes the cache; xdist workers get the controller's needs
(:mod:`~pytest_ctresources.xdist.learned_exchange`).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_ctresources.exceptions import CtResourcesWarning
from pytest_ctresources.reading import Unreadable, read_regular
from pytest_ctresources.settings.config import AUTO, MAX_GIB, CircuitTracerConfig, shown
from pytest_ctresources.settings.sources import Source, printable

#: Where pytest's cache keeps them. ("-v2": its keys are JSON arrays; the entry of earlier
#: versions, keyed ``node id|config``, is left unread, and its needs are learned again.)
CACHE_KEY = "ctresources/learned-needs-v2"
WHAT = "learned VRAM needs"
#: The largest learned-needs file read (a need takes about 200 bytes: 100,000 tests fit).
MAX_CACHE_BYTES = 32 << 20
#: The longest key kept: a node id (a path of at most 4096 bytes, a test name, parameter
#: ids) and the memory-relevant config. Longer is no key memory_key wrote.
MAX_KEY_CHARS = 16_384
#: The longest GPU name or date kept (NVML names are under 96 bytes).
MAX_TEXT_CHARS = 256
#: The libraries whose versions are recorded with each learned need (distribution names).
LIBRARIES = ("torch", "transformers", "nnsight", "circuit-tracer")
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
    """The cache key of a test's need: a JSON array of its node id, its memory-relevant
    config values (null for a test without a config) and the ``--ct-vram-capacity`` it ran
    under (null for none: a capped allocator gives its cache back before it fails, so a peak
    measured under a cap is that cap's, not the card's). JSON, not a separator: a node id may
    hold any character, and :func:`nodeid_of` reads it back whole.

    Empty (nothing learned, nothing looked up) for ``batch_size: auto``: its peak follows
    the card it ran on, so a peak measured on one card is no need on another.
    """
    if cfg is None:
        return _KEY_ENCODER.encode([nodeid, None, capacity_gib])
    if cfg.batch_size == AUTO:
        return ""
    values = {name: getattr(cfg, name) for name in MEMORY_FIELDS}
    return _KEY_ENCODER.encode([nodeid, values, capacity_gib])


#: One encoder for every key (``json.dumps`` with arguments makes one per call).
_KEY_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def nodeid_of(key: str) -> str | None:
    """The test a key belongs to (what :func:`memory_key` was given); None for a key it did
    not write (a corrupt cache's)."""
    try:
        decoded = json.loads(key)
    except (ValueError, RecursionError):
        return None
    if (
        isinstance(decoded, list)
        and len(decoded) == 3
        and isinstance(decoded[0], str)
        and isinstance(decoded[1], dict | None)
        and (decoded[2] is None or type(decoded[2]) in (int, float))
    ):
        return decoded[0]
    return None


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
        if nodeid is None:  # no key of a test
            stale.add(key)
            continue
        file = nodeid.split("::", 1)[0]
        if (file in files and nodeid not in collected) or not _exists(exists, file):
            stale.add(key)
    return stale


def _exists(exists: Callable[[str], bool], file: str) -> bool:
    """Whether ``file`` exists; a name no file can have (longer than the file system allows,
    a NUL in it: a key from a corrupt cache) is a test that no longer exists."""
    try:
        return exists(file)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class LearnedNeed:
    """A peak measured in an earlier run."""

    gib: float
    gpu: str
    date: str
    versions: Mapping[str, str] | None = None
    """The libraries' versions it was measured with (None: an entry of an earlier version of
    the plugin, which did not record them)."""

    @property
    def source(self) -> Source:
        return Source.learned(self.gib, self.gpu, self.date)


class LearnedNeedsWarning(CtResourcesWarning):
    """What the plugin learned in pytest's cache (the VRAM needs, the test durations, the GPU
    tests' last runs) could not be read or saved, or some of it was dropped."""


def _warn(message: str) -> None:
    warnings.warn(LearnedNeedsWarning(f"ctresources: {message}"), stacklevel=3)


def _valid_entry(key: object, entry: object) -> bool:
    """Whether a cached ``key: entry`` is one :meth:`LearnedNeeds.update` could have written:
    the cache is a file anyone who can write the project can change, so it is data that may
    be corrupt (a ``10**400`` need overflowed at setup, a 5000-character key was a file
    name too long)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or "\0" in key:
        return False
    if nodeid_of(key) is None:
        return False
    if not isinstance(entry, dict):
        return False
    gib, gpu, date = entry.get("gib"), entry.get("gpu"), entry.get("date")
    if isinstance(gib, bool) or not isinstance(gib, int | float):
        return False
    # An int over a float's range: float() raises; compare before converting.
    if isinstance(gib, int) and not 0 <= gib <= MAX_GIB:
        return False
    if not (math.isfinite(gib) and 0 <= gib <= MAX_GIB):
        return False
    versions = entry.get("versions", {})
    if not isinstance(versions, dict) or len(versions) > len(LIBRARIES):
        return False
    return all(
        isinstance(text, str) and len(text) <= MAX_TEXT_CHARS and text.isprintable()
        for text in (gpu, date, *versions, *versions.values())
    )


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries that move a test's memory (those not
    installed are left out), from their metadata: nothing is imported."""
    from importlib import metadata

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _value_path(cache: pytest.Cache, key: str) -> Path | None:
    """Where ``cache`` keeps ``key``'s value (pytest's ``Cache.get`` opens it as
    it finds it, so a FIFO there blocks forever and a link is followed, and ``Cache.set``
    writes through a link; pytest offers no public accessor for the path, so its
    ``_cachedir`` field is read, and None falls back to ``get``/``set``)."""
    cachedir = getattr(cache, "_cachedir", None)
    return Path(cachedir, "v", *key.split("/")) if isinstance(cachedir, Path) else None


class UnreadableCache(Exception):
    """The cached needs cannot be used; the message says why. ``left_alone``: what is at the
    path is not a regular file (a link, a FIFO, a directory), which saving must not touch."""

    def __init__(self, message: str, *, left_alone: bool = False) -> None:
        super().__init__(message)
        self.left_alone = left_alone


def read_cache(cache: pytest.Cache, key: str = CACHE_KEY, what: str = WHAT) -> object:
    """The value cached under ``key`` (``what`` it holds, for messages), read as data that
    may be hostile: only a regular file (never through a link, never blocking on a FIFO),
    at most :data:`MAX_CACHE_BYTES`, JSON whose depth json's decoder bounds. Raises
    :class:`UnreadableCache`."""
    path = _value_path(cache, key)
    if path is None:
        try:
            return cache.get(key, {})
        except RecursionError:
            raise UnreadableCache(f"the {what} in pytest's cache are nested too deep") from None
    shown_path = printable(str(path))
    try:
        data = read_regular(path, MAX_CACHE_BYTES, follow_links=False)
    except Unreadable as exc:
        if exc.missing:
            return {}
        if exc.link:
            raise UnreadableCache(
                f"{shown_path} is a symbolic link, not {what}; ignored and left alone (remove it)",
                left_alone=True,
            ) from None
        if exc.too_large:
            raise UnreadableCache(f"the {what} at {shown_path} are {exc}") from None
        if exc.in_read:  # a regular file of ours that failed to read: discarded
            raise UnreadableCache(f"cannot read the {what} at {shown_path}: {exc}") from None
        if exc.code is None:  # a directory, a FIFO, a device
            raise UnreadableCache(
                f"{shown_path} is not a regular file, not {what}; ignored and left alone "
                "(remove it)",
                left_alone=True,
            ) from None
        raise UnreadableCache(
            f"cannot read the {what} at {shown_path}: {exc}; ignored and left alone",
            left_alone=True,
        ) from None
    try:
        return json.loads(data)
    except RecursionError:  # json's decoder stops at Python's recursion limit
        raise UnreadableCache(f"the {what} at {shown_path} are nested too deep") from None
    except ValueError:  # not JSON, not UTF-8, an integer of over 4300 digits
        raise UnreadableCache(f"the {what} at {shown_path} are not valid JSON") from None


def read_cache_or_warn(cache: pytest.Cache, key: str, what: str) -> tuple[object, bool]:
    """:func:`read_cache` for a value the run does without when it cannot be used (one
    warning, read as nothing); and whether saving may replace the entry (not what is left
    alone)."""
    try:
        return read_cache(cache, key, what), True
    except UnreadableCache as exc:
        warnings.warn(LearnedNeedsWarning(f"ctresources: {exc}"), stacklevel=3)
        return {}, not exc.left_alone


def write_cache(
    cache: pytest.Cache, value: Mapping[str, Any], key: str = CACHE_KEY, what: str = WHAT
) -> None:
    """Save ``value`` under ``key`` beside nothing of anyone else's: the new content goes to
    a fresh file that replaces the old entry (``rename`` replaces a link, never writes
    through it), and only where the cache holds a regular file or nothing, in real
    directories. Every value the plugin keeps in pytest's cache is saved here."""
    path = _value_path(cache, key)
    if path is None:
        cache.set(key, value)
        return
    shown_path = printable(str(path))
    for directory in (path.parent.parent, path.parent):
        try:
            mode = os.lstat(directory).st_mode
        except FileNotFoundError:
            # Nothing there to write through: pytest creates its directories itself.
            cache.set(key, value)
            return
        except OSError as exc:
            _warn(f"{what} not saved: {shown_path}: {exc.strerror}")
            return
        if not stat.S_ISDIR(mode):
            _warn(
                f"{what} not saved: {printable(str(directory))} in pytest's "
                "cache is not a directory (a link or another file); left alone"
            )
            return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG | 0o644
    except OSError as exc:
        _warn(f"{what} not saved: {shown_path}: {exc.strerror}")
        return
    if not stat.S_ISREG(mode):
        _warn(
            f"{what} not saved: {shown_path} is not a regular file (a link, a "
            "FIFO, a directory); left alone"
        )
        return
    # ASCII, escapes included: a key read from the cache may hold a lone surrogate
    # (``"\\ud800"`` is valid JSON), which UTF-8 cannot encode.
    data = json.dumps(value, indent=2).encode("ascii")
    try:
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        _warn(f"{what} not saved: {shown_path}: {exc.strerror}")
        return
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            os.fchmod(handle.fileno(), stat.S_IMODE(mode))
        os.replace(temporary, path)
    except OSError as exc:
        os.unlink(temporary)
        _warn(f"{what} not saved: {shown_path}: {exc.strerror}")


class LearnedNeeds:
    """The learned needs of this project, loaded once per process."""

    def __init__(
        self, cache: pytest.Cache | None, shipped: Mapping[str, Any] | None = None
    ) -> None:
        """From ``cache``; or, in an xdist worker, from the needs its controller ``shipped``
        (then nothing is saved here: the controller saves). Entries that are not needs are
        dropped, with one warning."""
        self._cache = cache if shipped is None else None
        raw: object = {}
        if shipped is not None:
            raw = dict(shipped)
        elif cache is not None:
            try:
                raw = read_cache(cache)
            except UnreadableCache as exc:
                # Discarded, as pytest's stepwise discards a cache it cannot read; a regular
                # file is replaced by the next save, anything else is never touched.
                _warn(str(exc) + ("" if exc.left_alone else "; discarded"))
                if exc.left_alone:
                    self._cache = None
        if not isinstance(raw, dict):
            _warn(
                f"the learned VRAM needs in pytest's cache are a {type(raw).__name__}, not a "
                "mapping; discarded"
            )
            raw = {}
        self._needs: dict[str, dict[str, Any]] = {
            key: entry for key, entry in raw.items() if _valid_entry(key, entry)
        }
        dropped = [key for key in raw if key not in self._needs]
        if dropped:
            first = dropped[0] if isinstance(dropped[0], str) else str(dropped[0])
            _warn(
                f"dropped {len(dropped)} learned VRAM need(s) from pytest's cache that are "
                f"not valid (the first: {shown(first)})"
            )

    def to_mapping(self) -> dict[str, dict[str, Any]]:
        """The needs as the cache keeps them (what a controller ships to its workers)."""
        return {key: dict(entry) for key, entry in self._needs.items()}

    def __bool__(self) -> bool:
        return bool(self._needs)

    def get(self, key: str) -> LearnedNeed | None:
        entry = self._needs.get(key)
        if entry is None:
            return None
        versions = entry.get("versions")
        return LearnedNeed(
            float(entry["gib"]),
            str(entry["gpu"]),
            str(entry["date"]),
            dict(versions) if versions is not None else None,
        )

    def update(self, learned: Mapping[str, LearnedNeed]) -> None:
        for key, need in learned.items():
            entry: dict[str, Any] = {"gib": round(need.gib, 3), "gpu": need.gpu, "date": need.date}
            if need.versions is not None:
                entry["versions"] = dict(need.versions)
            self._needs[key] = entry

    def save(self) -> None:
        if self._cache is not None:
            write_cache(self._cache, self._needs)

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
