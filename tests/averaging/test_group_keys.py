"""Moshpit group keys: format, constant length, distinct coordinates, exact grid averaging."""

from __future__ import annotations

import os
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpit.averaging.group_keys import (
    PROBE_EVERY,
    GroupKeyManager,
    coordinate_bits,
    default_num_bits,
    group_position,
    make_group_key,
    parse_group_key,
)


def test_key_format_and_parse():
    assert make_group_key("run", "0110") == "run.0b0110"
    assert parse_group_key("my.run.0b01") == ("my.run", "01")
    assert parse_group_key("run.0b") == ("run", "")
    for bad in ["run", "run.0b012", ".0b01", "run.0bxx"]:
        with pytest.raises(ValueError):
            parse_group_key(bad)
    with pytest.raises(ValueError):
        make_group_key("run", "2")
    with pytest.raises(ValueError):
        GroupKeyManager("bad.0bprefix", 4)
    with pytest.raises(ValueError):
        GroupKeyManager("run", 4, initial_group_bits="01x")


def test_default_num_bits():
    assert coordinate_bits(1) == 1 and coordinate_bits(2) == 1
    assert coordinate_bits(4) == 2 and coordinate_bits(5) == 3 and coordinate_bits(16) == 4
    assert default_num_bits(4) == 0  # unknown swarm size: one key, random groups
    assert default_num_bits(4, expected_num_peers=16) == 2  # 4x4
    assert default_num_bits(2, expected_num_peers=8) == 2  # 2x2x2
    assert default_num_bits(16, expected_num_peers=4096) == 8  # 16^3
    assert default_num_bits(16, expected_num_peers=10) == 0  # one group is enough
    assert len(GroupKeyManager("p", 4, expected_num_peers=256).bits) == 6  # 4^4
    # a key holds at least max(2, M/2) peers on average: half full is fine, a few is not
    assert default_num_bits(32, expected_num_peers=512) == 5  # 32 x 32, keys of 16
    assert default_num_bits(16, expected_num_peers=300) == 4  # not 16^3: keys of ~1.2
    assert default_num_bits(16, expected_num_peers=1024) == 4  # not 16^3: keys of 4
    assert default_num_bits(32, expected_num_peers=150) == 0  # not 32 keys of ~4.7
    assert default_num_bits(2, expected_num_peers=16) == 3  # 2^4, keys of 2


@settings(max_examples=50, deadline=None)
@given(
    group_id=st.binary(min_size=1, max_size=32),
    size=st.integers(min_value=1, max_value=64),
)
def test_positions_form_a_permutation(group_id, size):
    positions = [group_position(group_id, size, i) for i in range(size)]
    assert sorted(positions) == list(range(size))


def test_positions_depend_on_group_id():
    perms = {tuple(group_position(os.urandom(8), 8, i) for i in range(8)) for _ in range(20)}
    assert len(perms) > 1


@settings(max_examples=30, deadline=None)
@given(
    target=st.integers(min_value=2, max_value=16),
    bits=st.text(alphabet="01", max_size=12),
    rounds=st.integers(min_value=1, max_value=8),
)
def test_key_length_constant_and_groupmates_spread(target, bits, rounds):
    size = target
    managers = [GroupKeyManager("run", target, initial_group_bits=bits) for _ in range(size)]
    members = list(range(size))
    for _ in range(rounds):
        group_id = os.urandom(16)
        for i, m in enumerate(managers):
            m.update_after_round(group_id, members, i)
            assert len(m.bits) == len(bits)
            assert m.key == f"run.0b{m.bits}"
        # the coordinate just shifted in is distinct within the group (when it fits in the key)
        if len(bits) >= coordinate_bits(target):
            last = [m.bits[-coordinate_bits(target) :] for m in managers]
            assert len(set(last)) == size


def _simulate_grid(num_peers: int, group_size: int, num_bits: int, rounds: int):
    """Pure-logic Moshpit rounds where groups are exactly the peers sharing a key."""
    rng = random.Random(0)
    values = [rng.random() * 100 for _ in range(num_peers)]
    mean = sum(values) / num_peers
    width = max(num_bits, 1)
    managers = [
        GroupKeyManager(
            "grid",
            group_size,
            initial_group_bits=format(i % (1 << num_bits), f"0{width}b")[-num_bits:]
            if num_bits
            else "",
        )
        for i in range(num_peers)
    ]
    history = []
    for _ in range(rounds):
        groups = defaultdict(list)
        for i, m in enumerate(managers):
            groups[m.key].append(i)
        assert all(len(g) == group_size for g in groups.values())
        for g in groups.values():
            avg = sum(values[i] for i in g) / len(g)
            group_id = rng.randbytes(16)
            for i in g:
                values[i] = avg
                managers[i].update_after_round(group_id, g, i)
        history.append(max(abs(v - mean) for v in values))
    return history


def test_grid_4x4_exact_after_two_rounds():
    history = _simulate_grid(16, 4, 2, rounds=2)
    assert history[-1] < 1e-9


def test_grid_2x2x2_exact_after_three_rounds():
    history = _simulate_grid(8, 2, 2, rounds=3)
    assert history[1] > 1e-6  # not yet exact after 2 rounds
    assert history[-1] < 1e-9


def test_update_without_group_keeps_length():
    m = GroupKeyManager("p", 4, initial_group_bits="0101", rng=random.Random(1))
    keys = {m.update_without_group() for _ in range(20)}
    assert all(len(parse_group_key(k)[1]) == 4 for k in keys)
    assert len(keys) > 1


def _grid_managers(side: int, dims: int, seed: int) -> list[GroupKeyManager]:
    """A full ``side ** dims`` grid: every key holds exactly ``side`` peers."""
    b = coordinate_bits(side)
    managers = []
    for i in range(side**dims):
        coords = [(i // side**k) % side for k in range(1, dims)]
        bits = "".join(format(c, f"0{b}b") for c in coords)
        managers.append(
            GroupKeyManager("g", side, initial_group_bits=bits, rng=random.Random(seed + i))
        )
    return managers


def _one_round(
    managers: list[GroupKeyManager], missing: set[int], rng: random.Random, saw_key: bool = True
) -> None:
    """Everyone but ``missing`` averages in the group of its key; the missing peers get none
    (``saw_key``: they read their key and count the peers there; else they saw nothing)."""
    groups = defaultdict(list)
    for i, m in enumerate(managers):
        if i not in missing:
            groups[m.key].append(i)
    sizes = {i: len(groups[m.key]) + 1 for i, m in enumerate(managers) if i in missing}
    for g in groups.values():
        group_id = rng.randbytes(16)
        for i in g:
            managers[i].update_after_round(group_id, g, i)
    for i in missing:
        managers[i].update_without_group(declared=sizes[i] if saw_key else None)


@pytest.mark.parametrize("side, dims", [(4, 2), (8, 2), (4, 3)])
def test_a_peer_that_missed_a_round_moves_into_the_hole_its_line_leaves(side, dims):
    # On a full grid the members of a line that lost one peer take positions 0..M-2, so one
    # key of the next round lacks a peer. The peer that missed the round must land exactly
    # there, or it sits alone beside full groups until chance puts it in the hole (~M rounds).
    rng = random.Random(7)
    for missing in range(0, side**dims, 3):
        managers = _grid_managers(side, dims, seed=100 * missing)
        _one_round(managers, set(), rng)  # a normal round first: the missing peer had a group
        _one_round(managers, {missing}, rng)
        counts = defaultdict(int)
        for m in managers:
            counts[m.key] += 1
        assert sorted(counts.values()) == [side] * side ** (dims - 1), (missing, dict(counts))


def _line_managers(peers: int, side: int, seed: int, hint: bool = True) -> list[GroupKeyManager]:
    """``peers`` on a partly filled ``side x side`` grid, peer i on line i mod side (as
    benchmarks/sim_swarm.py --grid places them): lines alternate between two lengths.
    ``hint``: the size is passed too (``expected_num_peers``), as a user laying out a grid can."""
    b = coordinate_bits(side)
    return [
        GroupKeyManager(
            "g",
            side,
            initial_group_bits=format(i % side, f"0{b}b"),
            expected_num_peers=peers if hint else None,
            rng=random.Random(seed + i),
        )  # fmt: skip
        for i in range(peers)
    ]


def _key_counts(managers: list[GroupKeyManager]) -> list[int]:
    counts: dict[str, int] = defaultdict(int)
    for m in managers:
        counts[m.key] += 1
    return sorted(counts.values())


def _run_with_misses(
    peers: int, misses: dict[int, set[int]], saw_key: bool, hint: bool = True
) -> tuple[list[GroupKeyManager], list[GroupKeyManager]]:
    """8 x 8 lines, rounds 1..max(misses) with ``misses[r]`` missing round r, next to the same
    swarm without misses (same seeds, same group IDs)."""
    side, last = 8, max(misses)
    managers = _line_managers(peers, side, seed=7 * peers, hint=hint)
    full = _line_managers(peers, side, seed=7 * peers, hint=hint)
    for r in range(1, last + 1):
        _one_round(managers, misses.get(r, set()), random.Random(r), saw_key=saw_key)
        _one_round(full, set(), random.Random(r))
    return managers, full


@pytest.mark.parametrize("saw_key", [True, False])
@pytest.mark.parametrize("peers", [32, 48, 56])
def test_a_peer_that_missed_a_round_of_a_partly_filled_grid_lands_on_a_line_that_exists(
    peers, saw_key
):
    # 8 x 8 at the paper's fill ratios (512, 768, 900 of 1024): 32 peers alternate between
    # lines of 4 (8 keys) and lines of 8 (keys 0-3). The hole a peer's line leaves is at the
    # length of *this* round's line; the last group ran along the other axis, twice or half as
    # long. Sized from it, a peer that missed a round of short lines went to key 7, empty in
    # the next round (lines of 8 sit under keys 0-3), and was alone every second round.
    # saw_key: the peer read its key (it counts the peers there); else it read nothing (cut
    # off) and knows only its own history (and, in the first round, the size hint).
    # Rounds 1 and 2 have no history along their axis yet.
    for missed_round in (1, 2, 3, 4):
        for missing in range(0, peers, 5):
            managers, full = _run_with_misses(peers, {missed_round: {missing}}, saw_key)
            # the next round's keys hold what they would have held had the peer been there
            assert _key_counts(managers) == _key_counts(full), (missed_round, missing)
            keys = [m.key for m in managers]
            assert keys.count(keys[missing]) > 1, (missed_round, missing)  # not alone


@pytest.mark.parametrize("peers", [32, 48])
def test_the_hole_is_sized_from_the_line_not_from_a_group_short_of_a_member(peers):
    # A peer's group is shorter than its line when another member missed that round. Sized
    # from that group alone, the line's hole two rounds later was one place short: the peer
    # landed on a line one too long (a group of M and a peer alone) and the grid kept that
    # shape, one peer alone every second round, until the run ended. Of the last two rounds
    # along the axis, the longer one sizes the line.
    for a in range(0, peers, 7):
        mates = [i for i in range(peers) if i != a]
        rng = random.Random(a)
        for _ in range(3):
            b = rng.choice(mates)  # misses round 4: a's line of 8 may be a group of 7 for a
            managers, full = _run_with_misses(peers, {4: {b}, 6: {a}}, saw_key=False)
            assert _key_counts(managers) == _key_counts(full), (a, b)


@pytest.mark.parametrize("missed_round", [1, 2, 3, 4])
def test_a_read_that_saw_part_of_the_line_does_not_shrink_its_hole(missed_round):
    # A read early in the round sees only the peers that had declared by then: a count of 2
    # in a line of 4 or 8. Taken as the line's length, it sent the peer to a place another
    # member took (full stack, 32 peers on 8 x 8: one line too long and a peer alone every
    # second round for the rest of the run); the count is a lower bound.
    peers, side = 32, 8
    for missing in range(0, peers, 3):
        managers = _line_managers(peers, side, seed=missing)
        full = _line_managers(peers, side, seed=missing)
        for r in range(1, missed_round + 1):
            rng = random.Random(r)
            if r < missed_round:
                _one_round(managers, set(), rng)
            else:
                groups = defaultdict(list)
                for i, m in enumerate(managers):
                    if i != missing:
                        groups[m.key].append(i)
                for g in groups.values():
                    group_id = rng.randbytes(16)
                    for i in g:
                        managers[i].update_after_round(group_id, g, i)
                managers[missing].update_without_group(declared=2)  # saw one other
            _one_round(full, set(), random.Random(r))
        assert _key_counts(managers) == _key_counts(full), (missed_round, missing)


@pytest.mark.parametrize("peers", [32, 48])
def test_a_peer_cut_off_in_the_first_round_needs_the_size_hint(peers):
    # Before any group, a peer that read nothing has no line length; with the grid's size
    # (expected_num_peers) it has the first round's (N / M per key), without it none, and it
    # moves at random (in rounds 2..d of a user's grid every line is full: no hint needed)
    managers, full = _run_with_misses(peers, {1: {0}}, saw_key=False, hint=True)
    assert _key_counts(managers) == _key_counts(full)
    managers, full = _run_with_misses(peers, {2: {0}}, saw_key=False, hint=False)
    assert _key_counts(managers) == _key_counts(full)


def test_a_peer_missing_round_after_round_wanders_at_random():
    # the hole rule is for one missed round; a peer alone again and again (an empty line,
    # a full key) must keep moving to random keys so that lonely peers find company
    m = GroupKeyManager("p", 4, initial_group_bits="0101", rng=random.Random(3))
    m.update_after_round(b"x" * 16, [0, 1, 2, 3], 0)
    first = m.update_without_group(declared=4)
    assert first.endswith("11")  # position 3 of a line of 4: the hole the other 3 leave
    later = {m.update_without_group(declared=4)[-2:] for _ in range(30)}
    assert len(later) > 1


def test_a_peer_whose_first_read_saw_a_few_grows_with_the_swarm():
    # 64 peers on the shared key, groups of 8: a peer whose block filled within its first
    # read of the swarm's first round counted 8; in round 2 it read 63. The median (35)
    # kept it on the shared key while the swarm grew; counts only ever miss peers
    m = GroupKeyManager("p", 8, rng=random.Random(5))
    m.update_after_round(b"a" * 16, list(range(8)), 0, declared=8)
    m.update_after_round(b"b" * 16, list(range(8)), 0, declared=63)
    assert m.num_bits == 3
    # the newest count, not the largest: a swarm that shrank from 40 to 20 peers does not
    # grow on the count from before (it would hold keys of 2-3 peers)
    m = GroupKeyManager("p", 8, rng=random.Random(5))
    for declared in (40, 20, 20):
        m.update_after_round(os.urandom(16), list(range(8)), 0, declared=declared)
    assert m.num_bits == 0


def test_a_peer_left_on_a_shorter_grid_follows_the_swarm_that_grew():
    # 58 of 64 peers grew to a 2-d grid (3 bits) while 6 stayed on the shared key: their
    # estimates, from early reads of a crowded key, were low. They then met only each other
    # (a swarm of 6 that saw nothing to grow for) and never averaged with the others again.
    m = GroupKeyManager("p", 8, rng=random.Random(4))
    assert m.adaptive and m.num_bits == 0
    for _ in range(3):  # low estimates: stays on the shared key
        m.update_after_round(b"g" * 16, list(range(6)), 2, declared=6)
    assert m.num_bits == 0
    probes = [m.longer_key() for _ in range(2 * PROBE_EVERY)]  # one round in PROBE_EVERY
    assert sum(p is not None for p in probes) == 2
    assert all(len(parse_group_key(p)[1]) == 3 for p in probes if p is not None)
    m.observe_longer(1, own=6)  # one peer there is no evidence
    m.update_after_round(b"g" * 16, list(range(6)), 2, declared=6)
    assert m.num_bits == 0
    m.observe_longer(7, own=6)  # ~56 peers on the longer grid against our 6
    m.update_after_round(b"g" * 16, list(range(6)), 2, declared=6)
    assert m.num_bits == 3
    # and it stays there: the low estimates that kept it behind were dropped
    for _ in range(4):
        m.update_after_round(os.urandom(16), list(range(8)), 3, declared=7)
    assert m.num_bits == 3
    fixed = GroupKeyManager("p", 8, initial_group_bits="")
    assert fixed.longer_key() is None  # a user's grid is never changed
