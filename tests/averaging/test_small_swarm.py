"""Small swarms do not wait for peers that are not there (issue 12, item 16).

A leader starts as soon as every peer declared under its group key has joined it, instead of
waiting ``min_matchmaking_time`` for a ``target_group_size`` that the swarm cannot fill. Time
here is trio's virtual clock (deterministic), not wall time.
"""

from __future__ import annotations

import pytest
import torch
import trio

from dht.kademlia.clock import dht_clock, trio_clock
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork
from dht.p2p.identity import Identity
from moshpit.averaging.averager import Averager
from moshpit.averaging.matchmaking import Declaration, Matchmaker
from tests.averaging.test_matchmaking import LocalBackend, LocalNet, make, run_all

EARLY = dict(start_when_all_joined=True)  # what the averager sets for keys without grid bits


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


async def test_three_matchmakers_with_target_16_start_at_once(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.05)
        mms = make(net, 3, target_group_size=16, min_matchmaking_time=5.0, **EARLY)
        results, finished = await run_all(mms, ["run.0b"] * 3, starts=[0.0, 0.01, 0.02])
        assert all(g is not None and g.size == 3 for g in results.values())
        assert len({g.group_id for g in results.values()}) == 1
        # virtual seconds: the leader did not wait for the 13 peers that do not exist
        assert max(finished.values()) < 1.0
        nursery.cancel_scope.cancel()


async def test_without_the_option_a_leader_waits_min_matchmaking_time(autojump_clock):
    """Grid keys (the default for a bare Matchmaker) keep waiting for the rest of the line."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.05)
        mms = make(net, 3, target_group_size=16, min_matchmaking_time=5.0)
        results, finished = await run_all(mms, ["run.0b01"] * 3)
        assert all(g is not None and g.size == 3 for g in results.values())
        assert 5.0 <= min(finished.values()) < 6.0
        nursery.cancel_scope.cancel()


async def test_a_declared_peer_that_never_joins_costs_at_most_min_matchmaking_time(
    autojump_clock,
):
    """A peer declared under the key that does not join (it follows someone else, left, or
    its record is stale) keeps the leader waiting, but only up to min_matchmaking_time."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.05)
        phantom = Identity.generate().peer_id  # last in the order: nobody asks it to lead
        net.directory["run.0b"][phantom] = (Declaration(phantom, 1e6, (), "node"), 1e9, 0.0)
        mms = make(net, 3, target_group_size=16, min_matchmaking_time=2.0, **EARLY)
        results, finished = await run_all(mms, ["run.0b"] * 3)
        assert all(g is not None and g.size == 3 for g in results.values())
        assert 2.0 <= min(finished.values()) < 3.0
        nursery.cancel_scope.cancel()


class JoinDuringReadBackend(LocalBackend):
    """The leader's read after its first join lasts until the second follower has joined."""

    matchmaker: Matchmaker | None = None
    stalled = False

    async def list_candidates(self, key):
        rnd = self.matchmaker._round
        if rnd is not None and rnd.joins == 1 and not self.stalled:
            self.stalled = True
            with trio.move_on_after(2.0):
                while rnd.joins < 2:
                    await rnd.changed.wait()  # set (and replaced) on every join
        return await super().list_candidates(key)


async def test_a_join_during_a_read_is_not_missed(autojump_clock):
    """A follower that joins while the leader reads the key wakes the leader at once (the
    read itself is not trusted: it may predate that follower's declaration); without that
    the leader slept until its next poll (poll_interval, 0.25 s here)."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.0)  # records visible once stored
        kwargs = dict(target_group_size=16, min_matchmaking_time=5.0, request_timeout=1.0, **EARLY)
        backend = JoinDuringReadBackend(net)
        leader = backend.matchmaker = Matchmaker(backend, "run", **kwargs)
        mms = [leader, *make(net, 2, **kwargs)]
        assert leader.poll_interval == 0.25
        results, finished = await run_all(mms, ["run.0b"] * 3, starts=[0.0, 0.05, 0.1])
        assert backend.stalled
        assert all(g is not None and g.size == 3 for g in results.values())
        assert max(finished.values()) < 0.1 + leader.poll_interval
        nursery.cancel_scope.cancel()


async def test_ten_steps_of_three_averagers_with_target_16(autojump_clock, virtual_dht_time):
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(3, memory_network=net, seed=7, rpc_timeout=1.0) as swarm:
        averagers = [
            Averager(
                [torch.full((4,), float(i))],
                dht=node,
                prefix="small",
                target_group_size=16,
                min_matchmaking_time=5.0,
                request_timeout=1.0,
                allreduce_timeout=10.0,
            )
            for i, node in enumerate(swarm.nodes)
        ]
        try:
            t0 = trio.current_time()

            async def one(i: int, results: list) -> None:
                results[i] = await averagers[i].astep()

            for _ in range(10):
                results: list = [None] * 3
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i, results)
                assert all(r.succeeded and r.group_size == 3 for r in results), [
                    (r.reason, r.group_size) for r in results
                ]
                assert max(r.matchmaking_seconds for r in results) < 1.0
            # ten rounds in less virtual time than one min_matchmaking_time (was 10 x 5 s)
            assert trio.current_time() - t0 < 5.0
            for av in averagers:
                with av.get_tensors() as (t,):
                    assert torch.allclose(t, torch.full((4,), 1.0))
        finally:
            for av in averagers:
                av.shutdown()
