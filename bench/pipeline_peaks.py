"""Measure the whole pipeline on a GPU: attribute()'s peak and the pruning peak after it.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/pipeline_peaks.py \
        --out $OUT/pipeline.json [--quick] [--deadline 460]

For TinyLlama-1.1B's published shape (22 layers, d_model 2048, d_mlp 5632, 32k vocabulary,
32 heads of 64, 4 KV heads; 32768-wide per-layer transcoders with a skip connection) and
Llama-3.2-1B's (``testing.LLAMA_3_2_1B_DIMS``), random weights built offline, bf16,
``max_feature_nodes=2048``: for each prompt length (300, 800, 1200, 2000, 4000 tokens; 300 and
1200 with ``--quick``) and batch size (16, 64), one ``attribute()`` (allocated peak, per phase
as ``bench/attribution_peaks.py`` marks them, wall time), then ``prune_graph`` on the graph
moved to the GPU as ``create_graph_files`` does it (allocated peak above what is resident,
wall time), each point next to the estimator's prediction (``estimate.pipeline``). An
out-of-memory error is recorded for its point and the script goes on; the pruning of a
prompt length runs once (it does not depend on the batch size). A point starts only before
``--deadline`` seconds, so the script ends within about 8 minutes on an H200. Prints a table
and writes every record as a JSON list to ``--out`` (after each point, so a run cut short keeps
what it measured). Without CUDA it runs one short point on
the tiny model (a smoke test) and records no memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GIB = 1 << 30


def shapes(quick: bool, cuda: bool) -> list[tuple[str, Any, list[int]]]:
    from pytest_ctresources import testing

    if not cuda:
        return [("tiny-gemma-2", testing.TINY_GEMMA2_DIMS, [20])]
    tinyllama = dataclasses.replace(
        testing.LLAMA_3_2_1B_DIMS,
        n_layers=22,
        d_mlp=5632,
        vocab_size=32000,
        n_kv_heads=4,
        d_transcoder=32768,
        tied_embeddings=False,
    )
    tokens = [300, 1200] if quick else [300, 800, 1200, 2000, 4000]
    return [
        ("TinyLlama-1.1B", tinyllama, tokens),
        ("Llama-3.2-1B", testing.LLAMA_3_2_1B_DIMS, tokens),
    ]


def predicted(model: Any, tokens: int, batch: int, active: int) -> dict[str, float]:
    """The estimator's phases for a point, from the loaded model's shapes."""
    from pytest_ctresources.estimator import estimate as est
    from pytest_ctresources.estimator import registry

    shape, transcoders = registry.shapes_of_loaded(model)
    work = est.Workload("bfloat16", batch, tokens, 0.0, 2048, counted_features=active)
    pipeline = est.pipeline(est.estimate(shape, transcoders, work))
    return {phase.name: round(phase.peak_allocated_bytes / GIB, 3) for phase in pipeline.phases}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import gc

    import torch
    from attribution_peaks import PhaseMeter  # this directory is on sys.path as the script's
    from circuit_tracer import attribute
    from circuit_tracer.graph import prune_graph

    from pytest_ctresources import testing
    from pytest_ctresources.gpu import oom

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    batches = [16, 64] if cuda else [4]
    for name, dims, lengths in shapes(args.quick, cuda):
        if time.perf_counter() - start > args.deadline:
            break
        model = testing.build_replacement_model(
            dims, dtype="bfloat16" if cuda else "float32", device=device
        )
        meter = PhaseMeter(torch, cuda)
        meter.wrap(model, "setup_attribution")
        meter.wrap(model, "run_forward_pass")
        for tokens in lengths:
            pruned = False
            for batch in batches:
                if time.perf_counter() - start > args.deadline:
                    print(
                        f"deadline: {name} {tokens} tokens batch {batch} not measured", flush=True
                    )
                    continue
                ids = torch.randint(
                    3,
                    dims.vocab_size,
                    (tokens - 1,),
                    generator=torch.Generator().manual_seed(tokens),
                )
                record: dict[str, Any] = {"model": name, "tokens": tokens, "batch": batch}
                if cuda:
                    torch.cuda.empty_cache()
                resident = torch.cuda.memory_allocated() if cuda else 0
                record["resident_gib"] = round(resident / GIB, 3)
                meter.reset()
                began = time.perf_counter()
                try:
                    graph = attribute(
                        [2, *ids.tolist()], model, batch_size=batch, max_feature_nodes=2048
                    )
                except torch.cuda.OutOfMemoryError as exc:
                    oom.release(exc, model)
                    gc.collect()
                    records.append(record | {"attribute": "OOM"})
                    save(args, records)
                    print(f"{name} {tokens} tokens batch {batch}: attribute OOM", flush=True)
                    continue
                meter.mark()
                record["attribute_s"] = round(time.perf_counter() - began, 2)
                record["active_features"] = int(graph.active_features.shape[0])
                record["nodes"] = int(graph.adjacency_matrix.shape[0])
                record["predicted_gib"] = predicted(model, tokens, batch, record["active_features"])
                if cuda:
                    record["attribute_gib"] = round(max(m["peak"] for m in meter.marks) / GIB, 3)
                    record["phases_gib"] = [round(m["peak"] / GIB, 3) for m in meter.marks]
                if not pruned:  # the pruning does not depend on the batch size
                    pruned = True
                    record |= prune(torch, graph, device, cuda, prune_graph, oom, model)
                del graph
                gc.collect()
                records.append(record)
                save(args, records)  # a run cut short keeps what it measured
                print(json.dumps(record), flush=True)
        del model, meter
        gc.collect()
    return records


def save(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")


def prune(
    torch: Any, graph: Any, device: str, cuda: bool, prune_graph: Any, oom: Any, model: Any
) -> dict[str, Any]:
    """``create_graph_files``'s pruning: the graph to the GPU, ``prune_graph``, back."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    try:
        graph.to(device)
        masks = [tensor.cpu() for tensor in prune_graph(graph, 0.8, 0.98)]
        if cuda:
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as exc:
        oom.release(exc, model)
        return {"prune": "OOM"}
    finally:
        graph.to("cpu")
    del masks
    found: dict[str, Any] = {"prune_s": round(time.perf_counter() - began, 2)}
    if cuda:
        found["prune_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return found


def print_table(records: list[dict[str, Any]]) -> None:
    print("\nmodel            tokens batch  attribute GiB (pred)   s     prune GiB (pred)     s")
    for r in records:
        pred = r.get("predicted_gib", {})
        attribute = r.get("attribute_gib", r.get("attribute", "-"))
        pruned = r.get("prune_gib", r.get("prune", "-"))
        print(
            f"{r['model']:16} {r['tokens']:6} {r['batch']:5}  {attribute!s:>8} "
            f"({pred.get('attribute', '-')!s:>7}) {r.get('attribute_s', '-')!s:>6}  "
            f"{pruned!s:>8} ({pred.get('prune', '-')!s:>7}) {r.get('prune_s', '-')!s:>6}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file of the records")
    parser.add_argument("--quick", action="store_true", help="300 and 1200 tokens only")
    parser.add_argument("--deadline", type=float, default=460.0, help="no point starts after")
    args = parser.parse_args()
    records = measure(args)
    save(args, records)
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
