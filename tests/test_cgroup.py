"""The container's memory limit, read from a fake cgroup file tree (pure: no pytest run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_ctresources.estimator import auto as autobatch
from pytest_ctresources.estimator import cgroup

GIB = 1 << 30
V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 25 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
    "32 25 0:28 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)


def tree(tmp_path: Path, cgroup_text: str, mounts: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_text)
    (tmp_path / "proc/self/mountinfo").write_text(mounts)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_v2_limit_less_usage_in_the_process_s_own_cgroup(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        "0::/user.slice/job.scope\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/user.slice/job.scope/memory.max": f"{8 * GIB}\n",
            "sys/fs/cgroup/user.slice/job.scope/memory.current": f"{3 * GIB}\n",
            "sys/fs/cgroup/memory.max": "max\n",
        },
    )
    assert cgroup.memory_room(root) == (5 * GIB, "cgroup v2 memory.max less memory.current")


def test_v1_limit_under_a_mount_of_the_container_s_own_cgroup(tmp_path: Path) -> None:
    """The mount's root is the container's cgroup (/docker/abc): its files are at the mount
    point itself."""
    root = tree(
        tmp_path,
        "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * GIB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1 * GIB}\n",
        },
    )
    room = cgroup.memory_room(root)
    assert room == (3 * GIB, "cgroup v1 memory.limit_in_bytes less memory.usage_in_bytes")


@pytest.mark.parametrize(
    ("cgroup_text", "mounts", "files"),
    [
        # No limit: v2's "max", v1's page-rounded 2^63.
        ("0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "max\n"}),
        (
            "11:memory:/docker/abc\n",
            V1_MOUNTS,
            {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"},
        ),
        # Garbage, in the limit or in the process's cgroup file.
        ("0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "lots\n"}),
        ("garbage\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": f"{GIB}\n"}),
        # Missing: the limit file, the memory controller's mount.
        ("0::/\n", V2_MOUNT, {}),
        ("11:memory:/docker/abc\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": f"{GIB}\n"}),
    ],
    ids=["v2-max", "v1-no-limit", "garbage-limit", "garbage-cgroup", "no-file", "no-mount"],
)
def test_no_limit_or_unreadable_files_mean_no_limit(
    tmp_path: Path, cgroup_text: str, mounts: str, files: dict[str, str]
) -> None:
    assert cgroup.memory_room(tree(tmp_path, cgroup_text, mounts, files)) is None


def test_a_host_without_proc_has_no_limit(tmp_path: Path) -> None:
    assert cgroup.memory_room(tmp_path) is None


def test_missing_usage_counts_the_whole_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": f"{2 * GIB}\n"})
    assert cgroup.memory_room(root) == (2 * GIB, "cgroup v2 memory.max less memory.current")


def test_auto_on_the_cpu_fits_the_container_s_limit_when_it_is_less(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skip and batch decisions of a CPU-only run read the host's available memory:
    the cgroup's room where that is less than the node's, the node's otherwise."""
    monkeypatch.setattr(autobatch, "_node_available", lambda: (64 * GIB, "psutil"))
    room = (3 * GIB, "cgroup v2 memory.max less memory.current")
    monkeypatch.setattr(cgroup, "memory_room", lambda root=Path("/"): room)
    assert autobatch.host_available() == room
    monkeypatch.setattr(cgroup, "memory_room", lambda root=Path("/"): (128 * GIB, "cgroup"))
    assert autobatch.host_available() == (64 * GIB, "psutil")
    monkeypatch.setattr(autobatch, "_node_available", lambda: None)
    assert autobatch.host_available() == (128 * GIB, "cgroup")
