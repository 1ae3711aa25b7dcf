"""An example experiment suite: circuit-tracer attribution as tests.

Run it on the bundled tiny offline model (CPU is enough):

    pytest examples/ --ct-config example_configs/tiny_gemma2.yaml

or on a real model with a GPU and hub access:

    pytest examples/ --ct-config example_configs/gemma-2-2b.yaml --ct-batch-size 64
"""

from __future__ import annotations

import pytest

from pytest_ctresources import CtSession


def prompts() -> list[str]:
    return [
        "the capital of france is",
        "the big red city was",
    ]


@pytest.mark.parametrize("prompt", prompts())
def test_attribution_graph_is_well_formed(ct_session: CtSession, prompt: str) -> None:
    graph = ct_session.attribute(prompt)
    n_features = len(graph.selected_features)
    assert 0 < n_features <= ct_session.cfg.max_feature_nodes
    assert graph.adjacency_matrix.shape[0] == graph.adjacency_matrix.shape[1]
    assert len(graph.logit_token_ids) <= ct_session.cfg.max_n_logits


@pytest.mark.ct_config(max_feature_nodes=16)
def test_a_smaller_graph_for_one_experiment(ct_session: CtSession) -> None:
    graph = ct_session.attribute(ct_session.cfg.params.get("PROMPT", prompts()[0]))
    assert len(graph.selected_features) <= 16


def test_attribution_does_not_depend_on_batch_size(ct_session: CtSession) -> None:
    prompt = prompts()[0]
    big = ct_session.attribute(prompt)
    # ct_session.batch_size is the batch size the last call ran with, a number even under
    # --ct-batch-size auto (where ct_session.cfg.batch_size is the string "auto").
    small = ct_session.attribute(prompt, batch_size=max(1, ct_session.batch_size // 4))
    assert small.selected_features.tolist() == big.selected_features.tolist()
    assert (small.adjacency_matrix - big.adjacency_matrix).abs().max().item() < 1e-3


def test_influence_chart(ct_session: CtSession) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = ct_session.attribute(prompts()[0])
    influence = graph.adjacency_matrix.abs().sum(dim=0)
    plt.figure()
    plt.bar(range(len(influence)), influence.tolist())
    plt.title("total incoming attribution per node")
    # No plt.close(): the plugin closes figures a test leaves open (and says so with -v).


@pytest.mark.ct_config(batch_size="auto", batch_size_max=128)
def test_auto_batch_size(ct_session: CtSession) -> None:
    """The batch size comes from the VRAM estimate (the largest that fits the GPU, up to 128;
    128 without a GPU); the summary says which one and why."""
    graph = ct_session.attribute("the capital of france is")
    (choice,) = ct_session.auto_choices
    assert 1 <= choice.batch_size <= 128
    assert graph.adjacency_matrix.shape[0] > 0


@pytest.mark.vram(gib=20)
def test_a_real_size_experiment_needs_a_big_gpu(ct_session: CtSession) -> None:
    # Declares a 20 GiB need: skipped, with the reason in the summary, where no GPU has it.
    graph = ct_session.attribute(prompts()[0])
    assert len(graph.selected_features) > 0
