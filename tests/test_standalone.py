"""CtSession.from_yaml: the plugin's config layering outside pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_ctresources import ConfigError, CtSession
from pytest_ctresources.settings.options import SETTINGS
from pytest_ctresources.settings.standalone import CONFIG_ENV, config_outside_pytest

ROOT = Path(__file__).resolve().parents[1]
YAML = "MODEL_NAME: ctresources/tiny-gemma-2\nBATCH_SIZE: 8\nMAX_FEATURE_NODES: 40\nPARAMS:\n  PROMPT: hi\n"


@pytest.fixture
def experiment(tmp_path: Path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(YAML)
    return path


def test_layers_defaults_yaml_environment_overrides(experiment: Path) -> None:
    env = {"CT_BATCH_SIZE": "16", "CT_DTYPE": "bfloat16"}
    cfg = config_outside_pytest(experiment, {"dtype": "float32"}, env)
    assert (cfg.model_name, cfg.batch_size, cfg.max_feature_nodes, cfg.dtype) == (
        "ctresources/tiny-gemma-2",
        16,
        40,
        "float32",
    )
    assert str(cfg.source_of("model_name")) == f"MODEL_NAME in {experiment}"
    assert str(cfg.source_of("batch_size")) == "env CT_BATCH_SIZE"
    assert str(cfg.source_of("dtype")) == "CtSession.from_yaml(dtype=...)"
    assert str(cfg.source_of("backend")) == "default"
    assert cfg.params == {"PROMPT": "hi"}


def test_without_a_path_ct_config_names_the_file(experiment: Path) -> None:
    assert config_outside_pytest(None, {}, {CONFIG_ENV: str(experiment)}).batch_size == 8
    assert config_outside_pytest(None, {}, {}).batch_size == 256  # the default
    # The same variable as --ct-config's.
    assert [setting.env for setting in SETTINGS if setting.dest == "ct_config"] == [CONFIG_ENV]


@pytest.mark.parametrize(
    ("path", "overrides", "env", "message"),
    [
        (
            None,
            {"batch_sise": 3},
            {},
            "CtSession.from_yaml: unknown field 'batch_sise' (did you mean batch_size?)",
        ),
        (
            None,
            {"batch_size": -3},
            {},
            "CtSession.from_yaml: batch_size must be a positive integer or 'auto', got -3",
        ),
        (
            None,
            {},
            {"CT_BATCH_SIZE": "abc"},
            "env CT_BATCH_SIZE: must be a positive integer or 'auto', got 'abc'",
        ),
        ("missing.yaml", {}, {}, "missing.yaml: cannot read experiment config"),
        (
            None,
            {},
            {"CT_CONFIG": "missing.yaml"},
            "env CT_CONFIG: missing.yaml: cannot read experiment config",
        ),
    ],
)
def test_bad_input_is_one_line_naming_its_source(
    path: str | None, overrides: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_outside_pytest(path, overrides, env)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_from_yaml_reads_the_process_environment(
    experiment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_MAX_FEATURE_NODES", "24")
    session = CtSession.from_yaml(experiment, batch_size=4)
    assert (session.cfg.batch_size, session.cfg.max_feature_nodes) == (4, 24)
    assert session.batch_size == 4


def test_the_readme_example_runs_outside_pytest_as_shown() -> None:
    # A fresh interpreter, no pytest run: the usage page's script and its output, as printed.
    readme = (ROOT / "docs" / "usage.md").read_text()
    script = re.search(r"```python\n# outside.py\n(.*?)```", readme, re.S)
    shown = re.search(
        r"```text\n\$ CT_BATCH_SIZE=16 HF_HUB_OFFLINE=1 python outside.py\n(.*?)```", readme, re.S
    )
    assert script is not None and shown is not None
    env = {**os.environ, "CT_BATCH_SIZE": "16", "HF_HUB_OFFLINE": "1"}
    env.pop("CT_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-c", script.group(1)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == shown.group(1)
