"""State transfer and circuit relays: a joiner must not push a state through a relay that
cannot carry it.

Real DHT nodes on loopback TCP with real circuit relays (as in ``tests/dht/test_roles.py``):
two public peers serve relays whose per-connection data limit (``RelayLimits.circuit_data``)
is smaller than the state; private peers listen nowhere, so they are reached only through
those relays (hole punching never dials loopback addresses: they stay relayed).

* a donor reached directly is preferred, and a relayed-only donor the state does not fit
  is not asked for anything, not even the manifest;
* when the relayed-only donor is the only one, it is used; the relay cuts the transfer,
  which is no misbehaviour (no ban), and the download completes from a direct donor that
  turns up meanwhile;
* a state that fits the relay's limit comes through the relay.
"""

from __future__ import annotations

from typing import Any

import trio

from dht.p2p.relay import RelayLimits
from moshpit.training.manifest import build_manifest
from moshpit.training.sharing import StateSharing
from tests.dht.test_roles import Swarm, wait_until
from tests.training.test_sharing import MemoryStore, assert_state_equal, make_state, schema_of

LIMIT = 64 * 1024  # bytes per direction per relayed connection
CHUNK = 16 * 1024
SHARING = dict(
    announce_ttl=30.0,
    request_timeout=3.0,
    refresh_interval=0.2,
    batch_bytes=32 * 1024,
    thread_min_bytes=float("inf"),
)


def publish(sharing: StateSharing, named: Any, epoch: int) -> Any:
    manifest, chunks = build_manifest(named, epoch, chunk_bytes=CHUNK)
    for digest, data in chunks.items():
        sharing.store.chunks[digest] = bytes(data)
    sharing.publish(manifest)
    return manifest


class Bed:
    """Relays ``r`` and ``s`` (public, ``s`` also a possible direct donor), donor ``a`` and
    joiner ``j`` behind "NATs" (listening nowhere), each with a StateSharing under ``prefix``."""

    def __init__(self, swarm: Swarm, nodes: dict[str, Any], prefix: str) -> None:
        self.swarm = swarm
        self.nodes = nodes
        self.sharing = {
            name: StateSharing(node, prefix, MemoryStore(), **SHARING)
            for name, node in nodes.items()
        }

    def serve(self, nursery: trio.Nursery, *names: str) -> None:
        for name in names:
            nursery.start_soon(self.sharing[name].run)

    def cut_circuits(self) -> int:
        return sum(self.nodes[n].relay_service.stats.circuits_cut_data for n in ("r", "s"))


async def open_bed(nursery: trio.Nursery, prefix: str) -> Bed:
    swarm = Swarm(nursery)
    r, s = await swarm.public_pair(relay=RelayLimits(circuit_data=LIMIT))
    await wait_until(lambda: r.relay_service is not None and s.relay_service is not None)
    a = await swarm.private(r)
    j = await swarm.private(s)
    for node in (a, j):
        await wait_until(lambda node=node: node.role is not None and node.role.circuit_addrs)
        assert not node.client_mode and node.relay_limit.data == LIMIT
    # the joiner finds the donor through the DHT and reaches it only through a relay
    found = await j.find_nearest_peers(a.node_id, 8)
    assert any(c.peer_id == a.peer_id for c in found)
    assert await j.ping(a.peer_id)
    assert j.network.relayed_only(a.peer_id)
    assert j.network.relay_limit(a.peer_id).data == LIMIT
    assert not j.network.relayed_only(s.peer_id)  # j dialed s: a direct connection
    return Bed(swarm, {"r": r, "s": s, "a": a, "j": j}, prefix)


async def donors_seen(joiner: StateSharing, count: int) -> None:
    with trio.fail_after(10):
        while True:
            states = await joiner.find_states()
            if states and len(states[0].donors) >= count:
                return
            await trio.sleep(0.05)


async def test_joiner_prefers_a_direct_donor_to_a_relay_that_cannot_carry_the_state() -> None:
    named = make_state(11, scale=20)  # ~320 KiB: five times the relay's limit
    async with trio.open_nursery() as nursery:
        bed = await open_bed(nursery, "pref")
        bed.serve(nursery, "a", "s")
        manifest = publish(bed.sharing["a"], named, 4)
        publish(bed.sharing["s"], named, 4)
        assert manifest.total_bytes > 4 * LIMIT
        joiner = bed.sharing["j"]
        await donors_seen(joiner, 2)
        result = await joiner.download(schema_of(named), timeout=30.0)
        assert_state_equal(result, named)
        s = bed.nodes["s"].peer_id
        assert result.bytes_by_peer == {s: manifest.total_bytes}, result.bytes_by_peer
        assert result.donors_used == [s] and not result.misbehaving
        # the relayed donor was not asked anything (the manifest came from `s` too), so no
        # relay had to cut a circuit
        assert bed.sharing["a"].stats["requests"] == 0, bed.sharing["a"].stats
        assert bed.cut_circuits() == 0
        nursery.cancel_scope.cancel()


async def test_relayed_donor_is_used_when_alone_and_a_cut_fails_over_to_a_direct_one() -> None:
    small = make_state(12, scale=1)  # ~16 KiB: fits the relay
    big = make_state(13, scale=20)  # ~320 KiB: does not
    async with trio.open_nursery() as nursery:
        bed = await open_bed(nursery, "small")
        a, s = bed.nodes["a"].peer_id, bed.nodes["s"].peer_id
        # a state that fits: it comes through the relay from the only donor
        bed.serve(nursery, "a")
        manifest = publish(bed.sharing["a"], small, 2)
        joiner = bed.sharing["j"]
        await donors_seen(joiner, 1)
        result = await joiner.download(schema_of(small), timeout=20.0)
        assert_state_equal(result, small)
        assert result.bytes_by_peer == {a: manifest.total_bytes}
        assert bed.cut_circuits() == 0

        # a state too big for the relay, and nobody else serves it: the relayed donor is
        # used anyway (the relay cuts it), then a direct donor turns up and the download
        # completes from it; the cut is no misbehaviour
        donor, direct = (
            StateSharing(bed.nodes[n], "big", MemoryStore(), **SHARING) for n in ("a", "s")
        )
        joiner = StateSharing(bed.nodes["j"], "big", MemoryStore(), **SHARING)
        nursery.start_soon(donor.run)
        nursery.start_soon(direct.run)
        manifest = publish(donor, big, 3)
        await donors_seen(joiner, 1)
        done: list[Any] = []
        finished = trio.Event()

        async def download() -> None:
            done.append(await joiner.download(schema_of(big), timeout=40.0))
            finished.set()

        nursery.start_soon(download)
        await wait_until(lambda: bed.cut_circuits() > 0, limit=20)
        assert donor.stats["chunks_served"] > 0  # it was asked: nothing else was there
        publish(direct, big, 3)
        with trio.fail_after(40):
            await finished.wait()
        result = done[0]
        assert_state_equal(result, big)
        assert result.bytes_by_peer.get(s, 0) > 0, result.bytes_by_peer
        assert result.bytes_by_peer.get(a, 0) < LIMIT, result.bytes_by_peer
        assert sum(result.bytes_by_peer.values()) == manifest.total_bytes
        assert not result.misbehaving and not joiner._banned_now(a)
        nursery.cancel_scope.cancel()


async def test_what_an_earlier_transfer_spent_of_a_relayed_connection_counts() -> None:
    # Issue 31 item 4: a relayed connection's data limit is spent over its whole life. After
    # a first state of ~48 KiB came through the relay (of 64 KiB per connection), a second
    # one of ~16 KiB fits the whole limit but not what is left: the joiner must take it from
    # the direct donor instead of having the relay cut the connection under it.
    first = make_state(16, scale=3)
    second = make_state(17, scale=1)
    async with trio.open_nursery() as nursery:
        bed = await open_bed(nursery, "spent")
        a, s = bed.nodes["a"].peer_id, bed.nodes["s"].peer_id
        bed.serve(nursery, "a")
        manifest = publish(bed.sharing["a"], first, 2)
        joiner = bed.sharing["j"]
        await donors_seen(joiner, 1)
        result = await joiner.download(schema_of(first), timeout=20.0)
        assert result.bytes_by_peer == {a: manifest.total_bytes}
        assert bed.cut_circuits() == 0
        room = bed.nodes["j"].network.relay_room(a)
        assert room is not None and room < LIMIT - manifest.total_bytes, room

        direct = StateSharing(bed.nodes["s"], "spent", MemoryStore(), **SHARING)
        nursery.start_soon(direct.run)
        manifest = publish(bed.sharing["a"], second, 3)
        publish(direct, second, 3)
        await donors_seen(joiner, 2)
        asked = bed.sharing["a"].stats["requests"]
        result = await joiner.download(schema_of(second), timeout=20.0)
        assert_state_equal(result, second)
        assert result.bytes_by_peer == {s: manifest.total_bytes}, result.bytes_by_peer
        assert bed.sharing["a"].stats["requests"] == asked  # not asked for anything more
        assert bed.cut_circuits() == 0
        nursery.cancel_scope.cancel()
