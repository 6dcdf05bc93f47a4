"""The at-scale simulation (benchmarks/sim_swarm.py) at test size.

test_moshpit.py already covers exact averaging on 4x4 and 2x2x2 grids and geometric
convergence under permanent churn (killed peers), test_default_grid.py the default grid of 64.
New here: the heterogeneous WAN network of the simulation (per-address delay and bandwidth)
and transient failures (a peer cut off mid-round that comes back for the next one), with the
same code the benchmark runs.
"""

from __future__ import annotations

import pytest
import trio

from benchmarks.sim_swarm import MBIT, WanNetwork, grid_bits, open_sim
from dht.kademlia.clock import dht_clock, trio_clock


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


def test_wan_links_are_drawn_per_address_and_cut_takes_them_down():
    net = WanNetwork(seed=5)
    ports = range(1, 200)
    for p in ports:
        delay, bandwidth = net.access(p)
        assert 0.005 <= delay <= 0.050 and 10 * MBIT <= bandwidth <= 1000 * MBIT
    assert net.access(7) == WanNetwork(seed=5).access(7)  # reproducible per (seed, address)
    rtts = [2 * net._link(1, p).latency for p in range(2, 200)]
    assert 0.020 <= min(rtts) and max(rtts) <= 0.200 and max(rtts) - min(rtts) > 0.05
    link = net._link(3, 9)
    assert link.bandwidth == min(net.access(3)[1], net.access(9)[1]) and link.up
    net.cut(9)
    assert not net._link(3, 9).up and not net._link(9, 4).up and net._link(3, 4).up
    net.restore()
    assert net._link(3, 9).up
    net.set_link(3, 4, up=False)  # explicit settings still win
    assert not net._link(3, 4).up


def test_grid_bits_place_peers_on_lines():
    assert grid_bits(8, 4) == ["00", "01", "10", "11"] * 2
    assert len(set(grid_bits(64, 8))) == 8


async def test_transient_failures_on_wan_links_still_converge_geometrically(
    autojump_clock, virtual_dht_time
):
    # the error that shrinks geometrically is the variance around the mean (what the Moshpit
    # paper bounds): a peer that failed keeps its value, so the largest deviation can stall
    async with open_sim(16, seed=3, numel=64, grid=4) as sim:
        variances = [sim.variance()]
        failed = 0
        for _ in range(6):
            row = await sim.round(fail=0.15, fail_window=3.0)
            failed += row["failed_peers"]
            variances.append(row["variance"])
        assert failed >= 3  # the failure process did hit peers
        # cut peers come back for the next round; averaging never grows the variance
        # (measured with seed 3: variance 0.18 after round 1, float32 rounding after round 2;
        # before stale declarations were withdrawn: ratios 0.18, 0.17, 0.16, 0.43, 0.48, 0.40)
        # (once a round lands every peer on the mean, the variance is float32 rounding,
        # ~1e-15, and its ratios are noise: only rounds that start above that count)
        ratios = [b / a for a, b in zip(variances, variances[1:], strict=False) if a > 1e-12]
        assert ratios and max(ratios) < 1.0, variances
        geometric_mean_ratio = (max(variances[-1], 1e-30) / variances[0]) ** (
            1 / (len(variances) - 1)
        )
        assert geometric_mean_ratio < 0.5, ratios


async def test_a_peer_cut_off_for_one_round_rejoins_a_whole_line(autojump_clock, virtual_dht_time):
    # 16 peers on a full 4 x 4 grid: one is cut off in round 2, so its line averages as 3.
    # It must come back into the one key of round 3 that its line left short, so that rounds
    # 3 and 4 are whole grid rounds again and every peer holds the exact mean after round 4.
    # (Moving to a random key, it met a full group and stayed alone 3 times in 4.)
    async with open_sim(16, seed=1, numel=64, grid=4) as sim:
        first = await sim.round(fail=0.0, fail_window=3.0)
        assert first["steps_failed"] == 0
        # the peer cut is the last of its line in the matchmaking order, so not its leader:
        # a leader cut off takes its waiting followers' round with it (measured separately)
        line = [i for i, a in enumerate(sim.averagers) if a.keys.key == sim.averagers[0].keys.key]
        last = max(line, key=lambda i: sim.swarm.nodes[i].host.peer_id.to_bytes())
        # cut at the start of the round: it never joined a group it could leave a hole in
        cut = await sim.round(fail=0.0, fail_window=0.01, cut=[last], gap=10.0)
        assert cut["failed_peers"] == 1 and cut["error"] > 1e-3
        for _ in range(2):
            # 10 s apart (local steps between rounds), so that stale declarations of the last
            # round (their own fix, tested below) do not cost anyone its group
            row = await sim.round(fail=0.0, fail_window=3.0, gap=10.0)
            assert row["steps_failed"] == 0, row  # nobody alone: the lost peer found its place
            assert row["mean_group_size"] == 4
        assert row["error"] < 1e-6


async def test_back_to_back_rounds_on_wan_links_keep_whole_groups(autojump_clock, virtual_dht_time):
    # Round 2 uses the same keys as round 1. A finished peer's round-1 declaration stayed in
    # the DHT until its matchmaking deadline and sorted first, so round-2 peers asked finished
    # peers (a WAN round trip and a dial each) while their leaders' time ran out: groups of
    # 2-3 and peers alone. Members now withdraw their declaration once their group formed.
    async with open_sim(16, seed=2, numel=64, grid=4) as sim:
        keys = {a.keys.key for a in sim.averagers}
        first = await sim.round(fail=0.0, fail_window=3.0)
        assert first["steps_failed"] == 0
        await trio.sleep(0.5)  # the withdrawals are stored in the background
        reader = sim.averagers[0]._mm_backend
        for key in keys:  # every member of every group withdrew: nobody invites joins
            declarations = await reader.list_candidates(key)
            assert len(declarations) == 4
            assert not any(d.looking for d in declarations), (key, declarations)
        second = await sim.round(fail=0.0, fail_window=3.0)  # back to back, same keys
        assert second["steps_failed"] == 0 and second["mean_group_size"] == 4, second
        assert second["error"] < 1e-6  # a whole 4 x 4 grid is exact after 2 rounds
        assert second["consensus_error"] < 1e-6 and second["drift"] < 1e-7  # nothing failed
        # no time lost on finished peers: round 2 is as quick as round 1 (virtual seconds;
        # with the stale declarations it took 1.6-2x as long on seeds 0-3)
        assert second["virtual_s"] < 1.4 * first["virtual_s"], (first, second)


async def test_a_crowded_shared_key_forms_whole_groups_every_round(
    autojump_clock, virtual_dht_time
):
    # 32 peers without hints, groups of 8: one shared key (32 <= 8 ** 1.75) holding four
    # groups' worth, ranked into blocks (test_crowded_key.py tests the rule itself, and fails
    # without it). Measured on the full stack, 3 rounds: with blocks 15 of 15 rounds formed
    # four groups of 8; before, every run's first round left a peer alone (a group of 7 and
    # 10 virtual s) and one run's second round formed groups of 2 and 6. The bound leaves one
    # first-round miss (2 in 28 rounds at 40 peers) room, not a regression. One block may
    # break up in one of the rounds: a declaration that lands a second after the others
    # moves the blocks of peers that already acted (1 in 37-84 first rounds with seeded
    # identities; docs/averaging.md, "Known limitations"); before blocks it was most rounds
    async with open_sim(32, seed=4, numel=64, target_group_size=8) as sim:
        assert len({a.keys.key for a in sim.averagers}) == 1
        whole, alone, split, pairs_seen = 0, 0, 0, []
        for _ in range(3):
            row = await sim.round(fail=0.0, fail_window=3.0)
            sizes = sorted(len(g) for g in row["groups"])
            split += min(sizes) < 5  # pairs or triples: leftovers, not blocks
            whole += sizes.count(8)
            alone += row["steps_failed"]
            pairs_seen.append({(a, b) for g in row["groups"] for a in g for b in g if a < b})
        assert split <= 1 and whole >= 11 and alone <= 1, (split, whole, alone)
        # the groups change from round to round (arrivals at one instant are reshuffled)
        assert len(pairs_seen[1] & pairs_seen[2]) < 0.6 * len(pairs_seen[2])
