"""Moshpit All-Reduce end to end on the in-memory network under MockClock.

Real DHT nodes (Kademlia over Noise+yamux Hosts on dht.p2p.MemoryNetwork), real matchmaking
and the real butterfly all-reduce; virtual time makes the timeouts free.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from dht.kademlia.clock import dht_clock, trio_clock
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork
from moshpit.averaging.averager import Averager


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


def make_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, generator=g) * 10, torch.randn(3, 5, generator=g) + seed]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


@asynccontextmanager
async def moshpit_swarm(
    n: int, bits: list[str] | None = None, latency: float = 0.002, **kwargs
) -> AsyncIterator[tuple[list[Averager], object]]:
    net = MemoryNetwork(latency=latency)
    params = dict(
        prefix="test",
        target_group_size=4,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=10.0,
    )
    params.update(kwargs)
    async with open_swarm(n, memory_network=net, seed=3, rpc_timeout=1.0) as swarm:
        averagers = [
            Averager(
                make_tensors(i),
                dht=node,
                initial_group_bits=bits[i] if bits else None,
                **params,
            )
            for i, node in enumerate(swarm.nodes)
        ]
        try:
            yield averagers, swarm
        finally:
            for a in averagers:
                a.shutdown()


async def step_all(averagers, weights=None, **kwargs):
    results = [None] * len(averagers)

    async def one(i):
        w = 1.0 if weights is None else weights[i]
        results[i] = await averagers[i].astep(weight=w, **kwargs)

    async with trio.open_nursery() as nursery:
        for i, a in enumerate(averagers):
            if a is not None:
                nursery.start_soon(one, i)
    return results


def stats(averagers, weights=None):
    xs = torch.stack([flat(a._tensors) for a in averagers])
    w = torch.ones(len(averagers)) if weights is None else torch.tensor(weights)
    mean = (xs * w[:, None]).sum(0) / w.sum()
    variance = ((xs - mean) ** 2 * w[:, None]).sum() / w.sum()
    spread = (xs - mean).abs().max()
    return mean, float(variance), float(spread)


@pytest.mark.parametrize(
    "n, m, rounds",
    [(16, 4, 2), (8, 2, 3)],
    ids=["16 peers 4x4 grid", "8 peers 2x2x2 grid"],
)
async def test_exact_average_on_a_full_grid(autojump_clock, virtual_dht_time, n, m, rounds):
    bits = [format(i % 4, "02b") for i in range(n)]  # 2 key bits in both grids
    async with moshpit_swarm(n, bits, target_group_size=m) as (averagers, _):
        mean0, var0, _ = stats(averagers)
        variances = [var0]
        for r in range(rounds):
            t0 = trio.current_time()
            results = await step_all(averagers)
            assert all(res.succeeded and res.group_size == m for res in results), [
                (res.reason, res.group_size) for res in results
            ]
            assert not any(res.failed for res in results)
            # full groups do not wait for min_matchmaking_time
            assert max(res.matchmaking_seconds for res in results) < 1.0
            assert trio.current_time() - t0 < 2.0
            # groups are exactly the grid lines: members shared the key
            by_group = {}
            for res in results:
                by_group.setdefault(res.group_id, set()).add(res.group_key)
            assert all(len(keys) == 1 for keys in by_group.values())
            mean, var, spread = stats(averagers)
            assert torch.allclose(mean, mean0, atol=1e-4)  # mean preserved every round
            assert var <= variances[-1] + 1e-6  # variance never increases
            variances.append(var)
            if r < rounds - 1:
                assert spread > 1e-3  # not exact before d rounds
        _, var, spread = stats(averagers)
        assert spread < 1e-4, f"not the exact mean after {rounds} rounds: spread {spread}"
        for a in averagers:
            with a.get_tensors() as ts:
                assert torch.allclose(flat(ts), mean0, atol=1e-4)


async def test_weighted_average(autojump_clock, virtual_dht_time):
    weights = [1.0, 2.0, 3.0, 0.5]
    async with moshpit_swarm(4, ["0"] * 4, target_group_size=4) as (averagers, _):
        want, _, _ = stats(averagers, weights)
        results = await step_all(averagers, weights)
        assert all(r.succeeded and r.group_size == 4 for r in results)
        for a in averagers:
            assert torch.allclose(flat(a._tensors), want, atol=1e-4)


async def test_gathered_metadata_reaches_everyone(autojump_clock, virtual_dht_time):
    async with moshpit_swarm(3, ["1"] * 3, target_group_size=3) as (averagers, _):
        results = [None] * 3

        async def one(i):
            results[i] = await averagers[i].astep(gather={"samples": 10 * i})

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        for r in results:
            assert sorted(v["samples"] for v in r.gathered.values()) == [0, 10, 20]


async def test_group_smaller_than_target_when_peers_are_missing(autojump_clock, virtual_dht_time):
    async with moshpit_swarm(3, ["01"] * 3, target_group_size=4, min_matchmaking_time=2.0) as (
        averagers,
        _,
    ):
        mean0, _, _ = stats(averagers)
        results = await step_all(averagers)
        assert all(r.succeeded and r.group_size == 3 for r in results)
        assert min(r.matchmaking_seconds for r in results) >= 2.0 - 1e-6
        _, _, spread = stats(averagers)
        assert spread < 1e-4


async def test_alone_step_returns_after_its_timeout(autojump_clock, virtual_dht_time):
    async with moshpit_swarm(2, ["0", "1"], target_group_size=2) as (averagers, _):
        before = flat(averagers[0]._tensors).clone()
        t0 = trio.current_time()
        result = await averagers[0].astep(timeout=3.0)
        assert not result.succeeded
        assert "no group" in result.reason
        assert 3.0 - 1e-6 <= trio.current_time() - t0 <= 3.5
        assert torch.equal(flat(averagers[0]._tensors), before)
        assert result.next_group_key != "" and len(result.next_group_key) == len(result.group_key)


async def test_client_and_auxiliary_peers(autojump_clock, virtual_dht_time):
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(4, memory_network=net, seed=4, rpc_timeout=1.0) as swarm:
        common = dict(prefix="mixed", target_group_size=4, min_matchmaking_time=2.0,
                      request_timeout=1.0, initial_group_bits="")  # fmt: skip
        nodes = swarm.nodes
        averagers = [
            Averager(make_tensors(0), dht=nodes[0], **common),
            Averager(make_tensors(1), dht=nodes[1], **common),
            Averager(make_tensors(2), dht=nodes[2], client_mode=True, **common),
            Averager([torch.zeros(16), torch.zeros(3, 5)], dht=nodes[3], auxiliary=True, **common),
        ]
        contributors = averagers[:3]
        want, _, _ = stats(contributors)
        aux_before = flat(averagers[3]._tensors).clone()
        results = await step_all(averagers)
        assert all(r.succeeded for r in results), [r.reason for r in results]
        assert sorted(results[0].modes) == ["aux", "client", "node", "node"]
        for a in contributors:
            assert torch.allclose(flat(a._tensors), want, atol=1e-4)
        assert torch.equal(flat(averagers[3]._tensors), aux_before)  # aux keeps its own
        for a in averagers:
            a.shutdown()


async def test_shutdown_cancels_a_running_step(autojump_clock, virtual_dht_time):
    async with moshpit_swarm(2, ["0", "1"], target_group_size=2) as (averagers, _):
        result = {}

        async def stepper():
            result["r"] = await averagers[0].astep()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stepper)
            await trio.sleep(1.0)
            averagers[0].shutdown()
        assert not result["r"].succeeded and "shut down" in result["r"].reason
        with pytest.raises(RuntimeError):
            await averagers[0].astep()


async def test_churn_converges_geometrically(autojump_clock, virtual_dht_time):
    """64 peers, groups of 4, ~8% of the peers failing each round: the error still shrinks
    geometrically.

    The error is the variance around the mean (what the Moshpit paper bounds). Not the largest
    deviation: under churn a key can hold a single live peer, which then keeps its value for
    that round, so the max deviation stalls whenever the worst peer is alone twice in a row
    (random group IDs and peer IDs make that happen in about one run in four).
    """
    rng = random.Random(7)
    n = 64
    bits = [format(i % 16, "04b") for i in range(n)]  # 4x4x4 grid
    async with moshpit_swarm(
        n, bits, target_group_size=4, min_matchmaking_time=1.0, allreduce_timeout=5.0
    ) as (averagers, swarm):
        alive = list(range(n))
        _, variance0, spread0 = stats(averagers)
        variances, spreads = [variance0], [spread0]
        for _ in range(5):
            # ~8% of the live peers drop out for good this round
            victims = rng.sample(alive, max(1, round(0.08 * len(alive))))
            for v in victims:
                averagers[v].shutdown()
                swarm.kill(swarm.nodes[v])
                alive.remove(v)
            await step_all([averagers[i] if i in alive else None for i in range(n)])
            _, variance, spread = stats([averagers[i] for i in alive])
            variances.append(variance)
            spreads.append(spread)
        # random groups of 4 would give ~0.25 per round. Measured over 24 runs: geometric mean
        # 0.14-0.24, single rounds 0.07-0.78. The late rounds vary most: by then the variance
        # left is mostly that of the few peers whom churn left alone in their group (they keep
        # their values), so one such round can shrink it little; 2 runs in 24 had a round above
        # 0.7 (one failed CI). The claims are geometric shrinking overall and no round growing
        # the error (the Moshpit All-Reduce paper)
        ratios = [b / a for a, b in zip(variances, variances[1:], strict=False)]
        geometric_mean_ratio = (variances[-1] / variances[0]) ** (1 / (len(variances) - 1))
        assert geometric_mean_ratio < 0.35, ratios
        assert max(ratios) < 1.0, ratios
        # every live peer moved towards the mean (measured: 0.02x-0.12x after 5 rounds)
        assert spreads[-1] < spreads[0] * 0.5, spreads


async def test_client_mode_dht_node_averages_as_a_client(autojump_clock, virtual_dht_time):
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(2, memory_network=net, seed=5, rpc_timeout=1.0) as swarm:
        client_node = await swarm.add(initial=[swarm.nodes[0]], client_mode=True)
        common = dict(prefix="cm", target_group_size=3, min_matchmaking_time=2.0,
                      request_timeout=1.0, initial_group_bits="")  # fmt: skip
        averagers = [Averager(make_tensors(i), dht=n, **common) for i, n in enumerate(swarm.nodes)]
        assert averagers[2].mode == "client" and averagers[0].mode == "node"
        want, _, _ = stats(averagers)
        results = await step_all(averagers)
        assert all(r.succeeded and r.group_size == 3 for r in results), [r.reason for r in results]
        assert sorted(results[0].modes) == ["client", "node", "node"]
        for a in averagers:
            assert torch.allclose(flat(a._tensors), want, atol=1e-4)
            a.shutdown()
        assert client_node.client_mode
