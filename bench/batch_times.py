"""Time circuit-tracer's ``attribute()`` phase by phase against the batch size (time model data).

    python3 bench/batch_times.py \
        --models ctresources/random-gemma-2-2b,ctresources/random-llama-3.2-1b \
        --tokens 30,300 --batch-sizes 16,32,64,128,256,512 --repeats 2 --out $OUT/times.jsonl

For each bundled random-weight model of real size (bf16, on the GPU, built once), one warm-up
attribution, then for each prompt length and round, one ``attribute()`` per batch size (the
order alternates between rounds, so a drift of the GPU's clocks does not favour one end),
with ``max_feature_nodes`` from ``--max-feature-nodes``. Each call is timed per phase by
wrapping what ``circuit_tracer.attribution.attribute._run_attribution`` calls
(circuit-tracer 0.5.0), with a CUDA synchronisation around each piece:

- ``setup_s``: ``model.setup_attribution`` (the one-prompt pass, phase 0);
- ``forward_s``: ``model.run_forward_pass`` (phase 1, the forward pass on ``batch_size``
  copies); ``inputs_s``: from its end to the first backward pass (phase 2, the input vectors);
- ``logit_passes`` / ``feature_passes`` and their seconds: each ``ctx.compute_batch`` call
  (one backward pass over the whole batch-size graph, however many of its rows are filled,
  and the copy of its rows to the host), told apart by the ``retain_graph`` argument only the
  feature passes get;
- ``influence_calls`` / ``influence_s``: ``compute_partial_influences`` (the feature ranking,
  every ``update_interval`` x ``batch_size`` rows when ``max_feature_nodes`` is below the
  number of active features);
- ``rest_s``: the rest of the call (the graph's packaging on the host).

A batch size that runs out of memory is recorded and the larger ones are not tried for that
prompt length in that round. A point starts only before ``--deadline`` seconds. One JSON line
per call goes to ``--out`` as it is measured, with the model's dimensions, so the fit
(``bench/fit_times.py``) needs nothing else. Without CUDA it runs two small points on the tiny
model on the CPU (a smoke test of the instrumentation).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


class PhaseClock:
    """Seconds per phase of the attributions of one model, from wrapped calls."""

    def __init__(self, torch: Any, model: Any) -> None:
        import circuit_tracer.attribution.attribute as ct_attribute

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.reset()
        setup = model.setup_attribution
        forward = model.run_forward_pass
        influences = ct_attribute.compute_partial_influences

        def timed_setup(*args: Any, **kwargs: Any) -> Any:
            began = self.now()
            ctx = setup(*args, **kwargs)
            self.setup_end = self.now()
            self.setup_s = self.setup_end - began
            compute_batch = ctx.compute_batch

            def timed_batch(*args: Any, **kwargs: Any) -> Any:
                began = self.now()
                if self.first_pass is None:
                    self.first_pass = began
                rows = compute_batch(*args, **kwargs)
                kind = "feature" if "retain_graph" in kwargs else "logit"
                self.passes.append((kind, self.now() - began))
                return rows

            ctx.compute_batch = timed_batch
            return ctx

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            began = self.now()
            found = forward(*args, **kwargs)
            self.forward_end = self.now()
            self.forward_s = self.forward_end - began
            return found

        def timed_influences(*args: Any, **kwargs: Any) -> Any:
            began = self.now()
            found = influences(*args, **kwargs)
            self.influences.append(self.now() - began)
            return found

        model.setup_attribution = timed_setup
        model.run_forward_pass = timed_forward
        ct_attribute.compute_partial_influences = timed_influences

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def reset(self) -> None:
        self.setup_s = 0.0
        self.setup_end = 0.0
        self.forward_s = 0.0
        self.forward_end = 0.0
        self.first_pass: float | None = None
        self.passes: list[tuple[str, float]] = []
        self.influences: list[float] = []

    def record(self, total_s: float) -> dict[str, Any]:
        logit = [s for kind, s in self.passes if kind == "logit"]
        feature = [s for kind, s in self.passes if kind == "feature"]
        inputs = (self.first_pass or self.forward_end) - self.forward_end
        counted = (
            self.setup_s
            + self.forward_s
            + inputs
            + sum(logit)
            + sum(feature)
            + sum(self.influences)
        )
        return {
            "total_s": round(total_s, 4),
            "setup_s": round(self.setup_s, 4),
            "forward_s": round(self.forward_s, 4),
            "inputs_s": round(inputs, 4),
            "logit_passes": len(logit),
            "logit_s": round(sum(logit), 4),
            "feature_passes": len(feature),
            "feature_s": round(sum(feature), 4),
            "feature_pass_median_s": round(statistics.median(feature), 5) if feature else None,
            "influence_calls": len(self.influences),
            "influence_s": round(sum(self.influences), 4),
            "rest_s": round(total_s - counted, 4),
        }


def dims_record(dims: Any, model: Any) -> dict[str, Any]:
    from pytest_ctresources.estimator import loaded_model

    shape, transcoders = loaded_model.shapes_of_loaded(model)
    return {
        "n_layers": shape.n_layers,
        "d_model": shape.d_model,
        "d_mlp": shape.d_mlp,
        "n_heads": shape.n_heads,
        "n_kv_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "n_params": shape.n_params,
        "family": shape.family,
        "d_transcoder": transcoders.width,
        "cross_layer": transcoders.cross_layer,
        "skip_connection": transcoders.skip_connection,
    }


def measure(args: argparse.Namespace) -> None:
    import torch
    from circuit_tracer import attribute

    from pytest_ctresources import testing
    from pytest_ctresources.gpu import oom

    cuda = torch.cuda.is_available()
    models = args.models.split(",") if cuda else [testing.TINY_GEMMA2]
    tokens_list = parse_ints(args.tokens) if cuda else [12]
    batches = parse_ints(args.batch_sizes) if cuda else [2, 4]
    start = time.perf_counter()
    out = Path(args.out).open("a")
    for name in models:
        if time.perf_counter() - start > args.deadline:
            print(f"deadline: {name} not measured", flush=True)
            continue
        dims = testing.BUNDLED_MODELS[name]
        model = testing.build_replacement_model(
            dims, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu"
        )
        clock = PhaseClock(torch, model)
        shape = dims_record(dims, model)
        vocab = shape["vocab_size"]
        attribute([2, 5, 6, 7], model, batch_size=batches[0], max_feature_nodes=64)  # warm-up
        for tokens in tokens_list:
            ids = torch.randint(
                3, vocab, (tokens - 1,), generator=torch.Generator().manual_seed(tokens)
            ).tolist()
            for round_ in range(args.repeats):
                order = batches if round_ % 2 == 0 else batches[::-1]
                too_big: int | None = None
                for batch in order:
                    if too_big is not None and batch >= too_big:
                        continue
                    if time.perf_counter() - start > args.deadline:
                        print(f"deadline: {name} {tokens} x {batch} not measured", flush=True)
                        continue
                    record: dict[str, Any] = {
                        "model": name,
                        "tokens": tokens,
                        "batch": batch,
                        "round": round_,
                        "max_feature_nodes": args.max_feature_nodes,
                    }
                    gc.collect()
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    clock.reset()
                    began = time.perf_counter()
                    try:
                        graph = attribute(
                            [2, *ids],
                            model,
                            batch_size=batch,
                            max_feature_nodes=args.max_feature_nodes,
                        )
                    except torch.cuda.OutOfMemoryError as exc:
                        oom.release(exc, model)
                        gc.collect()
                        too_big = batch
                        record["oom"] = True
                    else:
                        if cuda:
                            torch.cuda.synchronize()
                        record |= clock.record(time.perf_counter() - began)
                        record["active_features"] = int(graph.active_features.shape[0])
                        record["oom"] = False
                        if cuda:
                            record["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
                        del graph
                    out.write(json.dumps(record | {"dims": shape}) + "\n")
                    out.flush()
                    print(json.dumps(record), flush=True)
        del model, clock
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ctresources/random-gemma-2-2b")
    parser.add_argument("--tokens", default="30,300")
    parser.add_argument("--batch-sizes", default="16,32,64,128,256,512")
    parser.add_argument("--max-feature-nodes", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=280.0, help="no point starts after")
    parser.add_argument("--out", required=True, help="JSON lines, appended")
    args = parser.parse_args()
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
