"""A crowded key: more peers look under one key than fit in one group (issue 33).

Every peer cuts the ranking of the looking peers into blocks of ``target_group_size``; a
block's earliest arrival leads it. Before blocks, every peer asked the earliest peer first and the
rest went through full leaders one by one: 64 peers with groups of 16 on one key left peers
alone or in pairs, and arrivals at the same instant formed the same groups every round.
"""

from __future__ import annotations

import itertools

import trio

from dht.p2p.identity import Identity
from moshpit.averaging.group_info import MODE_CLIENT
from moshpit.averaging.matchmaking_blocks import ORDER_RESOLUTION, block_of, rank
from tests.averaging.test_matchmaking import LocalNet, check_consistent, make, run_all

EARLY = dict(start_when_all_joined=True)  # what the averager sets for the shared key


def test_rank_keeps_arrival_order_across_buckets_and_shuffles_inside_one():
    peers = [Identity.generate().peer_id.to_bytes() for _ in range(40)]
    # a peer that arrived a bucket later is later, whatever its hash
    assert all(rank(1.0, p) < rank(1.0 + ORDER_RESOLUTION, q) for p, q in itertools.pairwise(peers))
    # inside one bucket the order is by hash, and another bucket (round) shuffles it anew
    first = sorted(peers, key=lambda p: rank(10.0, p))
    again = sorted(peers, key=lambda p: rank(10.0 + 0.1, p))  # same bucket: same order
    later = sorted(peers, key=lambda p: rank(20.0, p))
    assert first == again and first != later and first != sorted(peers)


def test_rank_takes_any_finite_order_from_the_network():
    # declarations and join requests carry the order; a finite 1e308 used to be hashable only
    # after a bucket that overflowed 8 bytes (OverflowError while reading the key)
    peer = Identity.generate().peer_id.to_bytes()
    keys = [rank(x, peer) for x in (-1.7e308, -1e30, 0.0, 1e30, 1.7e308)]
    assert keys == sorted(keys)


def test_blocks_cut_the_ranking_into_groups_led_by_their_first_peer():
    ranked = [(f"p{i}", "node") for i in range(10)]
    assert block_of(ranked, "p3", 10) is None  # everyone fits: no blocks
    b = block_of(ranked, "p5", 4)
    assert b.leader() == "p4" and b.members == {"p4", "p5", "p6", "p7"} and b.basis == 10
    b = block_of(ranked, "p9", 4)  # the last block holds what is left
    assert b.leader() == "p8" and b.members == {"p8", "p9"}
    # a leader that is gone or would not take us is passed over: the next peer leads
    assert block_of(ranked, "p5", 4).leader(passed_over={"p4"}) == "p5"
    # a client-mode peer never leads: the next peer of its block does
    ranked[4] = ("p4", MODE_CLIENT)
    assert block_of(ranked, "p4", 4).leader() == "p5"
    ranked[5:8] = [(f"p{i}", MODE_CLIENT) for i in range(5, 8)]
    assert block_of(ranked, "p6", 4).leader() is None


async def test_sixty_four_peers_on_one_key_form_four_full_groups_at_once(autojump_clock):
    """64 peers arrive together on one key (groups of 16) over links of 50 ms each way:
    four groups of 16 within a second (before blocks: 1.5-2.1 s); then again, with other groups."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, latency=0.05, visibility_delay=0.1)
        mms = make(net, 64, target_group_size=16, min_matchmaking_time=5.0, **EARLY)
        memberships = []
        for round_ in range(2):
            results, finished = await run_all(mms, ["run.0b"] * 64, window=10.0)
            groups = check_consistent(mms, results)
            sizes = sorted(len(members) for members in groups.values())
            assert sizes == [16] * 4, f"round {round_}: groups of {sizes}"
            assert max(finished.values()) < 1.0, f"round {round_}: {max(finished.values())} s"
            memberships.append({frozenset(i for i, _ in m) for m in groups.values()})
            await trio.sleep(1.0)  # the next round starts a bucket or more later
        # peers that arrive together are shuffled anew: the groups change between rounds
        pairs = [
            {frozenset(p) for g in groups_ for p in itertools.combinations(sorted(g), 2)}
            for groups_ in memberships
        ]
        assert len(pairs[0] & pairs[1]) < len(pairs[0]) / 2
        nursery.cancel_scope.cancel()


async def test_the_last_block_starts_once_complete(autojump_clock):
    """100 peers, groups of 16: the last block (4 peers) does not wait min_matchmaking_time
    for peers of the other blocks, which withdraw as their groups form."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, latency=0.02, visibility_delay=0.1)
        mms = make(net, 100, target_group_size=16, min_matchmaking_time=5.0, **EARLY)
        results, finished = await run_all(mms, ["run.0b"] * 100, window=10.0)
        groups = check_consistent(mms, results)
        assert sorted(len(members) for members in groups.values()) == [4] + [16] * 6
        assert max(finished.values()) < 1.0
        nursery.cancel_scope.cancel()


async def test_late_arrivals_left_over_by_a_full_group_pair_up(autojump_clock):
    """16 peers fill a line's group just before two late arrivals are visible (in the
    256-peer simulation: peers back from a cut, sent to one line by the hole rule). The
    earlier of the two first asks the finished peers one by one ("not looking"), and answers
    the later one "busy" meanwhile. Three busy answers used to count as three failed tries:
    the later one gave up on the only peer still looking, and both stayed alone for the
    whole window (10 s). Now they pair up once the earlier one is free: after
    ``min_matchmaking_time`` (5 s), the wait of a group short of its target."""
    for options in [dict(), EARLY]:  # a grid key, and the shared key
        async with trio.open_nursery() as nursery:
            net = LocalNet(nursery, latency=0.05, visibility_delay=0.3)
            mms = make(net, 18, target_group_size=16, min_matchmaking_time=5.0, **options)
            key = "run.0b1111" if not options else "run.0b"
            results, finished = await run_all(
                mms, [key] * 18, window=10.0, starts=[0.0] * 16 + [0.1, 0.2]
            )
            groups = check_consistent(mms, results)
            assert sorted(len(m) for m in groups.values()) == [2, 16], options
            assert max(finished[16], finished[17]) < 6.0, (options, finished)
            nursery.cancel_scope.cancel()


async def test_a_block_whose_leader_went_silent_forms_around_the_next_peer(autojump_clock):
    """24 peers on one key, groups of 8, a 6-s window: the first arrival leads its block,
    and its links stall before anyone reaches it (a machine gone mid-round: no reset, no
    EOF). Everyone whose first read showed it asks it first, and times out on it after a
    request's time. A timed-out peer used to stay a candidate (and its block's leader) for
    two more tries: with 1-ms links the 7 others of its block formed their group only at the
    deadline, and with 50-ms links no group formed at all (leaders asked it again instead of
    taking their blocks). In the full stack, 64 peers on the shared key with one block's
    leader cut left 7-21 peers alone or in pairs. Now a silent peer is asked last and leads
    nothing: the block's next peer leads, within a second of the timeout."""
    for latency in (0.001, 0.05):
        async with trio.open_nursery() as nursery:
            net = LocalNet(nursery, latency=latency, visibility_delay=0.1)
            mms = make(
                net, 24, target_group_size=8, min_matchmaking_time=5.0, request_timeout=3.0,
                **EARLY,
            )  # fmt: skip
            net.freeze(mms[0].backend.local_peer)
            results, finished = await run_all(
                mms, ["run.0b"] * 24, window=6.0, starts=[0.0] + [0.05] * 23
            )
            groups = check_consistent(mms, results)
            sizes = sorted(len(m) for m in groups.values())
            assert sizes == [7, 8, 8], (latency, sizes)
            assert results[0] is None
            # one request's time on the silent peer (3 s), then the block's next peer leads
            assert max(finished[i] for i in range(1, 24)) < 4.5, (latency, finished)
            nursery.cancel_scope.cancel()
