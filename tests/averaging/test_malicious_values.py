"""Finite but hostile values must never break honest members (issue 12, items 11 and 12).

- Weight bomb: a member sends 1e30 with the largest accepted weight (1e9). Before the fix the
  float32 weighted sum overflowed to Inf, every honest output became Inf and every later round
  raised on the non-finite local tensors.
- Overflowing deviation: values of ~3e17 overflowed the float32 ``||x||^2`` of the deviation
  statistic, honest reducers reported Inf and every honest member rejected them.

Real Hosts on the in-memory network (MockClock with autojump: timeouts cost no wall time).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import trio

from moshpit.averaging.aggregation import (
    Aggregator,
    CenteredClip,
    ChunkAggregation,
    ClippedMean,
    WeightedMean,
    squared_norm,
)
from moshpit.averaging.allreduce_protocol import MAX_WEIGHT, all_finite
from moshpit.averaging.allreduce_reducer import (
    DEFAULT_MAX_WEIGHT_RATIO,
    effective_weights,
    weight_cap,
)
from moshpit.averaging.partition import part_bounds
from tests.averaging.test_allreduce import make_group, run_all, swarm

F32_MAX = float(torch.finfo(torch.float32).max)

# ---------------------------------------------------------------- aggregation in isolation


def _aggregate(agg: Aggregator, xs, ws):
    chunk = agg.begin(xs[0].numel())
    for x, w in zip(xs, ws, strict=True):
        chunk.add(x, w)
    return chunk.result()


@pytest.mark.parametrize("value", [3e17, 1e30, F32_MAX])
def test_squared_norm_is_finite_for_every_finite_float32(value):
    x = torch.full((4096,), value)
    assert math.isinf(float(torch.dot(x, x)))  # what the old code used
    assert squared_norm(x) == pytest.approx(4096 * value**2, rel=1e-6)
    small = torch.randn(100)
    assert squared_norm(small) == pytest.approx(float(torch.dot(small, small)))


@pytest.mark.parametrize(
    "agg", [WeightedMean(), ClippedMean(1.0), CenteredClip(1.0), ClippedMean(1e38)]
)
@pytest.mark.parametrize("value", [3e17, 1e30, F32_MAX])
def test_every_aggregator_stays_finite_on_huge_finite_input(agg, value):
    """Normalised weights (what the reducer passes), one sender at an extreme value."""
    honest = [torch.randn(4096) for _ in range(3)]
    xs = [*honest, torch.full((4096,), value), torch.full((4096,), -value)]
    ws = [0.2] * 5
    center, dev = _aggregate(agg, xs, ws)
    assert center.dtype == torch.float32
    assert all_finite(center)
    assert math.isfinite(dev) and dev > 0


def test_weight_cap_is_a_multiple_of_the_lower_median():
    assert weight_cap({0: 1.0, 1: MAX_WEIGHT}, 100.0) == 100.0  # lower median of two: 1
    assert weight_cap({0: 1.0, 1: 2.0, 2: 3.0}, 10.0) == 20.0
    assert weight_cap({0: 0.0, 1: 0.0, 2: 4.0}, 10.0) == 40.0  # zero weights do not count
    assert weight_cap({0: 0.0}, 10.0) == 0.0


def test_effective_weights_clip_and_normalise():
    ws = effective_weights({i: 1.0 for i in range(8)} | {8: MAX_WEIGHT}, 100.0)
    assert ws[8] == pytest.approx(100 / 108)
    assert all(ws[i] == pytest.approx(1 / 108) for i in range(8))
    assert math.fsum(ws.values()) == pytest.approx(1.0)
    # a majority claiming big weights is not clipped: the rule bounds outliers only
    big = effective_weights({0: 1e6, 1: 1e6, 2: 1.0}, 100.0)
    assert big[0] == pytest.approx(1e6 / (2e6 + 1))
    assert effective_weights({0: 0.0, 1: 0.0}, 100.0) == {0: 0.0, 1: 0.0}


# ---------------------------------------------------------------- whole rounds

HONEST = 8
N = 200


async def _attack_round(services, group, tensors, weights, **kw):
    results = await run_all(services, group, tensors, weights, timeout=30, **kw)
    return results


def _honest_peers(group):
    return set(group.members[:HONEST])


@pytest.mark.parametrize("attacker_mode", ["node", "client"])
async def test_weight_bomb_never_makes_honest_tensors_non_finite(autojump_clock, attacker_mode):
    async with swarm(HONEST + 1, chunk_numel=64) as services:
        group = make_group(services, ["node"] * HONEST + [attacker_mode])
        tensors = [[torch.randn(N)] for _ in range(HONEST)] + [[torch.full((N,), 1e30)]]
        weights = [1.0] * HONEST + [MAX_WEIGHT]
        results = await _attack_round(services, group, tensors, weights)
        # the attacker's weight is clipped to 100 x the median (1): share 100/108
        want = (sum(t[0].double() for t in tensors[:HONEST]) + 100 * 1e30) / (HONEST + 100)
        for r in results:  # the attacker's own result is exactly as finite as everyone's
            assert all_finite(r.averaged[0])
            assert torch.allclose(r.averaged[0].double(), want, rtol=1e-5)
            assert not r.failed_peers, r.failure_reasons
            assert r.averaged_fraction == 1.0
            assert r.deviation is not None and math.isfinite(r.deviation)
        # the honest members go on averaging among themselves (their values are now ~1e30)
        current = [[r.averaged[0].clone()] for r in results[:HONEST]]
        for _ in range(8):
            group = make_group(services[:HONEST])
            rounds = await run_all(services[:HONEST], group, current, timeout=30)
            for r in rounds:
                assert all_finite(r.averaged[0]) and not r.failed_peers
                assert r.averaged_fraction == 1.0
            current = [[r.averaged[0].clone()] for r in rounds]


async def test_overflowing_deviation_blames_nobody(autojump_clock):
    n = 80_000  # parts of 10k elements: ||x||^2 of a chunk of 3e17 overflows float32
    async with swarm(HONEST + 1) as services:
        group = make_group(services, ["node"] * HONEST + ["client"])
        tensors = [[torch.randn(n)] for _ in range(HONEST)] + [[torch.full((n,), 3e17)]]
        results = await _attack_round(services, group, tensors, None)
        want = sum(t[0].double() for t in tensors) / (HONEST + 1)
        for r in results:
            assert not r.failed_peers and not r.excluded, (r.failure_reasons, r.excluded)
            assert r.averaged_fraction == 1.0
            assert torch.allclose(r.averaged[0].double(), want, rtol=1e-5)
            assert math.isfinite(r.deviation) and r.deviation > 1e34


class _Exploding(Aggregator):
    """Produces +Inf for every chunk that contains the value 7 (a buggy or overflowing
    aggregator: the reducer must not pass such a result on)."""

    def begin(self, numel: int) -> ChunkAggregation:
        inner = WeightedMean().begin(numel)

        class Chunk(ChunkAggregation):
            def add(self, values, weight):
                self.seven = getattr(self, "seven", False) or bool((values == 7).any())
                inner.add(values, weight)
                self.contributors = inner.contributors

            def result(self):
                mean, dev = inner.result()
                return (torch.full_like(mean, math.inf) if self.seven else mean), dev

        return Chunk(numel)


async def test_non_finite_aggregate_is_withheld_and_everyone_keeps_local_values(
    autojump_clock, caplog
):
    async with swarm(3, chunk_numel=8) as services:
        group = make_group(services)
        tensors = [[torch.randn(30)] for _ in range(3)]
        bounds = part_bounds(group, 30)
        a1, b1 = bounds[1]
        tensors[0][0][a1] = 7.0  # poisons the first chunk of part 1 (reduced by member 1)
        with caplog.at_level(logging.WARNING, logger="moshpit.averaging.allreduce_reducer"):
            results = await run_all(services, group, tensors, timeout=30, aggregation=_Exploding())
        assert "aggregated to NaN/Inf" in caplog.text
        mean = sum(t[0] for t in tensors) / 3
        first = slice(a1, a1 + 8)
        for i, r in enumerate(results):
            out = r.averaged[0]
            assert all_finite(out)
            assert torch.equal(out[first], tensors[i][0][first])  # withheld chunk: local values
            rest = torch.ones(30, dtype=torch.bool)
            rest[first] = False
            assert torch.allclose(out[rest], mean[rest], atol=1e-5)
            assert not r.failed_peers and not r.excluded  # nobody is blamed for it
            assert r.averaged_numel == 30 - 8


async def test_narrow_output_dtype_never_overflows(autojump_clock, caplog):
    """A finite float32 mean can exceed float16's range: that member keeps its local values
    there (and does not count them as averaged) instead of writing Inf."""
    async with swarm(2) as services:
        group = make_group(services)
        tensors = [[torch.ones(10, dtype=torch.float16)], [torch.full((10,), 1e6)]]
        tensors[1][0][:5] = 1.0  # half of the mean stays in float16's range
        with caplog.at_level(logging.WARNING, logger="moshpit.averaging.allreduce"):
            results = await run_all(services, group, tensors, timeout=30)
        out16 = results[0].averaged[0]
        assert out16.dtype == torch.float16 and all_finite(out16)
        assert torch.equal(out16[:5], torch.ones(5, dtype=torch.float16))  # (1 + 1) / 2
        assert torch.equal(out16[5:], tensors[0][0][5:])  # 5e5 > 65504: local values
        assert results[0].averaged_numel == 5
        assert torch.allclose(results[1].averaged[0][5:], torch.full((5,), 5e5 + 0.5))
        assert results[1].averaged_numel == 10
        assert "overflow this member's torch.float16 tensor" in caplog.text


def test_max_weight_ratio_is_validated():
    from moshpit.averaging.allreduce import AllReduceService

    for bad in (0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_weight_ratio"):
            AllReduceService(object(), max_weight_ratio=bad, register=False)
    assert DEFAULT_MAX_WEIGHT_RATIO >= 10


async def test_weight_bomb_through_averager_steps(autojump_clock):
    """The issue's scenario end to end: 8 honest Averagers and one that holds 1e30 and steps
    with weight=1e9; afterwards the honest ones keep stepping without it (before the fix:
    0/8 honest rounds, every step raised on NaN/Inf local tensors)."""
    from tests.averaging.test_step_result import averager_swarm

    async with averager_swarm(HONEST + 1) as averagers:
        with averagers[HONEST].get_tensors() as ts:
            ts[0].fill_(1e30)
        results = [None] * (HONEST + 1)

        async def step(i, weight):
            results[i] = await averagers[i].astep(weight=weight)

        async with trio.open_nursery() as nursery:
            for i in range(HONEST + 1):
                nursery.start_soon(step, i, MAX_WEIGHT if i == HONEST else 1.0)
        assert all(r.succeeded and r.group_size == HONEST + 1 for r in results), results
        honest = averagers[:HONEST]
        honest_ids = {a._host.peer_id for a in honest}
        for a, r in zip(honest, results, strict=False):
            assert all_finite(a._tensors[0]) and not (r.failed & honest_ids)
        for _ in range(8):
            async with trio.open_nursery() as nursery:
                for i in range(HONEST):
                    nursery.start_soon(step, i, 1.0)
            for a, r in zip(honest, results, strict=False):
                assert r.succeeded and r.group_size == HONEST, r.reason
                assert r.averaged_fraction == 1.0 and not r.failed
                assert all_finite(a._tensors[0])
                assert not any(a._is_banned(p) for p in honest_ids)
