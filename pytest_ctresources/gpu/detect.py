"""Where GPU facts come from: which CUDA GPUs this process will see, and how big they are.

This is the only module of the plugin that asks the machine about GPUs. Everything else
(capacity checks, skip reasons, report headers) works from the :class:`GpuFacts` that
:func:`detect_gpus` returns.

Sources, in order:

1. ``CT_FAKE_GPUS`` -- a testing seam. CPU-only test runs present GPUs of given capacities;
   they are labelled ``source="fake"`` everywhere so they are never mistaken for real ones.
   ``CT_FAKE_GPUS_USED`` (``"6;0.5"``: GiB by position) is the same seam for the memory in
   use on each fake GPU, NVML's figure that the VRAM lease budget reads
   (:func:`used_memory_reader`); unset, nothing is in use.
2. NVML (``pynvml``, from the ``nvidia-ml-py`` distribution). NVML reads the driver's view of
   the hardware without creating a CUDA context, so detection neither costs GPU memory nor
   breaks later ``fork()``-based workers. ``CUDA_VISIBLE_DEVICES`` is applied the way the
   CUDA runtime applies it (gpu/visible_devices.py), because NVML itself ignores that variable.
3. torch, only when NVML cannot be used. ``torch.cuda`` already honours
   ``CUDA_VISIBLE_DEVICES``, but querying device properties may initialise CUDA.

Nothing here caches: callers cache the result; tests need fresh answers.
Neither ``torch`` nor ``pynvml`` is imported at module import time, because the plugin is
loaded by every pytest run and importing torch costs seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV, fake_used_gib, parse_fake_gpus
from pytest_ctresources.gpu.visible_devices import (
    VISIBLE_DEVICES_ENV,
    Device,
    Physical,
    Selection,
    select,
)
from pytest_ctresources.units import GIB, printable

__all__ = [
    "DEVICE_ORDER_ENV",
    "GpuFacts",
    "GpuInfo",
    "GpuSource",
    "detect_gpus",
    "used_memory_reader",
]

DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"

GpuSource = Literal["nvml", "torch", "fake", "none"]

# pynvml.NVML_DEVICE_MIG_ENABLE; spelled out so a stand-in pynvml module need not define it.
_NVML_DEVICE_MIG_ENABLE = 1

_T = TypeVar("_T")


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as this process will number it."""

    index: int
    """CUDA ordinal as this process sees it (0..n-1 after ``CUDA_VISIBLE_DEVICES``)."""
    name: str
    """Device name, e.g. ``"NVIDIA H200"`` or ``"NVIDIA A100-SXM4-40GB MIG 3g.20gb"``."""
    total_bytes: int
    """Device memory in bytes as CUDA counts it (torch's ``total_memory``); for a MIG device,
    that MIG device's own memory."""
    uuid: str | None
    """``"GPU-..."`` or ``"MIG-..."``; ``None`` where the source could not tell."""
    physical_index: int | None
    """NVML index of the physical GPU (of the parent GPU for a MIG device); ``None`` from torch."""

    @property
    def total_gib(self) -> float:
        """Total memory in GiB (2**30 bytes)."""
        return self.total_bytes / GIB

    @property
    def is_mig(self) -> bool:
        """Whether this is a MIG device (a slice of a physical GPU) rather than a whole GPU."""
        return self.uuid is not None and self.uuid.startswith("MIG-")

    def describe(self) -> str:
        """Short label for skip reasons and messages: ``"GPU 0 (NVIDIA H200)"``."""
        return f"GPU {self.index} ({self.name})"

    def to_dict(self) -> dict[str, object]:
        """JSON-able form; ``total_gib`` is included for people reading reports."""
        return {
            "index": self.index,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_gib, 3),
            "uuid": self.uuid,
            "physical_index": self.physical_index,
        }


@dataclass(frozen=True)
class GpuFacts:
    """What :func:`detect_gpus` found: the visible GPUs, where the facts came from, and why."""

    gpus: tuple[GpuInfo, ...]
    source: GpuSource
    detail: str
    """Human text: how the facts were obtained, and why GPUs were left out, if any were."""
    cuda_visible_devices: str | None
    """The raw ``CUDA_VISIBLE_DEVICES`` value; ``None`` when unset."""
    caveats: tuple[str, ...] = ()
    """Reasons the facts might not match what CUDA will do (e.g. device ordering)."""

    def gpu(self, index: int = 0) -> GpuInfo | None:
        """The GPU with CUDA ordinal ``index``, or ``None`` if there is no such GPU."""
        if 0 <= index < len(self.gpus):
            return self.gpus[index]
        return None

    def summary_lines(self) -> list[str]:
        """Lines for the pytest header, one per GPU, then one per caveat."""
        if not self.gpus:
            lines = [f"no CUDA GPU detected ({self.detail})"]
        else:
            lines = [self._summary_line(gpu) for gpu in self.gpus]
        lines.extend(f"note: {caveat}" for caveat in self.caveats)
        return lines

    def _summary_line(self, gpu: GpuInfo) -> str:
        where: list[str] = [self.source]
        if gpu.physical_index is not None:
            target = f"physical {gpu.physical_index}"
            if gpu.is_mig:
                target = f"MIG device on {target}"
            if self.cuda_visible_devices is not None:
                target = f"{VISIBLE_DEVICES_ENV}={self.cuda_visible_devices} -> {target}"
            where.append(target)
        elif self.cuda_visible_devices is not None:
            where.append(f"{VISIBLE_DEVICES_ENV}={self.cuda_visible_devices}")
        return f"GPU {gpu.index}: {gpu.name}, {gpu.total_gib:.1f} GiB ({', '.join(where)})"

    def to_dict(self) -> dict[str, object]:
        """JSON-able form, for the JSON report and ``ct-resources gpus --json``."""
        return {
            "source": self.source,
            "detail": self.detail,
            "cuda_visible_devices": self.cuda_visible_devices,
            "caveats": list(self.caveats),
            "gpus": [gpu.to_dict() for gpu in self.gpus],
        }


def _facts(
    source: GpuSource,
    selection: Selection,
    detail: str,
    cuda_visible_devices: str | None,
    caveats: Sequence[str] = (),
) -> GpuFacts:
    gpus = tuple(
        GpuInfo(
            index=index,
            name=device.name,
            total_bytes=device.total_bytes,
            uuid=device.uuid,
            physical_index=device.physical_index,
        )
        for index, device in enumerate(selection.devices)
    )
    return GpuFacts(
        gpus=gpus,
        source=source,
        detail="; ".join([detail, *selection.notes]),
        cuda_visible_devices=cuda_visible_devices,
        caveats=tuple([*caveats, *selection.caveats]),
    )


# --------------------------------------------------------------------------- detection


def detect_gpus(
    environ: Mapping[str, str] | None = None, *, torch_fallback: bool = True
) -> GpuFacts:
    """Find the CUDA GPUs this process will see, without creating a CUDA context.

    ``environ`` defaults to ``os.environ``; ``CT_FAKE_GPUS``, ``CUDA_VISIBLE_DEVICES`` and
    ``CUDA_DEVICE_ORDER`` are read from it. (The torch fallback necessarily follows the
    process's real environment instead.) Never raises for an unusable NVML or torch -- that
    becomes ``source="none"`` with the reasons in ``detail`` -- but a malformed
    ``CT_FAKE_GPUS`` raises ``ValueError``, since a test seam that silently falls back to the
    real hardware would make CPU test results lie. ``torch_fallback=False`` never imports
    torch (xdist workers bind their GPU at start-up, where importing torch is too costly).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    visible = env.get(VISIBLE_DEVICES_ENV)

    fake = env.get(FAKE_GPUS_ENV)
    if fake is not None:
        return _detect_fake(fake, visible)

    nvml = _detect_nvml(env, visible)
    if isinstance(nvml, GpuFacts):
        return nvml
    if not torch_fallback:
        return GpuFacts((), "none", nvml, visible)
    return _detect_torch(visible, nvml_reason=nvml)


def _detect_fake(text: str, visible: str | None) -> GpuFacts:
    physicals = [
        Physical(Device(name, round(gib * GIB), f"GPU-fake-{i}", i))
        for i, (name, gib) in enumerate(parse_fake_gpus(text))
    ]
    return _facts("fake", select(physicals, visible), FAKE_GPUS_ENV, visible)


def _load_pynvml() -> Any:
    """Import pynvml. The single access point, so tests can put a stand-in in sys.modules."""
    import pynvml

    return pynvml


def _load_torch() -> Any:
    """Import torch, late: it is slow to import and only needed when NVML is unusable."""
    import torch

    return torch


def _text(value: object) -> str:
    """pynvml returns bytes for strings in old versions (and str in new ones). Escaped where
    not printable: a name (a driver's, a MIG profile's) reaches the terminal and reports."""
    if isinstance(value, bytes):
        return printable(value.decode("utf-8", errors="replace"))
    return printable(str(value))


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _quietly(call: Callable[[], _T]) -> _T | None:
    """Run an optional query; ``None`` if it fails. Only for facts we can do without."""
    try:
        return call()
    except Exception:
        return None


def _optional_text(query: Callable[[Any], object], handle: Any) -> str | None:
    """``query(handle)`` as text, or ``None`` if it fails. Only for facts we can do without."""
    try:
        return _text(query(handle))
    except Exception:
        return None


def _detect_nvml(env: Mapping[str, str], visible: str | None) -> GpuFacts | str:
    """NVML facts, or a string saying why NVML could not be used."""
    try:
        nvml = _load_pynvml()
    except ImportError as exc:
        return f"NVML unavailable (pynvml not importable: {_reason(exc)})"
    try:
        nvml.nvmlInit()
    except Exception as exc:
        # Typically pynvml.NVMLError_LibraryNotFound (no driver) or DriverNotLoaded.
        return f"NVML unavailable ({_reason(exc)})"
    try:
        physicals, notes = _read_nvml_physicals(nvml)
        version = _quietly(lambda: _text(nvml.nvmlSystemGetNVMLVersion()))
    except Exception as exc:
        return f"NVML query failed ({_reason(exc)})"
    finally:
        # Shutdown failing must not hide the facts we already have.
        _quietly(nvml.nvmlShutdown)

    caveats: list[str] = []
    selection = select(physicals, visible)
    if selection.used_indices and env.get(DEVICE_ORDER_ENV) != "PCI_BUS_ID":
        kinds = {(p.device.name, p.device.total_bytes) for p in physicals}
        if len(kinds) > 1:
            # NVML lists GPUs in PCI bus order; CUDA's default order (FASTEST_FIRST) puts
            # the fastest GPU first and leaves the rest unspecified. With identical GPUs
            # the difference does not change any fact reported here; with mixed GPUs it can.
            caveats.append(
                f"{DEVICE_ORDER_ENV} is not PCI_BUS_ID and the GPUs differ, so CUDA may number "
                "them differently from NVML (shown here); set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                "or select GPUs by UUID"
            )
    detail = "NVML" if version is None else f"NVML {version}"
    return _facts("nvml", selection, "; ".join([detail, *notes]), visible, caveats)


def _read_nvml_physicals(nvml: Any) -> tuple[list[Physical], list[str]]:
    """Every physical GPU NVML can read, in NVML (PCI bus) order, with its MIG devices."""
    physicals: list[Physical] = []
    notes: list[str] = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            total = _total_bytes(nvml, handle)
        except Exception as exc:
            # E.g. NO_PERMISSION for a GPU a cgroup hides. CUDA cannot open such a GPU
            # either, and it does not count it when numbering devices, so neither do we.
            notes.append(f"NVML cannot read GPU {index} ({_reason(exc)}); left out")
            continue
        uuid = _optional_text(nvml.nvmlDeviceGetUUID, handle)
        mig_enabled, migs = _read_mig_devices(nvml, handle, index)
        physicals.append(Physical(Device(name, total, uuid, index), mig_enabled, migs))
    return physicals, notes


def _total_bytes(nvml: Any, handle: Any) -> int:
    """Device memory as CUDA reports it (``cudaDeviceProp.totalGlobalMem``, torch's
    ``total_memory``), i.e. without what the driver reserves for itself.

    NVML's original memory query counts the reserved part as used memory of the total: on an
    H200, 150754820096 bytes "total" against CUDA's 150109880320 (0.6 GiB less). The v2
    query reports ``reserved`` separately, and ``total - reserved`` is exactly CUDA's figure.
    Drivers older than R510 lack v2; their plain total then overstates capacity slightly.
    """
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(info.total) - int(info.reserved)
        except Exception:
            pass  # e.g. NVMLError_FunctionNotFound on an old driver: use the v1 query
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)


def _read_mig_devices(nvml: Any, handle: Any, index: int) -> tuple[bool, tuple[Device, ...]]:
    """Whether the GPU is in MIG mode, and its MIG devices.

    Any failure counts as "not in MIG mode" or skips that one MIG device: most GPUs do not
    support MIG at all (nvmlDeviceGetMigMode raises NotSupported), empty MIG slots raise
    NotFound, and old drivers lack these functions. None of that may break detection.
    """
    try:
        current_mode = nvml.nvmlDeviceGetMigMode(handle)[0]
    except Exception:
        return False, ()
    if current_mode != _NVML_DEVICE_MIG_ENABLE:
        return False, ()
    try:
        slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except Exception:
        return True, ()
    devices: list[Device] = []
    for slot in range(slots):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            uuid = _text(nvml.nvmlDeviceGetUUID(mig))
            total = _total_bytes(nvml, mig)
        except Exception:
            continue
        name = _optional_text(nvml.nvmlDeviceGetName, mig) or f"MIG device {uuid}"
        devices.append(Device(name, total, uuid, index))
    return True, tuple(devices)


def _detect_torch(visible: str | None, nvml_reason: str) -> GpuFacts:
    """Fallback when NVML is unusable. ``torch.cuda`` applies CUDA_VISIBLE_DEVICES itself."""
    try:
        torch = _load_torch()
    except ImportError as exc:
        reason = f"torch not importable ({_reason(exc)})"
    else:
        try:
            version = str(getattr(torch, "__version__", "?"))
            if not torch.cuda.is_available():
                build = getattr(getattr(torch, "version", None), "cuda", "?")
                why = "CPU-only build" if build is None else "no usable CUDA device or driver"
                reason = f"torch {version}: CUDA not available ({why})"
            else:
                # get_device_properties initialises CUDA in this process (which is why NVML
                # is preferred), but it is the only source left.
                devices = [
                    _torch_device(torch.cuda.get_device_properties(i))
                    for i in range(int(torch.cuda.device_count()))
                ]
                gpus = tuple(
                    GpuInfo(i, name, total, uuid, None)
                    for i, (name, total, uuid) in enumerate(devices)
                )
                return GpuFacts(
                    gpus=gpus,
                    source="torch",
                    detail=f"{nvml_reason}; torch {version} (this fallback may initialise CUDA)",
                    cuda_visible_devices=visible,
                )
        except Exception as exc:
            reason = f"torch CUDA query failed ({_reason(exc)})"
    return GpuFacts(
        gpus=(), source="none", detail=f"{nvml_reason}; {reason}", cuda_visible_devices=visible
    )


def _torch_device(props: Any) -> tuple[str, int, str | None]:
    """(name, total bytes, uuid) from a ``torch.cuda.get_device_properties`` result."""
    name = _text(props.name)
    raw_uuid = getattr(props, "uuid", None)
    uuid = None if raw_uuid is None else str(raw_uuid)
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        # torch prints the bare UUID; nvidia-smi and CUDA_VISIBLE_DEVICES use prefixed ones.
        # torch names MIG devices "<GPU> MIG <profile>", which tells which prefix applies.
        uuid = ("MIG-" if " MIG " in f" {name} " else "GPU-") + uuid
    return name, int(props.total_memory), uuid or None


def free_bytes(facts: GpuFacts, *, may_use_torch: bool = True) -> list[int | None]:
    """Free memory of each GPU in ``facts`` now, from the same source (None if unknown).

    NVML is asked by UUID; the torch source asks ``torch.cuda.mem_get_info``, which creates
    a CUDA context: only for commands, never at pytest start-up, and never with
    ``may_use_torch=False`` (the pytest process must not touch CUDA for a notebook's
    kernel). Fake GPUs are free but for what ``CT_FAKE_GPUS_USED`` says they use (raises
    ``ValueError`` if it is malformed).
    """
    if facts.source in ("nvml", "fake"):
        free: list[int | None] = []
        for gpu in facts.gpus:
            reader = used_memory_reader(gpu)
            used = None
            if reader is not None:
                used = reader()
                reader.close()
            free.append(None if used is None else max(gpu.total_bytes - used, 0))
        return free
    if facts.source == "torch" and may_use_torch:
        torch = _load_torch()

        def torch_free(index: int) -> int | None:
            return _quietly(lambda: int(torch.cuda.mem_get_info(index)[0]))

        return [torch_free(gpu.index) for gpu in facts.gpus]
    return [None] * len(facts.gpus)


class UsedMemory:
    """Reads the memory in use on one GPU now, in bytes, whoever uses it (NVML's view).

    Call it for a figure (None when it cannot be read); :meth:`close` when done. An NVML
    reader keeps NVML initialised between calls, so a reading costs one query.
    """

    def __init__(self, read: Callable[[], int | None], close: Callable[[], object] = int) -> None:
        self._read = read
        self._close = close

    def __call__(self) -> int | None:
        return _quietly(self._read)

    def close(self) -> None:
        _quietly(self._close)


def used_memory_reader(gpu: GpuInfo, environ: Mapping[str, str] | None = None) -> UsedMemory | None:
    """A reader of the memory in use on ``gpu``; None where no source can tell.

    Fake GPUs (``CT_FAKE_GPUS``) read ``CT_FAKE_GPUS_USED`` (raises ``ValueError`` if it is
    malformed); real ones NVML, by UUID: the card's size as CUDA counts it less NVML's free
    memory, which counts every process's allocations and CUDA contexts. Without NVML (the
    torch fallback) there is no reader: torch could only tell by creating a CUDA context.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    used = fake_used_gib(env)
    if used is not None:
        position = gpu.physical_index if gpu.physical_index is not None else gpu.index
        figure = round(used[position] * GIB) if position < len(used) else 0
        return UsedMemory(lambda: figure)
    if gpu.uuid is None:
        return None
    try:
        nvml = _load_pynvml()
        nvml.nvmlInit()
    except Exception:
        return None
    handle = _quietly(lambda: nvml.nvmlDeviceGetHandleByUUID(gpu.uuid))
    if handle is None:
        _quietly(nvml.nvmlShutdown)
        return None

    def read() -> int:
        free = int(nvml.nvmlDeviceGetMemoryInfo(handle).free)
        return max(0, gpu.total_bytes - free)

    return UsedMemory(read, nvml.nvmlShutdown)
