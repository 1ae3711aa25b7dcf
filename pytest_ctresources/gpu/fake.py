"""The fake GPU seam: ``CT_FAKE_GPUS`` presents GPUs of given sizes to the plugin, and
``CT_FAKE_GPUS_USED`` the memory other processes hold on them, so the CPU suite and a user's
dry run exercise every decision that depends on a GPU (skips, placement, leases) without one.

Only the variables' names and their parsers live here, importing nothing heavier than the
units: the names are read at every pytest start-up (they ask for the plugin,
settings/activation.py); ``gpu/detect.py`` turns a parsed value into :class:`GpuFacts`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pytest_ctresources.units import MAX_GIB, printable, shown

FAKE_GPUS_ENV = "CT_FAKE_GPUS"
FAKE_GPUS_USED_ENV = "CT_FAKE_GPUS_USED"

_FAKE_FORMAT = (
    "expected entries 'NAME=GIB' or 'GIB' separated by ';', "
    "e.g. 'NVIDIA GeForce RTX 4090=23.6;NVIDIA H200=139.8'"
)


def parse_fake_gpus(text: str) -> list[tuple[str, float]]:
    """Parse a ``CT_FAKE_GPUS`` value into ``(name, GiB)`` pairs, in order.

    Entries are separated by ``;``; each is ``NAME=GIB`` or just ``GIB`` (named
    ``"Fake GPU"``). Empty entries (e.g. a trailing ``;``) are ignored, so an empty value
    means "no GPUs". Raises ``ValueError("CT_FAKE_GPUS: ...")`` naming the bad entry.
    """
    gpus: list[tuple[str, float]] = []
    for position, raw in enumerate(text.split(";"), start=1):
        entry = raw.strip()
        if not entry:
            continue
        # rpartition: the capacity is after the last '=', so a name may itself contain '='.
        name, sep, number = entry.rpartition("=")
        name = name.strip() if sep else "Fake GPU"
        if not name:
            raise ValueError(
                f"{FAKE_GPUS_ENV}: entry {position} {shown(raw)} has an empty name; {_FAKE_FORMAT}"
            )
        try:
            gib = float(number)
        except ValueError:
            raise ValueError(
                f"{FAKE_GPUS_ENV}: entry {position} {shown(raw)}: {shown(number.strip())} is not a "
                f"number of GiB; {_FAKE_FORMAT}"
            ) from None
        if not math.isfinite(gib) or gib <= 0 or gib > MAX_GIB:
            raise ValueError(
                f"{FAKE_GPUS_ENV}: entry {position} {shown(raw)}: capacity must be a positive "
                f"number of GiB, at most {MAX_GIB:g}; {_FAKE_FORMAT}"
            )
        # An escape sequence in a name would rewrite the terminal where the name is shown.
        gpus.append((printable(name), gib))
    return gpus


def fake_used_gib(environ: Mapping[str, str]) -> list[float] | None:
    """GiB in use on each fake GPU, by position, as ``CT_FAKE_GPUS_USED`` says (None without
    ``CT_FAKE_GPUS``). Raises ``ValueError`` if either variable is malformed."""
    fake = environ.get(FAKE_GPUS_ENV)
    if fake is None:
        return None
    capacities = [gib for _name, gib in parse_fake_gpus(fake)]
    return parse_fake_used(environ.get(FAKE_GPUS_USED_ENV, ""), capacities)


def parse_fake_used(text: str, capacities: Sequence[float] = ()) -> list[float]:
    """Parse a ``CT_FAKE_GPUS_USED`` value: GiB in use on each fake GPU, by position.

    Entries are separated by ``;`` (``"6;0.5"``); missing ones are 0. With ``capacities``
    (the fake GPUs' sizes), an entry may not exceed its GPU. Raises
    ``ValueError("CT_FAKE_GPUS_USED: ...")`` naming the bad entry.
    """
    used: list[float] = []
    for position, raw in enumerate(text.split(";"), start=1):
        entry = raw.strip()
        try:
            gib = float(entry) if entry else 0.0
        except ValueError:
            gib = math.nan
        if not math.isfinite(gib) or gib < 0:
            raise ValueError(
                f"{FAKE_GPUS_USED_ENV}: entry {position} {shown(raw)} is not a number of GiB >= 0; "
                "expected GiB in use per fake GPU separated by ';', e.g. '6;0.5'"
            )
        if position <= len(capacities) and gib > capacities[position - 1]:
            raise ValueError(
                f"{FAKE_GPUS_USED_ENV}: entry {position} {shown(raw)} exceeds fake GPU "
                f"{position - 1}'s "
                f"{capacities[position - 1]:g} GiB ({FAKE_GPUS_ENV})"
            )
        used.append(gib)
    return used
