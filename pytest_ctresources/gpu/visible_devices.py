"""``CUDA_VISIBLE_DEVICES`` as the CUDA runtime applies it: which of the physical GPUs (and MIG
devices) a process with a given value sees, in which order. NVML ignores the variable, so
:mod:`pytest_ctresources.gpu.detect` applies it with this module to what NVML (or
``CT_FAKE_GPUS``) lists. Pure: no I/O, the devices are given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_ctresources.units import shown

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


# --------------------------------------------------------------------------- parsing


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split a ``CUDA_VISIBLE_DEVICES`` value into the entries CUDA will consider.

    ``None`` (unset) gives ``None``: every GPU is visible. Otherwise a list of entries, in
    order, of one kind, decided by the first entry as the CUDA runtime does:

    * integers, normalised (``" 01"`` -> ``"1"``, ``"1gpu"`` -> ``"1"``), or
    * ``GPU-`` UUID prefixes, or
    * ``MIG-`` UUIDs.

    Like the CUDA runtime, the list stops at the first entry that does not fit (a negative
    number such as ``-1``, text, an empty entry, or an entry of another kind), so ``""``
    gives ``[]`` and ``"0,GPU-..."`` gives ``["0"]``.

    This is syntax only. Entries that name no existing GPU, and repeated GPUs, are dealt
    with by :func:`select`, given the devices.
    """
    if value is None:
        return None
    return _tokenize(value)[0]


def _tokenize(value: str) -> tuple[list[str], str | None]:
    """:func:`parse_visible_devices`, plus why the list was cut short (``None`` if it wasn't)."""
    if not value.strip():
        return [], f"{VISIBLE_DEVICES_ENV} is empty, which hides every GPU"
    raws = value.split(",")
    entries = [raw.strip() for raw in raws]
    # The first entry fixes the kind of the whole list; checked against CUDA 13 on an H200:
    # "GPU-<uuid>,0" and "0,GPU-<uuid>" both give one device, not a repeated one.
    kind = next((k for k in ("GPU-", "MIG-") if entries[0].startswith(k)), None)
    tokens: list[str] = []
    for raw, entry in zip(raws, entries, strict=True):
        if kind is not None:
            if not entry.startswith(kind):
                return tokens, (
                    f"{VISIBLE_DEVICES_ENV} entry {shown(raw)} is not a {kind} UUID like the first "
                    "entry, so CUDA ignores it and everything after it"
                )
            tokens.append(entry)
            continue
        number = _strtoul(entry)
        if number is None:
            return tokens, (
                f"{VISIBLE_DEVICES_ENV} entry {shown(raw)} is not a device index (the first entry "
                "made this a list of indices), so CUDA ignores it and everything after it"
            )
        if number < 0:
            return tokens, (
                f"{VISIBLE_DEVICES_ENV} entry {shown(raw)} is negative, "
                "so CUDA ignores it and everything after it"
            )
        tokens.append(str(number))
    return tokens, None


def _strtoul(text: str) -> int | None:
    """The integer a C ``strtol`` reads at the start of ``text``; ``None`` if it reads none.

    CUDA parses index entries this leniently (``"1gpu"`` counts as ``1``); torch's own
    CUDA_VISIBLE_DEVICES parser (``torch.cuda._parse_visible_devices``) mirrors this, and so
    do we, so that all three agree on which GPUs a process gets. Where torch's differs,
    CUDA's reading wins: its digits are ASCII (torch's ``str.isdigit()`` also takes ``'²'``,
    on which its ``int()`` raises), and a number past a C ``long`` is clamped.
    """
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end] in _ASCII_DIGITS:  # str.isdigit() takes '²' too
        end += 1
    digits = text[:end]
    if not digits.lstrip("+-"):
        return None
    if end > _LONG_DIGITS:  # surely past a C long (and more than int() may read)
        return -_LONG_MAX - 1 if digits.startswith("-") else _LONG_MAX
    return max(-_LONG_MAX - 1, min(int(digits), _LONG_MAX))  # strtol clamps


_ASCII_DIGITS = "0123456789"
#: The largest C ``long`` (64-bit), and the characters beyond which a number is surely past it.
_LONG_MAX = 2**63 - 1
_LONG_DIGITS = 20


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Device:
    """Something CUDA can be pointed at: a whole GPU or one MIG device."""

    name: str
    total_bytes: int
    uuid: str | None
    physical_index: int


@dataclass(frozen=True)
class Physical:
    """A physical GPU as NVML (or CT_FAKE_GPUS) lists it, with its MIG devices if any."""

    device: Device
    mig_enabled: bool = False
    mig_devices: tuple[Device, ...] = ()


@dataclass
class Selection:
    devices: list[Device]
    notes: list[str]
    caveats: list[str]
    used_indices: bool
    """Whether CUDA ordinals depended on enumeration order (unset variable or integer entries)."""


def _match_uuid(token: str, uuids: Sequence[str | None]) -> int | None:
    """Position of the one UUID that ``token`` abbreviates, or ``None`` (none or ambiguous)."""
    if token in uuids:
        # Exact match first: real UUIDs have a fixed length, but fake ones ("GPU-fake-1",
        # "GPU-fake-10") can be prefixes of each other.
        return uuids.index(token)
    hits = [i for i, uuid in enumerate(uuids) if uuid is not None and uuid.startswith(token)]
    return hits[0] if len(hits) == 1 else None


def select(physicals: Sequence[Physical], value: str | None) -> Selection:
    """Apply ``CUDA_VISIBLE_DEVICES`` to ``physicals`` the way the CUDA runtime does."""
    notes: list[str] = []
    caveats: list[str] = []
    # A target is (position in physicals, MIG device position or None for the whole GPU).
    targets: list[tuple[int, int | None]] = []
    used_indices = value is None
    if value is None:
        targets = [(pos, None) for pos in range(len(physicals))]
    else:
        tokens, cut = _tokenize(value)
        migs = [(pos, j) for pos, p in enumerate(physicals) for j in range(len(p.mig_devices))]
        mig_uuids = [physicals[pos].mig_devices[j].uuid for pos, j in migs]
        gpu_uuids = [p.device.uuid for p in physicals]
        for token in tokens:
            target: tuple[int, int | None] | None = None
            if token.startswith("MIG-"):
                hit = _match_uuid(token, mig_uuids)
                target = None if hit is None else migs[hit]
            elif token.startswith("GPU-"):
                hit = _match_uuid(token, gpu_uuids)
                target = None if hit is None else (hit, None)
            else:
                used_indices = True
                if int(token) < len(physicals):
                    target = (int(token), None)
            if target is None:
                cut = (
                    f"{VISIBLE_DEVICES_ENV} entry {shown(token)} matches no single GPU "
                    f"(of {len(physicals)}), so CUDA ignores it and everything after it"
                )
                break
            if target in targets:
                # CUDA refuses a list that names a device twice: it then sees no device (checked
                # with CUDA 13 on an H200: "0,0" and "GPU-<uuid>,GPU-<prefix>" give none), and
                # torch.cuda's NVML-based count models it the same way.
                return Selection(
                    [],
                    [
                        f"{VISIBLE_DEVICES_ENV}={value} names the same device twice "
                        f"({shown(token)}); CUDA then sees no device at all"
                    ],
                    caveats,
                    used_indices,
                )
            targets.append(target)
        if cut is not None:
            notes.append(cut)

    devices: list[Device] = []
    mig_taken = False
    for pos, mig in targets:
        physical = physicals[pos]
        if mig is not None:
            device = physical.mig_devices[mig]
        elif physical.mig_enabled:
            # A GPU in MIG mode cannot run CUDA work itself; CUDA uses a MIG device on it.
            # Reporting the whole GPU's memory would overstate capacity badly.
            if not physical.mig_devices:
                caveats.append(
                    f"physical GPU {physical.device.physical_index} ({physical.device.name}) "
                    "is in MIG mode with no MIG devices; CUDA cannot use it, left out"
                )
                continue
            device = physical.mig_devices[0]
            caveats.append(
                f"physical GPU {physical.device.physical_index} is in MIG mode; CUDA runs on "
                f"its first MIG device ({device.name}), which is shown instead"
            )
        else:
            device = physical.device
        if device.uuid is not None and device.uuid.startswith("MIG-"):
            if mig_taken:
                # NVIDIA's MIG guide: a CUDA process enumerates at most one MIG device.
                # (Not checked on hardware here: no MIG-mode GPU was available.)
                caveats.append(f"CUDA uses only one MIG device per process; {device.uuid} left out")
                continue
            mig_taken = True
        devices.append(device)
    return Selection(devices, notes, caveats, used_indices)
