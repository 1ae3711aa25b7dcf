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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pytest_ctresources.estimator import cli_models, registry
from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator.cli_estimate import run_estimate
from pytest_ctresources.estimator.cli_request import CliError
from pytest_ctresources.settings.config import (
    DEFAULT_PROMPT_TOKENS,
    DTYPE_ALIASES,
    DTYPES,
    MAX_COUNT,
    MAX_GIB,
    CircuitTracerConfig,
    bound_text,
    shown,
)
from pytest_ctresources.units import GIB

DEFAULT_CEILING: Final = CircuitTracerConfig.defaults().batch_size_max


def _dtype(text: str) -> str:
    value = DTYPE_ALIASES.get(text, text)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}; got {shown(text)}")
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


#: The pairs the batch-size table covers (docs/estimator-cli.md): circuit-tracer's own examples.
TABLE_PAIRS: Final = (
    ("google/gemma-2-2b", "gemma"),
    ("google/gemma-2-2b", "mntss/clt-gemma-2-2b-426k"),
    ("meta-llama/Llama-3.2-1B", "llama"),
    ("google/gemma-3-4b-it", "mwhanna/gemma-scope-2-4b-it/transcoder_all/width_16k_l0_small"),
    ("google/gemma-3-4b-it", "mwhanna/gemma-scope-2-4b-it/transcoder_all/width_262k_l0_small"),
    ("Qwen/Qwen3-4B", "mwhanna/qwen3-4b-transcoders"),
)


#: The most entries a ``table`` list takes: the table has a column per card and a row per
#: pair, dtype and prompt length, each cell an estimate.
MAX_LIST = 32


def _csv(text: str, parse: Any) -> list[Any]:
    parts = [part for part in text.split(",") if part.strip()]
    if not 0 < len(parts) <= MAX_LIST:
        raise CliError(f"bad list {shown(text)}: give 1 to {MAX_LIST} values, comma-separated")
    try:
        return [parse(part) for part in parts]
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
        _stdout_to_devnull()
        return 1
    except AttributeError:
        if sys.stdout is not None:
            raise
        parser.exit(1, "ct-resources: error: stdout is closed; nothing was written\n")
    except OSError as exc:  # a full disk behind stdout, say (/dev/full)
        _stdout_to_devnull()  # what is left in its buffer cannot be written at exit either
        parser.exit(1, f"ct-resources: error: {exc.strerror or exc}\n")
    except CliError as exc:
        parser.exit(2, f"ct-resources: error: {exc}\n")
    except ValueError as exc:  # a malformed CT_FAKE_GPUS, say
        parser.exit(2, f"ct-resources: error: {exc}\n")
    return 0


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
