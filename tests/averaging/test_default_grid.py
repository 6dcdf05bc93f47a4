"""Default matchmaking grid without ``expected_num_peers``: the key length follows the swarm.

Unit tests drive :class:`GroupKeyManager` with observed counts; the end-to-end test runs 64
real averagers (Kademlia + Noise/yamux on the in-memory network, MockClock) with no size hint.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from dht.kademlia.clock import dht_clock, trio_clock
from moshpit.averaging.group_keys import GroupKeyManager
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
    assert km.num_bits == 4 and km.dimensions == 3  # 64 = 4**3: a 4x4x4 grid
    assert km.swarm_size_estimate == 64
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
