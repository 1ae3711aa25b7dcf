"""CUDA's allocation history (``torch.cuda.memory``'s recorder): start it, read a snapshot,
stop it. Used by ``--ct-snapshot`` in the pytest process (report/snapshots.py) and by a
notebook's kernel, whose start-up file imports it (notebooks/kernels.py)."""

from __future__ import annotations

from typing import Any


def start_recording() -> str | None:
    """Start recording this process's CUDA allocations; the reason it cannot, if it cannot
    (no torch, or one built without CUDA)."""
    try:
        import torch

        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", clear_history=True
        )
    except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def stop_recording() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def take_snapshot() -> dict[str, Any]:
    import torch

    snapshot: dict[str, Any] = torch.cuda.memory._snapshot()
    return snapshot
