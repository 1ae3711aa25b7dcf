"""Notebooks through nbmake: a notebook the plugin has nothing to say to runs as under nbmake
alone; settings and injected parameters (literals only) reach the kernel; one item per
experiment config that is ours; marks and VRAM needs from metadata; contained failures,
reported as nbmake reports them; xdist."""

from __future__ import annotations

import ast
import datetime
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pytest_ctresources.core.record import AFTER_PARAMETERS, AT_TOP
from pytest_ctresources.notebooks.params import (
    INJECTED_TAG,
    NotALiteral,
    check_params,
    has_parameters_cell,
    inject_parameters,
    injected_values,
    notebook_metadata,
    python_literal,
)
from pytest_ctresources.settings.config import CircuitTracerConfig, ConfigError
from pytest_ctresources.settings.sources import Source

# Projects run with --nbmake (tests/conftest.py turns nbmake off elsewhere).
pytestmark = pytest.mark.nbmake

pytest_plugins = ["pytester"]

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Short test summary lines are cut at the terminal's width; the tests read them whole.
    monkeypatch.setenv("COLUMNS", "400")


def summary_lines(result: pytest.RunResult) -> list[str]:
    """The run's PASSED/FAILED/ERROR summary lines (-rA/-rf), colours removed, sorted.
    (``ERROR `` with its space: a log line a kernel's shutdown lets through, such as
    ``ERROR:tornado.general:...``, is no outcome.)"""
    return sorted(
        ANSI.sub("", line)
        for line in result.stdout.lines
        if line.startswith(("PASSED ", "FAILED ", "ERROR "))
    )


def notebook(  # type: ignore[no-untyped-def]
    *sources: str,
    parameters: str | None = None,
    metadata: dict | None = None,  # type: ignore[type-arg]
    nb_metadata: dict | None = None,  # type: ignore[type-arg]
):
    nb = new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    if metadata is not None:
        nb.metadata["ctresources"] = metadata
    nb.metadata.update(nb_metadata or {})
    if parameters is not None:
        nb.cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb.cells += [new_code_cell(source) for source in sources]
    return nb


def write(path: Path, nb) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def injected_cells(path: Path) -> list:  # type: ignore[type-arg]
    cells = nbformat.read(path, as_version=4).cells
    return [cell for cell in cells if INJECTED_TAG in cell.metadata.get("tags", [])]


# --- pure parts -----------------------------------------------------------------------------


def test_injected_cell_goes_after_the_parameters_cell() -> None:
    nb = notebook("x = 1", parameters="BATCH_SIZE = 256")
    assert inject_parameters(nb, {"BATCH_SIZE": 64, "PROMPT": "hi"}) == AFTER_PARAMETERS
    cell = nb.cells[1]
    assert cell.metadata["tags"] == [INJECTED_TAG]
    assert "BATCH_SIZE = 64" in cell.source and "PROMPT = 'hi'" in cell.source


@pytest.mark.parametrize("tags", [5, None, "parameters", {"parameters": 1}])
def test_tags_that_are_not_a_list_are_no_tags(tags: object) -> None:
    """A cell's ``tags`` that is not a list (nbmake alone runs such a notebook) once failed
    the item with a TypeError traceback, or aborted the collection of a NOTEBOOK: config."""
    nb = notebook("x = 1", parameters="BATCH_SIZE = 256")
    for cell in nb.cells:
        cell.metadata["tags"] = tags
    assert not has_parameters_cell(nb)
    assert inject_parameters(nb, {"BATCH_SIZE": 64}) == AT_TOP
    assert len(nb.cells) == 3


def test_without_parameters_cell_the_injected_cell_goes_first() -> None:
    nb = notebook("x = 1")
    assert inject_parameters(nb, {"BATCH_SIZE": 64}) == AT_TOP
    assert nb.cells[0].metadata["tags"] == [INJECTED_TAG]


def test_injected_values_are_the_configured_ones_and_params() -> None:
    cfg = CircuitTracerConfig.defaults().layered(
        {"batch_size": 64}, Source.option("--ct-batch-size"), params={"PROMPT": "p"}
    )
    assert injected_values(cfg) == {"BATCH_SIZE": 64, "PROMPT": "p"}
    # Nothing set anywhere: nothing to inject (the notebook then runs as it is).
    assert injected_values(CircuitTracerConfig.defaults()) == {}


LITERALS = [
    None,
    True,
    0,
    -7,
    10**300,
    1.5,
    -0.0,
    float("inf"),
    float("-inf"),
    "",
    'it\'s "quoted"\nand\\escaped \u00e9',
    "__import__('os').system('x')",
    b"\x00bytes",
    [],
    [1, [2, [3]]],
    (1,),
    (),
    {"a": [1, {"b": None}], 2: "two", None: (1.0,)},
    {1, 2, 3},
]


@pytest.mark.parametrize("value", LITERALS, ids=repr)
def test_values_are_written_as_literals(value: object) -> None:
    """Every value becomes source that evaluates to it without a name or a call."""
    source = python_literal(value)
    assert ast.literal_eval(source) == value
    tree = ast.parse(source, mode="eval")
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Name, ast.Call))]


class Text(str):
    def __repr__(self) -> str:
        return "__import__('os').system('touch pwned')"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "NaN, which has no Python literal"),
        (datetime.date(2024, 1, 1), "a date (YAML reads an unquoted date as one: quote it)"),
        (set(), "an empty set"),
        (object(), "an object, which has no Python literal"),
        (Text("x"), "a Text, which has no Python literal"),  # no repr of a subclass
        ([1, {"k": datetime.datetime(2024, 1, 1)}], "a datetime"),
    ],
)
def test_values_without_a_literal_are_refused(value: object, message: str) -> None:
    with pytest.raises(NotALiteral, match=message.replace("(", r"\(").replace(")", r"\)")):
        python_literal(value)


@pytest.mark.parametrize(
    "key",
    [
        # keys that are code: both ran code in the kernel when keys were written verbatim
        "x = 1\nimport os; os.system('touch pwned')\ny",
        "globals()[__import__('os').system('touch pwned2')]",
        "a b",
        "1x",
        "",
        "class",
        "__builtins__",
        1,
        None,
    ],
    ids=repr,
)
def test_params_keys_must_be_plain_identifiers(key: object) -> None:
    with pytest.raises(ConfigError) as info:
        check_params({key: 1}, "configs/exp.yaml")
    message = str(info.value)
    assert message.startswith(f"configs/exp.yaml: PARAMS key {key!r} is not a name")
    assert "\n" not in message  # one line, whatever the key holds


@pytest.mark.parametrize("key", ["BATCH_SIZE", "MODEL_NAME", "VRAM_GIB"])
def test_a_params_key_that_shadows_a_setting_is_refused(key: str) -> None:
    with pytest.raises(
        ConfigError, match=f"exp.yaml: PARAMS key '{key}' would override the setting"
    ):
        check_params({"PROMPT": "p", key: -1}, "exp.yaml")


@pytest.mark.parametrize(
    ("key", "read_as"),
    [
        ("\uff22ATCH_SIZE", "BATCH_SIZE"),  # a fullwidth B: the setting, in the notebook
        ("_\uff3fbuiltins__", "__builtins__"),  # a fullwidth low line: a dunder there
        ("\ufb01le", "file"),  # a ligature
    ],
)
def test_a_params_key_python_would_read_as_another_name_is_refused(key: str, read_as: str) -> None:
    # Python binds the NFKC form of an identifier: the checks must see that name.
    assert key.isidentifier()
    with pytest.raises(ConfigError) as info:
        check_params({key: -1}, "exp.yaml")
    assert str(info.value) == (
        f"exp.yaml: PARAMS key {key!r} is not a name a notebook variable can have as "
        f"written: Python would read it as {read_as!r}; write that"
    )


def test_params_values_are_checked_where_they_are_read() -> None:
    check_params({"PROMPT": "p", "_private": [1], "LAYERS": {"a": 1}}, "exp.yaml")  # fine
    with pytest.raises(ConfigError, match=r"exp.yaml: PARAMS value of 'WHEN' is a date \(YAML"):
        check_params({"WHEN": datetime.date(2024, 1, 1)}, "exp.yaml")


def test_the_injected_cell_holds_only_literal_assignments() -> None:
    nb = notebook(parameters="X = 0")
    values = {"BATCH_SIZE": 8, "TEXT": "a'\nb", "NESTED": {"k": [1.5, None]}, "BIG": float("inf")}
    inject_parameters(nb, values)
    tree = ast.parse(nb.cells[1].source)
    assert len(tree.body) == len(values)
    for statement in tree.body:
        assert isinstance(statement, ast.Assign) and len(statement.targets) == 1
        target = statement.targets[0]
        assert isinstance(target, ast.Name)
        assert ast.literal_eval(statement.value) == values[target.id]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"vram_gb": 3}, "unknown key(s) vram_gb"),
        ({"marks": "slow"}, "must be a list of mark names"),
        ({"marks": ["not a name"]}, "must be a list of mark names"),
        ({"vram_gib": -2}, "must be a positive number, got -2"),
        ({"vram_gib": "20"}, "must be a positive number, got '20'"),
    ],
)
def test_bad_metadata(metadata: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        notebook_metadata(notebook(metadata=metadata), "nb.ipynb")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"], True),
        (["/envs/x/bin/python", "-m", "ipykernel", "-f", "{connection_file}"], True),
        (["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], False),
        (["xpython", "-f", "{connection_file}"], False),
    ],
)
def test_only_ipykernel_kernels_get_the_start_up_file(argv: list[str], expected: bool) -> None:
    from pytest_ctresources.notebooks.kernels import is_ipython_kernel

    assert is_ipython_kernel(argv) is expected


def test_ct_notebook_configs_lists_files_folders_and_globs(pytester: pytest.Pytester) -> None:
    from pytest_ctresources.notebooks.items import NotebookConfigs

    pytester.makeini(
        "[pytest]\nct_notebook_configs =\n    configs\n    more/*.yml\n    **/deep.yaml\n"
        "    one.yaml\n    missing\n"
    )
    files = {
        name: pytester.path / name
        for name in (
            "configs/a.yaml",
            "configs/sub/b.yml",
            "more/c.yml",
            "more/d.yaml",
            "x/y/deep.yaml",
            "one.yaml",
            "two.yaml",
            "other/pipeline.yaml",
        )
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("NOTEBOOK: nb.ipynb\n")
    configs = NotebookConfigs(pytester.parseconfig())
    listed = {name for name, path in files.items() if configs.lists(path)}
    assert listed == {
        "configs/a.yaml",
        "configs/sub/b.yml",
        "more/c.yml",
        "x/y/deep.yaml",
        "one.yaml",
    }
    assert configs.unmatched == ["missing"]


def test_a_ct_notebook_configs_entry_that_matches_nothing_is_warned_of(
    pytester: pytest.Pytester,
) -> None:
    # As pytest warns of testpaths that match nothing: a typo would silently collect nothing.
    pytester.makeini("[pytest]\nct_notebook_configs =\n    exmaple_configs\n")
    result = pytester.runpytest("--nbmake")
    result.stdout.fnmatch_lines(
        ["*CtResourcesWarning: ct_notebook_configs: 'exmaple_configs' matches no file or folder*"]
    )
    # Made an error (-W error): one line, no internal error.
    result = pytester.runpytest("--nbmake", "-W", "error")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: ct_notebook_configs: 'exmaple_configs' matches no file or folder*"]
    )
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    # Nothing to say without --nbmake (the key is not used then), or when it matches.
    assert "CtResourcesWarning" not in pytester.runpytest().stdout.str()
    (pytester.path / "exmaple_configs").mkdir()
    assert "CtResourcesWarning" not in pytester.runpytest("--nbmake").stdout.str()


# --- end to end -----------------------------------------------------------------------------

SETTINGS_CELL = """
import os
assert BATCH_SIZE == 64, BATCH_SIZE
assert os.environ["CT_BATCH_SIZE"] == "64"
assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
"""


def test_settings_reach_the_kernel_and_parameters_are_injected(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path / "nbs" / "nb.ipynb", notebook(SETTINGS_CELL, parameters="BATCH_SIZE = 256")
    )
    before = path.read_bytes()
    pytester.runpytest("--nbmake", "--ct-batch-size", "64").assert_outcomes(passed=1)
    assert path.read_bytes() == before  # the notebook on disk is unchanged
    # The injected copy runs from memory: nothing is written beside the notebook.
    assert [p.name for p in path.parent.iterdir()] == ["nb.ipynb"]
    # The same notebook without the option fails: the assertions above can fail.
    pytester.runpytest("--nbmake").assert_outcomes(failed=1)


PROBE_CELLS = (
    # a figure shown with the kernel's own backend (inline): it must stay in the outputs
    "import json, os, sys\nimport matplotlib\nimport matplotlib.pyplot as plt\n"
    "plt.plot([1, 2, 3])\nplt.show()",
    # defined by the project's IPython start-up file
    "assert project_helper() == 'from the project profile'\n"
    "assert profile_exec_file == 'ran' and profile_exec_line == 1",
    "json.dump({'env': dict(os.environ), 'backend': matplotlib.get_backend(),\n"
    "           'names': sorted(n for n in globals() if not n.startswith('_')),\n"
    "           'argv': sys.argv}, open(os.environ['PROBE_OUT'], 'w'))",
)

# What the plugin may add to a kernel's environment (docs/notebooks.md), and what differs
# between any two runs.
PLUGIN_ENV = {"CT_BATCH_SIZE", "CT_MAX_FEATURE_NODES", "CT_NOTEBOOK_VRAM_FILE"}
ALLOCATOR_ENV = {"PYTORCH_CUDA_ALLOC_CONF"}
PER_RUN_ENV = {"JPY_PARENT_PID", "PYTEST_CURRENT_TEST", "PROBE_OUT"}


def test_a_notebook_with_nothing_to_receive_runs_as_under_nbmake_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No injected cell (none written by --overwrite, execution counts unchanged), the
    kernel's own matplotlib backend (figures stay in the outputs), the project's IPython
    profile and start-up files, no warning (-W error), no environment change beyond the
    documented CT_* variables and the allocator default."""
    ipython_dir = pytester.path / "ipython"
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-project.py").write_text(
        "def project_helper():\n    return 'from the project profile'\n"
    )
    # The profile's own exec_files and exec_lines (a list on the kernel's command line would
    # replace them).
    (ipython_dir / "exec_me.py").write_text("profile_exec_file = 'ran'\n")
    (ipython_dir / "profile_default" / "ipython_kernel_config.py").write_text(
        f"c.IPKernelApp.exec_files = [{str(ipython_dir / 'exec_me.py')!r}]\n"
        "c.IPKernelApp.exec_lines = ['profile_exec_line = 1']\n"
    )
    monkeypatch.setenv("IPYTHONDIR", str(ipython_dir))
    runs = {}
    # The plugin asked for (an option that changes nothing here), so that it runs the notebook.
    for name, extra in (("alone", ["-p", "no:ctresources"]), ("plugin", ["--ct-no-leases"])):
        path = write(pytester.path / name / "probe.ipynb", notebook(*PROBE_CELLS))
        monkeypatch.setenv("PROBE_OUT", str(pytester.path / f"{name}.json"))
        result = pytester.runpytest_subprocess(
            "--nbmake", "--overwrite", "-W", "error", name, *extra
        )
        result.assert_outcomes(passed=1)
        assert "NotebookWarning" not in result.stdout.str()
        runs[name] = (
            nbformat.read(path, as_version=4),
            json.loads((pytester.path / f"{name}.json").read_text()),
        )
    (alone_nb, alone), (plugin_nb, plugin) = runs["alone"], runs["plugin"]
    assert not injected_cells(pytester.path / "plugin" / "probe.ipynb")
    assert [c.execution_count for c in plugin_nb.cells] == [1, 2, 3]
    assert [c.execution_count for c in alone_nb.cells] == [1, 2, 3]
    figure_outputs = [o for o in plugin_nb.cells[0].outputs if "image/png" in o.get("data", {})]
    assert len(figure_outputs) == 1
    assert plugin["backend"] == alone["backend"] == "module://matplotlib_inline.backend_inline"
    assert plugin["names"] == alone["names"]  # the start-up file leaves no name behind
    added = set(plugin["env"]) - set(alone["env"])
    assert added <= PLUGIN_ENV | ALLOCATOR_ENV, added
    assert not set(alone["env"]) - set(plugin["env"])
    changed = {
        key
        for key in set(alone["env"]) & set(plugin["env"])
        if alone["env"][key] != plugin["env"][key]
    }
    assert changed <= PER_RUN_ENV, changed
    assert plugin["env"]["IPYTHONDIR"] == str(ipython_dir)


def test_overwrite_shows_the_injected_cell(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path / "nb.ipynb", notebook("y = BATCH_SIZE * 2", parameters="BATCH_SIZE = 1")
    )
    pytester.runpytest("--nbmake", "--overwrite", "--ct-batch-size", "8").assert_outcomes(passed=1)
    cells = nbformat.read(path, as_version=4).cells
    assert cells[1].metadata["tags"] == [INJECTED_TAG]
    assert "BATCH_SIZE = 8" in cells[1].source


def test_overwrite_twice_keeps_one_injected_cell(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path / "nb.ipynb",
        notebook("assert BATCH_SIZE in (8, 16)", parameters="BATCH_SIZE = 1"),
    )
    pytester.runpytest("--nbmake", "--overwrite", "--ct-batch-size", "8").assert_outcomes(passed=1)
    write(pytester.path / "check.ipynb", notebook("assert BATCH_SIZE == 16"))  # the new value wins
    pytester.runpytest("--nbmake", "--overwrite", "--ct-batch-size", "16").assert_outcomes(passed=2)
    (injected,) = injected_cells(path)
    assert "BATCH_SIZE = 16" in injected.source


def test_a_planted_symlink_is_never_written_through(pytester: pytest.Pytester) -> None:
    """A link planted where the injected copy was written: it went to the predictable
    ``.{stem}.ctresources-{pid}.ipynb-run`` beside the notebook, through whatever link was
    there. The copy now runs from memory. (In-process, so the pid is this process's.)"""
    write(
        pytester.path / "nb.ipynb", notebook("assert BATCH_SIZE == 3", parameters="BATCH_SIZE = 1")
    )
    victim = pytester.path / "victim.txt"
    victim.write_text("precious")
    link = pytester.path / f".nb.ctresources-{os.getpid()}.ipynb-run"
    link.symlink_to(victim)
    pytester.runpytest_inprocess("--nbmake", "nb.ipynb", "--ct-batch-size", "3").assert_outcomes(
        passed=1
    )
    assert victim.read_text() == "precious"
    assert link.is_symlink() and link.resolve() == victim  # left as it was


def test_nbmake_loaded_by_module_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # -p or PYTEST_PLUGINS register nbmake as "nbmake.pytest_plugin", not "nbmake".
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    write(pytester.path / "nb.ipynb", notebook("assert BATCH_SIZE == 3"))
    result = pytester.runpytest_subprocess(
        "-p",
        "nbmake.pytest_plugin",
        "-p",
        "pytest_ctresources.plugin",
        "--nbmake",
        "--ct-batch-size",
        "3",
    )
    result.assert_outcomes(passed=1)


def test_relative_ct_config_reaches_the_kernel(pytester: pytest.Pytester) -> None:
    (pytester.path / "configs").mkdir()
    (pytester.path / "configs" / "exp.yaml").write_text("BATCH_SIZE: 4\n")
    write(
        pytester.path / "notebooks" / "nb.ipynb",
        notebook(
            "import os, yaml\n"
            "assert yaml.safe_load(open(os.environ['CT_CONFIG']))['BATCH_SIZE'] == BATCH_SIZE == 4"
        ),
    )
    pytester.runpytest("--nbmake", "--ct-config", "configs/exp.yaml", "notebooks").assert_outcomes(
        passed=1
    )


def test_no_parameters_cell_is_said(pytester: pytest.Pytester) -> None:
    """A session-wide value reaching a notebook with no parameters cell: a warning, and the
    summary says the values were injected at the top."""
    write(pytester.path / "plain.ipynb", notebook("assert BATCH_SIZE == 5"))
    result = pytester.runpytest("--nbmake", "--ct-batch-size", "5", "-v")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*NotebookWarning: plain.ipynb has no cell tagged 'parameters'*",
            "  plain.ipynb::plain.ipynb: BATCH_SIZE=5 (--ct-batch-size)"
            " [injected at the top: the notebook may have overwritten them]",
        ]
    )


def test_config_notebook_without_parameters_cell_fails_at_setup(
    pytester: pytest.Pytester,
) -> None:
    """The notebook's own assignment would overwrite the config's value while the reports
    said it ran with it: the item fails at setup, in one line naming the notebook and the
    config and what to do."""
    write(
        pytester.path / "plain.ipynb",
        notebook("PROMPT = 'default prompt'", "print('PROMPT is', PROMPT)"),
    )
    pytester.makefile(".yaml", exp="NOTEBOOK: plain.ipynb\nPARAMS:\n  PROMPT: injected prompt\n")
    pytester.makeini("[pytest]\nct_notebook_configs = exp.yaml\n")
    result = pytester.runpytest("--nbmake", "exp.yaml", "-rA", "--ct-report-json", "r.json")
    result.assert_outcomes(errors=1)
    message = (
        "plain.ipynb (the NOTEBOOK of exp.yaml) receives PROMPT but has no cell tagged "
        "'parameters', so its own assignments could overwrite them: tag the cell that sets "
        "them 'parameters', or set the ini key ct_notebook_inject = top to inject them at the "
        "top (papermill's behaviour)"
    )
    assert message in result.stdout.lines  # the error, in one line
    (line,) = summary_lines(result)
    assert line.startswith("ERROR exp.yaml::plain.ipynb - Failed: plain.ipynb (the NOTEBOOK of")
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["notebook_values"] == {}  # nothing ran, nothing is said to have been used


def test_inject_top_opt_in_says_so(pytester: pytest.Pytester) -> None:
    """ct_notebook_inject = top: papermill's behaviour; the notebook overwrites the value, and
    the summary and the JSON report say the value was injected at the top."""
    write(
        pytester.path / "plain.ipynb",
        notebook("PROMPT = 'default prompt'", "assert PROMPT == 'default prompt'"),
    )
    pytester.makefile(".yaml", exp="NOTEBOOK: plain.ipynb\nPARAMS:\n  PROMPT: injected prompt\n")
    pytester.makeini("[pytest]\nct_notebook_configs = exp.yaml\nct_notebook_inject = top\n")
    result = pytester.runpytest("--nbmake", "exp.yaml", "-v", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=1)  # asked for: no warning
    result.stdout.fnmatch_lines(
        [
            "  exp.yaml::plain.ipynb: PROMPT='injected prompt' (PARAMS in exp.yaml)"
            " [injected at the top: the notebook may have overwritten them]"
        ]
    )
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["notebook_values"] == {
        "exp.yaml::plain.ipynb": [
            {
                "name": "PROMPT",
                "value": "'injected prompt'",
                "source": "PARAMS in exp.yaml",
                "injected": "top",
            }
        ]
    }


@pytest.mark.parametrize("how", ["-W error", "filterwarnings = error"])
def test_warnings_made_errors_fail_in_one_line(pytester: pytest.Pytester, how: str) -> None:
    """Under -W error a notebook without a parameters cell that receives values fails in one
    line naming it, not as an NBMAKE INTERNAL ERROR; one with a parameters cell passes."""
    write(pytester.path / "plain.ipynb", notebook("x = 1"))
    write(pytester.path / "tagged.ipynb", notebook("x = 1", parameters="BATCH_SIZE = 1"))
    ini = "[pytest]\n"
    args = ["--nbmake", "-p", "no:randomly", "--ct-batch-size", "5"]
    if how == "-W error":
        args += ["-W", "error"]
    else:
        ini += "filterwarnings =\n    error\n"
    pytester.makeini(ini)
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1, failed=1)
    message = (
        "NotebookWarning: plain.ipynb has no cell tagged 'parameters': the injected parameters"
        " run first (the notebook may overwrite them)"
    )
    assert message in result.stdout.lines  # the failure, in one line
    assert summary_lines(result) == [f"FAILED plain.ipynb::plain.ipynb - {message}"]
    assert "INTERNAL ERROR" not in result.stdout.str()
    assert "Traceback" not in result.stdout.str()


def test_a_notebook_config_without_nbmake_says_to_add_it(pytester: pytest.Pytester) -> None:
    write(pytester.path / "nb.ipynb", notebook("x = 1"))
    pytester.makefile(".yaml", exp="NOTEBOOK: nb.ipynb\nBATCH_SIZE: 4\n")
    pytester.makeini("[pytest]\nct_notebook_configs = exp.yaml\n")
    result = pytester.runpytest("exp.yaml")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "exp.yaml names a NOTEBOOK: notebook configs run under nbmake: add --nbmake "
            "(pip install nbmake, if it is not installed)"
        ]
    )
    assert "found no collectors" not in result.stdout.str() + result.stderr.str()


def test_unlisted_notebook_configs_are_named_when_nothing_ran(pytester: pytest.Pytester) -> None:
    (pytester.path / "configs").mkdir()
    for name in ("a", "b"):
        (pytester.path / "configs" / f"{name}.yaml").write_text("NOTEBOOK: nb.ipynb\n")
    (pytester.path / "configs" / "other.yaml").write_text("BATCH_SIZE: 4\n")  # no NOTEBOOK
    pytester.makeini("[pytest]\nct_batch_size = 4\n")
    result = pytester.runpytest("--nbmake", "configs")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    hint = (
        "ctresources: configs/a.yaml, configs/b.yaml name a NOTEBOOK but are not listed in the "
        "ini key ct_notebook_configs: list them there (files, folders, globs), or name them on "
        "the command line, to run them"
    )
    assert hint in result.stdout.lines


def test_one_item_per_experiment_config_that_is_ours(pytester: pytest.Pytester) -> None:
    write(
        pytester.path / "notebooks" / "exp.ipynb",
        notebook(
            "assert PROMPT.startswith('the') and MAX_FEATURE_NODES < 100",
            parameters="PROMPT = ''\nMAX_FEATURE_NODES = 8192",
        ),
    )
    configs = pytester.path / "configs"
    configs.mkdir()
    for name, nodes in (("small", 10), ("large", 50)):
        (configs / f"{name}.yaml").write_text(
            f"NOTEBOOK: ../notebooks/exp.ipynb\nMAX_FEATURE_NODES: {nodes}\nPARAMS:\n  PROMPT: the {name}\n"
        )
    (configs / "no_notebook.yaml").write_text("BATCH_SIZE: 3\n")  # not an item
    # Some other tool's YAML with a NOTEBOOK line: not ours unless listed or named.
    (pytester.path / "pipeline").mkdir()
    (pytester.path / "pipeline" / "job.yaml").write_text("NOTEBOOK: x.ipynb\nTITLE: report\n")
    pytester.makeini("[pytest]\nct_notebook_configs = configs\n")
    result = pytester.runpytest("--nbmake", "configs", "pipeline", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["configs/large.yaml::exp.ipynb PASSED*", "configs/small.yaml::exp.ipynb PASSED*"]
    )
    result = pytester.runpytest("--nbmake", "configs", "-k", "small")
    result.assert_outcomes(passed=1, deselected=1)
    # An item's own config is its marker: it beats a session-wide option.
    result = pytester.runpytest("--nbmake", "configs", "--ct-max-feature-nodes", "500", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "2 test(s) keep their own max_feature_nodes over --ct-max-feature-nodes 500",
            # A notebook-only run ends with the values each item ran with, and their source.
            "notebook items ran with (injected; the rest as each notebook sets it):",
            "  configs/large.yaml::exp.ipynb: MAX_FEATURE_NODES=50 (configs/large.yaml);"
            " PROMPT='the large' (PARAMS in configs/large.yaml)",
            "  configs/small.yaml::exp.ipynb: MAX_FEATURE_NODES=10 (configs/small.yaml);"
            " PROMPT='the small' (PARAMS in configs/small.yaml)",
        ]
    )
    # Under xdist each worker reads the ini key and collects the same items; the values
    # reach the controller's report.
    result = pytester.runpytest(
        "--nbmake",
        "configs",
        "pipeline",
        "-n",
        "2",
        "--ct-batch-size",
        "7",
        "--ct-report-json",
        "r.json",
    )
    result.assert_outcomes(passed=2)
    values = json.loads((pytester.path / "r.json").read_text())["notebook_values"]
    assert values["configs/small.yaml::exp.ipynb"] == [
        {"name": name, "value": value, "source": source, "injected": AFTER_PARAMETERS}
        for name, value, source in (
            ("BATCH_SIZE", "7", "--ct-batch-size"),
            ("MAX_FEATURE_NODES", "10", "configs/small.yaml"),
            ("PROMPT", "'the small'", "PARAMS in configs/small.yaml"),
        )
    ]

    # Named on the command line, a YAML file is taken to be ours (as pytest collects a test
    # file named there whatever python_files says), and checked as ours.
    result = pytester.runpytest("--nbmake", "pipeline/job.yaml")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pipeline/job.yaml: unknown key 'TITLE'*"])


def test_metadata_marks_select_and_vram_skips(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    write(pytester.path / "slow.ipynb", notebook("x = 1", metadata={"marks": ["slow"]}))
    write(pytester.path / "big.ipynb", notebook("x = 1", metadata={"vram_gib": 40}))
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    result = pytester.runpytest("--nbmake", "-m", "not slow", "-rs")
    result.assert_outcomes(skipped=1, deselected=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [1] big.ipynb: needs 40.0 GiB VRAM; GPU 0 (NVIDIA GeForce RTX 4090) has 23.6 GiB"]
    )
    pytester.runpytest("--nbmake", "-m", "slow").assert_outcomes(passed=1, deselected=1)


def test_config_vram_gib_skips_a_notebook(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=8")
    write(pytester.path / "nb.ipynb", notebook("x = 1"))
    (pytester.path / "exp.yaml").write_text("NOTEBOOK: nb.ipynb\nVRAM_GIB: 20\n")
    result = pytester.runpytest("--nbmake", "exp.yaml", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs 20.0 GiB VRAM (VRAM_GIB in *exp.yaml); GPU 0 (Card) has 8.0 GiB"]
    )


def test_failures_stay_contained(pytester: pytest.Pytester) -> None:
    write(pytester.path / "a_bad_metadata.ipynb", notebook("x = 1", metadata={"vram_gib": "lots"}))
    write(pytester.path / "b_dies.ipynb", notebook("import os\nos._exit(1)"))
    write(pytester.path / "c_fine.ipynb", notebook("x = 1"))
    (pytester.path / "d_bad.yaml").write_text("NOTEBOOK: c_fine.ipynb\nBATCH_SIZE: big\n")
    write(
        pytester.path / "e_unregistered_mark.ipynb",
        notebook("x = 1", metadata={"marks": ["slowish"]}),
    )
    (pytester.path / "f_missing.yaml").write_text("NOTEBOOK: nothere.ipynb\n")
    # pytest refuses a mark name starting with "_": it was an INTERNALERROR.
    write(pytester.path / "g_private_mark.ipynb", notebook("x = 1", metadata={"marks": ["_p"]}))
    pytester.makeini("[pytest]\nct_notebook_configs =\n    d_bad.yaml\n    f_missing.yaml\n")
    result = pytester.runpytest("--nbmake", "-p", "no:randomly", "--strict-markers")
    result.assert_outcomes(passed=1, failed=1, errors=5)
    result.stdout.fnmatch_lines(
        [
            "*a_bad_metadata.ipynb: metadata 'ctresources.vram_gib' must be a positive number, got 'lots'",
            "*d_bad.yaml: BATCH_SIZE must be a positive integer or 'auto', got 'big'",
            "*e_unregistered_mark.ipynb: metadata 'ctresources.marks': 'slowish' not found in "
            "`markers` configuration option*",
            "*f_missing.yaml: NOTEBOOK names nothere.ipynb, which is not a file",
            "*the kernel running *b_dies.ipynb died*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*g_private_mark.ipynb: metadata 'ctresources.marks' must be a list of mark names, *"]
    )
    output = result.stdout.str()
    assert "INTERNAL ERROR" not in output and "Traceback" not in output


def test_unreadable_notebooks_fail_as_under_nbmake_alone(pytester: pytest.Pytester) -> None:
    (pytester.path / "not_json.ipynb").write_text("invalid json")
    (pytester.path / "not_a_notebook.ipynb").write_text("[]")
    summaries = {}
    for name, extra in (("alone", ["-p", "no:ctresources"]), ("plugin", [])):
        result = pytester.runpytest("--nbmake", "-p", "no:randomly", "-rf", *extra)
        result.assert_outcomes(failed=2)
        summaries[name] = summary_lines(result)
        assert "This file is not a valid json document" in result.stdout.lines
    assert summaries["plugin"] == summaries["alone"]
    assert summaries["plugin"] == [
        "FAILED not_a_notebook.ipynb::not_a_notebook.ipynb - NBMAKE INTERNAL ERROR",
        "FAILED not_json.ipynb::not_json.ipynb - Notebook does not appear to be JSON: 'invalid json'",
    ]


def test_nbmake_notebook_metadata_works_as_without_the_plugin(pytester: pytest.Pytester) -> None:
    """The runner is nbmake's, with the kernel started the plugin's way (the project asks, so
    the plugin runs every notebook): cell mocks, post-cell code, allow_errors and timeout
    metadata, and failure summaries are nbmake's."""
    mock = notebook("answer = 0\nname = ''", "assert (answer, name) == (42, 'x')")
    mock.cells[0].metadata["nbmake"] = {"mock": {"answer": 42, "name": "x"}}
    write(pytester.path / "mock.ipynb", mock)
    post = notebook("y = 0", "assert y == 3")
    post.cells[0].metadata["nbmake"] = {"post_cell_execute": ["y = 3"]}
    write(pytester.path / "post.ipynb", post)
    write(
        pytester.path / "allowed.ipynb",
        notebook("raise ValueError('fine')", nb_metadata={"execution": {"allow_errors": True}}),
    )
    write(
        pytester.path / "slow.ipynb",
        # The plugin waits for a kernel to start as long as the cell timeout (at most 60 s),
        # nbmake alone 60 s: 20 s, so that a kernel slow to start on a loaded machine (under a
        # second idle) still reaches the cell that times out in both runs.
        notebook("import time\ntime.sleep(600)", nb_metadata={"execution": {"timeout": 20}}),
    )
    write(pytester.path / "failing.ipynb", notebook("x = 1", "raise ValueError('boom')"))
    pytester.makeconftest(
        "def pytest_report_collectionfinish(items):\n"
        "    kinds = {type(item).__name__ for item in items}\n"
        "    return [f'items: {kind} x{len(items)}' for kind in sorted(kinds)]\n"
    )
    summaries = {}
    for name, extra in (("alone", ["-p", "no:ctresources"]), ("plugin", ["-o", "ct_cleanup=auto"])):
        result = pytester.runpytest("--nbmake", "-p", "no:randomly", "-rA", *extra)
        result.assert_outcomes(passed=3, failed=2)
        summaries[name] = summary_lines(result)
        # Which items ran the notebooks: nbmake's alone, the plugin's where it acts.
        kinds = {"alone": "NotebookItem", "plugin": "CtNotebookItem"}
        result.stdout.fnmatch_lines([f"items: {kinds[name]} x5"])
    assert summaries["plugin"] == summaries["alone"]
    assert any(
        "failing.ipynb" in line and "ValueError: boom" in line for line in summaries["plugin"]
    )
    assert any("slow.ipynb" in line and "timed out" in line for line in summaries["plugin"])


def test_configs_run_no_code(pytester: pytest.Pytester) -> None:
    """Attacks through PARAMS: keys that are code, and a key that overrides a
    validated setting, each fail their item in one line naming the file and the key; values
    reach the notebook as the literals they are."""
    write(
        pytester.path / "nb.ipynb",
        notebook(
            "assert TEXT == 'it\\'s \"q\"\\nline2', repr(TEXT)\n"
            "assert BIG == float('inf') and NESTED == {'a': [1, 2, {'b': None}]}\n"
            "assert BATCH_SIZE == 16",
            parameters="TEXT = ''\nBIG = 0\nNESTED = {}\nBATCH_SIZE = 1",
        ),
    )
    pytester.makefile(
        ".yaml",
        attack_newline="NOTEBOOK: nb.ipynb\n"
        "PARAMS: {\"x = 1\\nimport os; os.system('touch pwned')\\ny\": 1}\n",
        attack_globals="NOTEBOOK: nb.ipynb\n"
        "PARAMS: {\"globals()[__import__('os').system('touch pwned2')]\": 1}\n",
        shadow="NOTEBOOK: nb.ipynb\nBATCH_SIZE: 16\nPARAMS: {BATCH_SIZE: -1}\n",
        good="NOTEBOOK: nb.ipynb\nBATCH_SIZE: 16\n"
        'PARAMS:\n  TEXT: "it\'s \\"q\\"\\nline2"\n  BIG: .inf\n  NESTED: {a: [1, 2, {b: null}]}\n',
    )
    names = ["attack_newline.yaml", "attack_globals.yaml", "shadow.yaml", "good.yaml"]
    result = pytester.runpytest("--nbmake", "-p", "no:randomly", *names)
    result.assert_outcomes(passed=1, errors=3)
    output = result.stdout.str()
    assert (
        "attack_newline.yaml: PARAMS key \"x = 1\\nimport os; os.system('touch pwned')\\ny\" "
        "is not a name a notebook variable can have" in output
    )
    assert (
        "attack_globals.yaml: PARAMS key \"globals()[__import__('os').system('touch pwned2')]\" "
        "is not a name" in output
    )
    assert "shadow.yaml: PARAMS key 'BATCH_SIZE' would override the setting BATCH_SIZE" in output
    assert "Traceback" not in output
    # The session's own config is checked the same way, for every notebook it reaches.
    result = pytester.runpytest("--nbmake", "nb.ipynb", "--ct-config", "attack_globals.yaml")
    result.assert_outcomes(errors=1)
    assert "attack_globals.yaml: PARAMS key" in result.stdout.str()
    assert not list(pytester.path.glob("pwned*"))


def test_parallel_notebooks_do_not_collide(pytester: pytest.Pytester) -> None:
    # nbmake#129: kernels on TCP ports race under xdist; ours use IPC sockets, each kernel in
    # a directory of its own. Each kernel writes the connection it was started on (the file
    # jupyter_client wrote and the kernel bound): a TCP fallback fails here, not only when a
    # port race happens to strike, so one run of overlapping kernels is enough.
    for index in range(6):
        write(
            pytester.path / f"nb{index}.ipynb",
            notebook(
                "import json, time\n"
                "from ipykernel.connect import get_connection_info\n"
                "info = get_connection_info(unpack=True)\n"
                f"json.dump([info['transport'], info['ip']], open('kernel-{index}.json', 'w'))\n"
                "time.sleep(0.2)"
            ),
        )
    # Asked for (--ct-no-leases), so that the plugin starts the kernels: a project that does
    # not ask gets nbmake's own, on TCP.
    pytester.runpytest("--nbmake", "-n", "2", "--ct-no-leases").assert_outcomes(passed=6)
    kernels = [json.loads((pytester.path / f"kernel-{i}.json").read_text()) for i in range(6)]
    assert {transport for transport, _ in kernels} == {"ipc"}, kernels
    assert len({ip for _, ip in kernels}) == 6, kernels  # no two kernels share sockets


def test_kernel_figures_reach_the_report(pytester: pytest.Pytester) -> None:
    # CPU stand-in for a kernel that used CUDA: the start-up file's report, written by hand,
    # must come back as the notebook's figures in the JSON report (the GPU run does it live).
    write(
        pytester.path / "nb.ipynb",
        notebook(
            "import json, os\n"
            "json.dump({'device': 0, 'peak_allocated_bytes': 3 * 2**30, 'peak_reserved_bytes': 4 * 2**30}"
            ", open(os.environ['CT_NOTEBOOK_VRAM_FILE'], 'w'))"
        ),
    )
    pytester.runpytest("--nbmake", "--ct-report-json", "r.json").assert_outcomes(passed=1)
    (record,) = json.loads((pytester.path / "r.json").read_text())["tests"]
    assert record["nodeid"] == "nb.ipynb::nb.ipynb"
    assert record["peak_allocated_bytes"] == 3 * 2**30


def test_capacity_reaches_the_kernel(pytester: pytest.Pytester) -> None:
    # The kernel's start-up file arms the same allocator cap as the pytest process: with a
    # cap set, torch is imported at kernel start (CUDA is not initialised; the GPU test
    # shows the cap binding inside the kernel).
    write(
        pytester.path / "nb.ipynb",
        notebook(
            "import os, sys\n"
            "assert os.environ['CT_VRAM_CAPACITY'] == '8.0', os.environ.get('CT_VRAM_CAPACITY')\n"
            "assert 'torch' in sys.modules\n"
            "assert not sys.modules['torch'].cuda.is_initialized()"
        ),
    )
    pytester.runpytest_subprocess("--nbmake", "--ct-vram-capacity", "8").assert_outcomes(passed=1)
    pytester.runpytest("--nbmake").assert_outcomes(failed=1)  # no cap: nothing to arm


def test_strict_fails_an_under_declared_notebook(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPU stand-in for a kernel peak of 5 GiB against a declared 1 GiB (as in
    # test_kernel_figures_reach_the_report).
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    write(
        pytester.path / "nb.ipynb",
        notebook(
            "import json, os\n"
            "json.dump({'device': 0, 'peak_allocated_bytes': 5 * 2**30, 'peak_reserved_bytes': 5 * 2**30}"
            ", open(os.environ['CT_NOTEBOOK_VRAM_FILE'], 'w'))",
            metadata={"vram_gib": 1},
        ),
    )
    result = pytester.runpytest("--nbmake", "--ct-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*UNDER-DECLARED: peak 5.00 GiB reserved exceeds the declared 1.0 GiB*"
            '"ctresources": {"vram_gib": 5} in the notebook\'s metadata*'
        ]
    )


def test_auto_batch_size_is_resolved_before_the_kernel_starts(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook passes BATCH_SIZE to attribute() itself: auto becomes a number first, from
    the estimate of its configured model, within what the GPU has free (other processes'
    memory counts) or, without one, the host's available memory."""
    from pytest_ctresources.estimator.auto import Budget, choose_from_config, kernel_room

    write(
        pytester.path / "nb.ipynb",
        notebook("print('BATCH', BATCH_SIZE)\nassert BATCH_SIZE > 1", parameters="BATCH_SIZE = 1"),
    )
    pytester.makefile(
        ".yaml",
        gemma="MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: gemma\nDTYPE: bfloat16\nBATCH_SIZE: auto\n",
        other="MODEL_NAME: someone/unknown\nTRANSCODER_SET: gemma\nBATCH_SIZE: auto\n",
    )
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    # -vv: the summary says each auto choice with its reasons.
    result = pytester.runpytest("--nbmake", "--ct-config", "gemma.yaml", "-p", "no:randomly", "-vv")
    result.assert_outcomes(passed=1)
    cfg = CircuitTracerConfig.defaults().layered(
        {
            "model_name": "google/gemma-2-2b",
            "transcoder_set": "gemma",
            "dtype": "bfloat16",
            "batch_size": "auto",
        },
        Source.default(),
    )
    choice = choose_from_config(cfg, Budget(24.0, "GPU 0 (Card)", 0.05), 32)
    assert choice is not None and 1 < choice.batch_size < 512
    result.stdout.fnmatch_lines(
        [
            f"  nb.ipynb::nb.ipynb: auto batch size {choice.batch_size} (32 prompt tokens, * estimated before the kernel starts*"
        ]
    )
    # Another process holds 6 GiB of the card: the kernel gets what is free, not the card.
    monkeypatch.setenv("CT_FAKE_GPUS_USED", "6")
    monkeypatch.setenv("COLUMNS", "600")  # the choice's line, unfolded
    result = pytester.runpytest("--nbmake", "--ct-config", "gemma.yaml", "-p", "no:randomly", "-vv")
    result.assert_outcomes(passed=1)
    squeezed = choose_from_config(
        cfg,
        Budget(24.0, "GPU 0 (Card)", 0.05),
        32,
        room=kernel_room(18 * 2**30, Budget(24.0, "GPU 0 (Card)", 0.05)),
    )
    assert squeezed is not None and 1 < squeezed.batch_size < choice.batch_size
    result.stdout.fnmatch_lines(
        [
            f"  nb.ipynb::nb.ipynb: auto batch size {squeezed.batch_size} (32 prompt tokens, "
            "* room 17.1 GiB = 18.0 GiB free on the device (NVML: other processes' memory "
            "counts) less 5% margin)"
        ]
    )
    monkeypatch.delenv("CT_FAKE_GPUS_USED")
    # Without a GPU: the host's available memory (the kernel runs on this host).
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    result = pytester.runpytest(
        "--nbmake", "--ct-config", "gemma.yaml", "--ct-batch-size-max", "24", "-vv"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "  nb.ipynb::nb.ipynb: auto batch size * (32 prompt tokens, * it fits the host's "
            "available memory, * GiB (*) less 5% margin*"
        ]
    )
    # On a GPU, a model the estimator does not know was an NBMAKE INTERNAL ERROR
    # with a traceback; it is one line.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    result = pytester.runpytest("--nbmake", "--ct-config", "other.yaml")
    result.assert_outcomes(failed=1)
    (line,) = summary_lines(result)
    assert line.startswith(
        "FAILED nb.ipynb::nb.ipynb - nb.ipynb: batch_size 'auto' (BATCH_SIZE in other.yaml) "
        "needs a model and transcoder set the estimator knows, and 'someone/unknown' with "
        "'gemma' is not one"
    )
    output = result.stdout.str()
    assert "INTERNAL ERROR" not in output and "Traceback" not in output
    assert "pytest_ctresources/" not in output  # no frame of the plugin's code
