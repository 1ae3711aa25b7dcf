"""Skip decisions: does a test's VRAM need fit the GPU it will run on?"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_ctresources.settings.sources import Source, Sourced

if TYPE_CHECKING:
    from pytest_ctresources.gpu.detect import GpuInfo


def skip_reason(
    need_gib: float,
    need_source: Source,
    gpu: GpuInfo | None,
    capacity: Sourced[float] | None,
    *,
    runs_on_cpu: bool = False,
) -> str | None:
    """The skip reason when ``need_gib`` exceeds the capacity of ``gpu``, else None.

    ``capacity`` (from ``--ct-vram-capacity``) replaces the GPU's own memory in the decision.
    Without a GPU, a test that ``runs_on_cpu`` (ct_session puts its model there) is not
    skipped for a need the plugin worked out itself (estimated, or learned on a GPU); a need
    somebody declared still means a GPU.
    A need declared by a marker reads ``needs 20.0 GiB VRAM; ...``; any other source is
    named in parentheses after ``VRAM``.
    """
    qualifier = "" if need_source.kind == "marker" else f" ({need_source})"
    needs = f"needs {need_gib:.1f} GiB VRAM{qualifier}"
    if gpu is None:
        if need_source.kind == "estimate" or (runs_on_cpu and need_source.kind == "learned"):
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
