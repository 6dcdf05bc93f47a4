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
