"""A node whose own links went down does not blame the swarm (issue 33).

While a node is cut off (its machine lost the network, a laptop's Wi-Fi dropped, the
simulation's transient failure), every RPC it makes fails. Each failure used to ban the peer
it asked (5 s, doubling with every further failure, up to 5 min) and drop it from the routing
table, so the node came back with an empty table and a swarm it would not talk to: in the
256-peer simulation, peers back from a cut stayed alone for rounds.
"""

from __future__ import annotations

import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.routing import Contact, OutageGuard
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork


async def test_a_node_back_from_an_outage_talks_to_the_swarm_at_once(
    autojump_clock, virtual_dht_time
):
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(16, memory_network=net, seed=3, rpc_timeout=1.0) as swarm:
        cut, others = swarm.nodes[0], swarm.nodes[1:]
        expiration = get_dht_time() + 600
        assert await others[0].store("line", "value", expiration)
        known = len(cut.routing_table)
        assert known >= 10
        net.partition([cut.host.listen_addrs[0]], [n.host.listen_addrs[0] for n in others])
        for i in range(3):  # a round's worth of reads and writes, all failing
            assert await cut.get(f"elsewhere{i}", latest=True) is None
            await cut.store(f"mine{i}", i, expiration)
        net.heal()
        t0 = trio.current_time()
        found = await cut.get("line", latest=True)
        assert found is not None and found.value == "value"
        assert trio.current_time() - t0 < 1.0  # no RPC timeout waited out
        assert len(cut.blacklist) == 0  # the peers it could not reach are not banned
        assert len(cut.routing_table) >= known


async def test_one_dead_peer_is_still_banned(autojump_clock, virtual_dht_time):
    """Failures of a few peers among successes are theirs: banned and dropped as before."""
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(16, memory_network=net, seed=4, rpc_timeout=1.0) as swarm:
        reader, dead = swarm.nodes[0], swarm.nodes[1]
        assert dead.peer_id in reader.routing_table
        net.kill(dead.host.listen_addrs[0])
        assert not await reader.ping(dead.peer_id)
        assert await reader.store("k", 1, get_dht_time() + 60)  # others answer
        assert reader.blacklist.is_banned(dead.peer_id, get_dht_time())
        assert dead.peer_id not in reader.routing_table


def test_outage_guard_takes_back_only_a_long_streak():
    guard = OutageGuard(threshold=3, capacity=4)
    contacts = [Contact(f"p{i}", i) for i in range(6)]
    guard.failed("p0", contacts[0])
    guard.failed("p1", None)
    assert not guard.suspected
    assert guard.recovered() == []  # two dead peers: their own fault, bans stay
    for c in contacts:
        guard.failed(c.peer_id, c)
    assert guard.suspected
    back = guard.recovered()
    assert [p for p, _ in back] == ["p2", "p3", "p4", "p5"]  # bounded: the oldest dropped
    assert guard.recovered() == [] and not guard.suspected
