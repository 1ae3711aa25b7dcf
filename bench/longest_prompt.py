"""Measure the longest prompt whose whole pipeline runs under a capped GPU, by bisection.

    python3 bench/longest_prompt.py --model ctresources/random-gemma-2-2b --batch-size 16 \
        --capacity 40 --out $OUT/longest.jsonl

The measured side of ``ct-resources estimate --longest-prompt``. In one process, with
PyTorch's allocator capped at ``--capacity`` GiB (what ``--ct-vram-capacity`` does), it builds
the bundled random-weight model (bf16) and probes prompt lengths: a probe is one
``attribute()`` at ``--batch-size`` with ``--max-feature-nodes``, then ``prune_graph`` on the
graph moved to the GPU (what ``create_graph_files`` does); it passes when both finish without
running out of memory. The first probes bracket the length (from ``--start``, or the
estimate's own answer, downwards and upwards by 25%), then a bisection narrows the bracket to
within ``--resolution`` (default 1%) of the length. Each probe is one JSON line in ``--out``
(length, outcome, the phase that ran out of memory, seconds, what was allocated before it:
an out-of-memory error must leave nothing behind for the next probe to be fair), and the
last line is the result, with the estimate's answer for the same inputs and the active
features per layer and token the model really had. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources.units import GIB


def estimated(args: argparse.Namespace, active_per_layer_token: float) -> tuple[int, str]:
    """``ct-resources estimate --longest-prompt``'s answer and the phase that stops it."""
    from pytest_ctresources.estimator import cli
    from pytest_ctresources.estimator import estimate as est

    out = Path(args.out).with_suffix(".estimate.json")
    argv = ["--model", args.model, "--batch-size", str(args.batch_size)]
    argv += ["--active-features", f"{active_per_layer_token:.3f}"]
    argv += ["--max-feature-nodes", str(args.max_feature_nodes), "--dtype", "bfloat16"]
    # The cap holds PyTorch's allocator; the CUDA context is outside it, so the card it
    # emulates is the cap plus the context the estimate counts.
    context = est.CALIBRATION.context_bytes / GIB
    argv += ["--gpu-gib", f"{args.capacity + context:.3f}", "--longest-prompt", "--json"]
    with out.open("w") as stream:
        saved, sys.stdout = sys.stdout, stream
        try:
            cli.main(["estimate", *argv])
        finally:
            sys.stdout = saved
    found = json.loads(out.read_text())
    return int(found["longest_prompt_tokens"]), str(found.get("stopped_by_phase"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a bundled random-weight model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--capacity", type=float, default=40.0, help="GiB")
    parser.add_argument("--max-feature-nodes", type=int, default=512)
    parser.add_argument("--start", type=int, default=0, help="first probe (default: estimate)")
    parser.add_argument("--resolution", type=float, default=0.01)
    parser.add_argument("--deadline", type=float, default=240.0, help="no probe starts after")
    parser.add_argument("--out", required=True, help="JSON lines, appended")
    args = parser.parse_args()

    import torch
    from circuit_tracer import attribute
    from circuit_tracer.graph import prune_graph
    from pipeline_peaks import prune  # this directory is on sys.path as the script's

    from pytest_ctresources import testing
    from pytest_ctresources.gpu import oom
    from pytest_ctresources.gpu.allocator import CapacityCap

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    CapacityCap(args.capacity).arm(import_torch=True)
    began = time.perf_counter()
    dims = testing.BUNDLED_MODELS[args.model]
    model = testing.build_replacement_model(dims, dtype="bfloat16", device="cuda")
    out = Path(args.out).open("a")
    per_layer_token: list[float] = []

    def probe(tokens: int) -> bool:
        ids = torch.randint(
            3, dims.vocab_size, (tokens - 1,), generator=torch.Generator().manual_seed(tokens)
        ).tolist()
        gc.collect()
        torch.cuda.empty_cache()
        record: dict[str, Any] = {"model": args.model, "tokens": tokens}
        record["allocated_before_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        start = time.perf_counter()
        try:
            graph = attribute(
                [2, *ids],
                model,
                batch_size=args.batch_size,
                max_feature_nodes=args.max_feature_nodes,
            )
        except torch.cuda.OutOfMemoryError as exc:
            oom.release(exc, model)
            record["outcome"] = "OOM in attribute"
        else:
            active = int(graph.active_features.shape[0])
            per_layer_token.append(active / (dims.n_layers * (tokens - 1)))
            # pipeline_peaks.prune: as create_graph_files does it; "prune" says what stopped it
            # (OOM, or the sort limit), absent when it ran.
            failed = prune(torch, graph, "cuda", True, prune_graph, oom, model).get("prune")
            record["outcome"] = "fits" if failed is None else f"{failed} in prune"
            del graph
        gc.collect()
        torch.cuda.empty_cache()
        record["seconds"] = round(time.perf_counter() - start, 2)
        out.write(json.dumps(record) + "\n")
        out.flush()
        print(json.dumps(record), flush=True)
        return record["outcome"] == "fits"

    first = args.start or estimated(args, 16.0)[0]
    lo, hi = 0, 0  # the longest known to fit, the shortest known not to
    tokens = first
    while not (lo and hi):
        if time.perf_counter() - began > args.deadline:
            break
        if probe(tokens):
            lo = tokens
            tokens = hi - 1 if hi else int(tokens * 1.25) + 1
        else:
            hi = tokens
            tokens = max(2, int(tokens * 0.75))
            if lo:
                break
    while lo and hi and hi - lo > max(1, args.resolution * lo):
        if time.perf_counter() - began > args.deadline:
            break
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    active = sum(per_layer_token) / len(per_layer_token) if per_layer_token else 16.0
    predicted, phase = estimated(args, active)
    result = {
        "model": args.model,
        "result": True,
        "batch_size": args.batch_size,
        "capacity_gib": args.capacity,
        "max_feature_nodes": args.max_feature_nodes,
        "longest_fitting_tokens": lo,
        "shortest_failing_tokens": hi,
        "active_per_layer_token": round(active, 3),
        "estimated_longest_tokens": predicted,
        "estimated_stopped_by_phase": phase,
        "error": round(predicted / lo - 1, 4) if lo else None,
    }
    out.write(json.dumps(result) + "\n")
    out.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
