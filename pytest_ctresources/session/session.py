"""CtSession: one test's handle on circuit-tracer: its config, its model (through the
session-wide :class:`~pytest_ctresources.session.cache.ModelCache`), its attributions.

Usable without pytest: ``CtSession(cfg, ModelCache())`` gives the same ``load_model`` and
``attribute`` as the ``ct_session`` fixture.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_ctresources.estimator.auto import DEFAULT_AUTO_MARGIN, AutoChoice, Budget
from pytest_ctresources.gpu import oom
from pytest_ctresources.gpu.cleanup import cleanup_python_cuda
from pytest_ctresources.gpu.measure import VramFigures, VramMeter
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

    def close(self) -> None:
        """Drop this session's references; the model stays cached for the next test."""
        self.calls.clear()


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
