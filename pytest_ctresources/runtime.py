"""The plugin's state for one run, in ``config.stash``; per-test state in ``item.stash``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pytest_ctresources.allocator import AllocConf, CapacityCap
from pytest_ctresources.config import CircuitTracerConfig
from pytest_ctresources.gpus import GpuFacts, GpuInfo, detect_gpus
from pytest_ctresources.learned import LearnedNeeds
from pytest_ctresources.markers import layer_markers
from pytest_ctresources.session import ModelCache
from pytest_ctresources.settings import Settings


@dataclass
class Runtime:
    """Session state: resolved settings, GPU facts (detected on first use), the model cache."""

    settings: Settings
    alloc_conf: AllocConf
    capacity_cap: CapacityCap | None
    model_cache: ModelCache = field(default_factory=ModelCache)
    cache: pytest.Cache | None = None
    _gpu_facts: GpuFacts | None = None
    _learned: LearnedNeeds | None = None
    _config_below_markers: CircuitTracerConfig | None = None

    def gpu_facts(self) -> GpuFacts:
        if self._gpu_facts is None:
            self._gpu_facts = detect_gpus()
        return self._gpu_facts

    def learned(self) -> LearnedNeeds:
        """VRAM needs measured by earlier runs (pytest's cache), loaded on first use."""
        if self._learned is None:
            self._learned = LearnedNeeds(self.cache)
        return self._learned

    def test_gpu(self) -> GpuInfo | None:
        """The GPU a test in this process runs on: the first visible one."""
        return self.gpu_facts().gpu(0)

    def config_for(self, item: pytest.Item) -> CircuitTracerConfig:
        """The item's resolved config, computed once and kept in its stash.

        Raises :class:`~pytest_ctresources.markers.MarkerError` for a bad ``ct_config``.
        """
        cached = item.stash.get(CONFIG_KEY, None)
        if cached is not None:
            return cached
        if self._config_below_markers is None:
            self._config_below_markers = self.settings.config_below_markers()
        cfg = self.settings.config_above_markers(layer_markers(item, self._config_below_markers))
        item.stash[CONFIG_KEY] = cfg
        return cfg


RUNTIME_KEY = pytest.StashKey[Runtime]()
CONFIG_KEY = pytest.StashKey[CircuitTracerConfig]()


def runtime_of(config: pytest.Config) -> Runtime:
    """The :class:`Runtime` of a configured pytest run."""
    return config.stash[RUNTIME_KEY]
