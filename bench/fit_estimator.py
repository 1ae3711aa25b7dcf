"""Fit the estimator's factors to measured attribution peaks, and show its error per point.

    python bench/fit_estimator.py docs/calibration/*.jsonl            # fit, print factors
    python bench/fit_estimator.py --check docs/calibration/*.jsonl    # error of CALIBRATION
    python bench/fit_estimator.py --check --markdown docs/calibration/*.jsonl

Input: the JSON lines of ``bench/attribution_peaks.py`` (each carries the model's dimensions
and parameter counts). For every point the estimate is made from those dimensions, the
measured number of active features, the batch size and the prompt length, exactly as
``pytest_ctresources.estimate.estimate`` makes it for a user.

Per architecture family the fit takes the residual-stream tensors the forward pass keeps
(least squares on the memory after the forward pass, split between the model dtype and
float32 where both dtypes were measured) and the d_mlp-sized intermediates alive at the
forward peak (median over points of at least 1024 batch-tokens), then the fixed workspace
(the resident memory beyond the parameters: cuBLAS workspaces). The structural terms
(attention probabilities, the backward gather) and the reserved-margin envelope are not
fitted. ``--check`` prints, per point, the predicted and measured allocated peak and the
error, and the worst errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources import estimate as est

GIB = 1 << 30


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
    from pytest_ctresources import registry, testing

    model = registry.model_shape(record["model"])
    transcoders = registry.transcoder_info(testing.RANDOM_TRANSCODERS, record["model"]).shape
    tokens = record["prompt_tokens"]
    workload = est.Workload(
        dtype=record["dtype"],
        batch_size=record["batch_size"],
        prompt_tokens=tokens,
        active_per_token=record["active_features"] / max(tokens - 1, 1),
        max_feature_nodes=record["max_feature_nodes"],
        n_logits=record["logit_targets"],
    )
    return model, transcoders, workload


def measured_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if not p.get("oom") and p.get("peak_allocated_bytes")]


def fit(points: list[dict[str, Any]]) -> est.Calibration:
    """Per family: the kept tensors (from the memory after the forward pass) and the
    transient ones at the forward peak; then the reserved margin and the workspace."""
    import numpy as np

    measured = measured_points(points)
    families: dict[str, est.FamilyFactors] = {}
    for family in sorted({p["dims"]["architecture"] for p in measured}):
        rows, targets, rest = [], [], []
        for record in (p for p in measured if p["dims"]["architecture"] == family):
            model, tc, work = shapes(record)
            b = est.DTYPE_BYTES[work.dtype]
            bt = work.batch_size * work.prompt_tokens
            layers = model.n_layers * model.d_model
            phases = record["phases"]
            kept = phases[1]["after"] - phases[0]["after"]
            # Structural part: attention probabilities and any skip output, per layer.
            structural = bt * model.n_layers * model.n_heads * work.prompt_tokens * b
            if tc.skip_connection:
                structural += bt * layers * b
            if tc.feature_input_hook == est.NORMALIZED_HOOK:
                structural += bt * layers * b
            rows.append([bt * layers * b / kept, bt * layers * 4 / kept])
            targets.append((kept - structural) / kept)
            forward_peak = phases[1]["peak"] - phases[0]["after"]
            rest.append((forward_peak, kept, bt, b, model))
        if len({r[3] for r in rest}) > 1:
            (kd, kf), *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
        else:
            # One dtype measured: its split between model-dtype and float32 tensors cannot be
            # told. Gemma-3 normalises in float32 as Gemma-2 does, so it takes Gemma-2's
            # float32 share and the rest in the model dtype; others keep all in their dtype.
            gemma2 = families.get("gemma2")
            kf = gemma2.kept_fp32 if family == "gemma3" and gemma2 is not None else 0.0
            kd = float(
                np.mean([(t - r[1] * kf) / r[0] for r, t in zip(rows, targets, strict=True)])
            )
        logits = 1.0  # per CALIBRATION's convention; a softcap adds one copy
        transients = [
            (
                (peak - kept) / bt / b
                - (logits + (model.final_logit_softcap is not None)) * model.vocab_size
            )
            / model.d_mlp
            for peak, kept, bt, b, model in rest
            if bt >= 1024  # small batches: a fixed part of the peak dominates
        ]
        families[family] = est.FamilyFactors(
            round(float(kd), 3),
            round(float(kf), 3),
            logits,
            round(float(np.median(transients)), 2),
            est.CALIBRATION.family(family).measured,
        )
    for family, factors in est.CALIBRATION.families.items():
        families.setdefault(family, factors)
    workspaces: list[int] = []
    for record in measured:
        model, tc, work = shapes(record)
        base = est.estimate(model, tc, work, est.CALIBRATION)
        workspaces.append(
            record["resident_bytes"] - (base.resident_bytes - est.CALIBRATION.workspace_bytes)
        )
    return replace(
        est.CALIBRATION,
        families=families,
        workspace_bytes=int(np.median(workspaces)),
    )


def check(points: list[dict[str, Any]], calibration: est.Calibration) -> list[dict[str, Any]]:
    results = []
    for record in points:
        model, tc, work = shapes(record)
        prediction = est.estimate(model, tc, work, calibration)
        row: dict[str, Any] = {
            "model": record["model"],
            "dtype": work.dtype,
            "tokens": work.prompt_tokens,
            "batch": work.batch_size,
            "active": work.active_features,
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
        results.append(row)
    return results


def print_check(results: list[dict[str, Any]], markdown: bool) -> None:
    if markdown:
        print(
            "| model | dtype | tokens | batch | active features | predicted GiB "
            "| measured GiB | error |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["measured"] is None:
            measured, error = f"OOM (card {r['device_gib']:.1f})", "-"
        else:
            measured, error = f"{r['measured']:.2f}", f"{100 * r['error']:+.1f}%"
        name = r["model"].removeprefix("ctresources/")
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
        if markdown:
            print(
                f"| {name} | {dtype} | {r['tokens']} | {r['batch']} | {r['active']} | "
                f"{r['predicted']:.2f} | {measured} | {error} |"
            )
        else:
            print(
                f"{name:24} {dtype:5} {r['tokens']:>5} {r['batch']:>5} {r['active']:>7} "
                f"{r['predicted']:>8.2f} {measured:>16} {error:>7}  {r['phase']}"
            )
    errors = [r["error"] for r in results if r.get("error") is not None]
    if errors:
        print(
            f"\n{len(errors)} points: worst over {100 * max(errors):+.1f}%, "
            f"worst under {100 * min(errors):+.1f}%, "
            f"mean |error| {100 * sum(abs(e) for e in errors) / len(errors):.1f}%"
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
