"""Fit the time model (``estimator/timing.py``) to ``bench/batch_times.py``'s data.

    python3 bench/fit_times.py docs/calibration/times/2026-12-02-h200-attribute-times.jsonl

Two fits, each a least-squares fit of relative error with non-negative coefficients:

1. ``influence_per_cell`` from each call's ``influence_s`` against the edge-matrix cells
   its feature rankings read (:func:`timing.influence_cells` x columns);
2. the other five from the rest of the batch-dependent time (``total_s`` less setup, the
   input vectors, the packaging and the measured influences) against the model's terms.

Then, per model and prompt length, the check auto needs: among the measured batch sizes up to
each cap, is the one auto would pick (:func:`timing.fastest_of`) within 10% of the fastest
measured? Once on the fit, once leaving each model out of the fit (a model the coefficients
never saw), and on the ``--held-out`` records (never fitted: ``docs/calibration/times/held-out/``).
Prints the coefficients as :data:`timing.H200_TIMES` takes them. Needs numpy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator import timing

FIELDS = (
    "forward_per_layer",
    "forward_per_copy_token_param",
    "logit_per_copy_feature_dim",
    "pass_per_layer",
    "pass_per_copy_feature_dim",
)


def shapes(
    point: dict[str, Any], batch: int | None = None
) -> tuple[est.ModelShape, est.TranscoderShape, est.Workload]:
    """The model, transcoders and workload of a measured point (its counted active
    features)."""
    dims = point["dims"]
    model = est.ModelShape(
        name=point["model"],
        family=dims["family"],
        n_layers=dims["n_layers"],
        d_model=dims["d_model"],
        d_mlp=dims["d_mlp"],
        vocab_size=dims["vocab_size"],
        n_heads=dims["n_heads"],
        n_kv_heads=dims["n_kv_heads"],
        head_dim=dims["head_dim"],
        n_params=dims["n_params"],
    )
    transcoders = est.TranscoderShape(
        name=point["model"],
        width=dims["d_transcoder"],
        cross_layer=dims["cross_layer"],
        skip_connection=dims["skip_connection"],
    )
    work = est.Workload(
        "bfloat16",
        batch or point["batch"],
        point["tokens"],
        0.0,
        point["max_feature_nodes"],
        counted_features=point["active_features"],
    )
    return model, transcoders, work


def unit_terms(point: dict[str, Any]) -> list[float]:
    """The five terms at a point: the time model with each coefficient set to 1 alone."""
    terms = []
    for field in FIELDS:
        unit = timing.TimeCoefficients(
            **{name: float(name == field) for name in FIELDS}, influence_per_cell=0.0
        )
        terms.append(timing.predict(*shapes(point), unit).total_s)
    return terms


def cells(point: dict[str, Any]) -> float:
    unit = timing.TimeCoefficients(*(0.0 for _ in FIELDS), influence_per_cell=1.0)
    return timing.predict(*shapes(point), unit).influence_s


def batch_dependent_s(point: dict[str, Any]) -> float:
    return point["total_s"] - point["setup_s"] - point["inputs_s"] - point["rest_s"]


def nonnegative_fit(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares of relative error, every coefficient >= 0: the best over subsets of
    columns whose unconstrained fit is non-negative (few columns: exact and dependency-free)."""
    scale = columns.max(axis=0)
    scale[scale == 0] = 1.0
    scaled = columns / scale / target[:, None]
    ones = np.ones(len(target))
    best, best_error = np.zeros(columns.shape[1]), float(ones @ ones)
    for size in range(1, columns.shape[1] + 1):
        for subset in itertools.combinations(range(columns.shape[1]), size):
            picked = list(subset)
            coef, *_ = np.linalg.lstsq(scaled[:, picked], ones, rcond=None)
            if (coef < 0).any():
                continue
            residual = scaled[:, picked] @ coef - ones
            if float(residual @ residual) < best_error:
                best_error = float(residual @ residual)
                best = np.zeros(columns.shape[1])
                best[picked] = coef
    return best / scale


def fit(points: Sequence[dict[str, Any]]) -> timing.TimeCoefficients:
    ranked = [p for p in points if p["influence_calls"] and p["influence_s"] > 0]
    influence = nonnegative_fit(
        np.array([[cells(p)] for p in ranked]), np.array([p["influence_s"] for p in ranked])
    )[0]
    rest = nonnegative_fit(
        np.array([unit_terms(p) for p in points]),
        np.array([batch_dependent_s(p) - p["influence_s"] for p in points]),
    )
    return timing.TimeCoefficients(*map(float, rest), influence_per_cell=float(influence))


def choice_checks(
    points: Sequence[dict[str, Any]],
    coefficients: timing.TimeCoefficients,
    say: Callable[[str], None],
) -> float:
    """Per model, prompt length and cap: the predicted-fastest measured batch's median time
    over the fastest's. Returns the worst ratio."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for point in points:
        groups.setdefault((point["model"], point["tokens"]), []).append(point)
    worst = 1.0
    for (model, tokens), group in groups.items():
        times: dict[int, list[float]] = {}
        for point in group:
            times.setdefault(point["batch"], []).append(point["total_s"])
        medians = {batch: statistics.median(values) for batch, values in times.items()}
        if len(medians) < 3:
            continue
        for cap in sorted({max(medians), 256, 128} & set(range(min(medians), max(medians) + 1))):
            fitting = [batch for batch in medians if batch <= cap]
            picked, _ = timing.fastest_of(*shapes(group[0]), fitting, coefficients)
            chosen, fastest = picked.batch_size, min(fitting, key=medians.__getitem__)
            ratio = medians[chosen] / medians[fastest]
            worst = max(worst, ratio)
            say(
                f"  {model} {tokens} tokens, up to {cap}: auto picks {chosen} "
                f"({medians[chosen]:.3f} s), fastest {fastest} ({medians[fastest]:.3f} s): "
                f"{ratio:.3f}"
            )
    return worst


def read(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The records of ``paths`` (JSON lines) that did not run out of memory."""
    return [
        record
        for path in paths
        for line in path.read_text().splitlines()
        if line.startswith("{")
        for record in [json.loads(line)]
        if not record.get("oom")
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", type=Path, help="bench/batch_times.py JSON lines")
    parser.add_argument(
        "--held-out",
        nargs="+",
        type=Path,
        default=[],
        help="more records, checked against the fit and never fitted",
    )
    args = parser.parse_args(argv)
    points = read(args.data)
    coefficients = fit(points)
    print("H200_TIMES = TimeCoefficients(")
    for name, value in vars(coefficients).items():
        print(f"    {name}={value:.4g},")
    print(")")
    errors = [
        timing.predict(*shapes(p), coefficients).total_s / batch_dependent_s(p) - 1 for p in points
    ]
    print(
        "batch-dependent seconds, predicted / measured - 1: "
        f"median {statistics.median(errors):+.3f}, "
        f"{min(errors):+.3f} to {max(errors):+.3f} over {len(points)} calls"
    )
    print("auto's check on the fit:")
    worst = choice_checks(points, coefficients, print)
    for model in sorted({p["model"] for p in points}):
        kept = [p for p in points if p["model"] != model]
        if len({p["model"] for p in kept}) < 2:
            continue
        print(f"held out {model}:")
        worst = max(
            worst, choice_checks([p for p in points if p["model"] == model], fit(kept), print)
        )
    held_out = read(args.held_out)
    if held_out:
        print("auto's check on the held-out records:")
        worst = max(worst, choice_checks(held_out, coefficients, print))
        errors = [
            timing.predict(*shapes(p), coefficients).total_s / batch_dependent_s(p) - 1
            for p in held_out
        ]
        print(
            f"  batch-dependent seconds: {min(errors):+.3f} to {max(errors):+.3f} "
            f"over {len(held_out)} calls"
        )
    print(f"worst ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
