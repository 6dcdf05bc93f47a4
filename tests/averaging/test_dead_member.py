"""A member that dies at the start of an all-reduce costs its group no more than noticing it.

Real Hosts on the in-memory network (MockClock with autojump: the timeouts cost no wall time).
Killing a member's address breaks its connections at once, as a process exit does: the
survivors' streams from and to it are reset, and new connections to it are refused. Before,
neither reached the survivors' reducers: a stream reset before the dead member's hello only
logged "bad all-reduce hello", a refused connection only failed our part at its reducer, and
every reducer left the dead sender out when ``sender_timeout`` ran out ("sender N stalled on
chunk 0"), so the whole group waited for it: 20 s after the death at every kill moment below,
where the round itself takes milliseconds. A sender that stalls silently (connected, sending
nothing) still waits out the timeout: tests/averaging/test_allreduce_failures.py.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.lowlevel

from dht.p2p import MemoryNetwork
from moshpit.averaging.partition import part_bounds
from tests.averaging.test_allreduce import make_group, run_all, swarm, weighted_mean

SENDER_TIMEOUT = 20.0  # the averager's default
MEMBERS = 8
DEAD = 3
NUMEL = 800


async def _round_with_a_death(kill_after: float, connected: bool):
    """All members start a round; ``kill_after`` seconds after the dead member's round began,
    its address is killed and its run cancelled (a process that died). ``connected``: the
    members averaged once before (as after matchmaking, their connections are open)."""
    net = MemoryNetwork(latency=0.005)
    async with swarm(MEMBERS, net=net, chunk_numel=NUMEL // 4) as services:
        if connected:
            warm = [[torch.zeros(NUMEL)] for _ in range(MEMBERS)]
            await run_all(services, make_group(services), warm, timeout=10)
        group = make_group(services)
        tensors = [[torch.randn(NUMEL)] for _ in range(MEMBERS)]
        results: list = [None] * MEMBERS
        finished = [0.0] * MEMBERS
        killed_at: list[float] = []

        async def one(i: int) -> None:
            results[i] = await services[i].run(
                group, tensors[i], timeout=60, sender_timeout=SENDER_TIMEOUT
            )
            finished[i] = trio.current_time()

        async def dies() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, DEAD)
                with trio.fail_after(5):
                    while not services[DEAD]._rounds:
                        await trio.lowlevel.checkpoint()
                await trio.sleep(kill_after)
                killed_at.append(trio.current_time())
                net.kill(services[DEAD].host.listen_addrs[0])
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dies)
            for i in range(MEMBERS):
                if i != DEAD:
                    nursery.start_soon(one, i)
        return group, tensors, results, finished, killed_at[0]


@pytest.mark.parametrize(
    "connected, kill_after",
    [(True, 0.0), (True, 0.001), (True, 0.004), (True, 0.008), (False, 0.0), (False, 0.006)],
)
async def test_survivors_finish_soon_after_a_member_dies_at_the_start(
    connected, kill_after, autojump_clock
):
    group, tensors, results, finished, killed_at = await _round_with_a_death(kill_after, connected)
    survivors = [i for i in range(MEMBERS) if i != DEAD]
    took = max(finished[i] for i in survivors) - killed_at
    assert took < 1.0, (took, results[survivors[0]].failure_reasons)
    dead = group.members[DEAD]
    without = weighted_mean(tensors, [1.0] * MEMBERS, survivors)[0]
    everyone = weighted_mean(tensors, [1.0] * MEMBERS, list(range(MEMBERS)))[0]
    bounds = part_bounds(group, NUMEL)
    for i in survivors:
        r = results[i]
        assert dead in r.failed_senders and dead in r.failed_reducers, r.failure_reasons
        assert not r.timed_out
        out = r.averaged[0].double()
        for j, (a, b) in enumerate(bounds):
            if j == DEAD:  # its reducer is dead: the part keeps local values
                assert torch.equal(r.averaged[0][a:b], tensors[i][0][a:b])
                continue
            # per-chunk semantics: a chunk the dead member delivered before dying holds it
            for lo in range(a, b, NUMEL // 4):
                hi = min(b, lo + NUMEL // 4)
                got = out[lo:hi]
                assert torch.allclose(got, without[lo:hi], atol=1e-6) or torch.allclose(
                    got, everyone[lo:hi], atol=1e-6
                ), (i, j, lo)
        # every survivor got the same result for every part the survivors reduced
        first = results[survivors[0]].averaged[0]
        keep = torch.ones(NUMEL, dtype=torch.bool)
        keep[slice(*bounds[DEAD])] = False
        assert torch.equal(r.averaged[0][keep], first[keep])
    if kill_after == 0.0:  # dead before its first chunk got anywhere: the survivors' mean
        a, b = bounds[DEAD]
        got = results[survivors[0]].averaged[0].double()
        assert torch.allclose(got[:a], without[:a], atol=1e-6)
        assert torch.allclose(got[b:], without[b:], atol=1e-6)
