"""Out-of-memory: recognising it, freeing what it holds, and explaining it in the report."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from pytest_ctresources.gpu.cleanup import clear_exception_frames
from pytest_ctresources.gpu.detect import GpuInfo
from pytest_ctresources.gpu.measure import VramFigures
from pytest_ctresources.gpu.nnsight_threads import release_quietly
from pytest_ctresources.settings.config import CircuitTracerConfig
from pytest_ctresources.settings.sources import Sourced
from pytest_ctresources.units import GIB


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


def batch_size_advice(cfg: CircuitTracerConfig, batch_size: int) -> str:
    """``--ct-batch-size N``, or ``BATCH_SIZE: N in file.yaml`` when a YAML set it."""
    source = cfg.source_of("batch_size")
    advice = f"`--ct-batch-size {batch_size}`"
    if source.path is not None:
        advice += f", or `BATCH_SIZE: {batch_size}` in {source.path}"
    elif source.kind == "marker":
        advice += f", or `@pytest.mark.ct_config(batch_size={batch_size})`"
    return advice


def explain(
    cfg: CircuitTracerConfig | None,
    gpu: GpuInfo | None,
    capacity: Sourced[float] | None,
    figures: VramFigures | None,
) -> str:
    """The report section of a test that raised ``torch.cuda.OutOfMemoryError``."""
    lines = []
    if gpu is not None:
        line = f"{gpu.describe()}: {gpu.total_gib:.1f} GiB"
        if capacity is not None:
            line += f", emulated capacity {capacity.value:.1f} GiB ({capacity.source})"
        lines.append(line)
    if figures is not None:
        lines.append(
            f"peak before the failure: {figures.peak_allocated_bytes / GIB:.2f} GiB allocated, "
            f"{figures.peak_reserved_bytes / GIB:.2f} GiB reserved"
        )
    if cfg is not None:
        lines.append("config in effect:")
        lines += [f"  {line}" for line in cfg.describe()]
        if isinstance(cfg.batch_size, int):
            half = max(1, cfg.batch_size // 2)
            lines.append(f"next step: try {batch_size_advice(cfg, half)}")
        else:
            lines.append(
                "next step: the estimate behind --ct-batch-size auto was too low here; raise "
                "ct_auto_margin, or set a batch size below the one auto chose"
            )
    else:
        lines.append(
            "next step: lower the test's memory use, or declare its need with "
            "@pytest.mark.vram(gib=...) so it is skipped where it does not fit"
        )
    return "\n".join(lines)
