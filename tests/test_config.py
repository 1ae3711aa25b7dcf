"""Unit tests of the pure config, YAML and settings modules (no pytest run)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from pytest_ctresources.settings.config import (
    FIELDS,
    CircuitTracerConfig,
    ConfigError,
    parse_text,
    validate_typed,
)
from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml
from pytest_ctresources.settings.resolve import resolve_settings
from pytest_ctresources.settings.sources import Source


def test_defaults_are_circuit_tracers_and_are_sourced_default() -> None:
    cfg = CircuitTracerConfig.defaults()
    assert (cfg.batch_size, cfg.max_feature_nodes, cfg.backend) == (256, 8192, "nnsight")
    assert all(cfg.source_of(name).kind == "default" for name in FIELDS)


def test_config_is_frozen() -> None:
    cfg = CircuitTracerConfig.defaults()
    with pytest.raises(AttributeError):
        cfg.batch_size = 1  # type: ignore[misc]


def test_layering_keeps_provenance_per_field() -> None:
    cfg = CircuitTracerConfig.defaults().layered({"batch_size": 64}, Source.option("--x"))
    assert cfg.batch_size == 64
    assert str(cfg.source_of("batch_size")) == "--x"
    assert cfg.source_of("max_feature_nodes").kind == "default"


def test_attribute_kwargs_are_exactly_attribute_parameters() -> None:
    from circuit_tracer import attribute

    params = set(inspect.signature(attribute).parameters)
    kwargs = CircuitTracerConfig.defaults().attribute_kwargs()
    assert set(kwargs) <= params
    assert kwargs["batch_size"] == 256


def test_from_pretrained_kwargs_are_exactly_from_pretrained_parameters() -> None:
    import torch
    from circuit_tracer import ReplacementModel

    params = set(inspect.signature(ReplacementModel.from_pretrained).parameters)
    cfg = CircuitTracerConfig.defaults().layered(
        {"model_name": "google/gemma-2-2b", "transcoder_set": "gemma", "dtype": "bfloat16"},
        Source.default(),
    )
    kwargs = cfg.from_pretrained_kwargs()
    assert set(kwargs) <= params
    assert kwargs["dtype"] is torch.bfloat16
    assert kwargs["backend"] == "nnsight"


def test_from_pretrained_kwargs_need_a_model() -> None:
    with pytest.raises(ConfigError, match="MODEL_NAME and TRANSCODER_SET not set"):
        CircuitTracerConfig.defaults().from_pretrained_kwargs()


@pytest.mark.parametrize("text", ["0", "-3", "abc", "1.5", ""])
def test_parse_text_rejects_bad_batch_sizes(text: str) -> None:
    with pytest.raises(ConfigError, match="must be a positive integer"):
        parse_text("batch_size", text)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_size", True),
        ("batch_size", "64"),
        ("dtype", "float8"),
        ("backend", "jax"),
        ("desired_logit_prob", 1.5),
        ("vram_gib", -1),
        ("lazy_decoder", "yes"),
        ("offload", "gpu"),
    ],
)
def test_validate_typed_rejects(name: str, value: object) -> None:
    with pytest.raises(ConfigError):
        validate_typed(name, value)


def test_dtype_aliases() -> None:
    assert validate_typed("dtype", "bf16") == "bfloat16"


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_values_params_and_sources(tmp_path: Path) -> None:
    path = write(
        tmp_path, "BATCH_SIZE: 128\nDTYPE: bf16\nOFFLOAD: null\nPARAMS:\n  LAYERS: [1, 2]\n"
    )
    cfg = load_experiment_yaml(path).apply(CircuitTracerConfig.defaults())
    assert (cfg.batch_size, cfg.dtype) == (128, "bfloat16")
    assert cfg.params == {"LAYERS": [1, 2]}
    assert str(cfg.source_of("batch_size")) == f"BATCH_SIZE in {path}"
    assert cfg.source_of("offload").kind == "default"


def test_params_with_keys_json_cannot_hold_are_in_the_report_as_text(tmp_path: Path) -> None:
    """YAML keys may be dates, bytes or timestamps; the config's dict for the JSON report names
    them as text (``json.dumps`` refused them, and the whole report was lost)."""
    path = write(
        tmp_path,
        "PARAMS:\n  RUNS: {2024-01-01: base, !!binary aGk=: b, 7: c, null: d}\n  N: [{2024-01-02: 1}]\n",
    )
    cfg = load_experiment_yaml(path).apply(CircuitTracerConfig.defaults())
    document = json.loads(json.dumps(cfg.to_dict(), default=str))
    assert document["params"] == {
        "RUNS": {"2024-01-01": "base", "b'hi'": "b", "7": "c", "null": "d"},
        "N": [{"2024-01-02": 1}],
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("BATCH_SIZ: 128\n", "unknown key 'BATCH_SIZ' (did you mean BATCH_SIZE?)"),
        ("PROMPT: hi\n", "unknown key 'PROMPT'; experiment parameters of your own go under PARAMS"),
        ("BATCH_SIZE: big\n", "BATCH_SIZE must be a positive integer or 'auto', got 'big'"),
        ("- 1\n- 2\n", "the top level must be a mapping of KEY: value, got a list"),
        ("BATCH_SIZE: [\n", "malformed YAML"),
        ("PARAMS: 3\n", "PARAMS must be a mapping"),
        ("!!python/object:os.system {}\n", "malformed YAML"),
    ],
)
def test_yaml_errors_are_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_experiment_yaml(path)
    assert str(excinfo.value).startswith(f"{path}: ")
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_yaml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read experiment config"):
        load_experiment_yaml(tmp_path / "nope.yaml")


def test_yaml_reloads_when_the_file_changes(tmp_path: Path) -> None:
    path = write(tmp_path, "BATCH_SIZE: 1\n")
    assert load_experiment_yaml(path).values["batch_size"] == 1
    path.write_text("BATCH_SIZE: 2\n", encoding="utf-8")
    import os

    os.utime(path, ns=(1, 10**18))
    assert load_experiment_yaml(path).values["batch_size"] == 2


def resolve(tmp_path: Path, options=None, ini=None, environ=None):  # type: ignore[no-untyped-def]
    return resolve_settings(
        options=options or {},
        ini=ini or {},
        environ=environ or {},
        inifile=str(tmp_path / "pytest.ini"),
        invocation_dir=tmp_path,
    )


def test_precedence_option_over_env_over_yaml_over_ini(tmp_path: Path) -> None:
    path = write(tmp_path, "BATCH_SIZE: 128\n")
    settings = resolve(tmp_path, ini={"ct_batch_size": "32", "ct_config": "exp.yaml"})
    assert settings.session_config().batch_size == 128
    settings = resolve(tmp_path, ini={"ct_config": str(path)}, environ={"CT_BATCH_SIZE": "16"})
    cfg = settings.session_config()
    assert (cfg.batch_size, str(cfg.source_of("batch_size"))) == (16, "env CT_BATCH_SIZE")
    settings = resolve(tmp_path, options={"ct_batch_size": 8}, environ={"CT_BATCH_SIZE": "16"})
    assert str(settings.session_config().source_of("batch_size")) == "--ct-batch-size"


def test_ini_config_path_is_relative_to_the_ini_file(tmp_path: Path) -> None:
    write(tmp_path, "MAX_FEATURE_NODES: 77\n")
    settings = resolve(tmp_path, ini={"ct_config": "exp.yaml"})
    assert settings.session_config().max_feature_nodes == 77


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"environ": {"CT_BATCH_SIZE": "abc"}}, "env CT_BATCH_SIZE: must be a positive integer"),
        ({"ini": {"ct_max_feature_nodes": "0"}}, "ini ct_max_feature_nodes in"),
        ({"environ": {"CT_VRAM_CAPACITY": "-2"}}, "env CT_VRAM_CAPACITY: must be a positive"),
        ({"ini": {"ct_cleanup": "sometimes"}}, "must be one of auto, always, never"),
        ({"environ": {"CT_CONFIG": "missing.yaml"}}, "env CT_CONFIG: missing.yaml: cannot read"),
    ],
)
def test_bad_settings_name_their_source(tmp_path: Path, kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pytest.UsageError, match=message.replace(".", r"\.")):
        resolve(tmp_path, **kwargs)


def test_alloc_conf_default_and_empty(tmp_path: Path) -> None:
    assert resolve(tmp_path).alloc_conf.value == "expandable_segments:True"
    empty = resolve(tmp_path, ini={"ct_alloc_conf": ""}).alloc_conf
    assert (empty.value, empty.source.kind) == ("", "ini")


def test_off_on_the_command_line_beats_the_ini_key(tmp_path: Path) -> None:
    """``--ct-fail-on-increase off`` (a value that parses to None) is the option given,
    not an option missing that lets the ini key's 10% apply."""
    settings = resolve(
        tmp_path,
        options={"ct_fail_on_increase": "off", "ct_require_gpu_run_within": "off"},
        ini={"ct_fail_on_increase": "10", "ct_require_gpu_run_within": "7"},
    )
    assert settings.fail_on_increase.value is None
    assert str(settings.fail_on_increase.source) == "--ct-fail-on-increase"
    assert settings.require_gpu_run_within.value is None
    settings = resolve(tmp_path, ini={"ct_fail_on_increase": "10"})
    assert settings.fail_on_increase.value == 10.0


def test_options_keep_their_checked_text(pytester: pytest.Pytester) -> None:
    """Options are parsed where they are resolved, with the ini key and the variable; argparse
    only checks them, so that a bad value is reported as pytest reports its own options."""
    config = pytester.parseconfig("--ct-fail-on-increase", "off", "--ct-report-top", "3")
    assert config.getoption("ct_fail_on_increase") == "off"
    assert config.getoption("ct_report_top") == "3"
    with pytest.raises(pytest.UsageError, match="argument --ct-report-top: must be a positive"):
        pytester.parseconfig("--ct-report-top", "0")
    with pytest.raises(pytest.UsageError, match="argument --ct-fail-on-increase: must be"):
        pytester.parseconfig("--ct-fail-on-increase", "ten")
