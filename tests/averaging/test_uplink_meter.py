"""Peers that state no bandwidth measure their uplink, and a slow link's rounds get the time
their bytes need (``uplink_meter.py``).

Before, only a stated ``bandwidth`` stretched a round's time allowance: volunteers at home who
stated nothing failed every round whose bytes took longer than ``allreduce_timeout`` (4-bit
DiLoCo over 200 kbit/s: every round of the race, with 4 solo steps). Real DHT nodes,
matchmaking and all-reduce on the in-memory network, whose links time every byte.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trio

from dht.kademlia.clock import dht_clock, trio_clock
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork
from moshpit.averaging.averager import LINK_TIME_FACTOR, MAX_LINK_TIMEOUTS, Averager
from moshpit.averaging.group_info import GroupInfo, GroupInfoError
from moshpit.averaging.matchmaking_messages import JoinRequest, MatchmakingError
from moshpit.averaging.partition import round_link_seconds
from moshpit.averaging.uplink_meter import UplinkMeter
from tests.averaging.test_allreduce import make_group, swarm

LINK = 100_000  # bytes/s of every link, each direction
NUMEL = 150_000  # float32: 400 kB on each link per round, ~4 s at LINK


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


def test_the_meter_keeps_the_fastest_of_its_recent_readings():
    meter = UplinkMeter(readings=3)
    assert meter.rate is None
    meter.observe(0, 5.0)  # sent nothing: no reading
    meter.observe(1000, 0.0)
    assert meter.rate is None
    meter.observe(100_000, 1.0)
    meter.observe(100_000, 20.0)  # a round that waited out a dead member reads low
    assert meter.rate == 100_000
    meter.observe(30_000, 1.0)
    meter.observe(40_000, 1.0)  # the fast reading has left the window
    assert meter.rate == 40_000
    # a round that lost a member before its time was up mostly waited for it: no reading
    meter.observe(1_000, 1.0, lost=True)
    meter.observe(2_000, 1.0, lost=True)
    meter.observe(3_000, 1.0, lost=True)
    assert meter.rate == 40_000
    # one cut by its time allowance counts: what it sent by then is the link's pace
    for _ in range(3):
        meter.observe(5_000, 1.0, timed_out=True, lost=True)
    assert meter.rate == 5_000


async def test_measured_rates_size_only_the_time_allowance(autojump_clock):
    async with swarm(3) as services:
        group = make_group(services, bandwidths=[None, 2e6, None])
    measured = dataclasses.replace(group, measured_uplinks=(50e3, None, 5e6))
    n = 300_000  # 3 senders: each sends 2 * 2/3 of it, float32 before any codec reported
    assert round_link_seconds(group, n, unknown_bytes_per_value=4.0) == pytest.approx(
        2 * n * 2 / 3 * 4 / 2e6
    )
    # the allowance counts the slowest link stated or measured; chunks and pacing do not
    slow = round_link_seconds(measured, n, unknown_bytes_per_value=4.0, measured=True)
    assert slow == pytest.approx(2 * n * 2 / 3 * 4 / 50e3)
    assert round_link_seconds(measured, n, unknown_bytes_per_value=4.0) == pytest.approx(
        2 * n * 2 / 3 * 4 / 2e6
    )
    # a stated bandwidth wins over the same member's measurement
    stated = dataclasses.replace(measured, measured_uplinks=(50e3, 1.0, 5e6))
    assert round_link_seconds(
        stated, n, unknown_bytes_per_value=4.0, measured=True
    ) == pytest.approx(slow)
    back = GroupInfo.from_msg(measured.to_msg())
    assert back == measured and GroupInfo.from_msg(group.to_msg()).measured_uplinks == ()


async def test_a_member_that_claims_a_crawling_link_stretches_a_round_only_so_far(
    autojump_clock,
):
    """Rates come from the members: one that claims 1 byte/s (stated or measured) would
    otherwise make every round it joins wait for weeks before it may be given up."""
    async with swarm(3) as services:
        group = make_group(services)
    av = Averager(
        [torch.zeros(NUMEL)], dht=object(), prefix="p", target_group_size=3, start=False,
        allreduce_timeout=10.0,
    )  # fmt: skip
    honest = dataclasses.replace(group, measured_uplinks=(LINK, LINK, None))
    # float32 before any codec reported: 2 * 2/3 of the values, 4 bytes each, at 100 kB/s
    link = 2 * NUMEL * 2 / 3 * 4 / LINK
    assert av.allreduce_budget(honest) == pytest.approx(10.0 + LINK_TIME_FACTOR * link)
    for claim in (dict(measured_uplinks=(LINK, 1.0, None)), dict(bandwidths=(None, 1.0, None))):
        crawling = dataclasses.replace(honest, **claim)
        assert av.allreduce_budget(crawling) == 10.0 + LINK_TIME_FACTOR * MAX_LINK_TIMEOUTS * 10


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "fast"])
async def test_a_bad_measured_uplink_is_refused(autojump_clock, bad):
    async with swarm(2) as services:
        group = make_group(services)
    msg = group.to_msg()
    msg["mbw"] = [bad, None]
    with pytest.raises(GroupInfoError, match="measured uplink"):
        GroupInfo.from_msg(msg)
    msg["mbw"] = [1e6]  # one per member, or none
    with pytest.raises(GroupInfoError, match="one entry per member"):
        GroupInfo.from_msg(msg)
    request = JoinRequest("run.0b", 1.0, 5.0, "node", None, None, 1).to_msg("run")
    request["mbw"] = bad
    with pytest.raises(MatchmakingError, match="measured uplink"):
        JoinRequest.from_msg(request)


async def test_a_round_slower_than_the_timeout_on_unstated_links_succeeds_once_measured(
    autojump_clock, virtual_dht_time
):
    """Three peers, no bandwidth stated, a 1-s allreduce timeout, and rounds that keep their
    100 kB/s links busy for ~4 s. The first round runs out of time (nobody knew the links);
    what it sent by then is each peer's reading, and from the second round on the
    allowance holds the round's bytes: every later round averages everything. Before, every
    round timed out."""
    net = MemoryNetwork(latency=0.01, bandwidth=LINK)
    async with open_swarm(3, memory_network=net, seed=3, rpc_timeout=2.0) as dht_swarm:
        averagers = [
            Averager(
                [torch.full((NUMEL,), float(i))],
                dht=node,
                prefix="unstated",
                target_group_size=3,
                min_group_size=3,
                initial_group_bits="",
                min_matchmaking_time=1.0,
                request_timeout=2.0,
                allreduce_timeout=1.0,
                # the round's time, not its stall limits, must run out first (with 1/3 and
                # 2/3 of this timeout, links of 100 kB/s shared by two flows "stall")
                sender_timeout=5.0,
                reducer_timeout=5.0,
                ban_after_failures=10,
            )
            for i, node in enumerate(dht_swarm.nodes)
        ]
        try:
            rounds = []
            for _ in range(3):
                results: list = [None] * 3

                async def one(i: int, results: list = results) -> None:
                    results[i] = await averagers[i].astep()

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i)
                rounds.append(results)
            first = rounds[0]
            assert all(r.group_size == 3 and r.averaged_fraction < 1 for r in first), first
            assert any("timed out" in (r.reason or "") for r in first), first
            for av in averagers:
                rate = av.uplink_meter.rate
                # payload over the round's seconds: at most its two links' worth
                assert rate is not None and 0.2 * LINK < rate <= 2 * LINK, rate
            for results in rounds[1:]:
                for r in results:
                    assert r.succeeded and r.averaged_fraction == 1.0, r.reason
                    assert r.allreduce_seconds > 3.0, r.allreduce_seconds  # the links' pace
            for av in averagers:
                with av.get_tensors() as (t,):
                    assert torch.allclose(t, torch.full((NUMEL,), 1.0))
            # the training modes make an averager per epoch and hand the meter on: the next
            # one's first round already has the reading (a stated bandwidth needs none)
            meter = averagers[0].uplink_meter
            for options, shared in ((dict(), meter.rate), (dict(bandwidth=1e6), None)):
                successor = Averager(
                    [torch.zeros(NUMEL)], dht=dht_swarm.nodes[0], prefix="next-epoch",
                    target_group_size=3, uplink_meter=meter, **options,
                )  # fmt: skip
                try:
                    assert successor.matchmaker.measured_uplink == shared
                finally:
                    await successor.aclose()
        finally:
            for av in averagers:
                await av.aclose()
