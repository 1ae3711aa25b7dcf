"""CtSession: one test's handle on circuit-tracer: its config, its model (through the
session-wide :class:`~pytest_ctresources.session.cache.ModelCache`), its attributions.

Usable without pytest: ``CtSession(cfg, ModelCache())`` gives the same ``load_model``,
``attribute``, ``graph_files`` and ``prune`` as the ``ct_session`` fixture. The pruning after
an attribution is :mod:`pytest_ctresources.session.pruning`'s; this class keeps its calls.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_ctresources.estimator.auto import DEFAULT_AUTO_MARGIN, AutoChoice, Budget
from pytest_ctresources.gpu import oom
from pytest_ctresources.gpu.cleanup import cleanup_python_cuda
from pytest_ctresources.gpu.measure import VramFigures, VramMeter
from pytest_ctresources.session import pruning
from pytest_ctresources.session.cache import ModelCache
from pytest_ctresources.session.progress import (
    AttributionProbe,
    AttributionTiming,
    ProgressListener,
)
from pytest_ctresources.settings.config import (
    AUTO,
    FIELDS,
    CircuitTracerConfig,
    ConfigError,
    validate_typed,
)
from pytest_ctresources.units import GIB

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttributionCall:
    """The keyword arguments one ``attribute()`` call received, and how long its phases took
    (of the attempt that succeeded, after any OOM halving)."""

    kwargs: dict[str, Any]
    timing: AttributionTiming | None = None


def _attribute_parameters() -> set[str]:
    from circuit_tracer import attribute

    return set(inspect.signature(attribute).parameters) - {"prompt", "model"}


class CtSession:
    """A test's circuit-tracer session: its config, its model, its attributions.

    Attributes:
        cfg: the resolved
            :class:`~pytest_ctresources.settings.config.CircuitTracerConfig` of the test.
        calls: every successful :meth:`attribute` call's keyword arguments, in order.
        prunings: every successful :meth:`graph_files` and :meth:`prune` call, in order: its
            thresholds, timing and peak.
        pruning_oom: what the last :meth:`graph_files` or :meth:`prune` call was pruning when
            it ran out of memory (None: it did not).
        halvings: every out-of-memory :meth:`attribute` recovered from, in order.
        auto_choices: the batch size ``batch_size="auto"`` chose for each call, and why.
        oom_retry: whether :meth:`attribute` halves the batch size and retries after OOM.
        oom_retry_floor: the smallest batch size it retries with.
    """

    def __init__(
        self,
        cfg: CircuitTracerConfig,
        cache: ModelCache | None = None,
        *,
        oom_retry: bool = True,
        oom_retry_floor: int = 1,
        meter: VramMeter | None = None,
        auto_budget: Budget | None = None,
        estimate_prompt_tokens: int = 32,
        progress: ProgressListener | None = None,
    ) -> None:
        self.cfg = cfg
        self.calls: list[AttributionCall] = []
        self.prunings: list[pruning.PruningCall] = []
        self.pruning_oom: pruning.PruningOom | None = None
        self.halvings: list[oom.Halving] = []
        self.auto_choices: list[AutoChoice] = []
        self.auto_budget = auto_budget
        self.estimate_prompt_tokens = estimate_prompt_tokens
        #: Told as an attribution moves on (a phase starts, a backward batch ends).
        self.progress = progress
        self.oom_retry = oom_retry
        self.oom_retry_floor = oom_retry_floor
        self._cache = cache if cache is not None else ModelCache()
        self._meter = meter if meter is not None else VramMeter()

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike[str] | None = None,
        cache: ModelCache | None = None,
        **overrides: Any,
    ) -> CtSession:
        """A session outside pytest (a notebook, a script), its config layered as a test's:
        defaults < the experiment YAML ``path`` (None: ``CT_CONFIG``'s, if set) < the
        ``CT_*`` environment < ``overrides``, which are
        :class:`~pytest_ctresources.CircuitTracerConfig` fields
        (``CtSession.from_yaml("exp.yaml", batch_size=32)``).

        ``cache`` keeps models between sessions (default: a new one). Raises
        :class:`~pytest_ctresources.ConfigError`, one line naming the file, the variable or
        the keyword at fault.
        """
        from pytest_ctresources.settings.standalone import config_outside_pytest

        return cls(config_outside_pytest(path, overrides), cache)

    @property
    def batch_size(self) -> int:
        """The batch size as a number, never ``"auto"``, for arithmetic in tests
        (``ct_session.batch_size // 4``).

        After an :meth:`attribute` call: the batch size it ran with (under ``auto``, the
        choice for its prompt, after any OOM halving). Before the first call: the configured
        one, or under ``auto`` the choice the estimate makes before anything is loaded, for a
        prompt of ``estimate_prompt_tokens`` tokens (each call then chooses for its own
        prompt), or ``batch_size_max`` for a model the estimator does not know.
        """
        if self.calls:
            return int(self.calls[-1].kwargs["batch_size"])
        if self.cfg.batch_size != AUTO:
            return int(self.cfg.batch_size)
        from pytest_ctresources.estimator.auto import choose_from_config

        budget = self.auto_budget or _visible_gpu_budget()
        choice = choose_from_config(self.cfg, budget, self.estimate_prompt_tokens, host=True)
        return choice.batch_size if choice is not None else self.cfg.batch_size_max

    def vram(self) -> VramFigures | None:
        """This test's CUDA memory so far (baseline and peaks), or None if it used no CUDA."""
        return self._meter.figures()

    def load_model(self, device: str | torch.device | None = None) -> Any:
        """The ReplacementModel of ``cfg``, loaded once per session (see :class:`ModelCache`)."""
        from pytest_ctresources.bundled.builders import default_device

        return self._cache.get(self.cfg, device if device is not None else default_device())

    def attribute(self, prompt: Any, model: Any = None, **overrides: Any) -> Any:
        """Run ``circuit_tracer.attribute(prompt, model, **kwargs)`` with this test's config.

        ``kwargs`` are :meth:`CircuitTracerConfig.attribute_kwargs`, updated with
        ``overrides`` (config fields are validated as in a marker; other ``attribute()``
        parameters such as ``attribution_targets`` pass through). ``model`` defaults to
        :meth:`load_model`.

        With ``batch_size="auto"`` the batch size is the largest whose estimated peak fits
        the budget (:mod:`pytest_ctresources.estimator.auto`), chosen per call and recorded in
        :attr:`auto_choices`.

        On ``torch.cuda.OutOfMemoryError`` (with ``oom_retry``), the memory the failed attempt
        held is freed, the batch size halved and the call retried, down to
        ``oom_retry_floor``; each halving is recorded in :attr:`halvings`. Attribution results
        do not depend on the batch size, so the retry is safe.
        """
        # A wrong keyword or value is the test's mistake: pytest shows the test's frame and
        # the one-line message, not this method.
        __tracebackhide__ = True
        kwargs = self.cfg.attribute_kwargs()
        unknown = set(overrides) - _attribute_parameters()
        if unknown:
            raise TypeError(
                f"attribute() got unexpected keyword argument(s) {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(sorted(_attribute_parameters()))}"
            )
        for name, value in overrides.items():
            if name in FIELDS and value is not None:
                try:
                    value = validate_typed(name, value)
                except ConfigError as exc:
                    raise ValueError(f"attribute({name}=...): {exc}") from None
            kwargs[name] = value
        if model is None:
            model = self.load_model()
        from circuit_tracer import attribute

        from pytest_ctresources.estimator.auto import choose_with_setup, observed, reused_setup

        if kwargs["batch_size"] == AUTO:
            # The call's own overrides (max_feature_nodes, offload, ...) shape the estimate.
            call_cfg = dataclasses.replace(
                self.cfg,
                max_feature_nodes=kwargs["max_feature_nodes"],
                max_n_logits=kwargs["max_n_logits"],
                offload=kwargs["offload"],
            )
            budget = self.auto_budget or _budget_of(model)
            choice, setup = choose_with_setup(model, prompt, call_cfg, budget)
            self.auto_choices.append(choice)
            kwargs["batch_size"] = choice.batch_size
        else:
            choice, setup = None, None
        while True:
            try:
                # auto's setup pass is the one attribute() starts with: it is not run twice;
                # the call's measured peak corrects auto's later choices on this model.
                probe = AttributionProbe(
                    kwargs["batch_size"],
                    kwargs["max_feature_nodes"],
                    kwargs["max_n_logits"],
                    self.progress,
                )
                with (
                    reused_setup(model, prompt, setup),
                    observed(model, choice, kwargs["batch_size"]) as seen,
                    probe.watching(model),
                ):
                    setup = None  # the first attempt only: a retry runs its own
                    graph = attribute(prompt, model, **kwargs)
            except Exception as exc:
                smaller = max(self.oom_retry_floor, kwargs["batch_size"] // 2)
                if not (self.oom_retry and oom.is_oom(exc) and smaller < kwargs["batch_size"]):
                    raise
                # The failed attempt's frames (and nnsight threads it left blocked) hold its
                # activations: free them before retrying.
                oom.release(exc, model)
                self.halvings.append(oom.Halving(kwargs["batch_size"], smaller))
                kwargs["batch_size"] = smaller
            else:
                if seen.choice is not None:
                    self.auto_choices[-1] = seen.choice
                self.calls.append(AttributionCall(dict(kwargs), probe.timing))
                return graph
            cleanup_python_cuda()

    def graph_files(
        self,
        graph: Any,
        slug: str,
        output_path: str | os.PathLike[str],
        *,
        node_threshold: float = pruning.NODE_THRESHOLD,
        edge_threshold: float = pruning.EDGE_THRESHOLD,
        **kwargs: Any,
    ) -> Path:
        """Write ``graph``'s files for circuit-tracer's graph viewer: ``create_graph_files(graph,
        slug, output_path, node_threshold=..., edge_threshold=..., **kwargs)``
        (``circuit_tracer.utils``), timed, measured and explained as :meth:`attribute` is.

        ``graph`` is what :meth:`attribute` returned, or the path of a graph saved with
        ``Graph.to_pt``. ``slug`` names the graph and its file, ``<slug>.json`` in
        ``output_path`` (created if missing; a relative path is the current directory's),
        beside circuit-tracer's ``graph-metadata.json``. The thresholds are the fractions of
        the total influence the kept nodes and edges carry, from 0 to 1; ``kwargs`` are
        ``create_graph_files``'s others (``scan``). Returns the JSON file's path.

        ``create_graph_files`` prunes the dense graph on the GPU when there is one
        (``prune_graph``, the pipeline's second memory peak; see :meth:`prune`). The call is
        timed (the pruning, then the files; the live progress line shows it) and recorded in
        :attr:`prunings` with its peak. An out-of-memory error inside it is recorded in
        :attr:`pruning_oom` and explained in the test's report as the pruning's. ``graph``
        itself is not moved. A graph of a bundled model writes its files offline, even once
        its model is gone.
        """
        # A wrong argument is the test's mistake: one line, the test's frame.
        __tracebackhide__ = True
        extras = pruning.graph_files_extras("graph_files", kwargs)
        nodes = pruning.threshold("graph_files", "node_threshold", node_threshold)
        edges = pruning.threshold("graph_files", "edge_threshold", edge_threshold)
        name = pruning.slug_of(slug)
        directory = pruning.output_directory(output_path, name)
        loaded = pruning.graph_of("graph_files", graph)
        device = pruning.device_of("graph_files", None)  # where create_graph_files prunes
        run = pruning.PruningRun("graph_files", loaded, device, nodes, edges, self.progress)
        try:
            path = run.graph_files(name, directory, extras)
        finally:
            self.pruning_oom = run.oom
        self.prunings.append(run.record(path))
        return path

    def prune(
        self,
        graph: Any,
        node_threshold: float = pruning.NODE_THRESHOLD,
        edge_threshold: float = pruning.EDGE_THRESHOLD,
        *,
        device: str | torch.device | None = None,
    ) -> Any:
        """``prune_graph(graph, node_threshold, edge_threshold)`` (``circuit_tracer.graph``) on
        ``device``, timed, measured and explained as :meth:`graph_files` is.

        ``device`` defaults to where ``create_graph_files`` prunes: the current CUDA device
        when there is one, else the CPU; ``device="cpu"`` prunes in host memory, where a graph
        too large for the card may still fit. ``graph`` itself is not moved (a graph or the
        path of a saved one, as for :meth:`graph_files`). Returns ``prune_graph``'s
        ``PruneResult`` (``node_mask``, ``edge_mask``, ``cumulative_scores``) on the CPU.
        """
        __tracebackhide__ = True
        nodes = pruning.threshold("prune", "node_threshold", node_threshold)
        edges = pruning.threshold("prune", "edge_threshold", edge_threshold)
        where = pruning.device_of("prune", device)
        loaded = pruning.graph_of("prune", graph)
        run = pruning.PruningRun("prune", loaded, where, nodes, edges, self.progress)
        try:
            result = run.prune()
        finally:
            self.pruning_oom = run.oom
        self.prunings.append(run.record())
        return result

    def pruning_oom_of(self, exc: BaseException) -> pruning.PruningOom | None:
        """What ``exc`` was pruning, if it is the out-of-memory error of this session's last
        :meth:`graph_files` or :meth:`prune` call (None for any other error)."""
        found = self.pruning_oom
        if found is None or not oom.is_oom(exc) or not pruning.raised_while_pruning(exc):
            return None
        return found

    def close(self) -> None:
        """Drop this session's references; the model stays cached for the next test."""
        self.calls.clear()
        self.prunings.clear()
        self.pruning_oom = None


def _visible_gpu_budget() -> Budget:
    """Outside pytest, before a model is loaded: the first visible GPU, if torch sees one."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return Budget(None, "no CUDA GPU", DEFAULT_AUTO_MARGIN)
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    return Budget(total, torch.cuda.get_device_name(0), DEFAULT_AUTO_MARGIN)


def _budget_of(model: Any) -> Budget:
    """Outside pytest: the whole memory of the model's GPU, less ct_auto_margin's default."""
    from pytest_ctresources.estimator.auto import _device_of

    device = _device_of(model)
    if device.type != "cuda":
        return Budget(None, "no CUDA GPU", DEFAULT_AUTO_MARGIN)
    import torch

    total = torch.cuda.get_device_properties(device).total_memory / GIB
    return Budget(total, torch.cuda.get_device_name(device), DEFAULT_AUTO_MARGIN)
