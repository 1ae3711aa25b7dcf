"""The CUDA allocator of the pytest process: PYTORCH_CUDA_ALLOC_CONF and the capacity cap.

Both act only on a process that uses torch, and neither initialises CUDA itself: the
environment variable must be in place before CUDA initialises, and the cap is queued to run
when (if ever) it does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass, field

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
GIB = 1 << 30


@dataclass
class AllocConf:
    """Sets PYTORCH_CUDA_ALLOC_CONF if unset, and can undo exactly that."""

    value: str
    environ: MutableMapping[str, str] = field(default_factory=lambda: os.environ)
    set_by_us: bool = False

    def apply(self) -> None:
        if self.value and ALLOC_CONF_ENV not in self.environ:
            self.environ[ALLOC_CONF_ENV] = self.value
            self.set_by_us = True

    def undo(self) -> None:
        if self.set_by_us and self.environ.get(ALLOC_CONF_ENV) == self.value:
            del self.environ[ALLOC_CONF_ENV]
        self.set_by_us = False

    def effective(self) -> str | None:
        return self.environ.get(ALLOC_CONF_ENV)


def memory_fraction(capacity_bytes: int, total_bytes: int) -> float | None:
    """The allocator fraction that caps a ``total_bytes`` GPU at ``capacity_bytes``.

    None when the cap would not bind (capacity at or above the card's memory).
    """
    if total_bytes <= 0 or capacity_bytes >= total_bytes:
        return None
    return capacity_bytes / total_bytes


@dataclass
class CapacityCap:
    """Caps torch's CUDA caching allocator at ``capacity_gib`` on every visible device.

    ``arm()`` is cheap and idempotent; it does nothing until torch is loaded, and then
    queues the cap with torch's lazy-init queue so that it applies the moment CUDA
    initialises (or at once if it already has), without initialising CUDA itself.
    """

    capacity_gib: float
    armed: bool = False
    applied: dict[int, float] = field(default_factory=dict)
    not_binding: list[int] = field(default_factory=list)

    def arm(self, *, import_torch: bool = False) -> None:
        """Queue the cap. ``import_torch``: import torch if no one has yet (this does not
        initialise CUDA), so that a test importing torch later is capped too."""
        if import_torch and not self.armed:
            import torch as _torch  # noqa: F401  (registers the module in sys.modules)
        torch = sys.modules.get("torch")
        if self.armed or torch is None:
            return
        self.armed = True
        # torch.cuda._lazy_call is how torch itself defers device work (manual_seed uses it):
        # run now if CUDA is initialised, else at initialisation.
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if lazy_call is not None:
            lazy_call(self._apply)
        elif torch.cuda.is_initialized():
            self._apply()

    def _apply(self) -> None:
        torch = sys.modules["torch"]
        capacity = int(self.capacity_gib * GIB)
        for index in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(index).total_memory
            fraction = memory_fraction(capacity, total)
            if fraction is None:
                self.not_binding.append(index)
                continue
            torch.cuda.set_per_process_memory_fraction(fraction, index)
            self.applied[index] = fraction
