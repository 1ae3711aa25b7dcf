"""Units and quoting, said once: bytes in GiB and MiB, counts of parameters, and values,
text and files as every message shows them (bounded ``repr``, escaped control characters, a
did-you-mean, what a file is); and a named pair, as data another process or a project sent
is read."""

from __future__ import annotations

import difflib
import math
import reprlib
import stat
from collections.abc import Iterable
from typing import Final

GIB: Final = 1 << 30
MIB: Final = 1 << 20
#: The most GiB any one setting may name for one GPU (a capacity, a need, a threshold).
#: The largest cards sold today hold 288 GB; 1 TiB leaves room for a few generations, and
#: keeps every GiB figure convertible to bytes, ledger units and floats without overflow.
MAX_GIB = 1024.0

_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 40
_SHOWN.maxlevel = 3
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4
_LONG_INT_BITS = 133  # 40 decimal digits


def shown(value: object) -> str:
    """``repr(value)``, short enough to quote in a one-line message.

    Input is quoted back to its author, and input may be hostile: ``repr`` of an integer
    over 4300 digits raises, of a 5000-character string floods the terminal, and of a YAML
    alias bomb never finishes. :mod:`reprlib` bounds the work and the length.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _LONG_INT_BITS:
            digits = math.floor(value.bit_length() * math.log10(2)) + 1
            return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
        return repr(value)
    text = _SHOWN.repr(value)
    if isinstance(value, str) and len(value) > _SHOWN.maxstring:
        text += f" ({len(value)} characters)"
    return text


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it
    (``\\x1b``, ``\\u2028``, ``\\udcff``), as pytest escapes node ids: a file name, an ini
    path or a GPU name can hold an escape sequence, which raw would rewrite the terminal.
    Printable text, non-ASCII letters included, is returned as it is."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def named(value: str) -> str:
    """A path as a one-line message shows it: as typed, or, holding a control character
    (a newline, an escape sequence) or too long to read, escaped and shortened as pytest
    shows a node id."""
    return value if value.isprintable() and len(value) <= 200 else shown(value)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest candidate, or an empty string. Case does not
    count (``batch_size`` in a YAML file means ``BATCH_SIZE``)."""
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {named(by_lower[close[0]])}?)" if close else ""


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


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (an ``st_mode``) is, as a message names it: ``a FIFO``."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device node"),
        (stat.S_ISBLK, "a device node"),
    ):
        if test(mode):
            return kind
    return "a special file"


def named_pair(entry: object) -> tuple[str, object] | None:
    """``entry`` as a ``(name, value)`` pair whose name is text, or None: how an entry of data
    a project or another process sent is read (a test's ``user_properties``, to which a
    project may append anything; an xdist worker's list of needs)."""
    if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str):
        return entry[0], entry[1]
    return None
