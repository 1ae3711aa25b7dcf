"""Building the bundled random models: circuit-tracer ReplacementModels of real
architectures with random weights, random JumpReLU transcoders and a local word-level
tokenizer, fully offline. Heavy libraries (torch, transformers, tokenizers, circuit_tracer) are
imported inside the functions. What the models are (names, dimensions, hooks) is the catalogue,
:mod:`pytest_ctresources.bundled.catalogue`; test authors use :mod:`pytest_ctresources.testing`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

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

from pytest_ctresources.bundled.catalogue import (
    _BACKENDS,
    _BOS,
    _BOS_ID,
    _CALIBRATION_TEXT,
    _EOS,
    _EOS_ID,
    _HF_ARCHITECTURE,
    _PAD,
    _PAD_ID,
    _UNK,
    BUNDLED_TRANSCODER_SETS,
    DEFAULT_FEATURES_PER_TOKEN,
    GEMMA_2_FINAL_SOFTCAP,
    RANDOM_TRANSCODERS,
    ModelDims,
    _tokenizer_vocab,
    default_hooks,
    model_dims_of,
)

#: The prefix of the temporary directory :func:`build_replacement_model` writes a model's
#: tokenizer to when it is given none. That directory is the model's tokenizer name, and its
#: graphs' (``graph.cfg.tokenizer_name``); it is removed with the model.
OWN_TOKENIZER_PREFIX = "ctresources-tokenizer-"


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


@contextmanager
def rewritten_own_tokenizer(tokenizer_name: str, vocab_size: int) -> Iterator[str | None]:
    """A tokenizer name that loads offline, for the block, in place of a builder's that is gone.

    A graph attributed on a bundled model names the model's tokenizer by the temporary
    directory the builder wrote it to, which is removed with the model: once the model is
    gone (evicted from ct_session's cache, or the graph read back from a file), that name
    loads nothing, and transformers takes the missing path for a Hub id and refuses it. This
    writes the same tokenizer again (the same word list padded to ``vocab_size``: the same ids
    and words) to a private temporary directory, yields its path and removes it after the
    block. It yields None where nothing needs writing: the directory still exists, or the
    name is not one a builder made (a Hub id, a directory of the user's).
    """
    path = os.path.normpath(tokenizer_name)
    if os.path.isdir(path) or not os.path.basename(path).startswith(OWN_TOKENIZER_PREFIX):
        yield None
        return
    directory = tempfile.mkdtemp(prefix=OWN_TOKENIZER_PREFIX)
    try:
        yield write_local_tokenizer(directory, vocab_size=vocab_size)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


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
            final_logit_softcapping=GEMMA_2_FINAL_SOFTCAP,
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
    to unit norm, decoder rows normalised to norm 0.01 (every decoder block of a CLT),
    ``b_enc`` uniform in [-0.5, 0] and ``b_dec`` uniform in [-0.01, 0.01]. Thresholds start at
    zero and are calibrated later by :func:`_calibrate_thresholds`, once the model can produce
    the transcoders' inputs.
    """
    import torch
    from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder

    hooks = {"feature_input_hook": feature_input_hook, "feature_output_hook": feature_output_hook}
    if dims.cross_layer:
        clt = CrossLayerTranscoder(
            dims.n_layers,
            dims.d_transcoder,
            dims.d_model,
            activation_function="jump_relu",
            skip_connection=dims.skip_connection,
            lazy_decoder=False,
            scan=RANDOM_TRANSCODERS,
            device=device,
            dtype=dtype,
            **hooks,
        )
        _init_random(clt, clt.W_enc, clt.W_dec, dims.d_model)
        return clt
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
        _init_random(transcoder, [transcoder.W_enc], [transcoder.W_dec], dims.d_model)
        transcoders[layer] = transcoder
    # A scan name keeps circuit-tracer from warning that graphs cannot be uploaded.
    return TranscoderSet(transcoders, scan=RANDOM_TRANSCODERS, **hooks)


def _init_random(
    transcoder: Any,
    encoders: Iterable[torch.Tensor],
    decoders: Iterable[torch.Tensor],
    d_model: int,
) -> None:
    """Initialise one transcoder's (or a CLT's, a block per layer) weights in place, in this
    order, so that a seed gives the same weights."""
    import torch
    from torch import nn

    with torch.no_grad():
        for encoder in encoders:
            nn.init.kaiming_uniform_(encoder, mode="fan_in", nonlinearity="linear")
            encoder.div_(encoder.norm(dim=-1, keepdim=True))
        for decoder in decoders:
            nn.init.kaiming_uniform_(decoder, mode="fan_in", nonlinearity="linear")
            decoder.div_(decoder.norm(dim=-1, keepdim=True)).mul_(0.01)
        nn.init.uniform_(transcoder.b_enc, -0.5, 0.0)
        nn.init.uniform_(transcoder.b_dec, -0.01, 0.01)
        if transcoder.W_skip is not None:
            # A small linear path, like a trained skip connection next to the features.
            nn.init.normal_(transcoder.W_skip, std=0.01 / d_model**0.5)


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
        owned_tokenizer_dir = tempfile.mkdtemp(prefix=OWN_TOKENIZER_PREFIX)
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
            "output_logits_soft_cap": GEMMA_2_FINAL_SOFTCAP,
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
