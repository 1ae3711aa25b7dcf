"""The meter's one read of torch's allocator statistics (``gpu/measure.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_ctresources.gpu.measure import AllocatorStats, allocator_stats

torch = pytest.importorskip("torch")

GIB = 2**30


def test_allocator_stats_are_the_figures_torchs_own_getters_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's memory_allocated, memory_reserved, max_memory_* and memory_stats all flatten
    # the nested dictionary; fed one, they say which of its entries each figure is.
    nested: dict[str, Any] = {
        "allocated_bytes": {
            "all": {"current": 3 * GIB, "peak": 5 * GIB, "allocated": 9 * GIB, "freed": 6 * GIB},
            "large_pool": {"current": 2 * GIB, "peak": 4 * GIB},
        },
        "reserved_bytes": {"all": {"current": 4 * GIB, "peak": 7 * GIB, "allocated": 8 * GIB}},
        "allocation": {"all": {"current": 11, "peak": 12, "allocated": 42, "freed": 31}},
        "num_alloc_retries": 1,
    }
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "memory_stats_as_nested_dict", lambda device=None: nested)
    cuda = torch.cuda
    assert allocator_stats(cuda) == AllocatorStats(
        allocated=cuda.memory_allocated(),
        reserved=cuda.memory_reserved(),
        peak_allocated=cuda.max_memory_allocated(),
        peak_reserved=cuda.max_memory_reserved(),
        allocations=cuda.memory_stats()["allocation.all.allocated"],
    )
    assert allocator_stats(cuda) == AllocatorStats(3 * GIB, 4 * GIB, 5 * GIB, 7 * GIB, 42)
    assert allocator_stats(cuda).cached == GIB


def test_allocator_stats_are_zero_before_cuda_is_initialised() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    assert allocator_stats(torch.cuda) == AllocatorStats(0, 0, 0, 0, 0)
