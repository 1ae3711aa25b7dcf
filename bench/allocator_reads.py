"""What one read of the caching allocator's figures costs, torch's getters against the plugin's.

``torch.cuda.memory_allocated``, ``memory_reserved``, ``max_memory_*`` and ``memory_stats``
each flatten the whole statistics dictionary in Python; ``allocator_stats``
(pytest_ctresources/gpu/measure.py) reads the nested dictionary once and gives every figure
the plugin uses. This prints the mean time of one call of each, over ``--calls`` calls, on
the current CUDA device, after one small allocation (so the dictionary has its real size).

    python bench/allocator_reads.py                 # on a GPU machine
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pytest_ctresources.gpu.measure import allocator_stats


def per_call_us(read: Callable[[], object], calls: int) -> float:
    read()
    start = time.perf_counter()
    for _ in range(calls):
        read()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("allocator_reads.py: no CUDA device")
    cuda = torch.cuda
    kept = torch.ones(1024, device="cuda")  # noqa: F841 - an allocation the figures count
    reads: dict[str, Callable[[], object]] = {
        "torch.cuda.memory_allocated()": cuda.memory_allocated,
        "torch.cuda.max_memory_reserved()": cuda.max_memory_reserved,
        "torch.cuda.memory_stats()": cuda.memory_stats,
        "torch.cuda.memory_stats_as_nested_dict()": cuda.memory_stats_as_nested_dict,
        "allocator_stats(torch.cuda) (every figure)": lambda: allocator_stats(cuda),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.calls} calls each")
    print("| read | µs a call |\n|---|---|")
    for name, read in reads.items():
        print(f"| `{name}` | {per_call_us(read, args.calls):.1f} |")


if __name__ == "__main__":
    main()
