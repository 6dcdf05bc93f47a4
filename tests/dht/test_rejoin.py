"""A node whose routing table emptied finds its way back (the chaos test's lost peer).

In a small swarm a paused process (SIGSTOP, a laptop lid, a VM migration) wakes to find every
RPC it had in flight timed out. Each timeout bans the peer and drops it from the routing
table, and with 3 contacts the outage guard (8 in a row) never triggers: the node is left with
an empty table. The others had dropped it too, so nobody ever called anyone again. Its progress
reports went nowhere and it trained alone, 15 epochs behind, until the end of the run.
"""

from __future__ import annotations

import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork


async def _cut_off(net: MemoryNetwork, cut, others) -> None:
    """Every RPC between ``cut`` and the others times out, both ways, as under SIGSTOP."""
    net.partition([cut.host.listen_addrs[0]], [n.host.listen_addrs[0] for n in others])
    net.partition([n.host.listen_addrs[0] for n in others], [cut.host.listen_addrs[0]])
    expiration = get_dht_time() + 600
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut.store, "while-away", 1, expiration)
        for n in others:
            nursery.start_soon(n.ping, cut.peer_id)
    # the answers that were on their way are lost (a woken process's RPCs time out first)
    for n in others:
        with trio.move_on_after(1):
            await cut.host.disconnect(n.peer_id)
        with trio.move_on_after(1):
            await n.host.disconnect(cut.peer_id)
    net.heal()


async def test_a_node_left_with_an_empty_table_rejoins(autojump_clock, virtual_dht_time):
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(4, memory_network=net, seed=5, rpc_timeout=1.0) as swarm:
        cut, others = swarm.nodes[-1], swarm.nodes[:-1]
        await _cut_off(net, cut, others)
        assert len(cut.routing_table) == 0  # the small swarm's trap: every contact dropped
        assert all(cut.peer_id not in n.routing_table for n in others)
        expiration = get_dht_time() + 600
        assert await others[0].store("theirs", "value", expiration)
        await trio.sleep(10)  # the rejoin loop's first tries
        found = await cut.get("theirs", latest=True)
        assert found is not None and found.value == "value"
        assert len(cut.routing_table) == len(others)
        # ... and it is in the others' tables again, so what it stores reaches them
        assert await cut.store("mine", "back", get_dht_time() + 600)
        mine = await others[1].get("mine", latest=True)
        assert mine is not None and mine.value == "back"


async def test_the_first_node_rejoins_through_the_peers_it_knew(autojump_clock, virtual_dht_time):
    """The swarm's first node has no initial peers: it can only come back through the
    contacts it dropped."""
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(4, memory_network=net, seed=6, rpc_timeout=1.0) as swarm:
        cut, others = swarm.nodes[0], swarm.nodes[1:]
        await _cut_off(net, cut, others)
        assert len(cut.routing_table) == 0
        assert await others[0].store("theirs", "value", get_dht_time() + 600)
        await trio.sleep(10)
        found = await cut.get("theirs", latest=True)
        assert found is not None and found.value == "value"


async def test_a_lone_node_does_not_spin(autojump_clock, virtual_dht_time):
    """With nobody to rejoin through, tries back off: a lone peer costs next to nothing."""
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(2, memory_network=net, seed=7, rpc_timeout=1.0) as swarm:
        alone, gone = swarm.nodes
        net.kill(gone.host.listen_addrs[0])
        await alone.ping(gone.peer_id)
        assert len(alone.routing_table) == 0
        before = alone.rejoin.attempts
        await trio.sleep(600)
        assert 3 <= alone.rejoin.attempts - before <= 20
