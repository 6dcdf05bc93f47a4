"""Where other peers see this one, and whether they can connect to it: the state the Host
keeps (``host.observed_addrs``, ``host.reachability``) and AutoNAT (``autonat.py``) and hole
punching (``dcutr.py``) read and set.

Plain data with no I/O: the Host holds it without depending on the protocols that fill it.
:class:`ObservedAddrs` collects identify's ``observedAddr`` reports; :class:`Reachability` is
AutoNAT's last verdict; :func:`decide` and :func:`settle` are the rules that turn a round's
:class:`Evidence` into one (pure functions, tested without sockets).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

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


_HIDDEN_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private use (RFC 1918)
        "100.64.0.0/10",  # shared address space: carrier-grade NAT (RFC 6598)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local
        "172.16.0.0/12",  # private use
        "192.168.0.0/16",  # private use
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
    )
)
_HIDDEN_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/127",  # unspecified, loopback
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)


def globally_routable(ip: IPAddress) -> bool:
    """Could a machine elsewhere on the Internet reach ``ip`` with no NAT in between?

    False for the ranges NATs hide hosts in (private use, carrier-grade NAT's shared space,
    IPv6 unique-local) and for addresses that never leave a machine or a link (loopback,
    link-local, unspecified, multicast, IPv4's reserved 240/4). Unlike ``ip.is_global``, the
    documentation and benchmarking ranges (192.0.2/24, 198.51.100/24, 203.0.113/24,
    198.18/15) count as routable: no NAT hands them out, and test beds use them to stand for
    the Internet."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return globally_routable(ip.ipv4_mapped)
        return not any(ip in net for net in _HIDDEN_V6)
    return not any(ip in net for net in _HIDDEN_V4)


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
    """What AutoNAT last decided, and why (``reason`` is one line for humans).

    ``provisional``: decided by the young-swarm rules of :func:`decide` (fewer servers
    answered than the threshold asks for): AutoNAT checks it again sooner, and a later round
    with evidence against it overturns it (:func:`settle`)."""

    status: ReachabilityStatus = ReachabilityStatus.UNKNOWN
    reason: str = "not checked yet"
    public_addrs: tuple[Multiaddr, ...] = ()  # addresses servers reached us at
    confirmations: int = 0  # servers (or peers, see provisional) that agreed with the decision
    asked: int = 0  # servers asked in the deciding round
    decided_at: float = 0.0  # UNIX time (0: never decided)
    provisional: bool = False

    @property
    def is_public(self) -> bool:
        return self.status is ReachabilityStatus.PUBLIC

    @property
    def is_private(self) -> bool:
        return self.status is ReachabilityStatus.PRIVATE

    def __str__(self) -> str:
        return f"{self.status.value}: {self.reason}"


# -- the decision ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """Everything one AutoNAT round has to go on: the servers' answers, and what this peer
    saw itself (the input of :func:`decide`).

    ``dialed_back`` / ``could_not`` / ``no_verdict``: servers that answered OK, E_DIAL_ERROR,
    or anything else (refusals, nonsense, silence); ``reached_at``: the addresses the OKs
    named. ``arrivals``: direct inbound connections that reached us while the round ran (a
    genuine OK is one: the dial-back connects to us). ``global_addrs``: our listen IPs that
    are :func:`globally_routable`. ``connected_from``: other IPs (neither ours nor loopback)
    that recently opened a direct connection to us, hole-punched ones excluded.
    ``seen_at``: IPs peers observed us at (identify) that none of our interfaces holds: a
    NAT rewrote our address on the way."""

    dialed_back: int = 0
    could_not: int = 0
    no_verdict: int = 0
    reached_at: tuple[Multiaddr, ...] = ()
    arrivals: int = 0
    global_addrs: tuple[IPAddress, ...] = ()
    connected_from: tuple[IPAddress, ...] = ()
    seen_at: tuple[IPAddress, ...] = ()

    @property
    def asked(self) -> int:
        return self.dialed_back + self.could_not + self.no_verdict

    @property
    def verified_dial_backs(self) -> int:
        """OKs backed by a connection that really arrived (a claim alone proves nothing)."""
        return min(self.dialed_back, self.arrivals)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def decide(evidence: Evidence, threshold: int, now: float) -> Reachability:
    """The verdict of one round, from ``evidence`` alone (no I/O, no clock but ``now``).

    With enough servers (``threshold`` verdicts), as libp2p's AutoNAT: ``threshold`` OKs is
    public; ``threshold`` failures and no OK is private; anything else unknown. A young swarm
    has fewer servers than that, so when fewer than ``threshold`` gave a verdict two rules
    decide on what this peer saw itself (``provisional`` verdicts):

    * public: one of our listen IPs is globally routable and a peer at another IP connected
      to us directly (a claim cannot fake that: the connection happened);
    * private: a server could not dial us back, no server demonstrably could (an OK counts
      only with a connection that arrived during the round), and a peer saw us at an IP that
      none of our interfaces holds (a NAT is on the way).
    """
    e, need = evidence, threshold
    ok, failed, other, asked = e.dialed_back, e.could_not, e.no_verdict, e.asked
    tail = f" ({other} gave no verdict)" if other else ""
    if ok >= need:
        addrs = tuple(dict.fromkeys(e.reached_at))[:8]
        where = f" at {', '.join(map(str, addrs))}" if addrs else ""
        return Reachability(
            ReachabilityStatus.PUBLIC,
            f"{ok} of {asked} peers dialed this peer back{where}{tail}",
            addrs,
            ok,
            asked,
            now,
        )
    if failed >= need and not ok:
        return Reachability(
            ReachabilityStatus.PRIVATE,
            f"{failed} of {asked} peers could not dial this peer back "
            f"(behind NAT or a firewall){tail}",
            (),
            failed,
            asked,
            now,
        )
    young = ok + failed < need
    few = f"fewer than {need} servers to agree"
    if young and e.global_addrs and e.connected_from:
        others = len(e.connected_from)
        asked_text = f": {ok} of {asked} dialed back" if asked else ""
        return Reachability(
            ReachabilityStatus.PUBLIC,
            f"its address {e.global_addrs[0]} is global and {_plural(others, 'peer')} at "
            f"other addresses connected to it ({few}{asked_text})",
            (),
            others,
            asked,
            now,
            provisional=True,
        )
    if young and failed and not e.verified_dial_backs and e.seen_at:
        return Reachability(
            ReachabilityStatus.PRIVATE,
            f"{failed} of {asked} peers could not dial this peer back, and peers see it at "
            f"{e.seen_at[0]}, which none of its interfaces holds (behind NAT; {few}){tail}",
            (),
            failed,
            asked,
            now,
            provisional=True,
        )
    if not asked:
        reason = "no connected peer to ask"
    else:
        reason = (
            f"inconclusive: {ok} of {asked} peers dialed back, "
            f"{failed} could not{tail}; {need} must agree"
        )
    return Reachability(ReachabilityStatus.UNKNOWN, reason, (), 0, asked, 0.0)


def settle(old: Reachability, new: Reachability, evidence: Evidence) -> Reachability:
    """The verdict to hold after a round whose own verdict is ``new``.

    A decisive round replaces anything. An inconclusive one (servers silent, refusing, or
    too few) keeps an earlier decision, with one exception: a provisional ``private`` falls
    as soon as a server demonstrably dialed us back (its connection arrived), so a single
    peer that claimed it could not cannot keep a reachable peer hidden behind a relay."""
    if new.status is not ReachabilityStatus.UNKNOWN or old.status is ReachabilityStatus.UNKNOWN:
        return new
    if old.provisional and old.is_private and evidence.verified_dial_backs:
        return new
    return old


class Arrivals:
    """Direct inbound connections as they register, for :class:`Evidence`: when, from which
    IP, and the connection (read later: hole punching may mark it after registration).
    Bounded (``max_kept``, oldest dropped) and aged out after ``ttl`` seconds."""

    def __init__(
        self,
        *,
        ttl: float = 900.0,
        max_kept: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_kept = max_kept
        self._clock = clock
        self._seen: list[tuple[float, IPAddress, Any]] = []  # oldest first

    def record(self, ip: IPAddress, conn: Any = None) -> None:
        self._seen.append((self._clock(), ip, conn))
        if len(self._seen) > self.max_kept:
            del self._seen[: len(self._seen) - self.max_kept]

    def _fresh(self) -> list[tuple[float, IPAddress, Any]]:
        cutoff = self._clock() - self.ttl
        self._seen = [entry for entry in self._seen if entry[0] >= cutoff]
        return [e for e in self._seen if not getattr(e[2], "hole_punched", False)]

    def since(self, when: float) -> int:
        """Connections that arrived at or after ``when`` (on this object's clock)."""
        return sum(1 for t, _, _ in self._fresh() if t >= when)

    def sources(self, ours: Iterable[IPAddress] = ()) -> tuple[IPAddress, ...]:
        """The distinct IPs that connected, most recent first, without ``ours`` and
        loopback (a peer on this very machine proves nothing about the network)."""
        mine = set(ours)
        out: list[IPAddress] = []
        for _, ip, _ in reversed(self._fresh()):
            if ip.is_loopback or ip in mine or ip in out:
                continue
            out.append(ip)
        return tuple(out)

    def now(self) -> float:
        return self._clock()


__all__ = [
    "Arrivals",
    "Evidence",
    "IPAddress",
    "ObservedAddrs",
    "Reachability",
    "ReachabilityStatus",
    "decide",
    "globally_routable",
    "ip_of",
    "settle",
    "tcp_addr",
    "tcp_port",
]
