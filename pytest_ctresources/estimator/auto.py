"""``--ct-batch-size auto``: the fastest batch size whose estimated peak fits what is free.

For each ``ct_session.attribute`` call with ``batch_size: auto``, the choice uses the loaded
model's own dimensions (read from the object), the prompt's real length, and its real
number of active transcoder features (from the same one-prompt setup pass ``attribute()``
starts with). What is already allocated (the model, anything cached) is measured, not
estimated. What must fit is the predicted *allocated* peak (plus the CUDA context on a real
card): PyTorch's caching allocator gives its unused cache back before it reports an
out-of-memory error, so the reserved envelope the estimator also predicts is not a
requirement (measured under a 24 GiB cap on an H200, docs/benchmarks.md). Where the budget
is a share of a card (a declared need, an xdist lease: ``Budget.shared``), what the process
reserves is what the others lose, so there auto fits the reserved peak, as estimated needs
and leases count it (:func:`counted`).

Two bounds, the tighter wins, and the reason says which:

- the **budget**: the GPU's capacity (or ``--ct-vram-capacity``, a declared need, a lease)
  less the ``ct_auto_margin`` share;
- the **room**: what is free on the device now (``torch.cuda.mem_get_info()``, so other
  processes' memory counts) plus what this process's allocator reserves (the attribution
  reuses its cache), less the same margin's share of that. Without CUDA the model runs on
  the CPU, and the room is the host's available memory (psutil, else ``/proc/meminfo``'s
  MemAvailable; the container's cgroup limit less its usage where that is less) less the
  margin.

auto cannot be fooled by the estimator for long: after each call it chose, the measured peak
(``torch.cuda.max_memory_allocated()``, when the call raised it) corrects the predictions
for later calls on the same model and prompt length (:class:`Correction`, shown in the
choice's description, which the summary and the JSON report carry), and an out-of-memory
error at its choice does too. A first call on a model, with nothing measured yet, keeps a
margin no smaller than its family's worst under-prediction on the held-out validation
points (``estimate.WORST_UNDER_PREDICTION``).

Of the batch sizes that fit, auto runs the one the time model predicts fastest
(:mod:`pytest_ctresources.estimator.timing`, fitted on the H200): the largest that fits is
not the fastest once a larger batch's forward work outweighs the backward passes it saves.
Without CUDA no time model was measured; there auto keeps the smallest batch size that needs
as few backward passes as the largest that fits.

The choice's setup pass (one prompt through the model and the transcoders, 0.08-0.26 s on
the H200 for models of real size) is the one ``attribute()`` starts with: ``ct_session``
hands it over (:func:`reused_setup`) instead of running it twice. After it, and before the
attribution, a prompt that no batch size fits on the card (the attribution at batch size 1,
or the pruning after it) is refused in one line naming the phase (:class:`WillNotFit`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from pytest_ctresources.estimator import cgroup, loaded_model, of_config, registry, timing
from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.settings.config import DEFAULT_AUTO_MARGIN as DEFAULT_AUTO_MARGIN
from pytest_ctresources.settings.config import CircuitTracerConfig
from pytest_ctresources.units import GIB, bytes_text


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
class Room:
    """What the attribution may grow into now, in the bytes :func:`counted_for_fit` compares
    (or, on the CPU, in bytes of the call itself), and where the figure comes from."""

    bytes: int
    text: str


@dataclass(frozen=True)
class Correction:
    """What one measured call on a model taught about the estimator's prediction for that
    model and prompt: at ``batch_size`` the call took ``excess_bytes`` more than predicted
    (negative: less). Applied to other batch sizes the safe way round: an under-prediction
    grows with the batch above the measured one and stays whole below it; an over-prediction
    is taken whole above and shrinks with the batch below."""

    batch_size: int
    excess_bytes: int
    source: str  # "measured" or "out of memory"

    def at(self, batch: int) -> int:
        scale = batch / self.batch_size
        factor = max(1.0, scale) if self.excess_bytes > 0 else min(1.0, scale)
        return int(self.excess_bytes * factor)

    def describe(self) -> str:
        sign = "+" if self.excess_bytes >= 0 else "-"
        what = "the peak measured" if self.source == "measured" else "an out-of-memory error"
        return (
            f"corrected {sign}{abs(self.excess_bytes) / GIB:.2f} GiB at batch {self.batch_size} "
            f"from {what} there on this model and prompt length"
        )


@dataclass(frozen=True)
class AutoChoice:
    """One batch size ``auto`` chose, and why.

    ``measured_gib`` is set once the call ran (the allocated peak it reached, when it raised
    the device's peak); the private fields let :func:`observed` learn from the call."""

    batch_size: int
    prompt_tokens: int
    active_features: int | None
    predicted_gib: float | None
    reason: str
    measured_gib: float | None = None
    #: The model's layers, to say the active features per layer and token as well as in all.
    n_layers: int | None = None
    #: The model is on the CPU: the figures are of host memory.
    on_host: bool = False
    _key: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)
    _resident_bytes: int = field(default=0, repr=False, compare=False)
    _estimated_call_bytes: int = field(default=0, repr=False, compare=False)
    _predicted_call_bytes: int = field(default=0, repr=False, compare=False)
    _room_call_bytes: int | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        facts = f"{self.prompt_tokens} prompt tokens"
        if self.active_features is not None:
            facts += f", {self.active_features} active features"
            if self.n_layers:
                per = est.per_layer_token(self.active_features, self.n_layers, self.prompt_tokens)
                facts += f" in all ({per:.1f} per layer and token)"
        # On the CPU the figures are of host memory, said so: no GPU figure for a model that
        # is not on a GPU.
        of = " of host memory" if self.on_host else ""
        if self.predicted_gib is not None:
            facts += f", predicted {bytes_text(self.predicted_gib * GIB)}{of}"
        if self.measured_gib is not None:
            facts += f", measured {bytes_text(self.measured_gib * GIB)}{of}"
        return f"batch size {self.batch_size} ({facts}; {self.reason})"


#: Corrections per loaded model (weakly: a freed model takes its corrections with it), then
#: per prompt length and the call's other shaping settings.
_CORRECTIONS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Correction]] = (
    weakref.WeakKeyDictionary()
)


def correction_for(model: Any, key: tuple[Any, ...]) -> Correction | None:
    """What earlier calls on ``model`` measured for ``key`` (prompt length and settings)."""
    try:
        return _CORRECTIONS.get(model, {}).get(key)
    except TypeError:  # an object that cannot be weakly referenced learns nothing
        return None


def _remember(model: Any, key: tuple[Any, ...], correction: Correction) -> None:
    try:
        _CORRECTIONS.setdefault(model, {})[key] = correction
    except TypeError:
        pass


def _device_of(model: Any) -> Any:
    import torch

    device = getattr(model, "device", None)
    if device is None:
        device = next(model.parameters()).device
    return torch.device(device)


def host_available() -> tuple[int, str] | None:
    """The host's available memory in bytes and where it was read: psutil when installed,
    else ``/proc/meminfo``'s MemAvailable, and the container's cgroup limit less its usage
    where that is less (:mod:`~pytest_ctresources.estimator.cgroup`); None when none can say."""
    node = _node_available()
    limited = cgroup.memory_room()
    if limited is not None and (node is None or limited[0] < node[0]):
        return limited
    return node


def _node_available() -> tuple[int, str] | None:
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available), "psutil"
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _key_of(cfg: CircuitTracerConfig, tokens: int) -> tuple[Any, ...]:
    return (tokens, cfg.max_feature_nodes, cfg.max_n_logits, cfg.offload)


def choose(model: Any, prompt: Any, cfg: CircuitTracerConfig, budget: Budget) -> AutoChoice:
    """The batch size for ``attribute(prompt, model)`` under ``budget``."""
    return choose_with_setup(model, prompt, cfg, budget)[0]


def choose_with_setup(
    model: Any, prompt: Any, cfg: CircuitTracerConfig, budget: Budget
) -> tuple[AutoChoice, Any]:
    """:func:`choose`, and the setup context its pass computed, for :func:`reused_setup` to
    hand to the attribution."""
    import torch

    input_ids = model.ensure_tokenized(prompt)
    tokens = int(input_ids.numel())
    ceiling = cfg.batch_size_max
    device = _device_of(model)
    key = _key_of(cfg, tokens)
    correction = correction_for(model, key)
    cuda = device.type == "cuda"
    if cuda:
        # What is allocated now is what the attribution cannot use. (Garbage an earlier failure
        # left in reference cycles counts too until the collector runs; ct_session's own OOM
        # retry collects it, and a full collection here would cost ~0.2 s per call.) Measured
        # before the setup pass, whose tensors the estimate counts itself.
        resident = int(torch.cuda.memory_allocated(device))
        reserved = int(torch.cuda.memory_reserved(device))
        free, total = (int(value) for value in torch.cuda.mem_get_info(device))
    context = model.setup_attribution(input_ids)
    active = int(context.activation_matrix._nnz())
    model_shape, transcoders = loaded_model.shapes_of_loaded(model)
    workload = of_config.workload_of(cfg, tokens, 0.0, 1, counted_features=active)
    if not cuda:
        choice = _host_choice(model_shape, transcoders, workload, budget, ceiling, active)
        return replace(choice, _key=key), context
    refuse_what_cannot_fit(model_shape, transcoders, workload, budget, resident)
    room = device_room(free, reserved, total, budget)
    choice = _choice(
        model_shape,
        transcoders,
        workload,
        budget,
        ceiling,
        resident,
        active,
        room=room,
        correction=correction,
    )
    return replace(choice, _key=key, _resident_bytes=resident), context


class WillNotFit(RuntimeError):
    """auto's refusal, before the attribution starts: a phase of the pipeline does not fit
    the card at any batch size. The message is one line naming the phase and the card."""


def refuse_what_cannot_fit(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    budget: Budget,
    resident_bytes: int,
) -> None:
    """Raise :class:`WillNotFit` when a phase of the pipeline (:func:`est.pipeline`) is
    predicted over the budget at batch size 1: ``attribute()`` with what is allocated now
    (``resident_bytes``, measured), or the pruning after it (``prune_graph``,
    ``create_graph_files``; no batch size changes it) alone, its dense-graph buffers with
    nothing else on the card, so that a test that never prunes is refused only where its
    graph could not be pruned on that card at all. Only the budget (the card less the margin)
    refuses: what is free now may change, and a room too small only tries batch size 1."""
    if budget.capacity_gib is None:
        return
    smallest = est.estimate(model_shape, transcoders, est.with_batch(workload, 1))
    # What counted_for_fit adds to the allocated peak (the context, or the reserved margin
    # in a share of a card), with the measured resident memory for the estimate's.
    extra = counted_for_fit(smallest, budget) - smallest.peak_allocated_bytes
    for phase in est.pipeline(smallest).phases:
        alone = phase.name == "prune"
        need = phase.peak_allocated_bytes - smallest.resident_bytes + extra
        need += 0 if alone else resident_bytes
        if need > budget.budget_bytes:
            what = f"phase alone (prune_graph, {phase.note})" if alone else "phase (attribute())"
            raise WillNotFit(
                f"--ct-batch-size auto: {workload.prompt_tokens} prompt tokens cannot fit at "
                f"any batch size: the {phase.name} {what} is predicted to need "
                f"{bytes_text(need)} at batch size 1, over the {budget.describe()}"
            )


def device_room(free: int, reserved: int, total: int, budget: Budget) -> Room:
    """The room bound on a GPU: the allocated peak may reach what this process reserves now
    plus what the device has free, less the margin's share of that; plus the CUDA context
    where :func:`counted_for_fit` counts it (a real card; this process's context is already
    outside ``free``). ``total`` is the card's memory, which the room never exceeds."""
    context = 0 if budget.emulated else est.CALIBRATION.context_bytes
    room = int(min(reserved + free, total) * (1 - budget.margin))
    text = (
        f"room {room / GIB:.1f} GiB = {free / GIB:.1f} GiB free on the device (mem_get_info: "
        f"other processes' memory counts) + {reserved / GIB:.1f} GiB this process reserves, "
        f"less {100 * budget.margin:g}% margin"
    )
    return Room(room + context, text)


def kernel_room(free: int, budget: Budget) -> Room:
    """The room bound for a process not started yet (a notebook's kernel): what the device has
    free now (NVML: every process's memory counts), less the margin's share. The kernel's CUDA
    context will come out of that free memory; :func:`counted_for_fit` counts it on a real
    card, and here it is taken off where the fit does not count it (under a capacity cap)."""
    room = int(free * (1 - budget.margin))
    text = (
        f"room {room / GIB:.1f} GiB = {free / GIB:.1f} GiB free on the device (NVML: other "
        f"processes' memory counts) less {100 * budget.margin:g}% margin"
    )
    if budget.emulated:
        room -= est.CALIBRATION.context_bytes
    return Room(max(room, 0), text)


def _first_call_margin(family: str, budget: Budget) -> float:
    """The margin of a first call on a model: ``budget``'s, and never less than the family's
    worst under-prediction on the validation points."""
    worst = est.WORST_UNDER_PREDICTION.get(family, max(est.WORST_UNDER_PREDICTION.values()))
    return max(budget.margin, worst)


def _choice(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    budget: Budget,
    ceiling: int,
    resident_bytes: int | None,
    active_features: int,
    assumed: str = "",
    *,
    room: Room | None = None,
    correction: Correction | None = None,
) -> AutoChoice:
    """Fit the batch and say why; the prediction counts ``resident_bytes`` (measured) in
    place of the estimate's weights and transcoders when given. ``assumed`` prefixes the
    reason with what the estimate had to assume; ``room`` bounds the fit besides the budget;
    ``correction`` (what an earlier call measured) adjusts the predictions, and without one
    the family's first-call margin applies."""
    if correction is None:
        margin = _first_call_margin(model_shape.family, budget)
        if margin != budget.margin:
            budget = replace(budget, margin=margin)
    extra = correction.at if correction is not None else None
    limit = budget.budget_bytes if room is None else min(budget.budget_bytes, room.bytes)
    fitted = fit_batch(
        model_shape,
        transcoders,
        workload,
        budget,
        ceiling,
        resident_bytes,
        limit_bytes=limit,
        extra=extra,
    )
    if fitted is None:
        batch, prediction = 1, est.estimate(model_shape, transcoders, workload)
        bound = budget.describe() if room is None or limit == budget.budget_bytes else room.text
        why = f"not even batch size 1 is predicted to fit the {bound}; trying 1"
    else:
        batch, prediction = fitted.batch, fitted.prediction
        why = f"{fitted.why}; {budget.describe()}"
        largest = fitted.largest
        if room is not None and limit < budget.budget_bytes and largest < ceiling:
            why = why.removesuffix(budget.describe()) + room.text
    resident = prediction.resident_bytes if resident_bytes is None else resident_bytes
    excess = 0 if correction is None else correction.at(batch)
    counted_bytes = counted_for_fit(prediction, budget) - prediction.resident_bytes + resident
    predicted = (counted_bytes + excess) / GIB
    if correction is not None:
        why = f"{correction.describe()}; {why}"
    room_call = None
    if room is not None:
        # What the call itself may add before the device runs out: the room less what is
        # allocated now and the context counted in it.
        context = counted_for_fit(prediction, budget) - prediction.peak_allocated_bytes
        room_call = room.bytes - context - resident
    return AutoChoice(
        batch,
        workload.prompt_tokens,
        active_features,
        predicted,
        assumed + why,
        n_layers=model_shape.n_layers,
        _estimated_call_bytes=prediction.call_bytes,
        _predicted_call_bytes=prediction.call_bytes + excess,
        _room_call_bytes=room_call,
    )


def _host_choice(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    budget: Budget,
    ceiling: int,
    active_features: int | None,
    *,
    loaded: bool = True,
) -> AutoChoice:
    """Without CUDA: the largest batch whose call fits the host's available memory less the
    margin (a ``loaded`` model is already out of what is available; else its weights and
    transcoders count too)."""
    where = "the model is not on a CUDA GPU"

    def choice(batch: int, predicted_gib: float | None, why: str) -> AutoChoice:
        n_layers = model_shape.n_layers
        tokens = workload.prompt_tokens
        return AutoChoice(
            batch, tokens, active_features, predicted_gib, why, n_layers=n_layers, on_host=True
        )

    available = host_available()
    if available is None:
        why = f"{where}, and the host's available memory is unknown: the ceiling {ceiling}"
        return choice(ceiling, None, why)
    free, source = available
    text = (
        f"{where}: it fits the host's available memory, {free / GIB:.1f} GiB ({source}) less "
        f"{100 * budget.margin:g}% margin"
    )
    fitted = fit_batch(
        model_shape,
        transcoders,
        workload,
        budget,
        ceiling,
        0 if loaded else None,
        limit_bytes=int(free * (1 - budget.margin)),
        counted_as=lambda prediction: prediction.peak_allocated_bytes,
        timed=False,
    )
    if fitted is None:
        return choice(1, None, f"{text}; not even batch size 1 is predicted to fit; trying 1")
    return choice(fitted.batch, fitted.prediction.call_bytes / GIB, f"{text}; {fitted.why}")


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
    *,
    limit_bytes: int | None = None,
    extra: Callable[[int], int] | None = None,
    counted_as: Callable[[est.Estimate], int] | None = None,
    timed: bool = True,
) -> Fitted | None:
    """auto's choice, or None when not even batch size 1 fits.

    The largest batch size up to ``ceiling`` whose estimate fits ``budget`` (or
    ``limit_bytes`` in its place), then of those up to it the one predicted fastest
    (:func:`within_largest`). ``resident_bytes``: what is allocated now, measured (None:
    the estimate's weights and transcoders). ``extra(batch)`` adds a correction to each prediction.
    Without CUDA (:func:`_host_choice`), the limit is the host's available memory,
    ``counted_as`` replaces what a prediction counts against it, and ``timed=False`` leaves
    out the time model, which is a GPU's.
    """

    def need(prediction: est.Estimate) -> int:
        total = (
            counted_for_fit(prediction, budget) if counted_as is None else counted_as(prediction)
        )
        if extra is not None:
            total += extra(prediction.workload.batch_size)
        return total

    found = est.largest_fitting_batch(
        model_shape,
        transcoders,
        workload,
        budget.budget_bytes if limit_bytes is None else limit_bytes,
        ceiling=ceiling,
        resident_bytes=resident_bytes,
        counted=need,
    )
    if found is None:
        return None
    largest = found[0]
    batch, why = within_largest(model_shape, transcoders, workload, largest, ceiling, timed=timed)
    prediction = est.estimate(model_shape, transcoders, est.with_batch(workload, batch))
    return Fitted(batch, largest, prediction, why)


class Fitted(NamedTuple):
    """:func:`fit_batch`'s answer: the batch size auto runs, the largest that fits, the
    estimate at the first, and why (without the budget, which the caller says)."""

    batch: int
    largest: int
    prediction: est.Estimate
    why: str


def within_largest(
    model_shape: est.ModelShape,
    transcoders: est.TranscoderShape,
    workload: est.Workload,
    largest: int,
    ceiling: int,
    *,
    timed: bool = True,
) -> tuple[int, str]:
    """The batch size to run of those up to ``largest`` (the largest that fits; ``ceiling``
    when nothing smaller binds), and why: the time model's choice (``timed``, for a CUDA
    GPU; :func:`timing.fastest_batch`), else the smallest that needs as few backward passes
    over the feature rows as ``largest`` (the same passes on less memory)."""
    text = f"the ceiling {ceiling}" if largest == ceiling else f"{largest} is the largest that fits"
    if timed:
        chosen, least = timing.fastest_batch(model_shape, transcoders, workload, largest)
        if chosen.batch_size == least.batch_size == largest:
            return largest, f"{text}, and predicted fastest"
        seconds = f"{chosen.total_s:.3g} s of the batch-dependent part against "
        if chosen.batch_size == least.batch_size:
            at_largest = timing.predict(model_shape, transcoders, est.with_batch(workload, largest))
            return chosen.batch_size, (
                f"{text}; {chosen.batch_size} is predicted fastest ({seconds}"
                f"{at_largest.total_s:.3g} s at {largest}: the H200 time model)"
            )
        return chosen.batch_size, (
            f"{text}; {chosen.batch_size} is predicted within "
            f"{timing.NEAR_FASTEST:.0%} of the fastest on fewer backward passes ({seconds}"
            f"{least.total_s:.3g} s at {least.batch_size}: the H200 time model)"
        )
    rows = timing.feature_rows(model_shape, workload)
    batch = est.balanced_batch(largest, rows)
    if batch == largest:
        return largest, text
    passes = math.ceil(rows / largest)
    return (
        batch,
        f"{text}; {batch} needs the same {passes} backward batch(es) over {rows} feature rows",
    )


@dataclass
class Observation:
    """What :func:`observed` learnt from one call: the updated choice (measured peak and,
    for later calls, the correction), or None."""

    choice: AutoChoice | None = None


@contextmanager
def observed(model: Any, choice: AutoChoice | None, batch_size: int) -> Iterator[Observation]:
    """Around one ``attribute()`` call at ``batch_size``: when it is ``choice``'s own (not an
    OOM retry's), learn from it. A call that raised the device's allocated peak measured its
    own peak exactly: the difference from the prediction becomes the model's correction for
    this prompt length. A call that did not proves only an upper bound, kept when it shows
    the prediction was high. An out-of-memory error proves the call needed more than the
    room it had."""
    seen = Observation()
    if choice is None or choice._key is None or batch_size != choice.batch_size:
        yield seen
        return
    cuda = _device_of(model).type == "cuda"
    if not cuda:
        yield seen
        return
    import torch

    device = _device_of(model)
    before = int(torch.cuda.max_memory_allocated(device))
    try:
        yield seen
    except Exception as exc:
        from pytest_ctresources.gpu import oom

        if oom.is_oom(exc) and choice._room_call_bytes is not None:
            # The call needed more than the room it had: at least that much more than the
            # estimate.
            excess = choice._room_call_bytes - choice._estimated_call_bytes + 1
            previous = correction_for(model, choice._key)
            # Only where the estimate said the call fits does the error say it was wrong.
            if excess > 0 and (previous is None or previous.at(batch_size) < excess):
                _remember(model, choice._key, Correction(batch_size, excess, "out of memory"))
        raise
    after = int(torch.cuda.max_memory_allocated(device))
    call = after - choice._resident_bytes
    exact = after > before
    # Exact, or an upper bound below the prediction: either way a correction that never
    # predicts less than the call took.
    if exact or call < choice._predicted_call_bytes:
        excess = call - choice._estimated_call_bytes
        _remember(model, choice._key, Correction(batch_size, excess, "measured"))
    if exact:
        seen.choice = replace(choice, measured_gib=after / GIB)


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


def choose_from_config(
    cfg: CircuitTracerConfig,
    budget: Budget,
    prompt_tokens: int,
    *,
    host: bool = False,
    room: Room | None = None,
) -> AutoChoice | None:
    """auto's choice before any model is loaded (a notebook's kernel will load it, or a
    ``ct_session`` test asks ``ct_session.batch_size`` before its first call): from the
    registry's shapes, ``prompt_tokens`` and the transcoder set's active features per layer
    and token (its L0, or the documented default). None when the registry does not know the
    model or its transcoder set. Without a GPU: with ``host``, the host's available memory
    (weights included), as ``ct_session``'s own auto fits it; else the ceiling. On a GPU,
    ``room`` (see :func:`kernel_room`) bounds the fit besides the budget."""
    ceiling = cfg.batch_size_max
    if budget.capacity_gib is None and not host:
        return AutoChoice(
            ceiling, prompt_tokens, None, None, f"{budget.describe()}: the ceiling {ceiling}"
        )
    try:
        model_shape, transcoders = of_config.shapes_of_config(cfg)
    except registry.UnknownShape:
        return None
    per_layer = of_config.default_active_per_layer_token(cfg)
    workload = of_config.workload_of(cfg, prompt_tokens, per_layer, 1)
    if budget.capacity_gib is None:
        active = workload.active_features(model_shape.n_layers)
        return _host_choice(
            model_shape, transcoders, workload, budget, ceiling, active, loaded=False
        )
    assumed = (
        f"estimated before the kernel starts for {prompt_tokens} prompt tokens "
        f"(ct_estimate_prompt_tokens) and {per_layer:g} active features per layer and "
        "token; "
    )
    active = workload.active_features(model_shape.n_layers)
    return _choice(
        model_shape, transcoders, workload, budget, ceiling, None, active, assumed, room=room
    )
