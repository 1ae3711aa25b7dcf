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
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    from circuit_tracer.replacement_model.replacement_model_nnsight import (
        NNSightReplacementModel,
    )
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.transcoder import TranscoderSet
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder

    #: What the builders return: one of circuit-tracer's two backend classes. (circuit-tracer's
    #: ``ReplacementModel`` is only a factory; its ``from_*`` methods return these classes.)
    AnyReplacementModel: TypeAlias = NNSightReplacementModel | TransformerLensReplacementModel

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

#: Name of the bundled tiny random Gemma-2 model (for ``MODEL_NAME`` in experiment configs).
TINY_GEMMA2: Final = "ctresources/tiny-gemma-2"
#: Name of the bundled tiny random Llama model.
TINY_LLAMA: Final = "ctresources/tiny-llama"
#: Random weights of real gemma-2-2b dimensions (offline): for capacity tests and benchmarks.
RANDOM_GEMMA_2_2B: Final = "ctresources/random-gemma-2-2b"
#: Random gemma-2-2b with one cross-layer transcoder of 16384 features per layer (the size of
#: circuit-tracer's 426k gemma-2-2b CLT).
RANDOM_GEMMA_2_2B_CLT: Final = "ctresources/random-gemma-2-2b-clt"
#: Random weights of real gemma-3-4b (text) dimensions with 16k per-layer transcoders.
RANDOM_GEMMA_3_4B: Final = "ctresources/random-gemma-3-4b"
#: Random weights of real Llama-3.2-1B dimensions with 131k-wide skip transcoders.
RANDOM_LLAMA_3_2_1B: Final = "ctresources/random-llama-3.2-1b"
#: Name of the bundled random JumpReLU transcoder set (for ``TRANSCODER_SET``); it fits any
#: bundled model, because its transcoders are generated to match the model's dimensions.
RANDOM_TRANSCODERS: Final = "ctresources/random-jumprelu"

#: Architectures :func:`build_replacement_model` can build.
Architecture = Literal["gemma2", "gemma3", "llama", "qwen3"]

_HF_ARCHITECTURE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "llama": "LlamaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
)
#: Whether an architecture's random model ties its embeddings when ``ModelDims`` does not say:
#: Gemma's and Qwen3's small models do; the Llama builder never did (Llama-3.2-1B's measured
#: points were taken untied).
_TIED_BY_DEFAULT: Final[Mapping[str, bool]] = MappingProxyType(
    {"gemma2": True, "gemma3": True, "llama": False, "qwen3": True}
)

# Hook points the transcoders read from / write to, per architecture. They mirror the public
# transcoders circuit-tracer ships configs for, so the random models exercise the same nnsight
# code paths as real runs: GemmaScope (gemma-2-2b) reads the normalised MLP input
# ("ln2.hook_normalized", resolved through nnsight's ``.source`` tracing inside the RMSNorm);
# the Llama transcoders read the residual stream before the MLP. Both write the MLP output.
_DEFAULT_HOOKS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "gemma2": ("ln2.hook_normalized", "hook_mlp_out"),
        # Gemma-3 (text): the MLP input, as circuit-tracer's Gemma3 mapping names it.
        "gemma3": ("mlp.hook_in", "hook_mlp_out"),
        "llama": ("hook_resid_mid", "hook_mlp_out"),
        # Qwen3: circuit-tracer's mapping knows only the MLP's input and output, which the
        # mwhanna/qwen3-* transcoders read and write.
        "qwen3": ("mlp.hook_in", "mlp.hook_out"),
    }
)

# circuit-tracer backends the builders support.
_BACKENDS: Final = ("nnsight", "transformerlens")

# Special tokens and their ids. The ids match Gemma's (pad 0, eos 1, bos 2, unk 3), so code
# that hard-codes Gemma's special ids behaves the same on the random models. BOS must not be id
# 0: circuit-tracer picks the token it prepends with ``filter(None, ...)``, which skips id 0.
_PAD, _EOS, _BOS, _UNK = "<pad>", "<eos>", "<bos>", "<unk>"
_SPECIAL_TOKENS: Final = (_PAD, _EOS, _BOS, _UNK)
_PAD_ID, _EOS_ID, _BOS_ID = 0, 1, 2

# Common English words (plus punctuation and digits, which the whitespace pre-tokenizer splits
# off as separate tokens), so that ordinary prompts in tests tokenise without <unk>.
_WORDS: Final = tuple(
    """
    the a an of and or but to in on at by for with from into about as is are was were be been
    being am do does did done have has had having will would can could shall should may might
    must not no yes all any some many much more most few less least each every both either
    neither other another such same own only very too so than then there here when where why
    how what which who whom whose that this these those it its he him his she her hers they
    them their we us our you your i me my mine one two three four five six seven eight nine ten
    first second third last next new old good bad great small big large long short high low
    right left early late young little own important public able best better sure free full
    real whole true false hot cold warm dark light red blue green black white city country
    capital france paris germany berlin italy rome spain madrid england london japan tokyo
    china beijing river sea mountain world state house home school water fire earth air sun
    moon star time year day week month night morning evening man woman child people person
    family friend name word number part place case point group problem fact hand eye head face
    door room car book story game money work job life way thing answer question idea reason
    say said go went gone get got make made know knew think thought take took see saw come
    came want look use find found give gave tell told ask asked work seem feel try leave call
    keep let begin began show hear play run move live believe bring happen write sit stand
    lose pay meet include continue set learn change lead understand watch follow stop create
    speak read spend grow open walk win offer remember love consider appear buy wait serve die
    send expect build stay fall cut reach kill remain eat drink sleep sing dance fly swim
    quick brown fox jumps over lazy dog cat bird fish tree flower apple bread milk tea coffee
    if because while after before during until since though although up down out off again
    once now just also still even never always often sometimes well back away together
    . , ? ! ' " : ; - ( ) 0 1 2 3 4 5 6 7 8 9
    """.split()
)
_CALIBRATION_TEXT: Final = (
    "the capital of france is paris and the capital of germany is berlin . "
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun . "
    "people often ask why the sea is blue , but few know the answer ."
)

#: Active transcoder features per layer and token the random transcoders are calibrated to
#: (:func:`build_replacement_model`'s ``features_per_token``); about what random prompts get.
DEFAULT_FEATURES_PER_TOKEN: Final = 16

#: Vocabulary size of the bundled tiny models: a power of two above the word list's size, so
#: every token the tokenizer can produce is a valid model id.
_TINY_VOCAB_SIZE: Final = 512


def _tokenizer_vocab() -> list[str]:
    """Return the tokenizer's vocabulary in id order: specials first, then unique words."""
    vocab: list[str] = list(_SPECIAL_TOKENS)
    seen = set(vocab)
    for word in _WORDS:
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab


@dataclass(frozen=True)
class ModelDims:
    """Dimensions of a random model and of its per-layer transcoders.

    Attributes:
        n_layers: Number of transformer blocks (and of transcoders, one per block).
        d_model: Width of the residual stream.
        d_mlp: Hidden width of each (gated) MLP.
        vocab_size: Model vocabulary size. The generated tokenizer is padded with
            ``<unusedN>`` tokens up to this size, so tokenizer and model agree (circuit-tracer
            treats logit ids at or above the tokenizer's size as "virtual" targets).
        n_heads: Number of attention (query) heads.
        n_kv_heads: Number of key/value heads (grouped-query attention); divides ``n_heads``.
        head_dim: Width of each attention head.
        d_transcoder: Number of features of each transcoder.
        architecture: ``"gemma2"``, ``"gemma3"`` (text-only ``Gemma3ForCausalLM``, nnsight
            backend only), ``"llama"`` or ``"qwen3"`` (nnsight backend only).
        max_position: Maximum sequence length the model is configured for.
        skip_connection: Whether each transcoder has a linear skip connection
            (``W_skip``, d_model x d_model), as the llama-3.2-1b 131k transcoders do.
        cross_layer: One cross-layer transcoder (CLT: the features of layer l write to every
            later layer) instead of one transcoder per layer.
        tied_embeddings: Whether the unembedding shares the embedding matrix; None takes the
            architecture's default (tied for Gemma and Qwen3, untied for Llama).
    """

    n_layers: int
    d_model: int
    d_mlp: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_transcoder: int
    architecture: Architecture
    max_position: int = 512
    skip_connection: bool = False
    cross_layer: bool = False
    tied_embeddings: bool | None = None

    def __post_init__(self) -> None:
        if self.architecture not in _HF_ARCHITECTURE:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; "
                f"known: {', '.join(sorted(_HF_ARCHITECTURE))}"
            )
        for field_name in (
            "n_layers",
            "d_model",
            "d_mlp",
            "vocab_size",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_transcoder",
            "max_position",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelDims.{field_name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.vocab_size < len(_tokenizer_vocab()):
            # The generated tokenizer always holds the specials and the word list; a smaller
            # model vocabulary would produce out-of-range token ids (a device-side assert on GPU).
            raise ValueError(
                f"vocab_size must be at least {len(_tokenizer_vocab())} (the size of the "
                f"generated tokenizer), got {self.vocab_size}"
            )

    @property
    def ties_embeddings(self) -> bool:
        """Whether the built model shares its embedding and unembedding matrices."""
        if self.tied_embeddings is None:
            return _TIED_BY_DEFAULT[self.architecture]
        return self.tied_embeddings

    @property
    def n_model_params(self) -> int:
        """Number of parameters of the transformer (embeddings counted once if tied)."""
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.d_model * self.d_mlp
        n_norms = 2 if self.architecture in ("llama", "qwen3") else 4
        per_layer = attn + mlp + n_norms * self.d_model
        if self.architecture in ("gemma3", "qwen3"):
            per_layer += 2 * self.head_dim  # q_norm and k_norm
        embeddings = self.vocab_size * self.d_model
        if not self.ties_embeddings:
            embeddings *= 2
        return self.n_layers * per_layer + embeddings + self.d_model

    @property
    def n_transcoder_params(self) -> int:
        """Number of parameters of all transcoders (encoders, decoders, biases, thresholds)."""
        n, d_tc, d = self.n_layers, self.d_transcoder, self.d_model
        # Per layer: encoder, b_enc, threshold, b_dec, and W_skip if any.
        per_layer = d_tc * d + 2 * d_tc + d + (d * d if self.skip_connection else 0)
        # Decoders: a CLT's layer-l features write to the n - l layers from l on.
        decoder_layers = n * (n + 1) // 2 if self.cross_layer else n
        return n * per_layer + decoder_layers * d_tc * d


#: Tiny Gemma-2: attribution on CPU takes a fraction of a second.
TINY_GEMMA2_DIMS: Final = ModelDims(
    n_layers=2,
    d_model=32,
    d_mlp=64,
    vocab_size=_TINY_VOCAB_SIZE,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_transcoder=128,
    architecture="gemma2",
)
#: Tiny Llama with the same dimensions as :data:`TINY_GEMMA2_DIMS`.
TINY_LLAMA_DIMS: Final = dataclasses.replace(TINY_GEMMA2_DIMS, architecture="llama")
#: The real gemma-2-2b dimensions with GemmaScope-sized (16k) transcoders, for GPU tests that
#: need realistic memory use and speed. About 2.6e9 model plus 2.0e9 transcoder parameters:
#: ~18 GB in float32, ~9 GB in bfloat16. Never build this on a CPU.
GEMMA_2_2B_DIMS: Final = ModelDims(
    n_layers=26,
    d_model=2304,
    d_mlp=9216,
    vocab_size=256000,
    n_heads=8,
    n_kv_heads=4,
    head_dim=256,
    d_transcoder=16384,
    architecture="gemma2",
    max_position=8192,
)

#: gemma-2-2b with a cross-layer transcoder of 16384 features per layer (426k in all):
#: 14.2e9 transcoder parameters, ~28 GB in bfloat16. GPU only.
GEMMA_2_2B_CLT_DIMS: Final = dataclasses.replace(GEMMA_2_2B_DIMS, cross_layer=True)
#: gemma-3-4b's text model (google/gemma-3-4b-pt ``text_config``) with 16k transcoders.
#: GPU only.
GEMMA_3_4B_DIMS: Final = ModelDims(
    n_layers=34,
    d_model=2560,
    d_mlp=10240,
    vocab_size=262208,
    n_heads=8,
    n_kv_heads=4,
    head_dim=256,
    d_transcoder=16384,
    architecture="gemma3",
    max_position=8192,
)
#: Llama-3.2-1B with 131072-wide skip transcoders (about 8.6e9 transcoder parameters). The
#: random model does not tie its embeddings (the real one does): 0.26e9 more parameters, no
#: other difference in memory. GPU only.
LLAMA_3_2_1B_DIMS: Final = ModelDims(
    n_layers=16,
    d_model=2048,
    d_mlp=8192,
    vocab_size=128256,
    n_heads=32,
    n_kv_heads=8,
    head_dim=64,
    d_transcoder=131072,
    architecture="llama",
    max_position=8192,
    skip_connection=True,
)


def _published(
    architecture: Architecture,
    n_layers: int,
    d_model: int,
    d_mlp: int,
    vocab_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    tied: bool,
    d_transcoder: int = 16384,
) -> ModelDims:
    """A published model's dimensions (its ``config.json``) with 16k per-layer transcoders."""
    return ModelDims(
        n_layers=n_layers,
        d_model=d_model,
        d_mlp=d_mlp,
        vocab_size=vocab_size,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_transcoder=d_transcoder,
        architecture=architecture,
        max_position=8192,
        tied_embeddings=tied,
    )


# Published dimensions of the models the estimator is fitted and validated on
# (docs/estimator.md), with random per-layer transcoders of 16k features unless named
# otherwise; the sources of every value are in docs/registry-sources.md. All GPU only.
#: google/gemma-2-9b.
GEMMA_2_9B_DIMS: Final = _published("gemma2", 42, 3584, 14336, 256000, 16, 8, 256, tied=True)
#: google/gemma-2-27b (about 27e9 parameters: 54 GB in bfloat16).
GEMMA_2_27B_DIMS: Final = _published("gemma2", 46, 4608, 36864, 256000, 32, 16, 128, tied=True)
#: google/gemma-3-270m.
GEMMA_3_270M_DIMS: Final = _published("gemma3", 18, 640, 2048, 262144, 4, 1, 256, tied=True)
#: google/gemma-3-1b-pt.
GEMMA_3_1B_DIMS: Final = _published("gemma3", 26, 1152, 6912, 262144, 4, 1, 256, tied=True)
#: google/gemma-3-12b-pt's text model.
GEMMA_3_12B_DIMS: Final = _published("gemma3", 48, 3840, 15360, 262208, 16, 8, 256, tied=True)
#: meta-llama/Llama-3.2-3B, per-layer transcoders without a skip connection.
LLAMA_3_2_3B_DIMS: Final = _published("llama", 28, 3072, 8192, 128256, 24, 8, 128, tied=True)
#: Llama-3.2-3B with a cross-layer transcoder of 8192 features per layer.
LLAMA_3_2_3B_CLT_DIMS: Final = dataclasses.replace(
    LLAMA_3_2_3B_DIMS, d_transcoder=8192, cross_layer=True
)
#: meta-llama/Llama-3.1-8B (untied embeddings), per-layer transcoders without skip.
LLAMA_3_1_8B_DIMS: Final = _published("llama", 32, 4096, 14336, 128256, 32, 8, 128, tied=False)
#: Qwen/Qwen3-0.6B with transcoders as wide as mwhanna/qwen3-0.6b-transcoders-lowl0 (163840).
QWEN3_0_6B_DIMS: Final = _published(
    "qwen3", 28, 1024, 3072, 151936, 16, 8, 128, tied=True, d_transcoder=163840
)
#: Qwen/Qwen3-1.7B.
QWEN3_1_7B_DIMS: Final = _published("qwen3", 28, 2048, 6144, 151936, 16, 8, 128, tied=True)
#: Qwen3-1.7B with a cross-layer transcoder of 4096 features per layer.
QWEN3_1_7B_CLT_DIMS: Final = dataclasses.replace(
    QWEN3_1_7B_DIMS, d_transcoder=4096, cross_layer=True
)
#: Qwen/Qwen3-4B.
QWEN3_4B_DIMS: Final = _published("qwen3", 36, 2560, 9728, 151936, 32, 8, 128, tied=True)
#: Qwen/Qwen3-8B (untied embeddings).
QWEN3_8B_DIMS: Final = _published("qwen3", 36, 4096, 12288, 151936, 32, 8, 128, tied=False)

#: Bundled model names and their dimensions (read-only).
BUNDLED_MODELS: Final[Mapping[str, ModelDims]] = MappingProxyType(
    {
        TINY_GEMMA2: TINY_GEMMA2_DIMS,
        TINY_LLAMA: TINY_LLAMA_DIMS,
        RANDOM_GEMMA_2_2B: GEMMA_2_2B_DIMS,
        RANDOM_GEMMA_2_2B_CLT: GEMMA_2_2B_CLT_DIMS,
        RANDOM_GEMMA_3_4B: GEMMA_3_4B_DIMS,
        RANDOM_LLAMA_3_2_1B: LLAMA_3_2_1B_DIMS,
        "ctresources/random-gemma-2-9b": GEMMA_2_9B_DIMS,
        "ctresources/random-gemma-2-27b": GEMMA_2_27B_DIMS,
        "ctresources/random-gemma-3-270m": GEMMA_3_270M_DIMS,
        "ctresources/random-gemma-3-1b": GEMMA_3_1B_DIMS,
        "ctresources/random-gemma-3-12b": GEMMA_3_12B_DIMS,
        "ctresources/random-llama-3.2-3b": LLAMA_3_2_3B_DIMS,
        "ctresources/random-llama-3.2-3b-clt": LLAMA_3_2_3B_CLT_DIMS,
        "ctresources/random-llama-3.1-8b": LLAMA_3_1_8B_DIMS,
        "ctresources/random-qwen3-0.6b": QWEN3_0_6B_DIMS,
        "ctresources/random-qwen3-1.7b": QWEN3_1_7B_DIMS,
        "ctresources/random-qwen3-1.7b-clt": QWEN3_1_7B_CLT_DIMS,
        "ctresources/random-qwen3-4b": QWEN3_4B_DIMS,
        "ctresources/random-qwen3-8b": QWEN3_8B_DIMS,
    }
)
#: Bundled transcoder-set names.
BUNDLED_TRANSCODER_SETS: Final[frozenset[str]] = frozenset({RANDOM_TRANSCODERS})


def is_bundled_model(model_name: str) -> bool:
    """Return whether ``model_name`` names one of the bundled random models."""
    return model_name in BUNDLED_MODELS


def model_dims_of(model_name: str) -> ModelDims:
    """Return the dimensions of the bundled model ``model_name``.

    Raises:
        ValueError: ``model_name`` is not a bundled model; the message lists the known names.
    """
    try:
        return BUNDLED_MODELS[model_name]
    except KeyError:
        # ``from None``: the KeyError adds nothing; callers want one clear ValueError.
        raise ValueError(
            f"unknown bundled model {model_name!r}; known: {', '.join(sorted(BUNDLED_MODELS))}"
        ) from None


def default_device() -> str:
    """Return ``"cuda"`` when a CUDA GPU is available, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def write_local_tokenizer(
    directory: str | os.PathLike[str], *, vocab_size: int | None = None
) -> str:
    """Write a word-level Hugging Face tokenizer into ``directory`` and return its path.

    The tokenizer knows a few hundred common English words, punctuation and digits; it
    lower-cases its input, splits on whitespace and punctuation, maps unknown words to
    ``<unk>``, and prepends ``<bos>`` when called with ``add_special_tokens=True`` (as Gemma's
    and Llama's tokenizers do). Special tokens and ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
    ``<unk>`` 3. Load it with ``transformers.AutoTokenizer.from_pretrained(directory)``.

    Args:
        directory: Where to write ``tokenizer.json`` and its configuration files; created if
            missing.
        vocab_size: If given, pad the vocabulary with ``<unusedN>`` tokens to exactly this
            size, so that the tokenizer's size equals a model's vocabulary size.

    Returns:
        ``directory`` as a string.

    Raises:
        ValueError: ``vocab_size`` is smaller than the word list.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = _tokenizer_vocab()
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size must be at least {len(vocab)}, got {vocab_size}")
        # Filler entries make every model id decodable (and not "virtual" to circuit-tracer).
        vocab += [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
    tokenizer = Tokenizer(
        models.WordLevel(vocab={word: i for i, word in enumerate(vocab)}, unk_token=_UNK)
    )
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A", pair=f"{_BOS} $A $B:1", special_tokens=[(_BOS, _BOS_ID)]
    )
    fast = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        unk_token=_UNK,
    )
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def _transformers() -> Any:
    """Import :mod:`transformers`, typed as ``Any``.

    transformers ships ``py.typed`` but leaves most constructors unannotated, so mypy --strict
    rejects calls into it when it can see the package; going through ``Any`` works whether or
    not mypy is configured to see it.
    """
    import transformers

    return transformers


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Turn ``"bfloat16"``, ``"bf16"``, ``"torch.float16"``, ... or a dtype into a float dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
        name = dtype.lower().removeprefix("torch.")
        candidate = getattr(torch, aliases.get(name, name), None)
        if not isinstance(candidate, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        resolved = candidate
    if not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {resolved}")
    return resolved


def _hf_config(dims: ModelDims, tokenizer_dir: str, dtype: torch.dtype) -> Any:
    """Build the Hugging Face config of a random model with ``dims``."""
    common: dict[str, Any] = {
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.d_model,
        "intermediate_size": dims.d_mlp,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.head_dim,
        "max_position_embeddings": dims.max_position,
        "pad_token_id": _PAD_ID,
        "eos_token_id": _EOS_ID,
        "bos_token_id": _BOS_ID,
        "initializer_range": 0.02,
        "tie_word_embeddings": dims.ties_embeddings,
        # HF's ``from_config`` creates the parameters in this dtype (it sets torch's default
        # dtype while building), so nothing is ever materialised in float32 first.
        "dtype": dtype,
    }
    if dims.architecture == "gemma2":
        config = _transformers().Gemma2Config(
            **common,
            # gemma-2-2b's values (query_pre_attn_scalar equals its head_dim, 256).
            query_pre_attn_scalar=dims.head_dim,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
        )
    elif dims.architecture == "gemma3":
        config = _transformers().Gemma3TextConfig(
            **common,
            # Gemma-3's values: no logit softcapping (QK-norm instead), 512-token local window.
            query_pre_attn_scalar=dims.head_dim,
            sliding_window=512,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
        )
    elif dims.architecture == "qwen3":
        # Qwen3's values: RMSNorm on queries and keys, no attention bias, no sliding window.
        config = _transformers().Qwen3Config(
            **common, rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False
        )
    else:
        config = _transformers().LlamaConfig(**common, rms_norm_eps=1e-5)
    config.architectures = [_HF_ARCHITECTURE[dims.architecture]]
    # circuit-tracer's nnsight ``from_config`` loads the tokenizer from ``_name_or_path`` and
    # uses it as the model name too.
    config._name_or_path = tokenizer_dir
    return config


def _random_transcoders(
    dims: ModelDims,
    *,
    device: torch.device,
    dtype: torch.dtype,
    feature_input_hook: str,
    feature_output_hook: str,
) -> TranscoderSet | CrossLayerTranscoder:
    """Create one random JumpReLU transcoder per layer (a CLT for ``dims.cross_layer``),
    directly on ``device`` in ``dtype``.

    The initialisation follows circuit-tracer's own tests: He-uniform encoder rows normalised
    to unit norm, decoder rows normalised to norm 0.01, ``b_enc`` uniform in [-0.5, 0] and
    ``b_dec`` uniform in [-0.01, 0.01]. Thresholds start at zero and are calibrated later by
    :func:`_calibrate_thresholds`, once the model can produce the transcoders' inputs.
    """
    import torch
    from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from torch import nn

    if dims.cross_layer:
        return _random_clt(
            dims,
            device=device,
            dtype=dtype,
            feature_input_hook=feature_input_hook,
            feature_output_hook=feature_output_hook,
        )
    transcoders = {}
    for layer in range(dims.n_layers):
        threshold = torch.zeros(dims.d_transcoder, device=device, dtype=dtype)
        transcoder = SingleLayerTranscoder(
            dims.d_model,
            dims.d_transcoder,
            JumpReLU(threshold, bandwidth=0.1),
            layer,
            skip_connection=dims.skip_connection,
            device=device,
            dtype=dtype,
        )
        with torch.no_grad():
            nn.init.kaiming_uniform_(transcoder.W_enc, mode="fan_in", nonlinearity="linear")
            transcoder.W_enc.div_(transcoder.W_enc.norm(dim=-1, keepdim=True))
            nn.init.kaiming_uniform_(transcoder.W_dec, mode="fan_in", nonlinearity="linear")
            transcoder.W_dec.div_(transcoder.W_dec.norm(dim=-1, keepdim=True)).mul_(0.01)
            nn.init.uniform_(transcoder.b_enc, -0.5, 0.0)
            nn.init.uniform_(transcoder.b_dec, -0.01, 0.01)
            if transcoder.W_skip is not None:
                # A small linear path, like a trained skip connection next to the features.
                nn.init.normal_(transcoder.W_skip, std=0.01 / dims.d_model**0.5)
        transcoders[layer] = transcoder
    return TranscoderSet(
        transcoders,
        feature_input_hook=feature_input_hook,
        feature_output_hook=feature_output_hook,
        # A scan name keeps circuit-tracer from warning that graphs cannot be uploaded.
        scan=RANDOM_TRANSCODERS,
    )


def _random_clt(
    dims: ModelDims,
    *,
    device: torch.device,
    dtype: torch.dtype,
    feature_input_hook: str,
    feature_output_hook: str,
) -> CrossLayerTranscoder:
    """A random JumpReLU cross-layer transcoder, initialised as :func:`_random_transcoders`
    initialises per-layer ones (every decoder block normalised to norm 0.01)."""
    import torch
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
    from torch import nn

    clt = CrossLayerTranscoder(
        dims.n_layers,
        dims.d_transcoder,
        dims.d_model,
        activation_function="jump_relu",
        skip_connection=dims.skip_connection,
        lazy_decoder=False,
        feature_input_hook=feature_input_hook,
        feature_output_hook=feature_output_hook,
        scan=RANDOM_TRANSCODERS,
        device=device,
        dtype=dtype,
    )
    with torch.no_grad():
        for layer in range(dims.n_layers):
            encoder = clt.W_enc[layer]
            nn.init.kaiming_uniform_(encoder, mode="fan_in", nonlinearity="linear")
            encoder.div_(encoder.norm(dim=-1, keepdim=True))
        for decoder in clt.W_dec:
            nn.init.kaiming_uniform_(decoder, mode="fan_in", nonlinearity="linear")
            decoder.div_(decoder.norm(dim=-1, keepdim=True)).mul_(0.01)
        nn.init.uniform_(clt.b_enc, -0.5, 0.0)
        nn.init.uniform_(clt.b_dec, -0.01, 0.01)
        if clt.W_skip is not None:
            nn.init.normal_(clt.W_skip, std=0.01 / dims.d_model**0.5)
    return clt


def _calibrate_thresholds(
    model: AnyReplacementModel,
    transcoders: TranscoderSet | CrossLayerTranscoder,
    features_per_token: int,
) -> None:
    """Scale encoders and set JumpReLU thresholds from one forward pass over a fixed text.

    A random transcoder's pre-activations scale with its input, and the inputs differ a lot
    between architectures and hook points (Llama's residual stream is ~50x smaller than
    Gemma's normalised MLP input). So, per layer: rescale ``W_enc`` to make ``W_enc @ x`` unit
    variance, then pick the threshold that keeps about ``features_per_token`` features active
    per token on the calibration text. Without this, either nothing fires or everything does.
    The transcoders only read the model's activations, so one pass gives every layer's input.
    """
    import torch

    # ``ensure_tokenized`` prepends <bos>, exactly as attribution does.
    tokens = model.ensure_tokenized(_CALIBRATION_TEXT)
    logits, pre_acts = model.get_activations(tokens, apply_activation_function=False)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("the random model produced non-finite logits; try another dtype")
    # Per layer: (encoder weights, encoder bias, JumpReLU threshold), views that can be
    # changed in place, for a TranscoderSet and a CLT alike.
    from circuit_tracer.transcoder import TranscoderSet as PerLayer

    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    if isinstance(transcoders, PerLayer):
        parts = [(t.W_enc, t.b_enc, t.activation_function.threshold) for t in transcoders]
    else:
        clt = transcoders
        threshold_of = clt.activation_function.threshold
        parts = [(clt.W_enc[i], clt.b_enc[i], threshold_of[i]) for i in range(clt.n_layers)]
    with torch.no_grad():
        for layer, (encoder, bias, threshold_param) in enumerate(parts):
            # Position 0 (<bos>) is zeroed by circuit-tracer and never yields features.
            layer_pre = pre_acts[layer, 1:].to(torch.float32)
            b_enc = bias.to(torch.float32)
            projection = layer_pre - b_enc
            scale = 1.0 / projection.std().clamp_min(1e-6)
            scaled = projection * scale + b_enc
            n_active = min(features_per_token * scaled.shape[0], scaled.numel() - 1)
            # The (n_active + 1)-th largest value: JumpReLU keeps values strictly above it.
            kth = torch.topk(scaled.flatten(), n_active + 1).values[-1]
            # JumpReLU thresholds are positive in trained transcoders; keep that invariant.
            threshold = kth.clamp_min(0.0)
            encoder.mul_(scale.to(encoder.dtype))
            threshold_param.fill_(threshold.item())


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's generators for the block, then restore their previous state.

    The caller's global random state is left as it was, so building a model in a test does
    not perturb other seeded code.
    """
    import torch

    cuda_devices: list[int] = []
    if device.type == "cuda":
        cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def build_replacement_model(
    dims: ModelDims,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str | None = None,
    backend: str = "nnsight",
    seed: int = 0,
    tokenizer_dir: str | None = None,
    features_per_token: int = DEFAULT_FEATURES_PER_TOKEN,
    feature_input_hook: str | None = None,
    feature_output_hook: str | None = None,
) -> AnyReplacementModel:
    """Build a random circuit-tracer replacement model with dimensions ``dims``, offline.

    The transformer gets its library's standard random initialisation (normal, std 0.02).
    Its parameters and the transcoders' are created directly on ``device`` in ``dtype``, so a
    model of real size (:data:`GEMMA_2_2B_DIMS`) builds in seconds on a GPU; nothing is staged
    on the CPU first. JumpReLU thresholds are then calibrated with one forward pass (see
    ``features_per_token``), which also checks that the model's logits are finite.

    Args:
        dims: Model and transcoder dimensions, e.g. :data:`TINY_GEMMA2_DIMS`.
        dtype: Parameter dtype: a ``torch.dtype`` or a name such as ``"bfloat16"``.
        device: Where to build; ``None`` means ``"cuda"`` if available, else ``"cpu"``.
        backend: circuit-tracer backend: ``"nnsight"`` (a Hugging Face ``Gemma2ForCausalLM``
            or ``LlamaForCausalLM`` wrapped by nnsight) or ``"transformerlens"`` (a
            ``HookedTransformer`` configured like TransformerLens's own Gemma-2/Llama configs).
        seed: Seed for all random weights; the same seed gives the same model on the same
            device. The caller's global random state is left unchanged.
        tokenizer_dir: Directory holding a tokenizer to use (for instance one written by
            :func:`write_local_tokenizer`); ``None`` writes one, padded to
            ``dims.vocab_size``, to a fresh temporary directory that is removed when the model
            is garbage-collected.
        features_per_token: About how many transcoder features are active per token and layer
            on ordinary text.
        feature_input_hook: Hook the transcoders read; default per architecture
            (``"ln2.hook_normalized"`` for Gemma-2, as GemmaScope; ``"hook_resid_mid"`` for
            Llama).
        feature_output_hook: Hook the transcoders write; default ``"hook_mlp_out"``.

    Returns:
        An ``NNSightReplacementModel`` or ``TransformerLensReplacementModel``, usable with
        ``circuit_tracer.attribute``. ``model.transcoders`` holds the random transcoders (for
        nnsight, wrapped in an nnsight ``Envoy``: the module itself is ``._module``).

    Raises:
        ValueError: Unknown backend or dtype, a non-positive ``features_per_token``, or a
            tokenizer larger than ``dims.vocab_size``.
        RuntimeError: The random model produced non-finite logits (e.g. an unsuitable dtype).
    """
    import torch

    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(_BACKENDS)}")
    if features_per_token <= 0:
        raise ValueError(f"features_per_token must be positive, got {features_per_token}")
    if dims.architecture in ("gemma3", "qwen3") and backend != "nnsight":
        raise ValueError(
            f"{dims.architecture} random models are built for the nnsight backend only"
        )
    torch_dtype = _resolve_dtype(dtype)
    torch_device = torch.device(device if device is not None else default_device())

    owned_tokenizer_dir: str | None = None
    if tokenizer_dir is None:
        owned_tokenizer_dir = tempfile.mkdtemp(prefix="ctresources-tokenizer-")
        try:
            tokenizer_dir = write_local_tokenizer(owned_tokenizer_dir, vocab_size=dims.vocab_size)
        except BaseException:
            shutil.rmtree(owned_tokenizer_dir, ignore_errors=True)
            raise
    else:
        _check_tokenizer_fits(tokenizer_dir, dims.vocab_size)

    default_in, default_out = default_hooks(dims)
    try:
        with _seeded(seed, torch_device):
            # Everything created in this block -- model parameters and buffers, transcoders --
            # is allocated on ``device`` directly, and the libraries' weight init runs there.
            with torch.device(torch_device):
                transcoders = _random_transcoders(
                    dims,
                    device=torch_device,
                    dtype=torch_dtype,
                    feature_input_hook=feature_input_hook or default_in,
                    feature_output_hook=feature_output_hook or default_out,
                )
                model = _from_config(
                    dims, backend, transcoders, tokenizer_dir, torch_dtype, torch_device
                )
            _calibrate_thresholds(model, transcoders, features_per_token)
    except BaseException:
        if owned_tokenizer_dir is not None:
            shutil.rmtree(owned_tokenizer_dir, ignore_errors=True)
        raise
    if owned_tokenizer_dir is not None:
        # The tokenizer is already loaded into memory; the files only need to outlive the
        # model for code that reloads them from ``model.tokenizer.name_or_path``.
        weakref.finalize(model, shutil.rmtree, owned_tokenizer_dir, ignore_errors=True)
    return model


def default_hooks(dims: ModelDims) -> tuple[str, str]:
    """The (input, output) hooks the random transcoders of ``dims`` use, as the public sets
    of that architecture do."""
    default_in, default_out = _DEFAULT_HOOKS[dims.architecture]
    if dims.cross_layer and dims.architecture != "qwen3":
        # circuit-tracer's CLTs (mntss/clt-gemma-2-2b-426k, clt-llama-3.2-1b-524k) read the
        # residual stream before the MLP. (Its CLT does not cast its input to its own dtype,
        # so Gemma-2's float32 normalised MLP input would not work in bfloat16 anyway.)
        # circuit-tracer's Qwen3 mapping has no such hook; its MLP input is in the model dtype.
        default_in = "hook_resid_mid"
    return default_in, default_out


def _check_tokenizer_fits(tokenizer_dir: str, vocab_size: int) -> None:
    """Raise ValueError if the tokenizer in ``tokenizer_dir`` can emit ids >= ``vocab_size``."""
    size = len(_transformers().AutoTokenizer.from_pretrained(tokenizer_dir))
    if size > vocab_size:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir!r} has {size} tokens, more than the model's "
            f"vocab_size {vocab_size}"
        )


def _from_config(
    dims: ModelDims,
    backend: str,
    transcoders: TranscoderSet | CrossLayerTranscoder,
    tokenizer_dir: str,
    dtype: torch.dtype,
    device: torch.device,
) -> AnyReplacementModel:
    """Create the replacement model of ``backend`` around ``transcoders``."""
    from circuit_tracer import ReplacementModel

    # Two literal calls rather than ``backend=backend``: circuit-tracer types the argument as
    # a Literal, which a plain ``str`` does not satisfy.
    model: AnyReplacementModel
    if backend == "nnsight":
        config = _hf_config(dims, tokenizer_dir, dtype)
        model = ReplacementModel.from_config(config, transcoders, backend="nnsight")
    else:
        config = _tl_config(dims, tokenizer_dir, dtype, device)
        model = ReplacementModel.from_config(config, transcoders, backend="transformerlens")
    return model


def _tl_config(
    dims: ModelDims, tokenizer_dir: str, dtype: torch.dtype, device: torch.device
) -> Any:
    """Build the TransformerLens config of a random model with ``dims``.

    TransformerLens hard-codes Gemma-2 configs per Hub model name, so this mirrors its
    gemma-2-2b and generic Llama entries with ``dims`` substituted.
    """
    from transformer_lens import HookedTransformerConfig

    config: dict[str, Any] = {
        "d_model": dims.d_model,
        "d_head": dims.head_dim,
        "n_heads": dims.n_heads,
        "d_mlp": dims.d_mlp,
        "n_layers": dims.n_layers,
        "n_ctx": dims.max_position,
        "d_vocab": dims.vocab_size,
        # TransformerLens uses grouped-query attention whenever this is set, so it must be
        # None for plain multi-head attention.
        "n_key_value_heads": dims.n_kv_heads if dims.n_kv_heads != dims.n_heads else None,
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_dim": dims.head_dim,
        "rotary_base": 10000.0,
        "gated_mlp": True,
        "final_rms": True,
        "initializer_range": 0.02,
        "original_architecture": _HF_ARCHITECTURE[dims.architecture],
        "tokenizer_name": tokenizer_dir,
        "model_name": tokenizer_dir,
        "dtype": dtype,
        "device": str(device),
        # No ``seed``: TransformerLens would reseed Python's, NumPy's and torch's global
        # generators with it; ``_seeded`` seeds torch without leaking state.
    }
    if dims.architecture == "gemma2":
        config |= {
            "eps": 1e-6,
            "act_fn": "gelu_pytorch_tanh",
            "use_attn_scale": True,
            "window_size": 4096,
            "use_local_attn": True,
            "attn_types": ["global", "local"] * (dims.n_layers // 2)
            + ["global"] * (dims.n_layers % 2),
            "attn_scores_soft_cap": 50.0,
            "output_logits_soft_cap": 30.0,
            "use_normalization_before_and_after": True,
        }
    else:
        config |= {"eps": 1e-5, "act_fn": "silu", "rotary_adjacent_pairs": False}
    return HookedTransformerConfig(**config)


def build_named_model(
    model_name: str,
    transcoder_set: str,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str | None = None,
    backend: str = "nnsight",
) -> AnyReplacementModel:
    """Build a bundled random model by name, as an experiment config names them.

    Args:
        model_name: A bundled model name, :data:`TINY_GEMMA2`, :data:`TINY_LLAMA` or
            :data:`RANDOM_GEMMA_2_2B` (real size: build it on a GPU).
        transcoder_set: A bundled transcoder-set name, :data:`RANDOM_TRANSCODERS`.
        dtype: Parameter dtype (see :func:`build_replacement_model`).
        device: Device; ``None`` means CUDA if available, else CPU.
        backend: circuit-tracer backend, ``"nnsight"`` or ``"transformerlens"``.

    Returns:
        The model, built with seed 0 (so the same name always gives the same weights).

    Raises:
        ValueError: An unknown model or transcoder-set name; the message lists known names.
    """
    dims = model_dims_of(model_name)
    if transcoder_set not in BUNDLED_TRANSCODER_SETS:
        raise ValueError(
            f"unknown bundled transcoder set {transcoder_set!r}; "
            f"known: {', '.join(sorted(BUNDLED_TRANSCODER_SETS))}"
        )
    return build_replacement_model(dims, dtype=dtype, device=device, backend=backend)
