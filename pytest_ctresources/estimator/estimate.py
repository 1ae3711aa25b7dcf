"""Predict the peak CUDA memory of circuit-tracer's ``attribute()`` before running it.

Pure arithmetic over shapes: no torch import, so the ``ct-resources`` command and the skip
decisions can use it without loading anything. The model follows circuit-tracer 0.5.0's
nnsight backend (``attribution/attribute.py``, ``attribution/context_nnsight.py``,
``replacement_model/replacement_model_nnsight.py``) on transformers 4.57. Every term that
scales with the model's dimensions is derived from that code, and checked by counting every
tensor storage alive during ``attribute()`` on the CPU at small dimensions
(``bench/memory_terms.py``); the GPU measurements only check it and fit what is allocator
behaviour (``docs/estimator.md``). What each term holds:

- **weights**: the model's parameters in the model dtype (and cuBLAS workspaces).
- **transcoders**: the transcoder weights that stay on the GPU. A per-layer set holds
  encoder, decoder (and ``W_skip``) per layer; a cross-layer transcoder's layer-l features
  have decoders to every layer from l on. Sets loaded lazily (safetensors with
  ``lazy_decoder``/``lazy_encoder``) keep those matrices on disk and read rows on demand.
- **setup** (``setup_attribution``, kept for the whole call): encoder and decoder vectors of
  every active feature (a CLT feature has one decoder vector per layer it writes to), the
  error vectors (n_layers x tokens x d_model), token embeddings, one prompt's logits and the
  sparse activation matrix. While it runs, the per-layer lists of those vectors, the MLP
  input and output caches, the reconstruction and one layer's dense pre-activations are
  alive too.
- **forward** (``run_forward_pass``): the model runs on ``batch_size`` copies of the prompt
  with gradients on. Kept for the backward passes, per layer and batch-token
  (:func:`kept_per_batch_token`): the transcoders' input (cached by circuit-tracer; GemmaScope's
  ``ln2.hook_normalized`` is Gemma's float32 normalised MLP input) and their output (a new
  tensor circuit-tracer builds with the skip connection), the attention probabilities that
  the value path's gradient needs (heads x tokens: circuit-tracer detaches the probabilities,
  so autograd saves them for ``probs @ V``), and one float32 scalar per RMSNorm on a live
  gradient path (its detached ``rsqrt``); plus the embeddings and the final norm's output.
  The MLPs' and the queries' and keys' intermediates are not kept: circuit-tracer detaches
  the MLP output and the attention probabilities, so their graphs die. At the end of the
  pass, with all of that alive, the model's output holds the KV cache of every layer (keys
  and values, which ``use_cache`` keeps; Qwen3's keys also keep their float32 ``k_norm``
  input through the autograd graph they carry) and the logits of all copies (Gemma-2's
  final-logit softcap makes two copies alive at once), or, if larger, the last layer's four
  gated-MLP intermediates (:func:`forward_peak_per_batch_token`).
- **backward** (logit and feature attribution): the kept tensors, the row buffer
  (row size x batch), the per-layer gradient gathered at the decoder vectors' positions
  (batch x decoders writing to a layer x d_model: a CLT's last layer receives a decoder from
  every active feature), and, when ``max_feature_nodes`` is below the number of active
  features, the float32 copy of the partial edge matrix that ``compute_partial_influences``
  makes to rank features.
- **attention transient**: eager attention materialises one layer's scores at a time
  (batch x heads x tokens^2). In bf16, at its softmax, the masked scores (2 bytes), the
  float32 copy ``softmax(dtype=float32)`` casts them to (4: torch skips that copy only for
  float16) and the softmax's output (4) are alive before the probabilities (2, counted in
  what is kept) exist: 8 bytes per score beyond what is kept (:data:`ATTENTION_TRANSIENTS`,
  per implementation and dtype). Eager attention's causal mask (batch x tokens^2 in the
  model dtype) is alive through the whole pass. Both count in the forward pass only, against
  the logits (the larger wins): the backward passes re-run no attention (the probabilities
  are detached), and at 1,000 to 4,000 tokens the H200 measured the forward pass's peak
  above the kept tensors by this and the backward passes' by nothing of it
  (docs/estimator.md).
- **reserved margin**: what PyTorch's caching allocator holds beyond the allocated peak.
- **CUDA context**: memory the driver takes per process, outside PyTorch's allocator.

The allocated peak is weights + transcoders + max(setup peak, setup + max(forward,
backward)). After ``attribute()`` the pipeline has a second phase with its own peak, pruning
(:func:`pipeline`, :func:`prune_peak_bytes`): circuit-tracer's ``prune_graph`` (which
``create_graph_files`` calls) on the dense adjacency moved to the GPU. The figures the fitted
numbers come from, and the error at every measured point (the fit and the held-out validation
apart), are in ``docs/estimator.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final, Literal

from pytest_ctresources.bundled.catalogue import Dims, count_transcoder_params
from pytest_ctresources.units import GIB, count_text

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The hook GemmaScope's gemma-2 transcoders read (see TranscoderShape.feature_input_hook).
NORMALIZED_HOOK: Final = "ln2.hook_normalized"
#: The residual stream before the MLP: the one input hook whose reading leaves the MLP's
#: input norm off the gradient path.
RESID_MID_HOOK: Final = "hook_resid_mid"
#: Active features per layer and token when the transcoder set's L0 is not known (the
#: registry knows it for GemmaScope's gemma-2-2b set: 39 on average over its 26 layers,
#: docs/registry-sources.md). A conservative assumption, above every known set's average;
#: ``ct-resources estimate --active-features`` changes it, and ``--ct-batch-size auto``
#: counts the real ones.
DEFAULT_ACTIVE_PER_LAYER_TOKEN: Final = 64.0
Attention = Literal["eager", "sdpa"]


@dataclass(frozen=True)
class AttentionTransient:
    """Bytes per attention score of one layer (batch x heads x tokens^2) alive beyond the
    kept probabilities while one attention runs, and whether the H200 measured it."""

    bytes_per_score: float
    measured: bool
    ground: str


#: Per (attention implementation, dtype). circuit-tracer 0.5.0 loads every model with
#: ``attn_implementation="eager"``, so eager is what runs. Eager in bf16: the masked scores
#: (2 bytes), the float32 copy that ``softmax(..., dtype=torch.float32)`` makes of them (4) and
#: the softmax's output (4), less the probabilities cast back (2), which the kept tensors
#: count: 8 (the H200 measured 8.2 to 8.4 with the causal mask's 2 / heads included, at 1,000
#: to 4,000 tokens). Eager in float16: torch's CUDA softmax reads half precision directly
#: (``half_to_float``), so no copy: 6. In float32: the scaled and the masked scores (4 + 4): 8.
#: SDPA's math path materialises the same scores; its fused kernels do not, but circuit-tracer
#: reads the probabilities, which they do not give.
ATTENTION_TRANSIENTS: Final[Mapping[tuple[str, str], AttentionTransient]] = MappingProxyType(
    {
        ("eager", "bfloat16"): AttentionTransient(
            8, True, "from the code, measured on the H200 (tokens 1000-4000)"
        ),
        ("eager", "float16"): AttentionTransient(6, False, "from the code, not measured"),
        ("eager", "float32"): AttentionTransient(8, False, "from the code, not measured"),
        ("sdpa", "bfloat16"): AttentionTransient(8, False, "as eager, not measured"),
        ("sdpa", "float16"): AttentionTransient(6, False, "as eager, not measured"),
        ("sdpa", "float32"): AttentionTransient(8, False, "as eager, not measured"),
    }
)
#: Dense adjacency-sized float32 buffers alive at ``prune_graph``'s peak, the sort of every
#: edge score in ``find_threshold(edge_scores.flatten())``: from the code, the adjacency
#: itself, its pruned clone, the pruned matrix normalised and the edge scores (4), the sort's
#: values and int64 indices (1 + 2) and its radix-sort double buffers (1 + 2): 10; measured 11
#: on the H200 (docs/estimator.md: fitted on 800 and 1200 tokens, 300 held out), the one more
#: being the sort's other scratch.
PRUNE_ADJACENCY_COPIES: Final = 11.0
#: The most elements torch's CUDA sort takes along the dimension it sorts (INT_MAX: "The
#: dimension being sorted can not have more than INT_MAX elements", torch 2.11 on the H200).
#: ``prune_graph``'s ``find_threshold`` sorts every edge score, nodes^2 of them, in one call:
#: on a GPU a graph of more than 46,340 nodes cannot be pruned at any memory (on the CPU,
#: ``ct_session.prune(graph, device="cpu")``, it can).
CUDA_SORT_LIMIT: Final = 2**31 - 1


@dataclass(frozen=True)
class ModelShape(Dims):
    """What the estimate needs to know about a transformer: its dimensions (the fields of
    :class:`Dims`, first) and these.

    Attributes:
        name: Hugging Face id (or bundled name).
        family: gemma2, gemma3, llama or qwen3: what the forward pass keeps depends on it.
        n_params: parameters held on the GPU (tied embeddings counted once).
        final_logit_softcap: Gemma-2's ``final_logit_softcapping`` (None when absent).
    """

    name: str
    family: str
    n_params: int
    final_logit_softcap: float | None = None


@dataclass(frozen=True)
class TranscoderShape:
    """What the estimate needs to know about a transcoder set.

    Attributes:
        name: circuit-tracer's name for the set (alias or Hugging Face repo).
        width: features per layer.
        cross_layer: one cross-layer transcoder (CLT) rather than one transcoder per layer.
        skip_connection: each layer has a ``W_skip`` (d_model x d_model).
        lazy_encoder, lazy_decoder: the encoder / decoder matrices stay on disk and rows are
            read on demand (circuit-tracer supports this for safetensors sets only; npz sets,
            such as GemmaScope's, always load fully).
        feature_input_hook: where the transcoders read. GemmaScope's ``ln2.hook_normalized``
            is Gemma's float32 normalised MLP input; ``hook_resid_mid`` (the residual stream
            before the MLP) leaves the MLP's input norm off the gradient path; ``mlp.hook_in``
            is the MLP's input in the model dtype.
    """

    name: str
    width: int
    cross_layer: bool = False
    skip_connection: bool = False
    lazy_encoder: bool = False
    lazy_decoder: bool = False
    feature_input_hook: str = RESID_MID_HOOK


@dataclass(frozen=True)
class Workload:
    """One ``attribute()`` call.

    Attributes:
        dtype: the model's dtype.
        batch_size: ``attribute(batch_size=...)``.
        prompt_tokens: prompt length in tokens, BOS (and any chat template) included.
        active_per_layer_token: active transcoder features per layer and token (a transcoder
            set's L0); with the model's layers and the prompt length it sets the number of
            feature nodes (:meth:`active_features`).
        max_feature_nodes: ``attribute(max_feature_nodes=...)``; None keeps them all.
        n_logits: logit targets (``max_n_logits``, 10 by default).
        offload: ``attribute(offload=...)``: ``"cpu"`` or ``"disk"``. circuit-tracer then moves
            per-layer transcoders without a skip connection off the GPU after the setup pass,
            before the forward pass (and the MLPs after it), so the forward and backward
            peaks do without them. Derived from circuit-tracer's code, not measured.
        counted_features: the active features counted in a setup pass (``auto`` has them);
            when given, it replaces ``active_per_layer_token`` x layers x tokens.
        attention: the attention implementation (circuit-tracer 0.5.0 uses eager).
    """

    dtype: Dtype
    batch_size: int
    prompt_tokens: int
    active_per_layer_token: float
    max_feature_nodes: int | None = 8192
    n_logits: int = 10
    offload: Literal["cpu", "disk"] | None = None
    counted_features: int | None = None
    attention: Attention = "eager"

    def active_features(self, n_layers: int) -> int:
        """Active features of the prompt over all ``n_layers`` layers. Position 0 (BOS)
        never has any: circuit-tracer zeroes it."""
        if self.counted_features is not None:
            return self.counted_features
        return math.ceil(self.active_per_layer_token * n_layers * max(self.prompt_tokens - 1, 0))

    def per_layer(self, n_layers: int) -> float:
        """Active features per layer and token: as given, or of the counted ones."""
        if self.counted_features is None:
            return self.active_per_layer_token
        return per_layer_token(self.counted_features, n_layers, self.prompt_tokens)

    def feature_nodes(self, n_layers: int) -> int:
        """The feature rows ``attribute()`` computes: ``max_feature_nodes``, or every active
        feature when there are fewer (or no limit)."""
        active = self.active_features(n_layers)
        return active if self.max_feature_nodes is None else min(self.max_feature_nodes, active)


def per_layer_token(active_features: int, n_layers: int, prompt_tokens: int) -> float:
    """Active features per layer and token from their count over all layers: the inverse of
    :meth:`Workload.active_features` (position 0, BOS, has none)."""
    return active_features / max(n_layers * (prompt_tokens - 1), 1)


@dataclass(frozen=True)
class ArchitectureTerms:
    """What one architecture's forward pass keeps beyond the common terms, derived from its
    transformers 4.57 code and counted on the CPU (``bench/memory_terms.py``).

    Attributes:
        post_attention_norm: an RMSNorm on the attention output before the residual add
            (Gemma's sandwich norms): one more float32 scalar per token on the gradient path.
        k_norm_fp32: the keys' RMSNorm keeps its float32 input (n_kv_heads x head_dim) for
            autograd through the KV cache, with its scalar (Qwen3: circuit-tracer does not
            detach that norm).
        k_norm_scalars: the keys' RMSNorm keeps only its detached scalar (Gemma-3).
        causal_masks: the 4D masks eager attention gets (batch x 1 x tokens^2 in the model
            dtype, alive through the decoder layers): one per layer type, Gemma's sliding and
            full attention being two.
    """

    post_attention_norm: bool
    k_norm_fp32: bool = False
    k_norm_scalars: bool = False
    causal_masks: int = 1


#: Per family; an unknown family is estimated as Llama.
ARCHITECTURES: Final[Mapping[str, ArchitectureTerms]] = MappingProxyType(
    {
        "gemma2": ArchitectureTerms(post_attention_norm=True, causal_masks=2),
        "gemma3": ArchitectureTerms(post_attention_norm=True, k_norm_scalars=True, causal_masks=2),
        "llama": ArchitectureTerms(post_attention_norm=False),
        "qwen3": ArchitectureTerms(post_attention_norm=False, k_norm_fp32=True),
    }
)


def architecture(family: str) -> ArchitectureTerms:
    return ARCHITECTURES.get(family, ARCHITECTURES["llama"])


@dataclass(frozen=True)
class Calibration:
    """What the code does not fix: the allocator, the device and the backward passes' order
    of freeing, fitted to GPU measurements (``bench/fit_estimator.py``, ``docs/estimator.md``).

    Attributes:
        backward_gather: copies of the per-layer gradient gathered at the decoder vectors'
            positions (batch x decoders writing to a layer x d_model) at the backward peak
            (``compute_score``'s ``grads[:, positions]``: one, from the code).
        backward_layers: residual-stream-sized gradients per layer and batch-token alive with
            them, in the model dtype.
        unembed_share: the backward passes hold this share of the unembedding matrix
            (vocabulary x d_model) in the model dtype at their peak.
        reserved, reserved_bytes: reserved minus allocated at the peak, estimated as
            ``reserved`` x what the call adds + ``reserved_bytes`` (an envelope over the
            measured points, with expandable segments).
        context_bytes: the CUDA context of one process, outside PyTorch's allocator.
        workspace_bytes: allocated besides the parameters once the model has run (cuBLAS
            workspaces): measured resident memory minus the weights.
        safety: the allocated peak is multiplied by it.
    """

    backward_gather: float
    backward_layers: float
    unembed_share: float
    reserved: float
    reserved_bytes: int
    context_bytes: int
    workspace_bytes: int = 0
    safety: float = 1.0


#: Fitted by ``bench/fit_estimator.py`` from the fit points in ``docs/calibration/`` (one
#: H200, torch 2.11, circuit-tracer 0.5.0, nnsight backend, transformers 4.57.3); the fit,
#: the held-out validation and the error at every point are in ``docs/estimator.md``.
CALIBRATION: Final = Calibration(
    backward_gather=1.0,
    backward_layers=0.25,
    unembed_share=0.25,
    reserved=0.12,
    reserved_bytes=150 << 20,
    # bench/cuda_context.py on the H200 (driver 580.159.04, torch 2.11): NVML's used memory
    # minus PyTorch's reserved, after the first matmuls (docs/estimator.md). Other GPUs and
    # drivers differ by a few hundred MiB.
    context_bytes=718_077_952,
    workspace_bytes=102760960,
)


#: Per family, the worst under-prediction of the allocated peak over the held-out validation
#: points (docs/estimator.md), as a share of the measured peak: ``--ct-batch-size auto``'s
#: first call on a model keeps at least this margin. ``tests/test_estimate.py`` checks it
#: against the data.
WORST_UNDER_PREDICTION: Final[Mapping[str, float]] = MappingProxyType(
    {"gemma2": 0.001, "gemma3": 0.001, "llama": 0.002, "qwen3": 0.002}
)


@dataclass(frozen=True)
class Term:
    """One line of the breakdown."""

    name: str
    bytes: int
    note: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Estimate:
    """A predicted peak, with its parts.

    ``peak_allocated_bytes`` is what ``torch.cuda.max_memory_allocated()`` would report for
    the call; ``peak_reserved_bytes`` adds the caching allocator's margin; ``total_bytes`` adds
    the CUDA context: what the process takes from the card.
    """

    model: ModelShape
    transcoders: TranscoderShape
    workload: Workload
    terms: tuple[Term, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    total_bytes: int
    peak_phase: str
    calibration: Calibration = field(repr=False)

    @property
    def peak_gib(self) -> float:
        """The predicted allocated peak in GiB (2^30 bytes)."""
        return self.peak_allocated_bytes / GIB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def active_features(self) -> int:
        """Active features of the prompt over all layers."""
        return self.workload.active_features(self.model.n_layers)

    @property
    def active_per_layer_token(self) -> float:
        """Active features per layer and token: the workload's, or the counted ones'."""
        return self.workload.per_layer(self.model.n_layers)

    @property
    def resident_bytes(self) -> int:
        """Weights and transcoders: allocated before the call starts."""
        return sum(t.bytes for t in self.terms if t.name in ("weights", "transcoders"))

    @property
    def call_bytes(self) -> int:
        """What the call adds to the resident weights at its allocated peak."""
        return self.peak_allocated_bytes - self.resident_bytes

    def term(self, name: str) -> Term:
        for candidate in self.terms:
            if candidate.name == name:
                return candidate
        raise KeyError(name)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: every size in GiB, ``peak_gib`` the allocated peak."""
        return {
            "model": self.model.name,
            "transcoders": self.transcoders.name,
            "dtype": self.workload.dtype,
            "batch_size": self.workload.batch_size,
            "prompt_tokens": self.workload.prompt_tokens,
            "active_per_layer_token": round(self.active_per_layer_token, 3),
            "active_features": self.active_features,
            "max_feature_nodes": self.workload.max_feature_nodes,
            "peak_gib": round(self.peak_gib, 3),
            "peak_reserved_gib": round(self.peak_reserved_bytes / GIB, 3),
            "total_gib": round(self.total_gib, 3),
            "peak_phase": self.peak_phase,
            "breakdown_gib": {t.name: round(t.gib, 3) for t in self.terms},
        }


def transcoder_params_on_gpu(model: ModelShape, tc: TranscoderShape) -> int:
    """Transcoder parameters resident on the GPU (lazily loaded matrices excluded)."""
    return count_transcoder_params(
        model.n_layers,
        model.d_model,
        tc.width,
        cross_layer=tc.cross_layer,
        skip_connection=tc.skip_connection,
        encoders=not tc.lazy_encoder,
        decoders=not tc.lazy_decoder,
    )


def decoder_vectors_per_feature(model: ModelShape, tc: TranscoderShape) -> float:
    """Decoder vectors per active feature (what setup keeps, what each backward pass reads):
    1, or for a CLT the mean number of layers a feature writes to, (n_layers + 1) / 2 when
    features spread evenly over layers."""
    return (model.n_layers + 1) / 2 if tc.cross_layer else 1.0


def norms_on_gradient_path(model: ModelShape, transcoders: TranscoderShape) -> int:
    """RMSNorms per layer whose detached scalar autograd keeps: the attention's input norm
    (the value path), Gemma's norm after attention, and the MLP's input norm unless the
    transcoders read the residual stream before it (the MLP's own graph is detached)."""
    arch = architecture(model.family)
    mlp_input = 0 if transcoders.feature_input_hook == RESID_MID_HOOK else 1
    return 1 + int(arch.post_attention_norm) + mlp_input


def kept_per_batch_token(
    model: ModelShape, transcoders: TranscoderShape, dtype_bytes: int, prompt_tokens: int
) -> int:
    """Bytes the forward pass keeps for the backward passes per batch-token, alive from its
    end to the end of the call (see the module's docstring)."""
    b, d = dtype_bytes, model.d_model
    # Per layer: the transcoders' input (float32 for GemmaScope's normalised MLP input) and
    # output, the attention probabilities, a float32 scalar per norm on the gradient path.
    feature_input = 4 if transcoders.feature_input_hook == NORMALIZED_HOOK else b
    per_layer = (
        d * (feature_input + b)
        + model.n_heads * prompt_tokens * b
        + 4 * norms_on_gradient_path(model, transcoders)
    )
    # The embeddings' output (the token nodes' gradients) and the final norm's output (the
    # logit nodes' injection point), with the final norm's scalar.
    return model.n_layers * per_layer + 2 * d * b + 4


def cache_per_batch_token(model: ModelShape, dtype_bytes: int) -> int:
    """Bytes per batch-token the model's output holds at the end of the forward pass on top
    of the kept tensors: every layer's KV cache, and what the keys' graph keeps."""
    arch = architecture(model.family)
    kv = model.n_kv_heads * model.head_dim
    per_layer = 2 * kv * dtype_bytes
    if arch.k_norm_fp32:
        per_layer += 4 * kv + 4 * model.n_kv_heads
    elif arch.k_norm_scalars:
        per_layer += 4 * model.n_kv_heads
    return model.n_layers * per_layer


def forward_peak_per_batch_token(
    model: ModelShape,
    transcoders: TranscoderShape,
    dtype_bytes: int,
    prompt_tokens: int,
    attention_bytes_per_pair: float = 0.0,
) -> int:
    """Bytes per batch-token the forward pass adds at its peak: what it keeps, the KV cache,
    and the larger of the logits (two copies under a softcap: ``tanh``'s output, which autograd
    keeps, and the result) and the last layer's gated-MLP intermediates (gate, up, the
    activation and the product, with the MLP's input and its norm's: at most three residual
    streams more, counted on the CPU; the logits are larger in every published model), or one
    layer's attention (``attention_bytes_per_pair`` x tokens: :func:`attention_bytes_per_pair`,
    while the decoder layers run, before the logits exist)."""
    logit_copies = 2 if model.final_logit_softcap else 1
    mlp = 4 * model.d_mlp + 3 * model.d_model
    transient = max(
        max(logit_copies * model.vocab_size, mlp) * dtype_bytes,
        int(attention_bytes_per_pair * prompt_tokens),
    )
    return (
        kept_per_batch_token(model, transcoders, dtype_bytes, prompt_tokens)
        + cache_per_batch_token(model, dtype_bytes)
        + transient
    )


def estimate(
    model: ModelShape,
    transcoders: TranscoderShape,
    workload: Workload,
    calibration: Calibration = CALIBRATION,
) -> Estimate:
    """Predict the memory of one ``attribute()`` call. Sizes are bytes."""
    cal = calibration
    b = DTYPE_BYTES[workload.dtype]
    n_layers, d, vocab = model.n_layers, model.d_model, model.vocab_size
    tokens, batch = workload.prompt_tokens, workload.batch_size
    nnz = workload.active_features(n_layers)
    batch_tokens = batch * tokens
    layer_row = n_layers * d * b  # one token's residual stream over all layers, in bytes

    weights = model.n_params * b + cal.workspace_bytes
    transcoder_bytes = transcoder_params_on_gpu(model, transcoders) * b

    decoders = decoder_vectors_per_feature(model, transcoders)
    feature_vectors = int(nnz * d * b * (1 + decoders))  # encoder and decoder vectors
    setup = int(
        feature_vectors
        + n_layers * tokens * d * b  # error vectors
        + tokens * d * b  # token embeddings
        + tokens * vocab * b  # one prompt's logits (ctx.logits)
        + nnz * (3 * 8 + b)  # sparse activation matrix: int64 indices and values
    )
    # setup_attribution's own peak, at the concatenation of the per-layer feature vectors:
    # the lists being joined, the MLP input and output caches and the reconstruction, and one
    # layer's dense pre-activations and activations (tokens x width, in the model dtype).
    setup_peak = (
        setup + feature_vectors + 3 * n_layers * tokens * d * b + 2 * tokens * transcoders.width * b
    )

    kept = batch_tokens * kept_per_batch_token(model, transcoders, b, tokens)
    per_pair = attention_bytes_per_pair(model, workload)
    attention = int(per_pair * batch * tokens * tokens)
    forward = batch_tokens * forward_peak_per_batch_token(model, transcoders, b, tokens, per_pair)

    row_size = nnz + (n_layers + 1) * tokens
    feature_nodes = workload.feature_nodes(n_layers)
    influence = 0
    if feature_nodes < nnz:
        # compute_partial_influences: float32 copy of edge_matrix[:rows] on the GPU.
        influence = (feature_nodes + workload.n_logits) * (row_size + workload.n_logits) * 4
    # Each backward pass gathers, per layer, the gradient at the position of every decoder
    # vector that writes to that layer: batch x decoders x d_model. A per-layer transcoder's
    # layer has its own features' decoders (nnz / n_layers when features spread evenly); a
    # CLT's last layer receives a decoder from every active feature.
    decoders_per_layer = nnz if transcoders.cross_layer else nnz / n_layers
    gather = int(cal.backward_gather * batch * decoders_per_layer * d * b)
    gradients = int(cal.backward_layers * batch_tokens * layer_row) + row_size * batch * b
    unembed = int(cal.unembed_share * vocab * d * b)
    # No attention runs in the backward passes: the probabilities are detached, so no
    # transient of it is there (see the module's docstring).
    backward = kept + max(gather + gradients, influence, unembed)

    # With offload, transcoders that need no skip connection leave the GPU after the setup
    # pass (circuit-tracer's get_offload_targets_phase0): the later phases do without them.
    offloaded = transcoder_bytes if workload.offload and not transcoders.skip_connection else 0
    call_peak = max(setup_peak, setup + max(forward, backward) - offloaded)
    peak_allocated = int((weights + transcoder_bytes + call_peak) * cal.safety)
    margin = int(cal.reserved * call_peak) + cal.reserved_bytes
    peak_reserved = peak_allocated + margin
    total = peak_reserved + cal.context_bytes

    tc = transcoders
    lazy = [part for part, on in (("encoder", tc.lazy_encoder), ("decoder", tc.lazy_decoder)) if on]
    tc_note = "lazy " + "+".join(lazy) if lazy else "all on the GPU"
    per_layer = workload.per_layer(n_layers)
    terms = (
        Term("weights", weights, f"{count_text(model.n_params)} parameters, workspaces"),
        Term("transcoders", transcoder_bytes, tc_note),
        Term(
            "setup",
            setup,
            f"{per_layer:.1f} active features per layer and token, {nnz} in all",
        ),
        Term(
            "forward",
            forward,
            f"batch {batch} x {tokens} tokens, kept {kept / GIB:.2f} GiB"
            + (", softcapped logits" if model.final_logit_softcap else "")
            + f", one layer's {workload.attention} attention {attention / GIB:.2f} GiB",
        ),
        Term(
            "backward",
            backward,
            f"gradients at decoder positions {gather / GIB:.2f} GiB"
            + (f", influence ranking {influence / GIB:.2f} GiB" if influence else ""),
        ),
        Term("reserved margin", margin, "caching allocator"),
        Term("CUDA context", cal.context_bytes, "per process"),
    )
    return Estimate(
        model=model,
        transcoders=transcoders,
        workload=workload,
        terms=terms,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        total_bytes=total,
        peak_phase=(
            "setup"
            if setup_peak >= setup + max(forward, backward) - offloaded
            else ("forward" if forward >= backward else "backward")
        ),
        calibration=cal,
    )


def attention_transient(workload: Workload) -> AttentionTransient:
    """The attention transient of ``workload``'s implementation and dtype."""
    return ATTENTION_TRANSIENTS[(workload.attention, workload.dtype)]


def attention_bytes_per_pair(model: ModelShape, workload: Workload) -> float:
    """Bytes per query-key pair of one copy of the prompt while one layer's attention runs:
    its transient per score over the heads, and the causal masks (eager's only: SDPA's fused
    kernels take none)."""
    masks = architecture(model.family).causal_masks if workload.attention == "eager" else 0
    return (
        attention_transient(workload).bytes_per_score * model.n_heads
        + masks * DTYPE_BYTES[workload.dtype]
    )


def graph_nodes(model: ModelShape, workload: Workload) -> int:
    """Nodes of the dense graph ``attribute()`` returns: the feature nodes kept, an error node
    per layer and token, the token nodes and the logit nodes."""
    features = workload.feature_nodes(model.n_layers)
    return features + (model.n_layers + 1) * workload.prompt_tokens + workload.n_logits


def prune_blocker(nodes: int) -> str:
    """Why a graph of ``nodes`` nodes cannot be pruned on a GPU at any memory, or ``""``."""
    if nodes * nodes <= CUDA_SORT_LIMIT:
        return ""
    return (
        f"prune_graph sorts its {nodes * nodes:,} edge scores (nodes^2) in one torch.sort, which "
        f"on CUDA takes at most {CUDA_SORT_LIMIT:,}: at most {math.isqrt(CUDA_SORT_LIMIT):,} "
        "nodes on a GPU"
    )


def prune_peak_bytes(resident_bytes: int, nodes: int) -> int:
    """``prune_graph``'s allocated peak on the GPU: what is resident (the model and its
    transcoders, still loaded) and :data:`PRUNE_ADJACENCY_COPIES` dense float32 adjacencies
    (nodes^2 x 4 bytes)."""
    return resident_bytes + int(PRUNE_ADJACENCY_COPIES * nodes * nodes * 4)


@dataclass(frozen=True)
class Phase:
    """One phase of the pipeline: its allocated peak and what it takes from the card (with
    the allocator's margin and the CUDA context), and the host memory it holds;
    ``cannot_run``: why it cannot run on a GPU at any memory (``""`` when it can)."""

    name: str
    peak_allocated_bytes: int
    total_bytes: int
    host_bytes: int
    note: str
    cannot_run: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "peak_gib": round(self.peak_allocated_bytes / GIB, 3),
            "total_gib": round(self.total_bytes / GIB, 3),
            "host_gib": round(self.host_bytes / GIB, 3),
            "note": self.note,
            "cannot_run_on_a_gpu": self.cannot_run or None,
        }


@dataclass(frozen=True)
class Pipeline:
    """``attribute()`` and the pruning after it (``prune_graph`` / ``create_graph_files``):
    the run's peak is its largest phase's."""

    phases: tuple[Phase, ...]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total_bytes)

    def to_dict(self) -> dict[str, object]:
        return {phase.name: phase.to_dict() for phase in self.phases} | {
            "peak_phase": self.peak.name
        }


def pipeline(prediction: Estimate) -> Pipeline:
    """The phases of the whole pipeline of ``prediction``'s call. Host memory, from
    circuit-tracer's code: ``attribute()`` builds the edge matrix on the CPU (feature rows x
    every node, float32), copies its columns and rows and makes the dense graph (nodes^2),
    and with ``offload="cpu"`` holds the offloaded transcoders; pruning brings the dense graph
    back with its boolean edge mask (nodes^2 x 5 bytes)."""
    model, work, cal = prediction.model, prediction.workload, prediction.calibration
    nodes = graph_nodes(model, work)
    features = work.feature_nodes(model.n_layers)
    rows = features + work.n_logits
    columns = prediction.active_features + nodes - features
    edges = 4 * max(rows * (columns + nodes), rows * nodes + nodes * nodes)
    offloaded = prediction.term("transcoders").bytes if work.offload == "cpu" else 0
    resident = prediction.resident_bytes
    prune = prune_peak_bytes(resident, nodes)
    prune_total = prune + int(cal.reserved * (prune - resident)) + cal.reserved_bytes
    adjacency = nodes * nodes * 4
    return Pipeline(
        (
            Phase(
                "attribute",
                prediction.peak_allocated_bytes,
                prediction.total_bytes,
                edges + offloaded,
                f"peak in the {prediction.peak_phase} pass",
            ),
            Phase(
                "prune",
                prune,
                prune_total + cal.context_bytes,
                adjacency + nodes * nodes,
                f"{nodes} nodes, dense adjacency {adjacency / GIB:.2f} GiB",
                prune_blocker(nodes),
            ),
        )
    )


def longest_fitting(fits: Callable[[int], bool], most: int) -> int:
    """The largest n in 1..``most`` for which ``fits(n)`` holds, ``fits`` holding up to some
    n and not beyond (a prompt length whose whole pipeline fits: every phase grows with the
    prompt); 0 when not even 1 fits. A bisection: about log2(most) calls."""
    if not fits(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def largest_fitting_batch(
    model: ModelShape,
    transcoders: TranscoderShape,
    workload: Workload,
    budget_bytes: int,
    *,
    ceiling: int,
    resident_bytes: int | None = None,
    counted: Callable[[Estimate], int] | None = None,
) -> tuple[int, Estimate] | None:
    """The largest batch size <= ``ceiling`` whose predicted total fits ``budget_bytes``.

    ``resident_bytes``, when given (what is already allocated, measured), replaces the
    estimate's weights and transcoders. ``counted`` says what of an estimate must fit
    (default: ``total_bytes``, the reserved peak and the CUDA context); ``--ct-batch-size
    auto`` passes its own (``auto.counted_for_fit``). Returns None when not even batch
    size 1 fits. The predicted total grows with the batch size, so a bisection finds it.
    """

    def need(batch: int) -> tuple[int, Estimate]:
        est = estimate(model, transcoders, with_batch(workload, batch))
        total = est.total_bytes if counted is None else counted(est)
        if resident_bytes is not None:
            total += resident_bytes - est.resident_bytes
        return total, est

    largest = longest_fitting(lambda batch: need(batch)[0] <= budget_bytes, ceiling)
    return None if largest == 0 else (largest, need(largest)[1])


def balanced_batch(largest: int, rows: int) -> int:
    """The smallest batch size that needs no more backward passes over ``rows`` feature rows
    than ``largest`` does: same number of passes, less memory (306 for 4096 rows -> 293)."""
    if rows <= 0:
        return largest
    passes = math.ceil(rows / largest)
    return max(1, math.ceil(rows / passes))


def with_batch(workload: Workload, batch: int) -> Workload:
    """``workload`` at another batch size."""
    return replace(workload, batch_size=batch)
