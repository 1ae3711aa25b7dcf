"""Measure the CUDA memory of circuit-tracer attribution, phase by phase, over a grid.

    python bench/attribution_peaks.py --model ctresources/random-gemma-2-2b \
        --dtypes bfloat16,float32 --batch-sizes 32,64,128,256 --prompt-tokens 8,25,100 \
        --out peaks.jsonl

``--model`` takes a comma-separated list of bundled names (``testing.BUNDLED_MODELS``); each
model is built, measured over the grid and freed before the next. ``--plan FILE`` measures a
JSON list of ``{"split": "fit"|"validation", "model": NAME, "dtype": DTYPE, "points":
[[prompt_tokens, batch_size], ...]}`` instead (``bench/plan-2026-12-01.json``), in order, each
record tagged with its split; ``--deadline S`` starts no new model after S seconds, so a run
under a time limit keeps whole models. Each record carries the estimator's prediction for its
point (``predicted_bytes``, from the code measured), and the run ends with a table of the errors.

Calibration data for the VRAM estimator (docs/calibration). For each dtype the bundled random-weight
model is built once on the GPU; for each (batch size, prompt length) point one
``circuit_tracer.attribute`` runs on a prompt of random token ids (first id 2, BOS), and the
script records, as one JSON line per point (written as it goes, so a run cut short keeps
what it measured):

- ``resident_bytes``: allocated before the call (model and transcoders);
- per phase, the allocated bytes after it and the allocated peak during it, measured by
  wrapping the model's ``setup_attribution`` (phase 0) and ``run_forward_pass`` (phase 1); the
  rest of the call (logit and feature attribution: the backward passes) is phase 2;
- the call's peak allocated and reserved, the number of active features, logit targets and
  the wall time;
- ``gpu_busy``: the mean of NVML's GPU utilisation (the share of time a kernel was running),
  sampled every 50 ms during the call, when nvidia-ml-py is installed;
- ``dims``, ``n_model_params`` and ``n_transcoder_params`` of the model, so an estimate can
  be checked against the point without the registry.

Without CUDA it runs on the CPU with the tiny model and records no memory (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


class PhaseMeter:
    """Allocated bytes after, and peak during, the phases of one attribution."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch = torch
        self.cuda = cuda
        self.marks: list[dict[str, int]] = []

    def reset(self) -> None:
        self.marks = []
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def mark(self) -> None:
        if not self.cuda:
            return
        self.torch.cuda.synchronize()
        cuda = self.torch.cuda
        self.marks.append({"after": cuda.memory_allocated(), "peak": cuda.max_memory_allocated()})
        cuda.reset_peak_memory_stats()

    def wrap(self, obj: Any, name: str) -> None:
        original = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.mark()
            return result

        setattr(obj, name, wrapped)


class BusySampler:
    """Mean NVML GPU utilisation of device 0 over a block, sampled in a thread."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            self._handle: Any = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml: Any = pynvml
        except Exception:  # no NVML, no GPU, or a UUID in CUDA_VISIBLE_DEVICES: no samples
            self._nvml = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            self.samples.append(int(rates.gpu))

    def __enter__(self) -> BusySampler:
        self.samples = []
        self._stop.clear()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def plan_of(args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    """The (model, dtype, points) entries to measure: ``--plan``'s, or the grid's."""
    from pytest_ctresources import testing

    if args.plan and cuda:
        entries: list[dict[str, Any]] = json.loads(Path(args.plan).read_text())
        return entries
    names = args.model.split(",") if cuda else [testing.TINY_GEMMA2]
    points = [
        [tokens, batch]
        for tokens in parse_ints(args.prompt_tokens)
        for batch in parse_ints(args.batch_sizes)
    ]
    return [
        {"split": args.split, "model": name, "dtype": dtype, "points": points}
        for name in names
        for dtype in args.dtypes.split(",")
    ]


def measure(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    busy = BusySampler()
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    with Path(args.out).open("a") as handle:
        for entry in plan_of(args, cuda):
            if args.deadline and time.perf_counter() - start > args.deadline:
                print(f"deadline: {entry['model']} {entry['dtype']} not measured", flush=True)
                continue
            records += measure_model(entry, args, handle, busy, cuda)
    print_errors(records)
    return 0


def predicted_bytes(record: dict[str, Any]) -> int:
    """The shipped estimator's allocated peak for a measured point, as ``auto`` makes it: the
    model's shapes, the prompt length, the batch size and the counted active features."""
    from pytest_ctresources import testing
    from pytest_ctresources.estimator import estimate as est
    from pytest_ctresources.estimator import registry

    model = registry.model_shape(record["model"])
    transcoders = registry.transcoder_info(testing.RANDOM_TRANSCODERS, record["model"]).shape
    tokens = record["prompt_tokens"]
    workload = est.Workload(
        dtype=record["dtype"],
        batch_size=record["batch_size"],
        prompt_tokens=tokens,
        active_per_layer_token=0.0,
        max_feature_nodes=record["max_feature_nodes"],
        n_logits=record["logit_targets"],
        counted_features=record["active_features"],
    )
    return est.estimate(model, transcoders, workload).peak_allocated_bytes


def print_errors(records: list[dict[str, Any]]) -> None:
    rows = [r for r in records if r.get("peak_allocated_bytes") and r.get("predicted_bytes")]
    if not rows:
        return
    print("\nsplit      model                       dtype  tok batch  measured predicted  error")
    for r in rows:
        error = r["predicted_bytes"] / r["peak_allocated_bytes"] - 1
        print(
            f"{r['split']:10} {r['model'].removeprefix('ctresources/'):27} {r['dtype'][:5]:5} "
            f"{r['prompt_tokens']:4} {r['batch_size']:5} {r['peak_allocated_bytes'] / 2**30:9.2f} "
            f"{r['predicted_bytes'] / 2**30:9.2f} {100 * error:+6.2f}%",
            flush=True,
        )


def measure_model(
    entry: dict[str, Any],
    args: argparse.Namespace,
    handle: Any,
    busy: BusySampler,
    cuda: bool,
) -> list[dict[str, Any]]:
    """Build one model and measure every (prompt length, batch size) point of ``entry``."""
    import gc

    import torch
    from circuit_tracer import attribute

    from pytest_ctresources import testing

    model_name, dtype = entry["model"], entry["dtype"]
    dims = testing.model_dims_of(model_name)
    measured: list[dict[str, Any]] = []
    if cuda:
        torch.cuda.empty_cache()
    model = testing.build_named_model(
        model_name, testing.RANDOM_TRANSCODERS, dtype=dtype, device="cuda" if cuda else "cpu"
    )
    meter = PhaseMeter(torch, cuda)
    meter.wrap(model, "setup_attribution")
    meter.wrap(model, "run_forward_pass")
    vocab = model.cfg.d_vocab
    for tokens, batch in entry["points"]:
        generator = torch.Generator().manual_seed(tokens)
        ids = torch.randint(3, vocab, (tokens - 1,), generator=generator).tolist()
        prompt = [2, *ids]
        if cuda:
            torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated() if cuda else 0
        meter.reset()
        start = time.perf_counter()
        record: dict[str, Any] = {
            "split": entry.get("split", args.split),
            "model": model_name,
            "dtype": dtype,
            "batch_size": batch,
            "prompt_tokens": tokens,
            "max_feature_nodes": args.max_feature_nodes,
            "resident_bytes": resident,
            "dims": dataclasses.asdict(dims),
            "n_model_params": dims.n_model_params,
            "n_transcoder_params": dims.n_transcoder_params,
        }
        try:
            with busy:
                graph = attribute(
                    prompt, model, batch_size=batch, max_feature_nodes=args.max_feature_nodes
                )
        except torch.cuda.OutOfMemoryError as exc:
            # Recorded, not fatal: the point did not fit the card, which the estimate
            # must predict too. The failed call's frames and nnsight threads hold its tensors.
            from pytest_ctresources.gpu import oom

            oom.release(exc, model)
            record |= {"oom": True, "device_total_bytes": torch.cuda.mem_get_info()[1]}
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            print(f"{model_name} {dtype} tokens={tokens} batch={batch}: OOM", flush=True)
            gc.collect()
            continue
        meter.mark()  # phase 2: everything after the forward pass
        seconds = time.perf_counter() - start
        record |= {
            "active_features": int(graph.active_features.shape[0]),
            "logit_targets": len(graph.logit_targets),
            "seconds": round(seconds, 2),
            "gpu_busy": busy.mean(),
            "phases": meter.marks,
        }
        if cuda:
            record["peak_allocated_bytes"] = max(m["peak"] for m in meter.marks)
            record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            record["device"] = torch.cuda.get_device_name()
            record["torch"] = torch.__version__
            record["predicted_bytes"] = predicted_bytes(record)
        del graph
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        peak = record.get("peak_allocated_bytes", 0) / 2**30
        print(
            f"{model_name} {dtype} tokens={tokens} batch={batch}: peak {peak:.2f} GiB, "
            f"{record['active_features']} active, {seconds:.1f} s, "
            f"GPU busy {record['gpu_busy']}%",
            flush=True,
        )
        measured.append(record)
    del model, meter
    gc.collect()
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="ctresources/random-gemma-2-2b", help="comma-separated bundled names"
    )
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--batch-sizes", default="32,64,128,256")
    parser.add_argument("--prompt-tokens", default="8,25,100")
    parser.add_argument("--max-feature-nodes", type=int, default=8192)
    parser.add_argument("--plan", help="JSON list of models and points (see the docstring)")
    parser.add_argument("--split", default="fit", help="split of the grid's records")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds (0: none)")
    parser.add_argument("--out", default="attribution_peaks.jsonl")
    return measure(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
