"""What a round reports about this peer (issue 12, items 13 and the all-reduce half of 9).

``succeeded`` must mean "at least one element was averaged with another peer's contribution"
and ``averaged_fraction`` how much; a peer that the reducers refused must learn it (the
refusal says so, its result names the reason, a warning is logged) instead of reporting
success with its values unchanged. Real Hosts on the in-memory network under MockClock; the
Averager tests run real DHT nodes and matchmaking as in test_moshpit.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from dht.kademlia.clock import dht_clock, trio_clock
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork
from moshpit.averaging.allreduce_protocol import all_finite
from moshpit.averaging.averager import HARD_STEP_SLACK, Averager
from moshpit.averaging.partition import part_bounds
from tests.averaging.test_allreduce import make_group, run_all, swarm, weighted_mean
from tests.averaging.test_allreduce_failures import chunk_of, drive_sender

# ---------------------------------------------------------------- AllReduceService level


async def test_dead_reducer_leaves_a_partial_fraction(autojump_clock):
    async with swarm(4, chunk_numel=8) as services:
        group = make_group(services)
        tensors = [[torch.randn(40)] for _ in range(4)]
        results = await run_all(
            services, group, tensors, skip=[3], timeout=20, sender_timeout=2, reducer_timeout=3
        )
        a3, b3 = part_bounds(group, 40)[3]
        for r in results[:3]:
            assert r.averaged_numel == 40 - (b3 - a3) and r.numel == 40
            assert 0 < r.averaged_fraction < 1
            assert r.why_not_averaged() is None


async def test_alone_in_the_group_averages_nothing(autojump_clock):
    """The others never show up: our own part holds only our contribution, the others' parts
    fail. The old result looked like a normal round; now nothing counts as averaged."""
    async with swarm(3, chunk_numel=8) as services:
        group = make_group(services)
        tensors = [[torch.randn(24)] for _ in range(3)]
        results = await run_all(
            services, group, tensors, skip=[1, 2], timeout=20, sender_timeout=2, reducer_timeout=3
        )
        r = results[0]
        assert torch.equal(r.averaged[0], tensors[0][0])
        assert r.averaged_numel == 0 and r.averaged_fraction == 0.0
        reason = r.why_not_averaged()
        assert reason.startswith("nothing was averaged with another peer: ")
        assert "stalled" in reason


async def test_zero_weight_member_takes_the_others_mean(autojump_clock):
    """Weight 0 contributes nothing, but its values are replaced by the others' mean (so it
    averaged); a member whose result contains only its own contribution did not."""
    async with swarm(3, chunk_numel=8) as services:
        group = make_group(services)
        tensors = [[torch.randn(24)] for _ in range(3)]
        results = await run_all(services, group, tensors, [1.0, 0.0, 0.0], timeout=20)
        for r in results:
            assert torch.allclose(r.averaged[0], tensors[0][0])
        assert results[0].averaged_numel == 0  # nobody else had weight: its own values
        assert results[1].averaged_fraction == results[2].averaged_fraction == 1.0


async def test_excluded_sender_learns_why_and_warns(autojump_clock, caplog):
    """Member 3's tensors have 12 elements, the group's 10: every reducer refuses it and tells
    it so; it reports nothing averaged with the reason and does not blame the reducers."""
    async with swarm(4) as services:
        group = make_group(services, ["node", "node", "node", "client"])
        tensors = [[torch.randn(10)] for _ in range(3)] + [[torch.randn(12)]]
        with caplog.at_level(logging.WARNING, logger="moshpit.averaging.allreduce"):
            results = await run_all(services, group, tensors, timeout=20, sender_timeout=2)
        bad, honest = results[3], results[:3]
        assert set(bad.left_out_by) == set(group.members[:3])
        assert all(
            why == "flat size 12 != ours 10 (different tensors)" for why in bad.left_out_by.values()
        )
        assert not bad.failed_reducers  # the fault was its own
        assert bad.averaged_numel == 0 and torch.equal(bad.averaged[0], tensors[3][0])
        reason = bad.why_not_averaged()
        assert (
            reason
            == "this peer was left out by 3 reducer(s): flat size 12 != ours 10 (different tensors)"
        )
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert any(
            "3 of 3 reducers left this member's contribution out" in rec.getMessage()
            and "flat size 12" in rec.getMessage()
            for rec in warnings
        )
        want = weighted_mean(tensors, [1.0] * 4, [0, 1, 2])[0]
        for r in honest:
            assert "flat size 12 != ours 10" in r.excluded[group.members[3]]
            assert torch.allclose(r.averaged[0].double(), want, atol=1e-5)
            assert r.averaged_fraction == 1.0


async def test_stalled_sender_is_told_it_was_left_out(autojump_clock):
    async with swarm(3, chunk_numel=8) as services:
        group = make_group(services, ["node", "node", "client"])
        tensors = [[torch.randn(16)] for _ in range(3)]
        replies = {}

        async def staller():  # member 2: hello to reducer 0, then nothing
            replies["r"] = await drive_sender(services[2], group, 0, 16, [])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(staller)
            await run_all(services, group, tensors, skip=[2], timeout=20, sender_timeout=2)
        error = replies["r"][-1]
        assert error["t"] == "error" and error["left_out"] is True
        assert error["reason"].startswith("stalled: chunk 0 not received")


async def test_unknown_group_refusal_is_not_a_left_out(autojump_clock):
    """A reducer that never ran the round failed on its own: the sender counts it as a failed
    reducer (not as having left us out)."""
    async with swarm(2, accept_timeout=1.0) as services:
        group = make_group(services)
        replies = await drive_sender(services[1], group, 0, 4, [])
        assert replies[-1] == {"t": "error", "reason": "unknown group (or no hello in time)"}


# ---------------------------------------------------------------- Averager.step level


@asynccontextmanager
async def averager_swarm(n: int, **kw) -> AsyncIterator[list[Averager]]:
    params = dict(
        prefix="stepresult",
        target_group_size=n,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=10.0,
        initial_group_bits="",
    )
    params.update(kw)
    with dht_clock(trio_clock):
        net = MemoryNetwork(latency=0.002)
        async with open_swarm(n, memory_network=net, seed=7, rpc_timeout=1.0) as dht_swarm:
            averagers = [
                Averager([torch.randn(31) + i], dht=node, **params)
                for i, node in enumerate(dht_swarm.nodes)
            ]
            try:
                yield averagers
            finally:
                for a in averagers:
                    a.shutdown()


async def _step_all(averagers, **kw):
    results = [None] * len(averagers)

    async def one(i):
        results[i] = await averagers[i].astep(**kw)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return results


async def test_frozen_peer_step_result(autojump_clock):
    """One peer freezes after matchmaking (as under SIGSTOP) and resumes after the others
    finished: they report a partial round, it reports that nothing was averaged."""
    async with averager_swarm(4) as averagers:
        before = averagers[3]._tensors[0].clone()

        async def freeze(group):
            await trio.sleep(40.0)

        averagers[3]._before_allreduce = freeze
        results = await _step_all(averagers)
        frozen = averagers[3]._host.peer_id
        for r in results[:3]:
            assert r.succeeded and r.reason is None
            assert 0 < r.averaged_fraction < 1  # the frozen peer's part stayed local
            assert frozen in r.failed
        r = results[3]
        assert r.group_size == 4
        assert not r.succeeded and r.averaged_fraction == 0.0
        assert r.reason.startswith("nothing was averaged with another peer")
        assert torch.equal(averagers[3]._tensors[0], before)
        for a in averagers:
            assert all_finite(a._tensors[0])


async def test_excluded_peer_step_result(autojump_clock, caplog):
    """A peer whose all-reduce settings differ (chunk size) is grouped but refused by every
    reducer: its step says so instead of succeeding with unchanged values."""
    async with averager_swarm(4) as averagers:
        averagers[3]._allreduce.chunk_numel = 8  # a different chunk_numel setting
        before = averagers[3]._tensors[0].clone()
        with caplog.at_level(logging.WARNING, logger="moshpit.averaging.allreduce"):
            results = await _step_all(averagers)
        r = results[3]
        assert r.group_size == 4
        assert not r.succeeded and r.averaged_fraction == 0.0
        assert r.reason.startswith("this peer was left out by 3 reducer(s): chunk size 8 != ours")
        assert torch.equal(averagers[3]._tensors[0], before)
        assert "3 of 3 reducers left this member's contribution out" in caplog.text
        excluded = averagers[3]._host.peer_id
        for other in results[:3]:
            assert other.succeeded and excluded in other.excluded
            assert other.averaged_fraction < 1  # its part stayed local for them
        # it refused their chunks in its own part for the same mismatch (symmetric, and true
        # from its point of view), but does not count their refusals as their failures
        assert r.failed == set(r.excluded)
        assert all("different chunk_numel settings" in why for why in r.excluded.values())


def test_result_contributor_count_is_validated():
    """``n`` is what a receiver's averaged_fraction rests on: out of range, or inconsistent
    with the payload, it is a protocol violation of the reducer."""
    import pytest

    from compression import NoCompression
    from moshpit.averaging.allreduce_protocol import ProtocolError, parse_result, result_msg

    ct = NoCompression().compress(torch.ones(4))
    assert parse_result(result_msg(0, ct, 0.5, 3), 0, 4).contributors == 3
    assert parse_result(result_msg(0, None, 0.0, 0), 0, 4).ct is None
    for bad in (result_msg(0, ct, 0.0, 0), result_msg(0, None, 0.0, 2)):
        with pytest.raises(ProtocolError, match="contributors must"):
            parse_result(bad, 0, 4)
    for n in (-1, 1 << 17, 1.0, True):
        with pytest.raises(ProtocolError, match="contributors"):
            parse_result({**result_msg(0, ct, 0.0, 1), "n": n}, 0, 4)
    old = {k: v for k, v in result_msg(0, ct, 0.0, 1).items() if k != "n"}  # a v1 result
    with pytest.raises(ProtocolError, match="fields"):
        parse_result(old, 0, 4)


async def test_a_step_that_would_wait_forever_is_abandoned(autojump_clock, caplog):
    """The safety net: whatever a step gets stuck in (here the test hook, forever), a step
    without ``timeout`` ends after its phases' timeouts plus slack, with a reason and an
    ERROR, and the averager can step again."""
    async with averager_swarm(2) as averagers:

        async def stuck(group):
            await trio.sleep_forever()

        averagers[1]._before_allreduce = stuck
        start = trio.current_time()
        with caplog.at_level(logging.ERROR, logger="moshpit.averaging.averager"):
            results = await _step_all(averagers)
        bound = averagers[1]._hard_step_bound() + HARD_STEP_SLACK
        r = results[1]
        assert not r.succeeded and r.timed_out
        assert r.reason == f"step abandoned after {bound:.0f}s"
        assert trio.current_time() - start == pytest.approx(bound, abs=1.0)
        assert "abandoned" in caplog.text
        averagers[1]._before_allreduce = None
        again = await _step_all(averagers)
        assert all(res.succeeded for res in again)


# ---------------------------------------------------------------- missing contributors


async def test_every_survivor_names_a_sender_missing_from_any_part(autojump_clock):
    """Member 3 (a client: it reduces nothing) delivers all of part 0 and then dies before
    sending anything to parts 1 and 2. Member 0's own part holds it, but the parts it gets
    back from reducers 1 and 2 do not: member 0 must still name member 3 as missing (it
    used to report no failure at all), and so must every survivor, whose reports agree with
    the contributor counts the reducers sent."""
    async with swarm(4, chunk_numel=4) as services:
        group = make_group(services, ["node", "node", "node", "client"])
        total = 24
        tensors = [[torch.randn(total)] for _ in range(4)]
        (a0, b0), _, _, _ = part_bounds(group, total)
        from moshpit.averaging.partition import chunk_bounds

        chunks0 = chunk_bounds(a0, b0, 4)
        mine = tensors[3][0]

        async def deliver_part_0_then_die():
            await drive_sender(
                services[3],
                group,
                0,
                total,
                [chunk_of(mine[a:b], k) for k, (a, b) in enumerate(chunks0)],
                read_replies=False,
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver_part_0_then_die)
            results = await run_all(
                services, group, tensors, skip=[3], timeout=30, sender_timeout=2
            )
            nursery.cancel_scope.cancel()
        dead = group.members[3]
        for r in results[:3]:
            assert dead in r.failed_peers, r
            assert dead in r.missing_contributors or dead in r.failed_senders
            # 1/3 of the elements (part 0) hold every contribution, the rest lack member 3
            assert r.complete_numel == b0 - a0 and r.averaged_fraction == 1.0
            assert r.complete_fraction == pytest.approx((b0 - a0) / total)
        assert dead in results[0].missing_contributors
        assert "part 1" in results[0].missing_contributors[dead]
