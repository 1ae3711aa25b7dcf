"""nnsight intervention threads an exception left blocked forever, and freeing them.

nnsight (0.6.x) runs every ``tracer.invoke()`` body in a daemon thread (``Mediator<id>``)
that talks to the model's forward pass through two one-slot queues. When the forward pass
raises (``torch.cuda.OutOfMemoryError`` inside ``circuit_tracer.attribute``) while a mediator
is parked at a ``tracer.barrier()`` as its first participant (circuit-tracer's
``AttributionContext.cache_residual`` does that for every layer), ``Envoy.interleave``'s
``finally`` calls ``Interleaver.cancel()`` -> ``Mediator.cancel()``, which only wakes a
mediator whose event is still pending (``event_queue.has_value``). The barrier event was
already consumed, so the mediator is dropped while its thread stays blocked in
``Mediator.send`` -> ``response_queue.wait()`` for good, and its frames keep the invoke's
locals alive: on an H200, 9.6-10.2 GiB beyond the model after an OOM (gemma-2-2b, batch 512,
100 tokens; bench/oom_residue.py, docs/benchmarks.md). No garbage collection frees a
blocked thread's frames, so ``ct_session``'s halving retry would run with that much less.

:func:`release_nnsight_threads` finds such orphaned threads and hands them the same
``Cancelation`` that ``Mediator.cancel`` gives a mediator it does wake: the blocked ``send``
raises it, the invoke body's generated ``except Exception`` reports it through
``mediator.exception`` (which does not wait) and the thread returns. It relies on nnsight
internals (``Mediator.response_queue``/``event_queue``, ``Cancelation``), so callers go
through :func:`release_quietly`, which treats any surprise as "nothing released".
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

_INTERLEAVER_MODULE = "nnsight.intervention.interleaver"


def _orphans(mediator_type: Any, interleaver: Any) -> list[tuple[threading.Thread, Any]]:
    """(thread, mediator) for each live mediator thread that nnsight has already cancelled."""
    current = threading.current_thread()
    found: list[tuple[threading.Thread, Any]] = []
    for thread in threading.enumerate():
        if thread is current or not thread.is_alive():
            continue
        mediator = _mediator_of(thread, mediator_type)
        if (
            mediator is not None
            # A mediator still in use keeps its thread as ``worker``; Mediator.cancel sets None.
            and mediator.worker is not thread
            and (interleaver is None or mediator.interleaver is interleaver)
            and _parked_in_send(thread, mediator_type)
        ):
            found.append((thread, mediator))
    return found


def _mediator_of(thread: threading.Thread, mediator_type: type) -> Any:
    """The mediator ``thread`` runs, or None: CPython's ``Thread.run()`` keeps the target's
    arguments, (mediator, info, ...), as ``_args`` until it returns, so a blocked mediator
    thread still has them."""
    args = getattr(thread, "_args", None)
    mediator = args[0] if isinstance(args, tuple) and args else None
    return mediator if isinstance(mediator, mediator_type) else None


def _parked_in_send(thread: threading.Thread, mediator_type: type) -> bool:
    """True when ``thread`` waits in ``Mediator.send`` for a response (its innermost Python
    frame is ``Mediator.Value.wait``, called from ``send``): not one about to finish, and
    not one that ``Mediator.cancel`` on another thread is answering right now."""
    frame = sys._current_frames().get(thread.ident or -1)
    send = getattr(mediator_type, "send", None)
    wait = getattr(getattr(mediator_type, "Value", None), "wait", None)
    return (
        frame is not None
        and frame.f_code is getattr(wait, "__code__", None)
        and frame.f_back is not None
        and frame.f_back.f_code is getattr(send, "__code__", None)
    )


def release_nnsight_threads(model: Any = None, *, timeout: float = 1.0) -> int:
    """Wake and finish nnsight mediator threads left blocked by an aborted trace.

    Call it after catching an exception from an nnsight trace (e.g. an OOM inside
    ``circuit_tracer.attribute``), then ``gc.collect()``: the tensors the threads' frames
    held become collectable. Harmless when nothing is stuck; a no-op (and imports nothing)
    when nnsight is not loaded. Traces running in other threads are left alone: only a
    mediator that nnsight has already cancelled (``mediator.worker`` no longer its thread)
    and whose thread waits in ``Mediator.send`` for an answer nobody will give is touched.

    Args:
        model: An nnsight ``Envoy``/``NNsight`` model (e.g. circuit-tracer's
            ``NNSightReplacementModel``): only release mediators of its interleaver.
            ``None``: release those of every model.
        timeout: Seconds to wait for the woken threads to finish.

    Returns:
        How many threads finished.
    """
    module = sys.modules.get(_INTERLEAVER_MODULE)
    mediator_type = getattr(module, "Mediator", None)
    cancelation_type = getattr(module, "Cancelation", None)
    if mediator_type is None or cancelation_type is None:
        return 0
    interleaver = getattr(model, "_interleaver", None) if model is not None else None
    if model is not None and interleaver is None:
        return 0

    woken = []
    for thread, mediator in _orphans(mediator_type, interleaver):
        response, events = mediator.response_queue, mediator.event_queue
        # Blocked in Mediator.send: its response slot is empty and locked.
        if response.has_value or not response.lock.locked():
            continue
        # The woken thread reports the Cancelation through event_queue.put(), which
        # releases that lock: it must be held (its last event was taken), else skip.
        if events.has_value or not events.lock.locked():
            continue
        cancel = cancelation_type()
        response.put(cancel)
        woken.append((thread, mediator, cancel))
    deadline = time.monotonic() + timeout
    released = 0
    for thread, mediator, cancel in woken:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():  # an invoke body that caught the Cancelation and went on
            continue
        released += 1
        # Drop what the finished thread reported: (EXCEPTION, cancel), whose traceback
        # holds the thread's frames and so the invoke's locals.
        cancel.__traceback__ = None
        if mediator.event_queue.has_value:
            mediator.event_queue.get()
    return released


def may_hold_threads() -> bool:
    """Whether :func:`release_nnsight_threads` could find a thread to release: nnsight's
    interleaver is loaded and a thread running a mediator is alive. A few look-ups and one
    pass over the process's threads, so that the cleanup after a test that ran no trace
    (in a suite that imported nnsight) stays cheap."""
    module = sys.modules.get(_INTERLEAVER_MODULE)
    mediator_type = getattr(module, "Mediator", None)
    if not isinstance(mediator_type, type):
        return False  # no nnsight, or one whose threads release_nnsight_threads cannot see
    return any(_mediator_of(thread, mediator_type) is not None for thread in threading.enumerate())


def release_quietly(model: Any = None) -> int:
    """:func:`release_nnsight_threads`, with an nnsight whose internals changed counting as
    nothing released rather than failing the cleanup it is part of."""
    try:
        return release_nnsight_threads(model)
    except Exception:  # an nnsight release this code does not know: leave its threads be
        return 0
