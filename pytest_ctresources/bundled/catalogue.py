"""The bundled models' catalogue: their names, their dimensions, the hooks their transcoders
use. Importable without torch: the registry (estimator) and the model cache read it; the
builders that turn an entry into a model are :mod:`pytest_ctresources.bundled.builders`,
and :mod:`pytest_ctresources.testing` is the public module for test authors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

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

#: Gemma-2's final logit softcapping (``Gemma2Config``'s default, every published Gemma-2's):
#: the bundled Gemma-2 models are built with it, and the estimator counts the logits' copy.
GEMMA_2_FINAL_SOFTCAP: Final = 30.0

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
class Dims:
    """The dimensions that set a decoder-only model's shape and parameter count (its
    ``config.json``'s): what a model built here (:class:`ModelDims`) and a model the
    estimator sizes (``estimator.estimate.ModelShape``) both are.

    Attributes:
        n_layers: Number of transformer blocks (and of transcoders, one per block).
        d_model: Width of the residual stream.
        d_mlp: Hidden width of each (gated) MLP.
        vocab_size: Model vocabulary size.
        n_heads: Number of attention (query) heads.
        n_kv_heads: Number of key/value heads (grouped-query attention); divides ``n_heads``.
        head_dim: Width of each attention head.
    """

    n_layers: int
    d_model: int
    d_mlp: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    def dims(self) -> dict[str, int]:
        """The dimensions alone, by name (:data:`DIM_NAMES`)."""
        return {name: getattr(self, name) for name in DIM_NAMES}


#: The names of :class:`Dims`' dimensions.
DIM_NAMES: Final = tuple(spec.name for spec in dataclasses.fields(Dims))


def count_transcoder_params(
    n_layers: int,
    d_model: int,
    width: int,
    *,
    cross_layer: bool,
    skip_connection: bool,
    encoders: bool = True,
    decoders: bool = True,
) -> int:
    """Parameters of a model's transcoders of ``width`` features per layer: the encoders, the
    decoders (a CLT's layer-l features write to the n - l layers from l on), ``W_skip`` if any,
    and ``b_enc`` and the threshold per feature and ``b_dec`` per layer. ``encoders`` or
    ``decoders`` False leaves out those matrices (a lazy load keeps them off the GPU). The
    one count: the random models' and the estimator's."""
    n, d, w = n_layers, d_model, width
    encoder = n * w * d if encoders else 0
    decoder = (n * (n + 1) // 2 if cross_layer else n) * w * d if decoders else 0
    skip = n * d * d if skip_connection else 0
    return encoder + decoder + skip + n * (2 * w + d)


def count_params(architecture: str, dims: Mapping[str, int], *, tied: bool) -> int:
    """Parameters of a (bias-free) decoder-only model of ``architecture`` (gemma2, gemma3,
    llama or qwen3) with dimensions ``dims`` (by :data:`DIM_NAMES`). Tied embeddings are
    counted once, as the nnsight backend stores them. The one count: the random models',
    the estimator's registry's and a ``config.json``'s."""
    d_model, head_dim = dims["d_model"], dims["head_dim"]
    attention = d_model * head_dim * (2 * dims["n_heads"] + 2 * dims["n_kv_heads"])
    mlp = 3 * d_model * dims["d_mlp"]
    norms = (2 if architecture in ("llama", "qwen3") else 4) * d_model
    if architecture in ("gemma3", "qwen3"):
        norms += 2 * head_dim  # q_norm and k_norm
    embeddings = dims["vocab_size"] * d_model * (1 if tied else 2)
    return dims["n_layers"] * (attention + mlp + norms) + embeddings + d_model


@dataclass(frozen=True)
class ModelDims(Dims):
    """Dimensions of a random model (:class:`Dims`, in that order) and of its per-layer
    transcoders. The generated tokenizer is padded with ``<unusedN>`` tokens up to
    ``vocab_size``, so tokenizer and model agree (circuit-tracer treats logit ids at or above
    the tokenizer's size as "virtual" targets).

    Attributes:
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
        for field_name in (*DIM_NAMES, "d_transcoder", "max_position"):
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
        return count_params(self.architecture, self.dims(), tied=self.ties_embeddings)

    @property
    def n_transcoder_params(self) -> int:
        """Number of parameters of all transcoders (encoders, decoders, biases, thresholds)."""
        return count_transcoder_params(
            self.n_layers,
            self.d_model,
            self.d_transcoder,
            cross_layer=self.cross_layer,
            skip_connection=self.skip_connection,
        )


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


def _published(architecture: Architecture, *dims: int, tied: bool = True) -> ModelDims:
    """A published model's dimensions (its ``config.json``, in :data:`DIM_NAMES`' order) with
    16k per-layer transcoders."""
    named: dict[str, Any] = dict(zip(DIM_NAMES, dims, strict=True))
    return ModelDims(
        **named,
        d_transcoder=16384,
        architecture=architecture,
        max_position=8192,
        tied_embeddings=tied,
    )


_BASE: Final = {
    "google/gemma-2-2b": _published("gemma2", 26, 2304, 9216, 256000, 8, 4, 256),
    "google/gemma-2-9b": _published("gemma2", 42, 3584, 14336, 256000, 16, 8, 256),
    "google/gemma-3-1b-pt": _published("gemma3", 26, 1152, 6912, 262144, 4, 1, 256),
    "google/gemma-3-4b-pt": _published("gemma3", 34, 2560, 10240, 262208, 8, 4, 256),
    "google/gemma-3-12b-pt": _published("gemma3", 48, 3840, 15360, 262208, 16, 8, 256),
    "google/gemma-2-27b": _published("gemma2", 46, 4608, 36864, 256000, 32, 16, 128),
    "google/gemma-3-270m": _published("gemma3", 18, 640, 2048, 262144, 4, 1, 256),
    "meta-llama/Llama-3.2-1B": _published("llama", 16, 2048, 8192, 128256, 32, 8, 64),
    "meta-llama/Llama-3.2-3B": _published("llama", 28, 3072, 8192, 128256, 24, 8, 128),
    "meta-llama/Llama-3.1-8B": _published("llama", 32, 4096, 14336, 128256, 32, 8, 128, tied=False),
    "Qwen/Qwen3-0.6B": _published("qwen3", 28, 1024, 3072, 151936, 16, 8, 128),
    "Qwen/Qwen3-1.7B": _published("qwen3", 28, 2048, 6144, 151936, 16, 8, 128),
    "Qwen/Qwen3-4B": _published("qwen3", 36, 2560, 9728, 151936, 32, 8, 128),
    "Qwen/Qwen3-8B": _published("qwen3", 36, 4096, 12288, 151936, 32, 8, 128, tied=False),
    "Qwen/Qwen3-14B": _published("qwen3", 40, 5120, 17408, 151936, 40, 8, 128, tied=False),
}
#: Instruction-tuned models and the model each is tuned from (the same dimensions).
_TUNED_FROM: Final = {
    "google/gemma-2-2b-it": "google/gemma-2-2b",
    "google/gemma-2-9b-it": "google/gemma-2-9b",
    "google/gemma-3-1b-it": "google/gemma-3-1b-pt",
    "google/gemma-3-4b-it": "google/gemma-3-4b-pt",
    "google/gemma-3-12b-it": "google/gemma-3-12b-pt",
    "google/gemma-2-27b-it": "google/gemma-2-27b",
    "google/gemma-3-270m-it": "google/gemma-3-270m",
    "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B-Instruct": "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
}

#: The published dimensions of the models circuit-tracer 0.5.0 has transcoders for (their
#: Hugging Face ``config.json``; the text model of the multimodal Gemma-3 4b and 12b), by
#: Hugging Face name, with 16k per-layer transcoders: the one table of them. The estimator's
#: registry shapes them; the random models of real size below are built from them. The
#: sources of every value are in docs/registry-sources.md.
PUBLISHED: Final[Mapping[str, ModelDims]] = MappingProxyType(
    {**_BASE, **{tuned: _BASE[base] for tuned, base in _TUNED_FROM.items()}}
)

# Random models of published dimensions, for the GPU tests and the estimator's measurements
# (docs/estimator.md), with random per-layer transcoders of 16k features unless named
# otherwise. All GPU only.
#: gemma-2-2b with GemmaScope-sized (16k) transcoders, for GPU tests that need realistic
#: memory use and speed. About 2.6e9 model plus 2.0e9 transcoder parameters: ~18 GB in
#: float32, ~9 GB in bfloat16.
GEMMA_2_2B_DIMS: Final = PUBLISHED["google/gemma-2-2b"]
#: gemma-2-2b with a cross-layer transcoder of 16384 features per layer (426k in all):
#: 14.2e9 transcoder parameters, ~28 GB in bfloat16.
GEMMA_2_2B_CLT_DIMS: Final = dataclasses.replace(GEMMA_2_2B_DIMS, cross_layer=True)
#: gemma-3-4b's text model (google/gemma-3-4b-pt ``text_config``).
GEMMA_3_4B_DIMS: Final = PUBLISHED["google/gemma-3-4b-pt"]
#: Llama-3.2-1B with 131072-wide skip transcoders (about 8.6e9 transcoder parameters). The
#: random model does not tie its embeddings (the real one does; the measured points were taken
#: untied): 0.26e9 more parameters, no other difference in memory.
LLAMA_3_2_1B_DIMS: Final = dataclasses.replace(
    PUBLISHED["meta-llama/Llama-3.2-1B"],
    d_transcoder=131072,
    skip_connection=True,
    tied_embeddings=False,
)
#: TinyLlama-1.1B's published shape (22 layers, 32 heads of 64 over 4 KV heads, a 32k
#: vocabulary, untied embeddings) with 32768-wide skip transcoders: the shape the long-prompt
#: measurements were made on (docs/estimator.md). No bundled name: ``bench/pipeline_peaks.py``
#: builds it by this name, the tests estimate its records with it.
TINYLLAMA_1_1B_DIMS: Final = dataclasses.replace(
    LLAMA_3_2_1B_DIMS,
    n_layers=22,
    d_mlp=5632,
    vocab_size=32000,
    n_kv_heads=4,
    d_transcoder=32768,
)
#: google/gemma-2-9b.
GEMMA_2_9B_DIMS: Final = PUBLISHED["google/gemma-2-9b"]
#: google/gemma-2-27b (about 27e9 parameters: 54 GB in bfloat16).
GEMMA_2_27B_DIMS: Final = PUBLISHED["google/gemma-2-27b"]
#: google/gemma-3-270m.
GEMMA_3_270M_DIMS: Final = PUBLISHED["google/gemma-3-270m"]
#: google/gemma-3-1b-pt.
GEMMA_3_1B_DIMS: Final = PUBLISHED["google/gemma-3-1b-pt"]
#: google/gemma-3-12b-pt's text model.
GEMMA_3_12B_DIMS: Final = PUBLISHED["google/gemma-3-12b-pt"]
#: meta-llama/Llama-3.2-3B, per-layer transcoders without a skip connection.
LLAMA_3_2_3B_DIMS: Final = PUBLISHED["meta-llama/Llama-3.2-3B"]
#: Llama-3.2-3B with a cross-layer transcoder of 8192 features per layer.
LLAMA_3_2_3B_CLT_DIMS: Final = dataclasses.replace(
    LLAMA_3_2_3B_DIMS, d_transcoder=8192, cross_layer=True
)
#: meta-llama/Llama-3.1-8B (untied embeddings), per-layer transcoders without skip.
LLAMA_3_1_8B_DIMS: Final = PUBLISHED["meta-llama/Llama-3.1-8B"]
#: Qwen/Qwen3-0.6B with transcoders as wide as mwhanna/qwen3-0.6b-transcoders-lowl0 (163840).
QWEN3_0_6B_DIMS: Final = dataclasses.replace(PUBLISHED["Qwen/Qwen3-0.6B"], d_transcoder=163840)
#: Qwen/Qwen3-1.7B.
QWEN3_1_7B_DIMS: Final = PUBLISHED["Qwen/Qwen3-1.7B"]
#: Qwen3-1.7B with a cross-layer transcoder of 4096 features per layer.
QWEN3_1_7B_CLT_DIMS: Final = dataclasses.replace(
    QWEN3_1_7B_DIMS, d_transcoder=4096, cross_layer=True
)
#: Qwen/Qwen3-4B.
QWEN3_4B_DIMS: Final = PUBLISHED["Qwen/Qwen3-4B"]
#: Qwen/Qwen3-8B (untied embeddings).
QWEN3_8B_DIMS: Final = PUBLISHED["Qwen/Qwen3-8B"]

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
