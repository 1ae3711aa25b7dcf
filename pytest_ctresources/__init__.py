"""pytest-ctresources: run GPU-bound circuit-tracer experiment suites safely on any GPU.

Public API (importing this package never imports torch, matplotlib or circuit_tracer):

- :class:`CircuitTracerConfig`: the typed, layered config of one experiment.
- :class:`CtSession` / :class:`ModelCache`: what the ``ct_session`` fixture wraps.
- :func:`load_experiment_yaml`: read a flat experiment YAML.
- :func:`cleanup_python_cuda` and :func:`safe_clean_cuda`: memory cleanup outside pytest.
- :func:`detect_gpus`: the GPUs this process will see, without creating a CUDA context.
- :mod:`pytest_ctresources.testing`: tiny offline ReplacementModels for CPU smoke tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_ctresources.gpu.cleanup import cleanup_python_cuda, safe_clean_cuda
    from pytest_ctresources.gpu.detect import GpuFacts, GpuInfo, detect_gpus
    from pytest_ctresources.session.cache import ModelCache
    from pytest_ctresources.session.session import CtSession
    from pytest_ctresources.settings.config import CircuitTracerConfig, ConfigError
    from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml
    from pytest_ctresources.settings.sources import Source

#: Where each public name lives. They are imported on first use (PEP 562): pytest imports this
#: package at every start-up, through the plugin's entry point, in projects that never use it.
_PUBLIC = {
    "cleanup_python_cuda": "pytest_ctresources.gpu.cleanup",
    "safe_clean_cuda": "pytest_ctresources.gpu.cleanup",
    "GpuFacts": "pytest_ctresources.gpu.detect",
    "GpuInfo": "pytest_ctresources.gpu.detect",
    "detect_gpus": "pytest_ctresources.gpu.detect",
    "ModelCache": "pytest_ctresources.session.cache",
    "CtSession": "pytest_ctresources.session.session",
    "CircuitTracerConfig": "pytest_ctresources.settings.config",
    "ConfigError": "pytest_ctresources.settings.config",
    "load_experiment_yaml": "pytest_ctresources.settings.experiment_yaml",
    "Source": "pytest_ctresources.settings.sources",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "CircuitTracerConfig",
    "ConfigError",
    "CtSession",
    "GpuFacts",
    "GpuInfo",
    "ModelCache",
    "Source",
    "cleanup_python_cuda",
    "detect_gpus",
    "load_experiment_yaml",
    "safe_clean_cuda",
]
__version__ = "0.1.0"
