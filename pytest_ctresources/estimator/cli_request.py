"""What ``ct-resources estimate`` was asked: the flags and ``--config`` resolved into shapes, a
workload and a GPU size, names looked up as the registry has them; a user error is one
line (:class:`CliError`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator import of_config, registry
from pytest_ctresources.settings.config import (
    AUTO,
    CircuitTracerConfig,
    ConfigError,
)
from pytest_ctresources.settings.sources import Source


class CliError(Exception):
    """A user error: printed as ``ct-resources: error: ...`` with exit status 2."""


@dataclass(frozen=True)
class Request:
    """What ``estimate`` was asked, resolved from a config file and the flags."""

    model: est.ModelShape
    transcoders: est.TranscoderShape
    workload: est.Workload
    auto_batch: bool
    ceiling: int
    active_source: str
    model_source: str = "--model"
    transcoders_source: str = "--transcoders"
    usual_set: bool = False  # no set was named: the model's usual one


#: The flag each config field comes from, for the sources error messages name.
_FLAGS: Final = {
    "model_name": "--model",
    "transcoder_set": "--transcoders",
    "dtype": "--dtype",
    "batch_size": "--batch-size",
    "max_feature_nodes": "--max-feature-nodes",
    "batch_size_max": "--ceiling",
}


def resolve(args: argparse.Namespace) -> Request:
    """Turn the flags (and ``--config``) into shapes and a workload: the config's values with
    the flags laid over them, as the plugin lays options over an experiment YAML; short names
    resolved (:func:`resolve_names`)."""
    cfg = CircuitTracerConfig.defaults()
    if args.config:
        from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml

        try:
            cfg = load_experiment_yaml(args.config).apply(cfg)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
    # Each flag's value is argparse's attribute of its name (--batch-size: batch_size).
    flags = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in _FLAGS.items()}
    cfg = cfg.layered(
        {name: value for name, value in flags.items() if value is not None},
        lambda name: Source.option(_FLAGS[name]),
    )
    cfg, usual = resolve_names(cfg)
    try:
        model, transcoders = of_config.shapes_of_config(cfg)
    except registry.UnknownShape as exc:  # not reached: resolve_names looked both up
        raise CliError(str(exc)) from None
    auto = cfg.batch_size == AUTO
    batch = 1 if auto else int(cfg.batch_size)
    active, source = _active_per_layer_token(args.active_features, cfg)
    workload = of_config.workload_of(cfg, args.prompt_tokens, active, batch)
    return Request(
        model,
        transcoders,
        workload,
        auto,
        cfg.batch_size_max,
        source,
        model_source=str(cfg.source_of("model_name")),
        transcoders_source=str(cfg.source_of("transcoder_set")),
        usual_set=usual,
    )


def _where(cfg: CircuitTracerConfig, field: str) -> str:
    """A field's source as an error names it: ``argument --model``, ``MODEL_NAME in x.yaml``."""
    source = cfg.source_of(field)
    return f"argument {source}" if source.kind == "option" else str(source)


def resolve_names(cfg: CircuitTracerConfig) -> tuple[CircuitTracerConfig, bool]:
    """``cfg`` with the model's and the transcoder set's names as the registry has them, and
    whether the set is the model's usual one because none was named.

    A flag's short name resolves (``gemma-2-2b`` -> ``google/gemma-2-2b``); an experiment
    YAML's does not, because the plugin hands MODEL_NAME and TRANSCODER_SET to circuit-tracer
    as written: there a name the registry would resolve is an error naming the full one.

    Raises:
        CliError: no model; a name unknown, ambiguous or short in a YAML; a set made for
            another model. One line, naming where the value came from.
    """
    if not cfg.model_name:
        raise CliError("name a model: --model NAME, or MODEL_NAME in the --config file")
    model = _resolved(cfg, "model_name", registry.resolve_model_name)
    try:
        registry.model_shape(model)
    except registry.UnknownShape as exc:
        raise CliError(f"{_where(cfg, 'model_name')}: {exc}") from None
    cfg = cfg.layered({"model_name": model}, cfg.source_of("model_name"))
    usual = cfg.transcoder_set is None
    if usual:
        try:
            named = registry.usual_transcoder_set(model)
        except registry.UnknownShape as exc:
            raise CliError(f"{exc}; name one with --transcoders SET") from None
        cfg = cfg.layered({"transcoder_set": named}, Source("default", f"{model}'s usual set"))
    else:
        named = _resolved(
            cfg, "transcoder_set", lambda name: registry.resolve_transcoder_set(name, model)
        )
        cfg = cfg.layered({"transcoder_set": named}, cfg.source_of("transcoder_set"))
    try:
        registry.transcoder_info(named, model)
        registry.check_pair(model, named)
    except registry.UnknownShape as exc:
        raise CliError(f"{_where(cfg, 'transcoder_set')}: {exc}") from None
    return cfg, usual


def _resolved(cfg: CircuitTracerConfig, field: str, resolve_name: Callable[[str], str]) -> str:
    """Field ``field`` of ``cfg`` resolved by ``resolve_name``; a YAML's value must need no
    resolving."""
    name = str(getattr(cfg, field))
    where = _where(cfg, field)
    try:
        resolved = resolve_name(name)
    except registry.UnknownShape as exc:
        raise CliError(f"{where}: {exc}") from None
    if resolved != name and cfg.source_of(field).kind == "yaml":
        # The plugin would load this name as written, where it means something else.
        raise CliError(f"{where}: {registry.short_name_note(name, resolved)}")
    return resolved


def _active_per_layer_token(given: float | None, cfg: CircuitTracerConfig) -> tuple[float, str]:
    """``--active-features``, else the set's L0, else the default; and where it came from."""
    if given is not None:
        return given, "--active-features"
    assert cfg.transcoder_set is not None  # resolve() checked the shapes first
    info = registry.transcoder_info(cfg.transcoder_set, cfg.model_name)
    return info.active_per_layer_token, info.l0_source


def gpu_budget(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.gpu_gib is not None:
        return args.gpu_gib.gib, f"--gpu-gib {args.gpu_gib.label}"
    from pytest_ctresources.gpu.detect import detect_gpus

    facts = detect_gpus()
    gpu = facts.gpu(0)
    if gpu is None:
        return None, f"no GPU detected ({facts.detail}); pass --gpu-gib"
    return gpu.total_gib, f"{gpu.name}, {gpu.total_gib:.1f} GiB ({facts.source})"
