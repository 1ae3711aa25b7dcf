"""Options, ini keys and env vars end to end, through pytester projects."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

SHOW_CONFIG = """
def test_show(ct_config):
    print("BS", ct_config.batch_size, ct_config.source_of("batch_size"))
    print("MFN", ct_config.max_feature_nodes, ct_config.source_of("max_feature_nodes"))
"""


def run_show(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_show=SHOW_CONFIG)
    result = pytester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    return result


def test_option_group_in_help(pytester: pytest.Pytester) -> None:
    from pytest_ctresources.settings.options import SETTINGS

    result = pytester.runpytest("--help")
    options = [
        f"*{s.option}{'=' + s.metavar if s.metavar and s.const is None else ''}*"
        for s in SETTINGS
        if s.option
    ]
    kinds = [f"*{s.ini} ({'linelist' if s.lines else 'string'})*" for s in SETTINGS if s.ini]
    result.stdout.fnmatch_lines(
        ["circuit-tracer GPU resources (pytest-ctresources):", "*--ct-batch-size=N|auto*"]
    )
    result.stdout.fnmatch_lines(options)
    result.stdout.fnmatch_lines(kinds)
    assert "*--ct-no-leases*" in options and "*ct_alloc_conf (string)*" in kinds


def test_yaml_value_with_its_source(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    result = run_show(pytester, "--ct-config", "exp.yaml")
    result.stdout.fnmatch_lines(["*BS 128 BATCH_SIZE in exp.yaml"])


def test_option_beats_yaml(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    result = run_show(pytester, "--ct-config", "exp.yaml", "--ct-batch-size", "64")
    result.stdout.fnmatch_lines(["*BS 64 --ct-batch-size"])


def test_env_beats_yaml_and_ini(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makeini("[pytest]\nct_config = exp.yaml\nct_max_feature_nodes = 99\n")
    monkeypatch.setenv("CT_BATCH_SIZE", "16")
    result = run_show(pytester)
    result.stdout.fnmatch_lines(
        ["*BS 16 env CT_BATCH_SIZE", "MFN 40 MAX_FEATURE_NODES in *exp.yaml"]
    )


def test_ini_when_nothing_else(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nct_batch_size = 48\n")
    result = run_show(pytester)
    result.stdout.fnmatch_lines(["*BS 48 ini ct_batch_size in *tox.ini", "MFN 8192 default"])


def test_env_config_path(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    monkeypatch.setenv("CT_CONFIG", "exp.yaml")
    run_show(pytester).stdout.fnmatch_lines(["*BS 128 BATCH_SIZE in exp.yaml"])


def test_verbose_header_states_settings_and_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-v", "--ct-config", "exp.yaml", "--ct-batch-size", "64")
    result.stdout.fnmatch_lines(
        [
            "ctresources: batch_size=64 (--ct-batch-size), max_feature_nodes=40 "
            "(MAX_FEATURE_NODES in exp.yaml)*",
            "ctresources: experiment config exp.yaml (--ct-config)",
            "ctresources: model ctresources/tiny-gemma-2 (MODEL_NAME in exp.yaml)*",
            "ctresources: vram capacity as detected, cleanup=auto (default)*",
            "ctresources: GPU 0: NVIDIA GeForce RTX 4090, 23.6 GiB*",
        ]
    )


def test_no_header_without_verbose(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest()
    assert "ctresources:" not in result.stdout.str()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--ct-batch-size", "0"],
            "*argument --ct-batch-size: must be a positive integer or 'auto', got 0",
        ),
        (
            ["--ct-batch-size", "-3"],
            "*argument --ct-batch-size: must be a positive integer or 'auto', got -3",
        ),
        (
            ["--ct-batch-size", "abc"],
            "*argument --ct-batch-size: must be a positive integer or 'auto', got 'abc'",
        ),
        (
            ["--ct-batch-size", "1.5"],
            "*argument --ct-batch-size: must be a positive integer or 'auto', got '1.5'",
        ),
        (["--ct-max-feature-nodes", "x"], "*argument --ct-max-feature-nodes: must be a positive*"),
        (
            ["--ct-vram-capacity", "0"],
            "*argument --ct-vram-capacity: must be a positive number of GiB*",
        ),
        (
            ["--ct-vram-capacity", "-8"],
            "*argument --ct-vram-capacity: must be a positive number of GiB*",
        ),
        (
            ["--ct-config", "missing.yaml"],
            "ERROR: --ct-config: missing.yaml: cannot read experiment config*",
        ),
    ],
)
def test_bad_options_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], line: str
) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([line])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


@pytest.mark.parametrize(
    ("env", "ini", "line"),
    [
        (
            {"CT_BATCH_SIZE": "big"},
            "",
            "ERROR: env CT_BATCH_SIZE: must be a positive integer or 'auto', got 'big'",
        ),
        ({"CT_VRAM_CAPACITY": "0"}, "", "ERROR: env CT_VRAM_CAPACITY: must be a positive number*"),
        (
            {},
            "ct_batch_size = 1.5",
            "ERROR: ini ct_batch_size in *tox.ini: must be a positive integer*",
        ),
        (
            {},
            "ct_vram_capacity = -1",
            "ERROR: ini ct_vram_capacity in *: must be a positive number*",
        ),
        (
            {},
            "ct_cleanup = sometimes",
            "ERROR: ini ct_cleanup in *: must be one of auto, always, never; got 'sometimes'",
        ),
        ({"CT_FAKE_GPUS": "H200=lots"}, "", "ERROR: CT_FAKE_GPUS: *"),
        (
            {},
            "ct_gpu_binding = maybe",
            "ERROR: ini ct_gpu_binding in *: must be one of auto, off; got 'maybe'",
        ),
        (
            {},
            "ct_lease_timeout = 0",
            "ERROR: ini ct_lease_timeout in *: must be a positive number of seconds, got '0'",
        ),
        (
            {},
            "ct_default_vram_gib = -1",
            "ERROR: ini ct_default_vram_gib in *: must be a number of GiB, 0 or more, got '-1'",
        ),
        ({}, "ct_leases = perhaps", "ERROR: ini ct_leases in *: *perhaps*"),
    ],
)
def test_bad_env_and_ini_are_usage_errors(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    ini: str,
    line: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([line])
    assert "Traceback" not in result.stderr.str()
    assert len([ln for ln in result.stderr.lines if ln.startswith("ERROR")]) == 1


def test_verbose_header_says_which_layer_won_and_which_lost(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ct_batch_size in the ini loses to the experiment YAML's BATCH_SIZE: -v says so."""
    # The header folds at the terminal's width and the line quotes two temporary paths, which
    # are longer under xdist on CI (popen-gwN): a wide terminal keeps it on one line to match.
    monkeypatch.setenv("COLUMNS", "1000")
    pytester.makefile(".yaml", exp="BATCH_SIZE: 32\n")
    pytester.makeini("[pytest]\nct_batch_size = 64\nct_config = exp.yaml\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-v", "-p", "no:randomly")
    result.stdout.fnmatch_lines(
        [
            "ctresources: batch_size=32 (BATCH_SIZE in *exp.yaml) wins over 64 (ini ct_batch_size in *tox.ini)"
        ]
    )
    result = pytester.runpytest("-v", "--ct-batch-size", "8")
    result.stdout.fnmatch_lines(
        [
            "ctresources: batch_size=8 (--ct-batch-size) wins over 32 (BATCH_SIZE in *exp.yaml);"
            " 64 (ini ct_batch_size in *tox.ini)"
        ]
    )
    assert "wins over" not in pytester.runpytest().stdout.str()  # only under -v


def test_ini_keys_given_with_dash_o_are_named_as_such(pytester: pytest.Pytester) -> None:
    # pytest's -o overrides the ini file: the source is the option, not a file that may not
    # even have the key.
    pytester.makeini("[pytest]\nct_batch_size = 16\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-o", "ct_cleanup=sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: -o ct_cleanup: must be one of auto, always, never; got 'sometimes'"]
    )
    result = pytester.runpytest("-o", "ct_batch_size=8", "-v")
    result.stdout.fnmatch_lines(["ctresources: batch_size=8 (-o ct_batch_size), *"])
    # Without -o the file is the source.
    pytester.runpytest("-v").stdout.fnmatch_lines(
        ["ctresources: batch_size=16 (ini ct_batch_size in *tox.ini), *"]
    )


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("- a\n- b\n", "the top level must be a mapping of KEY: value, got a list"),
        ("BATCH_SIZE: big\n", "BATCH_SIZE must be a positive integer or 'auto', got 'big'"),
        ("BATCH_SIZ: 3\n", "unknown key 'BATCH_SIZ' (did you mean BATCH_SIZE?)*"),
        ("batch_size: 3\n", "unknown key 'batch_size' (did you mean BATCH_SIZE?)*"),
        ("MODEL_NAME: [unclosed\n", "malformed YAML*"),
    ],
)
def test_bad_yaml_is_a_usage_error_naming_the_file_and_key(
    pytester: pytest.Pytester, yaml_text: str, message: str
) -> None:
    pytester.makefile(".yaml", exp=yaml_text)
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("--ct-config", "exp.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --ct-config: exp.yaml: {message}"])
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        ("directory", "cannot read experiment config: Is a directory"),
        ("binary", "cannot read experiment config: not UTF-8 text"),
    ],
)
def test_unreadable_yaml(pytester: pytest.Pytester, make: str, message: str) -> None:
    # Unreadable even for root (CI runs as root, which reads any mode-0 file).
    if make == "directory":
        (pytester.path / "exp.yaml").mkdir()
    else:
        (pytester.path / "exp.yaml").write_bytes(b"BATCH_SIZE: \xff\xfe\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("--ct-config", "exp.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --ct-config: exp.yaml: {message}"])


def test_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-p", "no:ctresources", "--ct-batch-size", "3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


@pytest.mark.parametrize(
    ("kind", "default", "message"),
    [
        ("Setting", None, "setting x has no default: declare it an OptionalSetting"),
        ("OptionalSetting", "1", "setting x has a default: declare it a Setting"),
    ],
)
def test_a_declaration_says_whether_it_has_a_default(
    kind: str, default: str | None, message: str
) -> None:
    # Whether a resolved value can be None follows from the declaration's class, so a
    # declaration whose default contradicts its class is refused when the class is made.
    from pytest_ctresources.settings import options

    declaration = getattr(options, kind)
    with pytest.raises((TypeError, RuntimeError)) as caught:
        type("Table", (), {"x": declaration(str, "help", default=default)})
    # Before Python 3.12, an error in __set_name__ comes wrapped in a RuntimeError.
    error = caught.value.__cause__ or caught.value
    assert str(error) == message
