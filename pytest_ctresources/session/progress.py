"""What a long attribution (or the pruning after it) is doing: its phases timed, its backward
batches counted.

circuit-tracer's ``attribute()`` runs a setup pass (``model.setup_attribution``), one forward
pass over ``batch_size`` copies of the prompt (``model.run_forward_pass``), then backward
passes in batches (``ctx.compute_batch``: the logits' rows, then the feature rows up to
``max_feature_nodes``). :class:`AttributionProbe` wraps those three calls for one
``attribute()`` call (instance attributes for its duration, restored after, as
``estimator.auto.reused_setup`` does), so that the time of each phase and the number of batches are
known as they happen: to a live progress line (:mod:`pytest_ctresources.session.progress_line`) and,
after the call, to the summary and the JSON report (:class:`AttributionTiming`).
:class:`PruningTiming` is the same for ``ct_session.graph_files`` and ``ct_session.prune``
(:mod:`pytest_ctresources.session.pruning`).

Pure bookkeeping, usable outside pytest; nothing here imports torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

#: The phases, in the order an attribution goes through them.
PHASES = ("setup", "forward", "backward")


@dataclass
class AttributionTiming:
    """One ``attribute()`` call: how long each phase took, and its backward batches.

    ``batches_total`` is known once the setup pass has counted the active features (the
    logits' batches, at most ``max_n_logits`` rows, then the features' up to
    ``max_feature_nodes``); None before.
    """

    batch_size: int
    phase: str = "setup"
    setup_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    batches_done: int = 0
    batches_total: int | None = None
    total_s: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        """``backward 7/17 batches of 64, 12.3 s (setup 0.4, forward 2.1)``."""
        return self.descriptions()[0]

    def descriptions(self) -> tuple[str, str, str]:
        """The description at three lengths, longest first, for a line that must fit a
        terminal: ``backward 7/17 batches of 64, 12.3 s (setup 0.4, forward 2.1)``, then
        without the phases done, then ``backward 7/17 12.3 s``. Each keeps the timer."""
        clock = f"{self.elapsed_s:.1f} s"
        if self.phase == "backward":
            total = "?" if self.batches_total is None else str(self.batches_total)
            counted = f"{self.batches_done}/{total}"
            doing = f"backward {counted} batches of {self.batch_size}"
            terse = f"backward {counted} {clock}"
        else:
            doing = f"{self.phase} pass" + (
                f" of {self.batch_size} copies" if self.phase == "forward" else ""
            )
            terse = f"{self.phase} {clock}"
        before = PHASES[: PHASES.index(self.phase)] if self.phase in PHASES else ()
        done = [f"{name} {getattr(self, f'{name}_s'):.1f}" for name in before]
        short = f"{doing}, {clock}"
        return (short + (f" ({', '.join(done)})" if done else ""), short, terse)

    def to_dict(self) -> dict[str, Any]:
        return _report_dict(self)


@dataclass
class PruningTiming:
    """One ``graph_files()`` or ``prune()`` call (``call``) on a graph of ``nodes`` nodes: the
    pruning (the dense graph moved to ``device`` and circuit-tracer's ``prune_graph`` there),
    then, for ``graph_files``, the files written from it (``phase`` ``"files"``)."""

    call: str
    nodes: int
    device: str
    phase: str = "prune"
    prune_s: float = 0.0
    files_s: float = 0.0
    total_s: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def files_started(self) -> None:
        """The pruning is over; the files are being written."""
        self.prune_s = self.elapsed_s
        self.phase = "files"

    def finished(self) -> None:
        self.total_s = self.elapsed_s
        if self.phase == "files":
            self.files_s = self.total_s - self.prune_s
        else:
            self.prune_s = self.total_s

    def descriptions(self) -> tuple[str, str, str]:
        """As :meth:`AttributionTiming.descriptions`: ``pruning 12,345 nodes on cuda:0,
        3.2 s``, then ``writing the graph files, 5.1 s (pruning 3.2)``."""
        clock = f"{self.elapsed_s:.1f} s"
        if self.phase == "files":
            short = f"writing the graph files, {clock}"
            return (f"{short} (pruning {self.prune_s:.1f})", short, f"files {clock}")
        short = f"pruning {self.nodes:,} nodes on {self.device}, {clock}"
        return (short, short, f"prune {clock}")

    def to_dict(self) -> dict[str, Any]:
        return _report_dict(self)


def _report_dict(timing: AttributionTiming | PruningTiming) -> dict[str, Any]:
    """A timing as the report writes it: its figures, seconds to the millisecond."""
    out = asdict(timing)
    del out["started"], out["phase"]
    return {
        key: round(value, 3) if isinstance(value, float) else value for key, value in out.items()
    }


class Progress(Protocol):
    """What a live line shows of a call: its time so far, its description at three lengths
    (:class:`AttributionTiming`, :class:`PruningTiming`)."""

    @property
    def elapsed_s(self) -> float: ...

    def descriptions(self) -> tuple[str, str, str]: ...


class ProgressListener(Protocol):
    """Told as an attribution (or a pruning) moves on, and when it is done (a live line erases
    itself)."""

    def update(self, timing: Progress) -> None: ...

    def done(self) -> None: ...


def batches_for(rows: int, batch_size: int) -> int:
    return math.ceil(rows / batch_size) if rows > 0 else 0


class AttributionProbe:
    """Times one ``attribute()`` call on ``model`` and tells ``listener`` as it moves on (a
    phase starts, a backward batch ends) and when it is done."""

    def __init__(
        self,
        batch_size: int,
        max_feature_nodes: int | None,
        max_n_logits: int,
        listener: ProgressListener | None = None,
    ) -> None:
        self.timing = AttributionTiming(batch_size)
        self._max_feature_nodes = max_feature_nodes
        self._max_n_logits = max_n_logits
        self._listener = listener
        self._phase_started = time.monotonic()

    def _enter(self, phase: str) -> None:
        now = time.monotonic()
        previous = self.timing.phase
        setattr(self.timing, f"{previous}_s", now - self._phase_started)
        self.timing.phase = phase
        self._phase_started = now
        self._update()

    def _update(self) -> None:
        if self._listener is not None:
            self._listener.update(self.timing)

    def _counted(self, context: Any) -> Any:
        active = _active_features(context)
        if active is not None:
            rows = (
                active if self._max_feature_nodes is None else min(active, self._max_feature_nodes)
            )
            batch = self.timing.batch_size
            self.timing.batches_total = batches_for(self._max_n_logits, batch) + batches_for(
                rows, batch
            )
        compute_batch = getattr(context, "compute_batch", None)
        if compute_batch is None:
            return context

        def counting(*args: Any, **kwargs: Any) -> Any:
            if self.timing.phase != "backward":
                self._enter("backward")
            try:
                return compute_batch(*args, **kwargs)
            finally:
                self.timing.batches_done += 1
                self._update()

        try:
            context.compute_batch = counting
        except AttributeError:  # a context that takes no attributes: phases only
            pass
        return context

    @contextmanager
    def watching(self, model: Any) -> Iterator[AttributionTiming]:
        """Wrap ``model``'s setup and forward passes for the block; yields the timing."""
        setup, forward = model.setup_attribution, model.run_forward_pass
        shadowed = {
            name: vars(model).get(name) for name in ("setup_attribution", "run_forward_pass")
        }

        def timed_setup(*args: Any, **kwargs: Any) -> Any:
            self._update()
            return self._counted(setup(*args, **kwargs))

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            self._enter("forward")
            return forward(*args, **kwargs)

        model.setup_attribution = timed_setup
        model.run_forward_pass = timed_forward
        try:
            yield self.timing
        finally:
            for name, previous in shadowed.items():
                if previous is None:
                    delattr(model, name)
                else:
                    setattr(model, name, previous)
            now = time.monotonic()
            setattr(self.timing, f"{self.timing.phase}_s", now - self._phase_started)
            self.timing.total_s = now - self.timing.started
            if self._listener is not None:
                self._listener.done()


def _active_features(context: Any) -> int | None:
    matrix = getattr(context, "activation_matrix", None)
    nnz = getattr(matrix, "_nnz", None)
    try:
        return int(nnz()) if callable(nnz) else None
    except (RuntimeError, TypeError, ValueError):
        return None
