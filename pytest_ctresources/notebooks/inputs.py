"""What the plugin accepts as a notebook to run, checked before nbformat or nbclient sees it.

nbformat and nbclient trust the notebook's shape: metadata that is a list, cells that are a
mapping, ``"execution": {"timeout": "abc"}`` or nesting too deep for ``json`` end in a
traceback from deep inside them (nbmake reports it as ``NBMAKE INTERNAL ERROR``). For a
notebook the plugin runs, :func:`read_notebook` checks what they rely on and says what is
wrong in one line naming the notebook, without quoting its content (a config may name a file
that is not a notebook at all: its text is not the run's to show).

An experiment config's ``NOTEBOOK:`` is data from a file anyone may have written, so what it
may name is bounded too (:func:`trusted_notebook`): a ``.ipynb`` file inside the config's
folder or the rootdir once links are resolved, owned by the user running pytest and
writable by no one else, as ssh refuses a key file that others can write.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_ctresources.reading import Unreadable, read_regular
from pytest_ctresources.settings.config import ConfigError

if TYPE_CHECKING:
    from nbformat import NotebookNode

#: The notebook format versions nbformat converts to the one nbclient runs (4).
FORMATS = (3, 4)
CELL_TYPES = ("code", "markdown", "raw")
#: The longest ``execution.timeout`` taken (a year): asyncio cannot wait on much larger ones.
MAX_TIMEOUT = 365 * 24 * 3600
NOTEBOOK_RULE = (
    "a NOTEBOOK must name a .ipynb file inside the config file's folder or the rootdir "
    "(links resolved), owned by you and writable by no one else"
)


class NotebookUnreadable(ConfigError):
    """A notebook the plugin will not hand to nbformat or nbclient (the message says why)."""


def _kind(value: object) -> str:
    """A JSON value's kind, as the messages name it (never its content)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def check_notebook_data(data: object, where: str) -> None:
    """Check a notebook's parsed JSON for what nbformat's conversion, nbclient's run and
    nbmake's cell hook rely on. Raises :class:`NotebookUnreadable` naming ``where``."""

    def bad(what: str) -> NotebookUnreadable:
        return NotebookUnreadable(f"{where}: not a notebook nbclient can run: {what}")

    if not isinstance(data, dict):
        raise bad(f"the top level is {_kind(data)}, not an object")
    version = data.get("nbformat")
    if type(version) is not int or version not in FORMATS:
        shown = version if type(version) is int and abs(version) < 10**6 else _kind(version)
        raise bad(f"'nbformat' is {shown}, not a format version nbformat reads (3 or 4)")
    minor = data.get("nbformat_minor", 0)
    if type(minor) is not int or not 0 <= minor < 10**6:
        raise bad(f"'nbformat_minor' is {_kind(minor)}, not a small whole number")
    metadata = data.get("metadata")
    if not isinstance(metadata, dict):
        raise bad(f"'metadata' is {_kind(metadata)}, not an object")
    check_run_metadata(metadata, bad)
    if version == 4:
        cells = data.get("cells")
        if not isinstance(cells, list):
            raise bad(f"'cells' is {_kind(cells)}, not a list")
        for index, cell in enumerate(cells):
            check_cell(cell, index, bad)
    elif not isinstance(data.get("worksheets", []), list):
        raise bad(f"'worksheets' is {_kind(data.get('worksheets'))}, not a list")


def check_run_metadata(metadata: dict[str, Any], bad: Any) -> None:
    """The notebook metadata nbmake's runner and nbclient read: ``execution`` and
    ``kernelspec``."""
    execution = metadata.get("execution", {})
    if not isinstance(execution, dict):
        raise bad(f"metadata 'execution' is {_kind(execution)}, not an object")
    if "timeout" in execution:
        timeout = execution["timeout"]
        if timeout is not None and (
            type(timeout) is not int or not (timeout == -1 or 0 < timeout <= MAX_TIMEOUT)
        ):
            shown = timeout if type(timeout) is int and abs(timeout) < 10**12 else _kind(timeout)
            raise bad(
                f"metadata 'execution.timeout' is {shown}, not a whole number of seconds "
                f"from 1 to {MAX_TIMEOUT} (-1 or null: no timeout)"
            )
    if "allow_errors" in execution and not isinstance(execution["allow_errors"], bool):
        raise bad(
            f"metadata 'execution.allow_errors' is {_kind(execution['allow_errors'])}, "
            "not true or false"
        )
    kernelspec = metadata.get("kernelspec", {})
    if not isinstance(kernelspec, dict):
        raise bad(f"metadata 'kernelspec' is {_kind(kernelspec)}, not an object")
    name = kernelspec.get("name", "")
    if not isinstance(name, str) or "\0" in name:
        raise bad(f"metadata 'kernelspec.name' is {_kind(name)}, not a kernel name")


def check_cell(cell: object, index: int, bad: Any) -> None:
    """One v4 cell: a type, a source, metadata (nbclient records timings there) and the
    ``nbmake`` cell metadata nbmake's hook reads."""
    if not isinstance(cell, dict):
        raise bad(f"cell {index} is {_kind(cell)}, not an object")
    cell_type = cell.get("cell_type")
    if cell_type not in CELL_TYPES:
        raise bad(f"cell {index}: 'cell_type' is {_kind(cell_type)}, not code, markdown or raw")
    source = cell.get("source", "")
    if not isinstance(source, str) and not (
        isinstance(source, list) and all(isinstance(line, str) for line in source)
    ):
        raise bad(f"cell {index}: 'source' is {_kind(source)}, not text or a list of lines")
    metadata = cell.get("metadata", {})
    if not isinstance(metadata, dict):
        raise bad(f"cell {index}: 'metadata' is {_kind(metadata)}, not an object")
    if cell_type == "code" and not isinstance(cell.get("outputs", []), list):
        raise bad(f"cell {index}: 'outputs' is {_kind(cell.get('outputs'))}, not a list")
    nbmake = metadata.get("nbmake", {})
    if not isinstance(nbmake, dict):
        raise bad(f"cell {index}: metadata 'nbmake' is {_kind(nbmake)}, not an object")
    mock = nbmake.get("mock", {})
    if not isinstance(mock, dict) or not all(
        isinstance(key, str) and key.isidentifier() for key in mock
    ):
        raise bad(f"cell {index}: metadata 'nbmake.mock' must map variable names to values")
    post = nbmake.get("post_cell_execute", [])
    if not isinstance(post, list) or not all(isinstance(line, str) for line in post):
        raise bad(f"cell {index}: metadata 'nbmake.post_cell_execute' must be a list of lines")


def read_notebook(path: Path, where: str) -> NotebookNode:
    """The notebook at ``path`` as nbformat version 4, or :class:`NotebookUnreadable` in one
    line naming ``where`` (a file that is no notebook, a shape nbclient cannot run)."""
    import nbformat

    try:
        raw = read_regular(path)
    except Unreadable as exc:
        raise NotebookUnreadable(f"{where}: cannot read the notebook: {exc}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise NotebookUnreadable(f"{where}: not a notebook: not UTF-8 text") from None
    except RecursionError:
        raise NotebookUnreadable(f"{where}: not a notebook: JSON nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError; its message never quotes the text
        position = (
            f" (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            if isinstance(exc, json.JSONDecodeError)
            else ""
        )
        raise NotebookUnreadable(f"{where}: not a notebook: not JSON{position}") from None
    check_notebook_data(data, where)
    try:
        # nbformat.read's own steps (its reader for the file's version: lines rejoined,
        # transient fields dropped; then the conversion), without its schema validation,
        # which only logs, quoting the notebook.
        reader = nbformat.versions[data["nbformat"]]
        nb = reader.to_notebook_json(data, minor=data.get("nbformat_minor", 0))
        if nb.nbformat != 4:
            nb = nbformat.convert(nb, 4)
            check_notebook_data(nb, where)  # what the conversion made must run too
    except NotebookUnreadable:
        raise
    except RecursionError:
        raise NotebookUnreadable(f"{where}: not a notebook: nested too deeply") from None
    except Exception as exc:  # nbformat's conversion raises many kinds for odd input
        raise NotebookUnreadable(
            f"{where}: nbformat cannot convert it to format 4 ({type(exc).__name__})"
        ) from None
    return nb


def trusted_notebook(
    config: str, notebook: Path, shown_notebook: str, roots: Sequence[Path]
) -> Path:
    """The notebook an experiment config (shown as ``config``) names, links resolved, if it
    may run: a ``.ipynb`` regular file inside one of ``roots`` (the config's folder, the
    rootdir), owned by this user and not writable by group or others. Raises
    :class:`ConfigError` naming the config, the notebook and the rule."""

    def refuse(problem: str) -> ConfigError:
        return ConfigError(
            f"{config}: NOTEBOOK names {shown_notebook}, which {problem}: {NOTEBOOK_RULE}"
        )

    try:
        resolved = notebook.resolve(strict=True)
    except FileNotFoundError:
        raise ConfigError(
            f"{config}: NOTEBOOK names {shown_notebook}, which is not a file"
        ) from None
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL
        raise refuse("cannot be resolved") from None
    if resolved.suffix != ".ipynb":
        raise refuse(f"is not a .ipynb file (resolved: {resolved.name!r})")
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise refuse("is outside the config file's folder and the rootdir")
    info = resolved.stat()
    if not stat.S_ISREG(info.st_mode):
        raise refuse("is not a regular file")
    if info.st_uid != os.geteuid():
        raise refuse(f"is owned by another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise refuse(f"others can write (mode {stat.S_IMODE(info.st_mode):04o})")
    return resolved


def finite_need(value: object) -> bool:
    """Whether a metadata ``vram_gib`` is a positive number a float holds (JSON allows
    integers of any length, whose ``float()`` overflows). Infinity passes: the ``vram``
    marker it becomes bounds every need (at most 1024 GiB) and says so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        need = float(value)
    except OverflowError:
        return False
    return not math.isnan(need) and need > 0
