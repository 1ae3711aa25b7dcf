"""The CUDA allocator of the pytest process: PYTORCH_CUDA_ALLOC_CONF and the capacity cap.

Both act only on a process that uses torch, and neither initialises CUDA itself: the
environment variable must be in place before CUDA initialises, and the cap is queued to run
when (if ever) it does. ``ct_alloc_conf`` is checked against the caching allocator's option
names at start-up (:func:`check_alloc_conf`): torch itself reads the variable only at the
first CUDA allocation, and raises there.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

import pytest

from pytest_ctresources.units import GIB, did_you_mean, shown

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
#: The allocator's variables in the order torch reads them; the first one set wins
#: (c10/cuda/CUDAAllocatorConfig.h; the HIP name on ROCm builds, PYTORCH_ALLOC_CONF is the
#: newer device-generic name). The plugin sets ALLOC_CONF_ENV, which every torch it supports
#: reads, and only when none of them is set: a user's PYTORCH_ALLOC_CONF would otherwise be
#: silently overridden by ours.
ALLOC_CONF_ENVS: tuple[str, ...] = (ALLOC_CONF_ENV, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_BOOL = "True|False"
_WHOLE = "a whole number"
#: The caching allocator's option names and the values torch accepts, for the pinned torch
#: (2.13): the device-generic ones of c10/core/AllocatorConfig (max_split_size_mb, ...) and
#: the CUDA ones of c10/cuda/CUDAAllocatorConfig.h ``getKeys()``, the ROCm spellings
#: included. A value described as None is checked by torch only.
ALLOC_OPTIONS: Mapping[str, str | None] = {
    "backend": "native|cudaMallocAsync|hipMallocAsync",
    "expandable_segments": _BOOL,
    "expandable_segments_reserve": None,
    "expandable_segments_reserve_by_class": None,
    "garbage_collection_threshold": "a number between 0 and 1",
    "graph_capture_record_stream_reuse": _BOOL,
    "large_segment_size_mb": f"{_WHOLE} of at least 11",  # torch: "must be > 10 MB"
    "max_non_split_rounding_mb": "a whole number of at least 20",
    "max_split_size_mb": "a whole number of at least 20",
    "per_process_memory_fraction": "a number from 0 to 1",
    "pinned_free_catch_all": _BOOL,
    "pinned_max_cached_size_mb": _WHOLE,
    "pinned_max_round_threshold_mb": _WHOLE,
    "pinned_num_register_threads": "a power of 2 up to 128",
    "pinned_reserve_segment_size_mb": _WHOLE,
    "pinned_use_background_threads": _BOOL,
    "pinned_use_cuda_host_register": _BOOL,
    "pinned_use_hip_host_register": _BOOL,
    "release_lock_on_cudamalloc": _BOOL,
    "release_lock_on_hipmalloc": _BOOL,
    "roundup_power2_divisions": None,
    "throw_on_cudamalloc_oom": _BOOL,
}


def _value_fits(rule: str | None, value: str) -> bool:
    if rule is None:
        return bool(value)
    if rule.startswith(_WHOLE):  # as C++'s stoull reads it: ASCII digits a size_t holds
        if not (value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS):
            return False
        least = rule.removeprefix(_WHOLE).removeprefix(" of at least ")
        return int(value) >= int(least or 0)
    if rule == "a power of 2 up to 128":
        return value in {str(1 << power) for power in range(8)}
    if rule.startswith("a number"):
        if not value.isascii():  # stod reads no other digits
            return False
        try:
            number = float(value)
        except ValueError:
            return False
        return 0 < number < 1 if "between" in rule else 0 <= number <= 1
    return value in rule.split("|")


#: The most digits a whole value may have: 18 always fit the size_t torch parses into.
_MAX_DIGITS = 18


def check_alloc_conf(text: str) -> str:
    """Check an allocator config (``name:value,name:value``) as torch's parser reads it.

    Returns ``text``; raises ``ValueError`` with a one-line message naming the first option
    torch would reject. Empty text means "set nothing" and is valid. Values torch describes
    with a structure of their own (``roundup_power2_divisions:[256:1,>:4]``) are left to it.
    """
    # torch's ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own, spaces vanish.
    tokens = [t for t in re.split(r"([,:\[\]])", text.replace(" ", "")) if t]
    i = 0
    while i < len(tokens):
        name = tokens[i]
        if name == ",":  # torch skips empty entries
            i += 1
            continue
        if name not in ALLOC_OPTIONS:
            raise ValueError(
                f"unknown CUDA allocator option {shown(name)}{did_you_mean(name, ALLOC_OPTIONS)}"
                f" in {shown(text)}; torch's options: {', '.join(ALLOC_OPTIONS)} (for an option "
                "newer than this list, set PYTORCH_ALLOC_CONF in the environment instead)"
            )
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ValueError(
                f"allocator option {name} needs a value, {name}:VALUE, in {shown(text)}"
            )
        if tokens[i + 2] == "[":
            if "]" not in tokens[i + 2 :]:
                raise ValueError(f"allocator option {name}: '[' without ']' in {shown(text)}")
            i = tokens.index("]", i + 2) + 1
        else:
            value = tokens[i + 2]
            rule = ALLOC_OPTIONS[name]
            if value in ",:[]" or not _value_fits(rule, value):
                wanted = (rule or "a value").replace("|", " or ")
                raise ValueError(
                    f"allocator option {name} must be {wanted}, got {shown(value)} in {shown(text)}"
                )
            i += 3
        if i < len(tokens) and tokens[i] != ",":
            raise ValueError(f"expected ',' after the {name} option in {shown(text)}")
    return text


def alloc_conf_in_environment(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The allocator variable torch will read from ``environ`` and its value, or None."""
    for name in ALLOC_CONF_ENVS:
        if name in environ:
            return name, environ[name]
    return None


@dataclass
class AllocConf:
    """Sets PYTORCH_CUDA_ALLOC_CONF if no allocator variable is set, and can undo exactly
    that. A value :func:`check_alloc_conf` rejects is never set (the settings report it)."""

    value: str
    environ: MutableMapping[str, str] = field(default_factory=lambda: os.environ)
    set_by_us: bool = False

    def apply(self) -> None:
        if not self.value or alloc_conf_in_environment(self.environ) is not None:
            return
        try:
            check_alloc_conf(self.value)
        except ValueError:
            return
        self.environ[ALLOC_CONF_ENV] = self.value
        self.set_by_us = True

    def undo(self) -> None:
        if self.set_by_us and self.environ.get(ALLOC_CONF_ENV) == self.value:
            del self.environ[ALLOC_CONF_ENV]
        self.set_by_us = False

    def effective(self) -> str | None:
        return self.environ.get(ALLOC_CONF_ENV)


def memory_fraction(capacity_bytes: int, total_bytes: int) -> float | None:
    """The allocator fraction that caps a ``total_bytes`` GPU at ``capacity_bytes``.

    None when the cap would not bind (capacity at or above the card's memory).
    """
    if total_bytes <= 0 or capacity_bytes >= total_bytes:
        return None
    return capacity_bytes / total_bytes


@dataclass
class CapacityCap:
    """Caps torch's CUDA caching allocator at ``capacity_gib`` on every visible device.

    ``arm()`` is cheap and idempotent; it does nothing until torch is loaded, and then
    queues the cap with torch's lazy-init queue so that it applies the moment CUDA
    initialises (or at once if it already has), without initialising CUDA itself.
    """

    capacity_gib: float
    armed: bool = False

    def arm(self, *, import_torch: bool = False) -> None:
        """Queue the cap. ``import_torch``: import torch if no one has yet (this does not
        initialise CUDA), so that a test importing torch later is capped too."""
        if import_torch and not self.armed:
            import torch as _torch  # noqa: F401  (registers the module in sys.modules)
        torch = sys.modules.get("torch")
        if self.armed or torch is None:
            return
        self.armed = True
        # torch.cuda._lazy_call is how torch itself defers device work (manual_seed uses it):
        # run now if CUDA is initialised, else at initialisation.
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if lazy_call is not None:
            lazy_call(self._apply)
        elif torch.cuda.is_initialized():
            self._apply()

    def _apply(self) -> None:
        torch = sys.modules["torch"]
        capacity = int(self.capacity_gib * GIB)
        for index in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(index).total_memory
            fraction = memory_fraction(capacity, total)
            if fraction is not None:  # None: the card is no larger than the cap
                torch.cuda.set_per_process_memory_fraction(fraction, index)


#: The AllocConf the plugin applied before conftests were imported (config.stash): the
#: settings tell the variable it set from one the user set.
ALLOC_KEY = pytest.StashKey[AllocConf]()
