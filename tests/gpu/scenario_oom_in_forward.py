"""GPU scenario (run explicitly, see tests/gpu/test_gpu.py): the OOM retry gets the card back.

A random-weight gemma-2-2b in bf16 with a 100-token prompt under an emulated 24 GiB card,
from batch 512: the forward pass runs out of memory at 512, 256 and 128, and batch 64 needs
19.3 GiB of the 24. Before the plugin freed the nnsight intervention thread such an OOM
leaves blocked (pytest_ctresources/gpu/nnsight_threads.py), an OOM at batch 512 kept 9.6-10.2 GiB
of residual caches allocated beyond the model (measured), so batch 64 could not have fitted.
"""

import threading

import pytest
import torch

from pytest_ctresources import testing


@pytest.mark.ct_config(batch_size=512, max_feature_nodes=4096, dtype="bfloat16")
def test_retry_after_ooms_in_the_forward_pass(ct_session) -> None:
    model = testing.build_replacement_model(
        testing.GEMMA_2_2B_DIMS, dtype="bfloat16", device="cuda"
    )
    generator = torch.Generator().manual_seed(100)
    prompt = [2, *torch.randint(3, model.cfg.d_vocab, (99,), generator=generator).tolist()]
    graph = ct_session.attribute(prompt, model)
    halvings = [(h.failed_batch_size, h.next_batch_size) for h in ct_session.halvings]
    print("HALVINGS", halvings)
    assert halvings == [(512, 256), (256, 128), (128, 64)]
    assert len(graph.input_tokens) == 100
    stuck = [t.name for t in threading.enumerate() if t.name.startswith("Mediator")]
    assert not stuck, f"nnsight threads left blocked: {stuck}"
