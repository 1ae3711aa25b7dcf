"""Skip decisions: does a test's VRAM need fit the GPU it will run on?"""

from __future__ import annotations

from pytest_ctresources.gpus import GpuInfo
from pytest_ctresources.sources import Source, Sourced


def skip_reason(
    need_gib: float,
    need_source: Source,
    gpu: GpuInfo | None,
    capacity: Sourced[float] | None,
) -> str | None:
    """The skip reason when ``need_gib`` exceeds the capacity of ``gpu``, else None.

    ``capacity`` (from ``--ct-vram-capacity``) replaces the GPU's own memory in the decision.
    A need declared by a marker reads ``needs 20.0 GiB VRAM; ...``; any other source is
    named in parentheses after ``VRAM``.
    """
    qualifier = "" if need_source.kind == "marker" else f" ({need_source})"
    needs = f"needs {need_gib:.1f} GiB VRAM{qualifier}"
    if gpu is None:
        if need_source.kind == "estimate":
            return None  # without a GPU, ct_session runs the model on the CPU
        return f"{needs}; no CUDA GPU detected"
    if capacity is not None:
        if need_gib <= capacity.value:
            return None
        return (
            f"{needs}; {gpu.describe()} is capped at {capacity.value:.1f} GiB by {capacity.source}"
        )
    if need_gib <= gpu.total_gib:
        return None
    return f"{needs}; {gpu.describe()} has {gpu.total_gib:.1f} GiB"
