"""Where each test ran: worker, GPU, VRAM lease and lease wait.

Workers bound to a GPU put these in every test's record, other processes in the record of
every test that took a lease (:mod:`~pytest_ctresources.leases.leases`); the controller (or
the plain run) reads them from the records for the summary and the JSON report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_ctresources.core.record import PLAIN_RUN_WORKER, UNKNOWN_GPU

if TYPE_CHECKING:
    from pytest_ctresources.core.record import TestRecord
    from pytest_ctresources.report.results import TestResult


def placement_row(result: TestResult) -> dict[str, Any]:
    """Where a test ran, as the JSON report's ``placements`` list has it."""
    record = result.record
    return {
        "nodeid": result.nodeid,
        "outcome": result.outcome,
        "worker": record.worker,
        "gpu_name": _gpu_name(record),
        "gpu_physical_index": record.gpu_physical_index,
        "gpu_uuid": record.gpu_uuid,
        "lease_gib": float(record.lease_gib or 0.0),
        "lease_wait_s": float(record.lease_wait_s or 0.0),
        "lease_reused_gib": float(record.lease_reused_gib or 0.0),
        "lease_gave_up_after_s": float(record.lease_gave_up_after_s or 0.0),
        "placed_because": record.placed_because,
    }


def _gpu_name(record: TestRecord) -> str:
    return record.gpu_name or UNKNOWN_GPU


def waited_s(record: TestRecord) -> float:
    """The seconds the test waited for its lease, granted or not."""
    if (record.lease_wait_s or 0.0) < 0:
        return record.lease_gave_up_after_s or 0.0
    return record.lease_wait_s or 0.0


def gpu_label(record: TestRecord) -> str:
    where = "?" if record.gpu_physical_index is None else str(record.gpu_physical_index)
    return f"GPU {where} ({_gpu_name(record)})"


def made_wait(placed: list[TestRecord]) -> bool:
    """Whether a lease made one of the tests wait (or time out)."""
    return any(waited_s(record) > 0 or (record.lease_wait_s or 0.0) < 0 for record in placed)


def placement_lines(placed: list[TestRecord]) -> list[str]:
    """Per GPU: its workers, how many tests ran there, and the time spent waiting for leases
    (``placed``: the records of the tests that say where they ran)."""
    if not placed:
        return []
    by_gpu: dict[str, list[TestRecord]] = {}
    for record in placed:
        by_gpu.setdefault(record.gpu_uuid or gpu_label(record), []).append(record)
    plain = all(record.worker == PLAIN_RUN_WORKER for record in placed)
    if plain and not any(record.lease_wait_s for record in placed):
        return []  # a plain run's leases are worth a line only when they made a test wait
    what = "VRAM leases" if plain else "GPU placement (pytest-xdist)"
    out = [f"{what}: {len(placed)} test(s) on {len(by_gpu)} GPU(s)"]
    for group in sorted(by_gpu.values(), key=lambda g: gpu_label(g[0])):
        workers = sorted({str(r.worker) for r in group}, key=lambda w: (len(w), w))
        waits = [waited_s(r) for r in group if waited_s(r) > 0]  # timeouts' waits included
        leased = sum(1 for r in group if (r.lease_gib or 0.0) > 0)
        timeouts = sum(1 for r in group if (r.lease_wait_s or 0.0) < 0)
        who = "" if plain else f"{', '.join(workers)}; "
        line = (
            f"  {gpu_label(group[0])}: {who}{len(group)} test(s), "
            f"{leased} with a lease, waited {sum(waits):.1f} s in all"
            + (f" (longest {max(waits):.1f} s)" if waits else "")
        )
        reused = [r.lease_reused_gib for r in group if (r.lease_reused_gib or 0.0) > 0]
        if reused:
            line += f", {len(reused)} reused the resident model's lease"
        if timeouts:
            line += f", {timeouts} lease timeout(s)"
        out.append(line)
    out += _placed_by_vram(placed)
    return out


def _placed_by_vram(placed: list[TestRecord]) -> list[str]:
    """One line on the VRAM scheduler's reasons, where it placed the run (the JSON report's
    ``placed_because`` has each test's)."""
    from pytest_ctresources.xdist.exchange import EVERY, ONLY_SOME, TOO_BIG

    kinds = [record.placed_kind for record in placed if record.placed_kind]
    if not kinds:
        return []
    only, every, too_big = (kinds.count(kind) for kind in (ONLY_SOME, EVERY, TOO_BIG))
    packed = sum(1 for record in placed if record.placed_beside)
    return [
        f"  placed by VRAM: {only} test(s) on the only GPUs that hold them, {every} that fit "
        f"every GPU, {too_big} too big for every GPU (skipped on the largest); {packed} "
        "packed beside other workers' tests"
    ]
