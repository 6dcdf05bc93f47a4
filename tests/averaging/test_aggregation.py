"""Aggregation strategies: exact streaming mean, deviation statistic, robust bounds."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpit.averaging.aggregation import (
    CenteredClip,
    ClippedMean,
    NonFiniteContribution,
    WeightedMean,
)


def aggregate(agg, xs, ws):
    chunk = agg.begin(xs[0].numel())
    for x, w in zip(xs, ws, strict=True):
        chunk.add(x, w)
    return chunk.result()


@given(
    n=st.integers(1, 6),
    numel=st.integers(1, 50),
    seed=st.integers(0, 1000),
    zero_some=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_weighted_mean_and_deviation_are_exact(n, numel, seed, zero_some):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    ws = [float(w) for w in torch.rand(n, generator=g) + 0.1]
    if zero_some and n > 1:
        ws[0] = 0.0
    res = aggregate(WeightedMean(), xs, ws)
    W = sum(ws)
    mean = sum(w * x.double() for w, x in zip(ws, xs, strict=True)) / W
    dev = sum(w * float((x.double() - mean).pow(2).sum()) for w, x in zip(ws, xs, strict=True)) / W
    assert torch.allclose(res[0].double(), mean, atol=1e-5)
    assert res[1] == pytest.approx(dev, rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("agg", [WeightedMean(), ClippedMean(1.0), CenteredClip(1.0)])
def test_no_positive_weight_means_no_result(agg):
    assert aggregate(agg, [torch.ones(3), torch.zeros(3)], [0.0, 0.0]) is None


@pytest.mark.parametrize("agg", [ClippedMean(100.0), CenteredClip(100.0, iterations=20)])
def test_robust_equals_mean_when_nobody_is_clipped(agg):
    xs = [torch.randn(20) for _ in range(5)]
    ws = [1.0, 2.0, 1.0, 3.0, 1.0]
    got, dev = aggregate(agg, xs, ws)
    want, want_dev = aggregate(WeightedMean(), xs, ws)
    assert torch.allclose(got, want, atol=1e-4)
    assert dev == pytest.approx(want_dev, rel=1e-3)


@given(outlier=st.floats(-1e12, 1e12), tau=st.floats(0.01, 10.0), seed=st.integers(0, 100))
@settings(max_examples=50, deadline=None)
def test_clipped_mean_stays_within_tau_of_the_honest_range(outlier, tau, seed):
    g = torch.Generator().manual_seed(seed)
    honest = [torch.randn(16, generator=g) for _ in range(4)]
    got, _ = aggregate(ClippedMean(tau), [*honest, torch.full((16,), outlier)], [1.0] * 5)
    h = torch.stack(honest)
    assert bool(
        (got >= h.min(0).values - tau - 1e-4).all() and (got <= h.max(0).values + tau + 1e-4).all()
    )


@given(outlier=st.floats(-1e12, 1e12), weight=st.floats(0.1, 1e6), seed=st.integers(0, 100))
@settings(max_examples=50, deadline=None)
def test_centered_clip_moves_at_most_tau_per_iteration_share(outlier, weight, seed):
    """From a start inside the honest box, the attacker of weight share d moves the center by at
    most iterations * d * tau beyond the honest points' radius."""
    tau, iters = 0.5, 4
    g = torch.Generator().manual_seed(seed)
    honest = [torch.randn(10, generator=g) for _ in range(4)]
    ws = [1.0] * 4 + [weight]
    got, _ = aggregate(CenteredClip(tau, iters), [*honest, torch.full((10,), outlier)], ws)
    h = torch.stack(honest)
    c = h.mean(0)
    box = (h - c).abs().max(0).values.norm()
    radius = (h - c).norm(dim=1).max()
    share = weight / sum(ws)
    assert float((got - c).norm()) <= float(max(box, radius)) + iters * share * tau + 1e-4


def test_invalid_parameters():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ClippedMean(bad)
        with pytest.raises(ValueError):
            CenteredClip(bad)
    with pytest.raises(ValueError):
        CenteredClip(1.0, iterations=0)


@pytest.mark.parametrize("agg", [WeightedMean(), ClippedMean(tau=1.0), CenteredClip(tau=1.0)])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("weight", [0.5, 0.0])
def test_add_refuses_nan_and_inf_and_changes_nothing(agg, bad, weight):
    """The reducer relies on add() as the NaN/Inf check of received chunks."""
    chunk = agg.begin(100)
    good = torch.randn(100)
    chunk.add(good, 0.5)
    poisoned = torch.randn(100)
    poisoned[37] = bad
    with pytest.raises(NonFiniteContribution, match="NaN or Inf"):
        chunk.add(poisoned, weight)
    mean, deviation = chunk.result()
    assert torch.allclose(mean, good) and deviation == pytest.approx(0.0, abs=1e-6)
    assert chunk.count == 1 and chunk.contributors == 1


def test_huge_finite_values_are_not_mistaken_for_inf():
    """float32 ||x||^2 overflows for values near 1e20; that is not a NaN/Inf contribution."""
    chunk = WeightedMean().begin(4)
    chunk.add(torch.full((4,), 1e20), 0.5)
    chunk.add(torch.full((4,), -1e20), 0.5)
    mean, deviation = chunk.result()
    assert torch.equal(mean, torch.zeros(4)) and math.isfinite(deviation)
