"""Fit what the estimator does not derive, and show its error per point, fit and validation apart.

    python bench/fit_estimator.py docs/calibration/*.jsonl            # fit, print the numbers
    python bench/fit_estimator.py --check docs/calibration/*.jsonl    # error of CALIBRATION
    python bench/fit_estimator.py --check --markdown docs/calibration/*.jsonl

Input: the JSON lines of ``bench/attribution_peaks.py`` (each carries the model's dimensions
and parameter counts, and its split: ``fit`` or ``validation``; records without one are fit
points). For every point the estimate is made from those dimensions, the measured number of
active features, the batch size and the prompt length, exactly as
``pytest_ctresources.estimator.estimate.estimate`` makes it for ``--ct-batch-size auto``.

Every term that scales with the model's dimensions is derived from circuit-tracer's and
transformers' code and counted on the CPU (``bench/memory_terms.py``), so the fit takes
only what the code does not fix, from the fit points alone: the fixed workspace (resident
memory beyond the parameters: cuBLAS workspaces, median over points) and the residual-stream
gradients alive at the backward peak (``backward_layers``, the value in steps of 0.05 with the
smallest worst error over the fit points whose peak is in the backward passes). The
reserved-margin envelope is not fitted. ``--check`` prints, per split, the predicted and
measured allocated peak of every point and its error, then the worst errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.units import GIB


def load(paths: list[str]) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if "dims" in record or "n_model_params" in record:
                    points.append(record)
                else:
                    points.append(_with_gemma_2_2b_dims(record))
    # An OOM point has no count of active features: take it from the same model, dtype and
    # prompt (the prompt of a given length is the same at every batch size).
    counts = {
        (p["model"], p["dtype"], p["prompt_tokens"]): p["active_features"]
        for p in points
        if "active_features" in p
    }
    for point in points:
        point.setdefault("split", "fit")
        if "active_features" not in point:
            point["active_features"] = counts.get(
                (point["model"], point["dtype"], point["prompt_tokens"]), 0
            )
            point.setdefault("logit_targets", 10)
    return points


def _with_gemma_2_2b_dims(record: dict[str, Any]) -> dict[str, Any]:
    """Points measured before the records carried dimensions (2026-11-30, first file)."""
    from pytest_ctresources import testing

    dims = testing.model_dims_of(record["model"])
    import dataclasses

    return record | {
        "dims": dataclasses.asdict(dims),
        "n_model_params": dims.n_model_params,
        "n_transcoder_params": dims.n_transcoder_params,
    }


def shapes(record: dict[str, Any]) -> tuple[est.ModelShape, est.TranscoderShape, est.Workload]:
    """The point's shapes, as the registry gives them for its bundled random model."""
    from pytest_ctresources import testing
    from pytest_ctresources.estimator import registry

    model = registry.model_shape(record["model"])
    transcoders = registry.transcoder_info(testing.RANDOM_TRANSCODERS, record["model"]).shape
    tokens = record["prompt_tokens"]
    active = record["active_features"]
    workload = est.Workload(
        dtype=record["dtype"],
        batch_size=record["batch_size"],
        prompt_tokens=tokens,
        active_per_layer_token=active / max(model.n_layers * (tokens - 1), 1),
        max_feature_nodes=record["max_feature_nodes"],
        n_logits=record["logit_targets"],
        counted_features=active,
    )
    return model, transcoders, workload


def measured_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if not p.get("oom") and p.get("peak_allocated_bytes")]


def fit(points: list[dict[str, Any]]) -> est.Calibration:
    """The workspace and the backward passes' gradients, from the fit points only."""
    import numpy as np

    measured = [p for p in measured_points(points) if p["split"] == "fit"]
    workspaces: list[int] = []
    for record in measured:
        model, tc, work = shapes(record)
        base = est.estimate(model, tc, work, est.CALIBRATION)
        workspaces.append(
            record["resident_bytes"] - (base.resident_bytes - est.CALIBRATION.workspace_bytes)
        )
    calibration = replace(est.CALIBRATION, workspace_bytes=int(np.median(workspaces)))
    backward = [r for r in measured if _phase(r, calibration) == "backward"]
    if backward:
        candidates = [round(0.05 * step, 2) for step in range(0, 21)]

        def worst(layers: float) -> float:
            trial = replace(calibration, backward_layers=layers)
            return max(abs(row["error"]) for row in check(backward, trial))

        calibration = replace(calibration, backward_layers=min(candidates, key=worst))
    return calibration


def _phase(record: dict[str, Any], calibration: est.Calibration) -> str:
    model, tc, work = shapes(record)
    return est.estimate(model, tc, work, calibration).peak_phase


def check(points: list[dict[str, Any]], calibration: est.Calibration) -> list[dict[str, Any]]:
    results = []
    for record in points:
        model, tc, work = shapes(record)
        prediction = est.estimate(model, tc, work, calibration)
        row: dict[str, Any] = {
            "split": record["split"],
            "model": record["model"],
            "dtype": work.dtype,
            "tokens": work.prompt_tokens,
            "batch": work.batch_size,
            "active": work.active_features(model.n_layers),
            "predicted": prediction.peak_allocated_bytes / GIB,
            "predicted_reserved": prediction.peak_reserved_bytes / GIB,
            "phase": prediction.peak_phase,
        }
        if record.get("oom"):
            row["measured"] = None
            row["device_gib"] = record.get("device_total_bytes", 0) / GIB
        else:
            row["measured"] = record["peak_allocated_bytes"] / GIB
            row["measured_reserved"] = record["peak_reserved_bytes"] / GIB
            row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
            # What the call added to what was allocated before it, measured and predicted.
            resident = record["resident_bytes"] / GIB
            row["call_measured"] = row["measured"] - resident
            row["call_error"] = (row["predicted"] - row["measured"]) / max(
                row["call_measured"], 1e-9
            )
        results.append(row)
    return results


def print_check(results: list[dict[str, Any]], markdown: bool) -> None:
    for split in ("fit", "validation"):
        rows = [r for r in results if r["split"] == split]
        if rows:
            print(f"\n{split} points ({len(rows)}):")
            _print_rows(rows, markdown)


def _print_rows(results: list[dict[str, Any]], markdown: bool) -> None:
    if markdown:
        print(
            "| model | dtype | tokens | batch | active features | predicted GiB "
            "| measured GiB | error | call measured GiB | call error |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["measured"] is None:
            measured, error = f"OOM (card {r['device_gib']:.1f})", "-"
            call, call_error = "-", "-"
        else:
            measured, error = f"{r['measured']:.2f}", f"{100 * r['error']:+.2f}%"
            call, call_error = f"{r['call_measured']:.2f}", f"{100 * r['call_error']:+.1f}%"
        name = r["model"].removeprefix("ctresources/")
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
        if markdown:
            print(
                f"| {name} | {dtype} | {r['tokens']} | {r['batch']} | {r['active']} | "
                f"{r['predicted']:.2f} | {measured} | {error} | {call} | {call_error} |"
            )
        else:
            print(
                f"{name:24} {dtype:5} {r['tokens']:>5} {r['batch']:>5} {r['active']:>7} "
                f"{r['predicted']:>8.2f} {measured:>16} {error:>8} {call:>7} {call_error:>7}  "
                f"{r['phase']}"
            )
    errors = [r["error"] for r in results if r.get("error") is not None]
    if errors:
        print(
            f"\n{len(errors)} points: worst over {100 * max(errors):+.2f}%, "
            f"worst under {100 * min(errors):+.2f}%, "
            f"mean |error| {100 * sum(abs(e) for e in errors) / len(errors):.2f}%"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--check", action="store_true", help="error of the shipped CALIBRATION")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    points = load(args.files)
    if args.check:
        print_check(check(points, est.CALIBRATION), args.markdown)
        return 0
    fitted = fit(points)
    print(fitted)
    print_check(check(points, fitted), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
