"""The plugin's state for one run, in ``config.stash`` (each test's own: core/state.py)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from pytest_ctresources.core import learned as learned_needs
from pytest_ctresources.core.learned import LearnedNeeds
from pytest_ctresources.core.record import OwnSetting
from pytest_ctresources.core.state import state_of
from pytest_ctresources.exceptions import AllocConfIneffectiveWarning
from pytest_ctresources.gpu.allocator import ALLOC_CONF_ENV, AllocConf, CapacityCap
from pytest_ctresources.gpu.cleanup import cleanup_python_cuda, cuda_initialised
from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV, parse_fake_gpus
from pytest_ctresources.session.cache import ModelCache
from pytest_ctresources.settings.config import FIELDS, CircuitTracerConfig
from pytest_ctresources.settings.markers import layer_markers
from pytest_ctresources.settings.resolve import Settings, settings_from_config
from pytest_ctresources.settings.sources import Source, Sourced
from pytest_ctresources.xdist.learned_exchange import shipped_needs

if TYPE_CHECKING:
    # Imported where used: a run whose tests use no ct_session loads no estimator, and one
    # that never asks about the GPU (no capacity set, no test that needs VRAM) no detection.
    from pytest_ctresources.estimator.auto import Budget
    from pytest_ctresources.gpu.detect import GpuFacts, GpuInfo
    from pytest_ctresources.xdist.binding import Binding
from pytest_ctresources.xdist.roles import runs_no_tests


@dataclass
class Runtime:
    """Session state: resolved settings, GPU facts (detected on first use), the model cache."""

    settings: Settings
    alloc_conf: AllocConf
    capacity_cap: CapacityCap | None
    model_cache: ModelCache = field(default_factory=ModelCache)
    cache: pytest.Cache | None = None
    shipped_learned: Mapping[str, Any] | None = None
    """In an xdist worker: the learned needs its controller shipped (read instead of the
    cache)."""
    binding: Binding | None = None
    """The GPU this xdist worker is bound to (None elsewhere)."""
    vram_capacity: Sourced[float] | None = None
    """``--ct-vram-capacity`` as it applies: the setting, clamped to the card once the card is
    known (:func:`clamped_capacity`). The settings keep what was set."""
    _gpu_facts: GpuFacts | None = None
    _learned: LearnedNeeds | None = None
    _session_config: CircuitTracerConfig | None = None
    _library_versions: dict[str, str] | None = None

    def gpu_facts(self, *, may_import_torch: bool = True) -> GpuFacts:
        """The GPUs of this process, detected once. Without NVML, detection falls back to
        torch, whose import costs seconds: callers that only describe the run (the ``-v``
        header, the summary) pass ``may_import_torch=False`` and, when no test has imported
        torch, get NVML's answer with a note instead."""
        if self._gpu_facts is not None:
            return self._gpu_facts
        from pytest_ctresources.gpu.detect import detect_gpus

        if may_import_torch or "torch" in sys.modules:
            self._detected(detect_gpus())
            return self.gpu_facts()
        facts = detect_gpus(torch_fallback=False)
        if facts.gpus:
            self._detected(facts)
            return facts
        return dataclasses.replace(
            facts, detail=f"{facts.detail}; torch not asked, since no test imported it"
        )

    def _detected(self, facts: GpuFacts) -> None:
        """Keep the facts, and clamp ``--ct-vram-capacity`` to the card they found (at
        start-up when NVML answers; else when a test first needs the GPU)."""
        self._gpu_facts = facts
        capacity = self.vram_capacity
        if capacity is None:
            return
        clamped = clamped_capacity(capacity, facts.gpu(0))
        if clamped is not capacity:
            self.vram_capacity = clamped
            self.capacity_cap = CapacityCap(clamped.value)

    def learned(self) -> LearnedNeeds:
        """VRAM needs measured by earlier runs (pytest's cache), loaded on first use."""
        if self._learned is None:
            self._learned = LearnedNeeds(self.cache, self.shipped_learned)
        return self._learned

    def library_versions(self) -> dict[str, str]:
        """The versions of the libraries that move memory (core/learned.py), read once."""
        if self._library_versions is None:
            self._library_versions = learned_needs.library_versions()
        return self._library_versions

    def resident_bytes(self) -> int:
        """CUDA memory the models ``ct_session`` keeps loaded between tests hold now."""
        resident = self.model_cache.resident
        return resident.bytes if resident is not None else 0

    def free_cached_models(self) -> None:
        """Free the models ct_session cached, and what the allocator caches (before a wait)."""
        self.model_cache.evict()
        cleanup_python_cuda()

    def test_gpu(self) -> GpuInfo | None:
        """The GPU a test in this process runs on: the first visible one."""
        return self.gpu_facts().gpu(0)

    def auto_budget(self, item: pytest.Item | None = None) -> Budget:
        """What ``--ct-batch-size auto`` may fill for ``item``: the test GPU's capacity (or
        the ``--ct-vram-capacity`` cap) less the ``ct_auto_margin`` share; no more than the
        test's declared need (a ``vram`` marker or ``VRAM_GIB`` bounds auto), and, in an
        xdist worker sharing its GPU, no more than the VRAM lease it holds."""
        from pytest_ctresources.estimator.auto import Budget

        margin = float(self.settings.auto_margin.value)
        capacity = self.vram_capacity
        gpu = self.test_gpu()
        if capacity is not None:
            budget = Budget(capacity.value, str(capacity.source), margin, emulated=True)
        elif gpu is None:
            return Budget(None, "no CUDA GPU detected", margin)
        else:
            budget = Budget(gpu.total_gib, gpu.describe(), margin)
        if item is None:
            return budget
        state = state_of(item)
        need = state.need
        total = budget.capacity_gib or 0.0
        # The most a need allows (a learned need kept for the OOM retry decides its skip at
        # the retry's floor, but may take its learned peak).
        if need is not None and need.source.kind != "estimate" and need.lease_gib < total:
            budget = Budget(
                need.lease_gib, str(need.source), margin, emulated=budget.emulated, shared=True
            )
        # In an xdist worker bound to a GPU (which its run shares by design) auto fills the
        # lease; a plain run's auto fits the card, as before plain runs took leases.
        lease_gib = state.record.lease_gib if self.binding is not None else None
        if lease_gib is not None and lease_gib < (budget.capacity_gib or 0.0):
            # Leases share the card's memory; each process's context is outside them.
            budget = Budget(lease_gib, "its VRAM lease", margin, emulated=True, shared=True)
        return budget

    def session_config(self) -> CircuitTracerConfig:
        """The config of a test with no marker of its own, resolved once."""
        if self._session_config is None:
            self._session_config = self.settings.session_config()
        return self._session_config

    def config_for(self, item: pytest.Item) -> CircuitTracerConfig:
        """The item's resolved config, computed once and kept in its stash.

        Raises :class:`~pytest_ctresources.settings.markers.MarkerError` for a bad ``ct_config``.
        """
        state = state_of(item)
        if state.config is not None:
            return state.config
        session = self.session_config()
        cfg = layer_markers(item, session)
        state.config = cfg
        # Said once per setting in -v and the summary.
        state.record.own_settings = own_settings(session, cfg)
        return cfg


def own_settings(session: CircuitTracerConfig, cfg: CircuitTracerConfig) -> list[OwnSetting]:
    """Each field the test's own marker (or a notebook item's own config) set over a value the
    session set (not a default)."""
    out = []
    for name in FIELDS:
        before, after = session.source_of(name), cfg.source_of(name)
        if (
            after != before
            and before.kind != "default"
            and getattr(cfg, name) != getattr(session, name)
        ):
            out.append(
                OwnSetting(
                    field=name,
                    session_source=str(before),
                    session_value=str(getattr(session, name)),
                    value=str(getattr(cfg, name)),
                    source=str(after),
                )
            )
    return out


def clamped_capacity(capacity: Sourced[float], gpu: GpuInfo | None) -> Sourced[float]:
    """``--ct-vram-capacity`` no larger than the card it emulates on: a cap above the real
    memory would admit tests the card cannot hold. The source says so when it clamps."""
    if gpu is None or capacity.value <= gpu.total_gib:
        return capacity
    source = capacity.source
    where = (
        f"{source.where} {capacity.value:g} GiB, clamped to the {gpu.total_gib:.1f} GiB of "
        f"{gpu.describe()}"
    )
    return Sourced(gpu.total_gib, Source(source.kind, where, source.path))


RUNTIME_KEY = pytest.StashKey[Runtime]()


def runtime_of(config: pytest.Config) -> Runtime:
    """The :class:`Runtime` of a configured pytest run."""
    return config.stash[RUNTIME_KEY]


def start_runtime(
    config: pytest.Config, alloc: AllocConf | None, binding: Binding | None = None
) -> Runtime:
    """Resolve the settings and build the run's :class:`Runtime` (raises ``pytest.UsageError``).

    ``alloc`` is the allocator setting applied before conftests were imported, if any;
    ``binding`` the GPU this xdist worker was bound to then, if any.
    """
    settings = settings_from_config(config)
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake is not None:
        try:
            parse_fake_gpus(fake)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    alloc = alloc or AllocConf(settings.alloc_conf.value)
    if alloc.value and cuda_initialised():
        config.issue_config_time_warning(
            AllocConfIneffectiveWarning(
                f"CUDA was initialised before pytest-ctresources configured, so "
                f"{ALLOC_CONF_ENV}={alloc.effective() or alloc.value!r} had no effect; "
                "import torch lazily in conftest.py or set it in the environment"
            ),
            stacklevel=3,
        )
    capacity = settings.vram_capacity
    runtime = Runtime(
        settings=settings,
        alloc_conf=alloc,
        capacity_cap=None if capacity is None else CapacityCap(capacity.value),
        cache=getattr(config, "cache", None),  # None under -p no:cacheprovider
        shipped_learned=shipped_needs(config),
        vram_capacity=capacity,
        binding=binding,
    )
    if capacity is not None:
        runtime.gpu_facts(may_import_torch=False)  # clamps the capacity if NVML sees the card
    if runtime.capacity_cap is not None and not runs_no_tests(config):
        # The emulated card must bind from the first CUDA allocation, whoever imports torch
        # and whenever: importing torch here does not initialise CUDA.
        runtime.capacity_cap.arm(import_torch=True)
    return runtime
