"""How a notebook's kernel is started and how it reports back.

Everything reaches the kernel through jupyter_client's own ways in, so the kernel is the one
nbmake would start, in the project's own IPython profile:

- its environment: the pytest process's, plus the session's settings (``CT_*``); the
  allocator default ``PYTORCH_CUDA_ALLOC_CONF`` comes with the pytest process's environment.
  It is passed to ``start_kernel(env=...)``; ``os.environ`` is never changed;
- for an IPython kernel (ipykernel), a start-up file given as an extra IPython config file
  (``--IPKernelApp.extra_config_file``), which IPython executes after the profile's own
  config files, in a namespace of its own: it applies ``--ct-vram-capacity`` inside the
  kernel and writes the kernel's CUDA peak to a file at exit, and configures nothing. It
  leaves no name in the notebook's namespace, and the project's ``IPYTHONDIR``, profile,
  start-up files, ``exec_lines``/``exec_files`` and ``code_to_run``/``file_to_run`` all still
  run (``--IPKernelApp.code_to_run``, used before, replaced the profile's ``code_to_run``,
  and IPython skips ``file_to_run`` when ``code_to_run`` is set; a list on the command line
  would replace the profile's list);
- IPC sockets instead of TCP ports, so parallel xdist workers never race for a port
  (nbmake#129: jupyter_client picks free ports by binding and closing them, and the kernel
  binds them later). The sockets live in a private directory made for each kernel; where
  that directory's path is too long for a socket address (a long ``TMPDIR``), in a private
  directory under ``/tmp``, and where even that cannot be, on TCP as under nbmake alone.

Imported only under ``--nbmake`` (it imports jupyter_client's machinery when a kernel starts).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import string
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_ctresources.gpu.allocator import ALLOC_CONF_ENV
from pytest_ctresources.gpu.measure import VramFigures
from pytest_ctresources.settings.config import CircuitTracerConfig
from pytest_ctresources.settings.options import Declared

VRAM_FILE_ENV = "CT_NOTEBOOK_VRAM_FILE"
SNAPSHOT_FILE_ENV = "CT_NOTEBOOK_SNAPSHOT_FILE"
#: ``--ct-vram-capacity``'s variable: the kernel applies it as the pytest process does.
CAPACITY_ENV = str(Declared.vram_capacity.env)

# Executed by IPython in the kernel process as an extra config file, after the profile's own
# config files and before the kernel and its shell exist: nothing it defines reaches the
# notebook, and it sets no config (``c`` is left empty), so the profile's settings all stand.
# It caps the allocator like the pytest process (importing torch only when a cap is set) and
# reports the kernel's CUDA figures at exit, using only what the kernel itself loaded. Under
# --ct-snapshot it records the allocator's history from the start and dumps it at exit. The
# variables' names are this module's constants, filled in below.
KERNEL_STARTUP = string.Template("""\
import atexit
import os

if os.environ.get("$capacity"):
    from pytest_ctresources.gpu.allocator import CapacityCap

    CapacityCap(float(os.environ["$capacity"])).arm(import_torch=True)
if os.environ.get("$snapshot"):
    from pytest_ctresources.gpu.memory_history import start_recording

    start_recording()


def _ctresources_report_vram():
    import json, sys
    path = os.environ.get("$vram")
    torch = sys.modules.get("torch")
    if not path or torch is None or not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    if os.environ.get("$snapshot"):
        torch.cuda.memory._dump_snapshot(os.environ["$snapshot"])
    with open(path, "w") as handle:
        json.dump({
            "device": device,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }, handle)


atexit.register(_ctresources_report_vram)
""").substitute(capacity=CAPACITY_ENV, snapshot=SNAPSHOT_FILE_ENV, vram=VRAM_FILE_ENV)

#: How the start-up file reaches ipykernel: IPython loads this extra config file after the
#: profile's (``--config`` is its short form, which a kernelspec may already use).
STARTUP_OPTION = "--IPKernelApp.extra_config_file"

#: The longest socket path the kernel may be given: ``sun_path`` holds 108 bytes with its
#: NUL, and jupyter_client appends ``-<port>`` (one digit for the five channels, but be safe).
MAX_SOCKET_PATH = 100


def kernel_environment(
    cfg: CircuitTracerConfig,
    config_path: str | None,
    alloc_conf: str | None,
    capacity_gib: float | None,
) -> dict[str, str]:
    """The variables a notebook's kernel gets from the session, beyond the pytest process's
    own environment."""
    env = {
        str(Declared.batch_size.env): str(cfg.batch_size),
        str(Declared.max_feature_nodes.env): str(cfg.max_feature_nodes),
    }
    if config_path:
        env[str(Declared.config.env)] = config_path
    if alloc_conf:
        env[ALLOC_CONF_ENV] = alloc_conf
    if capacity_gib:
        env[CAPACITY_ENV] = repr(capacity_gib)
    return env


def startup_argument(path: str, argv: list[str]) -> str | None:
    """The argument that makes ipykernel (kernelspec command ``argv``) load the start-up
    file, or None where it must not be given: a kernel that is not ipykernel would refuse
    the option, and one whose kernelspec already names an extra config file would lose it
    (the option holds one file)."""
    if not is_ipython_kernel(argv):
        return None
    if any("--config" in part or "extra_config_file" in part for part in argv):
        return None
    return f"{STARTUP_OPTION}={path}"


def is_ipython_kernel(argv: list[str]) -> bool:
    """Whether a kernelspec's command starts ipykernel (whose ``IPKernelApp`` options the
    start-up file needs); any other kernel would refuse them."""
    return any(Path(part).name.startswith("ipykernel") for part in argv)


@functools.cache
def ipc_kernel_manager() -> type:
    """The kernel manager class nbclient is given (built once, on first use).

    nbclient drives kernels from an asyncio loop: the manager must be the *async* one. A
    subclass of the blocking KernelManager gives a blocking client whose get_msg() starves
    the loop, so nbclient's dead-kernel poll never runs and a dying kernel hangs the run.
    Where its sockets go and which start-up file it passes come from its traitlets config
    (:func:`kernel_launch`), so one class serves every kernel.
    """
    from jupyter_client import AsyncKernelManager
    from traitlets import Unicode

    class IpcKernelManager(AsyncKernelManager):  # type: ignore[misc]  # (Any base)
        """A kernel on IPC sockets, started with the plugin's start-up file if it is ipykernel."""

        startup_file = Unicode(
            "", config=True, help="a file ipykernel loads at start-up (as an extra config file)"
        )

        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            arguments = list(extra_arguments or [])
            if self.startup_file:
                argument = startup_argument(self.startup_file, list(self.kernel_spec.argv))
                if argument is not None:
                    arguments.append(argument)
            command: list[str] = super().format_kernel_cmd(arguments)
            return command

    return IpcKernelManager


@dataclass
class KernelLaunch:
    """How the kernels started in a :func:`kernel_launch` block are started, and, once the
    block has ended, the CUDA figures the kernel reported (None if it never used CUDA)."""

    env: dict[str, str]
    """The kernel's whole environment (for ``start_kernel(env=...)``)."""
    manager_class: type
    config: Any
    """traitlets ``Config`` for the manager: IPC transport, socket path, start-up file."""
    figures: VramFigures | None = None
    snapshot: bytes | None = None
    """The kernel's CUDA memory snapshot, pickled (``snapshot=True``; None if it used no CUDA)."""


@contextmanager
def kernel_launch(
    extra_env: Mapping[str, str], *, snapshot: bool = False
) -> Iterator[KernelLaunch]:
    """A private directory for one kernel's sockets, start-up file and VRAM report (and, with
    ``snapshot``, its memory snapshot); removed at the end of the block, when
    :attr:`KernelLaunch.figures` and :attr:`KernelLaunch.snapshot` are filled."""
    from traitlets.config import Config

    # mkdtemp: a new directory, mode 0700, that nobody else can have prepared or can enter.
    scratch = Path(tempfile.mkdtemp(prefix="ctresources-nb-"))
    sockets: Path | None = None
    try:
        sockets = socket_directory(scratch)
        transport = {"transport": "ipc", "ip": str(sockets / "kernel")} if sockets else {}
        startup = scratch / "startup.py"
        startup.write_text(KERNEL_STARTUP, encoding="utf-8")
        vram_file = scratch / "vram.json"
        snapshot_file = scratch / "snapshot.pickle"
        recording = {SNAPSHOT_FILE_ENV: str(snapshot_file)} if snapshot else {}
        launch = KernelLaunch(
            env={**os.environ, **extra_env, VRAM_FILE_ENV: str(vram_file), **recording},
            manager_class=ipc_kernel_manager(),
            config=Config(
                {
                    # No socket directory: jupyter_client's TCP default, as under nbmake.
                    "IpcKernelManager": {**transport, "startup_file": str(startup)}
                }
            ),
        )
        try:
            yield launch
        finally:
            launch.figures = read_figures(vram_file)
            if snapshot and snapshot_file.is_file():
                launch.snapshot = snapshot_file.read_bytes()
    finally:
        if sockets is not None and sockets != scratch:
            shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def socket_directory(scratch: Path) -> Path | None:
    """Where a kernel's IPC sockets go: ``scratch`` when its socket paths fit in a socket
    address, else a private directory made under ``/tmp`` (the temp directory a long
    ``TMPDIR`` replaced), else None (use TCP, as nbmake does)."""
    if fits_socket_path(scratch):
        return scratch
    short = Path("/tmp")
    if short.is_dir() and fits_socket_path(short / "ctresources-nb-xxxxxxxx"):
        try:
            return Path(tempfile.mkdtemp(prefix="ctresources-nb-", dir=short))
        except OSError:  # /tmp not writable here
            return None
    return None


def fits_socket_path(directory: Path) -> bool:
    """Whether the kernel's socket paths in ``directory`` fit in ``sun_path``."""
    return len(os.fsencode(directory / "kernel-99999")) <= MAX_SOCKET_PATH


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
