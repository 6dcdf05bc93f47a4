"""Routing table: splitting, least-recently-seen eviction, replacements, nearest, blacklist."""

import random

from dht.kademlia.ids import MAX_ID
from dht.kademlia.routing import Blacklist, Contact, RoutingTable


def contact(i, node_id):
    return Contact(peer_id=f"peer{i}", node_id=node_id, addrs=(b"a",))


def test_nearest_matches_brute_force_and_table_splits():
    rng = random.Random(0)
    table = RoutingTable(rng.randrange(MAX_ID), bucket_size=20)
    contacts = [contact(i, rng.randrange(MAX_ID)) for i in range(2000)]
    for c in contacts:
        table.add_or_update(c, now=0.0)
    assert len(table.buckets) > 1
    assert all(len(b.contacts) <= 20 for b in table.buckets)
    stored = list(table)
    for _ in range(20):
        target = rng.randrange(MAX_ID)
        expected = sorted(stored, key=lambda c: c.node_id ^ target)[:20]
        assert table.nearest(target, 20) == expected
    # the bucket nearest to us holds every contact that close (k-closest are always kept)
    own = sorted(contacts, key=lambda c: c.node_id ^ table.node_id)[:20]
    assert all(c.peer_id in table for c in own)


def test_every_split_reports_the_far_half_with_what_it_holds():
    """The node refreshes a bucket split off its own (DHTNode._refresh_far_bucket): the table must name
    the half that does not cover our ID, once per split, with the contacts it inherited."""
    rng = random.Random(3)
    table = RoutingTable(rng.randrange(MAX_ID), bucket_size=4)
    reported = []
    table.on_split = lambda far: reported.append((far.lower, far.upper, len(far.contacts)))
    for i in range(400):
        table.add_or_update(contact(i, rng.randrange(MAX_ID)), now=0.0)
    assert len(reported) == len(table.buckets) - 1 > 3  # one far half per split
    ranges = {(b.lower, b.upper) for b in table.buckets}
    for lower, upper, held in reported:
        assert not lower <= table.node_id < upper and held <= 4
        assert (lower, upper) in ranges  # far halves never split again


def test_full_bucket_returns_oldest_and_keeps_newcomer_as_replacement():
    table = RoutingTable(0, bucket_size=2, recheck_after=1.0)
    far = MAX_ID // 2  # the upper half never contains our ID, so it never splits
    a, b, c = contact(1, far + 1), contact(2, far + 2), contact(3, far + 3)
    assert table.add_or_update(a, 0.0) is None
    assert table.add_or_update(b, 0.0) is None
    assert table.add_or_update(a, 1.0) is None  # refresh: a becomes most recent
    oldest = table.add_or_update(c, 2.0)
    assert oldest is b and c.peer_id not in table
    table.remove(b.peer_id)  # the ping to b failed
    assert c.peer_id in table and b.peer_id not in table and a.peer_id in table
    # an oldest contact seen within recheck_after is known alive: no ping, newcomer waits
    d = contact(4, far + 4)
    assert table.add_or_update(d, 2.5) is None and d.peer_id not in table
    assert d.peer_id in table.buckets[table.bucket_index(d.node_id)].replacements


def test_blacklist_backoff_grows_and_is_capped():
    bl = Blacklist(base_delay=1.0, max_delay=8.0, max_entries=3)
    delays = [bl.register_failure("p", now=0.0) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert bl.is_banned("p", now=7.9) and not bl.is_banned("p", now=8.1)
    bl.register_success("p")
    assert not bl.is_banned("p", now=0.0)
    for i in range(10):
        bl.register_failure(i, now=0.0)
    assert len(bl) == 3
