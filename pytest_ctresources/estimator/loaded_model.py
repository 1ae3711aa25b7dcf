"""The shapes of a ReplacementModel already in memory (either backend), read from the object:
what the estimator and ``--ct-batch-size auto`` use once a test has loaded its model."""

from __future__ import annotations

from typing import Any

from pytest_ctresources.estimator.estimate import ModelShape, TranscoderShape


def shapes_of_loaded(model: Any) -> tuple[ModelShape, TranscoderShape]:
    """The shapes of a loaded ReplacementModel (either backend), read from the object.

    The weights are the model's own parameters (transcoders excluded), counted from the
    tensors, so anything the registry does not know is still right.
    """
    cfg = model.cfg
    transcoders = model.transcoders
    transcoder_ids = {id(p) for p in transcoders.parameters()}
    seen: set[int] = set()
    n_params = 0
    for parameter in model.parameters():
        key = parameter.data_ptr() if parameter.device.type != "meta" else id(parameter)
        if id(parameter) in transcoder_ids or key in seen:
            continue
        seen.add(key)
        n_params += parameter.numel()
    n_heads = int(cfg.n_heads)
    softcap = _loaded_softcap(model)
    architecture = str(getattr(cfg, "original_architecture", "") or "")
    shape = ModelShape(
        name=str(getattr(cfg, "model_name", "loaded model")),
        family=_family_of_architecture(architecture),
        n_layers=int(cfg.n_layers),
        d_model=int(cfg.d_model),
        d_mlp=int(cfg.d_mlp),
        vocab_size=int(cfg.d_vocab),
        n_heads=n_heads,
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or n_heads),
        head_dim=int(cfg.d_head),
        n_params=n_params,
        final_logit_softcap=float(softcap) if softcap and softcap > 0 else None,
    )
    return shape, _loaded_transcoders(transcoders)


def _loaded_softcap(model: Any) -> float | None:
    """The final-logit softcap of a loaded model: TransformerLens's config names it
    ``output_logits_soft_cap`` (-1 for none); the nnsight backend keeps the Hugging Face
    config, where it is ``final_logit_softcapping`` (in ``text_config`` for Gemma-3)."""
    value = getattr(model.cfg, "output_logits_soft_cap", None)
    if value is None:
        hf_config = getattr(model, "config", None) or getattr(model, "_hf_config", None)
        text = getattr(hf_config, "text_config", None) or hf_config
        value = getattr(text, "final_logit_softcapping", None)
    return float(value) if value and value > 0 else None


def _family_of_architecture(architecture: str) -> str:
    """``Gemma2ForCausalLM`` -> gemma2, ``Gemma3ForConditionalGeneration`` -> gemma3, ...;
    anything else is estimated as Llama."""
    lowered = architecture.lower()
    for prefix in ("gemma2", "gemma3", "qwen3", "llama"):
        if lowered.startswith(prefix):
            return prefix
    return "llama"


def _loaded_transcoders(transcoders: Any) -> TranscoderShape:
    scan = getattr(transcoders, "scan", None)
    per_layer = hasattr(transcoders, "transcoders")  # a TranscoderSet, else a CLT
    # What sets the width and the lazy flags: a TranscoderSet's first transcoder, or the CLT.
    part = transcoders.transcoders[0] if per_layer else transcoders
    return TranscoderShape(
        name=scan if isinstance(scan, str) else type(transcoders).__name__,
        feature_input_hook=str(getattr(transcoders, "feature_input_hook", "")),
        width=int(part.d_transcoder),
        cross_layer=not per_layer,
        skip_connection=bool(getattr(transcoders, "skip_connection", False)),
        lazy_encoder=bool(getattr(part, "lazy_encoder", False)),
        lazy_decoder=bool(getattr(part, "lazy_decoder", False)),
    )
