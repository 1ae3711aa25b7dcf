"""Flat experiment YAML files: ``MODEL_NAME``, ``BATCH_SIZE``, ... and a ``PARAMS`` mapping.

Read with PyYAML's safe loader only, and bounded (:data:`MAX_BYTES`, :data:`MAX_DEPTH`,
:data:`MAX_VALUES`, :data:`MAX_CHARS`, :data:`MAX_INT_CHARS`): a config is user input that
pytest reads before any test runs, and a hostile one (nested 20,000 deep, a billion-laughs
alias bomb, an alias that contains itself, a 5000-digit integer) must be one clear error,
not a ``RecursionError``, a hang, a ``MemoryError`` or an ``INTERNALERROR``. Every top-level
key is one of ours (a :data:`~pytest_ctresources.settings.config.FIELDS` name in upper case)
or ``PARAMS``, the one home for the experiment's own parameters (prompts, layer lists a
notebook uses); anything else is a :class:`~pytest_ctresources.settings.config.ConfigError`
with a did-you-mean suggestion, so a typo such as ``BATCH_SIZ`` never silently runs at the
default.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from pytest_ctresources.reading import Unreadable, read_regular
from pytest_ctresources.settings.config import (
    FIELDS,
    NOTEBOOK_KEY,
    PARAMS_KEY,
    CircuitTracerConfig,
    ConfigError,
    did_you_mean,
    shown,
    validate_typed,
)
from pytest_ctresources.settings.sources import Source, printable
from pytest_ctresources.units import MIB

_FIELD_BY_KEY = {spec.yaml_key: name for name, spec in FIELDS.items()}
KNOWN_KEYS: tuple[str, ...] = (*_FIELD_BY_KEY, PARAMS_KEY, NOTEBOOK_KEY)

#: The largest experiment config read, in bytes (prompts and layer lists fit many times).
MAX_BYTES = MIB
#: The deepest nesting of lists and mappings (PARAMS of real experiments nest 2-4 deep).
MAX_DEPTH = 64
#: The most values (scalars, lists, mappings) once aliases are expanded: what a report or
#: a notebook's injected cell will hold. Aliases are legal YAML and stay allowed; a
#: billion-laughs document (9 aliases of 9 aliases ...) expands to 10**9 and is refused.
MAX_VALUES = 100_000
#: The most characters the scalars hold once aliases are expanded: a few aliases of aliases
#: of one long string are few values and gigabytes of text.
MAX_CHARS = 16 * MIB
#: The longest integer Python reads from text (``sys.int_info.default_max_str_digits``): a
#: longer one is refused before PyYAML builds it (a base-60 ``1:1:1:...`` is built by
#: repeated multiplication, which no digit limit stops, in time quadratic in its length).
MAX_INT_CHARS = 4300
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _TooComplex(Exception):
    """The document breaks one of the bounds; the message says which, and where."""


@functools.lru_cache(maxsize=4)
def _bounded_loader(yaml: ModuleType) -> type:
    """PyYAML's SafeLoader, refusing nesting beyond :data:`MAX_DEPTH` while it composes
    (its composer recurses: 20,000 levels are a RecursionError). Built on first use, yaml
    being imported only when a config is read, and per yaml module object: pytester's
    in-process runs restore ``sys.modules``, so a later import can be a new module whose
    error and node classes a loader built on the old one would not raise or produce."""

    base: Any = yaml.SafeLoader

    def compose_node(self: Any, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise _TooComplex(
                    f"nested deeper than {MAX_DEPTH} levels at line {line} (the limit)"
                )
            return base.compose_node(self, parent, index)
        finally:
            self.depth -= 1

    # Built with type(): the base class is yaml's, known only at run time.
    return type("BoundedSafeLoader", (base,), {"depth": 0, "compose_node": compose_node})


def _line(node: Any) -> int:
    return int(node.start_mark.line) + 1


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_scalar(loader: Any, node: Any) -> None:
    import yaml

    if not isinstance(node, yaml.ScalarNode):
        return
    if node.tag == _INT_TAG:
        try:
            if len(node.value) > MAX_INT_CHARS:
                raise ValueError
            loader.construct_yaml_int(node)
        except ValueError:  # over sys.get_int_max_str_digits() (4300) digits
            text = node.value
            size = f"has {len(text)} digits" if text.isdigit() else f"is {len(text)} characters"
            raise _TooComplex(
                f"the integer at line {_line(node)} {size}, more than Python reads "
                f"({MAX_INT_CHARS})"
            ) from None
    elif node.tag == _FLOAT_TAG:
        text = node.value.lower()
        if (
            "inf" not in text
            and "nan" not in text
            and math.isinf(loader.construct_yaml_float(node))
        ):
            raise _TooComplex(
                f"the number {shown(node.value)} at line {_line(node)} is beyond a float's "
                "range (write .inf if infinity is meant)"
            )


def _check_mapping_keys(node: Any) -> None:
    import yaml

    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key, _value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
            if key.value in seen:
                raise _TooComplex(
                    f"duplicate key {shown(key.value)} at line {_line(key)} (first at line "
                    f"{seen[key.value]}); YAML keys must be unique"
                )
            seen[key.value] = _line(key)


def _check_graph(loader: Any, root: Any) -> None:
    """Walk the composed node graph once (aliases are shared nodes): count the values, the
    characters and the depth it expands to, find an alias inside the value it names, and
    check scalars.

    Iterative, memoised per node: a chain of aliases can be deeper than Python's stack,
    and the walk costs the size of the document, not of its expansion."""
    values: dict[int, int] = {}
    chars: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            children = _children(node)
            values[key] = 1 + sum(values[id(child)] for child in children)
            own = len(node.value) if isinstance(node.value, str) else 0  # a scalar's text
            chars[key] = own + sum(chars[id(child)] for child in children)
            depths[key] = 1 + max((depths[id(child)] for child in children), default=0)
            if values[key] > MAX_VALUES:
                raise _TooComplex(
                    f"its aliases expand it to more than {MAX_VALUES} values (the limit)"
                )
            if chars[key] > MAX_CHARS:
                raise _TooComplex(
                    f"its aliases expand it to more than {MAX_CHARS} characters (the limit)"
                )
            if depths[key] > MAX_DEPTH:
                raise _TooComplex(
                    f"its aliases nest it deeper than {MAX_DEPTH} levels at line "
                    f"{_line(node)} (the limit)"
                )
            continue
        if key in values:
            continue
        if key in on_path:
            raise _TooComplex(f"a recursive alias at line {_line(node)}: the value contains itself")
        on_path.add(key)
        _check_scalar(loader, node)
        _check_mapping_keys(node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in values)


def _parse(shown_path: str, text: str) -> Any:
    """The document in ``text``, within the bounds; raises :class:`ConfigError`."""
    import yaml

    try:
        # PyYAML's reader checks every character when the loader is made: a NUL, a C0 or C1
        # control, a raw ESC or U+FFFE is a ReaderError here, before anything is parsed.
        loader = _bounded_loader(yaml)(text)
    except yaml.reader.ReaderError as exc:
        raise ConfigError(f"{shown_path}: {_unacceptable(text, exc)}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(loader, node)
        return loader.construct_document(node)
    except _TooComplex as exc:
        raise ConfigError(f"{shown_path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{shown_path}: malformed YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as exc:  # the checks above should leave none
        raise ConfigError(f"{shown_path}: unreadable YAML: {type(exc).__name__}") from None
    finally:
        loader.dispose()


def _unacceptable(text: str, exc: Any) -> str:
    """Where a character YAML does not allow is, and which (never the character itself: a
    raw ESC quoted back would reach the terminal)."""
    position = exc.position if isinstance(exc.position, int) else 0
    before = text[:position]
    line = before.count("\n") + 1
    column = position - (before.rfind("\n") + 1) + 1
    character = exc.character if isinstance(exc.character, int) else ord(text[position])
    return (
        f"malformed YAML at line {line}, column {column}: the character U+{character:04X} "
        "is not allowed in YAML (a control or non-character code point)"
    )


def _read(shown_path: str, path: str) -> str:
    """The file's text, if it is a regular file of at most :data:`MAX_BYTES`."""
    try:
        data = read_regular(path, MAX_BYTES)
    except Unreadable as exc:
        if exc.too_large:
            raise ConfigError(f"{shown_path}: {exc} (the limit for an experiment config)") from None
        raise ConfigError(f"{shown_path}: cannot read experiment config: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{shown_path}: cannot read experiment config: not UTF-8 text") from None


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
        stat_result = resolved.stat()
        absolute = str(resolved.resolve())
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) else "not a valid path"
        raise ConfigError(f"{_where(str(path))}: cannot read experiment config: {reason}") from None
    return _load(str(path), absolute, stat_result.st_mtime_ns)


def _where(path: str) -> str:
    """The file as a message names it: escaped (a name can hold an escape sequence), short."""
    return printable(path) if len(path) <= 200 else shown(path)


@functools.lru_cache(maxsize=64)
def _load(path: str, absolute: str, _mtime_ns: int) -> ExperimentFile:
    shown_path = _where(path)
    data = _parse(shown_path, _read(shown_path, absolute))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{shown_path}: the top level must be a mapping of KEY: value, got a "
            f"{type(data).__name__}"
        )
    notebook = data.pop(NOTEBOOK_KEY, None)
    # Printable: the path names a test item, which a newline or an escape sequence in it
    # would carry raw to the terminal (NUL included: no file system takes it).
    if notebook is not None and (
        not isinstance(notebook, str) or not notebook.strip() or not notebook.isprintable()
    ):
        raise ConfigError(
            f"{shown_path}: {NOTEBOOK_KEY} must be a notebook path, got {shown(notebook)}"
        )
    values, params = _validate(shown_path, data)
    return ExperimentFile(
        path, values, params, Path(absolute).parent / notebook if notebook else None
    )


def _validate(
    shown_path: str, data: dict[Any, Any]
) -> tuple[Mapping[str, object], Mapping[str, Any]]:
    values: dict[str, object] = {}
    params: Mapping[str, Any] = MappingProxyType({})
    for key, value in data.items():
        if key == PARAMS_KEY:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{shown_path}: {PARAMS_KEY} must be a mapping of the experiment's own "
                    f"parameters, got {type(value).__name__}"
                )
            params = MappingProxyType(dict(value))
            continue
        name = _FIELD_BY_KEY.get(key) if isinstance(key, str) else None
        if name is None:
            raise ConfigError(
                f"{shown_path}: unknown key {shown(key)}{did_you_mean(str(key), KNOWN_KEYS)}; "
                f"experiment parameters of your own go under {PARAMS_KEY}:"
            )
        if value is None:
            # ``BATCH_SIZE: null`` means "not set here", as in the seed notes' tables.
            continue
        try:
            values[name] = validate_typed(name, value)
        except ConfigError as exc:
            raise ConfigError(f"{shown_path}: {key} {exc}") from None
    return MappingProxyType(values), params
