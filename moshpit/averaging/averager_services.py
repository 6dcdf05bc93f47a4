"""What averagers share per DHT node and Host: the matchmaking backend that counts the peers
a read of a key showed (the adaptive grid's swarm-size estimate), and one all-reduce service
per Host, reference-counted, that every averager on that Host registers its rounds with."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from moshpit.averaging.allreduce import AllReduceService
from moshpit.averaging.matchmaking import DHTMatchmakingBackend
from moshpit.averaging.matchmaking_messages import Declaration

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode
    from dht.p2p.host import Host
    from dht.p2p.identity import PeerID

__all__ = ["AllReduceServices", "CountingBackend"]


class CountingBackend(DHTMatchmakingBackend):
    """The DHT backend, noting which peers each read of a key showed (swarm-size estimate).

    Only peers declaring ``schema`` count: peers of another schema are never grouped with
    us, so counting them would size the grid for groups that cannot fill.
    """

    def __init__(self, node: DHTNode, schema: bytes | None = None):
        super().__init__(node)
        self.schema = schema
        self.seen: dict[str, set[PeerID]] = {}

    async def list_candidates(self, key: str) -> list[Declaration]:
        found = await super().list_candidates(key)
        seen = self.seen.setdefault(key, set())
        if len(seen) < 1 << 16:  # bounded: a key holds at most max_subkeys_per_key records
            seen.update(c.peer for c in found if self.schema is None or c.schema == self.schema)
        return found

    def take_count(self, key: str) -> int:
        """Distinct peers (us included) seen under ``key`` since the last call; resets."""
        seen = self.seen.pop(key, set())
        self.seen.clear()
        seen.add(self.local_peer)
        return len(seen)


class AllReduceServices:
    """One AllReduceService per Host, shared by every averager on it (ref-counted)."""

    def __init__(self) -> None:
        self._services: weakref.WeakKeyDictionary[Host, tuple[AllReduceService, int]] = (
            weakref.WeakKeyDictionary()
        )

    def acquire(self, host: Host) -> AllReduceService:
        service, refs = self._services.get(host, (None, 0))
        if service is None:
            service = AllReduceService(host)
        self._services[host] = (service, refs + 1)
        return service

    def release(self, host: Host) -> None:
        service, refs = self._services.get(host, (None, 0))
        if service is None:
            return
        if refs <= 1:
            service.close()
            del self._services[host]
        else:
            self._services[host] = (service, refs - 1)
