"""Cleanup helpers, usable outside pytest: garbage collection with the CUDA cache, figures,
failed tests' frames, and a scope that frees what a block left on the GPU.

What runs between tests, and when, is :mod:`pytest_ctresources.gpu.cleanup_between_tests`.
Nothing here imports torch or matplotlib to clean up: a library that the test never loaded
has nothing to clean, so we look in ``sys.modules``.
"""

from __future__ import annotations

import gc
import inspect
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pytest_ctresources.units import MIB

if TYPE_CHECKING:
    import torch


def cuda_initialised() -> bool:
    """True when torch is loaded and has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    is_initialized = getattr(getattr(torch, "cuda", None), "is_initialized", None)
    return bool(callable(is_initialized) and is_initialized())


def collect_everything(*, refreeze: bool = True) -> bool:
    """A full garbage collection that also reaches objects ``gc.freeze()`` set aside (the
    between-test cleanup freezes long-lived objects; garbage among them is only found this
    way), freezing the survivors again unless ``refreeze`` is false. Returns whether it
    unfroze and left it so: the caller tells whoever froze (``gc.get_freeze_count()`` walks
    the frozen objects, 28 ms over torch's heap: too slow to ask after every test)."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        gc.collect()
    finally:
        if frozen and refreeze:
            gc.freeze()
    return bool(frozen) and not refreeze


def cleanup_python_cuda(*, refreeze: bool = True) -> bool:
    """A full ``gc.collect()`` and then ``torch.cuda.empty_cache()``, in that order.

    The collection comes first because the cache can only return blocks whose tensors are
    gone, and tensors caught in reference cycles are gone only after a collection. Safe to
    call anywhere: without torch or without CUDA it only collects. (``refreeze`` and what it
    returns: see :func:`collect_everything`.)
    """
    left_unfrozen = collect_everything(refreeze=refreeze)
    if cuda_initialised():
        sys.modules["torch"].cuda.empty_cache()
    return left_unfrozen


def open_figure_numbers() -> frozenset[int]:
    """The numbers of matplotlib's open pyplot figures; empty when pyplot is not loaded."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return frozenset()
    try:
        return frozenset(number for number in pyplot.get_fignums() if isinstance(number, int))
    except Exception:  # a stand-in of the project's (a Mock, a module of its own): no figures
        return frozenset()


def close_figures(numbers: Iterable[int]) -> int:
    """Close the pyplot figures numbered ``numbers`` that are still open; return how many."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    closed = 0
    for number in sorted(numbers):
        if pyplot is not None and pyplot.fignum_exists(number):
            pyplot.close(number)
            closed += 1
    return closed


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it chains to (its cause, else its context), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _tracebacks_of(exc: BaseException | None) -> list[TracebackType]:
    return [link.__traceback__ for link in exception_chain(exc) if link.__traceback__ is not None]


def clear_exception_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame held by ``exc`` and the exceptions it chains
    to (never a suspended generator's: see :func:`clear_frames`)."""
    for tb in _tracebacks_of(exc):
        clear_frames(tb)


def release_failed_test_frames() -> bool:
    """Clear the local variables of the frames of the last failed test's traceback.

    pytest keeps the failure in ``sys.last_value``/``sys.last_traceback`` for post-mortem
    debugging (``--pdb`` has already run by the time teardown ends) until the *call* of the
    next test. Those frames hold the test's locals, so its tensors would stay on the GPU into
    the next test's setup. The traceback itself survives; only its finished frames' locals
    go. Returns whether there was a failure to release.
    """
    kept = vars(sys)
    tracebacks = _tracebacks_of(kept.get("last_value"))
    last_tb = kept.get("last_traceback")
    if last_tb is not None:
        tracebacks.append(last_tb)
    for tb in tracebacks:
        clear_frames(tb)
    return bool(tracebacks)


#: Code flags of frames that must never be cleared: clearing a suspended generator's frame
#: finalises the generator (on Python 3.11 ``frame.clear()`` closes it), which would run a
#: yield fixture's teardown in the middle of its scope. A finished generator's frame has no
#: locals left to free, so nothing is lost by skipping them all.
_GENERATOR_FLAGS = (
    inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)


def failure_kept() -> bool:
    """Whether pytest keeps a failed test in ``sys.last_value``/``sys.last_traceback`` (what
    :func:`release_failed_test_frames` releases). Read from the module's dict: after a test
    that passed they are absent, and ``getattr`` with a default pays for raising and catching
    an ``AttributeError``, more than the rest of the cleanup's checks together."""
    kept = vars(sys)
    return kept.get("last_value") is not None or kept.get("last_traceback") is not None


def clear_frames(tb: TracebackType | None) -> None:
    """Drop the local variables of every finished, non-generator frame of traceback ``tb``."""
    # traceback.clear_frames() is not enough before Python 3.13: frame.clear() drops the fast
    # locals, but a dict snapshot of them that pytest's traceback formatting made through
    # frame.f_locals keeps every local alive until the next f_locals read re-syncs it.
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_code.co_flags & _GENERATOR_FLAGS:
            try:
                frame.clear()
            except RuntimeError:  # a frame still executing (not a finished test's)
                pass
            else:
                frame.f_locals  # noqa: B018  (the read empties the stale snapshot)
        tb = tb.tb_next


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
    # isinstance() on some objects in gc's list warns (torch.distributed's deprecated
    # reduce_op proxy); looking at them is not using them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, tensor_type) and obj.is_cuda:
                    found[id(obj)] = obj
            except ReferenceError:  # a dead weakref proxy in gc's list
                continue
    return found


@contextmanager
def safe_clean_cuda(
    model: Any, device: str | torch.device = "cuda", *, min_bytes: int = MIB
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

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"safe_clean_cuda: CUDA is not available (torch {torch.__version__}); it cleans "
            "up after work on a CUDA GPU"
        )
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
