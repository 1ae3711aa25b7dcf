"""Does torch's per-process memory fraction bind under each allocator configuration?

    python bench/cap_probe.py   (on a GPU machine)

For PYTORCH_CUDA_ALLOC_CONF unset and expandable_segments:True, caps the allocator at 14 GiB
and allocates until OOM, in 256 MiB tensors and then in one 20 GiB tensor; prints where the
OOM happened. Each configuration runs in its own process (the allocator reads the variable
once).
"""

import os
import subprocess
import sys

CHILD = r"""
import torch
GIB = 2**30
cap = 14 * GIB
torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
held = []
try:
    for _ in range(200):
        held.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
    chunks = "no OOM up to 50 GiB"
except torch.cuda.OutOfMemoryError:
    chunks = f"OOM after {len(held) * 256 / 1024:.2f} GiB"
held.clear(); torch.cuda.empty_cache()
try:
    torch.empty(20 * GIB, dtype=torch.uint8, device="cuda")
    single = "20 GiB allocated"
except torch.cuda.OutOfMemoryError:
    single = "OOM"
print(f"256 MiB chunks: {chunks}; one 20 GiB tensor: {single}")
"""

for conf in (None, "expandable_segments:True"):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    print(f"PYTORCH_CUDA_ALLOC_CONF={conf}: {out.stdout.strip() or out.stderr.strip()[-300:]}")
