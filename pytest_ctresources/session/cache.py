"""The session-wide model cache: the one ReplacementModel ``ct_session`` keeps loaded between
tests, what its build left allocated (a resident model, not a leak), and loads that failed.

Usable without pytest: ``CtSession(cfg, ModelCache())``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pytest_ctresources.gpu.cleanup import cleanup_python_cuda
from pytest_ctresources.session.model_load import (
    ModelLoadError,
    is_permanent,
    load_failure_message,
    repeated_failure_message,
)
from pytest_ctresources.settings.config import (
    CircuitTracerConfig,
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
        #: How many evictions left the garbage collector unfrozen (one from a watcher thread
        #: does, see :meth:`evict_if_idle`): the between-test cleanup freezes again after one.
        self.unfreezes = 0
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
            if cleanup_python_cuda(refreeze=refreeze):
                self.unfreezes += 1
        if resident is not None:
            for observer in list(self.observers):
                observer.model_freed(resident)
        return resident
