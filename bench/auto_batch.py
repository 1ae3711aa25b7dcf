"""``--ct-batch-size auto`` against hand-picked batch sizes, under a capped GPU.

    python bench/auto_batch.py --capacity 24 --out auto_batch.jsonl

For each configuration (a random-weight model of real size, a dtype and a prompt length),
in its own child process, the script caps PyTorch's allocator at ``--capacity`` GiB (what
``--ct-vram-capacity`` does), builds the model, runs one small warm-up attribution, then:

1. one ``CtSession.attribute`` with ``batch_size="auto"`` (recording the choice and its
   reason, the time including the choice, the peak, or OOM);
2. ``circuit_tracer.attribute`` at each batch size of ``--batch-sizes`` in increasing order,
   until the first that runs out of memory (the larger ones would too).

Auto runs before any out-of-memory error because such an error inside circuit-tracer can
leave memory allocated in the process (seen on the H200: about 8 GiB after three OOMs),
which would shrink what later runs have; for the same reason each configuration gets a
fresh process. It prints one line per run and, per configuration, auto's time over the
fastest manual batch size that fitted. One JSON object per run goes to ``--out``. Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources import oom

#: (bundled model, dtype, prompt tokens): the measured architectures that fit 24 GiB.
CONFIGS: list[tuple[str, str, int]] = [
    ("ctresources/random-gemma-2-2b", "bfloat16", 25),
    ("ctresources/random-gemma-2-2b", "bfloat16", 100),
    ("ctresources/random-gemma-2-2b", "float32", 25),
    ("ctresources/random-gemma-3-4b", "bfloat16", 40),
    ("ctresources/random-llama-3.2-1b", "bfloat16", 40),
]


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=24.0, help="GiB (default 24)")
    parser.add_argument("--batch-sizes", default="16,32,64,128,256,512")
    parser.add_argument("--max-feature-nodes", type=int, default=4096)
    parser.add_argument("--only", default="", help="comma-separated config indices")
    parser.add_argument("--out", default="auto_batch.jsonl")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args)
    wanted = [int(i) for i in args.only.split(",") if i] or list(range(len(CONFIGS)))
    status = 0
    for index in wanted:
        argv = [sys.executable, __file__, "--child", str(index), "--capacity", str(args.capacity)]
        argv += ["--batch-sizes", args.batch_sizes, "--out", str(Path(args.out).resolve())]
        argv += ["--max-feature-nodes", str(args.max_feature_nodes)]
        status |= subprocess.run(argv, check=False).returncode
    return status


def child(args: argparse.Namespace) -> int:
    import torch

    from pytest_ctresources.allocator import CapacityCap

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    CapacityCap(args.capacity).arm(import_torch=True)
    with Path(args.out).open("a") as out:
        run_config(CONFIGS[args.child], args, out)
    return 0


def free_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def timed(call: Any) -> dict[str, Any]:
    """Run ``call()`` from a clean allocator: its time and peak, or OOM (memory freed)."""
    import torch

    free_memory()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        call()
    except torch.cuda.OutOfMemoryError as exc:
        # The failed call's frames hold its activations until they are cleared.
        oom.release(exc)
        failed = True
    else:
        failed = False
    if failed:
        free_memory()
        return {"oom": True}
    torch.cuda.synchronize()
    return {
        "oom": False,
        "seconds": round(time.perf_counter() - start, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
    }


def attribution(model: Any, prompt: list[int], batch: int, nodes: int) -> dict[str, Any]:
    from circuit_tracer import attribute

    return timed(lambda: attribute(prompt, model, batch_size=batch, max_feature_nodes=nodes))


def auto_attribution(
    model: Any, prompt: list[int], model_name: str, dtype: str, args: argparse.Namespace
) -> dict[str, Any]:
    from pytest_ctresources.autobatch import DEFAULT_AUTO_MARGIN, Budget
    from pytest_ctresources.config import CircuitTracerConfig
    from pytest_ctresources.session import CtSession

    cfg = CircuitTracerConfig.defaults().layered(
        {
            "model_name": model_name,
            "transcoder_set": "ctresources/random-jumprelu",
            "dtype": dtype,
            "batch_size": "auto",
            "max_feature_nodes": args.max_feature_nodes,
        },
        CircuitTracerConfig.defaults().source_of("dtype"),
    )
    # As the plugin builds it for --ct-vram-capacity: a cap on the allocator, default margin.
    budget = Budget(args.capacity, "--capacity", DEFAULT_AUTO_MARGIN, emulated=True)
    session = CtSession(cfg, oom_retry=False, auto_budget=budget)
    result = timed(lambda: session.attribute(prompt, model))
    choice = session.auto_choices[-1] if session.auto_choices else None
    if choice is not None:
        result["choice"] = choice.describe()
        result["batch_size"] = choice.batch_size
        if choice.predicted_gib is not None:
            result["predicted_gib"] = round(choice.predicted_gib, 2)
    return result


def run_config(config: tuple[str, str, int], args: argparse.Namespace, out: Any) -> None:
    import torch

    from pytest_ctresources import testing

    model_name, dtype, tokens = config
    torch.cuda.empty_cache()
    model = testing.build_named_model(
        model_name, testing.RANDOM_TRANSCODERS, dtype=dtype, device="cuda"
    )
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, model.cfg.d_vocab, (tokens - 1,), generator=generator).tolist()
    prompt = [2, *ids]
    base = {"model": model_name, "dtype": dtype, "prompt_tokens": tokens, "capacity": args.capacity}
    # Warm-up (kernels, cuBLAS handles), not recorded.
    attribution(model, prompt, 16, 64)

    def emit(record: dict[str, Any]) -> None:
        out.write(json.dumps(base | record) + "\n")
        out.flush()
        what = f"batch {record['batch_size']}" if record["kind"] == "manual" else "auto"
        result = (
            "OOM"
            if record["oom"]
            else f"{record['seconds']:.2f} s, {record['peak_reserved_gib']} GiB"
        )
        extra = f"  [{record['choice']}]" if record.get("choice") else ""
        print(f"{model_name} {dtype} {tokens} tokens, {what}: {result}{extra}", flush=True)

    auto = auto_attribution(model, prompt, model_name, dtype, args)
    emit({"kind": "auto"} | auto)
    manual: dict[int, float] = {}
    for batch in parse_ints(args.batch_sizes):
        record = attribution(model, prompt, batch, args.max_feature_nodes)
        emit({"kind": "manual", "batch_size": batch} | record)
        if record["oom"]:
            break
        manual[batch] = record["seconds"]
    if manual and not auto["oom"]:
        fastest = min(manual, key=manual.__getitem__)
        ratio = auto["seconds"] / manual[fastest]
        print(
            f"  -> auto {auto['seconds']:.2f} s at batch {auto['batch_size']} vs fastest "
            f"manual {manual[fastest]:.2f} s at batch {fastest}: ratio {ratio:.3f}",
            flush=True,
        )
        summary = {"kind": "summary", "ratio": round(ratio, 3), "fastest_manual": fastest}
        out.write(json.dumps(base | summary | {"auto_batch_size": auto["batch_size"]}) + "\n")
    del model
    free_memory()


if __name__ == "__main__":
    sys.exit(main())
