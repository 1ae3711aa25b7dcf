"""Which part of a pytest-xdist run this process plays: a worker, the controller, or neither.

Read at every pytest start-up (the plugin starts at once in a controller and a worker), so
this module imports nothing of the package's GPU code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

WORKER_ENV = "PYTEST_XDIST_WORKER"


def is_worker(environ: Mapping[str, str]) -> bool:
    """Whether this process is a pytest-xdist worker."""
    return WORKER_ENV in environ


def runs_no_tests(config: pytest.Config) -> bool:
    """Whether this is a pytest-xdist controller (its workers run the tests), by xdist's own
    test: it distributes (``dist`` other than ``no``) to some execution environments (``tx``:
    ``-n`` fills them in, ``--tx`` names them)."""
    if hasattr(config, "workerinput"):
        return False
    return config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
