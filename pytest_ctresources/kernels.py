"""How a notebook's kernel is started and how it reports back.

- its environment: the session's settings (``CT_*``), the allocator default
  (``PYTORCH_CUDA_ALLOC_CONF``) and a non-interactive matplotlib backend;
- an IPython start-up file (through a private ``IPYTHONDIR``) that applies
  ``--ct-vram-capacity`` inside the kernel and writes the kernel's CUDA peak to a file at exit;
- IPC sockets instead of TCP ports, so parallel xdist workers never race for a port
  (nbmake#129: jupyter_client picks free ports by binding and closing them, and the kernel
  binds them later).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pytest_ctresources.config import CircuitTracerConfig
from pytest_ctresources.measure import VramFigures

VRAM_FILE_ENV = "CT_NOTEBOOK_VRAM_FILE"
CAPACITY_ENV = "CT_VRAM_CAPACITY"

# Runs in the kernel at start-up (IPython profile start-up file), without a visible cell.
# It caps the allocator like the pytest process (importing torch only when a cap is set) and
# reports the kernel's CUDA figures at exit, using only what the kernel itself loaded.
KERNEL_STARTUP = """\
import atexit as _ct_atexit
import os as _ct_os

if _ct_os.environ.get("CT_VRAM_CAPACITY"):
    from pytest_ctresources.allocator import CapacityCap as _CtCapacityCap

    _CtCapacityCap(float(_ct_os.environ["CT_VRAM_CAPACITY"])).arm(import_torch=True)


def _ct_report_vram():
    import json, os, sys
    path = os.environ.get("CT_NOTEBOOK_VRAM_FILE")
    torch = sys.modules.get("torch")
    if not path or torch is None or not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    with open(path, "w") as handle:
        json.dump({
            "device": device,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }, handle)


_ct_atexit.register(_ct_report_vram)
"""


def kernel_environment(
    cfg: CircuitTracerConfig,
    config_path: str | None,
    alloc_conf: str | None,
    capacity_gib: float | None,
) -> dict[str, str]:
    """The environment variables a notebook's kernel gets from the session."""
    env = {
        "CT_BATCH_SIZE": str(cfg.batch_size),
        "CT_MAX_FEATURE_NODES": str(cfg.max_feature_nodes),
        "MPLBACKEND": "Agg",
    }
    if config_path:
        env["CT_CONFIG"] = config_path
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if capacity_gib:
        env[CAPACITY_ENV] = repr(capacity_gib)
    return env


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (the kernel inherits it), then restore."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _ipc_kernel_manager(directory: Path) -> type:
    # nbclient drives kernels from an asyncio loop: the manager must be the *async* one. A
    # subclass of the blocking KernelManager gives a blocking client whose get_msg() starves
    # the loop, so nbclient's dead-kernel poll never runs and a dying kernel hangs the run.
    from jupyter_client import AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):  # type: ignore[misc]  # (Any base)
        """A kernel on IPC sockets in a private directory: no TCP port to race for."""

        def _transport_default(self) -> str:
            return "ipc"

        def _ip_default(self) -> str:
            return str(directory / "kernel")

    return IpcKernelManager


@contextmanager
def ipc_kernels(directory: Path) -> Iterator[None]:
    """Make nbmake's runner start kernels on IPC sockets in ``directory`` for the block.

    nbmake's ``NotebookRun`` builds its ``nbclient.NotebookClient`` itself and takes no kernel
    manager, so the name it looks up is swapped for the block.
    """
    import functools

    from nbmake import nb_run

    original = nb_run.NotebookClient
    nb_run.NotebookClient = functools.partial(
        original, kernel_manager_class=_ipc_kernel_manager(directory)
    )
    try:
        yield
    finally:
        nb_run.NotebookClient = original


@dataclass
class KernelReport:
    """Filled when the block of :func:`kernel_launch` ends: the kernel's CUDA figures, if it
    used CUDA."""

    figures: VramFigures | None = None


@contextmanager
def kernel_launch(env: Mapping[str, str]) -> Iterator[KernelReport]:
    """Kernels started in the block get ``env``, the start-up file and IPC sockets."""
    scratch = Path(tempfile.mkdtemp(prefix="ctresources-nb-"))
    startup = scratch / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-ctresources.py").write_text(KERNEL_STARTUP, encoding="utf-8")
    vram_file = scratch / "vram.json"
    report = KernelReport()
    full_env = {**env, "IPYTHONDIR": str(scratch / "ipython"), VRAM_FILE_ENV: str(vram_file)}
    try:
        with environment(full_env), ipc_kernels(scratch):
            yield report
    finally:
        report.figures = read_figures(vram_file)
        shutil.rmtree(scratch, ignore_errors=True)


def read_figures(path: Path) -> VramFigures | None:
    """The figures the start-up file wrote; None if the kernel never used CUDA."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return VramFigures(
            device=int(data["device"]),
            baseline_bytes=0,  # a fresh kernel process
            peak_allocated_bytes=int(data["peak_allocated_bytes"]),
            peak_reserved_bytes=int(data["peak_reserved_bytes"]),
            # What the notebook still held at exit is not a leak: the kernel process has
            # exited (nbclient shuts it down before the item ends) and its memory with it.
            after_bytes=0,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
