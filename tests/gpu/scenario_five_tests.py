"""GPU scenario (run explicitly, see tests/gpu/test_gpu.py): five tests, the second OOMs.

Run with --ct-vram-capacity 16: the second test asks for 20 GiB.
"""

import pytest
import torch

GIB = 2**30


def allocate(gib: float) -> torch.Tensor:
    return torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")


@pytest.mark.vram(gib=3)
def test_1_two_gib() -> None:
    x = allocate(2)
    x.fill_(1)


def test_2_runs_out_of_memory() -> None:
    kept = allocate(6)  # held by the failing frame: the plugin must release it
    big = allocate(14)
    assert kept.numel() + big.numel() > 0


@pytest.mark.vram(gib=9)
def test_3_eight_gib() -> None:
    x = allocate(8)
    x.fill_(3)


def test_4_four_gib() -> None:
    x = allocate(4)
    x.fill_(4)


@pytest.mark.vram(gib=12)
def test_5_twelve_gib() -> None:
    x = allocate(12)
    x.fill_(5)
