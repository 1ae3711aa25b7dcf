"""Flat experiment YAML files: ``MODEL_NAME``, ``BATCH_SIZE``, ... and a ``PARAMS`` mapping.

Read with ``yaml.safe_load`` only. Every top-level key is one of ours (a
:data:`~pytest_ctresources.config.FIELDS` name in upper case) or ``PARAMS``, the one home
for the experiment's own parameters (prompts, layer lists a notebook uses); anything else
is a :class:`~pytest_ctresources.config.ConfigError` with a did-you-mean suggestion, so a
typo such as ``BATCH_SIZ`` never silently runs at the default.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pytest_ctresources.config import (
    FIELDS,
    NOTEBOOK_KEY,
    PARAMS_KEY,
    CircuitTracerConfig,
    ConfigError,
    did_you_mean,
    validate_typed,
)
from pytest_ctresources.sources import Source

_FIELD_BY_KEY = {spec.yaml_key: name for name, spec in FIELDS.items()}
KNOWN_KEYS: tuple[str, ...] = (*_FIELD_BY_KEY, PARAMS_KEY, NOTEBOOK_KEY)


@dataclass(frozen=True)
class ExperimentFile:
    """A validated experiment YAML: config field values and the experiment's PARAMS."""

    path: str
    values: Mapping[str, object]
    params: Mapping[str, Any]
    notebook: Path | None = None  # NOTEBOOK, resolved against the file's directory

    def apply(self, cfg: CircuitTracerConfig) -> CircuitTracerConfig:
        """``cfg`` with this file's values laid over it, each sourced ``KEY in path``."""
        return cfg.layered(
            self.values,
            lambda name: Source.yaml(self.path, FIELDS[name].yaml_key),
            params=self.params,
        )


def load_experiment_yaml(path: str | os.PathLike[str]) -> ExperimentFile:
    """Read and validate one experiment YAML file.

    Raises :class:`ConfigError` with a one-line message that starts with the file name.
    Results are cached per absolute path and modification time.
    """
    resolved = Path(path)
    try:
        stat = resolved.stat()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read experiment config: {exc.strerror}") from None
    return _load(str(path), str(resolved.resolve()), stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _load(shown: str, absolute: str, _mtime_ns: int) -> ExperimentFile:
    import yaml

    try:
        text = Path(absolute).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{shown}: cannot read experiment config: {reason}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{shown}: malformed YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{shown}: the top level must be a mapping of KEY: value, got a {type(data).__name__}"
        )
    notebook = data.pop(NOTEBOOK_KEY, None)
    if notebook is not None and (not isinstance(notebook, str) or not notebook.strip()):
        raise ConfigError(f"{shown}: {NOTEBOOK_KEY} must be a notebook path, got {notebook!r}")
    values, params = _validate(shown, data)
    return ExperimentFile(
        shown, values, params, Path(absolute).parent / notebook if notebook else None
    )


def _validate(shown: str, data: dict[Any, Any]) -> tuple[Mapping[str, object], Mapping[str, Any]]:
    values: dict[str, object] = {}
    params: Mapping[str, Any] = MappingProxyType({})
    for key, value in data.items():
        if key == PARAMS_KEY:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{shown}: {PARAMS_KEY} must be a mapping of the experiment's own "
                    f"parameters, got {type(value).__name__}"
                )
            params = MappingProxyType(dict(value))
            continue
        name = _FIELD_BY_KEY.get(key) if isinstance(key, str) else None
        if name is None:
            raise ConfigError(
                f"{shown}: unknown key {key!r}{did_you_mean(str(key), KNOWN_KEYS)}; "
                f"experiment parameters of your own go under {PARAMS_KEY}:"
            )
        if value is None:
            # ``BATCH_SIZE: null`` means "not set here", as in the seed notes' tables.
            continue
        try:
            values[name] = validate_typed(name, value)
        except ConfigError as exc:
            raise ConfigError(f"{shown}: {key} {exc}") from None
    return MappingProxyType(values), params
