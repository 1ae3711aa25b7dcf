"""Measure the memory one process's CUDA context takes outside PyTorch's allocator.

    python bench/cuda_context.py

Reads the GPU's used memory from NVML (this process alone on the GPU) before CUDA is
initialised, after a first tensor, after a matmul (cuBLAS handles) and after a model-sized
allocation, and subtracts what PyTorch's allocator has reserved at each step. Prints one
JSON object. Needs a CUDA GPU and nvidia-ml-py.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import pynvml
    import torch

    pynvml.nvmlInit()
    index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def used() -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

    steps: dict[str, dict[str, int]] = {}
    before = used()

    def record(name: str) -> None:
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        steps[name] = {
            "nvml_used_delta": used() - before,
            "torch_reserved": reserved,
            "outside_torch": used() - before - reserved,
        }

    x = torch.ones(1, device="cuda")
    record("first tensor")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    _ = a @ a
    record("after a bf16 matmul")
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float32)
    _ = b @ b
    record("after a fp32 matmul")
    del x, a, b
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "steps": steps,
        "context_bytes": max(step["outside_torch"] for step in steps.values()),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
