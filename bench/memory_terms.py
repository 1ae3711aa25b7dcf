"""Count every tensor storage alive during ``attribute()`` on the CPU, phase by phase.

    python bench/memory_terms.py                      # all four architectures, bf16 and fp32
    python bench/memory_terms.py --architectures qwen3 --dtypes bfloat16

How the estimator's terms were derived (``pytest_ctresources/estimator/estimate.py``): the forward
pass's kept tensors, its peak and the KV cache are functions of the model's dimensions that
circuit-tracer's and transformers' code fixes; this script measures them exactly at small
dimensions, without a GPU, and prints them per batch-token next to the estimator's formula
(:func:`~pytest_ctresources.estimator.estimate.kept_per_batch_token`,
:func:`~pytest_ctresources.estimator.estimate.forward_peak_per_batch_token`). Changing one dimension
at a time (``--vary``) shows which dimension each term scales with.

The counting: a ``TorchDispatchMode`` sees every operation's outputs; a storage that none of
the operation's inputs shares is new, and is counted until it is freed (a weak reference
to the C++ storage expires). The mode is entered in every thread the call starts, because
nnsight runs the intervention code (circuit-tracer's caching of the transcoders' inputs and
outputs) in a thread of its own: PyTorch's profiler, which records allocations of the
profiling thread only, misses those. What existed before the call (the weights) is not
counted. Per batch-token figures are differences between batch sizes 4 and 8, which cancel
everything that does not grow with the batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Small dimensions every architecture builds at; vocabulary large enough that the logits,
#: not the last MLP, are the forward pass's peak (as in every real model).
BASE: dict[str, Any] = {
    "n_layers": 2,
    "d_model": 64,
    "d_mlp": 256,
    "vocab_size": 4096,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "d_transcoder": 512,
}


class Ledger:
    """The storages alive now, their bytes, and the peak since :meth:`reset_peak`."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.lock = threading.RLock()
        self.live: dict[int, tuple[Any, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def add(self, outputs: Any, inputs: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        with self.lock:
            self._sweep()
            known = {
                t.untyped_storage()._cdata
                for t in tree_flatten(inputs)[0]
                if isinstance(t, torch.Tensor) and t.layout == torch.strided
            }
            for tensor in tree_flatten(outputs)[0]:
                if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                    continue
                if tensor.device.type != "cpu":
                    continue
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self.live or key in known:
                    continue  # a view, or an in-place result
                self.live[key] = (self._weak(storage), storage.nbytes())
                self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)

    def now(self) -> int:
        with self.lock:
            self._sweep()
            return self.current

    def reset_peak(self) -> None:
        with self.lock:
            self._sweep()
            self.peak = self.current


@contextmanager
def counting() -> Iterator[Ledger]:
    """Count the storages every thread creates within the block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ledger = Ledger()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            ledger.add(out, (args, kwargs))
            return out

    run = threading.Thread.run

    def counted_run(thread: threading.Thread) -> None:
        with Mode():
            run(thread)

    threading.Thread.run = counted_run  # type: ignore[method-assign]
    try:
        with Mode():
            yield ledger
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]


def phases(model: Any, prompt: list[int], batch: int, nodes: int = 16) -> dict[str, int]:
    """Bytes alive after, and at the peak of, each phase of one ``attribute()`` call,
    counted from the call's start (the weights are not counted)."""
    from circuit_tracer import attribute

    marks: dict[str, int] = {}
    setup, forward = model.setup_attribution, model.run_forward_pass
    with counting() as ledger:

        def timed(name: str, function: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                ledger.reset_peak()
                result = function(*args, **kwargs)
                marks[f"{name}_peak"] = ledger.peak
                marks[f"{name}_after"] = ledger.now()
                ledger.reset_peak()
                return result

            return wrapped

        model.setup_attribution = timed("setup", setup)
        model.run_forward_pass = timed("forward", forward)
        try:
            graph = attribute(prompt, model, batch_size=batch, max_feature_nodes=nodes)
        finally:
            del model.setup_attribution, model.run_forward_pass
        marks["backward_peak"] = ledger.peak
    marks["active_features"] = int(graph.active_features.shape[0])
    return marks


def per_batch_token(dims: Any, dtype: str, tokens: int = 8) -> dict[str, float]:
    """Kept and forward-peak bytes per batch-token of a model of ``dims``, counted (the
    difference between batch sizes 4 and 8) and as the estimator predicts them."""
    from pytest_ctresources import testing
    from pytest_ctresources.estimator import estimate as est
    from pytest_ctresources.estimator import loaded_model

    model = testing.build_replacement_model(dims, device="cpu", dtype=dtype)
    prompt = [2, *range(10, 10 + tokens - 1)]
    small, large = phases(model, prompt, 4), phases(model, prompt, 8)
    batch_tokens = 4 * tokens
    kept = (large["forward_after"] - small["forward_after"]) / batch_tokens
    peak = (
        large["forward_peak"] - large["setup_after"] - small["forward_peak"] + small["setup_after"]
    ) / batch_tokens
    shape, transcoders = loaded_model.shapes_of_loaded(model)
    b = est.DTYPE_BYTES[dtype]  # type: ignore[index]
    return {
        "kept": kept,
        "kept_estimated": est.kept_per_batch_token(shape, transcoders, b, tokens),
        "forward_peak": peak,
        "forward_peak_estimated": est.forward_peak_per_batch_token(shape, transcoders, b, tokens),
    }


def main() -> int:
    from pytest_ctresources import testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architectures", default="gemma2,gemma3,llama,qwen3")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument(
        "--vary",
        default="{}",
        help='JSON list of dimension changes, e.g. [{"d_model": 128}, {"n_layers": 4}]',
    )
    parser.add_argument("--cross-layer", action="store_true", help="one CLT, not per-layer")
    args = parser.parse_args()
    changes = json.loads(args.vary) if args.vary != "{}" else [{}]
    print(
        "architecture dtype     change                      kept/bt  (estimated)  "
        "forward peak/bt  (estimated)"
    )
    for arch in args.architectures.split(","):
        for dtype in args.dtypes.split(","):
            for change in changes:
                dims = testing.ModelDims(
                    **(BASE | change), architecture=arch, cross_layer=args.cross_layer
                )
                row = per_batch_token(dims, dtype)
                print(
                    f"{arch:12} {dtype:9} {json.dumps(change):26} {row['kept']:8.0f}  "
                    f"({row['kept_estimated']:8.0f})  {row['forward_peak']:14.0f}  "
                    f"({row['forward_peak_estimated']:8.0f})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
