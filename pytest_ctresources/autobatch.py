"""``--ct-batch-size auto``: the largest batch size whose estimated peak fits the GPU.

For each ``ct_session.attribute`` call with ``batch_size: auto``, the choice uses the loaded
model's own dimensions (read from the object), the prompt's real length, and its real
number of active transcoder features (from the same one-prompt setup pass ``attribute()``
starts with). What is already allocated (the model, anything cached) is measured, not
estimated. The budget is the GPU's capacity (or ``--ct-vram-capacity``) less the
``ct_auto_margin`` share, and what must fit in it is the predicted *allocated* peak (plus the
CUDA context on a real card): PyTorch's caching allocator gives its unused cache back before
it reports an out-of-memory error, so the reserved envelope the estimator also predicts is
not a requirement (measured under a 24 GiB cap on an H200: hand-picked sizes ran up to
23.33 GiB allocated, and 23.90 GiB reserved at another point; only a size at 98.4% of the
cap failed, and not always; docs/benchmarks.md). Where the budget is a share of a card (a
declared need, an xdist lease: ``Budget.shared``), what the process reserves is what the
others lose, so there auto fits the reserved peak, as estimated needs and leases count it
(:func:`counted`).

The choice's setup pass (one prompt through the model and the transcoders, 0.08-0.26 s on
the H200 for models of real size) is the one ``attribute()`` starts with: ``ct_session``
hands it over (:func:`reused_setup`) instead of running it twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pytest_ctresources import estimate as est
from pytest_ctresources import registry
from pytest_ctresources.config import CircuitTracerConfig

GIB = 1 << 30
#: ``ct_auto_margin``'s default: the share of the capacity auto leaves free beyond the
#: predicted peak (fragmentation, and what the estimator has not seen).
DEFAULT_AUTO_MARGIN = 0.05


@dataclass(frozen=True)
class Budget:
    """How much of the GPU an attribution may take, and how that was decided."""

    capacity_gib: float | None  # None: no CUDA GPU (the model runs on the CPU)
    capacity_source: str
    margin: float
    emulated: bool = False
    """The capacity caps PyTorch's allocator (``--ct-vram-capacity``): the CUDA context,
    outside the allocator, does not count against it."""
    shared: bool = False
    """The budget is a share of a card (a declared need, an xdist lease), not the card: what
    the process reserves must stay inside it, so auto fits the reserved peak there."""

    @property
    def budget_bytes(self) -> int:
        assert self.capacity_gib is not None
        return int(self.capacity_gib * (1 - self.margin) * GIB)

    def describe(self) -> str:
        if self.capacity_gib is None:
            return self.capacity_source
        return (
            f"budget {self.capacity_gib * (1 - self.margin):.1f} GiB = "
            f"{self.capacity_gib:.1f} GiB ({self.capacity_source}) less "
            f"{100 * self.margin:g}% margin"
        )


@dataclass(frozen=True)
class AutoChoice:
    """One batch size ``auto`` chose, and why."""

    batch_size: int
    prompt_tokens: int
    active_features: int | None
    predicted_gib: float | None
    reason: str

    def describe(self) -> str:
        facts = f"{self.prompt_tokens} prompt tokens"
        if self.active_features is not None:
            facts += f", {self.active_features} active features"
        if self.predicted_gib is not None:
            facts += f", predicted {self.predicted_gib:.2f} GiB"
        return f"batch size {self.batch_size} ({facts}; {self.reason})"


def _device_of(model: Any) -> Any:
    import torch

    device = getattr(model, "device", None)
    if device is None:
        device = next(model.parameters()).device
    return torch.device(device)


def choose(model: Any, prompt: Any, cfg: CircuitTracerConfig, budget: Budget) -> AutoChoice:
    """The batch size for ``attribute(prompt, model)`` under ``budget``."""
    return choose_with_setup(model, prompt, cfg, budget)[0]


def choose_with_setup(
    model: Any, prompt: Any, cfg: CircuitTracerConfig, budget: Budget
) -> tuple[AutoChoice, Any]:
    """:func:`choose`, and the setup context its pass computed (None without a GPU), for
    :func:`reused_setup` to hand to the attribution."""
    import torch

    input_ids = model.ensure_tokenized(prompt)
    tokens = int(input_ids.numel())
    ceiling = cfg.batch_size_max
    device = _device_of(model)
    if device.type != "cuda" or budget.capacity_gib is None:
        why = "the model is not on a CUDA GPU" if device.type != "cuda" else budget.describe()
        return AutoChoice(ceiling, tokens, None, None, f"{why}: the ceiling {ceiling}"), None
    # What is allocated now is what the attribution cannot use. (Garbage an earlier failure
    # left in reference cycles counts too until the collector runs; ct_session's own OOM
    # retry collects it, and a full collection here would cost ~0.2 s per call.) Measured
    # before the setup pass, whose tensors the estimate counts itself.
    resident = int(torch.cuda.memory_allocated(device))
    context = model.setup_attribution(input_ids)
    active = int(context.activation_matrix._nnz())
    model_shape, transcoders = registry.shapes_of_loaded(model)
    workload = registry.workload_of(cfg, tokens, active / max(tokens - 1, 1), 1)
    choice = _choice(model_shape, transcoders, workload, budget, ceiling, resident, active)
    return choice, context


@contextmanager
def reused_setup(model: Any, prompt: Any, context: Any) -> Iterator[None]:
    """Within the block, the model's next ``setup_attribution`` of ``prompt``'s tokens
    returns ``context`` (computed by :func:`choose_with_setup`) instead of running again;
    any other call runs as usual. The setup is deterministic, so the attribution is the same.
    """
    if context is None:
        yield
        return
    original = model.setup_attribution
    shadowed = vars(model).get("setup_attribution")  # an instance attribute of the caller's
    expected = model.ensure_tokenized(prompt)
    pending = [context]
    del context

    def setup_attribution(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        handed = pending.pop() if pending else None  # one chance: never kept past the first
        if handed is not None and not args and not kwargs and _same_tokens(input_ids, expected):
            return handed
        del handed
        return original(input_ids, *args, **kwargs)

    # An instance attribute for the block: the model may be cached and shared, but a test
    # runs one attribution at a time (not thread-safe, like the model itself).
    model.setup_attribution = setup_attribution
    try:
        yield
    finally:
        pending.clear()  # an unused context must not outlive the block
        if shadowed is None:
            del model.setup_attribution
        else:
            model.setup_attribution = shadowed


def _same_tokens(a: Any, b: Any) -> bool:
    return bool(a.shape == b.shape and a.device == b.device and (a == b).all())


def _choice(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    budget: Budget,
    ceiling: int,
    resident_bytes: int | None,
    active_features: int,
    assumed: str = "",
) -> AutoChoice:
    """Fit the batch and say why; the prediction counts ``resident_bytes`` (measured) in
    place of the estimate's weights and transcoders when given. ``assumed`` prefixes the
    reason with what the estimate had to assume."""
    fitted = fit_batch(model_shape, transcoders, workload, budget, ceiling, resident_bytes)
    if fitted is None:
        batch, prediction = 1, est.estimate(model_shape, transcoders, workload)
        why = f"not even batch size 1 is predicted to fit the {budget.describe()}; trying 1"
    else:
        batch, largest, prediction = fitted
        why = reason(batch, largest, ceiling, workload, budget)
    resident = prediction.resident_bytes if resident_bytes is None else resident_bytes
    predicted = (counted_for_fit(prediction, budget) - prediction.resident_bytes + resident) / GIB
    tokens = workload.prompt_tokens
    return AutoChoice(batch, tokens, active_features, predicted, assumed + why)


def counted(prediction: est.Estimate, budget: Budget) -> int:
    """What a process takes from a card others share (estimated needs, leases): the reserved
    peak, plus the CUDA context on a real card (a cap on PyTorch's allocator does not hold
    the context)."""
    return prediction.peak_reserved_bytes if budget.emulated else prediction.total_bytes


def counted_for_fit(prediction: est.Estimate, budget: Budget) -> int:
    """What auto fits into ``budget``: on a whole card (or under ``--ct-vram-capacity``),
    what must fit for the batch size to run, the allocated peak (see the module's
    docstring); in a share of a card (``budget.shared``), what the process takes from it,
    the reserved peak. Plus the CUDA context on a real card."""
    if budget.shared:
        return counted(prediction, budget)
    context = prediction.total_bytes - prediction.peak_reserved_bytes
    return prediction.peak_allocated_bytes + (0 if budget.emulated else context)


def fit_batch(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    budget: Budget,
    ceiling: int,
    resident_bytes: int | None = None,
) -> tuple[int, int, est.Estimate] | None:
    """auto's choice: (batch size, the largest that fits, its estimate), or None.

    The largest batch size up to ``ceiling`` whose estimate fits ``budget``, then the
    smallest that needs as few backward passes over the feature rows. ``resident_bytes``:
    what is allocated now, measured (None: the estimate's weights and transcoders).
    """
    found = est.largest_fitting_batch(
        model_shape,
        transcoders,
        workload,
        budget.budget_bytes,
        ceiling=ceiling,
        resident_bytes=resident_bytes,
        counted=lambda prediction: counted_for_fit(prediction, budget),
    )
    if found is None:
        return None
    largest = found[0]
    batch = est.balanced_batch(largest, _feature_rows(workload))
    return batch, largest, est.estimate(model_shape, transcoders, est.with_batch(workload, batch))


def _feature_rows(workload: est.Workload) -> int:
    nodes = workload.max_feature_nodes
    return workload.active_features if nodes is None else min(nodes, workload.active_features)


def reason(batch: int, largest: int, ceiling: int, workload: est.Workload, budget: Budget) -> str:
    """Why auto chose ``batch``, as the report says it."""
    text = f"the ceiling {ceiling}" if largest == ceiling else f"{largest} is the largest that fits"
    if batch != largest:
        rows = _feature_rows(workload)
        passes = math.ceil(rows / largest)
        text += f"; {batch} needs the same {passes} backward passes over {rows} feature rows"
    return f"{text}; {budget.describe()}"


def choose_from_config(
    cfg: CircuitTracerConfig, budget: Budget, prompt_tokens: int
) -> AutoChoice | None:
    """auto's choice before any model is loaded (a notebook's kernel will load it): from the
    registry's shapes, ``prompt_tokens`` and the assumed active features per token. None
    when the registry does not know the model or its transcoder set."""
    ceiling = cfg.batch_size_max
    if budget.capacity_gib is None:
        return AutoChoice(
            ceiling, prompt_tokens, None, None, f"{budget.describe()}: the ceiling {ceiling}"
        )
    try:
        model_shape, transcoders = registry.shapes_of_config(cfg)
    except registry.UnknownShape:
        return None
    workload = registry.workload_of(cfg, prompt_tokens, est.DEFAULT_ACTIVE_PER_TOKEN, 1)
    assumed = (
        f"estimated before the kernel starts for {prompt_tokens} prompt tokens "
        "(ct_estimate_prompt_tokens) and "
        f"{est.DEFAULT_ACTIVE_PER_TOKEN} active features per layer and token; "
    )
    return _choice(
        model_shape, transcoders, workload, budget, ceiling, None, workload.active_features, assumed
    )
