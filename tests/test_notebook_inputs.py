"""Hostile notebook inputs: notebook files, ``ctresources`` metadata, ``NOTEBOOK:`` configs
and the parameters injected into a notebook.

Most rows call the checks themselves (no kernel, no pytest run): each bad input must raise
one short line naming its source and saying what is wrong, and quote none of a file's text.
The rows that need a pytest run are batched into one run of a project (module fixture
``batch``) with a 150-character ``TMPDIR``, where every kernel starts once; each row then
reads its own item's outcome from that run's junit XML.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
import tracemalloc
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest

from pytest_ctresources.notebooks.configs import names_a_notebook
from pytest_ctresources.notebooks.inputs import (
    MAX_TIMEOUT,
    NotebookUnreadable,
    read_notebook,
    trusted_notebook,
)
from pytest_ctresources.notebooks.kernels import fits_socket_path, socket_directory
from pytest_ctresources.notebooks.params import (
    check_params,
    injected_source,
    notebook_metadata,
)
from pytest_ctresources.notebooks.run import startup_timeout
from pytest_ctresources.settings.config import ConfigError
from pytest_ctresources.settings.experiment_yaml import MAX_BYTES, load_experiment_yaml

# Projects run with --nbmake (tests/conftest.py turns nbmake off elsewhere).
pytestmark = pytest.mark.nbmake

SECRET = "hunter2-do-not-show"


def _nb(**overrides: Any) -> dict[str, Any]:
    """A minimal valid notebook's JSON with ``overrides`` applied (None deletes a key)."""
    data: dict[str, Any] = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {},
        "cells": [{"cell_type": "code", "source": "x = 1", "metadata": {}, "outputs": []}],
    }
    for key, value in overrides.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def _cell(**overrides: Any) -> dict[str, Any]:
    cell: dict[str, Any] = {"cell_type": "code", "source": "", "metadata": {}, "outputs": []}
    cell.update(overrides)
    return cell


def _meta(**metadata: Any) -> dict[str, Any]:
    return _nb(metadata=metadata)


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _nested_list(levels: int) -> list[Any]:
    root: list[Any] = []
    current = root
    for _ in range(levels):
        child: list[Any] = []
        current.append(child)
        current = child
    return root


# --- notebook files: what nbformat or nbclient cannot read or run ------------------------

#: (id, the file's bytes, what the line must say)
FILE_ROWS: list[tuple[str, bytes, str]] = [
    ("empty-file", b"", "not JSON"),
    ("not-json", b"invalid json", "not JSON"),
    ("secret-env-file", f"API_KEY={SECRET}\n".encode(), "not JSON"),
    ("secret-json-string", json.dumps(SECRET).encode(), "the top level is a string"),
    ("secret-json-object", json.dumps({"password": SECRET}).encode(), "'nbformat' is null"),
    ("passwd-like", f"root:x:0:0:{SECRET}:/root:/bin/bash\n".encode(), "not JSON"),
    ("not-utf8", b"\xff\xfe{\x00}", "not UTF-8"),
    ("latin1", '{"nbformat": 4, "x": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    ("nul-bytes", b"\x00" * 64, "not JSON"),
    ("truncated", json.dumps(_nb()).encode()[:-5], "not JSON"),
    ("deep-json", _deep(200_000).encode(), "nested too deeply"),
    (
        "deep-json-in-metadata",
        b'{"nbformat": 4, "metadata": {"a": ' + _deep(100_000).encode() + b"}}",
        "nested too deeply",
    ),
    ("top-level-list", b"[]", "the top level is a list"),
    ("top-level-number", b"4", "the top level is a number"),
    ("top-level-null", b"null", "the top level is null"),
    ("top-level-true", b"true", "the top level is a boolean"),
    ("nbformat-5", json.dumps(_nb(nbformat=5)).encode(), "'nbformat' is 5"),
    ("nbformat-2", json.dumps(_nb(nbformat=2)).encode(), "'nbformat' is 2"),
    ("nbformat-0", json.dumps(_nb(nbformat=0)).encode(), "'nbformat' is 0"),
    ("nbformat-negative", json.dumps(_nb(nbformat=-4)).encode(), "'nbformat' is -4"),
    ("nbformat-string", json.dumps(_nb(nbformat="4")).encode(), "'nbformat' is a string"),
    ("nbformat-float", json.dumps(_nb(nbformat=4.0)).encode(), "'nbformat' is a number"),
    ("nbformat-true", json.dumps(_nb(nbformat=True)).encode(), "'nbformat' is a boolean"),
    ("nbformat-huge", b'{"nbformat": ' + b"9" * 5000 + b"}", "not JSON"),
    ("nbformat-big", json.dumps(_nb(nbformat=10**30)).encode(), "'nbformat' is a number"),
    ("nbformat-missing", json.dumps(_nb(nbformat=None)).encode(), "'nbformat' is null"),
    ("minor-string", json.dumps(_nb(nbformat_minor="5")).encode(), "'nbformat_minor' is a string"),
    ("minor-negative", json.dumps(_nb(nbformat_minor=-1)).encode(), "'nbformat_minor'"),
    ("minor-huge", json.dumps(_nb(nbformat_minor=10**20)).encode(), "'nbformat_minor'"),
    ("metadata-list", json.dumps(_nb(metadata=[])).encode(), "'metadata' is a list"),
    ("metadata-string", json.dumps(_nb(metadata=SECRET)).encode(), "'metadata' is a string"),
    ("metadata-null", json.dumps(_nb(metadata=None)).encode(), "'metadata' is null"),
    ("metadata-number", json.dumps(_nb(metadata=1)).encode(), "'metadata' is a number"),
    ("cells-mapping", json.dumps(_nb(cells={"0": _cell()})).encode(), "'cells' is an object"),
    ("cells-string", json.dumps(_nb(cells="x = 1")).encode(), "'cells' is a string"),
    ("cells-missing", json.dumps(_nb(cells=None)).encode(), "'cells' is null"),
    (
        "cells-null",
        b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": null}',
        "'cells' is null",
    ),
    ("cell-a-list", json.dumps(_nb(cells=[[]])).encode(), "cell 0 is a list"),
    ("cell-a-string", json.dumps(_nb(cells=[SECRET])).encode(), "cell 0 is a string"),
    ("cell-type-missing", json.dumps(_nb(cells=[{"source": ""}])).encode(), "cell 0: 'cell_type'"),
    (
        "cell-type-unknown",
        json.dumps(_nb(cells=[_cell(cell_type="sql")])).encode(),
        "cell 0: 'cell_type' is a string",
    ),
    (
        "cell-type-number",
        json.dumps(_nb(cells=[_cell(cell_type=1)])).encode(),
        "cell 0: 'cell_type' is a number",
    ),
    (
        "cell-source-number",
        json.dumps(_nb(cells=[_cell(source=1)])).encode(),
        "cell 0: 'source' is a number",
    ),
    (
        "cell-source-mixed-list",
        json.dumps(_nb(cells=[_cell(source=["a", 1])])).encode(),
        "cell 0: 'source' is a list",
    ),
    (
        "cell-source-object",
        json.dumps(_nb(cells=[_cell(source={})])).encode(),
        "cell 0: 'source' is an object",
    ),
    (
        "cell-metadata-list",
        json.dumps(_nb(cells=[_cell(metadata=[])])).encode(),
        "cell 0: 'metadata' is a list",
    ),
    (
        "cell-outputs-object",
        json.dumps(_nb(cells=[_cell(outputs={})])).encode(),
        "cell 0: 'outputs' is an object",
    ),
    ("second-cell-bad", json.dumps(_nb(cells=[_cell(), 7])).encode(), "cell 1 is a number"),
    (
        "nbmake-metadata-list",
        json.dumps(_nb(cells=[_cell(metadata={"nbmake": []})])).encode(),
        "metadata 'nbmake' is a list",
    ),
    (
        "nbmake-mock-list",
        json.dumps(_nb(cells=[_cell(metadata={"nbmake": {"mock": [1]}})])).encode(),
        "'nbmake.mock'",
    ),
    (
        "nbmake-mock-bad-name",
        json.dumps(_nb(cells=[_cell(metadata={"nbmake": {"mock": {"a b": 1}}})])).encode(),
        "'nbmake.mock'",
    ),
    (
        "nbmake-mock-code-name",
        json.dumps(
            _nb(cells=[_cell(metadata={"nbmake": {"mock": {"x=1;import os;y": 1}}})])
        ).encode(),
        "'nbmake.mock'",
    ),
    (
        "nbmake-post-string",
        json.dumps(_nb(cells=[_cell(metadata={"nbmake": {"post_cell_execute": "x"}})])).encode(),
        "'nbmake.post_cell_execute'",
    ),
    (
        "nbmake-post-numbers",
        json.dumps(_nb(cells=[_cell(metadata={"nbmake": {"post_cell_execute": [1]}})])).encode(),
        "'nbmake.post_cell_execute'",
    ),
    ("execution-list", json.dumps(_meta(execution=[])).encode(), "metadata 'execution' is a list"),
    (
        "execution-string",
        json.dumps(_meta(execution="fast")).encode(),
        "metadata 'execution' is a string",
    ),
    (
        "timeout-abc",
        json.dumps(_meta(execution={"timeout": "abc"})).encode(),
        "metadata 'execution.timeout' is a string",
    ),
    (
        "timeout-float",
        json.dumps(_meta(execution={"timeout": 1.5})).encode(),
        "'execution.timeout' is a number",
    ),
    (
        "timeout-zero",
        json.dumps(_meta(execution={"timeout": 0})).encode(),
        "'execution.timeout' is 0",
    ),
    (
        "timeout-negative",
        json.dumps(_meta(execution={"timeout": -5})).encode(),
        "'execution.timeout' is -5",
    ),
    (
        "timeout-true",
        json.dumps(_meta(execution={"timeout": True})).encode(),
        "'execution.timeout' is a boolean",
    ),
    (
        "timeout-huge",
        json.dumps(_meta(execution={"timeout": 10**400})).encode(),
        "'execution.timeout' is a number",
    ),
    (
        "timeout-over-a-year",
        json.dumps(_meta(execution={"timeout": MAX_TIMEOUT + 1})).encode(),
        f"'execution.timeout' is {MAX_TIMEOUT + 1}",
    ),
    (
        "timeout-infinity",
        b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {"execution": {"timeout": Infinity}}, "cells": []}',
        "'execution.timeout' is a number",
    ),
    (
        "timeout-nan",
        b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {"execution": {"timeout": NaN}}, "cells": []}',
        "'execution.timeout' is a number",
    ),
    (
        "timeout-list",
        json.dumps(_meta(execution={"timeout": [60]})).encode(),
        "'execution.timeout' is a list",
    ),
    (
        "allow-errors-string",
        json.dumps(_meta(execution={"allow_errors": "yes"})).encode(),
        "'execution.allow_errors' is a string",
    ),
    (
        "allow-errors-number",
        json.dumps(_meta(execution={"allow_errors": 1})).encode(),
        "'execution.allow_errors' is a number",
    ),
    (
        "kernelspec-list",
        json.dumps(_meta(kernelspec=["python3"])).encode(),
        "metadata 'kernelspec' is a list",
    ),
    (
        "kernelspec-string",
        json.dumps(_meta(kernelspec="python3")).encode(),
        "metadata 'kernelspec' is a string",
    ),
    (
        "kernelspec-name-number",
        json.dumps(_meta(kernelspec={"name": 3})).encode(),
        "'kernelspec.name' is a number",
    ),
    (
        "kernelspec-name-null",
        json.dumps(_meta(kernelspec={"name": None})).encode(),
        "'kernelspec.name' is null",
    ),
    (
        "kernelspec-name-nul",
        json.dumps(_meta(kernelspec={"name": "py\x00thon"})).encode(),
        "'kernelspec.name' is a string",
    ),
    (
        "v3-worksheets-object",
        json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": {}}).encode(),
        "'worksheets' is an object",
    ),
    (
        "v3-worksheet-cells-mapping",
        json.dumps(
            {"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": [5]}
        ).encode(),
        "nbformat cannot convert it",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), [r[1:] for r in FILE_ROWS], ids=[r[0] for r in FILE_ROWS]
)
def test_a_notebook_nbformat_or_nbclient_cannot_run_is_one_line(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.ipynb"
    path.write_bytes(data)
    with pytest.raises(NotebookUnreadable) as exc:
        read_notebook(path, "nb/bad.ipynb")
    line = str(exc.value)
    assert line.startswith("nb/bad.ipynb: "), line
    assert message in line, line
    assert "\n" not in line and len(line) < 300
    assert SECRET not in line and "root:x" not in line


def test_a_notebook_the_plugin_reads_is_nbformats_own(tmp_path: Path) -> None:
    # What the checks accept, nbformat reads as it would itself (v4 as is, v3 converted).
    v4 = tmp_path / "v4.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), v4)
    assert read_notebook(v4, "v4.ipynb") == nbformat.read(v4, as_version=4)
    v3 = tmp_path / "v3.ipynb"
    v3.write_text(
        json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []})
    )
    assert read_notebook(v3, "v3.ipynb").nbformat == 4
    minimal = tmp_path / "minimal.ipynb"
    minimal.write_text(json.dumps(_meta(execution={"timeout": -1, "allow_errors": True})))
    assert read_notebook(minimal, "minimal.ipynb").metadata.execution.timeout == -1


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing"])
def test_a_notebook_path_that_is_no_file_is_one_line_and_never_blocks(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "odd.ipynb"
    if kind == "fifo":
        os.mkfifo(path)  # opened without O_NONBLOCK, this would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    with pytest.raises(NotebookUnreadable, match=r"^odd.ipynb: cannot read the notebook: "):
        read_notebook(path, "odd.ipynb")


# --- ctresources metadata ----------------------------------------------------------------

#: (id, the ctresources metadata, what the line must say)
METADATA_ROWS: list[tuple[str, Any, str]] = [
    ("list", [1], "must be an object"),
    ("string", "slow", "must be an object"),
    ("number", 8, "must be an object"),
    ("true", True, "must be an object"),
    ("null-inside-list", [None], "must be an object"),
    ("long-string", "x" * 5000, "must be an object"),
    ("unknown-key", {"vram": 8}, "unknown key(s) vram"),
    ("unknown-keys", {"a": 1, "b": 2}, "unknown key(s) a, b"),
    ("unknown-key-newline", {"x\ny": 1}, "unknown key(s) 'x\\ny'"),
    ("unknown-key-escape", {"\x1b[2J": 1}, "unknown key(s) '\\x1b[2J'"),
    ("unknown-key-long", {"k" * 5000: 1}, "unknown key(s) 'kkkk"),
    ("unknown-key-empty", {"": 1}, "unknown key(s) "),
    ("case-variant", {"Marks": []}, "unknown key(s) Marks"),
    ("vram-gb", {"vram_gb": 3}, "unknown key(s) vram_gb"),
    ("marks-string", {"marks": "slow"}, "must be a list of mark names"),
    ("marks-object", {"marks": {"slow": True}}, "must be a list of mark names"),
    ("marks-number", {"marks": 1}, "must be a list of mark names"),
    ("marks-null-item", {"marks": [None]}, "must be a list of mark names"),
    ("marks-number-item", {"marks": [1]}, "must be a list of mark names"),
    ("marks-nested", {"marks": [["slow"]]}, "must be a list of mark names"),
    ("marks-space", {"marks": ["not a name"]}, "must be a list of mark names"),
    ("marks-empty-name", {"marks": [""]}, "must be a list of mark names"),
    ("marks-dash", {"marks": ["gpu-heavy"]}, "must be a list of mark names"),
    ("marks-call", {"marks": ["skipif(True)"]}, "must be a list of mark names"),
    ("marks-code", {"marks": ["__import__('os').system('id')"]}, "must be a list of mark names"),
    ("marks-newline", {"marks": ["slow\nfast"]}, "must be a list of mark names"),
    ("marks-digit-first", {"marks": ["1slow"]}, "must be a list of mark names"),
    ("marks-dotted", {"marks": ["mark.slow"]}, "must be a list of mark names"),
    ("marks-many-long", {"marks": ["x y"] * 10_000}, "must be a list of mark names"),
    ("vram-negative", {"vram_gib": -2}, "must be a positive number"),
    ("vram-zero", {"vram_gib": 0}, "must be a positive number"),
    ("vram-negative-zero", {"vram_gib": -0.0}, "must be a positive number"),
    ("vram-string", {"vram_gib": "20"}, "must be a positive number"),
    ("vram-true", {"vram_gib": True}, "must be a positive number"),
    ("vram-false", {"vram_gib": False}, "must be a positive number"),
    ("vram-list", {"vram_gib": [20]}, "must be a positive number"),
    ("vram-object", {"vram_gib": {"gib": 20}}, "must be a positive number"),
    ("vram-nan", {"vram_gib": float("nan")}, "must be a positive number"),
    ("vram-minus-infinity", {"vram_gib": float("-inf")}, "must be a positive number"),
    ("vram-huge-int", {"vram_gib": 10**400}, "an integer of about 401 digits"),
    ("vram-5000-digits", {"vram_gib": int("1" * 4000) * 10**1000}, "an integer of about"),
    ("vram-tiny-negative", {"vram_gib": -1e-300}, "must be a positive number"),
    ("vram-long-string", {"vram_gib": "9" * 5000}, "(5000 characters)"),
]


@pytest.mark.parametrize(
    ("metadata", "message"), [r[1:] for r in METADATA_ROWS], ids=[r[0] for r in METADATA_ROWS]
)
def test_bad_ctresources_metadata_is_one_line(metadata: Any, message: str) -> None:
    nb = nbformat.from_dict(_meta(ctresources=metadata))
    with pytest.raises(ConfigError) as exc:
        notebook_metadata(nb, "nb/bad.ipynb")
    line = str(exc.value)
    assert line.startswith("nb/bad.ipynb: metadata 'ctresources") or line.startswith(
        "nb/bad.ipynb: unknown key(s)"
    ), line
    assert message in line, line
    assert "\n" not in line and len(line) < 1000, len(line)


@pytest.mark.parametrize(
    ("metadata", "marks", "need"),
    [
        ({}, [], None),
        ({"marks": []}, [], None),
        ({"marks": ["slow", "gpu"]}, ["slow", "gpu"], None),
        ({"vram_gib": 1e-3}, [], 1e-3),
        ({"vram_gib": 10**6}, [], 1e6),
        ({"vram_gib": 80}, [], 80.0),
        # Infinity becomes a vram marker, whose bound refuses it (tests/test_bad_inputs.py,
        # row nb-vram-1e400).
        ({"vram_gib": float("inf")}, [], float("inf")),
    ],
)
def test_good_ctresources_metadata(metadata: Any, marks: list[str], need: float | None) -> None:
    assert notebook_metadata(nbformat.from_dict(_meta(ctresources=metadata)), "nb") == (marks, need)


# --- parameter injection: what a config's PARAMS may put into a notebook ------------------

#: (id, the PARAMS mapping, what the line must say)
PARAMS_ROWS: list[tuple[str, dict[Any, Any], str]] = [
    ("key-int", {1: "x"}, "PARAMS key 1"),
    ("key-none", {None: "x"}, "PARAMS key None"),
    ("key-bool", {True: "x"}, "PARAMS key True"),
    ("key-tuple", {("a", "b"): 1}, "PARAMS key ('a', 'b')"),
    ("key-float", {1.5: 1}, "PARAMS key 1.5"),
    ("key-empty", {"": 1}, "PARAMS key ''"),
    ("key-space", {"a b": 1}, "PARAMS key 'a b'"),
    ("key-dash", {"a-b": 1}, "PARAMS key 'a-b'"),
    ("key-digit-first", {"1a": 1}, "PARAMS key '1a'"),
    ("key-assignment", {"x = 1": 1}, "PARAMS key 'x = 1'"),
    ("key-newline-code", {"x = 1\nimport os; os.system('id')\ny": 1}, "is not a name"),
    ("key-semicolon", {"x;import os": 1}, "is not a name"),
    ("key-attribute", {"os.environ": 1}, "is not a name"),
    ("key-subscript", {"globals()['x']": 1}, "is not a name"),
    ("key-call", {"print()": 1}, "is not a name"),
    ("key-comment", {"x#": 1}, "is not a name"),
    ("key-keyword-class", {"class": 1}, "PARAMS key 'class'"),
    ("key-keyword-import", {"import": 1}, "PARAMS key 'import'"),
    ("key-keyword-none", {"None": 1}, "PARAMS key 'None'"),
    ("key-keyword-true", {"True": 1}, "PARAMS key 'True'"),
    ("key-keyword-lambda", {"lambda": 1}, "PARAMS key 'lambda'"),
    ("key-dunder-builtins", {"__builtins__": {}}, "no __dunder__"),
    ("key-dunder-import", {"__import__": 1}, "no __dunder__"),
    ("key-dunder-name", {"__name__": "x"}, "no __dunder__"),
    ("key-dunder-class", {"__class__": 1}, "no __dunder__"),
    ("key-escape", {"\x1b[2J": 1}, "PARAMS key '\\x1b[2J'"),
    ("key-nul", {"a\x00b": 1}, "PARAMS key 'a\\x00b'"),
    ("key-zero-width-joiner", {"a\u200db": 1}, "is not a name"),
    ("key-rtl-override", {"a\u202eb": 1}, "is not a name"),
    ("key-fullwidth-setting", {"\uff22ATCH_SIZE": 1}, "Python would read it as 'BATCH_SIZE'"),
    ("key-ligature", {"\ufb01le": 1}, "Python would read it as 'file'"),
    ("key-superscript", {"x\u00b2": 1}, "is not a name"),
    ("key-mathematical-bold", {"\U0001d41bATCH": 1}, "Python would read it as 'bATCH'"),
    ("key-setting-batch", {"BATCH_SIZE": 1}, "would override the setting BATCH_SIZE"),
    ("key-setting-model", {"MODEL_NAME": "x"}, "would override the setting MODEL_NAME"),
    ("key-setting-nodes", {"MAX_FEATURE_NODES": 1}, "would override the setting MAX_FEATURE_NODES"),
    ("key-setting-vram", {"VRAM_GIB": 1}, "would override the setting VRAM_GIB"),
    (
        "key-setting-transcoders",
        {"TRANSCODER_SET": "x"},
        "would override the setting TRANSCODER_SET",
    ),
    ("key-long", {"k" * 5000 + " x": 1}, "is not a name"),
    (
        "value-date",
        {"WHEN": datetime.date(2024, 1, 1)},
        "a date (YAML reads an unquoted date as one",
    ),
    ("value-datetime", {"WHEN": datetime.datetime(2024, 1, 1)}, "a datetime"),
    ("value-nan", {"X": float("nan")}, "NaN, which has no Python literal"),
    ("value-nan-in-list", {"X": [1, float("nan")]}, "NaN"),
    ("value-nan-in-dict", {"X": {"a": float("nan")}}, "NaN"),
    ("value-nan-as-key", {"X": {float("nan"): 1}}, "NaN"),
    ("value-empty-set", {"X": set()}, "an empty set"),
    ("value-object", {"X": object()}, "an object, which has no Python literal"),
    ("value-type", {"X": int}, "a type"),
    ("value-function", {"X": print}, "has no Python literal"),
    ("value-complex", {"X": 1j}, "a complex"),
    ("value-bytearray", {"X": bytearray(b"x")}, "a bytearray"),
    ("value-range", {"X": range(3)}, "a range"),
    ("value-ellipsis", {"X": ...}, "has no Python literal"),
    ("value-huge-int", {"X": 10**5000}, "an integer too long to write out"),
    ("value-deep-list", {"X": _nested_list(100_000)}, "nested too deeply"),
    (
        "value-str-subclass",
        {"X": type("Text", (str,), {"__repr__": lambda s: "__import__('os')"})("x")},
        "a Text",
    ),
    ("value-int-subclass", {"X": type("Num", (int,), {})(1)}, "a Num"),
    ("value-dict-subclass", {"X": type("Map", (dict,), {})()}, "a Map"),
    ("value-list-subclass", {"X": type("Seq", (list,), {})()}, "a Seq"),
    ("value-date-in-list", {"X": [datetime.date(2024, 1, 1)]}, "a date"),
    ("value-set-of-dates", {"X": {datetime.date(2024, 1, 1)}}, "a date"),
]


@pytest.mark.parametrize(
    ("params", "message"), [r[1:] for r in PARAMS_ROWS], ids=[r[0] for r in PARAMS_ROWS]
)
def test_params_that_cannot_be_injected_are_one_line(params: dict[Any, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        check_params(params, "configs/exp.yaml")
    line = str(exc.value)
    assert line.startswith("configs/exp.yaml: PARAMS "), line
    assert message in line, line
    assert "\n" not in line and len(line) < 1000, len(line)


@pytest.mark.parametrize("name", ["a b", "x = 1", "class", "x\ny", "", "os.system", "1x", "a;b"])
def test_the_injected_cell_refuses_a_name_that_is_not_one(name: str) -> None:
    with pytest.raises(ConfigError, match="is not a name a notebook variable can have"):
        injected_source({name: 1})


# --- NOTEBOOK: configs ---------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigRow:
    """A config naming a notebook, in a project laid out by ``prepare`` (``root`` is the
    rootdir, ``configs/`` holds the config, ``outside/`` is beside the rootdir)."""

    id: str
    notebook: str
    message: str
    prepare: Callable[[Path], None] | None = None
    as_root: bool = False


def _plant(relative: str, mode: int = 0o644) -> Callable[[Path], None]:
    def prepare(root: Path) -> None:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_nb()))
        path.chmod(mode)

    return prepare


def _link(relative: str, target: str) -> Callable[[Path], None]:
    """A symlink at ``relative`` to ``target`` (absolute, or relative to the rootdir: then a
    notebook is planted there unless something already is)."""

    def prepare(root: Path) -> None:
        link = root / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        if not target.startswith("/") and not os.path.lexists(root / target):
            _plant(target)(root)
        link.symlink_to(target if target.startswith("/") else root / target)

    return prepare


def _owned_by_nobody(relative: str) -> Callable[[Path], None]:
    def prepare(root: Path) -> None:
        _plant(relative)(root)
        os.chown(root / relative, 65534, 65534)

    return prepare


def _both(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def prepare(root: Path) -> None:
        for step in steps:
            step(root)

    return prepare


OUTSIDE = "is outside the config file's folder and the rootdir"
NOT_IPYNB = "is not a .ipynb file"
CONFIG_ROWS = [
    ConfigRow("absolute-outside", "{outside}/nb.ipynb", OUTSIDE, _plant("../outside/nb.ipynb")),
    ConfigRow("dotdot-outside", "../../outside/nb.ipynb", OUTSIDE, _plant("../outside/nb.ipynb")),
    ConfigRow("dotdot-deep", "../" * 12 + "etc/passwd", NOT_IPYNB),
    ConfigRow("etc-passwd", "/etc/passwd", NOT_IPYNB),
    ConfigRow("etc-hostname-json", "/etc/hostname", NOT_IPYNB),
    ConfigRow("proc-self-environ", "/proc/self/environ", NOT_IPYNB),
    ConfigRow("dev-zero", "/dev/zero", NOT_IPYNB),
    ConfigRow("a-json-file", "data.json", NOT_IPYNB, _plant("configs/data.json")),
    ConfigRow("a-dotenv", ".env", NOT_IPYNB, _plant("configs/.env")),
    ConfigRow("no-suffix", "notebook", NOT_IPYNB, _plant("configs/notebook")),
    ConfigRow("upper-suffix", "nb.IPYNB", NOT_IPYNB, _plant("configs/nb.IPYNB")),
    ConfigRow("suffix-then-more", "nb.ipynb.bak", NOT_IPYNB, _plant("configs/nb.ipynb.bak")),
    ConfigRow("python-file", "run.py", NOT_IPYNB, _plant("configs/run.py")),
    ConfigRow("link-to-passwd", "nb.ipynb", NOT_IPYNB, _link("configs/nb.ipynb", "/etc/passwd")),
    ConfigRow("link-outside", "nb.ipynb", OUTSIDE, _link("configs/nb.ipynb", "../outside/x.ipynb")),
    ConfigRow(
        "dir-link-outside",
        "sub/nb.ipynb",
        OUTSIDE,
        _both(_plant("../outside/nb.ipynb"), _link("configs/sub", "../outside")),
    ),
    ConfigRow(
        "link-to-a-link-outside",
        "nb.ipynb",
        OUTSIDE,
        _both(
            _link("configs/hop.ipynb", "../outside/x.ipynb"),
            _link("configs/nb.ipynb", "configs/hop.ipynb"),
        ),
    ),
    ConfigRow(
        "dangling-link",
        "nb.ipynb",
        "which is not a file",
        _link("configs/nb.ipynb", "/nonexistent/x.ipynb"),
    ),
    ConfigRow(
        "link-loop",
        "loop.ipynb",
        "cannot be resolved",
        lambda root: _loop(root / "configs" / "loop.ipynb"),
    ),
    ConfigRow("missing", "nothere.ipynb", "which is not a file"),
    ConfigRow(
        "a-directory",
        "dir.ipynb",
        "is not a regular file",
        lambda root: (root / "configs" / "dir.ipynb").mkdir(parents=True),
    ),
    ConfigRow(
        "a-fifo",
        "pipe.ipynb",
        "is not a regular file",
        lambda root: os.mkfifo(root / "configs" / "pipe.ipynb"),
    ),
    ConfigRow(
        "world-writable",
        "nb.ipynb",
        "others can write (mode 0666)",
        _plant("configs/nb.ipynb", 0o666),
    ),
    ConfigRow(
        "group-writable",
        "nb.ipynb",
        "others can write (mode 0664)",
        _plant("configs/nb.ipynb", 0o664),
    ),
    ConfigRow(
        "world-writable-only",
        "nb.ipynb",
        "others can write (mode 0602)",
        _plant("configs/nb.ipynb", 0o602),
    ),
    ConfigRow(
        "setgid-group-writable",
        "nb.ipynb",
        "others can write (mode 2664)",
        _plant("configs/nb.ipynb", 0o2664),
    ),
    ConfigRow(
        "writable-through-link",
        "nb.ipynb",
        "others can write",
        _both(_plant("configs/real.ipynb", 0o666), _link("configs/nb.ipynb", "configs/real.ipynb")),
    ),
    ConfigRow(
        "another-users",
        "nb.ipynb",
        "is owned by another user (uid 65534)",
        _owned_by_nobody("configs/nb.ipynb"),
        as_root=True,
    ),
    ConfigRow(
        "another-users-in-rootdir",
        "../nb.ipynb",
        "is owned by another user",
        _owned_by_nobody("nb.ipynb"),
        as_root=True,
    ),
]


def _loop(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(path.parent / "loop2.ipynb")
    (path.parent / "loop2.ipynb").symlink_to(path)


def _project(tmp_path: Path, row: ConfigRow) -> tuple[Path, Path]:
    root = tmp_path / "root"
    (root / "configs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    if row.prepare is not None:
        row.prepare(root)
    config = root / "configs" / "exp.yaml"
    config.write_text("NOTEBOOK: " + row.notebook.format(outside=tmp_path / "outside") + "\n")
    return root, config


@pytest.mark.parametrize("row", CONFIG_ROWS, ids=lambda r: r.id)
def test_a_config_names_only_a_notebook_of_the_users_in_its_tree(
    tmp_path: Path, row: ConfigRow
) -> None:
    if row.as_root and os.geteuid() != 0:
        pytest.skip("making a file another user's needs root")
    root, config = _project(tmp_path, row)
    experiment = load_experiment_yaml(config)
    assert experiment.notebook is not None
    with pytest.raises(ConfigError) as exc:
        trusted_notebook(
            "configs/exp.yaml", experiment.notebook, "the notebook", (config.parent, root)
        )
    line = str(exc.value)
    assert line.startswith("configs/exp.yaml: NOTEBOOK names the notebook, which "), line
    assert row.message in line, line
    assert "\n" not in line and len(line) < 1000


@pytest.mark.parametrize(
    ("notebook", "prepare"),
    [
        ("nb.ipynb", _plant("configs/nb.ipynb")),
        ("../notebooks/nb.ipynb", _plant("notebooks/nb.ipynb")),
        ("deep/er/nb.ipynb", _plant("configs/deep/er/nb.ipynb")),
        ("nb.ipynb", _link("configs/nb.ipynb", "notebooks/real.ipynb")),
        ("private.ipynb", _plant("configs/private.ipynb", 0o600)),
    ],
    ids=["beside", "in-the-rootdir", "below", "link-inside", "private"],
)
def test_a_config_may_name_a_notebook_of_the_users_in_its_tree(
    tmp_path: Path, notebook: str, prepare: Callable[[Path], None]
) -> None:
    root, config = _project(tmp_path, ConfigRow("good", notebook, "", prepare))
    experiment = load_experiment_yaml(config)
    assert experiment.notebook is not None
    resolved = trusted_notebook("exp.yaml", experiment.notebook, notebook, (config.parent, root))
    assert resolved == experiment.notebook.resolve() and resolved.is_relative_to(root.resolve())


# --- the NOTEBOOK: scan (residual) and the socket directory -------------------------------


def test_the_notebook_scan_reads_at_most_what_a_config_may_hold(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as handle:
        handle.truncate(16 * MAX_BYTES)  # 16 MiB and no newline: one line read whole before
    tracemalloc.start()
    try:
        assert names_a_notebook(big) is False
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_BYTES, peak
    late = tmp_path / "late.yaml"
    late.write_bytes(b"#" * MAX_BYTES + b"\nNOTEBOOK: nb.ipynb\n")
    assert names_a_notebook(late) is False  # beyond what a config may hold: no config
    early = tmp_path / "early.yaml"
    early.write_bytes(b"BATCH_SIZE: 2\nNOTEBOOK: nb.ipynb\n")
    assert names_a_notebook(early) is True
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert names_a_notebook(fifo) is False  # and returns: never waits for a writer


def test_sockets_go_where_their_paths_fit(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 150)
    long_dir.mkdir()
    assert not fits_socket_path(long_dir)
    chosen = socket_directory(long_dir)
    assert chosen is not None and chosen != long_dir and fits_socket_path(chosen)
    try:
        assert stat.S_IMODE(chosen.stat().st_mode) == 0o700 and chosen.stat().st_uid == os.geteuid()
    finally:
        chosen.rmdir()
    assert socket_directory(tmp_path) == tmp_path  # a short one is used as it is


@pytest.mark.parametrize(
    ("cell_timeout", "expected"), [(None, 60), (-1, 60), (3, 3), (60, 60), (600, 60), (1, 1)]
)
def test_a_kernel_is_awaited_no_longer_than_a_cell(cell_timeout: int | None, expected: int) -> None:
    assert startup_timeout(cell_timeout) == expected


# --- one pytest run for the rows that need kernels -----------------------------------------

LONG_TMPDIR_LENGTH = 150


@dataclass(frozen=True)
class RunRow:
    """A file of the batch project, the item it makes, and what its one line must say
    (None: the item passes)."""

    id: str
    path: str
    content: str
    item: str
    message: str | None
    mode: int = 0o644


def _kernelspec(name: str, code: str) -> dict[str, Any]:
    return {
        "argv": [sys.executable, "-c", code, "{connection_file}"],
        "display_name": name,
        "language": "python",
    }


def _with_kernel(name: str, timeout: int | None = None) -> str:
    metadata: dict[str, Any] = {"kernelspec": {"name": name, "display_name": name}}
    if timeout is not None:
        metadata["execution"] = {"timeout": timeout}
    return json.dumps(_nb(metadata=metadata))


GOOD = json.dumps(
    _nb(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        cells=[_cell(source="import tempfile\nassert len(tempfile.gettempdir()) >= 150")],
    )
)
RUN_ROWS = [
    # This notebook's kernel starts with sockets under a 150-character TMPDIR.
    RunRow("long-tmpdir-kernel-starts", "good.ipynb", GOOD, "good.ipynb::good.ipynb", None),
    # nbformat or nbclient cannot read or start these; the other items still run.
    RunRow(
        "metadata-a-list",
        "meta_list.ipynb",
        json.dumps(_nb(metadata=[])),
        "meta_list.ipynb::meta_list.ipynb",
        "meta_list.ipynb: not a notebook nbclient can run: 'metadata' is a list",
    ),
    RunRow(
        "cells-a-mapping",
        "cells_map.ipynb",
        json.dumps(_nb(cells={})),
        "cells_map.ipynb::cells_map.ipynb",
        "cells_map.ipynb: not a notebook nbclient can run: 'cells' is an object",
    ),
    RunRow(
        "nbformat-5",
        "v5.ipynb",
        json.dumps(_nb(nbformat=5)),
        "v5.ipynb::v5.ipynb",
        "v5.ipynb: not a notebook nbclient can run: 'nbformat' is 5",
    ),
    RunRow(
        "deep-json",
        "deep.ipynb",
        _deep(100_000),
        "deep.ipynb::deep.ipynb",
        "deep.ipynb: not a notebook: JSON nested too deeply",
    ),
    RunRow(
        "timeout-abc",
        "abc.ipynb",
        json.dumps(_meta(execution={"timeout": "abc"})),
        "abc.ipynb::abc.ipynb",
        "abc.ipynb: not a notebook nbclient can run: metadata 'execution.timeout' is a string",
    ),
    RunRow(
        "kernel-hangs",
        "hangs.ipynb",
        _with_kernel("hangs", timeout=3),
        "hangs.ipynb::hangs.ipynb",
        # Waited for as long as its cell timeout, not nbclient's 60 s of start-up.
        "hangs.ipynb: its kernel did not start: Kernel didn't respond in 3 seconds",
    ),
    RunRow(
        "kernel-exits-at-once",
        "exits.ipynb",
        _with_kernel("exits"),
        "exits.ipynb::exits.ipynb",
        "exits.ipynb: its kernel did not start: ",
    ),
    # What a config may name.
    RunRow(
        "config-names-outside",
        "configs/outside.yaml",
        "NOTEBOOK: /etc/passwd\n",
        "configs/outside.yaml::passwd",
        "configs/outside.yaml: NOTEBOOK names /etc/passwd, which is not a .ipynb file",
    ),
    RunRow(
        "config-names-world-writable",
        "configs/writable.yaml",
        "NOTEBOOK: shared.ipynb\n",
        "configs/writable.yaml::shared.ipynb",
        "others can write (mode 0666)",
    ),
    # A config naming a file that is no notebook shows none of its content.
    RunRow(
        "config-names-a-secret",
        "configs/secret.yaml",
        "NOTEBOOK: notes.ipynb\n",
        "configs/secret.yaml::notes.ipynb",
        "configs/notes.ipynb: not a notebook: not JSON",
    ),
    RunRow(
        "config-names-a-good-notebook",
        "configs/good.yaml",
        "NOTEBOOK: ../good.ipynb\n",
        "configs/good.yaml::good.ipynb",
        None,
    ),
]
BATCH_FILES = {
    "configs/shared.ipynb": (json.dumps(_nb()), 0o666),
    "configs/notes.ipynb": (f"API_KEY={SECRET}\n", 0o600),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Runs the batch project once: item -> (outcome, its failure text)."""
    project = tmp_path_factory.mktemp("notebook-inputs")
    tmpdir = project / "t"
    tmpdir = tmpdir / ("x" * (LONG_TMPDIR_LENGTH - len(str(tmpdir)) - 1))
    tmpdir.mkdir(parents=True)
    assert len(str(tmpdir)) == LONG_TMPDIR_LENGTH
    kernels = project / "jupyter" / "kernels"
    for name, code in (
        (
            "hangs",  # a kernel that never answers, and ignores the interrupt jupyter_client sends first
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)",
        ),
        ("exits", "raise SystemExit(3)"),
    ):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "kernel.json").write_text(json.dumps(_kernelspec(name, code)))
    for row in RUN_ROWS:
        path = project / row.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(row.content)
    for name, (text, mode) in BATCH_FILES.items():
        (project / name).write_text(text)
        (project / name).chmod(mode)
    (project / "tox.ini").write_text("[pytest]\nct_notebook_configs = configs\n")
    env = {
        **os.environ,
        "TMPDIR": str(tmpdir),
        "JUPYTER_PATH": str(project / "jupyter"),
        "COLUMNS": "300",
    }
    env = {k: v for k, v in env.items() if not k.startswith(("CT_", "PYTEST_ADDOPTS"))}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbmake",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--junitxml",
            str(project / "junit.xml"),
            "-rA",
            # notebooks that only serve the configs: not items of their own here
            "--deselect",
            "configs/shared.ipynb::shared.ipynb",
            "--deselect",
            "configs/notes.ipynb::notes.ipynb",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = completed.stdout + completed.stderr
    junit = (project / "junit.xml").read_text()
    assert "Traceback" not in output and "INTERNAL" not in output, output
    assert SECRET not in output and SECRET not in junit
    results = {}
    for case in ET.fromstring(junit).iter("testcase"):
        item = case.get("classname", "") + "::" + case.get("name", "")
        problem = next((child for child in case if child.tag in ("failure", "error")), None)
        outcome = "passed" if problem is None else problem.tag
        text = "" if problem is None else (problem.text or problem.get("message", ""))
        results[item] = (outcome, text.strip())
    return results


def _find(results: dict[str, tuple[str, str]], item: str) -> tuple[str, str]:
    # junit's classname is the node id's path with "/" written "."
    wanted = item.replace("/", ".")
    assert wanted in results, (item, sorted(results))
    return results[wanted]


@pytest.mark.parametrize("row", RUN_ROWS, ids=lambda r: r.id)
def test_each_notebook_input_fails_only_its_own_item_in_one_line(
    batch: dict[str, tuple[str, str]], row: RunRow
) -> None:
    outcome, text = _find(batch, row.item)
    if row.message is None:
        assert outcome == "passed", text
        return
    assert outcome in ("failure", "error"), outcome
    assert "\n" not in text, text
    assert row.message in text, text


def test_the_tables_are_large_and_their_ids_distinct() -> None:
    # The tables promise many distinct hostile inputs on these surfaces: a row copied under a
    # second id would count twice and test nothing new.
    ids = (
        [row[0] for row in FILE_ROWS]
        + [row[0] for row in METADATA_ROWS]
        + [row[0] for row in PARAMS_ROWS]
        + [row.id for row in CONFIG_ROWS]
    )
    # The batch run repeats some inputs of the tables in a real run: its own ids are apart.
    assert len({row.id for row in RUN_ROWS}) == len(RUN_ROWS)
    assert len(ids) == len(set(ids))
    inputs = [json.dumps(row[1].decode("utf-8", "replace")) for row in FILE_ROWS]
    assert len(inputs) == len(set(inputs))
    assert len(ids) >= 200
