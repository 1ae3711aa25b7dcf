"""What the controller and its pytest-xdist workers exchange about learned needs.

The controller loads the learned needs from its cache and ships them to every worker in
``workerinput``, as pytest-randomly ships its seed, so that every worker (a ``--tx ssh``
one on another host with another cache, or none, included) decides skips, leases and the
OOM retry from the needs the controller will update. Each worker sends back, in
``workeroutput``, the needs it found stale while collecting, which the controller prunes.
Registered on the controller only, and only where xdist is installed (its hooks exist only
then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

#: ``workerinput`` key of the controller's learned needs.
LEARNED_INPUT = "ct_learned_needs"
#: ``workeroutput`` key of the learned needs a worker found stale at collection.
STALE_LEARNED_OUTPUT = "ct_stale_learned"


class LearnedNeedsExchange:
    """The controller's side: ship the needs to each worker, take its stale keys back."""

    name = "ctresources-xdist-learned"

    def __init__(
        self,
        learned: Callable[[], Mapping[str, Any]],
        stale: Callable[[Iterable[str]], None],
    ) -> None:
        self._learned = learned
        self._stale = stale

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[LEARNED_INPUT] = self._learned()

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        output = getattr(node, "workeroutput", None) or {}
        stale = output.get(STALE_LEARNED_OUTPUT, ())
        if isinstance(stale, list | tuple):
            # Keys only: anything else a worker sent prunes nothing.
            self._stale(key for key in stale if isinstance(key, str))


def shipped_needs(config: pytest.Config) -> Mapping[str, Any] | None:
    """In a worker: the learned needs its controller shipped (None: not a worker, or a
    controller that ships none, which leaves the worker to read its own cache)."""
    workerinput = getattr(config, "workerinput", None)
    if not isinstance(workerinput, dict):
        return None
    shipped = workerinput.get(LEARNED_INPUT)
    return shipped if isinstance(shipped, dict) else None


def send_stale(config: pytest.Config, stale: Iterable[str]) -> None:
    """In a worker: hand the stale keys to the controller, which prunes."""
    config.workeroutput[STALE_LEARNED_OUTPUT] = sorted(stale)  # type: ignore[attr-defined]
