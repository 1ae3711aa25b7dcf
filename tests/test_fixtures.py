"""ct_config and ct_session end to end: real circuit-tracer attribution on tiny offline models."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

ATTRIBUTION_TESTS = r"""
import pytest

SEEN = {}

@pytest.fixture
def spy_batches(monkeypatch):
    # Record the batch size circuit-tracer itself uses for its forward pass.
    from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel
    seen = []
    original = NNSightReplacementModel.run_forward_pass
    def spy(self, input_ids, batch_size, ctx):
        seen.append(batch_size)
        return original(self, input_ids, batch_size, ctx)
    monkeypatch.setattr(NNSightReplacementModel, "run_forward_pass", spy)
    return seen

def test_config_reaches_attribute(ct_session, spy_batches):
    prompt = ct_session.cfg.params["PROMPT"]
    graph = ct_session.attribute(prompt)
    assert spy_batches == [ct_session.cfg.batch_size]
    n_features = len(graph.selected_features)
    assert 0 < n_features <= ct_session.cfg.max_feature_nodes
    print("FEATURES", n_features, "BATCH", spy_batches[0], "SOURCE", ct_session.cfg.source_of("batch_size"))
    SEEN["model"] = id(ct_session.load_model())

def test_model_is_shared(ct_session):
    assert id(ct_session.load_model()) == SEEN["model"]

@pytest.mark.ct_config(model_name="ctresources/tiny-llama")
def test_other_model_evicts(ct_session, request):
    model = ct_session.load_model()
    assert id(model) != SEEN["model"]
    cache = ct_session._cache
    assert cache.loads == 2 and cache.key[0] == "ctresources/tiny-llama"
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"], model, batch_size=3)
    assert ct_session.calls[-1].kwargs["batch_size"] == 3

def test_overrides_are_checked(ct_session):
    with pytest.raises(ValueError, match=r"attribute\(batch_size=...\): must be a positive integer"):
        ct_session.attribute("the", batch_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ct_session.attribute("the", batchsize=3)
"""


def test_ct_session_runs_real_attribution(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_attr=ATTRIBUTION_TESTS)
    result = pytester.runpytest("-s", "--ct-config", "exp.yaml", "--ct-batch-size", "16")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*FEATURES * BATCH 16 SOURCE --ct-batch-size*"])


def test_max_feature_nodes_from_yaml_limits_the_graph(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".yaml", exp=TINY_YAML.replace("MAX_FEATURE_NODES: 40", "MAX_FEATURE_NODES: 7")
    )
    pytester.makepyfile(
        """
        def test_small_graph(ct_session):
            graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
            assert len(graph.selected_features) == 7
        """
    )
    pytester.runpytest("--ct-config", "exp.yaml").assert_outcomes(passed=1)


def test_load_model_without_a_model_is_a_clear_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_no_model(ct_session):
            ct_session.load_model()
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*MODEL_NAME and TRANSCODER_SET not set*"])


def test_ct_config_fixture_without_marker_is_the_session_config(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_ctresources import CircuitTracerConfig
        def test_cfg(ct_config):
            assert isinstance(ct_config, CircuitTracerConfig)
            assert ct_config.batch_size == 256 and ct_config.source_of("batch_size").kind == "default"
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


LOAD_FAILURES = """
import pytest

def test_first(ct_session):
    ct_session.attribute("the capital of france is")

def test_second(ct_session):
    ct_session.attribute("the capital of france is")

@pytest.fixture
def model(ct_session):
    return ct_session.load_model()

def test_third_through_a_fixture(model):
    pass

@pytest.mark.ct_config(model_name="ctresources/tiny-gema-2", transcoder_set="ctresources/random-jumprelu")
def test_typo(ct_session):
    ct_session.load_model()
"""


def test_a_model_that_fails_to_load_fails_once_in_one_line(pytester: pytest.Pytester) -> None:
    # HF_HUB_OFFLINE=1 (tests/conftest.py): the hub is not asked, the cache has nothing.
    pytester.makefile(".yaml", exp="MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: gemma\n")
    pytester.makepyfile(test_load=LOAD_FAILURES)
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(failed=3, errors=1)
    first = (
        "cannot load model 'google/gemma-2-2b' with transcoders 'gemma' (MODEL_NAME in "
        "exp.yaml): offline (HF_HUB_OFFLINE is set) and its files are not in the local "
        "Hugging Face cache"
    )
    lines = result.stdout.lines
    repeated = (
        f"not retried: the same model failed to load earlier in test_load.py::test_first: {first}"
    )
    assert lines.count(first) == 1  # test_first's failure: one line
    assert lines.count(repeated) == 2  # test_second and the fixture of test_third
    result.stdout.fnmatch_lines(
        [
            "cannot load model 'ctresources/tiny-gema-2' with transcoders "
            "'ctresources/random-jumprelu' (@pytest.mark.ct_config on test_load.py::test_typo): "
            "* (did you mean ctresources/tiny-gemma-2?)",
        ]
    )
    out = result.stdout.str()
    assert "Traceback" not in out and "During handling" not in out
    assert "did you mean google/gemma-2-2b" not in out  # a known name gets no suggestion


def test_a_short_model_name_that_fails_to_load_says_what_ct_resources_estimate_says(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_ctresources.estimator.cli import main

    pytester.makefile(".yaml", exp="MODEL_NAME: gemma-2-2b\nTRANSCODER_SET: gemma\n")
    pytester.makepyfile(test_load="def test_first(ct_session):\n    ct_session.load_model()\n")
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(failed=1)
    note = (
        "'gemma-2-2b' is short for google/gemma-2-2b; experiment configs take the full name, "
        "which circuit-tracer loads (short names work on the command line)"
    )
    result.stdout.fnmatch_lines(
        [
            "cannot load model 'gemma-2-2b' with transcoders 'gemma' (MODEL_NAME in exp.yaml): "
            f"offline (HF_HUB_OFFLINE is set) and its files are not in the local Hugging Face "
            f"cache; {note}"
        ]
    )
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["estimate", "--config", str(pytester.path / "exp.yaml"), "--gpu-gib", "24"])
    assert note in capsys.readouterr().err  # the same words for the same file


def test_the_batch_size_is_a_number_before_and_after_an_auto_call(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ct_config(batch_size="auto", batch_size_max=64)
        def test_auto(ct_session):
            assert ct_session.cfg.batch_size == "auto"
            before = ct_session.batch_size
            assert isinstance(before, int) and 1 <= before <= 64
            ct_session.attribute("the capital of france is")
            (choice,) = ct_session.auto_choices
            assert ct_session.batch_size == choice.batch_size
            ct_session.attribute("the capital of france is", batch_size=ct_session.batch_size // 4)
            assert ct_session.batch_size == choice.batch_size // 4

        def test_fixed(ct_session):
            assert ct_session.batch_size == 128
        """
    )
    pytester.runpytest("--ct-config", "exp.yaml").assert_outcomes(passed=2)


LOAD_OOM = """
import pytest
import torch
import pytest_ctresources.session.cache as session_module

CALLS = []

def build(cfg, device):
    CALLS.append(device)
    if len(CALLS) == 1:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory while loading the model")
    return object()

@pytest.fixture(autouse=True)
def stand_in_builder(monkeypatch):
    # Through monkeypatch: the project may run in-process, sharing the plugin's modules.
    monkeypatch.setattr(session_module, "build_model", build)

def test_first(ct_session):
    ct_session.load_model()

def test_second(ct_session):
    ct_session.load_model()
"""


def test_an_out_of_memory_load_is_not_remembered_as_a_load_failure(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_oom_load=LOAD_OOM)
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*OutOfMemoryError: CUDA out of memory while loading the model"])
    assert "not retried" not in result.stdout.str()
