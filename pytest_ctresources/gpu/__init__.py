"""Where GPU facts come from and what touches the GPU: detection, the allocator settings, per-
test measurement, skip decisions, out-of-memory, nnsight threads, and cleanup."""
