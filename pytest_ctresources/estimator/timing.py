"""How long ``attribute()`` takes at a batch size: the time model behind auto's choice.

The largest batch size that fits is not the fastest: every copy of the prompt costs forward
work, while a larger batch saves backward passes. Pure arithmetic over the same shapes as
:mod:`pytest_ctresources.estimator.estimate` (no torch). The structure follows
circuit-tracer 0.5.0's ``_run_attribution``; the seconds per unit were fitted to the H200
(``bench/batch_times.py`` measures each phase, ``bench/fit_times.py`` fits them,
``docs/calibration/README.md`` has the data and the commands, ``docs/estimator.md`` the
held-out check). Only the part of the call that depends on the batch size is modelled:

- **forward** (``run_forward_pass``): a fixed cost per layer, plus work proportional to
  copies x tokens x parameters (the model runs on ``batch_size`` copies);
- **logit passes**: ``ceil(n_logits / batch)`` backward passes, each over every copy
  (a pass's cost does not depend on how many of its rows are filled), their work growing
  with copies x decoder vectors x ``d_model`` (each pass reads the gradient at every active
  feature's decoder vectors: one per feature, or for a cross-layer transcoder one per layer
  it writes to, :func:`~pytest_ctresources.estimator.estimate.decoder_vectors_per_feature`);
- **feature passes**: ``ceil(feature rows / batch)`` such passes, each with a fixed cost
  per layer (kernel launches: what a larger batch saves) and the same per-copy work;
- **influences**: when ``max_feature_nodes`` is below the active features, circuit-tracer
  ranks features every ``4 x batch`` rows with ``compute_partial_influences`` over the
  edge matrix so far (rows x columns): fewer, and on average shorter, calls at a larger batch.

Setup (one prompt), building the input vectors and packaging the graph do not depend on the
batch size and are left out: the seconds are for comparing batch sizes, not a stopwatch.
The model ranks batch sizes within a few percent of each other less well than that (single
timings move by 10-30% between runs): of the sizes predicted within :data:`NEAR_FASTEST` of
the least, auto takes the one with the fewest backward passes, because where the model errs
near its optimum it is in under-counting the fixed cost of a pass (a feature pass's median
per layer at batch 32 and 30 tokens in ``docs/calibration/times/``: 1.2-1.3 ms on gemma-3-4b
against 0.7 ms on Llama-3.2-3B, one coefficient for both), which a larger batch saves.
The H200's figures are kept for every card: what moves with the device is mostly the overall
speed, which does not change which batch size is fastest (a card with a much lower
launch-to-compute ratio would favour smaller batches a little more; not measured).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from pytest_ctresources.estimator import estimate as est

#: ``_run_attribution``'s ``update_interval``: features are re-ranked every 4 x batch rows.
UPDATE_INTERVAL: Final = 4

#: Predicted times within this fraction of the least are a tie, decided by fewer backward
#: passes (the module's docstring says why).
NEAR_FASTEST: Final = 0.05


@dataclass(frozen=True)
class TimeCoefficients:
    """Seconds per unit of work, fitted on the H200 (``bench/fit_times.py``).

    Attributes:
        forward_per_layer: the forward pass's fixed cost per layer.
        forward_per_copy_token_param: per copy x token x model parameter.
        logit_per_copy_feature_dim: a logit pass's work per copy x decoder vector x d_model.
        pass_per_layer: a feature pass's fixed cost per layer.
        pass_per_copy_feature_dim: a feature pass's work per copy x decoder vector x d_model.
        influence_per_cell: ``compute_partial_influences`` per cell of the edge matrix it
            reads (rows so far x columns), summed over its calls.
    """

    forward_per_layer: float
    forward_per_copy_token_param: float
    logit_per_copy_feature_dim: float
    pass_per_layer: float
    pass_per_copy_feature_dim: float
    influence_per_cell: float


#: Fitted by ``bench/fit_times.py`` to ``docs/calibration/times/`` (the H200, 2026-12-02 and
#: 2026-12-03): gemma-2-2b, Llama-3.2-1B (131k skip transcoders) and Qwen3-1.7B at 30 and 300
#: tokens, Llama-3.2-3B and gemma-3-4b at 30 and 150, batch 16-512, bf16, 2048 feature nodes.
H200_TIMES: Final = TimeCoefficients(
    forward_per_layer=0.005925,
    forward_per_copy_token_param=4.892e-15,
    logit_per_copy_feature_dim=1.406e-11,
    pass_per_layer=0.0005662,
    pass_per_copy_feature_dim=2.868e-12,
    influence_per_cell=6.074e-10,
)


@dataclass(frozen=True)
class TimeEstimate:
    """The batch-dependent seconds of one ``attribute()`` call, by phase."""

    batch_size: int
    forward_s: float
    logit_s: float
    feature_s: float
    influence_s: float
    backward_passes: int

    @property
    def total_s(self) -> float:
        return self.forward_s + self.logit_s + self.feature_s + self.influence_s


def feature_rows(model: est.ModelShape, workload: est.Workload) -> int:
    """The feature rows ``attribute()`` computes: ``max_feature_nodes``, or every active
    feature when there are fewer (or no limit)."""
    return workload.feature_nodes(model.n_layers)


def influence_cells(rows: int, batch: int, n_logits: int) -> int:
    """Edge-matrix cells per column that the feature ranking reads over the whole call: one
    call before each queue of ``UPDATE_INTERVAL x batch`` rows, over the rows so far (the
    logit rows, then each finished queue)."""
    queue = UPDATE_INTERVAL * batch
    calls = math.ceil(rows / queue)
    return calls * n_logits + queue * calls * (calls - 1) // 2


def predict(
    model: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    coefficients: TimeCoefficients = H200_TIMES,
) -> TimeEstimate:
    """The batch-dependent seconds of ``workload``'s call on ``model`` with ``transcoders``."""
    c = coefficients
    batch, tokens = workload.batch_size, workload.prompt_tokens
    active = workload.active_features(model.n_layers)
    rows = feature_rows(model, workload)
    decoders = active * est.decoder_vectors_per_feature(model, transcoders)
    per_copy = batch * decoders * model.d_model
    logit_passes = math.ceil(workload.n_logits / batch)
    feature_passes = math.ceil(rows / batch)
    influence = 0.0
    if rows < active:
        columns = active + (model.n_layers + 1) * tokens
        cells = influence_cells(rows, batch, workload.n_logits)
        influence = c.influence_per_cell * columns * cells
    return TimeEstimate(
        batch_size=batch,
        forward_s=c.forward_per_layer * model.n_layers
        + c.forward_per_copy_token_param * batch * tokens * model.n_params,
        logit_s=logit_passes * c.logit_per_copy_feature_dim * per_copy,
        feature_s=feature_passes
        * (c.pass_per_layer * model.n_layers + c.pass_per_copy_feature_dim * per_copy),
        influence_s=influence,
        backward_passes=logit_passes + feature_passes,
    )


def fastest_of(
    model: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    sizes: Iterable[int],
    coefficients: TimeCoefficients = H200_TIMES,
) -> tuple[TimeEstimate, TimeEstimate]:
    """Of ``sizes``, the batch size auto runs and the one predicted fastest: of the sizes
    predicted within :data:`NEAR_FASTEST` of the least time, the one with the fewest
    backward passes, the smallest of those (less memory)."""
    timed = [
        predict(model, transcoders, est.with_batch(workload, batch), coefficients)
        for batch in sizes
    ]
    least = min(timed, key=lambda t: (t.total_s, t.batch_size))
    near = [t for t in timed if t.total_s <= least.total_s * (1 + NEAR_FASTEST)]
    return min(near, key=lambda t: (t.backward_passes, t.batch_size)), least


def fastest_batch(
    model: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    largest: int,
    coefficients: TimeCoefficients = H200_TIMES,
) -> tuple[TimeEstimate, TimeEstimate]:
    """:func:`fastest_of` the batch sizes up to ``largest`` (the largest that fits)."""
    return fastest_of(model, transcoders, workload, range(1, max(largest, 1) + 1), coefficients)
