"""Where a setting came from: the provenance every resolved value carries.

Error messages, the ``pytest -v`` header and reports all name a value's source the same
way, so the formatting lives here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

# Re-exported: reports and messages escape text through sources' name.
from pytest_ctresources.units import printable as printable

SourceKind = Literal["default", "ini", "yaml", "marker", "env", "option", "learned", "estimate"]

#: Covariant: a Sourced is frozen, so a Sourced[str] is a Sourced[object].
T = TypeVar("T", covariant=True)


@dataclass(frozen=True)
class Source:
    """One origin of a setting: its layer (``kind``) and the precise place within it."""

    kind: SourceKind
    where: str
    path: str | None = None  # the file, for a value read from an experiment YAML

    def __str__(self) -> str:
        return self.where

    @classmethod
    def default(cls) -> Source:
        return cls("default", "default")

    @classmethod
    def option(cls, flag: str) -> Source:
        return cls("option", flag)

    @classmethod
    def env(cls, name: str) -> Source:
        return cls("env", f"env {name}")

    @classmethod
    def ini(cls, key: str, inifile: str | None, overridden: Collection[str] = ()) -> Source:
        """An ini key: from the ini file, or from the command line (``-o key=value``: the
        keys in ``overridden``)."""
        if key in overridden:
            return cls("ini", f"-o {key}")
        return cls("ini", f"ini {key}" + (f" in {printable(inifile)}" if inifile else ""))

    @classmethod
    def yaml(cls, path: str, key: str) -> Source:
        return cls("yaml", f"{key} in {printable(path)}", path)

    @classmethod
    def marker(cls, name: str, nodeid: str) -> Source:
        return cls("marker", f"@pytest.mark.{name} on {printable(nodeid)}")

    @classmethod
    def estimate(cls, what: str) -> Source:
        return cls("estimate", f"estimated for {what}")

    @classmethod
    def learned(cls, gib: float, gpu: str, date: str) -> Source:
        return cls("learned", f"measured {gib:.1f} GiB on {printable(gpu)}, {printable(date)}")


@dataclass(frozen=True)
class Sourced(Generic[T]):
    """A value together with the source it was resolved from."""

    value: T
    source: Source
