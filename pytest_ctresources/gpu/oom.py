"""Out-of-memory: recognising it and freeing what it holds (the report explains it:
core/accounting.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from pytest_ctresources.gpu.cleanup import clear_exception_frames
from pytest_ctresources.gpu.nnsight_threads import release_quietly


def is_oom(exc: BaseException | None) -> bool:
    """True for ``torch.cuda.OutOfMemoryError`` (looked up, never imported)."""
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return exc is not None and oom_type is not None and isinstance(exc, oom_type)


def release(exc: BaseException, model: Any = None) -> int:
    """Free what a failed attribution holds: the locals of every frame ``exc`` holds (an
    OOM's traceback pins the activations), and nnsight's intervention threads the failure
    left blocked for good (of ``model``'s traces; all models' when None), whose frames pin
    the rest (:mod:`pytest_ctresources.gpu.nnsight_threads`). Returns how many threads finished.
    A ``gc.collect()`` afterwards frees what they held."""
    clear_exception_frames(exc)
    return release_quietly(model)


@dataclass(frozen=True)
class Halving:
    """One OOM recovered by ct_session.attribute: the batch size that failed and the next one."""

    failed_batch_size: int
    next_batch_size: int
