"""The DHT at scale, by simulation: bootstrap, hop counts, churn with republishing, traffic.

  nice -n 10 python benchmarks/sim_dht.py --peers 1024                    # loopback fabric
  nice -n 10 python benchmarks/sim_dht.py --peers 256 --network memory    # real hosts

Every peer is an unmodified ``DHTNode`` (same classes, timeouts, validation, republishing and
hand-over as in production); only the clock is virtual (trio's MockClock, autojump). With
``--network memory`` each peer has a real ``dht.p2p`` Host (Noise, yamux, multistream) on
``dht.p2p.MemoryNetwork``; with ``--network loopback`` RPCs go through the loopback fabric
(msgpack round trips with per-hop latency, no transport). Phases, one JSON line each:

  bootstrap  all peers join through ONE address (the first peer's), ``--join-concurrency`` at
             a time; virtual and wall time, routing table sizes, far buckets left empty over
             3+ live peers one virtual second later (``empty_far_buckets``);
  lookups    ``get(latest=True)`` of stored keys from random peers: hop histogram
             (``node.lookup_stats``: sequential RPCs to reach the nearest peer found);
  churn      ``--owners`` peers store ``--keys`` keys and republish them (production default,
             every 60 s); ``--churn`` of the peers (non-owners) are replaced one by one, evenly
             over ``--minutes`` virtual minutes; then every key is read from random survivors,
             and again one republish interval later;
  traffic    DHT requests sent per peer per virtual minute during the churn phase (counted by
             wrapping ``call`` of the network endpoint, see ``count_sent_requests``) and
             requests served (``node.requests_served``).

Each line carries the wall clock so far and the peak RSS per simulated peer.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dht.kademlia.clock import dht_clock, get_dht_time, trio_clock  # noqa: E402
from dht.kademlia.loopback import LoopbackNetwork  # noqa: E402
from dht.kademlia.network import HostNetwork  # noqa: E402
from dht.kademlia.simulation import open_swarm  # noqa: E402


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@contextmanager
def count_sent_requests() -> Iterator[Counter]:
    """Count every DHT request a peer sends (timed-out and refused ones included).

    Wraps ``call`` of both network endpoint classes for the duration of the block; the wrapped
    call is the original one, so behaviour is unchanged. Keys are the sender's PeerID.
    """
    sent: Counter = Counter()
    originals = {cls: cls.call for cls in (HostNetwork, LoopbackNetwork)}

    def counting(original: Any, sender: Any) -> Any:
        async def call(self: Any, peer_id: Any, request: Any, time_limit: float) -> Any:
            sent[sender(self)] += 1
            return await original(self, peer_id, request, time_limit)

        return call

    HostNetwork.call = counting(originals[HostNetwork], lambda net: net.host.peer_id)
    LoopbackNetwork.call = counting(originals[LoopbackNetwork], lambda net: net.peer_id)
    try:
        yield sent
    finally:
        for cls, original in originals.items():
            cls.call = original


def empty_far_buckets(nodes: list[Any], min_live: int = 3) -> int:
    """Buckets (not covering their node's ID) with no contact while ``min_live`` or more
    live peers fall in their range: a region lookups through that node cannot reach."""
    ids = sorted(n.node_id for n in nodes)
    empty = 0
    for node in nodes:
        for bucket in node.routing_table.buckets:
            if bucket.covers(node.node_id) or bucket.contacts:
                continue
            live = bisect.bisect_left(ids, bucket.upper) - bisect.bisect_left(ids, bucket.lower)
            empty += live >= min_live
    return empty


def histogram(values: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def message_bound(keys: int, peers: int, keys_per_owner: float | None = None) -> float:
    """docs/dht.md, "Bounded work": republishing costs ~K/N x (3 log2 N + 5) messages per peer
    per interval (1.1 intervals a minute at most, with jitter); joins, hand-over, refreshes
    and reads add a constant 60. For one owner, K/N becomes its own number of keys."""
    per_peer = keys / peers if keys_per_owner is None else keys_per_owner
    return per_peer * (3 * math.ceil(math.log2(peers)) + 5) * 1.1 + 60


async def simulate(
    peers: int,
    *,
    network: str = "loopback",
    keys: int = 1000,
    owners: int = 100,
    churn: float = 0.3,
    minutes: float = 10.0,
    lookups: int = 1000,
    join_concurrency: int = 16,
    latency: float = 0.005,
    seed: int = 0,
    emit: Any = None,
) -> dict[str, dict]:
    """Run all phases; returns {phase: result} (also passed to ``emit`` as they finish).

    Runs inside an existing trio run whose clock is a MockClock (autojump) and whose DHT time
    follows trio's clock (``dht_clock(trio_clock)``).
    """
    from dht.p2p import MemoryNetwork

    rng = random.Random(seed)
    memory = MemoryNetwork(latency=latency) if network == "memory" else None
    wall_started = time.perf_counter()
    rss_before = peak_rss_bytes()  # the interpreter and imports, before any peer
    results: dict[str, dict] = {}

    def report(phase: str, **fields: Any) -> None:
        fields = {
            "bench": "sim_dht",
            "phase": phase,
            "network": network,
            "peers": peers,
            **fields,
            "wall_s": round(time.perf_counter() - wall_started, 1),
            "peak_rss_per_peer_kib": round(peak_rss_bytes() / peers / 1024, 1),
            "peak_rss_growth_per_peer_kib": round(
                (peak_rss_bytes() - rss_before) / peers / 1024, 1
            ),
        }
        results[phase] = fields
        if emit is not None:
            emit(fields)

    with count_sent_requests() as sent:
        async with open_swarm(1, latency=latency, memory_network=memory, seed=seed) as swarm:
            # (a) everyone joins through the first peer's address
            first = swarm.nodes[0]
            started, wall = trio.current_time(), time.perf_counter()
            join_times: list[float] = []

            async def join() -> None:
                began = trio.current_time()
                await swarm.add(initial=[first])
                join_times.append(trio.current_time() - began)

            remaining = peers - 1
            while remaining:
                batch = min(join_concurrency, remaining)
                async with trio.open_nursery() as joining:
                    for _ in range(batch):
                        joining.start_soon(join)
                remaining -= batch
            joined = trio.current_time()
            # one virtual second for the refresh lookups of buckets split by the last joins
            # (~0.05 s each); before it a few recent splits still show as empty far buckets
            await trio.sleep(1.0)
            nodes = swarm.nodes
            table_sizes = [len(n.routing_table) for n in nodes]
            report(
                "bootstrap",
                through_one_address=True,
                join_concurrency=join_concurrency,
                virtual_s=round(joined - started, 2),
                bootstrap_wall_s=round(time.perf_counter() - wall, 1),
                join_virtual_s_median=round(statistics.median(join_times), 3),
                join_virtual_s_max=round(max(join_times), 3),
                routing_table_min=min(table_sizes),
                routing_table_median=statistics.median(table_sizes),
                empty_far_buckets=empty_far_buckets(nodes),
                seed_peer_requests_served=sum(first.requests_served.values()),
            )

            # owners store the keys (republished by them from now on, as in production)
            owner_nodes = rng.sample(nodes, owners)
            owner_ids = {o.peer_id for o in owner_nodes}
            expiration = get_dht_time() + 3 * 3600
            per_owner = [keys // owners + (i < keys % owners) for i in range(owners)]
            all_keys: list[str] = []
            stored_ok = 0
            for o, (owner, count) in enumerate(zip(owner_nodes, per_owner, strict=True)):
                items = [(f"k{o}-{i}", None, f"v{o}-{i}", expiration) for i in range(count)]
                stored_ok += sum((await owner.store_many(items)).values())
                all_keys += [key for key, _, _, _ in items]

            # (b) hop histogram of full lookups from random peers
            for node in nodes:
                node.lookup_stats.clear()
            found = 0
            for key in rng.choices(all_keys, k=lookups):
                value = await rng.choice(nodes).get(key, latest=True)
                found += value is not None and value.value == "v" + key[1:]
            stats = [s for n in nodes for s in n.lookup_stats]
            hops = [s.hops for s in stats]
            log2n = math.log2(peers)
            report(
                "lookups",
                lookups=len(stats),
                found_rate=found / lookups,
                stores_accepted=stored_ok / len(all_keys),
                hops_histogram=histogram(hops),
                hops_median=statistics.median(hops),
                hops_max=max(hops),
                log2_peers=round(log2n, 2),
                hops_max_over_log2_peers=round(max(hops) / log2n, 2),
                find_rpcs_per_lookup_median=statistics.median(s.messages for s in stats),
                find_rpcs_per_lookup_max=max(s.messages for s in stats),
            )

            # (c) + (d) churn: replace non-owners one by one, evenly over `minutes`
            replacements = round(churn * peers)
            if not replacements:
                return results
            sent.clear()
            served_before = {n.peer_id: sum(n.requests_served.values()) for n in nodes}
            alive_since = {n.peer_id: trio.current_time() for n in nodes}
            alive_until: dict[Any, float] = {}
            churn_started, wall = trio.current_time(), time.perf_counter()
            sizes: list[int] = []

            async def replace() -> None:
                # a newcomer knows a few live peers' addresses, as a restarted peer would
                node = await swarm.add(initial=rng.sample(swarm.alive(), 3))
                alive_since[node.peer_id] = trio.current_time()
                served_before[node.peer_id] = 0

            async with trio.open_nursery() as joining:
                for _ in range(replacements):
                    await trio.sleep(minutes * 60 / replacements)
                    victim = rng.choice([n for n in swarm.alive() if n.peer_id not in owner_ids])
                    alive_until[victim.peer_id] = trio.current_time()
                    swarm.kill(victim)
                    joining.start_soon(replace)
                    sizes.append(len(swarm.alive()))
            churn_ended = trio.current_time()
            churn_minutes = (churn_ended - churn_started) / 60
            churn_wall = time.perf_counter() - wall
            survivors = swarm.alive()
            assert all(o in survivors for o in owner_nodes)

            async def unreadable() -> list[str]:
                readers = rng.sample([n for n in swarm.alive() if n.peer_id not in owner_ids], 20)
                missing = []
                for r, reader in enumerate(readers):
                    got = await reader.get_many(all_keys[r::20])
                    missing += [k for k, v in got.items() if v is None or v.value != "v" + k[1:]]
                return missing

            # traffic of the churn window only (reads below excluded)
            per_minute_sent, per_minute_served, owner_rates = [], [], []
            for node in swarm.nodes:
                since = alive_since[node.peer_id]
                until = alive_until.get(node.peer_id, churn_ended)
                if since > churn_started or until < churn_ended:
                    continue  # joined or left during the window: see the mean below
                served = sum(node.requests_served.values()) - served_before[node.peer_id]
                rate = sent[node.peer_id] / churn_minutes
                (owner_rates if node.peer_id in owner_ids else per_minute_sent).append(rate)
                per_minute_served.append(served / churn_minutes)
            mean_rate = sum(sent.values()) / statistics.mean(sizes) / churn_minutes
            traffic = dict(
                churn_virtual_minutes=round(churn_minutes, 2),
                mean_sent_per_peer_minute=round(mean_rate, 1),
                bound_mean=round(message_bound(keys, peers), 1),
                non_owner_sent_per_minute_median=round(statistics.median(per_minute_sent), 1),
                non_owner_sent_per_minute_p99=round(quantile(per_minute_sent, 0.99), 1),
                non_owner_sent_per_minute_max=round(max(per_minute_sent), 1),
                owner_sent_per_minute_median=round(statistics.median(owner_rates), 1),
                owner_sent_per_minute_max=round(max(owner_rates), 1),
                bound_owner=round(message_bound(keys, peers, max(per_owner)), 1),
                served_per_minute_median=round(statistics.median(per_minute_served), 1),
                served_per_minute_p99=round(quantile(per_minute_served, 0.99), 1),
                served_per_minute_max=round(max(per_minute_served), 1),
                peers_counted_whole_window=len(per_minute_sent) + len(owner_rates),
            )

            missing_now = await unreadable()
            report(
                "churn",
                replaced=replacements,
                replaced_fraction=round(replacements / peers, 3),
                owners=owners,
                keys=len(all_keys),
                readable_after_last_replacement=round(1 - len(missing_now) / len(all_keys), 5),
                missing_after_last_replacement=len(missing_now),
                churn_wall_s=round(churn_wall, 1),
            )
            report("traffic", **traffic)
            await trio.sleep(60 * 1.1 + 10)
            lost = await unreadable()
            report(
                "churn_one_interval_later",
                readable=round(1 - len(lost) / len(all_keys), 5),
                missing=len(lost),
            )
            swarm_total_wall = time.perf_counter() - wall_started
    report("total", total_wall_s=round(swarm_total_wall, 1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=["loopback", "memory"], default="loopback")
    parser.add_argument("--peers", type=int, default=1024)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--owners", type=int, default=100, help="peers that store and republish")
    parser.add_argument("--churn", type=float, default=0.3, help="fraction of peers replaced")
    parser.add_argument("--minutes", type=float, default=10.0, help="virtual minutes of churn")
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--join-concurrency", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.005, help="per-hop latency (s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    async def run() -> None:
        with dht_clock(trio_clock):
            await simulate(
                args.peers,
                network=args.network,
                keys=args.keys,
                owners=args.owners,
                churn=args.churn,
                minutes=args.minutes,
                lookups=args.lookups,
                join_concurrency=args.join_concurrency,
                latency=args.latency,
                seed=args.seed,
                emit=lambda fields: print(json.dumps(fields), flush=True),
            )

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    main()
