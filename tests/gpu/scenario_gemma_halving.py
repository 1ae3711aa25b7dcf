"""GPU scenario (run explicitly, see tests/gpu/test_gpu.py): OOM recovered by halving.

A random-weight model of real gemma-2-2b dimensions in bf16, one attribution on a 25-token
prompt at batch 256 under an emulated small card (--ct-vram-capacity): ct_session.attribute
runs out of memory, halves the batch size and succeeds; the report names the batch size.
"""

from pytest_ctresources import testing

# 24 words + the BOS token that circuit-tracer prepends = 25 tokens.
PROMPT = " ".join(["the capital of france is paris and"] * 3 + ["the", "big", "red"])


def test_gemma_2_2b_attribution_under_a_small_card(ct_session) -> None:
    # Built inside the test: a wider-scoped fixture would keep it allocated past teardown.
    model = testing.build_replacement_model(
        testing.GEMMA_2_2B_DIMS, dtype="bfloat16", device="cuda"
    )
    graph = ct_session.attribute(PROMPT, model)
    assert len(graph.input_tokens) == 25
    assert ct_session.halvings, "expected at least one OOM at batch 256 on the emulated card"
    print("HALVINGS", [(h.failed_batch_size, h.next_batch_size) for h in ct_session.halvings])
    print("VRAM", ct_session.vram())
