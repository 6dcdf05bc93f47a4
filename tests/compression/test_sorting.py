"""The numpy-backed sort the codecs use gives exactly ``torch.sort``'s values."""

from __future__ import annotations

import pytest
import torch

from compression._sorting import sorted_values


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16]
)
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 70_000])
def test_same_values_as_torch_sort(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 1000).to(dtype)
    if n > 10:
        t[::7] = t[3]  # duplicates
    got = sorted_values(t)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, t.sort().values)


def test_infinities_and_non_contiguous_input():
    t = torch.tensor([3.0, -float("inf"), 1.0, float("inf"), -2.0, 0.0]).flip(0)
    assert torch.equal(sorted_values(t), t.sort().values)
    assert torch.equal(sorted_values(t[::2]), t[::2].sort().values)
