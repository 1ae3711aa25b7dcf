"""``ct-resources`` basics: ``--version``, ``models`` (and transcoder sets) from the offline
registry, ``table --model``."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from pytest_ctresources.estimator import cli, cli_models, registry
from pytest_ctresources.estimator.cli_models import ModelsError, table_pairs


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:  # argparse's --version and errors
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_version_names_the_distribution_and_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    status, out, _ = run(capsys, "--version")
    assert status == 0
    assert out == f"ct-resources (pytest-ctresources {version('pytest-ctresources')})\n"


def test_models_lists_every_registry_model_and_transcoder_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "models")
    assert status == 0
    lines = out.splitlines()
    for name in registry.known_models():
        assert any(line.startswith(name + " ") for line in lines), name
    for name in registry.TRANSCODER_SETS:
        assert any(line.startswith(name) for line in lines), name
    gemma = next(line for line in lines if line.startswith("google/gemma-2-2b "))
    assert gemma.split() == ["google/gemma-2-2b", "gemma2", "26", "2304", "2.6B", "gemma"]
    assert any(line.startswith("mwhanna/gemma-scope-transcoders (gemma) ") for line in lines)
    assert "mwhanna/gemma-scope-2-{1b,4b,12b}-{pt,it}" in out
    # The registry's own models before the bundled random ones.
    names = [line.split()[0] for line in lines[2:] if "/" in line.partition(" ")[0]]
    assert names.index("google/gemma-2-2b") < names.index("ctresources/tiny-gemma-2")


def test_models_json_is_one_object_with_models_and_sets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "models", "--json")
    assert status == 0
    payload = json.loads(out)
    by_name = {model["name"]: model for model in payload["models"]}
    assert set(by_name) == set(registry.known_models())
    assert by_name["google/gemma-2-2b"]["usual_transcoder_set"] == "gemma"
    assert by_name["google/gemma-2-9b"]["usual_transcoder_set"] is None
    assert by_name["ctresources/tiny-gemma-2"]["bundled"] is True
    sets = {entry["name"]: entry for entry in payload["transcoder_sets"]}
    assert sets["mwhanna/gemma-scope-transcoders"]["aliases"] == ["gemma"]
    assert sets["mntss/clt-gemma-2-2b-426k"]["cross_layer"] is True


def test_table_for_one_model_prints_its_rows_only(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "table", "--model", "gemma-2-2b", "--cards", "24", "--dtypes", "bf16"
    )
    assert status == 0
    rows = out.splitlines()[2:]
    assert rows and all(row.startswith("| google/gemma-2-2b | ") for row in rows)
    # Both of circuit-tracer's example sets for it: the transcoders and the 426k CLT.
    assert {row.split(" | ")[1] for row in rows} == {"gemma", "mntss/clt-gemma-2-2b-426k"}
    status, out, _ = run(
        capsys, "table", "--model", "tiny-gemma-2", "--cards", "24", "--dtypes", "float32"
    )
    assert status == 0
    assert out.splitlines()[2].startswith(
        "| ctresources/tiny-gemma-2 | ctresources/random-jumprelu |"
    )


def test_table_with_a_set_for_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "table",
        "--model",
        "gemma-3-4b-it",
        "--transcoders",
        "width_16k_l0_small",
        "--cards",
        "24",
        "--dtypes",
        "bf16",
        "--prompt-tokens",
        "32",
    )
    assert status == 0
    (row,) = out.splitlines()[2:]
    assert row.startswith("| google/gemma-3-4b-it | width_16k_l0_small | ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--model", "gemma-9"),
            "argument --model: unknown model 'gemma-9' (nearest: google/gemma-2-9b,",
        ),
        (
            ("--model", "gemma-2-9b"),
            "argument --model: no usual transcoder set for google/gemma-2-9b",
        ),
        (
            ("--model", "qwen3-4b", "--transcoders", "426k"),
            "argument --transcoders: transcoder set mntss/clt-gemma-2-2b-426k was made for "
            "google/gemma-2-2b",
        ),
        (("--transcoders", "gemma"), "--transcoders needs --model"),
    ],
)
def test_table_refuses_a_name_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    status, out, err = run(capsys, "table", *argv)
    assert status == 2 and out == ""
    assert err.startswith(f"ct-resources: error: {message}") and err.count("\n") == 1, err


def test_table_pairs_without_a_model_are_the_examples() -> None:
    examples = [("google/gemma-2-2b", "gemma")]
    assert table_pairs(argparse.Namespace(model=None, transcoders=None), examples) == examples
    with pytest.raises(ModelsError):
        table_pairs(argparse.Namespace(model="no-such-model-at-all", transcoders=None), examples)


def test_models_text_is_columns(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert cli_models.run_models(argparse.Namespace(json=False), out) == 0
    header = out.getvalue().splitlines()[1]
    assert header.split() == ["name", "family", "layers", "d_model", "parameters", "usual", "set"]


def test_the_pages_excerpt_of_models_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "estimator-cli.md").read_text()
    start = page.index("`ct-resources models` lists")
    block = page[
        page.index("```text\n", start) + len("```text\n") : page.index(
            "  ```\n", page.index("```text\n", start) + 8
        )
    ]
    excerpt = [line.removeprefix("  ") for line in block.splitlines()]
    _, out, _ = run(capsys, "models")
    assert excerpt and all(line in out.splitlines() for line in excerpt), excerpt
