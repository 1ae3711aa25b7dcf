"""An experiment config's attribution, estimated: its model's and transcoder set's shapes from
the registry, its workload from its dtype, feature nodes, logits and offload."""

from __future__ import annotations

from pytest_ctresources.estimator.estimate import (
    DEFAULT_ACTIVE_PER_LAYER_TOKEN,
    Estimate,
    ModelShape,
    TranscoderShape,
    Workload,
    estimate,
)
from pytest_ctresources.estimator.registry import UnknownShape, model_shape, transcoder_info
from pytest_ctresources.settings.config import AUTO, CircuitTracerConfig


def shapes_of_config(cfg: CircuitTracerConfig) -> tuple[ModelShape, TranscoderShape]:
    """The shapes of ``cfg``'s model and transcoder set, loaded as circuit-tracer would load
    them with the config's lazy flags.

    Raises:
        UnknownShape: either is not configured, or not known (the message lists the known).
    """
    if not cfg.model_name or not cfg.transcoder_set:
        raise UnknownShape(
            "name a model and a transcoder set: MODEL_NAME and TRANSCODER_SET, or "
            "--model NAME --transcoders SET"
        )
    model = model_shape(cfg.model_name)
    info = transcoder_info(cfg.transcoder_set, cfg.model_name)
    return model, info.loaded(lazy_encoder=cfg.lazy_encoder, lazy_decoder=cfg.lazy_decoder)


def workload_of(
    cfg: CircuitTracerConfig,
    prompt_tokens: int,
    active_per_layer_token: float,
    batch_size: int,
    *,
    counted_features: int | None = None,
) -> Workload:
    """One attribution under ``cfg``'s dtype, feature nodes, logits and offload;
    ``counted_features`` is the prompt's real number of active features, when counted."""
    return Workload(
        dtype=cfg.dtype,
        batch_size=batch_size,
        prompt_tokens=prompt_tokens,
        active_per_layer_token=active_per_layer_token,
        max_feature_nodes=cfg.max_feature_nodes,
        n_logits=cfg.max_n_logits,
        offload=cfg.offload,
        counted_features=counted_features,
    )


def default_active_per_layer_token(cfg: CircuitTracerConfig) -> float:
    """The active features per layer and token to assume for ``cfg``'s transcoder set: its
    L0 where the registry knows it, else the documented conservative default."""
    if not cfg.transcoder_set:
        return DEFAULT_ACTIVE_PER_LAYER_TOKEN
    try:
        return transcoder_info(cfg.transcoder_set, cfg.model_name).active_per_layer_token
    except UnknownShape:
        return DEFAULT_ACTIVE_PER_LAYER_TOKEN


def estimate_config(
    cfg: CircuitTracerConfig,
    prompt_tokens: int,
    active_per_layer_token: float | None = None,
    *,
    batch_size: int | None = None,
) -> Estimate | None:
    """The estimate of one attribution under ``cfg`` (at ``batch_size`` when given), or None
    when its model or transcoder set is not configured or not known. ``batch_size: auto``
    without ``batch_size`` is estimated at batch size 1, the least auto can choose.
    ``active_per_layer_token`` defaults to the set's L0 (:func:`default_active_per_layer_token`)."""
    try:
        model, transcoders = shapes_of_config(cfg)
    except UnknownShape:
        return None
    if batch_size is None:
        batch_size = 1 if cfg.batch_size == AUTO else int(cfg.batch_size)
    if active_per_layer_token is None:
        active_per_layer_token = default_active_per_layer_token(cfg)
    workload = workload_of(cfg, prompt_tokens, active_per_layer_token, batch_size)
    return estimate(model, transcoders, workload)
