"""Per-test VRAM measurement in the pytest process: baseline, peaks, what is left after cleanup.

A test that never touches CUDA costs two ``sys.modules`` look-ups: the meter reads torch's
allocator statistics only when torch is loaded and CUDA is initialised.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from pytest_ctresources.gpu.cleanup import cuda_initialised
from pytest_ctresources.units import GIB


@dataclass(frozen=True)
class VramFigures:
    """One test's CUDA memory, in bytes, on the device it used."""

    device: int
    baseline_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    after_bytes: int | None = None  # allocated after teardown and cleanup; None while running
    resident_bytes: int = 0
    """What the models kept loaded between tests (``ct_session``'s cache) grew by during the
    test: a model it loaded counts here, one it evicted negatively. Resident, not leaked."""
    others_resident_bytes: int = 0
    """A resident model that was on the card when the test started, stayed, and that the test
    did not use (another test's): left out of the peaks, which are the test's own."""

    @property
    def leaked_bytes(self) -> int:
        """Allocated after teardown and cleanup, beyond the baseline and the models the test
        made resident (0 while running)."""
        if self.after_bytes is None:
            return 0
        return max(0, self.after_bytes - self.baseline_bytes - self.resident_bytes)

    def without_others_resident(self, others: int) -> VramFigures:
        """These figures with a resident model the test did not use left out of its peaks."""
        if others <= 0:
            return self
        return replace(
            self,
            peak_allocated_bytes=max(0, self.peak_allocated_bytes - others),
            peak_reserved_bytes=max(0, self.peak_reserved_bytes - others),
            others_resident_bytes=others,
        )

    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_allocated_bytes / GIB

    @property
    def peak_reserved_gib(self) -> float:
        return self.peak_reserved_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["leaked_bytes"] = self.leaked_bytes
        return out


class VramMeter:
    """Measures one test: :meth:`start` before setup, :meth:`finish` after teardown and cleanup."""

    def __init__(self) -> None:
        self._device: int | None = None
        self._baseline = 0
        self._allocations = 0

    def start(self) -> None:
        if not cuda_initialised():
            return
        cuda = sys.modules["torch"].cuda
        try:
            device = cuda.current_device()
            self._baseline = cuda.memory_allocated(device)
            self._allocations = _allocation_count(cuda, device)
            cuda.reset_peak_memory_stats(device)
        except (AttributeError, RuntimeError):
            return
        self._device = device

    @property
    def baseline_bytes(self) -> int:
        """Allocated when the test started (0 when CUDA was initialised during it)."""
        return self._baseline

    def allocated_beyond_baseline(self) -> int | None:
        """CUDA memory allocated now beyond the baseline; None when the test used no CUDA."""
        figures = self.figures(finished=True)
        if figures is None or figures.after_bytes is None:
            return None
        return figures.after_bytes - figures.baseline_bytes

    def figures(self, *, finished: bool = False) -> VramFigures | None:
        """The figures so far, or None when the test has not used CUDA.

        A test used CUDA when CUDA was initialised during it, or when the caching allocator
        served at least one allocation while it ran.
        """
        if not cuda_initialised():
            return None
        try:
            return self._read(sys.modules["torch"].cuda, finished)
        except (AttributeError, RuntimeError):
            # A torch whose CUDA cannot answer (a stand-in module a test installed, a device
            # lost mid-run) must not turn into a pytest internal error: no figures.
            return None

    def _read(self, cuda: Any, finished: bool) -> VramFigures | None:
        # CUDA first initialised during this test: nothing was allocated before it, and the
        # peak statistics start at initialisation.
        device = self._device if self._device is not None else cuda.current_device()
        if self._device is not None and _allocation_count(cuda, device) == self._allocations:
            return None
        return VramFigures(
            device=device,
            baseline_bytes=self._baseline,
            peak_allocated_bytes=cuda.max_memory_allocated(device),
            peak_reserved_bytes=cuda.max_memory_reserved(device),
            after_bytes=cuda.memory_allocated(device) if finished else None,
        )


def _allocation_count(cuda: Any, device: int) -> int:
    count: int = cuda.memory_stats(device).get("allocation.all.allocated", 0)
    return count
