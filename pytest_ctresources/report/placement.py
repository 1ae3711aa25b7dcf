"""Where each test ran: worker, GPU, VRAM lease and lease wait.

Workers bound to a GPU put these in every test's record, other processes in the record of
every test that took a lease (:mod:`~pytest_ctresources.leases.leases`); the controller (or
the plain run) turns them into :class:`Placement` rows for the summary and the JSON report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pytest_ctresources.core.record import PLAIN_RUN_WORKER

if TYPE_CHECKING:
    from pytest_ctresources.core.record import TestRecord


@dataclass
class Placement:
    """One test run by a bound worker."""

    nodeid: str
    outcome: str
    worker: str
    gpu_name: str
    gpu_physical_index: int | None
    gpu_uuid: str | None
    lease_gib: float
    lease_wait_s: float
    """Seconds the test waited for its lease; -1 when it gave up (``ct_lease_timeout``)."""
    lease_reused_gib: float = 0.0
    """The part of ``lease_gib`` that the resident model it reused already held."""
    lease_gave_up_after_s: float = 0.0
    """When it gave up waiting: the seconds it had waited (0 otherwise)."""
    placed_because: str | None = None
    """Why the VRAM scheduler sent it there (None: xdist's own scheduler, or a plain run)."""

    @property
    def waited_s(self) -> float:
        """The seconds it waited for its lease, granted or not."""
        return self.lease_gave_up_after_s if self.lease_wait_s < 0 else self.lease_wait_s

    @property
    def gpu_label(self) -> str:
        where = "?" if self.gpu_physical_index is None else str(self.gpu_physical_index)
        return f"GPU {where} ({self.gpu_name})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def placement_from(nodeid: str, outcome: str, record: TestRecord) -> Placement | None:
    """Where the test ran, if its record says (a bound worker's test, or one that leased)."""
    if record.worker is None:
        return None
    return Placement(
        nodeid=nodeid,
        outcome=outcome,
        worker=record.worker,
        gpu_name=record.gpu_name or "unknown GPU",
        gpu_physical_index=record.gpu_physical_index,
        gpu_uuid=record.gpu_uuid,
        lease_gib=float(record.lease_gib or 0.0),
        lease_wait_s=float(record.lease_wait_s or 0.0),
        lease_reused_gib=float(record.lease_reused_gib or 0.0),
        lease_gave_up_after_s=float(record.lease_gave_up_after_s or 0.0),
        placed_because=record.placed_because,
    )


def placement_lines(placements: list[Placement]) -> list[str]:
    """Per GPU: its workers, how many tests ran there, and the time spent waiting for leases."""
    if not placements:
        return []
    by_gpu: dict[str, list[Placement]] = {}
    for placement in placements:
        by_gpu.setdefault(placement.gpu_uuid or placement.gpu_label, []).append(placement)
    plain = all(p.worker == PLAIN_RUN_WORKER for p in placements)
    if plain and not any(p.lease_wait_s != 0 for p in placements):
        return []  # a plain run's leases are worth a line only when they made a test wait
    what = "VRAM leases" if plain else "GPU placement (pytest-xdist)"
    out = [f"{what}: {len(placements)} test(s) on {len(by_gpu)} GPU(s)"]
    for group in sorted(by_gpu.values(), key=lambda g: g[0].gpu_label):
        workers = sorted({p.worker for p in group}, key=lambda w: (len(w), w))
        waits = [p.waited_s for p in group if p.waited_s > 0]  # timeouts' waits included
        leased = sum(1 for p in group if p.lease_gib > 0)
        timeouts = sum(1 for p in group if p.lease_wait_s < 0)
        who = "" if plain else f"{', '.join(workers)}; "
        line = (
            f"  {group[0].gpu_label}: {who}{len(group)} test(s), "
            f"{leased} with a lease, waited {sum(waits):.1f} s in all"
            + (f" (longest {max(waits):.1f} s)" if waits else "")
        )
        reused = [p.lease_reused_gib for p in group if p.lease_reused_gib > 0]
        if reused:
            line += f", {len(reused)} reused the resident model's lease"
        if timeouts:
            line += f", {timeouts} lease timeout(s)"
        out.append(line)
    out += _placed_by_vram(placements)
    return out


def _placed_by_vram(placements: list[Placement]) -> list[str]:
    """One line on the VRAM scheduler's reasons, where it placed the run (the JSON report's
    ``placed_because`` has each test's)."""
    reasons = [p.placed_because for p in placements if p.placed_because]
    if not reasons:
        return []
    only = sum(1 for r in reasons if " hold(s) it" in r)
    every = sum(1 for r in reasons if r.startswith("fits every GPU"))
    too_big = sum(1 for r in reasons if r.startswith("too big"))
    packed = sum(1 for r in reasons if "packed beside" in r)
    return [
        f"  placed by VRAM: {only} test(s) on the only GPUs that hold them, {every} that fit "
        f"every GPU, {too_big} too big for every GPU (skipped on the largest); {packed} "
        "packed beside other workers' tests"
    ]
