"""The seam between the Kademlia logic and the transport that carries its RPCs.

:class:`DHTNode` talks to peers only through an :class:`RPCNetwork`: unary calls, an inbound
handler, and an address book. :class:`HostNetwork` adapts the real ``dht.p2p.Host`` (TCP or
the in-memory network); ``dht.kademlia.loopback`` offers a direct in-process fabric for very
large simulations. Every transport failure surfaces as :class:`PeerUnreachableError`.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from dht.kademlia.errors import DHTError
from dht.kademlia.protocol import MAX_ADDRS_PER_PEER, PROTOCOL_ID

if TYPE_CHECKING:
    from dht.p2p.connection import Connection
    from dht.p2p.host import Host

logger = logging.getLogger(__name__)

RPCHandler = Callable[[Any, Any], Awaitable[Any]]


class PeerUnreachableError(DHTError):
    """A DHT RPC to a peer failed (dial, timeout, reset, or the peer replied with an error)."""

    def __init__(
        self, message: str, *, answered: bool = False, refused: bool = False, busy: bool = False
    ):
        super().__init__(message)
        self.answered = answered  # True when the peer is alive but refused/failed the request
        # True when every address refused the connection: nothing listens there (yet)
        self.refused = refused
        # True when no answer came in time but the peer's connection kept delivering bytes
        # meanwhile: a full link (a bulk transfer on a slow uplink), not a dead peer
        self.busy = busy


class RPCNetwork(Protocol):
    peer_id: Any

    def set_handler(self, handler: RPCHandler | None) -> None: ...

    async def call(self, peer_id: Any, request: Any, time_limit: float) -> Any: ...

    async def connect(self, address: Any, time_limit: float) -> tuple[Any, tuple[bytes, ...]]:
        """Dial an initial peer given as an address; return (PeerID, its addresses as bytes)."""
        ...

    def remember_addrs(
        self, peer_id: Any, addrs: Sequence[bytes], informant: Any = None
    ) -> bool | None:
        """Note where a peer says it listens; True if that taught us a new address."""
        ...

    def usable_addrs(self, addrs: Sequence[bytes], informant: Any) -> tuple[bytes, ...]:
        """``addrs`` less those that cannot name a way to the peer for us (see HostNetwork)."""
        ...

    def own_addrs(self) -> list[bytes]: ...

    def peer_from_bytes(self, data: bytes) -> Any: ...


class HostNetwork:
    """:class:`RPCNetwork` over a ``dht.p2p.Host``."""

    def __init__(self, host: Host, announce_maddrs: Sequence[Any] | None = None):
        from dht.p2p import Multiaddr, PeerID

        self._Multiaddr = Multiaddr
        self._PeerID = PeerID
        self.host = host
        self.peer_id = host.peer_id
        self._announce = [Multiaddr(str(a)) for a in announce_maddrs] if announce_maddrs else None
        self._recent_addrs: dict[Any, tuple[bytes, ...]] = {}  # skips re-parsing unchanged addrs
        # False once AutoNAT found that nobody can dial our own (non-relayed) listen addresses:
        # then only circuit addresses are announced (set by the DHT node's role logic)
        self.direct_reachable = True
        self._local_ips_cache: tuple[float, frozenset[str]] | None = None
        if hasattr(host, "announced_addrs"):  # what identify tells peers: what we announce
            host.announced_addrs = self.visible_maddrs

    @property
    def announces_explicitly(self) -> bool:
        """The caller named the addresses to announce (``announce_maddrs``)."""
        return self._announce is not None

    def set_handler(self, handler: RPCHandler | None) -> None:
        self.host.set_rpc_handler(PROTOCOL_ID, handler)

    async def call(self, peer_id: Any, request: Any, time_limit: float) -> Any:
        from dht.p2p import P2PError, P2PTimeoutError, RemoteError

        started = trio.current_time()
        try:
            with trio.fail_after(time_limit):
                return await self.host.call(peer_id, PROTOCOL_ID, request, timeout=time_limit)
        except RemoteError as e:
            raise PeerUnreachableError(
                f"{peer_id} refused a DHT request: {e}", answered=True
            ) from e
        except (
            P2PError,
            OSError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as e:
            heard = self.host.last_heard_from(peer_id)
            busy = isinstance(e, (trio.TooSlowError, P2PTimeoutError)) and (
                heard is not None and heard > started
            )
            raise PeerUnreachableError(f"DHT RPC to {peer_id} failed: {e!r}", busy=busy) from e

    async def connect(self, address: Any, time_limit: float) -> tuple[Any, tuple[bytes, ...]]:
        from dht.p2p import DialRefusedError, P2PError

        maddr = address if isinstance(address, self._Multiaddr) else self._Multiaddr(str(address))
        try:
            with trio.fail_after(time_limit):
                peer_id = await self.host.connect(
                    [maddr], peer_id=maddr.peer_id, timeout=time_limit
                )
        except DialRefusedError as e:
            raise PeerUnreachableError(
                f"cannot reach initial peer {maddr}: {e}", refused=True
            ) from e
        except (P2PError, OSError, trio.TooSlowError) as e:
            raise PeerUnreachableError(f"cannot reach initial peer {maddr}: {e!r}") from e
        addrs = (maddr.without_peer_id().to_bytes(),)
        self.remember_addrs(peer_id, addrs)
        return peer_id, addrs

    def usable_addrs(self, addrs: Sequence[bytes], informant: Any) -> tuple[bytes, ...]:
        """``addrs`` (binary multiaddrs) that ``informant`` could have meant for us.

        A loopback address names the machine of whoever uses it, a link-local one its link:
        from a peer on another machine they would make us, and everyone we pass them on to,
        dial ourselves. They are kept only when we reach ``informant`` over such an address
        too (peers on one machine, as in a local swarm). Malformed ones are dropped as well.
        """
        local = self._local_ips()
        scopes = {
            _address_scope_of_text(c.remote_addr, local) for c in self._live_connections(informant)
        }
        kept = []
        for raw in addrs:
            scope = _address_scope(raw)
            if scope == "malformed" or (scope is not None and scope not in scopes):
                continue
            kept.append(raw)
        return tuple(kept)

    def remember_addrs(self, peer_id: Any, addrs: Sequence[bytes], informant: Any = None) -> bool:
        """Add announced addresses to the peerstore. True if one of them was not known: the
        peer may have moved (e.g. behind a relay), so an earlier failure to reach it says
        little about the new way in. ``informant``: who told us (see :meth:`usable_addrs`;
        None: nobody, e.g. the address the user gave)."""
        if informant is not None:
            addrs = self.usable_addrs(addrs, informant)
        addrs = tuple(addrs)
        if not addrs or self._recent_addrs.get(peer_id) == addrs:
            return False
        if len(self._recent_addrs) >= 10_000:
            self._recent_addrs.clear()
        self._recent_addrs[peer_id] = addrs
        parsed = []
        for raw in addrs:
            try:
                parsed.append(self._Multiaddr.from_bytes(raw).without_peer_id())
            except ValueError:
                logger.debug("ignoring a malformed address announced for %s", peer_id)
        if not parsed:
            return False
        known = set(self.host.peerstore.get_addrs(peer_id))
        self.host.peerstore.add_addrs(peer_id, parsed)
        return any(a not in known for a in parsed)

    def visible_maddrs(self) -> list[Any]:
        """Full multiaddrs (with ``/p2p/<PeerID>``) others can use to reach this peer.

        The announced addresses if given, else the listen addresses (the TCP transport has
        already replaced a wildcard ``0.0.0.0`` / ``::`` by this machine's interface
        addresses; an unexpanded wildcard is never announced, nobody can dial it). Circuit
        addresses (``.../p2p-circuit``, added to the listen addresses while a relay holds a
        slot for us) come last, after the given announce addresses too; while
        ``direct_reachable`` is False only they are announced.
        """
        listen = self.host.listen_addrs
        circuits = [a for a in listen if a.is_circuit()]
        if self._announce is not None:
            addrs = self._announce + [a for a in circuits if a not in self._announce]
        elif not self.direct_reachable:
            addrs = circuits
        else:
            direct = [a for a in listen if not a.is_circuit() and not _is_wildcard(a)]
            addrs = direct + circuits
        return [a if a.peer_id is not None else a.with_peer_id(self.peer_id) for a in addrs]

    # -- read-only views of the Host's connections (roles and averaging read these) --------

    def _local_ips(self) -> frozenset[str]:
        """This machine's interface addresses, looked up at most once a minute (a peer that
        connects from one of them runs here, and its loopback addresses are real)."""
        now = time.monotonic()
        if self._local_ips_cache is None or now - self._local_ips_cache[0] > 60.0:
            from dht.p2p.transport import local_ip_addresses

            ips: set[str] = set()
            for family in (socket.AF_INET, socket.AF_INET6):
                try:
                    ips.update(local_ip_addresses(family))
                except OSError:
                    pass
            self._local_ips_cache = (now, frozenset(ips))
        return self._local_ips_cache[1]

    def _live_connections(self, peer_id: Any) -> list[Connection]:
        return self.host.connections(peer_id)

    def relayed_only(self, peer_id: Any) -> bool:
        """True if we are connected to ``peer_id`` and every live connection to it runs
        through a circuit relay (byte- and time-limited)."""
        live = self._live_connections(peer_id)
        return bool(live) and all(getattr(c, "relayed", False) for c in live)

    def relay_limit(self, peer_id: Any) -> Any:
        """The relay's ``Limit`` (``.duration`` s, ``.data`` bytes per direction, 0 = none) of
        the connection to ``peer_id`` when we reach it only through a relay, else None."""
        if not self.relayed_only(peer_id):
            return None
        limits = [c.relay_limit for c in self._live_connections(peer_id)]
        return next((limit for limit in limits if limit is not None), None)

    def relay_room(self, peer_id: Any) -> int | None:
        """When we reach ``peer_id`` only through a relay: the bytes the roomiest of those
        connections may still carry each way (what its relay's data limit leaves after what
        it carried already; 0 = spent); None otherwise or when one has no data limit."""
        if not self.relayed_only(peer_id):
            return None
        rooms = [c.relay_room for c in self._live_connections(peer_id)]
        limited = [room for room in rooms if room is not None]
        return max(limited) if len(limited) == len(rooms) else None

    def direct_peers(self) -> list[Any]:
        """Peers we hold a live direct (not relayed) connection to, the ones we dialed first
        (those are known to accept connections)."""
        dialed, accepted = [], []
        for peer_id in self.host.connected_peers():
            direct = [
                c for c in self._live_connections(peer_id) if not getattr(c, "relayed", False)
            ]
            if any(c.outbound for c in direct):
                dialed.append(peer_id)
            elif direct:
                accepted.append(peer_id)
        return dialed + accepted

    def serves(self, protocol: str) -> bool:
        """Does our Host already answer ``protocol`` (e.g. someone enabled a relay on it)?"""
        return self.host.supports(protocol)

    def own_addrs(self) -> list[bytes]:
        """The addresses sent with every request: at most what peers accept from one peer."""
        addrs = [a.without_peer_id().to_bytes() for a in self.visible_maddrs()]
        if len(addrs) > MAX_ADDRS_PER_PEER:
            logger.warning(
                "announcing only the first %d of %d addresses (the DHT's per-peer limit)",
                MAX_ADDRS_PER_PEER,
                len(addrs),
            )
        return addrs[:MAX_ADDRS_PER_PEER]

    def peer_from_bytes(self, data: bytes) -> Any:
        return self._PeerID.from_bytes(data)


def _is_wildcard(maddr: Any) -> bool:
    if not maddr.is_tcp():
        return False
    try:
        return ipaddress.ip_address(maddr.tcp_endpoint()[0]).is_unspecified
    except ValueError:  # a DNS name
        return False


_IP4, _IP6 = 0x04, 0x29  # multiaddr protocol codes (one varint byte each)


def _address_scope(raw: bytes) -> str | None:
    """ "loopback" / "link-local" for a binary multiaddr starting with such an IP (a circuit
    address counts by its relay's), None for any other, "malformed" if it cannot be one."""
    if not raw:
        return "malformed"
    if raw[0] == _IP4:
        if len(raw) < 5:
            return "malformed"
        if raw[1] == 127:
            return "loopback"
        return "link-local" if raw[1] == 169 and raw[2] == 254 else None
    if raw[0] == _IP6:
        if len(raw) < 17:
            return "malformed"
        ip = ipaddress.IPv6Address(raw[1:17])
        if ip.ipv4_mapped is not None:
            return _address_scope(bytes([_IP4]) + ip.ipv4_mapped.packed)
        if ip.is_loopback:
            return "loopback"
        return "link-local" if ip.is_link_local else None
    return None


# Asked for every connection to an informant on every address it tells us about: the same
# few texts over and over, and parsing one (a failing parse above all) is the expensive part.
@functools.lru_cache(maxsize=4096)
def _address_scope_of_text(remote: str, local_ips: frozenset[str] = frozenset()) -> str | None:
    """The scope of a connection's remote address: ``ip:port``, ``[ip6]:port`` (accepted)
    or a multiaddr text (dialed). A remote IP that is one of ours (``local_ips``) is this
    machine: "loopback" as well."""
    if remote.startswith("/ip"):
        host = remote.split("/")[2]
    else:
        host = remote.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or str(ip) in local_ips:
        return "loopback"
    return "link-local" if ip.is_link_local else None
