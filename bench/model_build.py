"""Where the time of building a random-weight model of real size goes, phase by phase.

    python bench/model_build.py [--model ctresources/random-gemma-2-2b] [--dtype bfloat16]
        [--attributions 3] [--profile 25]

Times, in one process: importing circuit-tracer; writing the local tokenizer; creating the
random transcoders; Hugging Face's ``from_config`` (the transformer's parameters and their
init); nnsight's wrapping and circuit-tracer's configuration of it; the threshold
calibration; then ``--attributions`` attributions of a 25-token prompt (batch 256, 8192
feature nodes, as ``bench/xdist_suite``), each followed by what the plugin's teardown does
(``gc.collect`` and ``torch.cuda.empty_cache``), timed apart. ``--profile N`` also prints
the N most expensive functions of the build by cumulative time (cProfile). Runs on CUDA when
there is a GPU, else on the CPU with the bundled tiny model.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMES: dict[str, float] = {}


def timed_attr(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``TIMES[label]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            TIMES[label] = TIMES.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ctresources/random-gemma-2-2b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attributions", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()

    start = time.perf_counter()
    import torch
    import transformers
    from circuit_tracer import attribute
    from circuit_tracer.replacement_model.replacement_model_nnsight import (
        NNSightReplacementModel,
    )

    from pytest_ctresources import testing

    print(f"import torch, transformers, circuit_tracer: {time.perf_counter() - start:.2f} s")
    cuda = torch.cuda.is_available()
    model_name, dtype, batch = args.model, args.dtype, 256
    if not cuda:
        model_name, dtype, batch = testing.TINY_GEMMA2, "float32", 16
    start = time.perf_counter()
    if cuda:
        torch.zeros(1, device="cuda")
    print(f"CUDA initialisation: {time.perf_counter() - start:.2f} s")

    timed_attr(testing, "write_local_tokenizer", "write the local tokenizer")
    timed_attr(testing, "_random_transcoders", "random transcoders")
    timed_attr(transformers.AutoModelForCausalLM, "from_config", "HF from_config (params, init)")
    timed_attr(transformers.AutoTokenizer, "from_pretrained", "load the tokenizer")
    timed_attr(NNSightReplacementModel, "__init__", "nnsight wrap (LanguageModel init)")
    timed_attr(NNSightReplacementModel, "_configure_replacement_model", "circuit-tracer configure")
    timed_attr(testing, "_calibrate_thresholds", "threshold calibration (one forward)")

    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    model = testing.build_named_model(model_name, testing.RANDOM_TRANSCODERS, dtype=dtype)
    if profiler is not None:
        profiler.disable()
    sync()
    total = time.perf_counter() - start
    print(f"\nbuild of {model_name} ({dtype}, {'cuda' if cuda else 'cpu'}): {total:.2f} s")
    for label, seconds in TIMES.items():
        print(f"  {label:<40} {seconds:7.2f} s")
    print(f"  {'(rest)':<40} {total - sum(TIMES.values()):7.2f} s")

    prompt = " ".join(["the capital of france is paris and"] * 3 + ["the", "big", "red"])
    for index in range(args.attributions):
        start = time.perf_counter()
        attribute(prompt, model, batch_size=batch, max_feature_nodes=8192, verbose=False)
        sync()
        attributed = time.perf_counter() - start
        start = time.perf_counter()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        cleaned = time.perf_counter() - start
        print(
            f"attribution {index + 1}: {attributed:.2f} s; gc.collect + empty_cache {cleaned:.2f} s"
        )
    if profiler is not None:
        print(f"\nthe build's {args.profile} most expensive functions (cumulative):")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
