"""``Averager(aggregation=...)``: finite poisoning a user can defend against.

Four honest members and an attacker (a client: it sends to every reducer and reduces nothing)
run real all-reduce rounds on the in-memory network. With the default weighted mean a member
sending 1e30, or one claiming weight 1e9, moves the result by orders of magnitude; with
``"trimmed_mean"`` or ``"median"`` the honest members' results stay within the honest
contributions' range on every coordinate (their spread), and the Averager passes the option
through to the rounds it runs.
"""

from __future__ import annotations

import pytest
import torch

from moshpit.averaging.aggregation import (
    CenteredClip,
    Median,
    TrimmedMean,
    WeightedMean,
    make_aggregator,
)
from tests.averaging.test_allreduce import make_group, run_all, swarm
from tests.averaging.test_moshpit import moshpit_swarm, step_all

N = 64
ATTACKS = {
    "huge-values": (torch.full((N,), 1e30), 1.0),
    "float32-max": (torch.full((N,), torch.finfo(torch.float32).max), 1.0),
    "huge-weight": (torch.full((N,), 100.0), 1e9),
}


async def _round(attack: str, aggregation) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the honest members' results, the honest contributions stacked)."""
    gen = torch.Generator().manual_seed(7)
    honest = [torch.randn(N, generator=gen) for _ in range(4)]
    values, weight = ATTACKS[attack]
    async with swarm(5, chunk_numel=16) as services:
        group = make_group(services, ["node"] * 4 + ["client"])
        results = await run_all(
            services,
            group,
            [[t] for t in honest] + [[values.clone()]],
            weights=[1.0] * 4 + [weight],
            timeout=30,
            aggregation=aggregation,
        )
    return [r.averaged[0] for r in results[:4]], torch.stack(honest)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_the_weighted_mean_is_moved_far(autojump_clock, attack):
    outs, honest = await _round(attack, WeightedMean())
    spread = (honest.max(0).values - honest.min(0).values).max()
    for out in outs:
        assert (out - honest.mean(0)).abs().max() > 10 * spread  # the attack is real


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_robust_options_keep_the_result_in_the_honest_range(
    autojump_clock, attack, aggregation
):
    outs, honest = await _round(attack, make_aggregator(aggregation))
    low, high = honest.min(0).values, honest.max(0).values
    spread = (high - low).max()
    for out in outs:
        assert bool(torch.isfinite(out).all())
        assert bool(((out >= low - 1e-5) & (out <= high + 1e-5)).all())
        assert (out - honest.mean(0)).abs().max() < spread
    # every honest member holds the same result (each part is reduced once)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_trimmed_mean_and_median_exactly():
    xs = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [1e30, -1e30], [4.0, 40.0]])
    ws = torch.ones(5, dtype=torch.float64)
    trimmed = TrimmedMean(0.2)._combine(xs.double(), ws)
    assert torch.allclose(trimmed, torch.tensor([3.0, 20.0], dtype=torch.float64))
    assert torch.equal(Median()._combine(xs.double(), ws), torch.tensor([3.0, 20.0]).double())
    even = xs[:4].double()
    assert torch.equal(Median()._combine(even, ws[:4]), torch.tensor([2.5, 15.0]).double())
    # too few contributions to trim: the plain mean of what is there
    assert torch.equal(TrimmedMean(0.2)._combine(xs[:2].double(), ws[:2]), xs[:2].double().mean(0))


def test_the_option_is_validated():
    assert make_aggregator(None) is None and make_aggregator("mean") is None
    assert isinstance(make_aggregator("median"), Median)
    clip = CenteredClip(1.0)
    assert make_aggregator(clip) is clip
    with pytest.raises(ValueError, match="aggregation must be one of"):
        make_aggregator("mode")
    with pytest.raises(ValueError, match="trim"):
        TrimmedMean(0.5)


async def test_the_averager_runs_its_rounds_with_the_option(autojump_clock, monkeypatch):
    """Averagers built with aggregation="median" hand it to every all-reduce they run."""
    from moshpit.averaging.allreduce import AllReduceService

    seen = []
    real_run = AllReduceService.run

    async def spy(self, *args, **kwargs):
        seen.append(kwargs.get("aggregation"))
        return await real_run(self, *args, **kwargs)

    monkeypatch.setattr(AllReduceService, "run", spy)
    async with moshpit_swarm(3, target_group_size=3, aggregation="median") as (averagers, _):
        results = await step_all(averagers)
        assert all(r.succeeded for r in results), [r.reason for r in results]
    assert len(seen) == 3 and all(isinstance(a, Median) for a in seen)
