"""Where other peers see this one, and whether they can connect to it: the state the Host
keeps (``host.observed_addrs``, ``host.reachability``) and AutoNAT (``autonat.py``) and hole
punching (``dcutr.py``) read and set.

Plain data with no I/O: the Host holds it without depending on the protocols that fill it.
:class:`ObservedAddrs` collects identify's ``observedAddr`` reports; :class:`Reachability` is
AutoNAT's last verdict.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from .errors import MultiaddrError
from .identity import PeerID
from .multiaddr import Multiaddr

# AutoNAT's logger: every record about reachability under one name
logger = logging.getLogger("dht.p2p.autonat")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_of(addr: str | Multiaddr) -> IPAddress | None:
    """The IP of ``ip:port`` / ``[v6]:port`` text or of a multiaddr starting with /ip4 or
    /ip6 (IPv4-mapped IPv6 as IPv4); None for anything else (memory, relayed, DNS)."""
    if isinstance(addr, Multiaddr):
        if addr.is_circuit():
            return None
        kind, value = addr.components[0]
        text = str(value) if kind in ("ip4", "ip6") else ""
    elif addr.startswith("/"):
        try:
            return ip_of(Multiaddr(addr))
        except MultiaddrError:
            return None
    else:
        text = addr.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def tcp_addr(ip: IPAddress, port: int) -> Multiaddr:
    return Multiaddr(f"/ip{ip.version}/{ip}/tcp/{port}")


def tcp_port(addr: Multiaddr) -> int | None:
    """The port of an ``/ip4|ip6/<ip>/tcp/<port>`` address (DNS names and others: None)."""
    parts = addr.components
    if parts[-1][0] == "p2p":
        parts = parts[:-1]
    if len(parts) != 2 or parts[0][0] not in ("ip4", "ip6") or parts[1][0] != "tcp":
        return None
    port = int(parts[1][1])  # type: ignore[arg-type]
    return port if 0 < port < 65536 else None


class ObservedAddrs:
    """Where other peers see us (identify's ``observedAddr``), and what follows from it.

    Each peer's latest report counts once. Loopback, link-local, unspecified and multicast
    addresses are never kept; any other IP (private ranges included: a "public" network may
    use them, e.g. a test bed or a campus) becomes a candidate only once ``min_confirmations``
    distinct peers reported it. A candidate is that IP with each of our TCP listen ports:
    without port reuse an outbound connection's observed port is a NAT mapping of an
    ephemeral port, which nobody can dial. Reports expire after ``ttl`` seconds; at most
    ``max_observers`` peers are remembered (the oldest report goes first).
    """

    def __init__(
        self,
        min_confirmations: int = 2,
        *,
        ttl: float = 3600.0,
        max_observers: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_confirmations < 1:
            raise ValueError(f"min_confirmations must be at least 1, got {min_confirmations}")
        self.min_confirmations = min_confirmations
        self.ttl = ttl
        self.max_observers = max_observers
        self._clock = clock
        self._reports: dict[PeerID, tuple[Multiaddr, float]] = {}  # oldest first

    def record(self, observer: PeerID, observed: Multiaddr | None) -> bool:
        """Take ``observer``'s report; False (and nothing kept) if it is untrustworthy."""
        if observed is None:
            return False
        ip = ip_of(observed)
        if ip is None or tcp_port(observed) is None:
            return False  # relayed, memory, DNS or no TCP port: nothing to learn
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
            logger.debug("ignoring observed address %s reported by %s", observed, observer.short())
            return False
        self._reports.pop(observer, None)
        self._reports[observer] = (tcp_addr(ip, tcp_port(observed) or 0), self._clock())
        while len(self._reports) > self.max_observers:
            del self._reports[next(iter(self._reports))]
        return True

    def _fresh(self) -> list[tuple[PeerID, Multiaddr]]:
        cutoff = self._clock() - self.ttl
        for peer in [p for p, (_, t) in self._reports.items() if t < cutoff]:
            del self._reports[peer]
        return [(p, a) for p, (a, _) in self._reports.items()]

    def observed(self) -> dict[Multiaddr, int]:
        """Every observed ``ip:port`` with how many peers reported it (for logs, debugging)."""
        counts: dict[Multiaddr, int] = {}
        for _, addr in self._fresh():
            counts[addr] = counts.get(addr, 0) + 1
        return counts

    def confirmed_ips(self) -> list[IPAddress]:
        """IPs that at least ``min_confirmations`` distinct peers saw us at (most first)."""
        voters: dict[IPAddress, set[PeerID]] = {}
        for peer, addr in self._fresh():
            ip = ip_of(addr)
            if ip is not None:
                voters.setdefault(ip, set()).add(peer)
        ranked = sorted(voters.items(), key=lambda item: -len(item[1]))
        return [ip for ip, peers in ranked if len(peers) >= self.min_confirmations]

    def candidates(self, listen_addrs: Iterable[Multiaddr]) -> list[Multiaddr]:
        """Our possible public addresses: each confirmed IP with each TCP listen port of the
        same IP version (the address a NAT with a port forward or no NAT would expose)."""
        ports: dict[int, list[int]] = {4: [], 6: []}
        for addr in listen_addrs:
            ip, port = ip_of(addr), tcp_port(addr)
            if ip is not None and port is not None and port not in ports[ip.version]:
                ports[ip.version].append(port)
        out: list[Multiaddr] = []
        for ip in self.confirmed_ips():
            out += [tcp_addr(ip, port) for port in ports[ip.version]]
        return out


class ReachabilityStatus(str, Enum):
    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


@dataclass(frozen=True)
class Reachability:
    """What AutoNAT last decided, and why (``reason`` is one line for humans)."""

    status: ReachabilityStatus = ReachabilityStatus.UNKNOWN
    reason: str = "not checked yet"
    public_addrs: tuple[Multiaddr, ...] = ()  # addresses servers reached us at
    confirmations: int = 0  # servers that agreed with the decision
    asked: int = 0  # servers asked in the deciding round
    decided_at: float = 0.0  # UNIX time (0: never decided)

    @property
    def is_public(self) -> bool:
        return self.status is ReachabilityStatus.PUBLIC

    @property
    def is_private(self) -> bool:
        return self.status is ReachabilityStatus.PRIVATE

    def __str__(self) -> str:
        return f"{self.status.value}: {self.reason}"


__all__ = [
    "IPAddress",
    "ObservedAddrs",
    "Reachability",
    "ReachabilityStatus",
    "ip_of",
    "tcp_addr",
    "tcp_port",
]
