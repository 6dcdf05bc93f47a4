"""RoutingTable.nearest (range bisection over sorted node IDs) equals brute force."""

import random

from dht.kademlia.routing import Contact, RoutingTable


def test_nearest_equals_brute_force_with_removals_and_exclusion():
    rng = random.Random(5)
    for size in (0, 1, 7, 50, 400):
        own = rng.getrandbits(256)
        table = RoutingTable(own, bucket_size=20)
        for i in range(size):
            table.add_or_update(Contact(f"p{i}", rng.getrandbits(256)), now=float(i))
        # near-self IDs make the dense buckets split deeply
        for i in range(size // 2):
            table.add_or_update(Contact(f"q{i}", own ^ rng.getrandbits(40)), now=float(i))
        for peer in rng.sample([c.peer_id for c in table], len(table) // 4):
            table.remove(peer)
        contacts = list(table)
        for _ in range(60):
            targets = [rng.getrandbits(256), own ^ rng.getrandbits(30)]
            if contacts:
                targets.append(rng.choice(contacts).node_id)
            target = rng.choice(targets)
            count = rng.choice([1, 5, 20, 40, 1000])
            exclude = rng.choice(contacts).peer_id if contacts and rng.random() < 0.5 else None
            expected = sorted(
                (c for c in contacts if c.peer_id != exclude), key=lambda c: c.node_id ^ target
            )[:count]
            got = table.nearest(target, count, exclude=exclude)
            assert [c.peer_id for c in got] == [c.peer_id for c in expected]
