"""GPU scenario (run explicitly, see tests/gpu/test_gpu.py): --ct-batch-size auto.

The same random-weight gemma-2-2b (bf16) and 25-token prompt as the halving scenario, on an
emulated 14 GiB card where batch 256 runs out of memory: with ``--ct-batch-size auto``
ct_session.attribute picks a batch size from the estimate that fits at the first try.
"""

from pytest_ctresources import testing

# 24 words + the BOS token that circuit-tracer prepends = 25 tokens.
PROMPT = " ".join(["the capital of france is paris and"] * 3 + ["the", "big", "red"])


def test_auto_batch_fits_the_first_time(ct_session) -> None:
    model = testing.build_replacement_model(
        testing.GEMMA_2_2B_DIMS, dtype="bfloat16", device="cuda"
    )
    graph = ct_session.attribute(PROMPT, model)
    assert len(graph.input_tokens) == 25
    (choice,) = ct_session.auto_choices
    assert not ct_session.halvings, "auto's choice ran out of memory"
    assert 16 <= choice.batch_size < 256
    print("AUTO", choice.describe())
    print("VRAM", ct_session.vram())
