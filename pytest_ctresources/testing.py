"""Small random circuit-tracer models that build fully offline.

This module is public: besides serving the plugin's own tests, it is meant for users' CPU smoke
tests and for GPU tests that need a model of a *real* size without downloading any weights.

It builds :mod:`circuit_tracer` replacement models of four real architectures -- Gemma-2
(``Gemma2ForCausalLM``), Gemma-3 (``Gemma3ForCausalLM``), Llama (``LlamaForCausalLM``) and
Qwen3 (``Qwen3ForCausalLM``) -- with randomly initialised weights, random JumpReLU transcoders
(one per layer, or one cross-layer transcoder), and a small word-level tokenizer written to a
local directory. Nothing touches the Hugging Face Hub. ``*_DIMS`` constants give the published
dimensions of real models (their sources are in ``docs/registry-sources.md``).

Typical use in a CPU smoke test::

    from circuit_tracer import attribute
    from pytest_ctresources.testing import TINY_GEMMA2_DIMS, build_replacement_model

    model = build_replacement_model(TINY_GEMMA2_DIMS, device="cpu")
    graph = attribute("the capital of france is", model, batch_size=8, max_feature_nodes=32)

Bundled names (:data:`TINY_GEMMA2`, :data:`TINY_LLAMA`, :data:`RANDOM_TRANSCODERS`) let an
experiment config refer to these models the way it would refer to real ones::

    MODEL_NAME: ctresources/tiny-gemma-2
    TRANSCODER_SET: ctresources/random-jumprelu

and :func:`build_named_model` turns such a pair into a model.

Heavy libraries (torch, transformers, tokenizers, circuit_tracer) are imported lazily inside
the functions, so importing this module -- and the plugin package -- does not need torch.
The catalogue (names, dimensions) lives in :mod:`pytest_ctresources.bundled.catalogue`, the
builders in :mod:`pytest_ctresources.bundled.builders`; this module is their public face, and
the plugin's own code never imports it.
"""

from __future__ import annotations

from pytest_ctresources.bundled.builders import (
    build_named_model,
    build_replacement_model,
    default_device,
    write_local_tokenizer,
)
from pytest_ctresources.bundled.catalogue import (
    BUNDLED_MODELS,
    BUNDLED_TRANSCODER_SETS,
    DEFAULT_FEATURES_PER_TOKEN,
    GEMMA_2_2B_CLT_DIMS,
    GEMMA_2_2B_DIMS,
    GEMMA_2_9B_DIMS,
    GEMMA_2_27B_DIMS,
    GEMMA_3_1B_DIMS,
    GEMMA_3_4B_DIMS,
    GEMMA_3_12B_DIMS,
    GEMMA_3_270M_DIMS,
    LLAMA_3_1_8B_DIMS,
    LLAMA_3_2_1B_DIMS,
    LLAMA_3_2_3B_CLT_DIMS,
    LLAMA_3_2_3B_DIMS,
    QWEN3_0_6B_DIMS,
    QWEN3_1_7B_CLT_DIMS,
    QWEN3_1_7B_DIMS,
    QWEN3_4B_DIMS,
    QWEN3_8B_DIMS,
    RANDOM_GEMMA_2_2B,
    RANDOM_GEMMA_2_2B_CLT,
    RANDOM_GEMMA_3_4B,
    RANDOM_LLAMA_3_2_1B,
    RANDOM_TRANSCODERS,
    TINY_GEMMA2,
    TINY_GEMMA2_DIMS,
    TINY_LLAMA,
    TINY_LLAMA_DIMS,
    TINYLLAMA_1_1B_DIMS,
    Architecture,
    ModelDims,
    default_hooks,
    is_bundled_model,
    model_dims_of,
)

__all__ = [
    "BUNDLED_MODELS",
    "BUNDLED_TRANSCODER_SETS",
    "DEFAULT_FEATURES_PER_TOKEN",
    "GEMMA_2_2B_CLT_DIMS",
    "GEMMA_2_2B_DIMS",
    "GEMMA_2_9B_DIMS",
    "GEMMA_2_27B_DIMS",
    "GEMMA_3_1B_DIMS",
    "GEMMA_3_4B_DIMS",
    "GEMMA_3_12B_DIMS",
    "GEMMA_3_270M_DIMS",
    "LLAMA_3_1_8B_DIMS",
    "LLAMA_3_2_1B_DIMS",
    "LLAMA_3_2_3B_CLT_DIMS",
    "LLAMA_3_2_3B_DIMS",
    "QWEN3_0_6B_DIMS",
    "QWEN3_1_7B_CLT_DIMS",
    "QWEN3_1_7B_DIMS",
    "QWEN3_4B_DIMS",
    "QWEN3_8B_DIMS",
    "RANDOM_GEMMA_2_2B",
    "RANDOM_GEMMA_2_2B_CLT",
    "RANDOM_GEMMA_3_4B",
    "RANDOM_LLAMA_3_2_1B",
    "RANDOM_TRANSCODERS",
    "TINYLLAMA_1_1B_DIMS",
    "TINY_GEMMA2",
    "TINY_GEMMA2_DIMS",
    "TINY_LLAMA",
    "TINY_LLAMA_DIMS",
    "Architecture",
    "ModelDims",
    "build_named_model",
    "build_replacement_model",
    "default_device",
    "default_hooks",
    "is_bundled_model",
    "model_dims_of",
    "write_local_tokenizer",
]
