"""Tests parametrized from an experiment config's ``PARAMS``: the pure part.

``@pytest.mark.ct_parametrize("prompt", "PROMPTS")`` makes one test per element of the list
under ``PARAMS: PROMPTS:`` in the session's experiment YAML (or the marker's ``path=`` YAML),
as ``@pytest.mark.parametrize`` would, so each prompt has its own test id, ``-k``, ``--lf``
and VRAM accounting. With several names (``"prompt, target"``) each element is a list of
that many values or a mapping with those keys.

This module turns a reference and a config's ``PARAMS`` into argument values and ids (no
pytest, no I/O); :mod:`pytest_ctresources.settings.parametrize_tests` is the pytest side.
Ids come from the values alone, so every xdist worker, reading the same file, collects the
same items: no ``hash()`` (salted per process), no counters across tests.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_ctresources.settings.config import did_you_mean, shown
from pytest_ctresources.units import named

#: The longest id made from one value; longer ones are cut and told apart by a digest.
MAX_ID = 32
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]+")
#: How many of PARAMS' keys a missing key's message lists.
_KEYS_LISTED = 10


class ParametrizeError(Exception):
    """A reference that the config cannot satisfy; the message is one line for the user."""


@dataclass(frozen=True)
class ParamsReference:
    """One ``ct_parametrize`` marker: the argument names, the ``PARAMS`` key holding their
    list, and the YAML it names (None: the session's experiment config)."""

    argnames: tuple[str, ...]
    key: str
    path: str | None = None


@dataclass(frozen=True)
class ParameterSets:
    """What ``metafunc.parametrize`` is given."""

    argnames: tuple[str, ...]
    argvalues: list[Any]
    ids: list[str]


def split_argnames(argnames: str | Sequence[str]) -> tuple[str, ...]:
    """``"prompt, target"`` or ``["prompt", "target"]`` as pytest's parametrize reads them;
    raises ValueError for anything else."""
    names = (
        [name.strip() for name in argnames.split(",")]
        if isinstance(argnames, str)
        else list(argnames)
        if isinstance(argnames, (list, tuple))
        else None
    )
    if not names or not all(isinstance(name, str) and name.isidentifier() for name in names):
        raise ValueError(
            f"argnames must name arguments ('prompt' or 'prompt, target'), got {shown(argnames)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"argnames name an argument twice: {shown(argnames)}")
    return tuple(names)


def parameter_sets(
    reference: ParamsReference, config: str, params: Mapping[str, Any]
) -> ParameterSets:
    """The argument values and ids ``reference`` names in ``params``, the ``PARAMS`` of the
    YAML shown as ``config``. Raises :class:`ParametrizeError` naming the config and the key
    for a missing key, a value that is not a list, or an element that does not fit the names."""
    key, names = reference.key, reference.argnames
    if key not in params:
        # Keys are data: each quoted as a one-line message may show it, the first few only.
        listed = [named(str(name)) for name in list(params)[:_KEYS_LISTED]]
        more = len(params) - len(listed)
        keys = ", ".join(listed) + (f" and {more} more" if more else "") if listed else "none"
        raise ParametrizeError(
            f"{config}: PARAMS has no key {shown(key)}{did_you_mean(key, map(str, params))}; "
            f"its keys: {keys}"
        )
    values = params[key]
    if not isinstance(values, list):
        raise ParametrizeError(
            f"{config}: PARAMS {key} must be a list (one test per element), "
            f"got {type(values).__name__} {shown(values)}"
        )
    argvalues = [_row(config, key, index, names, value) for index, value in enumerate(values)]
    ids = [_row_id(key, index, names, row) for index, row in enumerate(argvalues)]
    return ParameterSets(names, argvalues, ids)


def _row(config: str, key: str, index: int, names: tuple[str, ...], value: Any) -> Any:
    # A copy per test: the file's values are cached and shared, and a test may change its own.
    value = copy.deepcopy(value)
    if len(names) == 1:
        return value
    where = f"{config}: PARAMS {key}[{index}]"
    if isinstance(value, dict):
        missing = [name for name in names if name not in value]
        if missing:
            raise ParametrizeError(
                f"{where} has no {shown(missing[0])} (a mapping needs a key per name: "
                f"{', '.join(names)})"
            )
        return tuple(value[name] for name in names)
    if not isinstance(value, list) or len(value) != len(names):
        raise ParametrizeError(
            f"{where} must be a list of {len(names)} values or a mapping with keys "
            f"{', '.join(names)}, got {shown(value)}"
        )
    return tuple(value)


def _row_id(key: str, index: int, names: tuple[str, ...], row: Any) -> str:
    values = (row,) if len(names) == 1 else row
    return "-".join(value_id(value, f"{key}{index}") for value in values)


def value_id(value: Any, fallback: str) -> str:
    """A short id safe in node ids, ``-k`` and shells, made from ``value`` alone: a string,
    number or boolean with every run of other characters than letters, digits, ``_`` and
    ``.`` made one ``-``, cut at :data:`MAX_ID` with a digest of the whole (so that long
    prompts sharing a beginning stay apart); ``fallback`` for other values and for values
    with nothing left."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float) or (isinstance(value, int) and value.bit_length() <= 100):
        # A number's own text is safe, and keeps its sign, which the rule for strings would
        # drop; str() of an int over 4300 digits raises.
        return str(value)
    if not isinstance(value, str):
        return fallback
    safe = _UNSAFE.sub("-", value).strip("-")
    if not safe:
        return fallback
    if len(safe) <= MAX_ID:
        return safe
    digest = hashlib.sha1(value.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    return f"{safe[: MAX_ID - 7].rstrip('-')}-{digest}"
