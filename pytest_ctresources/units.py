"""Units, said once: bytes in GiB and MiB, counts of parameters, as every message shows them."""

from __future__ import annotations

from typing import Final

GIB: Final = 1 << 30
MIB: Final = 1 << 20


def bytes_text(count: float) -> str:
    """``count`` bytes as a person reads them: ``3.50 GiB``, ``640 MiB`` below 1 GiB, ``0 MiB``."""
    if abs(count) >= GIB:
        return f"{count / GIB:.2f} GiB"
    return f"{count / MIB:.0f} MiB"


def count_text(count: float) -> str:
    """A large count as ``1.2M``, ``2.6B``, ``850K``; small counts as they are."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= size:
            return f"{count / size:.1f}{suffix}"
    return f"{count:.0f}"
