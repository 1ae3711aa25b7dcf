"""The vram and ct_config markers: skip decisions against fake GPUs, and bad arguments."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

VRAM_TESTS = """
import pytest

@pytest.mark.vram(gib=20)
def test_fits(): pass

@pytest.mark.vram(gib=30)
def test_too_big(): pass

@pytest.mark.vram(8)
def test_positional(): pass
"""


def test_skip_reason_names_the_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makepyfile(test_v=VRAM_TESTS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [1] test_v.py:6: needs 30.0 GiB VRAM; GPU 0 (NVIDIA GeForce RTX 4090) has 23.6 GiB"
        ]
    )


def test_no_gpu_skips_every_vram_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_v=VRAM_TESTS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(
        ["SKIPPED [1] test_v.py:3: needs 20.0 GiB VRAM; no CUDA GPU detected"]
    )


def test_capacity_option_replaces_the_detected_memory(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA H200=139.8")
    pytester.makepyfile(test_v=VRAM_TESTS)
    result = pytester.runpytest("-rs", "--ct-vram-capacity", "24")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs 30.0 GiB VRAM; GPU 0 (NVIDIA H200) is capped at 24.0 GiB by --ct-vram-capacity"]
    )


def test_a_capacity_above_the_card_is_clamped_to_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(test_v=VRAM_TESTS)
    result = pytester.runpytest("-rs", "-v", "--ct-vram-capacity", "200")
    result.assert_outcomes(passed=1, skipped=2)
    clamped = "--ct-vram-capacity 200 GiB, clamped to the 10.0 GiB of GPU 0 (Card)"
    result.stdout.fnmatch_lines(
        [
            f"ctresources: vram capacity 10 GiB ({clamped}), *",
            f"*needs 20.0 GiB VRAM; GPU 0 (Card) is capped at 10.0 GiB by {clamped}",
        ]
    )


def test_cuda_visible_devices_picks_the_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=8;NVIDIA H200=139.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pytester.makepyfile(test_v=VRAM_TESTS)
    pytester.runpytest().assert_outcomes(passed=3)


def test_class_and_module_markers_closest_wins(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.vram(gib=50)

        def test_module_level(): pass

        @pytest.mark.vram(gib=4)
        class TestSmall:
            def test_in_class(self): pass
        """
    )
    pytester.runpytest().assert_outcomes(passed=1, skipped=1)


def test_config_vram_gib_is_a_need_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    pytester.makefile(".yaml", exp="VRAM_GIB: 12\n")
    pytester.makepyfile(
        """
        def test_session(ct_session): pass
        def test_plain(): pass
        """
    )
    result = pytester.runpytest("-rs", "--ct-config", "exp.yaml")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs 12.0 GiB VRAM (VRAM_GIB in exp.yaml); GPU 0 (Card) has 10.0 GiB"]
    )


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("vram(gib=-1)", "gib must be a positive number of GiB, got -1"),
        ("vram('20')", "gib must be a positive number of GiB, got '20'"),
        ("vram(gb=20)", "unknown keyword 'gb' (did you mean gib?)"),
        ("vram()", "missing a required argument: 'gib'"),
        ("vram(True)", "gib must be a positive number of GiB, got True"),
        ("ct_config(batch_size=0)", "batch_size must be a positive integer or 'auto', got 0"),
        ("ct_config(batch_sise=8)", "unknown field 'batch_sise' (did you mean batch_size?)"),
        ("ct_config(path=3)", "path must be a string, got 3"),
        ("ct_config(path='nope.yaml')", "nope.yaml: cannot read experiment config"),
    ],
)
def test_bad_marker_fails_only_that_test_at_setup(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_bad(ct_config): pass

        def test_good(): pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [f"invalid @pytest.mark.{marker.split('(')[0]} on *::test_bad: *{message}*"]
    )
    assert "Traceback" not in result.stdout.str()
    assert "During handling" not in result.stdout.str()


def test_markers_are_registered_and_documented(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.vram(gib=1)
        @pytest.mark.ct_config(batch_size=2)
        def test_a(): pass
        """
    )
    pytester.runpytest("--strict-markers").assert_outcomes(skipped=1)
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.vram(gib): the test's peak VRAM need in GiB*",
            "@pytest.mark.ct_config(path=None, **fields): *",
        ]
    )


def test_ct_config_marker_layers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".yaml", exp="BATCH_SIZE: 128\nMAX_FEATURE_NODES: 100\nDTYPE: bfloat16\n")
    pytester.makefile(".yaml", own="MAX_FEATURE_NODES: 50\n")
    pytester.makepyfile(
        test_layering="""
        import pytest
        pytestmark = pytest.mark.ct_config(batch_size=64, max_n_logits=5)

        @pytest.mark.ct_config(batch_size=32)
        class TestLayers:
            @pytest.mark.ct_config(path="own.yaml")
            def test_layers(self, ct_config):
                assert ct_config.batch_size == 32
                assert str(ct_config.source_of("batch_size")).startswith("@pytest.mark.ct_config on ")
                assert ct_config.max_n_logits == 5
                assert ct_config.max_feature_nodes == 50
                # Shown relative to where pytest runs, as --ct-config's files are.
                assert str(ct_config.source_of("max_feature_nodes")) == "MAX_FEATURE_NODES in own.yaml"
                assert ct_config.dtype == "bfloat16"
                assert ct_config.source_of("dtype").kind == "yaml"

        """,
        test_own="""
        import pytest

        @pytest.mark.ct_config(batch_size=32)
        def test_own_marker_beats_env_and_option(ct_config):
            assert ct_config.batch_size == 32
            assert ct_config.max_feature_nodes == 100

        @pytest.mark.ct_config(batch_size=16, max_feature_nodes=10)
        def test_another_own_marker(ct_config):
            assert (ct_config.batch_size, ct_config.max_feature_nodes) == (16, 10)

        def test_session_wide(ct_config):
            assert ct_config.batch_size == 9
            assert str(ct_config.source_of("batch_size")) == "--ct-batch-size"
        """,
    )
    result = pytester.runpytest("--ct-config", "exp.yaml", "test_layering.py::TestLayers")
    result.assert_outcomes(passed=1)
    # pytest's convention (pytest-timeout's marker over --timeout): the test's own marker wins
    # over the session-wide environment and command line, and the run says so once per setting.
    monkeypatch.setenv("CT_BATCH_SIZE", "7")
    result = pytester.runpytest(
        "--ct-config", "exp.yaml", "--ct-batch-size", "9", "-v", "test_own.py"
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "ctresources: test_own.py::test_own_marker_beats_env_and_option keeps its own "
            "batch_size=32 (@pytest.mark.ct_config on test_own.py::test_own_marker_beats_env_and_option) "
            "over --ct-batch-size 9; said once per "
            "setting, the summary counts them",
            "ctresources: test_own.py::test_another_own_marker keeps its own "
            "max_feature_nodes=10 (@pytest.mark.ct_config on test_own.py::test_another_own_marker) "
            "over MAX_FEATURE_NODES in exp.yaml "
            "(100)*",
            "*ctresources summary*",
            "2 test(s) keep their own batch_size over --ct-batch-size 9",
            "1 test(s) keep their own max_feature_nodes over MAX_FEATURE_NODES in exp.yaml (100)",
        ]
    )
    out = result.stdout.str()
    assert out.count("keeps its own batch_size") == 1
