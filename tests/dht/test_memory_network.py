"""DHT nodes on real hosts (Noise + yamux) over dht.p2p.MemoryNetwork, under MockClock.

Full hosts cost ~5 ms of CPU per connection set-up, so these runs stay at a few dozen peers;
the 256+ peer simulations use the loopback fabric (test_swarm.py).
"""

import random

import pytest
import trio
import trio.lowlevel

from dht.kademlia.clock import get_dht_time
from dht.kademlia.ids import key_id_of
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork


async def test_real_hosts_store_get_dictionary_and_dead_peers(autojump_clock, virtual_dht_time):
    rng = random.Random(11)
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(24, memory_network=net, seed=11, rpc_timeout=2.0) as swarm:
        nodes = swarm.nodes
        expiration = get_dht_time() + 300
        for i in range(30):
            assert await rng.choice(nodes).store(f"mem{i}", i, expiration)
        for i, node in enumerate(nodes[:6]):
            assert await node.store("members", str(node.peer_id), expiration, subkey=i)
        for i in range(30):
            assert (await rng.choice(nodes).get(f"mem{i}")).value == i
        members = await nodes[-1].get("members", latest=True)
        assert {k: v.value for k, v in members.value.items()} == {
            i: str(n.peer_id) for i, n in enumerate(nodes[:6])
        }
        # kill the two nearest replicas of a key: the others still serve it
        nearest = sorted(nodes, key=lambda n: n.node_id ^ key_id_of("mem3"))
        for victim in nearest[:2]:
            swarm.kill(victim)
        reader = nearest[-1]
        assert (await reader.get("mem3", latest=True)).value == 3
        # a peer joining later reads old keys
        late = await swarm.add(initial=[nearest[5]])
        assert (await late.get("mem7")).value == 7
        await trio.lowlevel.checkpoint()


@pytest.mark.slow
async def test_128_real_hosts_on_the_memory_network(autojump_clock, virtual_dht_time):
    """Full hosts (Noise, yamux) cost 2-5 ms of CPU per connection, so this stays at 128
    (256 took ~2 min under a parallel test run); benchmarks/ run the real code at 1024."""
    rng = random.Random(12)
    net = MemoryNetwork(latency=0.005)
    async with open_swarm(128, memory_network=net, seed=12) as swarm:
        nodes = swarm.nodes
        expiration = get_dht_time() + 1000
        stored = await nodes[0].store_many([(f"big{i}", None, i, expiration) for i in range(100)])
        assert all(stored.values())
        for i in range(100):
            assert (await rng.choice(nodes).get(f"big{i}")).value == i
        for _ in range(5):
            node, target = rng.choice(nodes), rng.getrandbits(256)
            found = [c.peer_id for c in await node.find_nearest_peers(target, 20)]
            truth = [
                n.peer_id for n in sorted(nodes, key=lambda n: n.node_id ^ target) if n is not node
            ][:20]
            assert found == truth


async def test_patient_get_returns_what_live_replicas_said_beside_a_stalled_one(
    autojump_clock, virtual_dht_time
):
    # A replica whose links went down (a machine that froze, a cable pulled) answers nothing
    # and refuses nothing: a latest-value read waited for it until the RPC timeout. A reader
    # with a deadline of its own (matchmaking re-reads a key every 0.25 s and gives a read
    # 3 s) then got nothing at all. With ``patience`` it gets what the others answered.
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(16, memory_network=net, seed=5, rpc_timeout=3.0) as swarm:
        nodes = swarm.nodes
        expiration = get_dht_time() + 300
        for i, node in enumerate(nodes[:4]):
            assert await node.store("line", i, expiration, subkey=str(node.peer_id))
        nearest = sorted(nodes, key=lambda n: n.node_id ^ key_id_of("line"))
        stalled, patient, waiting = nearest[0], nearest[-1], nearest[-2]
        others = [n.host.listen_addrs[0] for n in nodes if n is not stalled]
        net.partition([stalled.host.listen_addrs[0]], others)
        t0 = trio.current_time()
        found = await patient.get("line", latest=True, patience=1.0)
        assert trio.current_time() - t0 <= 1.0 + 1e-6
        assert found is not None and len(found.value) == 4
        # a patient store reaches the replicas that answer: a reader finds it
        t0 = trio.current_time()
        assert await patient.store("line", 4, expiration, subkey="late", patience=1.0)
        assert trio.current_time() - t0 <= 1.0 + 0.1
        found = await nearest[-3].get("line", latest=True, patience=1.0)
        assert found is not None and len(found.value) == 5
        # without patience (another reader: the first one learned the replica is down)
        t0 = trio.current_time()
        found = await waiting.get("line", latest=True)
        assert trio.current_time() - t0 > 1.5 and len(found.value) == 5
