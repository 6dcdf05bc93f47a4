"""benchmarks/sim_dht.py scaled down: every peer joins through one address, lookups stay
within log2 N hops, keys survive 30 % replacement, and each peer's traffic stays bounded.

Overlap with other tests, left to them: exact k-nearest and median hops (test_swarm.py),
the swarm-wide mean message rate under 30 % churn per minute (test_republish.py).
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sim_dht import simulate  # noqa: E402


async def test_all_lookups_within_log2_n_hops_after_joining_through_one_address(
    autojump_clock, virtual_dht_time
):
    """256 peers join one after another through the first peer's address only.

    Without the far-bucket refresh at join (DHTNode._bootstrap) such swarms stored and read
    ~0.6 % of fresh keys (1-4 % at 1024 peers) away from their true nearest peers, so gets
    right after the stores missed some. Without the refresh of buckets split off later
    (DHTNode._refresh_far_bucket) 43-111 far buckets stayed empty here, and ~1 get in 6000 missed (a CI
    run failed on one of 300). Peer IDs are random, so the misses show only in some runs; the
    empty buckets show in every run.
    """
    peers = 256
    results = await simulate(
        peers, keys=300, owners=30, churn=0.0, lookups=300, join_concurrency=1, seed=1
    )
    assert results["bootstrap"]["routing_table_min"] >= 20
    assert results["bootstrap"]["empty_far_buckets"] == 0
    lookups = results["lookups"]
    assert lookups["stores_accepted"] == 1.0
    assert lookups["found_rate"] >= 0.999, lookups
    hops = {int(h): n for h, n in lookups["hops_histogram"].items()}
    assert sum(hops.values()) >= 300
    # O(log N): every lookup, not just the median, within log2 N sequential hops
    assert max(hops) <= math.log2(peers), hops


@pytest.mark.parametrize(
    "network, peers",
    [("loopback", 64), pytest.param("memory", 32, marks=pytest.mark.slow)],
)
async def test_keys_survive_30_percent_replacement_with_bounded_traffic_per_peer(
    autojump_clock, virtual_dht_time, network, peers
):
    """30 % of the peers (owners excepted) are replaced one by one over 2 virtual minutes
    while 12 owners republish their keys; real hosts (Noise + yamux) with network=memory
    (slow: ~30 s of CPU, nearly all of it in the transport stack)."""
    keys = 160 if network == "loopback" else 96
    results = await simulate(
        peers, network=network, keys=keys, owners=12, churn=0.3, minutes=2, lookups=100, seed=2
    )
    assert results["lookups"]["found_rate"] >= 0.999
    churn = results["churn"]
    assert churn["replaced"] == round(0.3 * peers)
    assert churn["readable_after_last_replacement"] >= 0.999, churn
    assert results["churn_one_interval_later"]["missing"] == 0
    traffic = results["traffic"]
    # docs/dht.md "Bounded work": republishing + a constant 60 for joins, hand-over, refreshes
    assert traffic["mean_sent_per_peer_minute"] <= traffic["bound_mean"], traffic
    assert traffic["owner_sent_per_minute_max"] <= traffic["bound_owner"], traffic
    assert traffic["non_owner_sent_per_minute_max"] <= 60, traffic
    assert traffic["served_per_minute_max"] <= 2 * traffic["bound_mean"], traffic
