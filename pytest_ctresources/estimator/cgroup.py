"""The container's memory limit: what a process may still take under its cgroup.

A CPU-only run reading ``psutil`` or ``/proc/meminfo`` sees the whole node's memory, not the
limit a container runs under; the kernel kills the process at the limit. Found the way the
kernel publishes it: the process's cgroup in ``/proc/self/cgroup``, the cgroup file system's
mount in ``/proc/self/mountinfo``, then cgroup v2's ``memory.max`` and ``memory.current`` or
v1's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``. Pure reading under ``root``
(``/`` on a real host, a fake tree in tests); anything missing, unreadable or malformed, and a
limit of ``max`` (or v1's "no limit", a page-rounded 2^63), mean no limit: never an error.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Final

#: v1 reports "no limit" as the largest page-aligned signed 64-bit value; anything this
#: large is no limit.
NO_LIMIT_V1: Final = 1 << 62


def _mount(root: Path, version: int) -> tuple[Path, PurePosixPath] | None:
    """The mount point (under ``root``) and the mounted cgroup root of the memory
    controller's file system: ``cgroup2``, or a v1 ``cgroup`` mount with ``memory``."""
    for line in (root / "proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and "memory" in options
        ):
            return root / fields[4].lstrip("/"), PurePosixPath(fields[3])
    return None


def _cgroup_dir(root: Path) -> tuple[Path, int] | None:
    """The directory of this process's memory cgroup, and its version."""
    for line in (root / "proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        version = 2 if hierarchy == "0" and controllers == "" else 1
        if version == 1 and "memory" not in controllers.split(","):
            continue
        mount = _mount(root, version)
        if mount is None:
            continue
        point, mounted = mount
        relative = PurePosixPath(path)
        # Inside a cgroup namespace the path may be outside the mounted root: the mount
        # point is then the process's own cgroup.
        if relative.is_relative_to(mounted):
            return point / relative.relative_to(mounted), version
        return point, version
    return None


def memory_room(root: Path = Path("/")) -> tuple[int, str] | None:
    """Bytes the cgroup still allows (its limit less its usage) and where they were read,
    or None where there is no limit or it cannot be read."""
    try:
        found = _cgroup_dir(root)
        if found is None:
            return None
        directory, version = found
        names = (
            ("memory.max", "memory.current")
            if version == 2
            else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        text = (directory / names[0]).read_text().strip()
        if text == "max":
            return None
        limit = int(text)
        if limit <= 0 or limit >= NO_LIMIT_V1:
            return None
        try:
            used = int((directory / names[1]).read_text().strip())
        except (OSError, ValueError):
            used = 0
    except (OSError, ValueError):
        return None
    return max(limit - used, 0), f"cgroup v{version} {names[0]} less {names[1]}"
