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
from dht.kademlia.routing import BusyPeers, Contact, OutageGuard
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


async def test_a_peer_slow_to_answer_while_its_connection_delivers_is_kept_a_while(
    autojump_clock, virtual_dht_time
):
    """On a full uplink (an all-reduce over 1 Mbit/s) a peer answers late, but its bytes
    keep arriving: that is a busy peer, not a gone one. It stays in the routing table and
    unbanned for ``BusyPeers.misses`` (4) unanswered RPCs in a row, then is dropped like a silent one
    (a peer whose DHT never answers again must not stay for good). Before, the first late
    answer dropped and banned it, and a swarm of four emptied its tables mid-round."""
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(8, memory_network=net, seed=5, rpc_timeout=1.0) as swarm:
        asker, slow = swarm.nodes[0], swarm.nodes[1]
        assert await asker.ping(slow.peer_id)
        assert slow.peer_id in asker.routing_table

        async def late(sender, request):
            await trio.sleep(5.0)  # queued behind the bulk transfer
            return await slow._handle_rpc(sender, request)

        async def drain(stream) -> None:
            while await stream.receive_some(1 << 16):
                pass

        async def push() -> None:
            stream = await slow.host.new_stream(asker.peer_id, "/bulk")
            while True:
                await stream.send_all(b"x" * 1024)
                await trio.sleep(0.1)

        slow.network.set_handler(late)
        asker.host.set_stream_handler("/bulk", drain)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(push)
            for _ in range(asker.busy.misses):
                assert not await asker.ping(slow.peer_id)
                assert slow.peer_id in asker.routing_table
                assert not asker.blacklist.is_banned(slow.peer_id, get_dht_time())
            assert not await asker.ping(slow.peer_id)
            assert slow.peer_id not in asker.routing_table
            assert asker.blacklist.is_banned(slow.peer_id, get_dht_time())
            nursery.cancel_scope.cancel()


def test_busy_peers_forgive_a_few_misses_in_a_row_and_forget_on_an_answer():
    busy = BusyPeers(misses=2, max_peers=2)
    assert not busy.tolerate("silent", False)  # no bytes meanwhile: a failure at once
    assert busy.tolerate("a", True) and busy.tolerate("a", True)
    assert not busy.tolerate("a", True)  # the third in a row counts
    assert busy.tolerate("a", True)  # ... and the count starts again after it
    busy.answered("a")
    assert busy.tolerate("a", True) and busy.tolerate("a", True)
    for peer in ("b", "c", "d"):  # bounded: beyond max_peers, all are forgotten
        assert busy.tolerate(peer, True)
    assert len(busy._in_a_row) <= 2
