"""The VRAM regression gate, pure: has a test's peak grown over its last passing peak?

A test's last passing peak is its learned need (:mod:`~pytest_ctresources.core.learned`),
recorded with the GPU it ran on, the date and the versions of the libraries that move
memory. A peak is compared only with one measured on the same GPU model under the same
memory key (node id and memory-relevant config). An entry written before versions were
recorded is compared on its peak, and the line says the versions were not recorded then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pytest_ctresources.core.learned import LIBRARIES, LearnedNeed


@dataclass(frozen=True)
class Increase:
    """A peak that grew by more than the allowed share over the last passing one."""

    nodeid: str
    gpu: str
    before_gib: float
    before_date: str
    peak_gib: float
    date: str
    changed_versions: tuple[str, ...] | None
    """``torch 2.4.0 -> 2.5.1`` for each library that changed; None: not recorded then."""

    @property
    def percent(self) -> float:
        return (self.peak_gib / self.before_gib - 1) * 100 if self.before_gib else 100.0

    def line(self) -> str:
        """One line: both peaks, both dates, and the library versions that changed."""
        if self.changed_versions is None:
            versions = "library versions not recorded then"
        elif self.changed_versions:
            versions = "changed since: " + ", ".join(self.changed_versions)
        else:
            versions = "no library version changed"
        return (
            f"{self.nodeid}: peak {self.peak_gib:.2f} GiB reserved on {self.date}, up "
            f"{self.percent:.0f}% from {self.before_gib:.2f} GiB on {self.before_date} "
            f"({self.gpu}); {versions}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["changed_versions"] = (
            None if self.changed_versions is None else list(self.changed_versions)
        )
        out["percent"] = round(self.percent, 1)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Increase:
        changed = data.get("changed_versions")
        return cls(
            nodeid=str(data["nodeid"]),
            gpu=str(data["gpu"]),
            before_gib=float(data["before_gib"]),
            before_date=str(data["before_date"]),
            peak_gib=float(data["peak_gib"]),
            date=str(data["date"]),
            changed_versions=None if changed is None else tuple(map(str, changed)),
        )


def changed_versions(
    before: Mapping[str, str] | None, now: Mapping[str, str]
) -> tuple[str, ...] | None:
    """``name old -> new`` for each of :data:`LIBRARIES` whose version differs (``none``:
    not installed); None when ``before`` was not recorded."""
    if before is None:
        return None
    return tuple(
        f"{name} {before.get(name, 'none')} -> {now.get(name, 'none')}"
        for name in LIBRARIES
        if before.get(name) != now.get(name)
    )


def increase(
    nodeid: str,
    before: LearnedNeed | None,
    peak_gib: float,
    gpu: str,
    date: str,
    versions: Mapping[str, str],
    percent: float,
) -> Increase | None:
    """The increase of ``peak_gib`` on ``gpu`` over ``before`` (its last passing peak), if
    more than ``percent``; None when there is no earlier peak on the same GPU model, or it
    grew by no more."""
    if before is None or before.gpu != gpu or peak_gib <= before.gib * (1 + percent / 100):
        return None
    return Increase(
        nodeid,
        gpu,
        before.gib,
        before.date,
        round(peak_gib, 3),
        date,
        changed_versions(before.versions, versions),
    )
