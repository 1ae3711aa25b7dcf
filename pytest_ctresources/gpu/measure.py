"""Per-test VRAM measurement in the pytest process: baseline, peaks, what is left after cleanup.

A test that never touches CUDA costs two ``sys.modules`` look-ups: the meter reads torch's
allocator statistics only when torch is loaded and CUDA is initialised.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

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
    def peak_reserved_gib(self) -> float:
        return self.peak_reserved_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["leaked_bytes"] = self.leaked_bytes
        return out


class AllocatorStats(NamedTuple):
    """The caching allocator's figures on one device, in bytes (and a count), read at once."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    allocations: int
    """Allocations the allocator has served since CUDA was initialised (never reset)."""

    @property
    def cached(self) -> int:
        """Reserved by the allocator but allocated to no tensor."""
        return max(0, self.reserved - self.allocated)


def allocator_stats(cuda: Any, device: int | None = None) -> AllocatorStats:
    """Every figure the plugin reads from ``torch.cuda`` (the module, passed in: never
    imported here) on ``device`` (None: the current one), from one call; all zero while
    CUDA is not initialised.

    ``torch.cuda.memory_allocated``, ``memory_reserved``, ``max_memory_*`` and
    ``memory_stats`` each build the whole statistics dictionary and flatten it into sorted
    dotted keys in Python: 0.14 to 0.19 ms a call on an H100 host, against 0.02 ms for the
    nested dictionary they flatten (``bench/allocator_reads.py``, ``docs/benchmarks.md``).
    The plugin's work around one CUDA test read a figure that way fourteen times. The nested
    dictionary is public (``memory_stats_as_nested_dict``) and is read here once.
    """
    stats = cuda.memory_stats_as_nested_dict(device)

    def figure(name: str, kind: str) -> int:
        return int(stats.get(name, {}).get("all", {}).get(kind, 0))

    return AllocatorStats(
        allocated=figure("allocated_bytes", "current"),
        reserved=figure("reserved_bytes", "current"),
        peak_allocated=figure("allocated_bytes", "peak"),
        peak_reserved=figure("reserved_bytes", "peak"),
        allocations=figure("allocation", "allocated"),
    )


def cached_bytes() -> int | None:
    """CUDA memory this process's caching allocator holds unallocated on its current device:
    0 when torch has not initialised CUDA here, None when it cannot be read (a stand-in
    torch, a lost device); never imports torch."""
    try:
        if not cuda_initialised():
            return 0
        return allocator_stats(sys.modules["torch"].cuda).cached
    except (AttributeError, RuntimeError):
        return None


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
            stats = allocator_stats(cuda, device)
            self._baseline, self._allocations = stats.allocated, stats.allocations
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
        stats = allocator_stats(cuda, device)
        if self._device is not None and stats.allocations == self._allocations:
            return None
        return VramFigures(
            device=device,
            baseline_bytes=self._baseline,
            peak_allocated_bytes=stats.peak_allocated,
            peak_reserved_bytes=stats.peak_reserved,
            after_bytes=stats.allocated if finished else None,
        )
