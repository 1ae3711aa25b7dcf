"""The report paths, ``--ct-report-json`` and ``--ct-report-plot``: what the plugin may write.

A path is checked when the settings are resolved (:func:`check_target`: a symlink, a
directory, a device node or a file that is not a report is refused, docs/security.md), and
the writer (report/files.py) asks :func:`refusal` again when it replaces a file: only a
report of the same kind that the plugin wrote for this user is replaced.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import IO

from pytest_ctresources.settings.options import Declared
from pytest_ctresources.units import file_kind, named, shown

SCHEMA = "pytest-ctresources-report"
#: The options that name the report files, as their declarations spell them.
JSON_FLAG = str(Declared.report_json.option)
PLOT_FLAG = str(Declared.report_plot.option)
SNAPSHOT_FLAG = str(Declared.snapshot.option)
#: How a pickle of protocol 2 or later begins (its ``PROTO`` opcode), as every memory
#: snapshot does: torch's and the kernels' are written with ``pickle``'s default protocol.
PICKLE_MARK = b"\x80"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: How every JSON report begins: an object whose first key is ``schema``, the report's
#: (``json.dumps`` keeps it first; any spacing, as a tool that rewrites the file may leave).
JSON_MARK = re.compile(rb'\{\s*"schema"\s*:\s*"' + re.escape(SCHEMA.encode()) + rb'"\s*,')
#: The PNG ``tEXt`` chunk that marks a VRAM plot the plugin wrote (matplotlib writes it,
#: after ``IHDR``, from ``savefig(metadata=...)``): any other PNG is someone's image.
PLOT_MARK_KEY = "pytest-ctresources"
PLOT_MARK_VALUE = "vram-plot"
#: How much of an existing file is read to recognise a report (the marks are at its start,
#: but at a PDF's end, in its document information dictionary).
HEAD_BYTES = 4096
TAIL_BYTES = 65536
#: The plot's formats, by extension, as matplotlib writes them: (format, what it is).
PLOT_FORMATS = {
    ".png": ("png", "a PNG image"),
    ".svg": ("svg", "an SVG image"),
    ".pdf": ("pdf", "a PDF document"),
}
#: The mark of a plot the plugin wrote, as matplotlib's metadata of each format: a PNG
#: ``tEXt`` chunk, an SVG's Dublin Core description (near its start), a PDF's subject (in its
#: information dictionary, near its end).
MARK_TEXT = f"{PLOT_MARK_KEY} {PLOT_MARK_VALUE}"
PLOT_METADATA = {
    "png": {PLOT_MARK_KEY: PLOT_MARK_VALUE},
    "svg": {"Description": MARK_TEXT},
    "pdf": {"Subject": MARK_TEXT},
}


class TargetError(ValueError):
    """A report path that the plugin will not write; the message is one line."""


def refused_kind(mode: int) -> str:
    """What is at a report's path, when it is not a regular file, and why it is refused."""
    if stat.S_ISLNK(mode):
        return "a symbolic link (a report is never written through one: name its target)"
    if stat.S_ISDIR(mode):
        return "a directory, not a file path"
    return f"{file_kind(mode)}, not a regular file"


def _png_marked(head: bytes) -> bool:
    """Whether ``head`` is the start of a PNG holding the plugin's ``tEXt`` mark before its
    image data (chunks: 4-byte length, 4-byte type, data, 4-byte CRC)."""
    if not head.startswith(PNG_MAGIC):
        return False
    mark = PLOT_MARK_KEY.encode("latin-1") + b"\0" + PLOT_MARK_VALUE.encode("latin-1")
    offset = len(PNG_MAGIC)
    while offset + 8 <= len(head):
        length = int.from_bytes(head[offset : offset + 4], "big")
        kind = head[offset + 4 : offset + 8]
        if kind in (b"IDAT", b"IEND") or offset + 12 + length > len(head):
            return False  # (a chunk cut short, or longer than the file: not ours)
        if kind == b"tEXt" and head[offset + 8 : offset + 8 + length] == mark:
            return True
        offset += 12 + length
    return False


def _recognised(handle: IO[bytes], size: int, path: Path, flag: str) -> bool:
    """Whether the open file (``size`` bytes) is a report of ``flag``'s kind the plugin wrote,
    in the format ``path``'s extension names."""
    head = handle.read(HEAD_BYTES)
    if flag == JSON_FLAG:
        return JSON_MARK.match(head) is not None
    if flag == SNAPSHOT_FLAG:
        return head.startswith(PICKLE_MARK)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        mark = f"<dc:description>{MARK_TEXT}</dc:description>"
        return head.startswith(b"<?xml") and mark.encode() in head
    if suffix == ".pdf":
        handle.seek(max(0, size - TAIL_BYTES))
        mark = f"/Subject ({MARK_TEXT})"
        return head.startswith(b"%PDF-") and mark.encode() in handle.read()
    return _png_marked(head)


def refusal(path: Path, value: str, flag: str) -> str | None:
    """Why the entry at ``path`` may not be replaced by a report of ``flag``, in one line; None
    when nothing is there or it is a report of that kind the plugin wrote for this user.

    Only such a file is replaced: not any PNG, not another user's report (root would make it
    root's and 0600), not another user's empty file. The user's own empty file is a name
    reserved for the report (``mktemp``) and is replaced. Never follows a link and never opens
    anything but a regular file (opening a device can have effects); the checks are made on
    what was opened.
    """
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(seen.st_mode):
        return f"{value} is {refused_kind(seen.st_mode)}"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        return f"{value} cannot be read to tell whether it is a report ({exc.strerror})"
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(
            info.st_mode
        ):
            return f"{value} changed while it was looked at"
        if info.st_uid != os.geteuid():
            return f"{value} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
        if info.st_size == 0 or _recognised(handle, info.st_size, path, flag):
            return None
    what = "a pytest-ctresources JSON report"
    if flag == SNAPSHOT_FLAG:
        what = "a memory snapshot (a pickle)"
    elif flag == PLOT_FLAG:
        kind = PLOT_FORMATS.get(path.suffix.lower(), (None, "a VRAM plot"))[1]
        what = f"{kind} that pytest-ctresources wrote (its VRAM plot)"
    return f"{value} exists and is not {what}"


def check_target(value: str, flag: str, invocation_dir: Path) -> Path:
    """The path a report of ``flag`` goes to, checked at start-up rather than after an hour
    of tests. Raises :class:`TargetError` for a path the plugin will not write."""
    if "\0" in value:
        raise TargetError(f"{shown(value)} is not a valid path (it contains a NUL character)")
    path = invocation_dir / value
    value = named(value)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # ENOTDIR (a component is a file), ENAMETOOLONG, ELOOP, EACCES
        raise TargetError(f"cannot write {value}: {exc.strerror}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise TargetError(f"{value} is {refused_kind(mode)}")
    if (problem := planted_link(path)) is not None:
        raise TargetError(f"cannot write {value}: {problem}")
    # Missing directories are created when the report is written, as --junitxml does.
    existing = existing_ancestor(path.parent)
    if not existing.is_dir():
        raise TargetError(f"cannot write {value}: {named(str(existing))} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK) or (
        mode is not None and not os.access(path, os.W_OK)
    ):
        raise TargetError(f"cannot write {value}: permission denied")
    if mode is not None and (problem := refusal(path, value, flag)) is not None:
        raise TargetError(f"{problem}: it is not replaced (remove it, or name another path)")
    if flag == PLOT_FLAG and path.suffix.lower() not in PLOT_FORMATS:
        extension = f"the extension {named(path.suffix)}" if path.suffix else "no extension"
        raise TargetError(
            f"{value} has {extension}: the plot's format comes from it, and it can be written "
            f"as {', '.join(PLOT_FORMATS)}"
        )
    return path


def planted_link(path: Path) -> str | None:
    """Why a directory on the way to ``path`` may not be followed, or None: a symbolic link
    in a shared directory (sticky, anyone may write to it: ``/tmp``) that another user made,
    and that user does not own that directory. Linux follows no such link where
    ``fs.protected_symlinks`` is on (the usual default); this holds where it is off, for
    links planted before the run (a directory the plugin makes is never made over one)."""
    for part in [*reversed(path.parents)][1:]:
        try:
            info = os.lstat(part)
        except OSError:
            return None  # what is missing is made by the plugin, never through a link
        if not stat.S_ISLNK(info.st_mode) or info.st_uid == os.geteuid():
            continue
        parent = os.lstat(part.parent)
        shared = parent.st_mode & stat.S_ISVTX and parent.st_mode & stat.S_IWOTH
        if shared and info.st_uid != parent.st_uid:
            return (
                f"{named(str(part))} is a symbolic link that uid {info.st_uid} made in a shared "
                "directory (it is not followed: name its target)"
            )
    return None


def existing_ancestor(directory: Path) -> Path:
    """``directory`` or the nearest of its parents that exists (a link counts as existing)."""
    while not os.path.lexists(directory) and directory != directory.parent:
        directory = directory.parent
    return directory


def check_directory(value: str, invocation_dir: Path) -> Path:
    """A directory the plugin writes files into, checked at start-up: absent (made later,
    private: ``report/files.py``'s ``private_directory``) or a directory, never a link.
    Raises :class:`TargetError`."""
    path = invocation_dir / value
    if (problem := planted_link(path)) is not None:
        raise TargetError(f"cannot write into {named(value)}: {problem}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise TargetError(f"cannot write into {named(value)}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise TargetError(
            f"{named(value)} is a symbolic link (nothing is written through one: name its target)"
        )
    if not stat.S_ISDIR(mode):
        raise TargetError(f"{named(value)} is {file_kind(mode)}, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise TargetError(f"cannot write into {named(value)}: permission denied")
    return path


def check_plot_support() -> str | None:
    """Why ``--ct-report-plot`` cannot work here (matplotlib is an optional dependency)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib, which is not installed (pip install matplotlib)"
    return None
