"""The report files: ``--ct-report-json`` (docs/report-schema.md) and ``--ct-report-plot``."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_ctresources.measure import GIB

if TYPE_CHECKING:
    from pytest_ctresources.runtime import Runtime
    from pytest_ctresources.summary import RunSummary

SCHEMA = "pytest-ctresources-report"
SCHEMA_VERSION = 1


def build_report(
    summary: RunSummary,
    runtime: Runtime,
    exitstatus: int | None,
    capacity_gib: float | None,
    capacity_note: str,
) -> dict[str, Any]:
    """The JSON document: every per-test record, GPU facts, settings with provenance."""
    settings = runtime.settings
    capacity = settings.vram_capacity_gib
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exitstatus": exitstatus,
        "interrupted": exitstatus == 2,
        "gpus": runtime.gpu_facts(may_import_torch=False).to_dict(),
        "capacity": {
            "gib": capacity_gib,
            "description": capacity_note,
            "emulated": capacity is not None,
            "source": str(capacity.source) if capacity is not None else None,
        },
        "settings": {
            "config": settings.session_config().to_dict(),
            "experiment_config": settings.experiment.path if settings.experiment else None,
            "cleanup": {"value": settings.cleanup.value, "source": str(settings.cleanup.source)},
            "alloc_conf": {
                "value": settings.alloc_conf.value,
                "source": str(settings.alloc_conf.source),
            },
            "leak_threshold_bytes": {
                "value": settings.leak_threshold_bytes.value,
                "source": str(settings.leak_threshold_bytes.source),
            },
            "oom_retry": {
                "value": settings.oom_retry.value,
                "source": str(settings.oom_retry.source),
            },
            "oom_retry_floor": settings.oom_retry_floor.value,
            "strict": settings.strict,
        },
        "tests": [record.to_dict() for record in summary.records.values()],
        "placements": [placement.to_dict() for placement in summary.placements.values()],
        "attributions": summary.attributions,
        "auto_batch_sizes": summary.auto_choices,
        "vram_skips": summary.vram_skips,
        "resident_models": summary.resident_models,
        "reruns": summary.reruns,
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` atomically: a reader never sees a half-written report."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2, default=str)
            handle.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_plot(
    path: Path, summary: RunSummary, capacity_gib: float | None, capacity_note: str
) -> None:
    """A horizontal bar chart of per-test peaks (allocated, reserved) against the capacity.

    Uses matplotlib's object API with the Agg canvas, so the user's pyplot state and backend
    are left alone; matplotlib is imported only here, when a plot was asked for.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = sorted(summary.records.values(), key=lambda r: r.peak_reserved_bytes)
    height = max(2.5, 0.45 * len(records) + 1.5)
    figure = Figure(figsize=(10, height))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    labels = [record.nodeid.rsplit("::", 1)[-1] for record in records]
    positions = range(len(records))
    axes.barh(
        positions,
        [r.peak_reserved_bytes / GIB for r in records],
        color="#9ecae1",
        label="peak reserved",
    )
    axes.barh(
        positions,
        [r.peak_allocated_bytes / GIB for r in records],
        height=0.4,
        color="#3182bd",
        label="peak allocated",
    )
    for position, record in zip(positions, records, strict=True):
        if record.need_gib is not None:
            axes.plot([record.need_gib] * 2, [position - 0.4, position + 0.4], color="black")
    if capacity_gib is not None:
        axes.axvline(capacity_gib, color="#de2d26", linestyle="--", label="capacity")
    axes.set_yticks(list(positions), labels)
    peaks = [r.peak_reserved_bytes / GIB for r in records] + [r.need_gib or 0 for r in records]
    axes.set_xlim(0, 1.08 * max([*peaks, capacity_gib or 0, 1]))
    axes.set_xlabel(f"GiB — {capacity_note}; black tick: declared need", fontsize=8)
    axes.set_title("VRAM per test (pytest-ctresources)")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
