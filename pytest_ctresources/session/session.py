"""CtSession: one test's handle on circuit-tracer, and the session-wide model cache.

Usable without pytest: ``CtSession(cfg, ModelCache())`` gives the same ``load_model`` and
``attribute`` as the ``ct_session`` fixture.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pytest_ctresources.estimator.auto import DEFAULT_AUTO_MARGIN, AutoChoice, Budget
from pytest_ctresources.gpu import oom
from pytest_ctresources.gpu.cleanup import cleanup_python_cuda
from pytest_ctresources.gpu.measure import VramFigures, VramMeter
from pytest_ctresources.session.model_load import (
    ModelLoadError,
    is_permanent,
    load_failure_message,
    repeated_failure_message,
)
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

if TYPE_CHECKING:
    import torch


def build_model(cfg: CircuitTracerConfig, device: str | torch.device) -> Any:
    """Build the ReplacementModel ``cfg`` names: a bundled offline model, or from the hub."""
    from pytest_ctresources.bundled import builders, catalogue

    kwargs = cfg.from_pretrained_kwargs()
    if catalogue.is_bundled_model(kwargs["model_name"]):
        return builders.build_named_model(
            kwargs["model_name"],
            kwargs["transcoder_set"],
            dtype=kwargs["dtype"],
            device=device,
            backend=kwargs["backend"],
        )
    import torch
    from circuit_tracer import ReplacementModel

    return ReplacementModel.from_pretrained(**kwargs, device=torch.device(device))


@dataclass(frozen=True)
class ResidentModel:
    """The model :class:`ModelCache` keeps loaded between tests, and what it holds.

    Attributes:
        key: what identifies it (model, transcoders, backend, dtype, device).
        label: ``model_name (dtype)`` for reports.
        device: where it lives (``cuda:0``, ``cpu``).
        bytes: CUDA memory its build left allocated, measured around the build (0 on the CPU).
            It stays allocated between tests by design: a resident model, not a leak.
        loaded_by: the node id of the test whose setup or call loaded it, when known.
    """

    key: Hashable
    label: str
    device: str
    bytes: int
    loaded_by: str | None = None


class CacheObserver(Protocol):
    """Told when :class:`ModelCache` loads or frees its model (the xdist VRAM budget keeps a
    lease for a resident model)."""

    def model_loaded(self, resident: ResidentModel) -> None: ...

    def model_freed(self, resident: ResidentModel) -> None: ...


def _cuda_allocated(device: str | torch.device) -> int | None:
    """CUDA memory allocated on ``device`` now; None for a non-CUDA device. Never imports
    torch (a CUDA device means the caller has it loaded)."""
    torch_module = sys.modules.get("torch")
    if torch_module is None or not str(device).startswith("cuda"):
        return None
    return int(torch_module.cuda.memory_allocated(torch_module.device(device)))


class ModelCache:
    """Holds the one ReplacementModel of the session, keyed by what identifies it.

    Tests whose configs name the same model, transcoders, backend and dtype share a single
    load; a test that needs another model evicts the previous one and frees its memory
    first, so two models are never resident at once. The CUDA memory a build leaves
    allocated is measured (:attr:`resident`), so reports count it as a resident model
    rather than as the leak of the test that loaded it.

    Thread-safe: an xdist worker may free an idle cache from a watcher thread
    (:meth:`evict_if_idle`) while its main thread is between tests; a test using the model
    holds :meth:`in_use` for its duration.
    """

    def __init__(self) -> None:
        self._key: Hashable | None = None
        self._model: Any = None
        self._resident: ResidentModel | None = None
        self._failures: dict[Hashable, tuple[str, str | None]] = {}
        self._lock = threading.RLock()
        self._users = 0
        self.loads = 0
        self.observers: list[CacheObserver] = []
        #: The node id reported as ``loaded_by`` of a model loaded now (set by the plugin).
        self.current_test: str | None = None

    def get(self, cfg: CircuitTracerConfig, device: str | torch.device) -> Any:
        """The model of ``cfg`` on ``device``, built on first use.

        Raises :class:`~pytest_ctresources.session.model_load.ModelLoadError` (one line: the model,
        its config source, the cause) when it cannot be built; a model that failed once
        fails again at once, without another attempt (a hub that is unreachable now will be
        unreachable for the next test too).
        """
        key = (*cfg.model_key(), str(device))
        with self._lock:
            if self._model is not None and key == self._key:
                return self._model
            failed = self._failures.get(key)
            if failed is not None:
                raise ModelLoadError(repeated_failure_message(*failed))
            self.evict()
            before = _cuda_allocated(device)
            try:
                model = build_model(cfg, device)
            except Exception as exc:
                if not is_permanent(exc):  # an OOM, say: the next test may load it
                    raise
                message = load_failure_message(cfg, exc)
                self._failures[key] = (message, self.current_test)
                raise ModelLoadError(message) from None
            after = _cuda_allocated(device)
            self._model = model
            self._key = key
            self.loads += 1
            resident = ResidentModel(
                key=key,
                label=f"{cfg.model_name} ({cfg.dtype})",
                device=str(device),
                bytes=max(0, after - before) if after is not None and before is not None else 0,
                loaded_by=self.current_test,
            )
            self._resident = resident
        for observer in list(self.observers):
            observer.model_loaded(resident)
        return model

    @property
    def key(self) -> Hashable | None:
        """The key of the resident model, or None."""
        return self._key

    @property
    def resident(self) -> ResidentModel | None:
        """The model kept loaded now and its measured CUDA bytes, or None."""
        return self._resident

    def resident_for(self, cfg: CircuitTracerConfig) -> ResidentModel | None:
        """The resident model a test with ``cfg`` would reuse (same model, transcoders,
        backend and dtype, on whichever device it lives), or None."""
        resident = self._resident
        if resident is None or not isinstance(resident.key, tuple):
            return None
        return resident if resident.key[:-1] == cfg.model_key() else None

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """A test uses the cache for the block: :meth:`evict_if_idle` leaves it alone."""
        with self._lock:
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1

    def evict_if_idle(self) -> ResidentModel | None:
        """Free the model if no test is using it; returns what was freed, if anything.

        For a watcher thread: the main thread may be running a test that does not use the
        model, so the collection that frees it leaves the collector unfrozen (freezing now
        would set that test's live objects aside; the between-test cleanup freezes again)."""
        with self._lock:
            if self._users:
                return None
            return self.evict(refreeze=False)

    def evict(self, *, refreeze: bool = True) -> ResidentModel | None:
        """Drop the resident model and return its memory; returns what was freed."""
        with self._lock:
            if self._model is None:
                return None
            resident = self._resident
            self._model = None
            self._key = None
            self._resident = None
            cleanup_python_cuda(refreeze=refreeze)
        if resident is not None:
            for observer in list(self.observers):
                observer.model_freed(resident)
        return resident


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
    total = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    return Budget(total, torch.cuda.get_device_name(0), DEFAULT_AUTO_MARGIN)


def _budget_of(model: Any) -> Budget:
    """Outside pytest: the whole memory of the model's GPU, less ct_auto_margin's default."""
    from pytest_ctresources.estimator.auto import _device_of

    device = _device_of(model)
    if device.type != "cuda":
        return Budget(None, "no CUDA GPU", DEFAULT_AUTO_MARGIN)
    import torch

    total = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    return Budget(total, torch.cuda.get_device_name(device), DEFAULT_AUTO_MARGIN)
