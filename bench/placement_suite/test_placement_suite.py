"""The H200 placement suite for bench/placement_h200.py: real-size attributions whose declared
needs fall on both sides of 20 GiB, for two workers on one GPU capped at 20 and 60 GiB.

- 6 small tests: random gemma-2-2b (bfloat16), a 25-token prompt, batch 256, up to 8192
  feature nodes; measured on an H200 at 17.69 GiB allocated / 18.20 GiB reserved at the peak
  (bench/xdist_suite), hence ``vram(gib=19)``: both workers can hold them.
- 6 large tests: random gemma-3-4b (bfloat16), a 160-token prompt of random token ids,
  batch 128, up to 4096 feature nodes; measured on an H200 at 34.71 GiB allocated /
  36.98 GiB reserved at the peak (docs/calibration, 2026-11-30-h200-architectures.jsonl),
  hence ``vram(gib=39)``: only the 60 GiB worker can hold them. Each attribution took
  6.5 s there, a small one 3 s, so the run takes well under 5 minutes with the builds.

``circuit_tracer.attribute`` is called directly, so an out-of-memory error fails the test
(what the driver counts) instead of being retried at a smaller batch. ``CT_BENCH_TINY=1``
runs the same tests, with the same declared needs, on the bundled tiny model (CPU is fine).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_ctresources import testing

TINY = os.environ.get("CT_BENCH_TINY") == "1"
DTYPE = "float32" if TINY else "bfloat16"
# (model, prompt tokens, batch size, max feature nodes) per size.
SMALL = (testing.TINY_GEMMA2 if TINY else testing.RANDOM_GEMMA_2_2B, 25, 16 if TINY else 256, 8192)
LARGE = (testing.TINY_LLAMA if TINY else testing.RANDOM_GEMMA_3_4B, 160, 16 if TINY else 128, 4096)


def cases() -> list[Any]:
    out = []
    for size, gib, count, shape in (("small", 19, 6, SMALL), ("large", 39, 6, LARGE)):
        config = pytest.mark.ct_config(
            model_name=shape[0], transcoder_set=testing.RANDOM_TRANSCODERS, dtype=DTYPE
        )
        marks = [pytest.mark.vram(gib=gib), config]
        out += [pytest.param(shape, n, marks=marks, id=f"{size}-{n}") for n in range(count)]
    return out


@pytest.mark.parametrize(("shape", "seed"), cases())
def test_attribution(shape: tuple[str, int, int, int], seed: int, ct_session: Any) -> None:
    import torch
    from circuit_tracer import attribute

    _model, tokens, batch_size, max_feature_nodes = shape
    replacement_model = ct_session.load_model()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, replacement_model.cfg.d_vocab, (tokens - 1,), generator=generator)
    graph = attribute(
        [2, *ids.tolist()],  # BOS, then random token ids, as bench/attribution_peaks.py
        replacement_model,
        batch_size=batch_size,
        max_feature_nodes=max_feature_nodes,
        verbose=False,
    )
    assert len(graph.input_tokens) == tokens
    assert 0 < len(graph.selected_features) <= max_feature_nodes
    assert torch.isfinite(graph.adjacency_matrix).all()
