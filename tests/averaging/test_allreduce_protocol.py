"""The finiteness check used on local tensors and on every received chunk."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpit.averaging.allreduce_protocol import all_finite

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    data=st.data(),
    bad=st.sampled_from([math.nan, math.inf, -math.inf, None]),
)
def test_all_finite_agrees_with_isfinite(dtype, n, data, bad):
    t = (torch.randn(n, dtype=torch.float64) * 1e3).to(dtype)
    if bad is not None:
        t[data.draw(st.integers(0, n - 1))] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t) == (bad is None)


def test_all_finite_edge_cases():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.tensor([3.4e38, -3.4e38]))  # huge but finite: no overflow
    assert not all_finite(torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]))
    assert not all_finite(torch.full((1 << 18,), math.inf)[::2])  # non-contiguous view
