"""The ``ct-resources`` command: what GPUs the plugin sees, and what an attribution will need.

    ct-resources gpus [--json]
    ct-resources estimate --config example_configs/gemma-2-2b-it.yaml --prompt-tokens 40
    ct-resources estimate --model google/gemma-2-2b --transcoders gemma \\
        --dtype bfloat16 --batch-size 256 --gpu-gib 24 [--json]
    ct-resources estimate --model gemma-2-2b --gpu-gib 24   # a short name, its usual set
    ct-resources table --cards 24,48,80 --prompt-tokens 32,128   # docs/estimator-cli.md's table
    ct-resources table --model gemma-2-2b; ct-resources models; ct-resources --version

Nothing here imports torch unless GPU detection has to fall back to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from pytest_ctresources.estimator import cli_models, of_config, registry
from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator.auto import (
    DEFAULT_AUTO_MARGIN,
    Budget,
    counted_for_fit,
    fit_batch,
)
from pytest_ctresources.settings.config import (
    AUTO,
    DTYPE_ALIASES,
    DTYPES,
    FIELDS,
    MAX_COUNT,
    MAX_GIB,
    CircuitTracerConfig,
    ConfigError,
    bound_text,
    shown,
)
from pytest_ctresources.settings.sources import Source
from pytest_ctresources.units import GIB, count_text

DEFAULT_PROMPT_TOKENS: Final = 32
DEFAULT_CEILING: Final = int(FIELDS["batch_size_max"].default)  # type: ignore[call-overload]


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


def _dtype(text: str) -> str:
    value = DTYPE_ALIASES.get(text, text)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}; got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return int(_positive(text, int, "integer", MAX_COUNT))


def _positive_float(text: str) -> float:
    return _positive(text, float, "number", MAX_COUNT)


def _gib(text: str) -> float:
    return _positive(text, float, "number of GiB", MAX_GIB)


@dataclass(frozen=True)
class Card:
    """``--gpu-gib``: a card's size, given in GiB or by its name, and how outputs name it."""

    gib: float
    label: str


def _card(text: str) -> Card:
    """GiB (``24``), or a GPU name as ``--ct-plan`` knows it (``H200``: its GiB there)."""
    from pytest_ctresources.xdist.plan import GPU_NAMES

    name = text.strip().upper()
    if name in GPU_NAMES:
        return Card(GPU_NAMES[name], f"{name} ({GPU_NAMES[name]:g} GiB)")
    try:
        float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive number of GiB or a GPU name ({', '.join(GPU_NAMES)}), "
            f"got {shown(text)}"
        ) from None
    gib = _gib(text)
    return Card(gib, f"{gib:g}")


def _positive(text: str, convert: Any, kind: str, most: float) -> float:
    try:
        value = convert(text)  # int() of over 4300 digits raises ValueError too
    except ValueError:
        value = 0
    if not value > 0:  # nan included
        raise argparse.ArgumentTypeError(f"must be a positive {kind}, got {shown(text)}")
    if value > most:  # inf included; the same bounds as the plugin's settings
        raise argparse.ArgumentTypeError(f"must be at most {bound_text(most)}, got {shown(text)}")
    return float(value)


def _batch(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ct-resources",
        description="GPU facts and VRAM estimates for circuit-tracer attribution "
        "(pytest-ctresources)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from pytest_ctresources.estimator.plan_cli import add_plan_parser

    add_plan_parser(commands)
    gpus = commands.add_parser("gpus", help="the GPUs the plugin detects")
    gpus.add_argument("--json", action="store_true", help="one JSON object")
    estimate = commands.add_parser(
        "estimate", help="predict the peak VRAM of attribute() and the batch sizes that fit"
    )
    source = estimate.add_argument_group("what to estimate (a config, or a model and a set)")
    source.add_argument("--config", metavar="YAML", help="experiment config (MODEL_NAME, ...)")
    source.add_argument(
        "--model",
        help="model name, full or short where unique (gemma-2-2b), or a config.json path",
    )
    source.add_argument(
        "--transcoders",
        metavar="SET",
        help="transcoder set, full or short where unique (default: the model's usual set)",
    )
    estimate.add_argument("--dtype", type=_dtype, help="bfloat16 or float32 (default: config's)")
    estimate.add_argument(
        "--batch-size", type=_batch, metavar="N|auto", help="default: config's, else 256"
    )
    estimate.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=DEFAULT_PROMPT_TOKENS,
        metavar="N",
        help=f"prompt length in tokens, BOS and chat template included "
        f"(default {DEFAULT_PROMPT_TOKENS})",
    )
    estimate.add_argument(
        "--active-features",
        type=_positive_float,
        metavar="K",
        help="active transcoder features per layer and token (default: the transcoder "
        f"set's L0 where known, else {est.DEFAULT_ACTIVE_PER_LAYER_TOKEN:g}, an assumption)",
    )
    estimate.add_argument("--max-feature-nodes", type=_positive_int, metavar="N")
    estimate.add_argument(
        "--gpu-gib",
        type=_card,
        metavar="G",
        help="card size in GiB, or a GPU name (H200, H100, A100-80GB, L4, RTX-4090, ...) "
        "(default: detected GPU 0)",
    )
    estimate.add_argument(
        "--ceiling",
        type=_positive_int,
        metavar="N",
        help="largest batch size the table and 'auto' consider (default: the config's "
        f"BATCH_SIZE_MAX, else {DEFAULT_CEILING})",
    )
    estimate.add_argument(
        "--pipeline",
        action="store_true",
        help="also the phases after attribute(): pruning (prune_graph, create_graph_files), "
        "each with its peak and host memory; the run's peak is the largest",
    )
    estimate.add_argument(
        "--longest-prompt",
        action="store_true",
        help="the longest prompt (tokens) whose whole pipeline fits the card (--gpu-gib), at "
        "--batch-size or at auto's choice",
    )
    estimate.add_argument("--json", action="store_true", help="one JSON object")
    table = commands.add_parser(
        "table", help="largest batch size that fits, per card, model, dtype and prompt length"
    )
    table.add_argument("--cards", default="24,48,80", metavar="GIB,...", help="card sizes")
    table.add_argument("--prompt-tokens", default="32,128", metavar="N,...", help="prompt lengths")
    table.add_argument("--dtypes", default="bfloat16,float32", metavar="DTYPE,...")
    table.add_argument(
        "--active-features",
        type=_positive_float,
        metavar="K",
        help="active features per layer and token (default: each set's L0 where known, else "
        f"{est.DEFAULT_ACTIVE_PER_LAYER_TOKEN:g})",
    )
    table.add_argument("--ceiling", type=_positive_int, default=DEFAULT_CEILING, metavar="N")
    cli_models.add_arguments(parser, commands, table)  # --version, models, table --model
    return parser


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
    flags = {
        "model_name": args.model,
        "transcoder_set": args.transcoders,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "max_feature_nodes": args.max_feature_nodes,
        "batch_size_max": args.ceiling,
    }
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


def _gpu_budget(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.gpu_gib is not None:
        return args.gpu_gib.gib, f"--gpu-gib {args.gpu_gib.label}"
    from pytest_ctresources.gpu.detect import detect_gpus

    facts = detect_gpus()
    gpu = facts.gpu(0)
    if gpu is None:
        return None, f"no GPU detected ({facts.detail}); pass --gpu-gib"
    return gpu.total_gib, f"{gpu.name}, {gpu.total_gib:.1f} GiB ({facts.source})"


def _table_sizes(ceiling: int, *marked: int) -> list[int]:
    """Powers of two from 8 up to the ceiling, and the batch sizes the output names."""
    sizes = {1 << power for power in range(3, 20) if 1 << power <= ceiling}
    return sorted(sizes | set(marked))


@dataclass(frozen=True)
class FitRule:
    """What "fits" means in one output: one figure of each estimate against one budget, so
    the table, the largest batch size and auto's reason never disagree.

    A fixed batch size fits when its total on the card (the reserved peak and the CUDA
    context) fits the card, as the plugin's estimated needs and ``ct-resources table`` count
    it; under ``auto`` a batch size fits when what auto fits (:func:`counted_for_fit`: the
    allocated peak and the context) fits auto's budget, the card less the margin. Two rules,
    because they answer two questions; one output asks one of them.
    """

    budget_bytes: int
    counts: str  # what of an estimate is compared, for the output and the JSON
    column: str  # the table's column of that figure
    budget_text: str
    description: str
    counted: Callable[[est.Estimate], int]

    def fits(self, prediction: est.Estimate) -> bool:
        return self.counted(prediction) <= self.budget_bytes

    @classmethod
    def fixed(cls, gpu_gib: float) -> FitRule:
        counts = "total on the card (reserved peak and CUDA context)"
        return cls(
            int(gpu_gib * GIB),
            counts,
            "total GiB",
            f"{gpu_gib:.1f} GiB",
            f"{counts} within the card's {gpu_gib:.1f} GiB",
            lambda prediction: prediction.total_bytes,
        )

    @classmethod
    def auto(cls, budget: Budget) -> FitRule:
        counts = "allocated peak and CUDA context"
        return cls(
            budget.budget_bytes,
            counts,
            "peak + context GiB",
            f"{budget.budget_bytes / GIB:.1f} GiB",
            f"{counts} within auto's {budget.describe()} (the caching allocator frees its "
            "unused cache before it runs out, so the reserved peak need not fit)",
            lambda prediction: counted_for_fit(prediction, budget),
        )


#: The longest prompt ``--longest-prompt`` considers (tokens).
MOST_PROMPT_TOKENS: Final = 1 << 17


def longest_prompt(request: Request, gpu_gib: float, gpu_text: str) -> dict[str, Any]:
    """The longest prompt whose every phase can run on the card: each phase's allocated peak
    plus the CUDA context within the card (what must fit for a call to run: PyTorch's
    allocator gives its cache back before it fails, so the reserved envelope is not needed),
    under auto within auto's budget (the card less its margin) at auto's choice; and no phase
    that cannot run on a GPU at all (:func:`est.prune_blocker`). With the batch size at that
    length and the phase that stops one token more."""
    auto_budget = Budget(gpu_gib, gpu_text, DEFAULT_AUTO_MARGIN)
    limit = auto_budget.budget_bytes if request.auto_batch else int(gpu_gib * GIB)

    def at(tokens: int) -> tuple[int, est.Phase | None]:
        work = replace(request.workload, prompt_tokens=tokens)
        batch = work.batch_size
        if request.auto_batch:
            fitted = fit_batch(
                request.model, request.transcoders, work, auto_budget, request.ceiling
            )
            if fitted is None:
                prediction = est.estimate(request.model, request.transcoders, work)
                return batch, est.pipeline(prediction).phases[0]
            batch = fitted.batch
        prediction = est.estimate(request.model, request.transcoders, est.with_batch(work, batch))
        for phase in est.pipeline(prediction).phases:
            need = phase.peak_allocated_bytes + prediction.calibration.context_bytes
            if need > limit or phase.cannot_run:
                return batch, phase
        return batch, None

    tokens = est.longest_fitting(lambda n: at(n)[1] is None, MOST_PROMPT_TOKENS)
    batch = at(max(tokens, 1))[0]
    stops = at(tokens + 1)[1] if tokens < MOST_PROMPT_TOKENS else None
    return {
        "longest_prompt_tokens": tokens,
        "batch_size": batch if tokens else None,
        "auto": request.auto_batch,
        "gpu_gib": gpu_gib,
        "gpu": gpu_text,
        "stopped_by_phase": None if stops is None else stops.name,
        "stopped_because": None if stops is None else (stops.cannot_run or "does not fit"),
    }


def run_estimate(args: argparse.Namespace, out: Any) -> int:
    request = resolve(args)
    gpu_gib, gpu_text = _gpu_budget(args)
    if args.longest_prompt:
        if gpu_gib is None:
            raise CliError(f"--longest-prompt needs a GPU size (--gpu-gib): {gpu_text}")
        longest = longest_prompt(request, gpu_gib, gpu_text)
        if args.json:
            json.dump(longest, out, indent=2)
            out.write("\n")
            return 0
        how = "auto's batch size" if request.auto_batch else "batch size"
        if not longest["longest_prompt_tokens"]:
            out.write(f"no prompt fits the whole pipeline on {gpu_text}\n")
            return 0
        out.write(
            f"longest prompt whose whole pipeline fits {gpu_text}: "
            f"{longest['longest_prompt_tokens']} tokens ({how} {longest['batch_size']})"
            + (
                f"; one more token and the {longest['stopped_by_phase']} phase "
                + (
                    "does not fit\n"
                    if longest["stopped_because"] == "does not fit"
                    else f"cannot run on a GPU ({longest['stopped_because']})\n"
                )
                if longest["stopped_by_phase"]
                else "\n"
            )
        )
        return 0
    workload = request.workload
    rule = None
    largest = None
    auto_reason = None
    if request.auto_batch:
        if gpu_gib is None:
            raise CliError(f"--batch-size auto needs a GPU size (--gpu-gib): {gpu_text}")
        # The choice ct_session would make on this card, before loading anything.
        budget = Budget(gpu_gib, gpu_text, DEFAULT_AUTO_MARGIN)
        rule = FitRule.auto(budget)
        fitted = fit_batch(request.model, request.transcoders, workload, budget, request.ceiling)
        if fitted is None:
            raise CliError(
                f"--batch-size auto: not even batch size 1 is predicted to fit the "
                f"{budget.describe()}"
            )
        workload = est.with_batch(workload, fitted.batch)
        largest = fitted.largest
        auto_reason = f"{fitted.why}; {budget.describe()}"
    elif gpu_gib is not None:
        rule = FitRule.fixed(gpu_gib)
        found = est.largest_fitting_batch(
            request.model,
            request.transcoders,
            workload,
            rule.budget_bytes,
            ceiling=request.ceiling,
            counted=rule.counted,
        )
        largest = None if found is None else found[0]
    prediction = est.estimate(request.model, request.transcoders, workload)
    marked = [workload.batch_size] + ([] if largest is None else [largest])
    rows = est.batch_table(
        request.model,
        request.transcoders,
        workload,
        _table_sizes(request.ceiling, *marked),
    )
    if args.json:
        payload = prediction.to_dict() | {
            "model_source": request.model_source,
            "transcoders_source": request.transcoders_source,
            "active_source": request.active_source,
            "gpu_gib": gpu_gib,
            "gpu": gpu_text,
            "fit_rule": None
            if rule is None
            else {"counts": rule.counts, "budget_gib": round(rule.budget_bytes / GIB, 3)},
            "largest_fitting_batch_size": largest,
            "auto_reason": auto_reason,
            "table": [
                {
                    "batch_size": row.workload.batch_size,
                    "peak_gib": round(row.peak_gib, 3),
                    "total_gib": round(row.total_gib, 3),
                    "counted_gib": None if rule is None else round(rule.counted(row) / GIB, 3),
                    "fits": None if rule is None else rule.fits(row),
                }
                for row in rows
            ],
        }
        if args.pipeline:
            payload["pipeline"] = est.pipeline(prediction).to_dict()
        json.dump(payload, out, indent=2)
        out.write("\n")
        return 0
    _print_estimate(out, prediction, rows, rule, gpu_text, largest, request)
    if auto_reason is not None:
        out.write(f"auto: batch size {workload.batch_size} ({auto_reason})\n")
    if args.pipeline:
        _print_pipeline(out, est.pipeline(prediction), gpu_gib)
    return 0


def _print_estimate(
    out: Any,
    prediction: est.Estimate,
    rows: Sequence[est.Estimate],
    rule: FitRule | None,
    gpu_text: str,
    largest: int | None,
    request: Request,
) -> None:
    model, tc, work = prediction.model, prediction.transcoders, prediction.workload
    softcap = f", logit softcap {model.final_logit_softcap:g}" if model.final_logit_softcap else ""
    kind = "cross-layer" if tc.cross_layer else "per-layer"
    skip = ", skip connection" if tc.skip_connection else ""
    usual = (
        f" ({request.transcoders_source}; --transcoders to choose another)"
        if request.usual_set
        else ""
    )
    write = out.write
    write(
        f"model        {model.name}: {count_text(model.n_params)} parameters, {model.n_layers} "
        f"layers, d_model {model.d_model}, vocabulary {model.vocab_size}{softcap}\n"
    )
    write(f"transcoders  {tc.name}: {kind}, {tc.width} features per layer{skip}{usual}\n")
    nodes = "all" if work.max_feature_nodes is None else work.max_feature_nodes
    auto = " (auto)" if request.auto_batch else ""
    write(
        f"workload     {work.dtype}, batch size {work.batch_size}{auto}, {work.prompt_tokens} "
        f"prompt tokens, max_feature_nodes {nodes}\n"
    )
    write(
        f"features     {work.active_per_layer_token:.4g} active per layer and token "
        f"({request.active_source}): {prediction.active_features} in all over "
        f"{model.n_layers} layers x {max(work.prompt_tokens - 1, 0)} positions after BOS\n"
    )
    write(f"GPU          {gpu_text}\n")
    if rule is not None:
        write(f"fits         {rule.description}\n")
    write("\nbreakdown                GiB\n")
    for term in prediction.terms:
        write(f"  {term.name:<20} {term.gib:>7.2f}  {term.note}\n")
    write(
        f"  {'peak allocated':<20} {prediction.peak_gib:>7.2f}  in the {prediction.peak_phase} "
        "pass\n"
    )
    write(f"  {'peak reserved':<20} {prediction.peak_reserved_bytes / GIB:>7.2f}\n")
    write(f"  {'total on the card':<20} {prediction.total_gib:>7.2f}\n\n")
    column = "total GiB" if rule is None else rule.column
    fits_header = "fits" if rule is None else f"fits {rule.budget_text}"
    write(f"batch size   peak GiB   {column}   {fits_header}\n")
    for row in rows:
        batch = row.workload.batch_size
        figure = row.total_bytes if rule is None else rule.counted(row)
        fits = "-" if rule is None else ("yes" if rule.fits(row) else "no")
        marks = [
            *(["this run"] if batch == work.batch_size else []),
            *(["the largest that fits"] if batch == largest else []),
        ]
        mark = f"  <- {', '.join(marks)}" if marks else ""
        write(
            f"{batch:>10} {row.peak_gib:>10.2f} {figure / GIB:>{len(column) + 2}.2f}   "
            f"{fits}{mark}\n"
        )
    if rule is not None:
        if largest is None:
            write(f"\nnot even batch size 1 fits {rule.budget_text}\n")
        else:
            write(f"\nlargest batch size that fits (up to {request.ceiling}): {largest}\n")


def _print_pipeline(out: Any, pipeline: est.Pipeline, gpu_gib: float | None) -> None:
    """A line per phase: its allocated peak, its total on the card, its host memory."""
    out.write("\nphase        peak GiB  total GiB  host GiB\n")
    for phase in pipeline.phases:
        mark = "  <- the run's peak" if phase is pipeline.peak else ""
        fits = ""
        if phase.cannot_run:
            fits = f"  cannot run on a GPU: {phase.cannot_run}"
        elif gpu_gib is not None:
            fits = "  fits" if phase.total_bytes <= gpu_gib * GIB else "  does not fit"
        out.write(
            f"{phase.name:<10} {phase.peak_allocated_bytes / GIB:>10.2f} "
            f"{phase.total_bytes / GIB:>10.2f} {phase.host_bytes / GIB:>9.2f}  "
            f"{phase.note}{fits}{mark}\n"
        )


#: The pairs the batch-size table covers (docs/estimator-cli.md): circuit-tracer's own examples.
TABLE_PAIRS: Final = (
    ("google/gemma-2-2b", "gemma"),
    ("google/gemma-2-2b", "mntss/clt-gemma-2-2b-426k"),
    ("meta-llama/Llama-3.2-1B", "llama"),
    ("google/gemma-3-4b-it", "mwhanna/gemma-scope-2-4b-it/transcoder_all/width_16k_l0_small"),
    ("google/gemma-3-4b-it", "mwhanna/gemma-scope-2-4b-it/transcoder_all/width_262k_l0_small"),
    ("Qwen/Qwen3-4B", "mwhanna/qwen3-4b-transcoders"),
)


def _csv(text: str, parse: Any) -> list[Any]:
    try:
        return [parse(part) for part in text.split(",") if part.strip()]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise CliError(f"bad list {shown(text)}: {exc}") from None


def run_table(args: argparse.Namespace, out: Any) -> int:
    """A Markdown table: the largest batch size (up to the ceiling) whose estimated total
    fits each card, for circuit-tracer's example models and transcoder sets."""
    cards = _csv(args.cards, _gib)
    prompts = _csv(args.prompt_tokens, _positive_int)
    dtypes = _csv(args.dtypes, _dtype)
    pairs = cli_models.table_pairs(args, TABLE_PAIRS)  # before the header: a bad name is one line
    header = "| model | transcoders | active per layer and token | dtype | prompt tokens | "
    header += " | ".join(f"{card:g} GiB" for card in cards)
    out.write(header + " |\n")
    out.write("|---|---|---|---|---|" + "---|" * len(cards) + "\n")
    for model_name, set_name in pairs:
        model = registry.model_shape(model_name)
        info = registry.transcoder_info(set_name, model_name)
        transcoders = info.loaded()
        if args.active_features is not None:
            active, active_text = args.active_features, f"{args.active_features:g} (given)"
        elif info.l0 is not None:
            active, active_text = info.l0, f"{info.l0:.1f} (L0)"
        else:
            active, active_text = (
                info.active_per_layer_token,
                f"{info.active_per_layer_token:g} (assumed)",
            )
        for dtype in dtypes:
            for tokens in prompts:
                work = est.Workload(dtype, 1, tokens, active)
                cells = []
                for card in cards:
                    found = est.largest_fitting_batch(
                        model, transcoders, work, int(card * GIB), ceiling=args.ceiling
                    )
                    cells.append("does not fit" if found is None else str(found[0]))
                short_set = set_name.split("/transcoder_all/")[-1]
                out.write(
                    f"| {model_name} | {short_set} | {active_text} | {dtype} | {tokens} | "
                    + " | ".join(cells)
                    + " |\n"
                )
    return 0


def run_gpus(args: argparse.Namespace, out: Any) -> int:
    from pytest_ctresources.gpu.detect import detect_gpus, free_bytes

    facts = detect_gpus()
    try:
        free = free_bytes(facts)
    except ValueError as exc:  # a malformed CT_FAKE_GPUS_USED
        raise CliError(str(exc)) from None
    if args.json:
        payload = facts.to_dict() | {
            "free_gib": [None if f is None else round(f / GIB, 3) for f in free]
        }
        json.dump(payload, out, indent=2)
        out.write("\n")
        return 0
    if not facts.gpus:
        out.write(f"no CUDA GPU detected ({facts.detail})\n")
        return 0
    out.write(f"source: {facts.detail}\n")
    visible = facts.cuda_visible_devices
    out.write(f"CUDA_VISIBLE_DEVICES: {'(unset)' if visible is None else visible}\n")
    out.write("index  name                          total GiB   free GiB   physical  uuid\n")
    for gpu, free_now in zip(facts.gpus, free, strict=True):
        free_text = "-" if free_now is None else f"{free_now / GIB:.1f}"
        physical = "-" if gpu.physical_index is None else str(gpu.physical_index)
        out.write(
            f"{gpu.index:>5}  {gpu.name:<28} {gpu.total_gib:>10.1f} {free_text:>10}   "
            f"{physical:>8}  {gpu.uuid or '-'}\n"
        )
    for caveat in facts.caveats:
        out.write(f"note: {caveat}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "gpus":
            status = run_gpus(args, sys.stdout)
        elif args.command == "plan":
            from pytest_ctresources.estimator.plan_cli import run_plan

            status = run_plan(args, sys.stdout)
        elif args.command == "table":
            status = run_table(args, sys.stdout)
        elif args.command == "models":
            status = cli_models.run_models(args, sys.stdout)
        else:
            status = run_estimate(args, sys.stdout)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return status
    except BrokenPipeError:
        # `ct-resources ... | head`: the reader has gone. Python's recipe (the signal module's
        # "Note on SIGPIPE"): point stdout at devnull so the flush at exit cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except CliError as exc:
        parser.exit(2, f"ct-resources: error: {exc}\n")
    except ValueError as exc:  # a malformed CT_FAKE_GPUS, say
        parser.exit(2, f"ct-resources: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
