"""Unit tests of ``pytest_ctresources.testing``: the offline random circuit-tracer models.

Everything runs on the CPU with the tiny models; nothing may reach the Hugging Face Hub.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_ctresources import testing
from pytest_ctresources.bundled import catalogue
from pytest_ctresources.testing import (
    GEMMA_2_2B_DIMS,
    RANDOM_TRANSCODERS,
    TINY_GEMMA2,
    TINY_GEMMA2_DIMS,
    TINY_LLAMA,
    TINY_LLAMA_DIMS,
    ModelDims,
    build_named_model,
    build_replacement_model,
    default_hooks,
    is_bundled_model,
    model_dims_of,
    write_local_tokenizer,
)

torch = pytest.importorskip("torch")
pytest.importorskip("circuit_tracer")

# Small but not tiny: big enough that staging weights badly would show, small enough for CPU.
MEDIUM_DIMS = ModelDims(
    n_layers=4,
    d_model=256,
    d_mlp=1024,
    vocab_size=8192,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    d_transcoder=2048,
    architecture="gemma2",
)
PROMPT = "the capital of france is"


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[None]:
    # Module-scoped so the module-scoped model fixtures are built offline too.
    # huggingface_hub reads HF_HUB_OFFLINE once, at import, so patch its constant as well.
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def tiny_gemma() -> Any:
    return build_replacement_model(TINY_GEMMA2_DIMS, device="cpu")


def _transcoder_set(model: Any) -> Any:
    # nnsight wraps every module attribute of the model in an Envoy; ``_module`` is the module.
    return getattr(model.transcoders, "_module", model.transcoders)


def _state(model: Any) -> dict[str, Any]:
    module = getattr(model, "_module", model)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trips_words_and_prepends_bos(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_local_tokenizer(tmp_path / "tok")
    assert path == str(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(path)

    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == (
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
    )
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)

    text = "the quick brown fox jumps over the lazy dog . paris is the capital of france"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok(text, add_special_tokens=False).input_ids == ids[1:]
    # Lower-casing and unknown words.
    assert (
        tok("The Capital", add_special_tokens=False).input_ids == tok("the capital").input_ids[1:]
    )
    assert tok("zyzzyva", add_special_tokens=False).input_ids == [tok.unk_token_id]


def test_tokenizer_has_a_few_hundred_words_and_pads_to_vocab_size(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "plain"))
    assert 200 <= len(plain) <= TINY_GEMMA2_DIMS.vocab_size

    padded = AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "pad", vocab_size=600))
    # circuit-tracer reads graph.vocab_size from tokenizer.vocab_size; it must equal the model's.
    assert len(padded) == padded.vocab_size == 600
    assert padded.decode([599]) == f"<unused{599 - len(plain)}>"

    with pytest.raises(ValueError, match="vocab_size must be at least"):
        write_local_tokenizer(tmp_path / "small", vocab_size=10)


# -- dims and names ----------------------------------------------------------------------------


def test_presets() -> None:
    for dims in (TINY_GEMMA2_DIMS, TINY_LLAMA_DIMS):
        assert dims.n_layers == 2 and dims.d_model <= 64
    assert TINY_GEMMA2_DIMS.architecture == "gemma2"
    assert TINY_LLAMA_DIMS.architecture == "llama"
    g = GEMMA_2_2B_DIMS
    assert (g.n_layers, g.d_model, g.d_mlp, g.vocab_size) == (26, 2304, 9216, 256000)
    assert (g.n_heads, g.n_kv_heads, g.head_dim, g.d_transcoder) == (8, 4, 256, 16384)
    assert g.architecture == "gemma2"
    # gemma-2-2b has 2.61e9 parameters (embeddings tied).
    assert 2.60e9 < g.n_model_params < 2.62e9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architecture": "gpt2"}, "unknown architecture"),
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"d_model": 0}, "d_model must be a positive int"),
        ({"vocab_size": 16}, "vocab_size must be at least"),
    ],
)
def test_model_dims_validation(change: dict[str, Any], message: str) -> None:
    fields = {**TINY_GEMMA2_DIMS.__dict__, **change}
    with pytest.raises(ValueError, match=message):
        ModelDims(**fields)


def test_bundled_names() -> None:
    assert is_bundled_model(TINY_GEMMA2) and is_bundled_model(TINY_LLAMA)
    assert not is_bundled_model("google/gemma-2-2b")
    assert model_dims_of(TINY_GEMMA2) is TINY_GEMMA2_DIMS
    assert testing.BUNDLED_MODELS[TINY_LLAMA] is TINY_LLAMA_DIMS
    assert RANDOM_TRANSCODERS in testing.BUNDLED_TRANSCODER_SETS
    assert TINY_GEMMA2 == "ctresources/tiny-gemma-2"
    assert RANDOM_TRANSCODERS == "ctresources/random-jumprelu"


def test_unknown_names_raise_value_error_listing_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown bundled model") as model_error:
        build_named_model("ctresources/huge", RANDOM_TRANSCODERS, device="cpu")
    assert TINY_GEMMA2 in str(model_error.value) and TINY_LLAMA in str(model_error.value)

    with pytest.raises(ValueError, match="unknown bundled transcoder set") as tc_error:
        build_named_model(TINY_GEMMA2, "gemma", device="cpu")
    assert RANDOM_TRANSCODERS in str(tc_error.value)

    with pytest.raises(ValueError, match=TINY_LLAMA):
        model_dims_of("nope")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        build_replacement_model(TINY_LLAMA_DIMS, device="cpu", backend="vllm")
    with pytest.raises(ValueError, match="unknown dtype"):
        build_replacement_model(TINY_LLAMA_DIMS, device="cpu", dtype="float33")
    with pytest.raises(ValueError, match="floating-point"):
        build_replacement_model(TINY_LLAMA_DIMS, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="features_per_token"):
        build_replacement_model(TINY_LLAMA_DIMS, device="cpu", features_per_token=0)


# -- models ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "backend"),
    [
        (TINY_GEMMA2_DIMS, "nnsight"),
        (TINY_LLAMA_DIMS, "nnsight"),
        (TINY_GEMMA2_DIMS, "transformerlens"),
        (TINY_LLAMA_DIMS, "transformerlens"),
        (dataclasses.replace(TINY_LLAMA_DIMS, skip_connection=True), "nnsight"),
        (dataclasses.replace(TINY_GEMMA2_DIMS, skip_connection=True), "transformerlens"),
        (dataclasses.replace(TINY_GEMMA2_DIMS, cross_layer=True), "nnsight"),
        (dataclasses.replace(TINY_LLAMA_DIMS, cross_layer=True, skip_connection=True), "nnsight"),
        (dataclasses.replace(TINY_GEMMA2_DIMS, architecture="gemma3"), "nnsight"),
        (dataclasses.replace(TINY_GEMMA2_DIMS, architecture="qwen3"), "nnsight"),
        (dataclasses.replace(TINY_GEMMA2_DIMS, architecture="qwen3", cross_layer=True), "nnsight"),
    ],
    ids=[
        "gemma2-nnsight",
        "llama-nnsight",
        "gemma2-tl",
        "llama-tl",
        "llama-skip",
        "gemma2-skip-tl",
        "gemma2-clt",
        "llama-clt-skip",
        "gemma3",
        "qwen3",
        "qwen3-clt",
    ],
)
# Upstream noise: nnsight patches torch globally, and the warning fires for TransformerLens too.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_attribution_respects_max_feature_nodes(dims: ModelDims, backend: str) -> None:
    from circuit_tracer import Graph, attribute

    model = build_replacement_model(dims, device="cpu", backend=backend)
    assert model.backend == backend
    max_feature_nodes = 20

    graph = attribute(PROMPT, model, batch_size=8, max_feature_nodes=max_feature_nodes)
    assert model.skip_transcoder == dims.skip_connection

    assert isinstance(graph, Graph)
    n_active = graph.active_features.shape[0]
    n_selected = len(graph.selected_features)
    assert n_active > max_feature_nodes  # so the limit is what bounds the selection
    assert n_selected == max_feature_nodes
    assert int(graph.selected_features.max()) < n_active

    n_pos = len(graph.input_tokens)
    assert n_pos == len(PROMPT.split()) + 1
    assert int(graph.input_tokens[0]) == model.tokenizer.bos_token_id
    n_logits = len(graph.logit_targets)
    # Rows and columns: selected features, error nodes (per layer and position), token nodes,
    # logit nodes.
    n_nodes = n_selected + dims.n_layers * n_pos + n_pos + n_logits
    assert tuple(graph.adjacency_matrix.shape) == (n_nodes, n_nodes)
    assert bool(torch.isfinite(graph.adjacency_matrix).all())
    assert graph.adjacency_matrix.abs().sum() > 0

    assert graph.cfg.n_layers == dims.n_layers
    assert graph.vocab_size == dims.vocab_size
    assert graph.scan == RANDOM_TRANSCODERS


@pytest.mark.parametrize(
    "dims",
    [
        dataclasses.replace(TINY_LLAMA_DIMS, skip_connection=True),
        dataclasses.replace(TINY_GEMMA2_DIMS, cross_layer=True),
        dataclasses.replace(TINY_GEMMA2_DIMS, cross_layer=True, skip_connection=True),
        dataclasses.replace(TINY_GEMMA2_DIMS, architecture="gemma3"),
        dataclasses.replace(TINY_GEMMA2_DIMS, architecture="qwen3"),
        dataclasses.replace(TINY_GEMMA2_DIMS, architecture="qwen3", tied_embeddings=False),
        dataclasses.replace(TINY_LLAMA_DIMS, tied_embeddings=True),
    ],
    ids=["skip", "clt", "clt-skip", "gemma3", "qwen3", "qwen3-untied", "llama-tied"],
)
def test_parameter_counts(dims: ModelDims) -> None:
    model = build_replacement_model(dims, device="cpu")
    params = dict(model._module.named_parameters())
    n_transcoder = sum(p.numel() for n, p in params.items() if n.startswith("transcoders."))
    n_model = sum(p.numel() for n, p in params.items() if not n.startswith("transcoders."))
    assert n_transcoder == dims.n_transcoder_params
    assert n_model == dims.n_model_params


@pytest.mark.parametrize("architecture", ["gemma3", "qwen3"])
def test_gemma3_and_qwen3_are_nnsight_only(architecture: str) -> None:
    with pytest.raises(ValueError, match=f"{architecture} random models are built for the nnsight"):
        build_replacement_model(
            dataclasses.replace(TINY_GEMMA2_DIMS, architecture=architecture),
            device="cpu",
            backend="transformerlens",
        )


def test_qwen3_reads_and_writes_the_mlp() -> None:
    """Qwen3's transcoders use the hooks circuit-tracer's Qwen3 mapping has (the MLP's input
    and output, as the mwhanna/qwen3-* sets), per-layer and cross-layer alike."""
    dims = dataclasses.replace(TINY_GEMMA2_DIMS, architecture="qwen3")
    assert default_hooks(dims) == ("mlp.hook_in", "mlp.hook_out")
    assert default_hooks(dataclasses.replace(dims, cross_layer=True))[0] == "mlp.hook_in"
    model = build_replacement_model(dims, device="cpu")
    assert model.cfg.original_architecture == "Qwen3ForCausalLM"


def test_published_dimensions_are_bundled() -> None:
    """The published sizes the estimator is fitted and validated on build by name, with the
    registry's dimensions for the real model."""
    from pytest_ctresources.estimator import registry

    pairs = {
        "ctresources/random-gemma-2-9b": "google/gemma-2-9b",
        "ctresources/random-gemma-2-27b": "google/gemma-2-27b",
        "ctresources/random-gemma-3-270m": "google/gemma-3-270m",
        "ctresources/random-gemma-3-1b": "google/gemma-3-1b-pt",
        "ctresources/random-llama-3.2-3b": "meta-llama/Llama-3.2-3B",
        "ctresources/random-llama-3.1-8b": "meta-llama/Llama-3.1-8B",
        "ctresources/random-qwen3-0.6b": "Qwen/Qwen3-0.6B",
        "ctresources/random-qwen3-1.7b": "Qwen/Qwen3-1.7B",
        "ctresources/random-qwen3-4b": "Qwen/Qwen3-4B",
        "ctresources/random-qwen3-8b": "Qwen/Qwen3-8B",
    }
    for bundled, real in pairs.items():
        random, published = registry.model_shape(bundled), registry.MODELS[real]
        assert dataclasses.replace(random, name=real) == published, bundled


def test_build_named_model() -> None:
    model = build_named_model(TINY_LLAMA, RANDOM_TRANSCODERS, device="cpu")
    assert model.cfg.original_architecture == "LlamaForCausalLM"
    assert model.cfg.n_layers == TINY_LLAMA_DIMS.n_layers
    assert model.device == torch.device("cpu")


def test_gemma_uses_gemmascope_hooks_and_tokenizer_matches(tiny_gemma: Any) -> None:
    transcoders = _transcoder_set(tiny_gemma)
    assert transcoders.feature_input_hook == "ln2.hook_normalized"
    assert transcoders.feature_output_hook == "hook_mlp_out"
    assert tiny_gemma.cfg.original_architecture == "Gemma2ForCausalLM"
    assert len(tiny_gemma.tokenizer) == TINY_GEMMA2_DIMS.vocab_size


def test_features_per_token_is_calibrated(tiny_gemma: Any) -> None:
    # On the calibration text the thresholds keep ``features_per_token`` (default 16) features
    # per layer and non-BOS position on average -- exactly, but for rounding at the threshold.
    tokens = tiny_gemma.ensure_tokenized(catalogue._CALIBRATION_TEXT)
    _, acts = tiny_gemma.get_activations(tokens)
    n_pos = len(tokens) - 1
    n_active = int((acts[:, 1:] > 0).sum())
    assert abs(n_active - TINY_GEMMA2_DIMS.n_layers * 16 * n_pos) <= 2

    llama = build_replacement_model(TINY_LLAMA_DIMS, device="cpu", features_per_token=4)
    _, acts = llama.get_activations(llama.ensure_tokenized(PROMPT))
    per_token = (acts[:, 1:] > 0).sum(-1).float()
    assert 1 <= float(per_token.mean()) <= 16
    thresholds = [tc.activation_function.threshold for tc in _transcoder_set(llama)]
    assert all(bool((t > 0).all()) for t in thresholds)


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "torch.bfloat16"])
def test_model_has_requested_dtype(dtype: str) -> None:
    model = build_replacement_model(TINY_LLAMA_DIMS, device="cpu", dtype=dtype)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model._module.parameters()} == {torch.bfloat16}
    assert _transcoder_set(model)[0].W_enc.dtype == torch.bfloat16


def test_dtype_object_and_float32_default(tiny_gemma: Any) -> None:
    assert tiny_gemma.dtype == torch.float32
    model = build_replacement_model(TINY_LLAMA_DIMS, device="cpu", dtype=torch.float16)
    assert model.dtype == torch.float16
    assert _transcoder_set(model)[1].b_dec.dtype == torch.float16


def test_build_is_deterministic_and_keeps_global_rng() -> None:
    torch.manual_seed(1234)
    rng_before = torch.random.get_rng_state()
    first = _state(build_replacement_model(TINY_LLAMA_DIMS, device="cpu", seed=7))
    assert torch.equal(torch.random.get_rng_state(), rng_before)

    second = _state(build_replacement_model(TINY_LLAMA_DIMS, device="cpu", seed=7))
    other = _state(build_replacement_model(TINY_LLAMA_DIMS, device="cpu", seed=8))
    assert first.keys() == second.keys() == other.keys()
    assert any(name.startswith("transcoders.") for name in first)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert not torch.equal(
        first["transcoders.transcoders.0.W_enc"], other["transcoders.transcoders.0.W_enc"]
    )


def test_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert testing.default_device() == "cpu"
    model = build_replacement_model(TINY_LLAMA_DIMS)
    assert model.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert testing.default_device() == "cuda"


def test_medium_model_builds_in_place_with_the_stated_sizes() -> None:
    # GEMMA_2_2B_DIMS is far too big for a CPU test; a medium model still shows that building
    # is direct (no meta tensors left) and that the sizes come out as stated.
    model = build_replacement_model(MEDIUM_DIMS, device="cpu")

    params = dict(model._module.named_parameters())
    assert all(p.device.type == "cpu" for p in params.values())
    n_transcoder = sum(p.numel() for n, p in params.items() if n.startswith("transcoders."))
    n_model = sum(p.numel() for n, p in params.items() if not n.startswith("transcoders."))
    assert n_model == MEDIUM_DIMS.n_model_params
    assert n_transcoder == MEDIUM_DIMS.n_transcoder_params
    assert model.cfg.d_model == 256 and model.cfg.n_key_value_heads == 2


def test_temporary_tokenizer_dir_is_removed_with_the_model() -> None:
    model = build_replacement_model(TINY_LLAMA_DIMS, device="cpu")
    path = model.tokenizer.name_or_path
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    del model
    gc.collect()
    assert not os.path.exists(path)


def test_given_tokenizer_dir_is_used_and_kept(tmp_path: Path) -> None:
    path = write_local_tokenizer(tmp_path / "tok", vocab_size=TINY_LLAMA_DIMS.vocab_size)
    model = build_replacement_model(TINY_LLAMA_DIMS, device="cpu", tokenizer_dir=path)
    assert model.tokenizer.name_or_path == path
    del model
    gc.collect()
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))

    too_big = write_local_tokenizer(tmp_path / "big", vocab_size=TINY_LLAMA_DIMS.vocab_size + 1)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        build_replacement_model(TINY_LLAMA_DIMS, device="cpu", tokenizer_dir=too_big)


def test_module_imports_without_heavy_libraries() -> None:
    # Load the file on its own (not through the package) with the heavy imports blocked.
    code = (
        "import importlib.util, sys\n"
        "for name in ('torch', 'transformers', 'tokenizers', 'circuit_tracer', 'nnsight',\n"
        "             'transformer_lens'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('ct_testing', {testing.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['ct_testing'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert module.is_bundled_model(module.TINY_GEMMA2)\n"
        "assert module.GEMMA_2_2B_DIMS.n_layers == 26\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
