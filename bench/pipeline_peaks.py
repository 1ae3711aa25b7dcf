"""Measure the whole pipeline on a GPU: attribute()'s peak and the pruning peak after it.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/pipeline_peaks.py \
        --out $OUT/pipeline.json [--shapes TinyLlama-1.1B,Llama-3.2-1B] \
        [--tokens 300,800,1200,2000,4000] [--batch-sizes 16,64] [--max-feature-nodes 2048] \
        [--deadline 460]

For each shape of ``--shapes`` (TinyLlama-1.1B's published shape: 22 layers, d_model 2048,
d_mlp 5632, 32k vocabulary, 32 heads of 64, 4 KV heads, 32768-wide per-layer transcoders
with a skip connection; Llama-3.2-1B's, ``testing.LLAMA_3_2_1B_DIMS``; the cross-layer sets
Qwen3-1.7B-CLT and gemma-2-2b-CLT; or a bundled model's name, ``ctresources/random-qwen3-1.7b``),
random weights built offline, bf16: for each prompt length and batch size,
one ``attribute()`` (allocated peak, per phase as ``bench/attribution_peaks.py`` marks them,
wall time, and how far the process's resident host memory rose: ``HostMeter``), then
``prune_graph`` on the graph moved to the GPU as ``create_graph_files`` does it (allocated
peak, host memory, wall time), each point next to the estimator's prediction
(``estimate.pipeline``). An out-of-memory error is recorded for its point and the script
goes on; the pruning of a prompt length runs once (it does not depend on the batch size). A
point whose predicted host memory (the dense graph) is over half of the host's available
memory is not run (a host out-of-memory kill would end the run), nor one predicted over 1.3
times the card (the pruning: over 1.2 times). A pruning that torch's CUDA sort refuses (more
than INT_MAX edge scores, ``estimate.prune_blocker``) is recorded as ``"sort limit"``. A
point starts only before ``--deadline`` seconds. Prints a table and writes every record as a
JSON list to ``--out`` (after each point, so a run cut short keeps what it measured).
Without CUDA it runs one short point on the tiny model (a smoke test) and records no memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from pytest_ctresources.units import GIB


def shapes(names: list[str], cuda: bool) -> list[tuple[str, Any]]:
    from pytest_ctresources import testing

    if not cuda:
        return [("tiny-gemma-2", testing.TINY_GEMMA2_DIMS)]
    known = {
        "TinyLlama-1.1B": testing.TINYLLAMA_1_1B_DIMS,
        "Llama-3.2-1B": testing.LLAMA_3_2_1B_DIMS,
        "Qwen3-1.7B-CLT": testing.QWEN3_1_7B_CLT_DIMS,
        "gemma-2-2b-CLT": testing.GEMMA_2_2B_CLT_DIMS,
    }
    # Any other name is a bundled random model's (``ctresources/random-qwen3-1.7b``).
    return [(name, known.get(name) or testing.model_dims_of(name)) for name in names]


def host_available() -> int:
    """What auto takes as the host's available memory (the container's limit where that is
    less), in bytes; 0 where nothing can say."""
    from pytest_ctresources.estimator import auto

    found = auto.host_available()
    return found[0] if found else 0


class HostMeter:
    """This process's resident memory at its highest since :meth:`reset`, beyond what it was
    then (Linux: ``VmHWM`` and ``VmRSS`` of ``/proc/self/status``; writing 5 to
    ``/proc/self/clear_refs`` resets the high-water mark). None where that cannot be read."""

    def __init__(self) -> None:
        self.base: int | None = None

    @staticmethod
    def _kib(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def reset(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.base = None
            return
        self.base = self._kib("VmRSS")

    def grown_gib(self) -> float | None:
        high = self._kib("VmHWM")
        if self.base is None or high is None:
            return None
        return round((high - self.base) / GIB, 3)


def predicted(model: Any, tokens: int, batch: int, active: int | None, nodes: int) -> Any:
    """The estimator's pipeline for a point, from the loaded model's shapes (``active``: the
    counted active features, else the default per layer and token)."""
    from pytest_ctresources.estimator import estimate as est
    from pytest_ctresources.estimator import loaded_model

    shape, transcoders = loaded_model.shapes_of_loaded(model)
    work = est.Workload("bfloat16", batch, tokens, 0.0, nodes, counted_features=active)
    return est.pipeline(est.estimate(shape, transcoders, work))


def gib_of(pipeline: Any) -> dict[str, float]:
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
    batches = [int(b) for b in args.batch_sizes.split(",")] if cuda else [4]
    lengths = [int(t) for t in args.tokens.split(",")] if cuda else [20]
    card = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    nodes_kept = args.max_feature_nodes
    for name, dims in shapes(args.shapes.split(","), cuda):
        if time.perf_counter() - start > args.deadline:
            break
        model = testing.build_replacement_model(
            dims, dtype="bfloat16" if cuda else "float32", device=device
        )
        meter = PhaseMeter(torch, cuda)
        host_meter = HostMeter()
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
                record: dict[str, Any] = {
                    "model": name,
                    "tokens": tokens,
                    "batch": batch,
                    "max_feature_nodes": nodes_kept,
                }
                before = predicted(model, tokens, batch, None, nodes_kept)
                host = max(phase.host_bytes for phase in before.phases)
                if host > 0.5 * host_available():
                    # The dense graph on the host: a host OOM would end the whole run.
                    records.append(record | {"attribute": f"host: {host / GIB:.0f} GiB predicted"})
                    save(args, records)
                    print(
                        f"{name} {tokens} x {batch}: skipped, host {host / GIB:.0f} GiB", flush=True
                    )
                    continue
                if cuda and before.phases[0].peak_allocated_bytes > 1.3 * card:
                    records.append(record | {"attribute": "predicted over the card"})
                    save(args, records)
                    print(f"{name} {tokens} x {batch}: skipped, over the card", flush=True)
                    continue
                if cuda:
                    torch.cuda.empty_cache()
                resident = torch.cuda.memory_allocated() if cuda else 0
                record["resident_gib"] = round(resident / GIB, 3)
                meter.reset()
                host_meter.reset()
                began = time.perf_counter()
                try:
                    graph = attribute(
                        [2, *ids.tolist()], model, batch_size=batch, max_feature_nodes=nodes_kept
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
                record["attribute_host_gib"] = host_meter.grown_gib()
                record["active_features"] = int(graph.active_features.shape[0])
                record["nodes"] = int(graph.adjacency_matrix.shape[0])
                after = predicted(model, tokens, batch, record["active_features"], nodes_kept)
                record["predicted_gib"] = gib_of(after)
                record["predicted_host_gib"] = {
                    phase.name: round(phase.host_bytes / GIB, 3) for phase in after.phases
                }
                record["predicted_peak_phase"] = after.phases[0].note
                if cuda:
                    record["attribute_gib"] = round(max(m["peak"] for m in meter.marks) / GIB, 3)
                    record["phases_gib"] = [round(m["peak"] / GIB, 3) for m in meter.marks]
                if not pruned and cuda and after.phases[1].peak_allocated_bytes > 1.2 * card:
                    pruned = True
                    record["prune"] = "predicted over the card"
                elif not pruned:  # the pruning does not depend on the batch size
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
    host = HostMeter()
    host.reset()
    began = time.perf_counter()
    try:
        graph.to(device)
        masks = [tensor.cpu() for tensor in prune_graph(graph, 0.8, 0.98)]
        if cuda:
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as exc:
        oom.release(exc, model)
        return {"prune": "OOM"}
    except RuntimeError as exc:
        # torch's CUDA sort of more than INT_MAX elements: past 46,340 nodes
        # (estimate.prune_blocker), at any memory.
        if "INT_MAX" not in str(exc):
            raise
        return {"prune": "sort limit", "prune_error": str(exc).splitlines()[0]}
    finally:
        graph.to("cpu")
    del masks
    found: dict[str, Any] = {
        "prune_s": round(time.perf_counter() - began, 2),
        "prune_host_gib": host.grown_gib(),
    }
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
    parser.add_argument("--shapes", default="TinyLlama-1.1B,Llama-3.2-1B")
    parser.add_argument("--tokens", default="300,800,1200,2000,4000")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--max-feature-nodes", type=int, default=2048)
    parser.add_argument("--deadline", type=float, default=460.0, help="no point starts after")
    args = parser.parse_args()
    records = measure(args)
    save(args, records)
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
