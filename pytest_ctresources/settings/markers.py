"""The ``vram``, ``ct_config`` and ``ct_parametrize`` markers: typed functions that validate
their arguments.

As in pytest-memray, each marker is a Python function whose signature is the marker's
signature: binding a marker's args to it rejects unknown keywords, and its docstring's
first line is the ``pytest --markers`` help. A marker is parsed once per test; a bad one
raises :class:`MarkerError`, which fails that test alone at setup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_ctresources.settings.config import (
    CircuitTracerConfig,
    ConfigError,
    checked_fields,
    did_you_mean,
    gib_amount,
    shown,
)
from pytest_ctresources.settings.parametrize import ParamsReference, split_argnames
from pytest_ctresources.settings.sources import Source


class MarkerError(Exception):
    """A marker whose arguments are wrong; the message is one line for the user."""


def vram(gib: float) -> float:
    """vram(gib): the test's peak VRAM need in GiB; skipped when it exceeds the GPU's capacity."""
    try:
        return gib_amount(gib)  # finite, at most MAX_GIB: inf and 10**400 are refused
    except ConfigError as exc:
        raise MarkerError(f"gib {exc}") from None


def ct_config(path: str | None = None, **overrides: object) -> tuple[str | None, dict[str, Any]]:
    """ct_config(path=None, **fields): experiment YAML and CircuitTracerConfig overrides."""
    if path is not None and not isinstance(path, str):
        raise MarkerError(f"path must be a string, got {shown(path)}")
    try:
        return path, checked_fields(overrides)
    except ConfigError as exc:
        raise MarkerError(str(exc)) from None


def ct_parametrize(
    argnames: str | Sequence[str], key: str, path: str | None = None
) -> ParamsReference:
    """ct_parametrize(argnames, key, path=None): a test per element of the list PARAMS[key]."""
    try:
        names = split_argnames(argnames)
    except ValueError as exc:
        raise MarkerError(str(exc)) from None
    if not isinstance(key, str) or not key:
        raise MarkerError(f"key must name a PARAMS key, got {shown(key)}")
    if path is not None and not isinstance(path, str):
        raise MarkerError(f"path must be a string, got {shown(path)}")
    return ParamsReference(names, key, path)


MARKERS: Mapping[str, Callable[..., Any]] = {
    "vram": vram,
    "ct_config": ct_config,
    "ct_parametrize": ct_parametrize,
}


def usage(name: str) -> str:
    """``name(signature)`` of one of our markers, as users write it."""
    signature = inspect.signature(MARKERS[name], eval_str=True)
    return f"{name}{signature.replace(return_annotation=inspect.Signature.empty)}"


def marker_help(name: str) -> str:
    """The ``pytest --markers`` line of one of our markers, from its function's docstring."""
    return (MARKERS[name].__doc__ or "").strip().splitlines()[0]


def _call(name: str, mark: pytest.Mark, nodeid: str) -> Any:
    func = MARKERS[name]
    signature = inspect.signature(func)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    unknown = [] if accepts_any else [k for k in mark.kwargs if k not in signature.parameters]
    problem = None
    if unknown:
        problem = (
            f"unknown keyword {shown(unknown[0])}{did_you_mean(unknown[0], signature.parameters)}"
        )
    else:
        try:
            signature.bind(*mark.args, **mark.kwargs)
        except TypeError as exc:
            problem = str(exc)
    if problem is None:
        try:
            return func(*mark.args, **mark.kwargs)
        except MarkerError as exc:
            problem = str(exc)
    raise MarkerError(
        f"invalid @pytest.mark.{name} on {nodeid}: {problem}; usage: @pytest.mark.{usage(name)}"
    )


@dataclass(frozen=True)
class VramNeed:
    """A declared VRAM need and where it was declared."""

    gib: float
    source: Source
    most_gib: float | None = None
    """For an estimate: the most the test may take (at the largest batch size it may use,
    capped at the GPU), which its VRAM lease and the ESTIMATE LOW check use; ``gib`` is the
    least it needs, which the skip decision uses. None: a declared need, both are ``gib``."""

    @property
    def lease_gib(self) -> float:
        return self.gib if self.most_gib is None else self.most_gib

    def exceeded_by(self, peak_reserved_gib: float) -> bool:
        """Whether a test's peak went over its declared need (UNDER-DECLARED with
        ``--ct-strict``, a snapshot kept under ``on-failure``): an estimate is not a
        declaration, so going over one is not counted."""
        return self.source.kind != "estimate" and peak_reserved_gib > self.lease_gib


def vram_need(item: pytest.Item) -> VramNeed | None:
    """The test's ``vram`` marker (closest wins), or None."""
    # Every test the plugin acts for asks this at setup: the keywords (a few dict look-ups up
    # the node chain, which hold every marker's name) rule out most before markers are walked.
    if "vram" not in item.keywords:
        return None
    mark = item.get_closest_marker("vram")
    if mark is None:
        return None
    return VramNeed(_call("vram", mark, item.nodeid), Source.marker("vram", item.nodeid))


def params_references(item: pytest.Item) -> list[ParamsReference]:
    """The item's ``ct_parametrize`` markers (function, class, module), each parsed."""
    return [
        _call("ct_parametrize", mark, item.nodeid) for mark in item.iter_markers("ct_parametrize")
    ]


def shown_yaml_path(item: pytest.Item, base_dir: Path, path: str) -> Path:
    """A marker's ``path=`` file, relative to where pytest runs when it is below it (as
    ``--ct-config`` paths are shown), so that sources read ``BATCH_SIZE in tests/own.yaml``."""
    target = Path(path) if Path(path).is_absolute() else base_dir / path
    here = item.config.invocation_params.dir
    try:
        if Path.cwd() == here:
            return target.relative_to(here)
    except (OSError, ValueError):  # a removed working directory; a file outside it
        pass
    return target


def layer_markers(item: pytest.Item, below: CircuitTracerConfig) -> CircuitTracerConfig:
    """Lay the item's ``ct_config`` markers (module, then class, then function) over ``below``.

    ``path=`` YAML files are laid first, then keyword overrides; relative paths are taken
    from the directory of the test's file.
    """
    # Imported here: the marker functions and their help are read at every pytest start-up,
    # and a test with a ct_config marker is rare.
    from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml

    marks = list(item.iter_markers("ct_config"))
    cfg = below
    base_dir = Path(str(item.path)).parent
    parsed = [(_call("ct_config", mark, item.nodeid)) for mark in reversed(marks)]
    for path, _overrides in parsed:
        if path is None:
            continue
        try:
            cfg = load_experiment_yaml(shown_yaml_path(item, base_dir, path)).apply(cfg)
        except ConfigError as exc:
            raise MarkerError(f"invalid @pytest.mark.ct_config on {item.nodeid}: {exc}") from None
    source = Source.marker("ct_config", item.nodeid)
    for _path, overrides in parsed:
        if overrides:
            cfg = cfg.layered(overrides, source)
    return cfg
