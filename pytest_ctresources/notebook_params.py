"""What goes into a notebook: papermill-style injected parameters and the plugin's metadata.

Pure functions over nbformat notebooks (imported only under ``--nbmake``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_ctresources.config import FIELDS, CircuitTracerConfig, ConfigError

if TYPE_CHECKING:
    from nbformat import NotebookNode

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
METADATA_KEY = "ctresources"


def injected_values(cfg: CircuitTracerConfig) -> dict[str, Any]:
    """``NAME = value`` pairs for a notebook: every config value not left at its default
    (``BATCH_SIZE``, ``MODEL_NAME``, ...), then the experiment's ``PARAMS``."""
    values: dict[str, Any] = {
        spec.yaml_key: getattr(cfg, name)
        for name, spec in FIELDS.items()
        if cfg.source_of(name).kind != "default"
    }
    values.update(cfg.params)
    return values


def inject_parameters(nb: NotebookNode, values: Mapping[str, Any]) -> str | None:
    """Insert the ``injected-parameters`` cell after the ``parameters`` cell, papermill style.

    Cells injected by an earlier run (kept by ``--overwrite``) are removed first, as papermill
    does. Returns a note when the notebook has no ``parameters`` cell (the cell then goes
    first).
    """
    from nbformat.v4 import new_code_cell

    nb.cells = [
        cell for cell in nb.cells if INJECTED_TAG not in cell.get("metadata", {}).get("tags", [])
    ]
    lines = ["# Parameters injected by pytest-ctresources"]
    lines += [f"{name} = {value!r}" for name, value in values.items()]
    cell = new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    cells = nb.cells
    for index, existing in enumerate(cells):
        if PARAMETERS_TAG in existing.get("metadata", {}).get("tags", []):
            cells.insert(index + 1, cell)
            return None
    cells.insert(0, cell)
    return "has no cell tagged 'parameters': the injected parameters run first"


def notebook_metadata(nb: NotebookNode, where: str) -> tuple[list[str], float | None]:
    """The marks and VRAM need a notebook declares in ``metadata.ctresources``.

    Raises :class:`ConfigError` naming the notebook for malformed metadata.
    """
    raw = nb.get("metadata", {}).get(METADATA_KEY, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: metadata '{METADATA_KEY}' must be an object, got {raw!r}")
    unknown = set(raw) - {"marks", "vram_gib"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} in metadata "
            f"'{METADATA_KEY}'; known: marks, vram_gib"
        )
    marks = raw.get("marks", [])
    if not isinstance(marks, list) or not all(
        isinstance(m, str) and m.isidentifier() for m in marks
    ):
        raise ConfigError(
            f"{where}: metadata '{METADATA_KEY}.marks' must be a list of mark names, got {marks!r}"
        )
    need = raw.get("vram_gib")
    if need is not None and (
        isinstance(need, bool) or not isinstance(need, (int, float)) or not need > 0
    ):
        raise ConfigError(
            f"{where}: metadata '{METADATA_KEY}.vram_gib' must be a positive number, got {need!r}"
        )
    return marks, float(need) if need is not None else None
