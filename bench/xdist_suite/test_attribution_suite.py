"""Benchmark suite for bench/xdist_gpus.py: 16 real-size attributions, each declaring its VRAM.

Each test runs ``circuit_tracer.attribute`` on a 25-token prompt with a random-weight model of
real gemma-2-2b dimensions in bfloat16 (batch 256, up to 8192 feature nodes). Measured on an
H200: 17.69 GiB allocated / 18.20 GiB reserved at the peak, hence ``vram(gib=19)``.

The model comes from ``ct_session.load_model()``: built once per process (per xdist worker)
by the first test that runs there and kept in the session's model cache, which the plugin
frees when the worker has to wait for a lease. That first test's report carries a LEAK flag
for the resident model, which is expected. ``circuit_tracer.attribute`` is called directly,
not through ``ct_session.attribute``, so an out-of-memory error fails the test instead of
being retried at a smaller batch: OOM failures are what the benchmark counts.

``CT_BENCH_TINY=1`` switches to the bundled tiny model (float32, CPU or CUDA, batch 16, 1 GiB)
so the harness runs on a machine without a GPU (with ``CT_FAKE_GPUS`` presenting one).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_ctresources import testing

TINY = os.environ.get("CT_BENCH_TINY") == "1"
VRAM_GIB = 1 if TINY else 19
BATCH_SIZE = 16 if TINY else 256
MAX_FEATURE_NODES = 8192
N_TESTS = 16

# One ending word per test, so the 16 attributions differ; 23 words + ending + BOS = 25 tokens.
ENDINGS = "red blue green black white dark light hot cold warm big small old new good bad".split()
PROMPT_START = " ".join(["the capital of france is paris and"] * 3 + ["the", "big"])
N_TOKENS = 25


MODEL = testing.TINY_GEMMA2 if TINY else testing.RANDOM_GEMMA_2_2B
DTYPE = "float32" if TINY else "bfloat16"


@pytest.mark.vram(gib=VRAM_GIB)
@pytest.mark.ct_config(model_name=MODEL, transcoder_set=testing.RANDOM_TRANSCODERS, dtype=DTYPE)
@pytest.mark.parametrize("index", range(N_TESTS))
def test_attribution(index: int, ct_session: Any) -> None:
    import torch
    from circuit_tracer import attribute

    replacement_model = ct_session.load_model()
    graph = attribute(
        f"{PROMPT_START} {ENDINGS[index]}",
        replacement_model,
        batch_size=BATCH_SIZE,
        max_feature_nodes=MAX_FEATURE_NODES,
        verbose=False,
    )
    n_layers = replacement_model.cfg.n_layers
    n_features = len(graph.selected_features)
    # Nodes: selected features, one error node per layer and position, one embedding node per
    # position, one node per logit target.
    n_nodes = n_features + (n_layers + 1) * N_TOKENS + len(graph.logit_targets)
    assert len(graph.input_tokens) == N_TOKENS
    assert 0 < n_features <= MAX_FEATURE_NODES
    assert graph.adjacency_matrix.shape == (n_nodes, n_nodes)
    assert torch.isfinite(graph.adjacency_matrix).all()
