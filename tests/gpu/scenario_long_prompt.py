"""GPU scenario (run explicitly, see tests/gpu/test_gpu.py): long prompts under auto.

Random weights of Llama-3.2-1B's shape with 16384-wide skip transcoders (bf16, about 5 GiB
resident), ``max_feature_nodes`` 512, on an emulated 24 GiB card (``--ct-vram-capacity``):

- 1,600 tokens: the graph (512 + 17 x 1,600 + 10 nodes) cannot be pruned in 24 GiB at any
  batch size, and ``--ct-batch-size auto`` refuses the call after its setup pass, before the
  forward pass, in one line naming the phase;
- 1,000 tokens: the estimate says the attribution and the pruning fit; auto's batch size runs
  without an out-of-memory error, and ``ct_session.graph_files`` prunes the graph on the GPU
  and writes its files inside the cap.
"""

import dataclasses

import pytest
import torch

from pytest_ctresources import testing
from pytest_ctresources.estimator import auto

DIMS = dataclasses.replace(testing.LLAMA_3_2_1B_DIMS, d_transcoder=16384)


@pytest.fixture(scope="module")
def model():
    return testing.build_replacement_model(DIMS, dtype="bfloat16", device="cuda")


def prompt(tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(tokens)
    return [2, *torch.randint(3, DIMS.vocab_size, (tokens - 1,), generator=generator).tolist()]


def test_a_prompt_whose_pruning_cannot_fit_is_refused_before_the_forward_pass(
    ct_session, model, monkeypatch
):
    forward = []
    original = model.run_forward_pass
    monkeypatch.setattr(
        model, "run_forward_pass", lambda *a, **k: forward.append(1) or original(*a, **k)
    )
    with pytest.raises(auto.WillNotFit) as refused:
        ct_session.attribute(prompt(1600), model, max_feature_nodes=512)
    assert not forward
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "--ct-batch-size auto: 1600 prompt tokens cannot fit at any batch size: the prune "
        "phase alone (prune_graph, 27722 nodes, dense adjacency 2.86 GiB)"
    )
    print("REFUSED", message)


def test_a_prompt_that_fits_runs_and_prunes_inside_the_cap(ct_session, model, tmp_path):
    graph = ct_session.attribute(prompt(1000), model, max_feature_nodes=512)
    (choice,) = ct_session.auto_choices
    assert not ct_session.halvings, "auto's choice ran out of memory"
    assert torch.cuda.max_memory_allocated() <= 24 * 2**30
    path = ct_session.graph_files(graph, "long", tmp_path)
    assert path.is_file()
    (call,) = ct_session.prunings
    assert call.timing.device.startswith("cuda")
    assert call.peak_allocated_bytes is not None and call.peak_allocated_bytes <= 24 * 2**30
    print("AUTO", choice.describe())
    print("PRUNED", call.to_dict())
