"""Notebooks through nbmake: settings in the kernel, injected parameters, one item per
experiment config, marks and VRAM needs from metadata, contained failures, xdist."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pytest_ctresources.config import CircuitTracerConfig, ConfigError
from pytest_ctresources.notebook_params import (
    INJECTED_TAG,
    inject_parameters,
    injected_values,
    notebook_metadata,
)
from pytest_ctresources.sources import Source

pytest_plugins = ["pytester"]


def notebook(*sources: str, parameters: str | None = None, metadata: dict | None = None):  # type: ignore[no-untyped-def]
    nb = new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    if metadata is not None:
        nb.metadata["ctresources"] = metadata
    if parameters is not None:
        nb.cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb.cells += [new_code_cell(source) for source in sources]
    return nb


def write(path: Path, nb) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


# --- pure parts -----------------------------------------------------------------------------


def test_injected_cell_goes_after_the_parameters_cell() -> None:
    nb = notebook("x = 1", parameters="BATCH_SIZE = 256")
    assert inject_parameters(nb, {"BATCH_SIZE": 64, "PROMPT": "hi"}) is None
    cell = nb.cells[1]
    assert cell.metadata["tags"] == [INJECTED_TAG]
    assert "BATCH_SIZE = 64" in cell.source and "PROMPT = 'hi'" in cell.source


def test_without_parameters_cell_the_injected_cell_goes_first() -> None:
    nb = notebook("x = 1")
    note = inject_parameters(nb, {"BATCH_SIZE": 64})
    assert note is not None and "no cell tagged 'parameters'" in note
    assert nb.cells[0].metadata["tags"] == [INJECTED_TAG]


def test_injected_values_are_the_configured_ones_and_params() -> None:
    cfg = CircuitTracerConfig.defaults().layered(
        {"batch_size": 64}, Source.option("--ct-batch-size"), params={"PROMPT": "p"}
    )
    assert injected_values(cfg) == {"BATCH_SIZE": 64, "PROMPT": "p"}


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


# --- end to end -----------------------------------------------------------------------------

SETTINGS_CELL = """
import os
import matplotlib
assert BATCH_SIZE == 64, BATCH_SIZE
assert os.environ["CT_BATCH_SIZE"] == "64"
assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()
"""


def test_settings_reach_the_kernel_and_parameters_are_injected(pytester: pytest.Pytester) -> None:
    path = write(pytester.path / "nb.ipynb", notebook(SETTINGS_CELL, parameters="BATCH_SIZE = 256"))
    before = path.read_bytes()
    pytester.runpytest_subprocess("--nbmake", "--ct-batch-size", "64").assert_outcomes(passed=1)
    assert path.read_bytes() == before  # the notebook on disk is unchanged
    assert not list(pytester.path.glob(".nb.ctresources-*"))  # no copy left behind
    # The same notebook without the option fails: the assertions above can fail.
    pytester.runpytest_subprocess("--nbmake").assert_outcomes(failed=1)


def test_overwrite_shows_the_injected_cell(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path / "nb.ipynb", notebook("y = BATCH_SIZE * 2", parameters="BATCH_SIZE = 1")
    )
    pytester.runpytest_subprocess(
        "--nbmake", "--overwrite", "--ct-batch-size", "8"
    ).assert_outcomes(passed=1)
    cells = nbformat.read(path, as_version=4).cells
    assert cells[1].metadata["tags"] == [INJECTED_TAG]
    assert "BATCH_SIZE = 8" in cells[1].source


def test_overwrite_twice_keeps_one_injected_cell(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path / "nb.ipynb",
        notebook("assert BATCH_SIZE in (8, 16)", parameters="BATCH_SIZE = 1"),
    )
    pytester.runpytest_subprocess(
        "--nbmake", "--overwrite", "--ct-batch-size", "8"
    ).assert_outcomes(passed=1)
    write(pytester.path / "check.ipynb", notebook("assert BATCH_SIZE == 16"))  # the new value wins
    pytester.runpytest_subprocess(
        "--nbmake", "--overwrite", "--ct-batch-size", "16"
    ).assert_outcomes(passed=2)
    cells = nbformat.read(path, as_version=4).cells
    injected = [cell for cell in cells if INJECTED_TAG in cell.metadata.get("tags", [])]
    assert len(injected) == 1 and "BATCH_SIZE = 16" in injected[0].source


def test_a_left_behind_copy_is_not_collected(pytester: pytest.Pytester) -> None:
    write(pytester.path / "nb.ipynb", notebook("x = 1"))
    pytester.runpytest_subprocess("--nbmake", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    # What a worker killed mid-notebook would leave: never collected as a notebook.
    write(pytester.path / ".nb.ctresources-1234.ipynb-run", notebook("x = 1"))
    pytester.runpytest_subprocess("--nbmake").assert_outcomes(passed=1)


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
    pytester.runpytest_subprocess(
        "--nbmake", "--ct-config", "configs/exp.yaml", "notebooks"
    ).assert_outcomes(passed=1)


def test_no_parameters_cell_is_said(pytester: pytest.Pytester) -> None:
    write(pytester.path / "plain.ipynb", notebook("assert BATCH_SIZE == 5"))
    result = pytester.runpytest_subprocess("--nbmake", "--ct-batch-size", "5")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*NotebookWarning: plain.ipynb has no cell tagged 'parameters'*"])


def test_one_item_per_experiment_config(pytester: pytest.Pytester) -> None:
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
    result = pytester.runpytest_subprocess("--nbmake", "configs", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["configs/large.yaml::exp.ipynb PASSED*", "configs/small.yaml::exp.ipynb PASSED*"]
    )
    result = pytester.runpytest_subprocess("--nbmake", "configs", "-k", "small")
    result.assert_outcomes(passed=1, deselected=1)


def test_metadata_marks_select_and_vram_skips(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    write(pytester.path / "slow.ipynb", notebook("x = 1", metadata={"marks": ["slow"]}))
    write(pytester.path / "big.ipynb", notebook("x = 1", metadata={"vram_gib": 40}))
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    result = pytester.runpytest_subprocess("--nbmake", "-m", "not slow", "-rs")
    result.assert_outcomes(skipped=1, deselected=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [1] big.ipynb: needs 40.0 GiB VRAM; GPU 0 (NVIDIA GeForce RTX 4090) has 23.6 GiB"]
    )
    pytester.runpytest_subprocess("--nbmake", "-m", "slow").assert_outcomes(passed=1, deselected=1)


def test_config_vram_gib_skips_a_notebook(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=8")
    write(pytester.path / "nb.ipynb", notebook("x = 1"))
    (pytester.path / "exp.yaml").write_text("NOTEBOOK: nb.ipynb\nVRAM_GIB: 20\n")
    result = pytester.runpytest_subprocess("--nbmake", "exp.yaml", "-rs")
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
    (pytester.path / "f_not_a_notebook.ipynb").write_text("[]")
    result = pytester.runpytest_subprocess("--nbmake", "-p", "no:randomly", "--strict-markers")
    result.assert_outcomes(passed=1, failed=1, errors=4)
    result.stdout.fnmatch_lines(
        [
            "*a_bad_metadata.ipynb: metadata 'ctresources.vram_gib' must be a positive number, got 'lots'",
            "*d_bad.yaml: BATCH_SIZE must be a positive integer or 'auto', got 'big'",
            "*'slowish' not found in `markers` configuration option*",
            "*f_not_a_notebook.ipynb: not a readable notebook:*",
            "*the kernel running *b_dies.ipynb died*",
        ]
    )


def test_parallel_notebooks_do_not_collide(pytester: pytest.Pytester) -> None:
    # nbmake#129: kernels on TCP ports race under xdist; ours use IPC sockets. Repeated runs.
    for index in range(6):
        write(pytester.path / f"nb{index}.ipynb", notebook("import time\ntime.sleep(0.2)"))
    for _ in range(3):
        pytester.runpytest_subprocess("--nbmake", "-n", "2").assert_outcomes(passed=6)


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
    pytester.runpytest_subprocess("--nbmake", "--ct-report-json", "r.json").assert_outcomes(
        passed=1
    )
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
    pytester.runpytest_subprocess("--nbmake").assert_outcomes(failed=1)


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
    result = pytester.runpytest_subprocess("--nbmake", "--ct-strict")
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
    the estimate of its configured model (on a GPU) or the ceiling (without one)."""
    from pytest_ctresources.autobatch import Budget, choose_from_config

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
    result = pytester.runpytest_subprocess(
        "--nbmake", "--ct-config", "gemma.yaml", "-p", "no:randomly"
    )
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
    # Without a GPU: the ceiling.
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    result = pytester.runpytest_subprocess(
        "--nbmake", "--ct-config", "gemma.yaml", "--ct-batch-size-max", "24"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "  nb.ipynb::nb.ipynb: auto batch size 24 (32 prompt tokens; no CUDA GPU detected: the ceiling 24)"
        ]
    )
    # On a GPU, a model the estimator does not know: one line, no traceback.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    result = pytester.runpytest_subprocess("--nbmake", "--ct-config", "other.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*nb.ipynb: batch_size 'auto' (BATCH_SIZE in other.yaml) needs a model and transcoder set the estimator knows*"
        ]
    )
    assert "Traceback" not in result.stdout.str()
