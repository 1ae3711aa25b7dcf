"""``ct-resources`` basics: ``--version``, ``models`` (and transcoder sets), ``table --model``.

    ct-resources --version
    ct-resources models [--json]            # the offline registry's models and transcoder sets
    ct-resources table --model gemma-2-2b [--transcoders 426k]

What the offline registry (:mod:`pytest_ctresources.estimator.registry`) knows is what
``estimate`` and ``table`` can answer without a download; ``models`` says so before a user
guesses names. The parser is :mod:`pytest_ctresources.estimator.cli`'s; this module adds
its arguments (:func:`add_arguments`) and runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

from pytest_ctresources.bundled import catalogue
from pytest_ctresources.estimator import registry
from pytest_ctresources.units import count_text

DISTRIBUTION = "pytest-ctresources"


class ModelsError(ValueError):
    """A name the registry cannot answer for; ``ct-resources`` prints it as one error line."""


def version_text() -> str:
    """``ct-resources (pytest-ctresources 0.1.0)``: the installed distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        found = "unknown version (not installed)"
    return f"ct-resources ({DISTRIBUTION} {found})"


def add_arguments(
    parser: argparse.ArgumentParser,
    commands: Any,
    table: argparse.ArgumentParser,
) -> None:
    """``--version`` on ``parser``, the ``models`` command in ``commands`` (the parser's
    subparsers), ``--model`` and ``--transcoders`` on the ``table`` command."""
    parser.add_argument("--version", action="version", version=version_text())
    models = commands.add_parser(
        "models",
        help="the models and transcoder sets the offline registry knows (no download needed)",
    )
    models.add_argument("--json", action="store_true", help="one JSON object")
    table.add_argument(
        "--model",
        help="one model (full or short name) instead of circuit-tracer's examples",
    )
    table.add_argument(
        "--transcoders",
        metavar="SET",
        help="with --model: its transcoder set (default: the examples' sets for it, else its "
        "usual set)",
    )


def table_pairs(
    args: argparse.Namespace, examples: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The (model, transcoder set) rows ``table`` prints: ``examples`` without ``--model``;
    with it, the model's rows among the examples, else the model with its usual set, or with
    ``--transcoders``. Raises :class:`ModelsError` in one line for a name the registry lacks
    or a set made for another model."""
    model_given = getattr(args, "model", None)
    set_given = getattr(args, "transcoders", None)
    if model_given is None:
        if set_given is not None:
            raise ModelsError("--transcoders needs --model (the set goes with a model)")
        return list(examples)
    # Each error names the flag its name came from, as estimate's do.
    with _named("--model"):
        model = registry.resolve_model_name(model_given)
        registry.model_shape(model)  # an unknown name: the nearest ones, in one line
    if set_given is not None:
        with _named("--transcoders"):
            set_name = registry.resolve_transcoder_set(set_given, model)
            registry.check_pair(model, set_name)
            registry.transcoder_info(set_name, model)
        return [(model, set_name)]
    rows = [(name, set_name) for name, set_name in examples if name == model]
    if rows:
        return rows
    with _named("--model"):
        return [(model, registry.usual_transcoder_set(model))]


@contextlib.contextmanager
def _named(flag: str) -> Iterator[None]:
    try:
        yield
    except registry.UnknownShape as exc:
        raise ModelsError(f"argument {flag}: {exc}") from None


def models_payload() -> dict[str, Any]:
    """What ``models --json`` prints: every model and transcoder set of the registry."""
    models = []
    # The registry's models first, the bundled random ones after: those are what people mean.
    for name in sorted(
        registry.known_models(), key=lambda n: (catalogue.is_bundled_model(n), n.lower())
    ):
        shape = registry.model_shape(name)
        try:
            usual: str | None = registry.usual_transcoder_set(name)
        except registry.UnknownShape:
            usual = None
        models.append(
            {
                "name": name,
                "family": shape.family,
                "n_layers": shape.n_layers,
                "d_model": shape.d_model,
                "vocab_size": shape.vocab_size,
                "n_params": shape.n_params,
                "usual_transcoder_set": usual,
                "bundled": catalogue.is_bundled_model(name),
            }
        )
    aliases: dict[str, list[str]] = {}
    for alias, target in registry.ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    sets = [
        {
            "name": name,
            "aliases": sorted(aliases.get(name, [])),
            "cross_layer": info.shape.cross_layer,
            "features_per_layer": info.shape.width,
            "skip_connection": info.shape.skip_connection,
            "l0": info.l0,
            "models": list(info.models),
        }
        for name, info in sorted(registry.TRANSCODER_SETS.items())
    ]
    return {
        "models": models,
        "transcoder_sets": sets,
        "transcoder_set_patterns": [registry.GEMMA_SCOPE_2_PATTERN],
        "bundled_transcoder_sets": sorted(catalogue.BUNDLED_TRANSCODER_SETS),
    }


def run_models(args: argparse.Namespace, out: Any) -> int:
    """``ct-resources models``: the registry's models, then its transcoder sets."""
    payload = models_payload()
    if args.json:
        json.dump(payload, out, indent=2)
        out.write("\n")
        return 0
    rows = [
        (
            model["name"],
            model["family"],
            str(model["n_layers"]),
            str(model["d_model"]),
            count_text(model["n_params"]),
            (model["usual_transcoder_set"] or "-")
            + ("  (bundled: random weights, offline)" if model["bundled"] else ""),
        )
        for model in payload["models"]
    ]
    out.write(
        "models (the offline registry: estimate and table need no download; short names "
        "work where unique, e.g. gemma-2-2b)\n"
    )
    _columns(out, ("name", "family", "layers", "d_model", "parameters", "usual set"), rows)
    sets = [
        (
            info["name"] + (f" ({', '.join(info['aliases'])})" if info["aliases"] else ""),
            "cross-layer" if info["cross_layer"] else "per-layer",
            str(info["features_per_layer"]),
            "yes" if info["skip_connection"] else "no",
            "-" if info["l0"] is None else f"{info['l0']:.1f}",
            ", ".join(info["models"]),
        )
        for info in payload["transcoder_sets"]
    ]
    out.write("\ntranscoder sets\n")
    _columns(out, ("name", "kind", "features", "skip", "L0", "made for"), sets)
    out.write(f"also: {registry.GEMMA_SCOPE_2_PATTERN} (GemmaScope-2, for Gemma-3)\n")
    out.write(
        f"also: {', '.join(payload['bundled_transcoder_sets'])} (random, for the bundled models)\n"
    )
    return 0


def _columns(out: Any, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    # Numbers right-aligned, names left; the last column runs free.
    numeric = {"layers", "d_model", "parameters", "features", "L0"}
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if header[i] in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=False))
        ]
        out.write(("  ".join([*cells, row[-1]])).rstrip() + "\n")
