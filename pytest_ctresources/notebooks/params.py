"""What goes into a notebook: papermill-style injected parameters and the plugin's metadata.

The injected cell is code that runs in the notebook's kernel, built from experiment configs,
which are data: it holds nothing but ``NAME = literal`` lines. A name is a plain Python
identifier that is not one of the settings (those are validated at the top level of the
config and injected from there); a value is written as a Python literal (numbers, strings,
``True``/``False``/``None``, lists, tuples, dicts and sets of those), which evaluates without
looking up a name or calling anything. Anything else is a :class:`ConfigError` naming the
file and the key.

Pure functions over nbformat notebooks (imported only under ``--nbmake``).
"""

from __future__ import annotations

import keyword
import math
import unicodedata
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_ctresources.core.record import AFTER_PARAMETERS, AT_TOP, NotebookValue
from pytest_ctresources.notebooks.inputs import finite_need
from pytest_ctresources.settings.config import FIELDS, CircuitTracerConfig, ConfigError, shown

if TYPE_CHECKING:
    from nbformat import NotebookNode

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
METADATA_KEY = "ctresources"

#: The names the injected cell gives the settings (``BATCH_SIZE``, ``MODEL_NAME``, ...).
SETTING_NAMES: frozenset[str] = frozenset(spec.yaml_key for spec in FIELDS.values())


class NotALiteral(ValueError):
    """A value with no Python literal (the message says what it is)."""


def python_literal(value: object) -> str:
    """Python source for ``value`` that evaluates to it with no name lookup and no call.

    ``ast.literal_eval`` of the result equals ``value``. Only the types ``yaml.safe_load``
    gives for plain data are accepted, exactly (no subclass, whose ``repr`` could be
    anything): a YAML date, ``.nan`` or an empty set raise :class:`NotALiteral`.
    """
    if value is None or type(value) in (bool, str, bytes):
        return repr(value)
    if type(value) is int:
        try:
            return repr(value)
        except ValueError:  # beyond sys.get_int_max_str_digits()
            raise NotALiteral("an integer too long to write out") from None
    if type(value) is float:
        if math.isnan(value):
            raise NotALiteral("NaN, which has no Python literal")
        if math.isinf(value):
            return "1e999" if value > 0 else "-1e999"  # the literal Python reads as inf
        return repr(value)
    if type(value) is list:
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if type(value) is tuple:
        items = [python_literal(item) for item in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if type(value) is dict:
        pairs = [f"{python_literal(key)}: {python_literal(item)}" for key, item in value.items()]
        return "{" + ", ".join(pairs) + "}"
    if type(value) in (set, frozenset):
        assert isinstance(value, (set, frozenset))
        if not value:
            raise NotALiteral("an empty set, which has no Python literal")
        return "{" + ", ".join(sorted(python_literal(item) for item in value)) + "}"
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    hint = ""
    if type(value).__module__ == "datetime":
        hint = " (YAML reads an unquoted date as one: quote it)"
    raise NotALiteral(f"{article} {name}{hint}, which has no Python literal")


def _quoted(key: object) -> str:
    """A ``PARAMS`` key as messages quote it: whole (repr-escaped, so one line) up to 200
    characters, so that a key that is code is shown as it is; longer, or not a string
    (an integer of 5000 digits), cut short."""
    if isinstance(key, str) and len(key) <= 200:
        return repr(key)
    return shown(key)


def check_params(params: Mapping[Any, Any], where: str) -> None:
    """Check that every ``PARAMS`` entry of the config file ``where`` can become a notebook
    variable: its key a plain identifier that is no setting, its value a literal.

    Raises :class:`ConfigError` with one line naming ``where`` and the key.
    """
    for key, value in params.items():
        if (
            not isinstance(key, str)
            or not key.isidentifier()
            or keyword.iskeyword(key)
            or (key.startswith("__") and key.endswith("__"))
        ):
            raise ConfigError(
                f"{where}: PARAMS key {_quoted(key)} is not a name a notebook variable can have: "
                "a notebook gets each PARAMS entry as NAME = value, so a key must be a plain "
                "Python identifier (letters, digits, underscores; no keyword, no __dunder__)"
            )
        if unicodedata.normalize("NFKC", key) != key:
            # Python binds the NFKC form of an identifier: the checks above and below must
            # see the name the notebook will get (a fullwidth B makes BATCH_SIZE there).
            raise ConfigError(
                f"{where}: PARAMS key {_quoted(key)} is not a name a notebook variable can have "
                f"as written: Python would read it as "
                f"{unicodedata.normalize('NFKC', key)!r}; write that"
            )
        if key in SETTING_NAMES:
            raise ConfigError(
                f"{where}: PARAMS key {key!r} would override the setting {key} in the notebook: "
                f"set it as {key}: at the top level of the file, where it is validated"
            )
        try:
            python_literal(value)
        except NotALiteral as exc:
            raise ConfigError(f"{where}: PARAMS value of {_quoted(key)} is {exc}") from None
        except RecursionError:
            raise ConfigError(
                f"{where}: PARAMS value of {_quoted(key)} is nested too deeply"
            ) from None


def injected_values(cfg: CircuitTracerConfig) -> dict[str, Any]:
    """``NAME = value`` pairs for a notebook: every config value not left at its default
    (``BATCH_SIZE``, ``MODEL_NAME``, ...), then the experiment's ``PARAMS`` (checked with
    :func:`check_params` where they were read, so none overrides a setting)."""
    values: dict[str, Any] = {
        spec.yaml_key: getattr(cfg, name)
        for name, spec in FIELDS.items()
        if cfg.source_of(name).kind != "default"
    }
    values.update(cfg.params)
    return values


def values_with_sources(
    cfg: CircuitTracerConfig,
    values: Mapping[str, Any],
    params_from: Mapping[str, str],
    injected: str,
    show: Callable[[str], str] = str,
) -> list[NotebookValue]:
    """What a notebook item received, as the summary shows it, per injected value (its
    ``source``: the experiment YAML, the option or the
    variable it came from; ``params_from`` names the YAML each ``PARAMS`` key came from;
    ``injected``: where the cell went, as :func:`inject_parameters` returns it; ``show``
    turns a file's path into how messages show it)."""
    field_of = {spec.yaml_key: name for name, spec in FIELDS.items()}
    out = []
    for key, value in values.items():
        name = field_of.get(key)
        if name is None:
            where = f"PARAMS in {show(params_from[key])}" if key in params_from else "PARAMS"
        else:
            source = cfg.source_of(name)
            where = show(source.path) if source.kind == "yaml" and source.path else str(source)
        out.append(
            NotebookValue(name=key, value=python_literal(value), source=where, injected=injected)
        )
    return out


def injected_source(values: Mapping[str, Any]) -> str:
    """The injected cell's code: one ``NAME = literal`` line per value."""
    lines = ["# Parameters injected by pytest-ctresources"]
    for name, value in values.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            # check_params has refused these already; this keeps the cell literal-only
            # whatever the caller passed.
            raise ConfigError(f"{name!r} is not a name a notebook variable can have")
        try:
            lines.append(f"{name} = {python_literal(value)}")
        except (NotALiteral, RecursionError) as exc:
            raise ConfigError(f"the value of {name} has no Python literal ({exc})") from None
    return "\n".join(lines)


def _tags(cell: Any) -> list[Any]:
    """A cell's tags. Anything but a list (``5``, ``null``) is no tags, as nbmake, which
    never reads them, runs such a notebook."""
    tags = cell.get("metadata", {}).get("tags", [])
    return tags if isinstance(tags, list) else []


def has_parameters_cell(nb: NotebookNode) -> bool:
    """Whether ``nb`` has a cell tagged ``parameters``."""
    return any(PARAMETERS_TAG in _tags(cell) for cell in nb.cells)


def inject_parameters(nb: NotebookNode, values: Mapping[str, Any]) -> str:
    """Insert the ``injected-parameters`` cell after the ``parameters`` cell, papermill style,
    or first where the notebook has none.

    Call it only for a notebook that receives values. Cells injected by an earlier run (kept
    by ``--overwrite``) are removed first, as papermill does. Returns where the cell went:
    :data:`AFTER_PARAMETERS` or :data:`AT_TOP`.
    """
    from nbformat.v4 import new_code_cell

    nb.cells = [cell for cell in nb.cells if INJECTED_TAG not in _tags(cell)]
    cell = new_code_cell(injected_source(values), metadata={"tags": [INJECTED_TAG]})
    for index, existing in enumerate(nb.cells):
        if PARAMETERS_TAG in _tags(existing):
            nb.cells.insert(index + 1, cell)
            return AFTER_PARAMETERS
    nb.cells.insert(0, cell)
    return AT_TOP


def _key(key: str) -> str:
    """A metadata key as messages show it: as written, unless that could break the line."""
    return key if key.isprintable() and len(key) <= 60 else shown(key)


def notebook_metadata(nb: NotebookNode, where: str) -> tuple[list[str], float | None]:
    """The marks and VRAM need a notebook declares in ``metadata.ctresources``.

    Raises :class:`ConfigError` naming the notebook for malformed metadata.
    """
    raw = nb.get("metadata", {}).get(METADATA_KEY, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: metadata '{METADATA_KEY}' must be an object, got {shown(raw)}")
    unknown = set(raw) - {"marks", "vram_gib"}
    if unknown:
        names = ", ".join(_key(key) for key in sorted(unknown))
        raise ConfigError(
            f"{where}: unknown key(s) {names} in metadata '{METADATA_KEY}'; known: marks, vram_gib"
        )
    marks = raw.get("marks", [])
    # pytest refuses a mark name starting with "_" (an AttributeError: an INTERNALERROR).
    if not isinstance(marks, list) or not all(
        isinstance(m, str) and m.isidentifier() and not m.startswith("_") for m in marks
    ):
        raise ConfigError(
            f"{where}: metadata '{METADATA_KEY}.marks' must be a list of mark names, "
            f"got {shown(marks)}"
        )
    need = raw.get("vram_gib")
    if need is not None and not finite_need(need):
        raise ConfigError(
            f"{where}: metadata '{METADATA_KEY}.vram_gib' must be a positive number, "
            f"got {shown(need)}"
        )
    return marks, float(need) if need is not None else None
