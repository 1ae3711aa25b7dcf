"""What stays allocated after a CUDA out-of-memory error inside circuit-tracer, and who holds it.

    python bench/oom_residue.py --capacity 24 --batch-size 512 [--model NAME] [--dtype D]

A diagnostic, not a benchmark. It caps the allocator at ``--capacity`` GiB, builds a bundled
random-weight model of real size, runs one attribution that fits (the baseline), then
``--repeats`` attributions at ``--batch-size`` that run out of memory. After each failure it
does what ``ct_session`` does (``oom.release`` on the exception, ``gc.collect``,
``empty_cache``) and prints what is still allocated beyond the model. For the CUDA tensors
still alive that are not the model's parameters or buffers it prints their shapes and, for
the largest, the chain of objects referring to them (types, three levels), plus the Python
threads alive and where each is waiting: a thread blocked inside nnsight keeps its frames'
tensors alive, and no garbage collection frees them. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources.units import GIB


def describe(obj: Any) -> str:
    kind = type(obj).__name__
    if kind == "frame":
        return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
    if kind == "function":
        return f"function {obj.__qualname__}"
    if kind == "cell":
        return "cell"
    if isinstance(obj, dict):
        keys = list(obj)[:6]
        return f"dict keys {keys}"
    return f"{type(obj).__module__}.{kind}"


def referrer_chain(obj: Any, depth: int, seen: set[int], ignore: set[int], indent: str) -> None:
    if depth == 0:
        return
    for ref in gc.get_referrers(obj):
        if id(ref) in ignore or id(ref) in seen:
            continue
        seen.add(id(ref))
        print(f"{indent}<- {describe(ref)}")
        referrer_chain(ref, depth - 1, seen, ignore, indent + "   ")


def residue(model: Any, ignore: set[int]) -> None:
    import torch

    owned = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    for transcoder_tensor in model.transcoders.state_dict().values():
        owned.add(transcoder_tensor.data_ptr())
    alive = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.data_ptr() not in owned:
                alive.append(obj)
        except Exception:  # some objects refuse isinstance checks
            continue
    alive.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    total = sum(t.numel() * t.element_size() for t in alive)
    print(f"  live CUDA tensors outside the model: {len(alive)}, {total / GIB:.2f} GiB")
    for tensor in alive[:8]:
        size = tensor.numel() * tensor.element_size() / GIB
        print(f"    {tuple(tensor.shape)} {tensor.dtype} {size:.3f} GiB")
    if alive:
        print("  who holds the largest:")
        frame_ids = {id(sys._getframe())}
        referrer_chain(alive[0], 3, set(), ignore | frame_ids | {id(alive)}, "    ")
    del alive
    for thread in threading.enumerate():
        if thread is threading.main_thread():
            continue
        frame = sys._current_frames().get(thread.ident or -1)
        where = traceback.format_stack(frame)[-3:] if frame is not None else ["?"]
        print(f"  thread {thread.name} (daemon={thread.daemon}) at:")
        print("".join(where).rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=24.0)
    parser.add_argument("--model", default="ctresources/random-gemma-2-2b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    args = parser.parse_args()

    import torch
    from circuit_tracer import attribute

    from pytest_ctresources import testing
    from pytest_ctresources.gpu import oom
    from pytest_ctresources.gpu.allocator import CapacityCap

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    CapacityCap(args.capacity).arm(import_torch=True)
    model = testing.build_named_model(
        args.model, testing.RANDOM_TRANSCODERS, dtype=args.dtype, device="cuda"
    )
    ids = torch.randint(3, model.cfg.d_vocab, (args.prompt_tokens - 1,)).tolist()
    prompt = [2, *ids]

    def settle() -> float:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated() / GIB

    resident = settle()
    attribute(prompt, model, batch_size=16, max_feature_nodes=256, verbose=False)
    print(
        f"resident (model and transcoders): {resident:.2f} GiB; "
        f"after one attribution that fits: {settle():.2f} GiB"
    )
    print(f"threads before any OOM: {[t.name for t in threading.enumerate()]}")
    for attempt in range(1, args.repeats + 1):
        try:
            attribute(prompt, model, batch_size=args.batch_size, verbose=False)
        except torch.cuda.OutOfMemoryError as exc:
            oom.release(exc)
            del exc
            after = settle()
            print(
                f"OOM {attempt} at batch {args.batch_size}: {after:.2f} GiB allocated "
                f"({after - resident:+.2f} GiB beyond the model)"
            )
            residue(model, {id(locals())})
        else:
            print(f"attempt {attempt} at batch {args.batch_size} did not run out of memory")
    attribute(prompt, model, batch_size=16, max_feature_nodes=256, verbose=False)
    print(f"after one more attribution that fits: {settle():.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
