"""Notebooks beside nbmake and other plugins: with the plugin asked, installed but not
asked, and not installed (``-p no:ctresources``).

A project that does not ask and a notebook without ``ctresources`` metadata get nbmake's own
item and nbmake's own kernel (argv, environment, transport); where the plugin does act, the
item keeps what other plugins gave it and the project's IPython profile still runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

# Projects run with --nbmake (tests/conftest.py turns nbmake off elsewhere).
pytestmark = pytest.mark.nbmake

pytest_plugins = ["pytester"]

#: How each mode is asked for on the command line. "asked" asks for the whole project with a
#: setting that changes nothing a notebook here depends on.
MODES = {
    "asked": ("--ct-batch-size", "8"),
    "not-asked": (),
    "not-installed": ("-p", "no:ctresources"),
}


def write_notebook(path: Path, *sources: str) -> Path:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [new_code_cell(source) for source in sources]
    nbformat.write(nb, path)
    return path


ITEMS_CONFTEST = """
import pytest

def pytest_itemcollected(item):
    if item.name.startswith("a"):
        item.add_marker(pytest.mark.from_itemcollected)
        item.user_properties.append(("from_itemcollected", "yes"))

def pytest_collection_finish(session):
    for item in session.items:
        marks = sorted(m.name for m in item.iter_markers())
        print("ITEM", item.name, type(item).__name__, marks, item.user_properties)
"""


@pytest.mark.parametrize("mode", MODES)
def test_collect_only_shows_nbmakes_item_unless_the_plugin_acts(
    pytester: pytest.Pytester, mode: str
) -> None:
    write_notebook(pytester.path / "plain.ipynb", "x = 1")
    result = pytester.runpytest("--nbmake", "--co", *MODES[mode])
    result.assert_outcomes()
    expected = "CtNotebookItem" if mode == "asked" else "NotebookItem"
    result.stdout.fnmatch_lines([f"*<{expected} plain.ipynb>*"])
    if mode != "asked":
        result.stdout.no_fnmatch_line("*CtNotebookItem*")


def test_a_notebook_with_metadata_is_the_plugins_in_a_project_that_does_not_ask(
    pytester: pytest.Pytester,
) -> None:
    nb = new_notebook(cells=[new_code_cell("x = 1")])
    nb.metadata["ctresources"] = {"marks": ["slow"]}
    nbformat.write(nb, pytester.path / "declared.ipynb")
    write_notebook(pytester.path / "plain.ipynb", "x = 1")
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    result = pytester.runpytest("--nbmake", "--co")
    result.stdout.fnmatch_lines(
        ["*<CtNotebookItem declared.ipynb>*", "*<NotebookItem plain.ipynb>*"]
    )


@pytest.mark.parametrize("mode", MODES)
def test_marks_and_attributes_given_in_itemcollected_are_kept(
    pytester: pytest.Pytester, mode: str
) -> None:
    write_notebook(pytester.path / "a.ipynb", "x = 1")
    write_notebook(pytester.path / "b.ipynb", "x = 1")
    pytester.makeini("[pytest]\nmarkers =\n    from_itemcollected: added by a conftest\n")
    pytester.makeconftest(ITEMS_CONFTEST)
    result = pytester.runpytest(
        "--nbmake", "--co", "-s", "-m", "not from_itemcollected", *MODES[mode]
    )
    # As without the plugin: the marked notebook is deselected, the other is not.
    result.stdout.fnmatch_lines(["*1/2 tests collected (1 deselected)*"])
    result.stdout.fnmatch_lines(["ITEM b.ipynb *"])
    everything = pytester.runpytest("--nbmake", "--co", "-s", *MODES[mode])
    everything.stdout.fnmatch_lines(
        ["ITEM a.ipynb *Item *from_itemcollected* *from_itemcollected*yes*"]
    )


# What the kernel sees, written by the notebook itself: its environment's names, the values
# of the plugin's variables, its command line (the connection file, whose name is random,
# left out) and the transport in the connection file.
KERNEL_PROBE = """
import json, os, sys
argv = [a for a in sys.argv if not a.endswith(".json")]
connection = next(a for a in sys.argv if a.endswith(".json"))
ours = {k: v for k, v in os.environ.items() if k.startswith("CT_") or k == "PYTORCH_CUDA_ALLOC_CONF"}
with open(os.environ["PROBE_OUT"], "w") as handle:
    json.dump({
        "names": sorted(os.environ),
        "ours": ours,
        "argv": argv,
        "transport": json.load(open(connection))["transport"],
    }, handle)
"""


def test_kernels_argv_and_environment_are_nbmakes_unless_the_plugin_acts(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_notebook(pytester.path / "probe.ipynb", KERNEL_PROBE)
    for name in list(os.environ):  # the outer run's own (this project asks for the plugin)
        if name.startswith(("CT_", "PYTORCH_")):
            monkeypatch.delenv(name)
    seen = {}
    for mode, args in MODES.items():
        out = pytester.path / f"{mode}.json"
        monkeypatch.setenv("PROBE_OUT", str(out))
        # A subprocess: the kernel inherits the pytest process's environment, which the
        # plugin's start-up could change (PYTORCH_CUDA_ALLOC_CONF), as a real run would.
        result = pytester.runpytest_subprocess("--nbmake", "-p", "no:randomly", *args)
        result.assert_outcomes(passed=1)
        seen[mode] = json.loads(out.read_text())
    assert seen["not-asked"] == seen["not-installed"]
    assert seen["not-installed"]["ours"] == {}
    assert seen["not-installed"]["transport"] == "tcp"
    asked = seen["asked"]
    assert asked["ours"]["CT_BATCH_SIZE"] == "8"
    assert "CT_NOTEBOOK_VRAM_FILE" in asked["ours"]
    assert any("extra_config_file" in part for part in asked["argv"])
    assert asked["transport"] == "ipc"


PROFILES = {
    "code_to_run": "c.IPKernelApp.code_to_run = 'FROM_PROFILE = \"code\"'\n",
    "file_to_run": "c.IPKernelApp.file_to_run = {start!r}\n",
}


@pytest.mark.parametrize("setting", PROFILES)
@pytest.mark.parametrize("mode", MODES)
def test_the_profiles_code_to_run_and_file_to_run_still_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str, setting: str
) -> None:
    ipython_dir = pytester.path / "ipython"
    profile = ipython_dir / "profile_default"
    profile.mkdir(parents=True)
    start = pytester.path / "start.py"
    start.write_text("FROM_PROFILE = 'file'\n")
    (profile / "ipython_kernel_config.py").write_text(PROFILES[setting].format(start=str(start)))
    monkeypatch.setenv("IPYTHONDIR", str(ipython_dir))
    expected = "code" if setting == "code_to_run" else "file"
    write_notebook(pytester.path / "uses_profile.ipynb", f"assert FROM_PROFILE == {expected!r}")
    result = pytester.runpytest("--nbmake", "-p", "no:randomly", *MODES[mode])
    result.assert_outcomes(passed=1)
