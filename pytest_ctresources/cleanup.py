"""Where cleanup happens: between tests, and in the public helpers usable outside pytest.

Nothing here imports torch or matplotlib to clean up: a library that the test never loaded
has nothing to clean, so we look in ``sys.modules``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pytest_ctresources.nnsight_threads import release_quietly

if TYPE_CHECKING:
    import torch


def cuda_initialised() -> bool:
    """True when torch is loaded and has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    is_initialized = getattr(getattr(torch, "cuda", None), "is_initialized", None)
    return bool(callable(is_initialized) and is_initialized())


def cleanup_python_cuda() -> None:
    """``gc.collect()`` and then ``torch.cuda.empty_cache()``, in that order.

    The collection comes first because the cache can only return blocks whose tensors are
    gone, and tensors caught in reference cycles are gone only after a collection. Safe to
    call anywhere: without torch or without CUDA it only collects.
    """
    gc.collect()
    if cuda_initialised():
        sys.modules["torch"].cuda.empty_cache()


def close_open_figures() -> int:
    """Close every open matplotlib figure, if pyplot is loaded; return how many were open."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return 0
    count = len(pyplot.get_fignums())
    if count:
        pyplot.close("all")
    return count


def _tracebacks_of(exc: BaseException | None) -> Iterator[TracebackType]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            yield exc.__traceback__
        exc = exc.__cause__ or exc.__context__


def clear_exception_frames(exc: BaseException) -> None:
    """Drop the locals of every frame held by ``exc`` and the exceptions it chains to."""
    for tb in _tracebacks_of(exc):
        clear_frames(tb)


def release_failed_test_frames() -> bool:
    """Clear the local variables of the frames of the last failed test's traceback.

    pytest keeps the failure in ``sys.last_value``/``sys.last_traceback`` for post-mortem
    debugging (``--pdb`` has already run by the time teardown ends). Those frames hold the
    test's locals, so its tensors would stay on the GPU into the next test. The traceback
    itself survives; only its frames' locals go.
    """
    tracebacks = list(_tracebacks_of(getattr(sys, "last_value", None)))
    last_tb = getattr(sys, "last_traceback", None)
    if last_tb is not None:
        tracebacks.append(last_tb)
    for tb in tracebacks:
        clear_frames(tb)
    return bool(tracebacks)


def clear_frames(tb: TracebackType | None) -> None:
    """Drop the local variables of every finished frame of traceback ``tb``."""
    # traceback.clear_frames() is not enough before Python 3.13: frame.clear() drops the fast
    # locals, but a dict snapshot of them that pytest's traceback formatting made through
    # frame.f_locals keeps every local alive until the next f_locals read re-syncs it.
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:  # a frame still executing (not a finished test's)
            pass
        else:
            frame.f_locals  # noqa: B018  (the read empties the stale snapshot)
        tb = tb.tb_next


@dataclass(frozen=True)
class CleanupResult:
    """What the between-test cleanup did."""

    figures_closed: int = 0
    collected: bool = False
    cuda_cache_emptied: bool = False


def cleanup_after_test(mode: str) -> CleanupResult:
    """The cleanup run after each test's teardown, per ``ct_cleanup`` mode.

    ``auto``: close open figures; when torch is loaded, release the frames of a failed test;
    free nnsight threads an aborted trace left blocked (:mod:`pytest_ctresources.nnsight_threads`);
    when CUDA was initialised, ``gc.collect()`` then ``torch.cuda.empty_cache()``.
    ``always``: the same, and ``gc.collect()`` even when CUDA was not used. ``never``: nothing.
    """
    if mode == "never":
        return CleanupResult()
    figures = close_open_figures()
    if "torch" in sys.modules or mode == "always":
        release_failed_test_frames()
    # A trace an exception aborted (in the test, a fixture, or caught by the test itself)
    # can leave nnsight threads blocked with its tensors; a no-op unless nnsight is loaded.
    release_quietly()
    cuda = cuda_initialised()
    if cuda or mode == "always":
        cleanup_python_cuda()
    return CleanupResult(
        figures_closed=figures, collected=cuda or mode == "always", cuda_cache_emptied=cuda
    )


class CleanScope:
    """What :func:`safe_clean_cuda` yields: the model on the GPU, and a way to keep results."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._kept: set[int] = set()

    def keep(self, *tensors: torch.Tensor) -> None:
        """Exempt ``tensors`` (created inside the block) from being freed at its end."""
        self._kept.update(id(t) for t in tensors)


def _cuda_tensors() -> dict[int, torch.Tensor]:
    tensor_type = sys.modules["torch"].Tensor
    found: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, tensor_type) and obj.is_cuda:
                found[id(obj)] = obj
        except ReferenceError:  # a dead weakref proxy in gc's list
            continue
    return found


@contextmanager
def safe_clean_cuda(
    model: Any, device: str | torch.device = "cuda", *, min_bytes: int = 1 << 20
) -> Iterator[CleanScope]:
    """Move ``model`` to ``device`` for the block, then free what the block left behind.

    On exit, every CUDA tensor that the block created, that is at least ``min_bytes`` and
    not passed to :meth:`CleanScope.keep`, has its storage released even if something
    (a global, a cache, a traceback) still references it; then the model goes back to the
    device it came from and :func:`cleanup_python_cuda` runs. Copy results you need to the
    CPU inside the block, or ``keep()`` them::

        with safe_clean_cuda(model) as scope:
            graph = attribute(prompt, scope.model)
    """
    import torch

    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else torch.device("cpu")
    # Storage addresses, not tensors: holding the tensors would keep them alive, and a view
    # of a parameter or of an older tensor shares its storage, which must survive.
    before = {t.untyped_storage().data_ptr() for t in _cuda_tensors().values()}
    model.to(device)
    scope = CleanScope(model)
    try:
        yield scope
    finally:
        current = _cuda_tensors()
        kept = [t for key, t in current.items() if key in scope._kept]
        spared = before | {
            t.untyped_storage().data_ptr()
            for t in (*model.parameters(), *model.buffers(), *kept)
            if t.is_cuda
        }
        for tensor in current.values():
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in spared and storage.nbytes() >= min_bytes:
                storage.resize_(0)
        del current, kept
        model.to(home)
        cleanup_python_cuda()
