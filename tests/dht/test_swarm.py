"""Hundreds of DHT nodes in one trio loop under MockClock (loopback fabric: real msgpack
round-trips and virtual latency, no transport stack; see test_memory_network.py for hosts)."""

import random

import pytest
import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.ids import id_to_bytes, key_id_of, serialize
from dht.kademlia.network import PeerUnreachableError
from dht.kademlia.records import DHTRecord
from dht.kademlia.simulation import open_swarm


def brute_force_nearest(nodes, target, k):
    return [n.peer_id for n in sorted(nodes, key=lambda n: n.node_id ^ target)[:k]]


async def test_256_peers_store_get_and_exact_nearest(autojump_clock, virtual_dht_time):
    rng = random.Random(1)
    async with open_swarm(256, seed=1) as swarm:
        nodes = swarm.nodes
        expiration = get_dht_time() + 1000
        for i in range(200):
            assert await rng.choice(nodes).store(f"key{i}", {"i": i}, expiration)
        for i in range(200):
            found = await rng.choice(nodes).get(f"key{i}")
            assert (
                found is not None
                and found.value == {"i": i}
                and found.expiration_time == expiration
            )
        for _ in range(20):
            node, target = rng.choice(nodes), rng.getrandbits(256)
            found = await node.find_nearest_peers(target, 20)
            others = [n for n in nodes if n is not node]
            assert [c.peer_id for c in found] == brute_force_nearest(others, target, 20)
        # every record sits on the true nearest replicas
        holders = [n.peer_id for n in nodes if n.storage.get(key_id_of("key7"), get_dht_time())]
        assert set(brute_force_nearest(nodes, key_id_of("key7"), 5)) <= set(holders)
        hops = sorted(s.hops for n in nodes for s in n.lookup_stats)
        assert hops[len(hops) // 2] <= 4


async def test_dictionary_values_merge_across_replicas(autojump_clock, virtual_dht_time):
    async with open_swarm(64, seed=2) as swarm:
        nodes, now = swarm.nodes, get_dht_time()
        for i, node in enumerate(nodes[:10]):
            assert await node.store("group", f"peer{i}", now + 100 + i, subkey=f"sub{i}")
        # write two more subkeys to disjoint replica sets only, bypassing the normal path
        replicas = sorted(nodes, key=lambda n: n.node_id ^ key_id_of("group"))[:5]
        for node, sub in ((replicas[0], "only-first"), (replicas[4], "only-last")):
            record = DHTRecord(serialize("group"), serialize(sub), serialize(sub), now + 500)
            assert node.storage.store(key_id_of("group"), record, now) == (True, None)
        newer = DHTRecord(serialize("group"), serialize("sub0"), serialize("newer"), now + 600)
        assert replicas[2].storage.store(key_id_of("group"), newer, now)[0]
        reader = nodes[-1]
        found = await reader.get("group", latest=True)
        assert set(found.value) == {f"sub{i}" for i in range(10)} | {"only-first", "only-last"}
        assert found.value["sub0"].value == "newer" and found.value["sub3"].value == "peer3"
        assert found.expiration_time == now + 600
        # each subkey expires on its own
        await trio.sleep(now + 105.5 - trio.current_time())
        found = await reader.get("group", latest=True)
        assert set(found.value) == {
            "sub0",
            "sub6",
            "sub7",
            "sub8",
            "sub9",
            "only-first",
            "only-last",
        }


async def test_expiration_is_exact_under_the_mock_clock(autojump_clock, virtual_dht_time):
    async with open_swarm(32, seed=3) as swarm:
        writer, reader = swarm.nodes[0], swarm.nodes[-1]
        expiration = get_dht_time() + 60
        assert await writer.store("ttl", "alive", expiration)
        await trio.sleep(expiration - 1 - trio.current_time())
        found = await reader.get("ttl")
        assert found == ("alive", expiration)
        await trio.sleep(expiration - trio.current_time())
        assert get_dht_time() == expiration
        assert await reader.get("ttl") is None
        assert all(n.storage.get(key_id_of("ttl"), get_dht_time()) is None for n in swarm.nodes)
        with pytest.raises(Exception, match="expired"):
            await writer.store("ttl", "too late", expiration)


async def test_joined_peers_know_their_neighbourhood(autojump_clock, virtual_dht_time):
    """Joining looks up our own ID for k peers, so neighbours know each other (issue 3).

    With a beam-wide (5) join lookup only ~89% of each peer's 10 nearest were in its routing
    table, and lookups after churn could stop short of the nearest live replicas.
    """
    async with open_swarm(160, seed=11) as swarm:
        nodes = swarm.nodes
        known = 0
        for node in nodes:
            nearest = brute_force_nearest([n for n in nodes if n is not node], node.node_id, 10)
            known += sum(peer in node.routing_table for peer in nearest)
        assert known / (10 * len(nodes)) >= 0.99


async def test_no_far_bucket_stays_empty_after_joining_through_one_address(
    autojump_clock, virtual_dht_time
):
    """A far bucket is split off a node's own bucket whenever that one fills, often after the
    join, and its range then holds only the peers met before. Unrefreshed until the periodic
    refresh (10 min), 26-27 of 128 peers that joined one after another through one address
    kept an empty far bucket over 25-65 live peers; lookups through them could not reach
    that range, and a 256-peer CI run stored a key away from its true nearest and missed it.
    Every split now refreshes its far half (DHTNode._refresh_far_bucket)."""
    async with open_swarm(1, seed=5) as swarm:
        first = swarm.nodes[0]
        for _ in range(127):
            await swarm.add(initial=[first])
        await trio.sleep(5)  # the last joiners' refresh lookups
        ids = sorted(n.node_id for n in swarm.nodes)
        gaps = []
        for node in swarm.nodes:
            for bucket in node.routing_table.buckets:
                live = sum(bucket.lower <= i < bucket.upper for i in ids)
                if not bucket.covers(node.node_id) and not bucket.contacts and live >= 3:
                    gaps.append((swarm.nodes.index(node), hex(bucket.lower)[:6], live))
        assert not gaps, gaps


@pytest.mark.slow
async def test_churn_30_percent(autojump_clock, virtual_dht_time):
    """After 30% of the peers die, 99% of the keys that still have a live replica can be read,
    by survivors and by peers that join later.

    Which keys lose all 5 replicas is luck (peer IDs are random): 0.2% of them on average but
    in clusters, since neighbouring keys share replicas (0-34 of 1000 measured), so the issue's
    "99% of all gets" bound fails now and then however good the lookups are (1 run in 40 after
    the issue-3 fix: 8 keys lost, 7 of the 525 survivor gets). Those keys are counted apart.
    """
    rng = random.Random(4)
    async with open_swarm(256, seed=4) as swarm:
        expiration = get_dht_time() + 10_000
        items = [(f"churn{i}", None, i, expiration) for i in range(1000)]
        stored = await swarm.nodes[0].store_many(items)
        assert all(stored.values())
        for victim in rng.sample(swarm.nodes, int(0.3 * len(swarm.nodes))):
            swarm.kill(victim)
        alive = swarm.alive()
        assert len(alive) == 180
        now = get_dht_time()
        surviving = {
            key
            for key, _, _, _ in items
            if any(n.storage.get(key_id_of(key), now) is not None for n in alive)
        }
        assert len(surviving) >= 900, 1000 - len(surviving)

        def unreadable(results):
            return sorted(
                key
                for key in results
                if key in surviving and ((v := results[key]) is None or v.value != int(key[5:]))
            )

        def readable_fraction(results):
            asked = sum(1 for key in results if key in surviving)
            return 1 - len(unreadable(results)) / asked

        # Before the issue-3 fix (join looked up only 5 neighbours, so neighbourhoods were
        # incomplete) survivors missed 1-3 keys with a live replica in 3 of 20 runs; after it,
        # 1 key in 1 of 55 runs (lost keys excluded).
        readers = rng.sample(alive, 20)
        results = await readers[0].get_many([f"churn{i}" for i in range(0, 1000, 2)])
        for reader in readers[1:]:
            results.update(await reader.get_many([f"churn{i}" for i in range(1, 1000, 40)]))
        assert len(results) == 525
        assert readable_fraction(results) >= 0.99, unreadable(results)
        # peers joining after the churn can read the old keys
        newcomers = [await swarm.add() for _ in range(10)]
        results = {}
        for node in newcomers:
            results.update(
                await node.get_many([f"churn{i}" for i in range(node is newcomers[0], 1000, 10)])
            )
        assert len(results) == 200
        assert readable_fraction(results) >= 0.99, unreadable(results)


async def test_client_mode_peers_use_the_dht_but_never_enter_routing_tables(
    autojump_clock, virtual_dht_time
):
    async with open_swarm(32, seed=5) as swarm:
        client = await swarm.add(client_mode=True)
        assert await client.store("from-client", 42, get_dht_time() + 100)
        assert (await swarm.nodes[3].get("from-client")).value == 42
        assert await swarm.nodes[5].store("to-client", 7, get_dht_time() + 100)
        assert (await client.get("to-client")).value == 7
        assert len(client.storage) == 0
        assert all(client.peer_id not in n.routing_table for n in swarm.nodes if n is not client)


async def test_concurrent_lookups_of_one_key_share_a_search(autojump_clock, virtual_dht_time):
    async with open_swarm(64, seed=6) as swarm:
        node = swarm.nodes[10]
        assert await swarm.nodes[0].store("shared", 1, get_dht_time() + 100)
        before = len(node.lookup_stats)
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(node.get, "shared", True)
        assert len(node.lookup_stats) == before + 1
        # lookups of different keys running together share batched find RPCs
        items = [(f"batch{i}", None, i, get_dht_time() + 100) for i in range(200)]
        assert all((await node.store_many(items)).values())
        assert node._finds.requests_sent < 0.9 * node._finds.keys_sent


async def test_malformed_rpcs_get_errors_and_the_node_keeps_serving(
    autojump_clock, virtual_dht_time
):
    async with open_swarm(8, seed=7) as swarm:
        target, attacker = swarm.nodes[0], swarm.nodes[1]
        garbage = [
            None,
            b"\x00" * 10,
            {"op": "nope"},
            {"op": "store", "records": "x"},
            {"op": "store", "records": [[b"k", None, b"v", "soon", None]]},
            {"op": "store", "records": [[b"k", None, b"v", float("nan"), None]]},
            {"op": "find", "keys": [b"short"]},
            {"op": "find", "keys": [b"\x00" * 32] * 10_000},
            {"op": "ping", "from": {"addrs": [b"x" * 10_000]}},
        ]
        for request in garbage:
            with pytest.raises(PeerUnreachableError) as info:
                await attacker.network.call(target.peer_id, request, 1.0)
            assert info.value.answered
            assert "malformed" in str(info.value) or "unknown DHT operation" in str(info.value)
        assert await attacker.ping(target.peer_id)
        assert await target.store("still", "serving", get_dht_time() + 10)


async def test_store_flood_and_oversized_and_forged_records_are_refused(
    autojump_clock, virtual_dht_time
):
    from dht.kademlia.errors import RecordRejectedError
    from dht.kademlia.storage import StorageLimits

    from .conftest import Identity

    limits = StorageLimits(max_record_bytes=4096, max_records=200, max_total_bytes=200_000)
    async with open_swarm(8, seed=8, limits=limits) as swarm:
        target, flooder = swarm.nodes[0], swarm.nodes[1]
        now = get_dht_time()
        reasons: dict[int, set[str]] = {}
        for flooder_index in range(1, 7):  # six peers flood the same node
            flooder = swarm.nodes[flooder_index]
            for batch in range(5):
                records = [
                    DHTRecord(
                        serialize(f"flood{flooder_index}-{batch}-{i}"),
                        None,
                        b"\xc4\x00" + b"x" * 1000,
                        now + 100,
                    ).to_wire()
                    for i in range(100)
                ]
                reply = await flooder.network.call(
                    target.peer_id, flooder._request("store", records=records), 1.0
                )
                reasons.setdefault(flooder_index, set()).update(
                    r.split(" (")[0].split(":")[0] for ok, r in reply["results"] if not ok
                )
                assert target.storage.num_records <= 200 and target.storage.num_bytes <= 200_000
        # each peer is first stopped by its own quota (25 % of the limits), later ones by a full node
        assert reasons[1] == {"per-peer quota exceeded"}
        assert "storage full" in set().union(*reasons.values())
        flooder = swarm.nodes[1]
        with pytest.raises(RecordRejectedError, match="too large"):
            await flooder.store("huge", b"x" * 10_000, now + 10)
        huge = DHTRecord(serialize("huge"), None, serialize(b"x" * 10_000), now + 10).to_wire()
        reply = await flooder.network.call(
            swarm.nodes[2].peer_id, flooder._request("store", records=[huge]), 1.0
        )
        assert reply["results"][0][0] is False and "too large" in reply["results"][0][1]
        victim = Identity.generate()
        forged = DHTRecord(
            serialize(f"x[owner:{victim.peer_id}]"), None, serialize(1), now + 10, b"s" * 64
        )
        reply = await flooder.network.call(
            target.peer_id, flooder._request("store", records=[forged.to_wire()]), 1.0
        )
        assert reply["results"][0] == [False, "invalid owner signature"]
        with pytest.raises(RecordRejectedError, match="not signed"):
            await flooder.store(f"x[owner:{victim.peer_id}]", 1, now + 10)
        # a node's own owner records are signed automatically and readable by everyone
        own_key = f"state[owner:{flooder.peer_id}]"
        assert await flooder.store(own_key, "mine", now + 10, subkey="s")
        assert (await swarm.nodes[5].get(own_key)).value["s"].value == "mine"


async def test_join_with_one_live_initial_peer_refresh_caching_and_blacklist(
    autojump_clock, virtual_dht_time
):
    async with open_swarm(48, seed=9, refresh_period=120.0) as swarm:
        dead = swarm.nodes[1]
        swarm.kill(dead)
        # any one live initial peer is enough
        joiner = await swarm.add(initial=[dead, swarm.nodes[2], swarm.nodes[3]])
        assert len(joiner.routing_table) > 5

        # the first RPC to the dead peer bans it and evicts it from the routing table
        node = next(n for n in swarm.alive() if dead.peer_id in n.routing_table)
        assert not await node.ping(dead.peer_id)
        assert node.blacklist.is_banned(dead.peer_id, get_dht_time())
        assert dead.peer_id not in node.routing_table

        # a found value is cached on the nearest queried peer that did not have it
        reader = swarm.nodes[20]
        assert await swarm.nodes[5].store("cached", "v", get_dht_time() + 1000)
        key_id = key_id_of("cached")
        before = {n.peer_id for n in swarm.alive() if n.storage.get(key_id, get_dht_time())}
        assert (await reader.get("cached")).value == "v"
        await trio.sleep(1)
        after = {n.peer_id for n in swarm.alive() if n.storage.get(key_id, get_dht_time())}
        assert len(after) >= len(before)

        # with no user traffic, buckets are refreshed by lookups every refresh_period: watched
        # every second for 600 s, none goes unrefreshed for longer than that period and the
        # refresh's own lookup (one RPC to the dead peer may cost rpc_timeout; a lookup queued
        # behind it another). Checking only for buckets already stale let some reach 183 s.
        lookups = sum(len(n.lookup_stats) for n in swarm.alive())
        worst = 0.0
        for _ in range(600):
            await trio.sleep(1)
            now = get_dht_time()
            ages = [now - b.last_updated for n in swarm.alive() for b in n.routing_table.buckets]
            worst = max(worst, *ages) if now > 200 else worst
        assert sum(len(n.lookup_stats) for n in swarm.alive()) > lookups
        assert 100 < worst <= 120.0 + 2 * 3.0 + 1.0


async def test_many_owner_signed_subkeys_merge(autojump_clock, virtual_dht_time):
    # verification stays on the loop here: a worker thread would let the autojumping mock
    # clock skip past every timeout (test_facade.py covers the threaded path on real time)
    async with open_swarm(16, seed=10, max_signatures_on_loop=10**6) as swarm:
        writer, reader = swarm.nodes[0], swarm.nodes[9]
        key = "matchmaking.0b0101"
        items = [(key, f"[owner:{writer.peer_id}]#{i}", i, get_dht_time() + 100) for i in range(40)]
        assert all((await writer.store_many(items)).values())
        found = await reader.get(key, latest=True)
        assert {k: v.value for k, v in found.value.items()} == {sub: i for _, sub, i, _ in items}


async def test_cancelled_callers_do_not_break_shared_lookups(autojump_clock, virtual_dht_time):
    async with open_swarm(64, seed=13) as swarm:
        node = swarm.nodes[7]
        assert await swarm.nodes[0].store("c", 1, get_dht_time() + 100)
        results = []

        async def patient() -> None:
            results.append(await node.get("c", latest=True))

        async with trio.open_nursery() as nursery:
            with trio.move_on_after(0.001):  # cancelled while its lookup is in flight
                nursery.start_soon(patient)
                await node.get("c", latest=True)
                pytest.fail("the impatient caller should have been cancelled")
        assert [r.value for r in results] == [1]
        assert not node._lookups.running  # finished searches are forgotten
        assert (await node.get("c")).value == 1


async def test_a_stores_lookup_asks_for_peers_only_and_a_get_for_the_values(
    autojump_clock, virtual_dht_time
):
    """A store's lookup needs the nearest peers, not what they hold: its find requests say
    ``values: False`` and the replies leave the entries out. For a busy dictionary key (the
    training progress: every peer's record) the entries were most of a publish's bytes."""
    async with open_swarm(32, seed=7) as swarm:
        nodes, now = swarm.nodes, get_dht_time()
        for i, node in enumerate(nodes[:12]):
            assert await node.store("progress", "x" * 300, now + 100, subkey=f"peer{i}")
        writer = nodes[-1]
        target = id_to_bytes(key_id_of("progress"))
        sent: list[tuple[bool, bool]] = []  # (asked for values, the reply carried entries)
        real_call = writer.network.call

        async def call(peer_id, request, time_limit):
            response = await real_call(peer_id, request, time_limit)
            if request.get("op") == "find" and target in request["keys"]:
                index = request["keys"].index(target)
                entries = response["results"][index][0]
                sent.append((request.get("values", True), bool(entries)))
            return response

        writer.network.call = call
        assert await writer.store("progress", "y" * 300, now + 100, subkey="writer")
        assert sent and all(pair == (False, False) for pair in sent), sent
        sent.clear()
        found = await writer.get("progress", latest=True)
        assert found is not None and len(found.value) == 13
        assert sent and all(asked for asked, _ in sent) and any(got for _, got in sent), sent
