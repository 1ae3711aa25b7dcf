"""A stand-in for torch.cuda's allocator statistics, for CPU tests of the VRAM accounting.

Installed into a pytester project as its conftest: it replaces the torch.cuda functions the
plugin reads (is_initialized, memory_allocated, max_memory_*, reset_peak_memory_stats,
memory_stats, current_device, empty_cache) with a small bookkeeping model. Tests then call
``conftest.FAKE.alloc(gib)`` / ``free(gib)`` where real code would allocate tensors. It
presents figures, not a GPU: skip decisions still come from CT_FAKE_GPUS.
"""

FAKE_CUDA_CONFTEST = """
import pytest
import torch

GIB = 2**30


class FakeCuda:
    def __init__(self):
        self.initialised = False
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.count = 0

    def alloc(self, gib):
        self.initialised = True
        self.allocated += int(gib * GIB)
        self.reserved = max(self.reserved, self.allocated)
        self.count += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, gib):
        self.allocated -= int(gib * GIB)

    def reset_peaks(self, device=None):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def empty_cache(self):
        self.reserved = self.allocated


FAKE = FakeCuda()
_patch = pytest.MonkeyPatch()
for name, value in {
    "is_initialized": lambda: FAKE.initialised,
    "current_device": lambda: 0,
    "memory_allocated": lambda device=None: FAKE.allocated,
    "max_memory_allocated": lambda device=None: FAKE.peak_allocated,
    "max_memory_reserved": lambda device=None: FAKE.peak_reserved,
    "memory_reserved": lambda device=None: FAKE.reserved,
    "reset_peak_memory_stats": FAKE.reset_peaks,
    "memory_stats": lambda device=None: {"allocation.all.allocated": FAKE.count},
    "empty_cache": FAKE.empty_cache,
}.items():
    _patch.setattr(torch.cuda, name, value)
"""
