"""GPU scenario (run explicitly, see tests/gpu/test_snapshots.py): three tests whose memory
snapshot ``--ct-snapshot on-failure`` keeps, each naming the line marked ``# SITE``.

Run under ``--ct-vram-capacity 24 --ct-no-oom-retry``: a random-weight gemma-2-2b in bf16
attributed from batch 512 runs out of memory in the forward pass (as in
scenario_oom_in_forward.py); a tensor left in a module global is a leak; a test declared at
1 GiB that takes 3 GiB goes over its need. (The out-of-memory test marks two lines: the
model's weights and the attribution's activations are both alive when it fails.) The
out-of-memory test runs last: what an OOM without the retry leaves is not this scenario's
subject.
"""

import pytest
import torch

from pytest_ctresources import testing

GIB = 2**30
LEAKED = []


def test_leaks_into_a_module_global() -> None:
    LEAKED.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))  # SITE


@pytest.mark.vram(gib=1)
def test_goes_over_its_declared_need() -> None:
    scratch = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")  # SITE
    del scratch


@pytest.mark.ct_config(batch_size=512, max_feature_nodes=4096, dtype="bfloat16")
def test_attribution_runs_out_of_memory(ct_session) -> None:
    model = testing.build_replacement_model(  # SITE
        testing.GEMMA_2_2B_DIMS, dtype="bfloat16", device="cuda"
    )
    generator = torch.Generator().manual_seed(100)
    prompt = [2, *torch.randint(3, model.cfg.d_vocab, (99,), generator=generator).tolist()]
    ct_session.attribute(prompt, model)  # SITE
