"""Which files are notebook configs, and what a project that asks hears of one named without
``--nbmake`` (:class:`NotebookHint`).

Apart from ``items.py`` so that a run without ``--nbmake`` loads this and no more of the
notebook support.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ctresources.settings.experiment_yaml import MAX_BYTES

YAML_SUFFIXES = (".yaml", ".yml")
NOTEBOOK_LINE = b"NOTEBOOK:"


def shown_path(path: str | Path, config: pytest.Config) -> str:
    """``path`` as messages show it: relative to the rootdir when it is inside."""
    try:
        return Path(path).relative_to(config.rootpath).as_posix()
    except ValueError:
        return str(path)


def names_a_notebook(path: Path) -> bool:
    """Whether the YAML file at ``path`` has a ``NOTEBOOK:`` line in the most a config may
    hold (:data:`MAX_BYTES`; a larger one is refused when it is read). A FIFO or a device is
    no config: opened without blocking, it is never read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # os.fdopen refuses a directory
        os.close(descriptor)
        return False
    with os.fdopen(descriptor, "rb") as handle:
        try:
            head = handle.read(MAX_BYTES + 1)
        except OSError:
            return False
    return head.startswith(NOTEBOOK_LINE) or b"\n" + NOTEBOOK_LINE in head


class NotebookHint:
    """Without ``--nbmake``, in a project that asks: a ``NOTEBOOK`` config named on the
    command line says what it needs, instead of pytest's "found no collectors"."""

    name = "ctresources-notebook-hint"

    def pytest_collect_file(self, file_path: Path, parent: pytest.Collector) -> pytest.File | None:
        if not (
            file_path.suffix in YAML_SUFFIXES
            and parent.session.isinitpath(file_path)
            and names_a_notebook(file_path)
        ):
            return None
        return NeedsNbmake.from_parent(parent, path=file_path)


class NeedsNbmake(pytest.File):
    """A ``NOTEBOOK`` config named without ``--nbmake``: a collection error saying so."""

    def collect(self) -> Iterator[pytest.Item]:
        raise self.CollectError(
            f"{shown_path(self.path, self.config)} names a NOTEBOOK: notebook configs run "
            "under nbmake: add --nbmake (pip install nbmake, if it is not installed)"
        )
