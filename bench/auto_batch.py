"""``--ct-batch-size auto`` against hand-picked batch sizes, under a capped GPU.

    python bench/auto_batch.py --capacity 24 --out auto_batch.jsonl

For each configuration (a random-weight model of real size, a dtype and a prompt length),
in its own child process, the script caps PyTorch's allocator at ``--capacity`` GiB (what
``--ct-vram-capacity`` does), builds the model, runs one small warm-up attribution, then:

1. one ``CtSession.attribute`` with ``batch_size="auto"`` (recording the choice and its
   reason, the time including the choice, the peak, or OOM); from the second round on, the
   choice carries the correction the earlier rounds' measured peaks made;
2. for the configurations marked for comparison, ``circuit_tracer.attribute`` at each batch
   size of ``--batch-sizes`` in increasing order, until the first that runs out of memory
   (the larger ones would too).

With ``--repeats R`` that round runs R times; rounds after the first time only the sizes
that fitted in the first, in alternating order, and the comparison uses medians (one size's
time moves by up to 10% between runs). With ``--capacity 0 --other-process-gib G`` there is
no cap: another process holds G GiB of the card for the whole run, and auto must fit what
``torch.cuda.mem_get_info()`` says is free.

Auto runs before any out-of-memory error because such an error inside circuit-tracer can
leave memory allocated in the process (seen on the H200: about 8 GiB after three OOMs),
which would shrink what later runs have; for the same reason each configuration gets a
fresh process, and an OOM's record says what stayed allocated after it. It prints one line
per run and, per configuration, auto's time over the fastest manual batch size that fitted.
One JSON object per run goes to ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_ctresources.gpu import oom

#: (bundled model, dtype, prompt tokens, compare): the estimator's held-out validation
#: models (docs/estimator.md) that fit a 24 GiB cap. ``compare``: time hand-picked batch
#: sizes against auto; the others run auto only (that it never runs out of memory, and how
#: its corrections go). Llama-3.2-3B in float32 is left out: 22.6 GiB resident, not even
#: batch size 1 fits 24 GiB (the estimator says so).
CONFIGS: list[tuple[str, str, int, bool]] = [
    ("ctresources/random-llama-3.2-3b", "bfloat16", 70, True),
    ("ctresources/random-qwen3-1.7b-clt", "bfloat16", 30, True),
    ("ctresources/random-qwen3-1.7b", "bfloat16", 100, False),
    ("ctresources/random-qwen3-1.7b", "float32", 40, False),
    ("ctresources/random-gemma-3-270m", "bfloat16", 50, False),
    ("ctresources/random-gemma-3-270m", "float32", 50, False),
]


def parse_configs(text: str) -> list[tuple[str, str, int, bool]]:
    """``--configs``: ``model:dtype:tokens`` items, comma-separated, each compared."""
    configs = []
    for item in filter(None, text.split(",")):
        model, dtype, tokens = item.split(":")
        configs.append((model, dtype, int(tokens), True))
    return configs


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=24.0, help="GiB (default 24)")
    parser.add_argument("--batch-sizes", default="16,32,64,128,256,512")
    parser.add_argument("--max-feature-nodes", type=int, default=4096)
    parser.add_argument("--only", default="", help="comma-separated config indices")
    parser.add_argument(
        "--configs",
        default="",
        help="model:dtype:tokens,... in place of CONFIGS (each compared against hand-picked sizes)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds per configuration; medians compared"
    )
    parser.add_argument(
        "--other-process-gib",
        type=float,
        default=0.0,
        help="another process holds this much of the GPU for the whole run (use with "
        "--capacity 0: auto must fit what mem_get_info says is free)",
    )
    parser.add_argument("--out", default="auto_batch.jsonl")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args)
    configs = parse_configs(args.configs) if args.configs else CONFIGS
    wanted = [int(i) for i in args.only.split(",") if i] or list(range(len(configs)))
    status = 0
    with other_process(args.other_process_gib):
        for index in wanted:
            argv = [sys.executable, __file__, "--child", str(index)]
            argv += ["--capacity", str(args.capacity), "--batch-sizes", args.batch_sizes]
            argv += ["--out", str(Path(args.out).resolve())]
            argv += ["--max-feature-nodes", str(args.max_feature_nodes)]
            argv += ["--repeats", str(args.repeats), "--configs", args.configs]
            status |= subprocess.run(argv, check=False).returncode
    print_summary(Path(args.out), [configs[index] for index in wanted])
    return status


@contextmanager
def other_process(gib: float) -> Iterator[None]:
    """A process of our own that holds ``gib`` GiB of the GPU until the block ends."""
    if gib <= 0:
        yield
        return
    code = (
        "import sys, time, torch\n"
        f"held = torch.empty({int(gib * 2**30)}, dtype=torch.uint8, device='cuda')\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"  # until the parent closes the pipe
    )
    hog = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        print(f"another process holds {gib:g} GiB of the GPU (pid {hog.pid})", flush=True)
        yield
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(timeout=60)


def print_summary(path: Path, configs: list[tuple[str, str, int, bool]]) -> None:
    """The last lines of a run: per configuration, auto's rounds (batch size, predicted and
    measured allocated peak, time, OOM) and its time over the fastest hand-picked size."""
    if not path.exists():
        return
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print("\nmodel                 dtype tok  auto rounds: batch predicted/measured GiB s   ratio")
    for model, dtype, tokens, _ in configs:
        mine = [
            r
            for r in records
            if (r["model"], r["dtype"], r["prompt_tokens"]) == (model, dtype, tokens)
        ]
        rounds = [
            "OOM"
            if r["oom"]
            else f"{r['batch_size']} {r.get('predicted_gib', 0):.2f}/{r['peak_allocated_gib']:.2f} "
            f"{r['seconds']:.2f}"
            for r in mine
            if r["kind"] == "auto"
        ]
        ratio = next((f"{r['ratio']:.3f}" for r in mine if r["kind"] == "summary"), "-")
        name = model.removeprefix("ctresources/random-")
        print(f"{name:21} {dtype[:5]:5} {tokens:3}  {' | '.join(rounds)}  {ratio}", flush=True)


def child(args: argparse.Namespace) -> int:
    import torch

    from pytest_ctresources.gpu.allocator import CapacityCap

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.capacity > 0:
        CapacityCap(args.capacity).arm(import_torch=True)
    with Path(args.out).open("a") as out:
        configs = parse_configs(args.configs) if args.configs else CONFIGS
        run_config(configs[args.child], args, out)
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
        # What an OOM inside circuit-tracer leaves allocated (see bench/oom_residue.py).
        return {"oom": True, "allocated_after_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}
    torch.cuda.synchronize()
    return {
        "oom": False,
        "seconds": round(time.perf_counter() - start, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def attribution(model: Any, prompt: list[int], batch: int, nodes: int) -> dict[str, Any]:
    from circuit_tracer import attribute

    return timed(lambda: attribute(prompt, model, batch_size=batch, max_feature_nodes=nodes))


def auto_config(model_name: str, dtype: str, args: argparse.Namespace) -> Any:
    """The config of auto's runs: the bundled model and its random transcoders."""
    from pytest_ctresources.settings.config import CircuitTracerConfig

    defaults = CircuitTracerConfig.defaults()
    fields = {
        "model_name": model_name,
        "transcoder_set": "ctresources/random-jumprelu",
        "dtype": dtype,
        "batch_size": "auto",
        "max_feature_nodes": args.max_feature_nodes,
    }
    return defaults.layered(fields, defaults.source_of("dtype"))


def auto_attribution(
    model: Any, prompt: list[int], model_name: str, dtype: str, args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    from pytest_ctresources.estimator.auto import DEFAULT_AUTO_MARGIN, Budget
    from pytest_ctresources.session.session import CtSession

    cfg = auto_config(model_name, dtype, args)
    if args.capacity > 0:
        # As the plugin builds it for --ct-vram-capacity: a cap on the allocator.
        budget = Budget(args.capacity, "--capacity", DEFAULT_AUTO_MARGIN, emulated=True)
    else:  # the whole card, as the plugin sees it without a cap
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        budget = Budget(total, torch.cuda.get_device_name(0), DEFAULT_AUTO_MARGIN)
    session = CtSession(cfg, oom_retry=False, auto_budget=budget)
    # The choice's own cost (its setup pass and the search), timed apart inside the total.
    from pytest_ctresources.estimator import auto as autobatch

    choose, choice_seconds = autobatch.choose_with_setup, []

    def timed_choose(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return choose(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            choice_seconds.append(time.perf_counter() - start)

    autobatch.choose_with_setup = timed_choose
    try:
        result = timed(lambda: session.attribute(prompt, model))
    finally:
        autobatch.choose_with_setup = choose
    if choice_seconds:
        result["choice_seconds"] = round(choice_seconds[0], 3)
    choice = session.auto_choices[-1] if session.auto_choices else None
    if choice is not None:
        result["choice"] = choice.describe()
        result["batch_size"] = choice.batch_size
        if choice.predicted_gib is not None:
            result["predicted_gib"] = round(choice.predicted_gib, 2)
        result["active_features"] = choice.active_features
    return result


def emit_predictions(
    model: Any,
    prompt: list[int],
    active: int,
    dtype: str,
    sizes: list[int],
    args: argparse.Namespace,
    out: Any,
    base: dict[str, Any],
) -> None:
    """The estimator's allocated and reserved peaks at every batch size of the run (and the
    resident bytes measured now in place of the estimated weights), to compare policies."""
    import torch

    from pytest_ctresources.estimator import estimate as est
    from pytest_ctresources.estimator import loaded_model, of_config

    cfg = auto_config(str(base["model"]), dtype, args)
    model_shape, transcoders = loaded_model.shapes_of_loaded(model)
    tokens = len(prompt)
    resident = torch.cuda.memory_allocated()
    predictions = {}
    for batch in sorted(set(sizes)):
        workload = of_config.workload_of(cfg, tokens, 0.0, batch, counted_features=active)
        estimate = est.estimate(model_shape, transcoders, workload)
        extra = resident - estimate.resident_bytes
        predictions[batch] = {
            "allocated_gib": round((estimate.peak_allocated_bytes + extra) / 2**30, 3),
            "reserved_gib": round((estimate.peak_reserved_bytes + extra) / 2**30, 3),
        }
    out.write(json.dumps(base | {"kind": "predictions", "predictions": predictions}) + "\n")


def run_config(config: tuple[str, str, int], args: argparse.Namespace, out: Any) -> None:
    import torch

    from pytest_ctresources import testing

    model_name, dtype, tokens, compare = config
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
        if record.get("choice_seconds") is not None:
            extra = f" (choice {record['choice_seconds']:.2f} s)" + extra
        print(f"{model_name} {dtype} {tokens} tokens, {what}: {result}{extra}", flush=True)

    sizes = parse_ints(args.batch_sizes)
    fitted: list[int] = []  # sizes that ran in the first round, ascending
    seconds: dict[str, list[float]] = {}
    auto_sizes: set[int] = set()
    for round_index in range(args.repeats):
        auto = auto_attribution(model, prompt, model_name, dtype, args)
        emit({"kind": "auto", "round": round_index} | auto)
        if not auto["oom"]:
            seconds.setdefault("auto", []).append(auto["seconds"])
            auto_sizes.add(auto["batch_size"])
        if round_index == 0 and auto.get("active_features"):
            emit_predictions(model, prompt, auto["active_features"], dtype, sizes, args, out, base)
        # The first round probes, in increasing order, up to the first out-of-memory error;
        # later rounds time the sizes that fitted, in alternating order (drift evens out).
        if not compare:
            todo = []
        elif round_index == 0:
            todo = sizes
        else:
            todo = fitted if round_index % 2 == 0 else fitted[::-1]
        for batch in todo:
            record = attribution(model, prompt, batch, args.max_feature_nodes)
            emit({"kind": "manual", "batch_size": batch, "round": round_index} | record)
            if record["oom"]:
                break
            if round_index == 0:
                fitted.append(batch)
            seconds.setdefault(str(batch), []).append(record["seconds"])
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    manual = {int(key): value for key, value in medians.items() if key != "auto"}
    if manual and "auto" in medians:
        fastest = min(manual, key=manual.__getitem__)
        ratio = medians["auto"] / manual[fastest]
        runs = len(seconds["auto"])
        print(
            f"  -> auto (batch {sorted(auto_sizes)}) median {medians['auto']:.2f} s over {runs} "
            f"vs fastest manual median {manual[fastest]:.2f} s at batch {fastest}: ratio "
            f"{ratio:.3f}; medians "
            + ", ".join(f"{batch}: {value:.2f}" for batch, value in sorted(manual.items())),
            flush=True,
        )
        summary = {
            "kind": "summary",
            "ratio": round(ratio, 3),
            "fastest_manual": fastest,
            "auto_batch_sizes": sorted(auto_sizes),
            "median_seconds": {key: round(value, 3) for key, value in medians.items()},
            "runs": {key: len(values) for key, values in seconds.items()},
        }
        out.write(json.dumps(base | summary) + "\n")
    del model
    free_memory()


if __name__ == "__main__":
    sys.exit(main())
