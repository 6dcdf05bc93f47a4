"""Matchmaking logic over an in-process backend (trio memory channels + a shared directory).

These tests exercise the algorithm (ordering, merging, redirects, deadlines, bad input) in
isolation and fast under the autojump clock; the multi-peer tests over the real DHT, Host and
all-reduce live in test_moshpit*.py / test_averager*.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from typing import Any

import msgpack
import pytest
import trio

from dht.p2p.identity import Identity, PeerID
from moshpit.averaging.group_info import GroupInfo
from moshpit.averaging.matchmaking import (
    Declaration,
    JoinRequest,
    Matchmaker,
    MatchmakingDispatcher,
    MatchmakingError,
    SchemaMemory,
)
from moshpit.averaging.matchmaking_state import MatchmakingRound, Member


class ChannelStream:
    """One end of an in-process bidirectional message stream; messages go through msgpack."""

    def __init__(self, remote_peer, send, receive, net: LocalNet, owner):
        self.remote_peer = remote_peer
        self._send, self._receive = send, receive
        self.net, self.owner = net, owner

    async def send_msg(self, obj: Any) -> None:
        if self.owner in self.net.dead:
            raise trio.BrokenResourceError("peer is dead")
        if self.net.frozen & {self.owner, self.remote_peer}:
            await trio.sleep_forever()  # a stalled link: nothing arrives, nothing is refused
        await trio.sleep(self.net.latency)
        await self._send.send(msgpack.packb(obj, use_bin_type=True))

    async def receive_msg(self, max_size=None) -> Any:
        try:
            data = await self._receive.receive()
        except trio.EndOfChannel:
            raise EOFError("stream closed") from None
        if max_size is not None and len(data) > max_size:
            raise trio.BrokenResourceError("message too large")
        return msgpack.unpackb(data, raw=False)

    async def aclose(self) -> None:
        if self.net.frozen & {self.owner, self.remote_peer}:
            return  # over a stalled link not even the close arrives
        await self._send.aclose()
        await self._receive.aclose()


class LocalNet:
    """Directory with visibility delay + stream routing between LocalBackends."""

    def __init__(
        self, nursery: trio.Nursery, latency: float = 0.001, visibility_delay: float = 0.01
    ):
        self.nursery = nursery
        self.latency = latency
        self.visibility_delay = visibility_delay
        self.directory: dict[str, dict[PeerID, tuple[Declaration, float, float]]] = defaultdict(
            dict
        )
        self.backends: dict[PeerID, LocalBackend] = {}
        self.dead: set[PeerID] = set()
        self.frozen: set[PeerID] = set()
        self.streams_by_peer: dict[PeerID, list] = defaultdict(list)

    def freeze(self, peer: PeerID) -> None:
        """The peer's links stall (a VM paused or powered off, a cable pulled): no EOF."""
        self.frozen.add(peer)

    def kill(self, peer: PeerID) -> None:
        self.dead.add(peer)
        for s in self.streams_by_peer[peer]:
            s._send.close()
            s._receive.close()


class LocalBackend:
    def __init__(self, net: LocalNet):
        self.net = net
        self.identity = Identity.generate()
        self.dispatcher = MatchmakingDispatcher()
        net.backends[self.local_peer] = self

    @property
    def local_peer(self) -> PeerID:
        return self.identity.peer_id

    def own_addrs(self) -> list[str]:
        return []

    def dht_time(self) -> float:
        return trio.current_time()

    async def declare(self, key, order, expiration, mode) -> bool:
        await trio.sleep(self.net.latency)
        visible_at = trio.current_time() + self.net.visibility_delay
        self.net.directory[key][self.local_peer] = (
            Declaration(self.local_peer, order, (), mode),
            expiration,
            visible_at,
        )
        return True

    def withdraw(self, key, order, expiration, mode, schema=None) -> None:
        entry = self.net.directory[key].get(self.local_peer)
        if entry is not None:
            d = entry[0]
            withdrawn = Declaration(d.peer, d.order, (), d.mode, d.schema, looking=False)
            self.net.directory[key][self.local_peer] = (withdrawn, expiration + 0.01, entry[2])

    async def list_candidates(self, key):
        await trio.sleep(self.net.latency)
        now = trio.current_time()
        return [d for d, exp, vis in self.net.directory[key].values() if exp > now and vis <= now]

    async def open_stream(self, peer, addrs, dial_timeout):
        await trio.sleep(self.net.latency)
        if peer in self.net.dead or self.local_peer in self.net.dead:
            raise trio.BrokenResourceError("cannot reach peer")
        if self.net.frozen & {peer, self.local_peer}:
            await trio.sleep_forever()
        a_send, b_recv = trio.open_memory_channel(16)
        b_send, a_recv = trio.open_memory_channel(16)
        mine = ChannelStream(peer, a_send, a_recv, self.net, self.local_peer)
        theirs = ChannelStream(self.local_peer, b_send, b_recv, self.net, peer)
        self.net.streams_by_peer[peer].append(theirs)
        self.net.streams_by_peer[self.local_peer].append(mine)
        self.net.nursery.start_soon(self.net.backends[peer].dispatcher.handle_stream, theirs)
        return mine

    def peer_to_bytes(self, peer):
        return peer.to_bytes()

    def peer_from_bytes(self, data):
        return PeerID.from_bytes(data)

    def decode_group(self, msg):
        return GroupInfo.from_msg(msg)

    def register(self, prefix, handler):
        self.dispatcher.handlers[prefix] = handler

    def unregister(self, prefix):
        self.dispatcher.handlers.pop(prefix, None)


KEYLESS = dict(  # a key without grid bits, as the averager sets it up
    target_group_size=4, min_matchmaking_time=2.0, request_timeout=1.0, start_when_all_joined=True
)


def make(net, n, **kwargs) -> list[Matchmaker]:
    defaults = dict(
        target_group_size=4, min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0
    )
    defaults.update(kwargs)
    return [Matchmaker(LocalBackend(net), "run", **defaults) for _ in range(n)]


async def run_all(mms, keys, window=10.0, starts=None, gathers=None):
    results: dict[int, Any] = {}
    finished_at: dict[int, float] = {}
    t0 = trio.current_time()

    async def one(i):
        if starts:
            await trio.sleep(starts[i])
        gather = gathers[i] if gathers else None
        results[i] = await mms[i].look_for_group(keys[i], trio.current_time() + window, gather)
        finished_at[i] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for i in range(len(mms)):
            nursery.start_soon(one, i)
    return results, finished_at


def check_consistent(mms, results):
    """Every member of a group got the same GroupInfo."""
    by_id = defaultdict(list)
    for i, g in results.items():
        if g is not None:
            assert mms[i].backend.local_peer in g.members
            by_id[g.group_id].append((i, g))
    for members in by_id.values():
        first = members[0][1]
        assert all(g == first for _, g in members)
        assert len(members) == first.size
    return by_id


async def test_full_group_forms_without_waiting(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 4, min_matchmaking_time=5.0)
        results, finished = await run_all(mms, ["run.0b"] * 4, gathers=[{"i": i} for i in range(4)])
        groups = check_consistent(mms, results)
        assert len(groups) == 1
        (group,) = [g for _, g in next(iter(groups.values()))][:1]
        assert group.size == 4
        assert sorted(x["i"] for x in group.gathered) == [0, 1, 2, 3]
        assert max(finished.values()) < 1.0  # did not wait min_matchmaking_time
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_grid_groups_are_exactly_the_keys(autojump_clock, seed):
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.05)
        mms = make(net, 16, min_matchmaking_time=3.0)
        keys = [f"run.0b{i % 4:02b}" for i in range(16)]
        starts = [rng.random() * 0.3 for _ in range(16)]
        results, finished = await run_all(mms, keys, starts=starts)
        groups = check_consistent(mms, results)
        assert len(groups) == 4
        for members in groups.values():
            assert len(members) == 4
            assert len({keys[i] for i, _ in members}) == 1
        assert max(finished.values()) < 2.0
        nursery.cancel_scope.cancel()


async def test_partial_group_proceeds_after_min_matchmaking_time(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 3, min_matchmaking_time=2.0)
        results, finished = await run_all(mms, ["run.0b1"] * 3)
        groups = check_consistent(mms, results)
        assert [len(m) for m in groups.values()] == [3]
        assert 2.0 <= min(finished.values()) and max(finished.values()) < 3.0
        nursery.cancel_scope.cancel()


async def test_alone_returns_none_at_deadline(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        (mm,) = make(net, 1)
        results, finished = await run_all([mm], ["run.0b"], window=4.0)
        assert results[0] is None
        assert math.isclose(finished[0], 4.0, abs_tol=0.1)
        nursery.cancel_scope.cancel()


async def test_target_two_splits_into_pairs(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.02)
        mms = make(net, 8, target_group_size=2, min_matchmaking_time=3.0)
        results, finished = await run_all(mms, ["run.0b0"] * 8, starts=[0.01 * i for i in range(8)])
        groups = check_consistent(mms, results)
        assert sorted(len(m) for m in groups.values()) == [2, 2, 2, 2]
        assert max(finished.values()) < 1.5
        nursery.cancel_scope.cancel()


async def test_client_and_aux_modes(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        nodes = make(net, 1)
        clients = make(net, 2, mode="client")
        aux = make(net, 1, mode="aux")
        mms = nodes + clients + aux
        results, _ = await run_all(mms, ["run.0b"] * 4)
        groups = check_consistent(mms, results)
        assert len(groups) == 1
        (members,) = groups.values()
        group = members[0][1]
        assert Counter(group.modes) == {"node": 1, "client": 2, "aux": 1}
        nursery.cancel_scope.cancel()


async def test_clients_alone_form_no_group(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 3, mode="client")
        results, finished = await run_all(mms, ["run.0b"] * 3, window=3.0)
        assert all(g is None for g in results.values())
        assert max(finished.values()) <= 3.0 + 1.0 + 0.1
        nursery.cancel_scope.cancel()


async def test_aux_only_group_does_not_form(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 2, mode="aux")
        results, _ = await run_all(mms, ["run.0b"] * 2, window=3.0)
        assert all(g is None for g in results.values())
        nursery.cancel_scope.cancel()


async def test_leader_dies_followers_do_not_hang(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 4, target_group_size=8, min_matchmaking_time=3.0)

        async def killer():
            await trio.sleep(1.0)
            # the leader is the peer everyone else follows: the one earliest in the order
            leader = next(m for m in mms if m._round is not None and m._round.followers)
            net.kill(leader.backend.local_peer)
            leader.close()

        nursery.start_soon(killer)
        results, finished = await run_all(mms, ["run.0b"] * 4, window=6.0)
        survivors = [i for i, m in enumerate(mms) if m.backend.local_peer not in net.dead]
        assert len(survivors) == 3
        assert max(finished[i] for i in survivors) <= 6.0 + 1.0 + 0.1
        good = {i: results[i] for i in survivors if results[i] is not None}
        groups = check_consistent(mms, good)
        # the survivors regrouped without the dead leader
        for members in groups.values():
            assert all(net.dead.isdisjoint(g.members) for _, g in members)
        assert sum(len(m) for m in groups.values()) == 3
        nursery.cancel_scope.cancel()


async def test_leader_that_stalls_loses_its_followers_who_regroup(autojump_clock):
    # A leader whose links stall (no EOF, as for a VM that was paused or powered off) kept
    # its followers waiting for a group message until their deadline: its whole line lost
    # the round. Leaders now send followers a heartbeat; silence means the leader is gone.
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 4, target_group_size=8, min_matchmaking_time=3.0)
        frozen = []

        async def freezer():
            await trio.sleep(1.0)
            leader = next(m for m in mms if m._round is not None and m._round.followers)
            assert len(leader._round.followers) == 3  # everyone follows it
            frozen.append(leader)
            net.freeze(leader.backend.local_peer)

        nursery.start_soon(freezer)
        results, finished = await run_all(mms, ["run.0b"] * 4, window=10.0)
        (leader,) = frozen
        survivors = [i for i, m in enumerate(mms) if m is not leader]
        good = {i: results[i] for i in survivors}
        assert all(g is not None for g in good.values()), good
        groups = check_consistent(mms, good)
        assert len(groups) == 1  # the three regrouped, without the stalled leader
        (members,) = groups.values()
        assert leader.backend.local_peer not in members[0][1].members
        assert max(finished[i] for i in survivors) < 10.0  # well before their deadline
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("latency", [0.001, 0.02])
@pytest.mark.parametrize("freeze_at", [1.5, 2.5])
async def test_followers_of_a_lost_leader_regroup_whole_past_min_matchmaking_time(
    autojump_clock, latency, freeze_at
):
    # A line of 8 (groups of up to 16: it waits min_matchmaking_time) whose leader stalls.
    # Its 7 followers joined over 0.8 s, so each notices the silence at its own heartbeat,
    # by then past min_matchmaking_time. The first orphan to lead started a group with the
    # first one to join it, the others were turned away or redirected to the lost leader:
    # groups of 2, 2 and 2 and one peer alone (as measured on the full stack,
    # benchmarks/sim_swarm.py: a cut leader's line in pairs and peers without a group).
    # An orphan that leads waits one request's time for the others, and a redirect to the
    # lost leader does not count as a try of the peer that sent it.
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, latency=latency)
        mms = make(net, 8, target_group_size=16, min_matchmaking_time=3.0, request_timeout=3.0)
        frozen = []

        async def freezer():
            await trio.sleep(freeze_at)
            leader = next(m for m in mms if m._round is not None and m._round.followers)
            assert len(leader._round.followers) == 7
            frozen.append(leader)
            net.freeze(leader.backend.local_peer)

        nursery.start_soon(freezer)
        starts = [0.11 * i for i in range(8)]
        results, finished = await run_all(mms, ["run.0b"] * 8, window=8.0, starts=starts)
        (leader,) = frozen
        good = {i: results[i] for i, m in enumerate(mms) if m is not leader}
        groups = check_consistent(mms, good)
        assert sorted(len(members) for members in groups.values()) == [7], groups
        nursery.cancel_scope.cancel()


async def test_banned_peers_are_avoided(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 3, target_group_size=3, min_matchmaking_time=1.0)
        banned = mms[0].backend.local_peer
        for m in mms:
            m.is_banned = lambda p: p == banned
        results, _ = await run_all(mms, ["run.0b"] * 3, window=3.0)
        groups = check_consistent(mms, {i: g for i, g in results.items() if i != 0})
        assert [len(m) for m in groups.values()] == [2]
        nursery.cancel_scope.cancel()


async def test_malformed_requests_are_rejected_and_leader_keeps_working(autojump_clock):
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 2, target_group_size=2, min_matchmaking_time=1.0)
        attacker = LocalBackend(net)
        replies = []

        async def attack():
            await trio.sleep(0.1)
            for bad in [
                "not a map",
                {"prefix": 5},
                {"prefix": "other"},
                {"prefix": "run", "key": "run.0b", "x": float("nan"), "dl": 1.0, "m": "node"},
                {"prefix": "run", "key": "run.0b", "x": 0.0, "dl": 1.0, "m": "evil"},
                {"prefix": "run", "key": "run.0b", "x": 0.0, "dl": 1.0, "m": "node", "n": 10**9},
                {
                    "prefix": "run",
                    "key": "run.0b",
                    "x": 1e9,
                    "dl": 1.0,
                    "m": "node",
                    "g": "x" * 100_000,
                },
            ]:
                for m in mms:
                    s = await attacker.open_stream(m.backend.local_peer, (), 1.0)
                    await s.send_msg(bad)
                    replies.append(await s.receive_msg())

        out = {}

        async def matchmake():
            out["results"], _ = await run_all(mms, ["run.0b"] * 2, window=3.0)

        async with trio.open_nursery() as inner:
            inner.start_soon(attack)
            inner.start_soon(matchmake)
        results = out["results"]
        assert all(r.get("t") == "reject" for r in replies) and len(replies) == 14
        groups = check_consistent(mms, results)
        assert [len(m) for m in groups.values()] == [2]
        nursery.cancel_scope.cancel()


async def test_a_group_never_runs_below_a_members_minimum(autojump_clock):
    """``min_group_size`` binds every member, not only the leader: a follower that needs 3
    (it knows a third peer at this epoch) is not run in a pair because the leader needs only
    2 and everyone declared so far has joined. The group waits for the third peer and starts
    the moment it joins (well before ``min_matchmaking_time``); a training round of 2 would
    have been rejected by the follower and retried."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        leader, needs_three, late = (
            Matchmaker(LocalBackend(net), "run", min_group_size=size, **KEYLESS)
            for size in (2, 3, 2)
        )
        mms = [leader, needs_three, late]
        results, finished = await run_all(mms, ["run.0b"] * 3, starts=[0.0, 0.05, 0.6])
        groups = check_consistent(mms, results)
        assert [sorted(i for i, _ in m) for m in groups.values()] == [[0, 1, 2]]
        assert 0.6 <= max(finished.values()) < 1.5  # min_matchmaking_time is 2
        nursery.cancel_scope.cancel()


async def test_a_minimum_nobody_can_meet_runs_no_group(autojump_clock):
    """The third peer never comes: the pair does not run (the follower's minimum would be
    broken); both give up at their deadline with no group."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = [
            Matchmaker(LocalBackend(net), "run", min_group_size=size, **KEYLESS) for size in (2, 3)
        ]
        results, finished = await run_all(mms, ["run.0b"] * 2, window=4.0, starts=[0.0, 0.05])
        assert results == {0: None, 1: None}
        assert min(finished.values()) >= 3.9
        nursery.cancel_scope.cancel()


def test_a_leader_merging_away_brings_its_followers_minimum():
    """A leader that joins an earlier one takes its followers along; the largest minimum
    among them goes into its request, or the earlier leader could start a group too small
    for one of them."""
    mm = Matchmaker(LocalBackend(LocalNet(None)), "run", target_group_size=8, min_group_size=2)
    follower = Identity.generate().peer_id
    me = Member(mm.backend.local_peer, "node", None, None, 10.0)
    rnd = MatchmakingRound(key="run.0b", order=1.0, deadline=10.0, started=0.0, me=me)
    assert mm._join_request(rnd, 5.0).min_group_size == 2
    rnd.lead.followers[follower] = Member(follower, "node", None, None, 10.0, min_group_size=5)
    request = mm._join_request(rnd, 5.0)
    assert request.size == 2 and request.min_group_size == 5
    assert JoinRequest.from_msg(request.to_msg("run")).min_group_size == 5


def test_join_request_validation():
    ok = JoinRequest("k", 1.0, 2.0, "node", None, None, 1)
    assert JoinRequest.from_msg(ok.to_msg("p")) == ok
    dense = JoinRequest("k", 1.0, 2.0, "node", 5e6, None, 1, bytes_per_value=1.03)
    assert JoinRequest.from_msg(dense.to_msg("p")) == dense
    beats = JoinRequest("k", 1.0, 2.0, "node", None, None, 1, heartbeats=True)
    assert JoinRequest.from_msg(beats.to_msg("p")) == beats
    needy = JoinRequest("k", 1.0, 2.0, "node", None, None, 1, min_group_size=3)
    assert JoinRequest.from_msg(needy.to_msg("p")) == needy
    assert "min" not in ok.to_msg("p")  # an older leader sees the message it always did
    for field, value in [
        ("hb", 1),
        ("hb", "yes"),
        ("bpv", 0.0),
        ("bpv", 1e6),
        ("bpv", float("inf")),
        ("bpv", "4"),
        ("bpv", True),
        ("x", "1"),
        ("dl", -1.0),
        ("dl", 1e12),
        ("bw", -3.0),
        ("n", True),
        ("min", True),
        ("min", 0),
        ("min", 10**6),
        ("min", 2.0),
        ("key", 3),
    ]:
        msg = ok.to_msg("p")
        msg[field] = value
        with pytest.raises(MatchmakingError):
            JoinRequest.from_msg(msg)
    with pytest.raises(MatchmakingError):
        JoinRequest.from_msg({"key": "k"})


def test_a_bad_heartbeat_interval_in_an_accepted_reply_is_a_clear_error():
    mm = Matchmaker(LocalBackend(LocalNet(None)), "run", target_group_size=4)
    assert mm._silence_limit({"t": "accepted"}) == math.inf  # a leader without heartbeats
    assert mm._silence_limit({"t": "accepted", "hb": 0.5}) == mm.request_timeout
    assert mm._silence_limit({"t": "accepted", "hb": 2.0}) == 6.0
    for bad in (0.0, -1.0, float("nan"), 1e9, "1", True):
        with pytest.raises(MatchmakingError, match="accepted"):
            mm._silence_limit({"t": "accepted", "hb": bad})


def test_invalid_configuration():
    with pytest.raises(ValueError):
        Matchmaker(None, "p", target_group_size=2, min_group_size=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Matchmaker(None, "p", target_group_size=2, mode="boss")  # type: ignore[arg-type]


async def test_churn_many_peers_staggered(autojump_clock):
    """64 peers, 16 keys, some missing: groups never mix keys and never exceed the target."""
    rng = random.Random(5)
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery, visibility_delay=0.05)
        mms = make(net, 64, min_matchmaking_time=1.0)
        keys = [f"run.0b{i % 16:04b}" for i in range(64)]
        present = [i for i in range(64) if rng.random() > 0.1]
        sub = [mms[i] for i in present]
        results, finished = await run_all(
            sub, [keys[i] for i in present], starts=[rng.random() * 0.5 for _ in present]
        )
        groups = check_consistent(sub, results)
        for members in groups.values():
            assert 2 <= len(members) <= 4
            assert len({keys[present[i]] for i, _ in members}) == 1
        grouped = sum(len(m) for m in groups.values())
        per_key = Counter(keys[i] for i in present)
        expected = sum(c for c in per_key.values() if c >= 2)
        assert grouped == expected  # everyone who had a partner got a group
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# peers of another tensor schema: skipped without a request, remembered across rounds


class SchemaBackend(LocalBackend):
    """A LocalBackend whose declarations carry the schema and which counts join attempts."""

    def __init__(self, net: LocalNet):
        super().__init__(net)
        self.dialed: Counter = Counter()  # peer -> streams opened to it (join requests)

    async def declare(self, key, order, expiration, mode, schema=None) -> bool:
        await trio.sleep(self.net.latency)
        self.net.directory[key][self.local_peer] = (
            Declaration(self.local_peer, order, (), mode, schema),
            expiration,
            trio.current_time() + self.net.visibility_delay,
        )
        return True

    async def open_stream(self, peer, addrs, dial_timeout):
        self.dialed[peer] += 1
        return await super().open_stream(peer, addrs, dial_timeout)


SCHEMA_A, SCHEMA_B = b"A" * 16, b"B" * 16


def make_schema(net, schemas, **kwargs) -> list[Matchmaker]:
    defaults = dict(
        target_group_size=4,
        min_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        start_when_all_joined=True,  # what the averager sets for a key without grid bits
    )
    defaults.update(kwargs)
    return [Matchmaker(SchemaBackend(net), "run", schema=s, **defaults) for s in schemas]


async def test_a_peer_of_another_schema_costs_the_others_nothing_round_after_round(
    autojump_clock,
):
    """Two peers of one schema and one of another under the same key: the pair groups at
    once every round (the other peer is neither asked nor waited for, although the target
    group of 4 never fills), and nobody ever dials across the schemas."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make_schema(net, [SCHEMA_A, SCHEMA_B, SCHEMA_A])
        for _ in range(4):
            results, finished = await run_all(mms, ["run.0b"] * 3, starts=[0.0, 0.05, 0.1])
            groups = check_consistent(mms, results)
            assert [sorted(i for i, _ in m) for m in groups.values()] == [[0, 2]]
            assert results[1] is None
            assert finished[0] < 1.0 and finished[2] < 1.0  # min_matchmaking_time is 2
            assert mms[1].backend.local_peer in mms[0].last_schema_conflicts
        for i, j in [(0, 1), (1, 0), (2, 1), (1, 2)]:
            assert mms[i].backend.dialed[mms[j].backend.local_peer] == 0
        assert all(m.schema_refusals == 0 for m in mms)
        nursery.cancel_scope.cancel()


async def test_a_refusal_for_our_schema_is_remembered_until_the_peer_declares_another(
    autojump_clock,
):
    """A peer whose declaration carries no schema (an older version) learns of the conflict
    only from the leader's refusal: it asks once, not every round, until the leader declares
    another schema (restarted with another model), which it then asks about again."""
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        leader, joiner = make_schema(net, [SCHEMA_A, None])
        lead_peer = leader.backend.local_peer
        for _ in range(3):
            results, _ = await run_all([leader, joiner], ["run.0b"] * 2, starts=[0.0, 0.1])
            assert results == {0: None, 1: None}
            assert lead_peer in joiner.last_schema_conflicts  # still reported every round
        assert joiner.backend.dialed[lead_peer] == 1 and joiner.schema_refusals == 1
        # the same peer comes back with another model: worth asking again (refused again)
        leader.close()
        leader = Matchmaker(
            leader.backend, "run", schema=SCHEMA_B, target_group_size=4, request_timeout=1.0
        )
        for _ in range(2):
            await run_all([leader, joiner], ["run.0b"] * 2, starts=[0.0, 0.1])
        assert joiner.backend.dialed[lead_peer] == 2 and joiner.schema_refusals == 2
        nursery.cancel_scope.cancel()


def test_schema_memory_is_bounded_and_forgets_a_peer_that_changed_schema():
    memory = SchemaMemory(capacity=3)
    for i in range(5):
        memory.note(f"p{i}", SCHEMA_A, "why")
    assert len(memory) == 3 and "p0" not in memory and "p4" in memory  # oldest dropped
    assert memory.refused("p4", SCHEMA_A)
    assert not memory.refused("p4", SCHEMA_B) and "p4" not in memory  # re-declared: forgotten
    memory.note("p2", SCHEMA_A, "again")  # noted again: the most recent now
    memory.note("p5", SCHEMA_A, "why")
    memory.note("p6", SCHEMA_A, "why")
    assert "p3" not in memory and "p2" in memory and len(memory) == 3
    assert memory.first_warning(["p2", "p5", "nobody"]) == ["p2", "p5"]
    assert memory.first_warning(["p2", "p5"]) == []  # warned once
    memory.note("p5", SCHEMA_B, "another schema now")
    assert memory.first_warning(["p5"]) == ["p5"]  # a new conflict is worth a new warning


async def test_members_withdraw_their_declarations_once_the_group_formed(autojump_clock):
    # a declaration left until its deadline invites the next round's peers to ask a peer
    # that is not looking any more; peers without a group keep theirs (it expires anyway)
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        mms = make(net, 3, target_group_size=2, min_matchmaking_time=1.0)
        results, _ = await run_all(mms, ["run.0b"] * 3, window=3.0)
        grouped = {mms[i].backend.local_peer for i, g in results.items() if g is not None}
        assert len(grouped) == 2
        for peer, (declaration, _, _) in net.directory["run.0b"].items():
            assert declaration.looking == (peer not in grouped)
        nursery.cancel_scope.cancel()


async def test_a_search_left_while_alone_ends_at_once_but_not_once_someone_joined(autojump_clock):
    # Matchmaker.leave_if_alone: a peer that finds the swarm under another key part way
    # into a round stops here only if that strands nobody (no follower, no leader asked)
    async with trio.open_nursery() as nursery:
        net = LocalNet(nursery)
        (alone,) = make(net, 1, min_matchmaking_time=5.0)
        assert not alone.leave_if_alone()  # no search under way: nothing to leave
        ended: list[float] = []

        async def search() -> None:
            ended.append(-1.0 if await alone.look_for_group("run.0b", 20.0) else 0.0)
            ended.append(trio.current_time())

        nursery.start_soon(search)
        await trio.sleep(1.0)
        assert alone.leave_if_alone()
        await trio.sleep(0.1)
        assert ended[0] == 0.0 and ended[1] < 1.1  # None, without waiting out the window
        assert not alone.leave_if_alone()  # already left

        pair = make(net, 2, min_matchmaking_time=5.0)
        found: dict[int, GroupInfo | None] = {}

        async def look(i: int) -> None:
            found[i] = await pair[i].look_for_group("run.0b1", trio.current_time() + 20.0)

        nursery.start_soon(look, 0)
        nursery.start_soon(look, 1)
        await trio.sleep(1.0)  # one follows the other by now (the group waits 5 s to fill)
        assert not pair[0].leave_if_alone() and not pair[1].leave_if_alone()
        await trio.sleep(10.0)
        assert found[0] is not None and found[0] == found[1] and found[0].size == 2
        nursery.cancel_scope.cancel()
