"""Reading a file that may be hostile, said once: the experiment configs, a model's
``config.json``, notebooks and the learned needs in pytest's cache are all read this way.

Only a regular file is read (a FIFO would block its reader until a writer comes, and
``/dev/zero`` never ends): it is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the
descriptor, so what is checked is what is read. At most a limit of bytes is read, optionally
never through a symbolic link. Each caller words the failure in its own one-line message.
"""

from __future__ import annotations

import errno as errno_codes
import os
import stat


class Unreadable(Exception):
    """Why a file was not read: ``str()`` is a few words for the caller's message (an
    ``strerror``, ``not a regular file``, ``larger than 1 MiB``)."""

    def __init__(
        self,
        reason: str,
        *,
        code: int | None = None,
        too_large: bool = False,
        in_read: bool = False,
    ) -> None:
        super().__init__(reason)
        self.code = code
        """The ``errno`` of a failed open or read, None otherwise."""
        self.too_large = too_large
        self.in_read = in_read
        """The file opened as a regular file, and reading it failed."""

    @property
    def missing(self) -> bool:
        return self.code == errno_codes.ENOENT

    @property
    def link(self) -> bool:
        """Refused as a symbolic link (``follow_links=False``)."""
        return self.code == errno_codes.ELOOP


def read_regular(
    path: str | os.PathLike[str], limit: int | None = None, *, follow_links: bool = True
) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (None: all).

    Raises :class:`Unreadable`: the path cannot be opened (its ``errno`` kept; a NUL in it
    reads ``not a valid path``), is a directory (``Is a directory``) or another file that is
    not regular, is larger than ``limit``, or, with ``follow_links=False``, is a link.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        raise Unreadable(exc.strerror or type(exc).__name__, code=exc.errno) from None
    except ValueError:  # a NUL in the path
        raise Unreadable("not a valid path") from None
    # fstat before fdopen: fdopen of a directory raises IsADirectoryError.
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise Unreadable("Is a directory" if stat.S_ISDIR(mode) else "not a regular file")
    with os.fdopen(descriptor, "rb") as handle:
        try:
            data = handle.read() if limit is None else handle.read(limit + 1)
        except OSError as exc:
            raise Unreadable(
                exc.strerror or type(exc).__name__, code=exc.errno, in_read=True
            ) from None
    if limit is not None and len(data) > limit:
        raise Unreadable(f"larger than {limit >> 20} MiB", too_large=True)
    return data
