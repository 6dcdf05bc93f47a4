"""A joiner at home whose first contact with its donor goes through the swarm's relay: the
state's bytes wait for the hole punch that contact started, rather than cross the relay
(usually the one public bootstrap, its circuits capped).

Real TCP over loopback, a real relay and real DCUtR, the punching dials held back so that
the download surely starts while the punch is under way (as in
``tests/averaging/test_relayed_members.py``). The DHT is a dict: what is tested is the path
the bytes take, not how the donor is found.
"""

from __future__ import annotations

from typing import Any

import trio

from dht.kademlia.records import ValueWithExpiration
from dht.p2p import Host
from dht.p2p.relay import enable_relay_service, relay_client
from moshpit.training.sharing import StateSharing
from tests.p2p.test_dcutr import LOCAL, LOOPBACK, SlowPunchTransport
from tests.training.test_sharing import (
    MemoryStore,
    assert_state_equal,
    make_state,
    schema_of,
    stored,
)

SHARING = dict(announce_ttl=30.0, request_timeout=10.0, thread_min_bytes=float("inf"))


class DictNode:
    """A :class:`~moshpit.training.sharing.SharingNode` on a bare host, its DHT one dict
    that every node of a test shares."""

    def __init__(self, host: Host, table: dict[str, dict[str, Any]]) -> None:
        self.host = host
        self.peer_id = host.peer_id
        self.table = table

    async def store(self, key: str, value: Any, expiration_time: float, subkey: str) -> bool:
        self.table.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        return True

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration[Any] | None:
        entries = self.table.get(key)
        if not entries:
            return None
        expiration = max(entry.expiration_time for entry in entries.values())
        return ValueWithExpiration(dict(entries), expiration)


async def test_a_download_from_a_donor_first_reached_through_a_relay_waits_for_the_punch():
    named = make_state(21, scale=2)  # ~32 KiB: the relay could carry it, and must not
    table: dict[str, dict[str, Any]] = {}
    async with (
        Host.open(hole_punching=False) as r,
        Host.open(transport=SlowPunchTransport(), hole_punching=LOOPBACK) as donor_host,
        Host.open(transport=SlowPunchTransport(), hole_punching=LOOPBACK) as joiner_host,
        trio.open_nursery() as nursery,
    ):
        (raddr,) = await r.listen(LOCAL)
        relay = enable_relay_service(r)
        for host in (donor_host, joiner_host):
            await host.listen(LOCAL)
        reservation = await relay_client(donor_host).reserve(r.peer_id, [raddr])
        chunks = MemoryStore()
        donor = StateSharing(DictNode(donor_host, table), "punch", chunks, **SHARING)
        joiner = StateSharing(DictNode(joiner_host, table), "punch", None, **SHARING)
        manifest = stored(named, 3, chunks)
        donor.publish(manifest)
        nursery.start_soon(donor.run)
        await donor.announce()
        assert await joiner.find_states()
        # the first contact: the joiner dials the donor's circuit address, and that relayed
        # connection starts the punch; the download begins at once
        await joiner_host.connect(reservation.circuit_addrs)
        assert joiner_host.best_connection(donor_host.peer_id).relayed
        before = relay.stats.bytes_forwarded
        result = await joiner.download(schema_of(named), timeout=30.0)
        relayed = relay.stats.bytes_forwarded - before
        assert_state_equal(result, named)
        assert result.bytes_by_peer == {donor_host.peer_id: manifest.total_bytes}
        # the relay carried the punch's messages, none of the state
        assert relayed < manifest.total_bytes // 4, (relayed, manifest.total_bytes)
        assert not joiner_host.best_connection(donor_host.peer_id).relayed
        nursery.cancel_scope.cancel()
