"""A stand-in for torch.cuda's allocator statistics, for CPU tests of the VRAM accounting.

Installed into a pytester project as its conftest (and undone when that run ends, so the
project can run in-process): it replaces the torch.cuda functions the plugin reads (is_initialized,
memory_stats_as_nested_dict, memory_allocated, max_memory_*, reset_peak_memory_stats,
current_device, empty_cache) with a small bookkeeping model. Tests then call
``conftest.FAKE.alloc(gib)`` / ``free(gib)`` where real code would allocate tensors, and
``FAKE.oom(gib)`` for an allocation that fails. It presents figures, not a GPU: skip
decisions still come from CT_FAKE_GPUS. torch.cuda.memory's ``_record_memory_history`` and
``_snapshot`` are replaced too: while recording, each allocation is traced with its caller's
Python frames, and the snapshot is a small one in torch's format (``segments`` with their
``blocks``, ``device_traces``); ``FAKE.history_calls`` lists every recording call.
"""

FAKE_CUDA_CONFTEST = """
import traceback

import pytest
import torch

GIB = 2**30


def _frames():
    # Innermost first, as torch records them; this file's own frames left out.
    return [
        {"filename": frame.filename, "line": frame.lineno, "name": frame.name}
        for frame in reversed(traceback.extract_stack()[:-2])
    ]


class FakeCuda:
    def __init__(self):
        self.initialised = False
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.count = 0
        self.history_calls = []
        self.recording = False
        self.trace = []
        self.live = {}  # address -> (size, frames)

    def record_history(self, enabled="all", context="all", stacks="all", **options):
        self.history_calls.append(enabled)
        self.recording = enabled is not None
        if options.get("clear_history"):
            self.trace = []

    def snapshot(self):
        blocks = [
            {"address": address, "size": size, "state": "active_allocated", "frames": frames}
            for address, (size, frames) in self.live.items()
        ]
        return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [list(self.trace)]}

    def oom(self, gib):
        if self.recording:
            self.trace.append({"action": "oom", "size": int(gib * GIB), "frames": _frames()})
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {gib} GiB")

    def alloc(self, gib):
        self.initialised = True
        if self.recording:
            address = self.count + 1
            self.live[address] = (int(gib * GIB), _frames())
            self.trace.append({"action": "alloc", "addr": address, "size": int(gib * GIB),
                               "frames": self.live[address][1]})
        self.allocated += int(gib * GIB)
        self.reserved = max(self.reserved, self.allocated)
        self.count += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, gib):
        self.allocated -= int(gib * GIB)
        for address, (size, _frames) in reversed(list(self.live.items())):
            if size == int(gib * GIB):
                del self.live[address]
                self.trace.append({"action": "free_completed", "addr": address, "size": size})
                break

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
    "memory_stats_as_nested_dict": lambda device=None: {
        "allocated_bytes": {"all": {"current": FAKE.allocated, "peak": FAKE.peak_allocated}},
        "reserved_bytes": {"all": {"current": FAKE.reserved, "peak": FAKE.peak_reserved}},
        "allocation": {"all": {"allocated": FAKE.count}},
    },
    "empty_cache": FAKE.empty_cache,
}.items():
    _patch.setattr(torch.cuda, name, value)
_patch.setattr(torch.cuda.memory, "_record_memory_history", FAKE.record_history)
_patch.setattr(torch.cuda.memory, "_snapshot", FAKE.snapshot)


def pytest_unconfigure(config):
    # An in-process pytester run shares torch with the suite that runs it: give it back.
    _patch.undo()
"""
