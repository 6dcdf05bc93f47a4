"""Known addresses of peers, bounded (peers are evicted least-recently-updated first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .identity import PeerID
from .multiaddr import Multiaddr


class PeerStore:
    """PeerID -> addresses (stored without their ``/p2p/`` suffix, newest first)."""

    def __init__(self, max_peers: int = 10_000, max_addrs_per_peer: int = 16) -> None:
        self.max_peers = max_peers
        self.max_addrs_per_peer = max_addrs_per_peer
        self._addrs: OrderedDict[PeerID, list[Multiaddr]] = OrderedDict()

    def add_addrs(self, peer_id: PeerID, addrs: Iterable[Multiaddr | str]) -> None:
        """Remember addresses of ``peer_id``; an address naming another peer raises ValueError."""
        new: list[Multiaddr] = []
        for addr in addrs:
            maddr = Multiaddr(addr)
            if maddr.peer_id is not None and maddr.peer_id != peer_id:
                raise ValueError(f"address {maddr} belongs to {maddr.peer_id}, not {peer_id}")
            new.append(maddr.without_peer_id())
        if not new:
            return
        known = self._addrs.pop(peer_id, [])
        merged = list(dict.fromkeys(new + known))[: self.max_addrs_per_peer]
        self._addrs[peer_id] = merged
        while len(self._addrs) > self.max_peers:
            self._addrs.popitem(last=False)

    def get_addrs(self, peer_id: PeerID) -> list[Multiaddr]:
        return list(self._addrs.get(peer_id, ()))

    def remove(self, peer_id: PeerID) -> None:
        self._addrs.pop(peer_id, None)

    def peers(self) -> list[PeerID]:
        return list(self._addrs)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._addrs

    def __len__(self) -> int:
        return len(self._addrs)
