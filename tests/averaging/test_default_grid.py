"""Default matchmaking grid without ``expected_num_peers``: the key length follows the swarm.

Unit tests drive :class:`GroupKeyManager` with observed counts; the end-to-end test runs 64
real averagers (Kademlia + Noise/yamux on the in-memory network, MockClock) with no size hint.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import trio

from dht.kademlia.clock import dht_clock, trio_clock
from moshpit.averaging.group_keys import FOLLOW_READS, PROBE_EVERY, GroupKeyManager
from tests.averaging.test_moshpit import flat, moshpit_swarm, stats, step_all


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


def _round(km: GroupKeyManager, declared: int) -> None:
    km.update_after_round(random.randbytes(8), ["a", "b", "c", "d"], "a", declared)


def test_default_is_adaptive_but_user_sizes_are_kept():
    assert GroupKeyManager("p", 4).adaptive
    assert not GroupKeyManager("p", 4, expected_num_peers=64).adaptive
    assert not GroupKeyManager("p", 4, initial_group_bits="").adaptive
    fixed = GroupKeyManager("p", 4, initial_group_bits="")
    for _ in range(10):
        _round(fixed, declared=64)
    assert fixed.num_bits == 0  # an explicit choice is never overridden


def test_grows_to_the_grid_of_the_observed_swarm_and_shrinks_back():
    km = GroupKeyManager("p", 4, rng=random.Random(1))
    assert km.num_bits == 0 and km.dimensions == 1
    _round(km, declared=64)
    assert km.num_bits == 0  # one estimate is not enough to move
    _round(km, declared=64)
    # 64 = 4**3: a 4x4x4 grid, one dimension per round (keys of positions fill evenly)
    assert km.num_bits == 2 and km.dimensions == 2
    _round(km, declared=16)  # the count of a 2-bit key; the next dimension comes anyway
    assert km.num_bits == 4 and km.dimensions == 3
    # on the grid, ~4 peers per key (16 keys) keep the estimate at ~64: no flapping
    for declared in [4, 5, 3, 4, 6, 2, 4]:
        _round(km, declared)
        assert km.num_bits == 4, (declared, km.swarm_size_estimate)
    # the swarm shrank to a handful: back to one shared key
    for _ in range(5):
        _round(km, declared=1)
    assert km.num_bits < 4
    for _ in range(10):
        km.update_without_group(declared=1)
    assert km.num_bits == 0


def test_small_swarms_stay_on_one_key():
    for n in range(1, 12):
        km = GroupKeyManager("p", 4)
        for _ in range(6):
            _round(km, declared=n)
        assert km.num_bits == 0, n


def test_a_peer_left_on_the_shared_key_finds_a_swarm_two_dimensions_ahead():
    # 1024 peers in groups of 8 leave the shared key for 6 bits (a 3-d grid) after their
    # first round, all at once. A peer that missed that round stayed on the shared key,
    # alone: its probe one dimension longer (3 bits) found nobody, every fourth round, for
    # good (1 seed in 20 of benchmarks/sim_rounds.py stalled at a variance of 2e-4). Alone
    # round after round it now probes every round, one dimension further after an empty one.
    km = GroupKeyManager("p", 8, rng=random.Random(5))
    km.update_without_group(declared=1)  # missed the first round
    swarm_bits = 6
    rounds = 0
    while km.num_bits != swarm_bits and rounds < 8:
        rounds += 1
        probe = km.longer_key()
        if probe is not None:
            extra = len(probe.rpartition(".0b")[2]) - km.num_bits
            km.observe_longer(16 if km.num_bits + extra == swarm_bits else 0, own=1)
        km.update_without_group(declared=1)
    assert km.num_bits == swarm_bits
    assert rounds <= 4, rounds  # the swarm is averaging to 1e-9 in ~10 rounds meanwhile


def test_a_count_of_one_does_not_hold_back_the_grid():
    # 150 peers in groups of 16: a peer cut off in the first round counted only itself (1),
    # then 150 on the shared key. The median of the two (75) is below the band that grows
    # the grid (16**1.75 = 128), so it stayed on the shared key while the others grew, and
    # kept a cluster apart for rounds. Being alone argues for shrinking, not against growing.
    km = GroupKeyManager("p", 16, rng=random.Random(2))
    km.update_without_group(declared=1)
    km.update_after_round(random.randbytes(8), list(range(16)), 3, declared=150)
    assert km.num_bits == 4  # 150 = 16**1.8: a 2-d grid, as the others
    # alone under a grid that is too large, counts of 1 still shrink it
    for _ in range(6):
        km.update_without_group(declared=1)
    assert km.num_bits == 0


def test_a_new_peer_looks_ahead_in_its_first_round_and_follows_at_once():
    km = GroupKeyManager("p", 4, rng=random.Random(3))
    probe = km.longer_key()  # the first round looks one dimension on, before declaring
    assert probe is not None and km.probe_before_declaring
    assert len(probe.rpartition(".0b")[2]) == 2
    assert km.follow_longer_now(count=3, own=1)
    assert km.key == probe and km.num_bits == 2
    # it averaged there: its next look comes on the usual schedule, and only while declaring
    km.update_after_round(random.randbytes(8), ["a", "b", "c", "d"], "a", declared=4)
    assert km.num_bits == 2
    looks = [km.longer_key() for _ in range(PROBE_EVERY - 1)]  # rounds 2..PROBE_EVERY
    assert [k is not None for k in looks] == [False] * (PROBE_EVERY - 2) + [True]
    assert not km.probe_before_declaring  # it has a group now: it looks while declaring


@pytest.mark.parametrize(
    "count, own, follows",
    [(3, 1, True), (2, 1, True), (1, 1, False), (0, 1, False), (3, 2, False), (9, 5, False)],
)
def test_a_new_peer_follows_only_from_an_empty_key_to_a_group(count, own, follows):
    km = GroupKeyManager("p", 4, rng=random.Random(4))
    probe = km.longer_key()
    assert km.follow_longer_now(count, own) is follows
    assert km.key == (probe if follows else "p.0b")


def test_a_new_peer_reads_other_keys_of_the_longer_grid_and_follows_the_fullest():
    km = GroupKeyManager("p", 4, rng=random.Random(6))
    probe = km.longer_key()
    others = km.other_longer_keys()
    # a 2-bit grid has 4 keys: the probe and the 3 others are all of them
    assert sorted([probe, *others]) == ["p.0b00", "p.0b01", "p.0b10", "p.0b11"]
    with pytest.raises(ValueError, match="not a key of the grid"):
        km.follow_longer_now(3, 1, "p.0b0101")
    with pytest.raises(ValueError, match="not a key of the grid"):
        km.follow_longer_now(3, 1, "q.0b01")
    assert km.follow_longer_now(3, 1, others[1]) and km.key == others[1]
    # on a larger grid: FOLLOW_READS - 1 distinct others, under our bits, of the probe's length
    big = GroupKeyManager("p", 16, initial_group_bits="1010", rng=random.Random(7), adaptive=True)
    probe = big.longer_key()
    others = big.other_longer_keys()
    assert len(others) == FOLLOW_READS - 1 and len({probe, *others}) == FOLLOW_READS
    assert all(k.startswith("p.0b1010") and len(k) == len(probe) for k in others)
    assert GroupKeyManager("p", 4, initial_group_bits="01").other_longer_keys() == []


def test_the_first_look_of_a_new_swarm_leaves_the_schedule_alone():
    # everyone starts at once: nobody is ahead, the look finds nobody and changes nothing
    km = GroupKeyManager("p", 4, rng=random.Random(5))
    first = km.longer_key()
    assert first is not None and len(first.rpartition(".0b")[2]) == 2
    km.observe_longer(0, own=40)
    km.update_after_round(random.randbytes(8), ["a", "b", "c", "d"], "a", declared=40)
    looks = [km.longer_key() for _ in range(PROBE_EVERY - 1)]
    assert looks[:-1] == [None] * (PROBE_EVERY - 2) and looks[-1] is not None  # as before
    assert len(looks[2].rpartition(".0b")[2]) == 2  # still one dimension on


def test_only_a_peer_stranded_on_an_empty_key_looks_before_declaring():
    # alone twice on a key nobody else uses: the swarm probably left; look first
    stranded = GroupKeyManager(
        "p", 8, initial_group_bits="010", rng=random.Random(8), adaptive=True
    )
    stranded.longer_key()  # its first look, before the rounds below
    for _ in range(2):
        stranded.update_without_group(declared=1)
    assert stranded.longer_key() is not None and stranded.probe_before_declaring
    # alone twice as the 9th peer of a full key: reading first would make it declare last,
    # and the last to declare on a full key is left over again
    crowded = GroupKeyManager("p", 8, initial_group_bits="010", rng=random.Random(9), adaptive=True)
    crowded.longer_key()
    crowded.update_after_round(random.randbytes(8), list(range(8)), 0, declared=8)
    for _ in range(2):
        crowded.update_without_group(declared=9)
    assert crowded.longer_key() is not None and not crowded.probe_before_declaring


def test_a_user_grid_never_looks_ahead():
    km = GroupKeyManager("p", 4, initial_group_bits="01")
    assert km.longer_key() is None and not km.probe_before_declaring
    assert not km.follow_longer_now(count=9, own=1) and km.key == "p.0b01"


@pytest.mark.parametrize("starts_after", [0.5, 0.0])
async def test_a_volunteer_joining_an_adaptive_swarm_averages_in_its_first_round(
    autojump_clock, virtual_dht_time, starts_after
):
    # 12 peers in groups of 4 grow from the shared key to 4 keys of 3 (12 = 4**1.8) after
    # two rounds. A 13th peer that starts then (a restarted VM) begins on the shared key,
    # where nobody is any more: before, it averaged alone there for three rounds.
    # starts_after=0.5: the others have declared, and its look before declaring finds them.
    # starts_after=0: it steps at the same moment as the others (as every peer of
    # sim_swarm.py does), and that look runs while their declarations are still being
    # stored and finds nobody: before, it then sat alone under the shared key for the whole
    # round (4 s, twice the others' round). It looks again part way in and moves to them.
    n, m = 13, 4
    async with moshpit_swarm(n, None, target_group_size=m, min_matchmaking_time=2.0) as (
        averagers,
        _,
    ):
        newcomer = averagers[-1]
        swarm = averagers[:-1]
        for _ in range(3):
            await step_all(swarm)
        assert Counter(a.keys.num_bits for a in swarm) == {2: n - 1}
        assert newcomer.keys.num_bits == 0
        results: dict[str, object] = {}

        async def join() -> None:
            await trio.sleep(starts_after)
            results["newcomer"] = await newcomer.astep()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(join)
            results["swarm"] = await step_all(swarm)
        first = results["newcomer"]
        assert first.succeeded, first.reason
        assert first.group_key.startswith("test.0b") and len(first.group_key) == len("test.0b01")
        assert 2 <= first.group_size <= m
        assert all(r.succeeded for r in results["swarm"]), [r.reason for r in results["swarm"]]
        assert newcomer.keys.num_bits == 2
        if starts_after == 0:
            # the shared key it left reads as "not looking" (withdrawn) before its record
            # expires: a later straggler's look is not misled into staying there for it
            await trio.sleep(0.5)
            backend = swarm[0]._attached()[1]
            me = newcomer._attached()[3].peer_id
            left = [c for c in await backend.list_candidates("test.0b") if c.peer == me]
            assert left and not any(c.looking for c in left)


async def test_default_swarm_of_64_forms_moshpit_groups(autojump_clock, virtual_dht_time):
    n, m = 64, 4
    async with moshpit_swarm(n, None, target_group_size=m, min_matchmaking_time=1.0) as (
        averagers,
        _,
    ):
        assert all(a.keys.num_bits == 0 for a in averagers)  # no size hint given
        mean0, var0, _ = stats(averagers)
        variances = [var0]
        last = None
        for _ in range(6):
            last = await step_all(averagers)
            mean, var, _ = stats(averagers)
            assert torch.allclose(mean, mean0, atol=1e-3)  # mean preserved every round
            assert var <= variances[-1] + 1e-6
            variances.append(var)
        # the grid grew to 3 dimensions (4 key bits), the same for everyone
        assert Counter(a.keys.num_bits for a in averagers) == {4: n}
        # grid keys wait for their line; start-when-all-joined is only for the shared key
        assert not any(a.matchmaker.start_when_all_joined for a in averagers)
        # the last round ran in groups of about the target size, not one crowd of 64
        sizes = [res.group_size for res in last if res.succeeded]
        assert len(sizes) >= n * 3 // 4, [res.reason for res in last if not res.succeeded]
        assert max(sizes) <= m
        # keys are filled at random (Poisson-like, mean 4), so some groups are smaller
        assert sum(sizes) / len(sizes) >= 2.5
        keys = {res.group_key for res in last}
        assert len(keys) >= 8  # peers spread over many grid keys
        # ~3-4x less variance per round (a random, not exact, grid): >= 100x in 6 rounds
        assert variances[-1] < var0 / 100, variances
        for a in averagers:
            with a.get_tensors() as ts:
                assert flat(ts).shape == mean0.shape


@pytest.mark.parametrize("late", [0.0, 0.3])
async def test_the_peer_left_over_on_a_full_key_finds_the_key_a_peer_short(
    autojump_clock, virtual_dht_time, late
):
    # Groups of 4 on a grid: 5 peers under one key and 3 under another (a peer too many
    # here, one short there, as a missed round leaves them). The first four fill a group
    # and start; before, the fifth sat the round out, and the pattern came back round after
    # round (sim_swarm.py, 64 peers in groups of 8: keys of 9 and 7, a peer alone each
    # round). Alone part way into the round, it reads the other keys and joins the three.
    bits = ["00"] * 5 + ["01"] * 3
    async with moshpit_swarm(8, bits, target_group_size=4, min_matchmaking_time=2.0) as (
        averagers,
        _,
    ):

        async def step(i: int) -> None:
            if i == 4:
                await trio.sleep(late)  # declares after the other four: the one left over
            results[i] = await averagers[i].astep()

        results: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(step, i)
        assert all(r.succeeded for r in results.values()), [r.reason for r in results.values()]
        sizes = sorted(r.group_size for r in results.values())
        assert sizes == [4] * 8
        assert Counter(r.group_key for r in results.values()) == {"test.0b00": 4, "test.0b01": 4}
        if late:
            assert results[4].group_key == "test.0b01"


async def test_the_peer_the_ranking_leaves_over_moves_before_the_others_withdraw(
    autojump_clock, virtual_dht_time
):
    # The same 5 + 3 peers on 50-ms links with the default request timeout (3 s). The key
    # of five is ranked into a block of four and a block of one; the four form their group
    # at once, but their withdrawals are DHT stores and a read still shows them looking at
    # both looks around (the simulated WAN: 2-3 s after the group formed). The fifth used
    # to stay for that count, and sat the round out (6 of 6 runs: groups of 4 and 3, one
    # alone); a block of its own is reason enough to move
    bits = ["00"] * 5 + ["01"] * 3
    async with moshpit_swarm(
        8, bits, latency=0.05, target_group_size=4, min_matchmaking_time=2.0,
        request_timeout=3.0,
    ) as (averagers, _):  # fmt: skip
        results: dict[int, object] = {}

        async def step(i: int) -> None:
            results[i] = await averagers[i].astep()

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(step, i)
        assert all(r.succeeded for r in results.values()), [r.reason for r in results.values()]
        assert sorted(r.group_size for r in results.values()) == [4] * 8


def test_sibling_keys_cover_a_small_grid_and_a_key_with_room_is_drawn_among_them():
    km = GroupKeyManager("p", 8, rng=random.Random(0))
    assert km.sibling_keys() == []  # the shared key has no siblings
    km.bits = "101"  # a grid of 8 keys (groups of 8): every other key is read
    km.num_bits = 3
    siblings = km.sibling_keys()
    assert sorted(siblings) == sorted(f"p.0b{v:03b}" for v in range(8) if v != 5)
    # room: 2 or more looking (a group forming), fewer than the target (not full)
    looking = [(7, "p.0b000"), (8, "p.0b001"), (1, "p.0b010"), (7, "p.0b011"), (0, "p.0b100")]
    drawn = Counter(km.key_with_room(looking) for _ in range(400))
    assert set(drawn) == {"p.0b000", "p.0b011"}  # both: peers left over together spread
    assert min(drawn.values()) > 120
    assert km.key_with_room([(8, "p.0b000"), (1, "p.0b001")]) is None
    km.move_sideways("p.0b011")
    assert km.key == "p.0b011"
    for bad in ["p.0b01", "q.0b011", "p.0b0110"]:
        with pytest.raises(ValueError, match="not a key of our grid"):
            km.move_sideways(bad)
    # a grid of 2**6 keys (groups of 8 on 2 coordinates): a sample of distinct keys
    km.bits, km.num_bits = "000111", 6
    many = km.sibling_keys()
    assert len(many) == len(set(many)) == 7 and km.key not in many
    assert all(len(k) == len("p.0b000111") for k in many)
