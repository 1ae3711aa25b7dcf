"""``ct-resources estimate``: the estimate of one attribution, the batch sizes that fit a card
(:class:`FitRule`), the longest prompt that fits (``--longest-prompt``), as text or JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator.auto import (
    DEFAULT_AUTO_MARGIN,
    Budget,
    counted_for_fit,
    fit_batch,
)
from pytest_ctresources.estimator.cli_request import CliError, Request, gpu_budget, resolve
from pytest_ctresources.units import GIB, count_text


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
    gpu_gib, gpu_text = gpu_budget(args)
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
    rows = [
        est.estimate(request.model, request.transcoders, est.with_batch(workload, batch))
        for batch in _table_sizes(request.ceiling, *marked)
    ]
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
