"""The allocation sites a CUDA memory snapshot shows alive at its peak, readable without a
viewer: the file:line of the user's code, and of circuit-tracer or nnsight, that allocated
most.

Pure: it reads torch's snapshot format (``torch.cuda.memory._snapshot()``: ``segments`` with
their ``blocks``, and per device a ``device_traces`` list of ``alloc``, ``free_requested``,
``free_completed`` and ``oom`` events, each allocation with its ``frames``, innermost first)
as a plain dict; no torch, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any

from pytest_ctresources.units import bytes_text

#: Frames of these packages are the library's sites that a report names beside the user's.
LIBRARIES = ("circuit_tracer", "nnsight", "transformer_lens")
#: Frames of these are neither: torch, the test runner, this plugin, a notebook's kernel.
_NEITHER = frozenset(
    {"torch", "_pytest", "pytest", "pluggy", "pytest_ctresources", "nbclient", "ipykernel"}
)
_FREES = frozenset({"free_requested", "free_completed"})

Allocation = tuple[int, Sequence[Mapping[str, Any]]]
"""One live allocation: its size in bytes and its frames (innermost first)."""


@dataclass(frozen=True)
class Site:
    """Memory alive at the peak that one place in the code allocated."""

    bytes: int
    blocks: int
    user: str | None
    """``tests/test_x.py:12 (test_big)``: the innermost frame of the user's code."""
    library: str | None
    """``circuit_tracer/attribution/attribute.py:120 (attribute)``: the innermost frame of
    circuit-tracer, nnsight or TransformerLens, if the allocation came through one."""

    def text(self) -> str:
        where = " via ".join(part for part in (self.user, self.library) if part)
        return f"{bytes_text(self.bytes)} in {self.blocks} block(s) at {where or 'unknown'}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def alive_at_peak(snapshot: Mapping[str, Any]) -> tuple[list[Allocation], str]:
    """The allocations alive at the moment that matters, and which moment: when the device
    that peaked highest ran out of memory (the last ``oom`` event), else at its peak of
    allocated memory. Without a trace (history not recorded), what is still allocated."""
    best: tuple[int, list[Allocation], str] | None = None
    for events in snapshot.get("device_traces") or []:
        found = _replay(events)
        if found is not None and (best is None or found[0] > best[0]):
            best = found
    if best is not None:
        return best[1], best[2]
    return allocated(snapshot), "still allocated"


def _replay(events: Sequence[Mapping[str, Any]]) -> tuple[int, list[Allocation], str] | None:
    """One device's events replayed twice: to find the moment, then to it."""
    total = peak = 0
    moment = -1
    alive: dict[int, int] = {}
    for index, event in enumerate(events):
        action, address = event.get("action"), int(event.get("addr", 0))
        if action == "alloc":
            alive[address] = int(event.get("size", 0))
            total += alive[address]
            if total > peak:
                peak, moment = total, index
        elif action in _FREES and address in alive:
            total -= alive.pop(address)
    ooms = [index for index, event in enumerate(events) if event.get("action") == "oom"]
    if ooms:
        moment = ooms[-1]
    if moment < 0:
        return None
    live: dict[int, Allocation] = {}
    for event in events[: moment + 1]:
        action, address = event.get("action"), int(event.get("addr", 0))
        if action == "alloc":
            live[address] = (int(event.get("size", 0)), event.get("frames") or [])
        elif action in _FREES:
            live.pop(address, None)
    return peak, list(live.values()), "when it ran out of memory" if ooms else "at the peak"


def allocated(snapshot: Mapping[str, Any]) -> list[Allocation]:
    """The blocks still allocated when the snapshot was taken."""
    return [
        (int(block.get("size", 0)), block.get("frames") or [])
        for segment in snapshot.get("segments") or []
        for block in segment.get("blocks") or []
        if block.get("state") == "active_allocated"
    ]


def top_sites(allocations: Iterable[Allocation], root: str = "", limit: int = 5) -> list[Site]:
    """The ``limit`` sites holding most of ``allocations``, largest first; user paths shown
    relative to ``root``."""
    grouped: dict[tuple[str | None, str | None], list[int]] = {}
    for size, frames in allocations:
        key = (_innermost(frames, root, library=False), _innermost(frames, root, library=True))
        entry = grouped.setdefault(key, [0, 0])
        entry[0] += size
        entry[1] += 1
    sites = [Site(size, count, user, library) for (user, library), (size, count) in grouped.items()]
    return sorted(sites, key=lambda site: -site.bytes)[:limit]


def _innermost(frames: Sequence[Mapping[str, Any]], root: str, *, library: bool) -> str | None:
    for frame in frames:
        filename = str(frame.get("filename", ""))
        parts = PurePosixPath(filename).parts
        package = next((index for index, part in enumerate(parts) if part in LIBRARIES), None)
        if library and package is not None:
            shown = "/".join(parts[package:])
        elif not library and package is None and _users(filename, parts):
            prefix = root.rstrip("/") + "/"
            shown = filename.removeprefix(prefix) if root else filename
        else:
            continue
        return f"{shown}:{frame.get('line', '?')} ({frame.get('name', '?')})"
    return None


def _users(filename: str, parts: Sequence[str]) -> bool:
    """Whether a frame is the user's code: not an installed package, the standard library,
    torch or the runner (``<frozen ...>``, ``<string>``: neither)."""
    if filename.startswith("<") or _NEITHER.intersection(parts):
        return False
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not any(re.fullmatch(r"python3\.\d+", part) for part in parts[:-1])
