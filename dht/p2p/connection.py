"""Connections: the type the Host and the protocols built on it (relay, hole punching,
AutoNAT) share, the Host's table of them, how a remote address is read, and how to close a
stream that may already be broken.

It sits below ``host.py`` so that both sides import it and neither imports the other's
internals: the Host creates and registers :class:`Connection` objects in its
:class:`ConnectionTable`, the protocols read them (``host.connections(peer)``) or hand new
ones to the Host (``host.add_connection``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

import trio

from .identity import PeerID
from .yamux import YamuxSession


class Connection:
    """One secured, multiplexed connection to ``peer_id`` (Noise + yamux over some raw stream).

    ``outbound``: this side initiated the upgrade (multistream, Noise, yamux). ``remote_addr``
    names the remote for logs and identify: ``ip:port`` when accepted, the dialed multiaddr
    text when dialed, a circuit address when relayed. The flags below are set by the
    protocol that made the connection, before the Host registers it.
    """

    def __init__(
        self, peer_id: PeerID, session: YamuxSession, outbound: bool, remote_addr: str
    ) -> None:
        self.peer_id = peer_id
        self.session = session
        self.outbound = outbound
        self.remote_addr = remote_addr
        self.opened_at = trio.current_time()
        self.last_used = self.opened_at  # last stream opened or accepted
        self.identified = trio.Event()  # our identify exchange on it finished (or failed)
        # the protocols the remote listed in its identify answer (empty until then, or if
        # identify failed): hole punching asks whether the peer speaks DCUtR at all
        self.remote_protocols: frozenset[str] = frozenset()
        # through a circuit relay (relay.py): limited in bytes and time, used only when there
        # is no direct connection; relay_limit is the relay's Limit (None: it stated none)
        self.relayed = False
        self.relay_limit: Any = None
        # relayed: the bytes it has carried in its busier direction so far (the relay's
        # data limit counts them); see relay_room
        self.relay_usage: Callable[[], int] | None = None
        # direct, opened by hole punching (dcutr.py) beside a relayed connection
        self.hole_punched = False

    @property
    def relay_room(self) -> int | None:
        """Bytes this connection may still carry each way before its relay cuts it: None
        unless relayed with a data limit (a connection's limit is spent over its life, so
        what one round or download may use is what earlier ones left)."""
        data = int(getattr(self.relay_limit, "data", 0) or 0)
        if not self.relayed or not data:
            return None
        used = self.relay_usage() if self.relay_usage is not None else 0
        return max(0, data - used)

    @property
    def alive(self) -> bool:
        """Open, and the remote has not announced it is going away (GoAway)."""
        return not self.session.closed and not self.session.remote_go_away


ConnectionHook = Callable[[Connection], None]
PeerCallback = Callable[[PeerID], None]


class ConnectionTable:
    """The registered connections of one Host, per peer, oldest first, and the rules over
    them: which one new streams take, which idle one is closed to make room, who hears of
    arrivals and departures.

    No I/O beyond closing a connection to make room; ``log`` is the owner's logger (the
    records read as the Host's). A connection leaves the table when its session closes.
    """

    def __init__(self, me: PeerID, log: logging.Logger) -> None:
        self.me = me
        self.log = log
        self.by_peer: dict[PeerID, list[Connection]] = {}
        # peers whose connections make_room never closes, with why (e.g. a relay reservation)
        self.protected: dict[PeerID, set[str]] = {}
        self.hooks: list[ConnectionHook] = []  # told of every connection as it registers
        self.observers: list[tuple[PeerCallback, PeerCallback]] = []  # first in, last out

    def count(self) -> int:
        return sum(len(group) for group in self.by_peer.values())

    def add(self, conn: Connection) -> None:
        """Make a new connection usable at once (before its serving task starts)."""
        group = self.by_peer.setdefault(conn.peer_id, [])
        first = not any(c.alive for c in group)
        group.append(conn)
        conn.session._on_close = lambda _s: self._closed(conn)
        self.log.debug(
            "connected to %s (%s, %s)",
            conn.peer_id.short(),
            "outbound" if conn.outbound else "inbound",
            conn.remote_addr,
        )
        if first:
            self._notify(0, conn.peer_id)
        for hook in list(self.hooks):
            try:
                hook(conn)
            except Exception:
                self.log.exception("connection hook failed")

    def _closed(self, conn: Connection) -> None:
        group = self.by_peer.get(conn.peer_id)
        if group is None or conn not in group:
            return
        group.remove(conn)
        if conn.session.close_reason.startswith("protocol violation"):
            self.log.warning(
                "dropped connection to %s (%s): %s",
                conn.peer_id.short(),
                conn.remote_addr,
                conn.session.close_reason,
            )
        else:
            self.log.debug(
                "connection to %s closed: %s", conn.peer_id.short(), conn.session.close_reason
            )
        if not group:
            del self.by_peer[conn.peer_id]
            self._notify(1, conn.peer_id)

    def _notify(self, which: int, peer_id: PeerID) -> None:
        for callbacks in list(self.observers):
            try:
                callbacks[which](peer_id)
            except Exception:
                self.log.exception("connection observer failed")

    # -- reading ---------------------------------------------------------------------------
    def live(self, peer_id: PeerID | None = None) -> list[Connection]:
        """The live connections to ``peer_id`` (to every peer if None), oldest first."""
        if peer_id is not None:
            return [c for c in self.by_peer.get(peer_id, ()) if c.alive]
        return [c for group in self.by_peer.values() for c in group if c.alive]

    def of_session(self, peer_id: PeerID, session: YamuxSession) -> Connection | None:
        for conn in self.by_peer.get(peer_id, ()):
            if conn.session is session:
                return conn
        return None

    def best(self, peer_id: PeerID) -> Connection | None:
        """The connection new streams to ``peer_id`` take (None if there is no live one)."""
        live = [c for c in self.by_peer.get(peer_id, ()) if c.alive]
        if not live:
            return None
        live = [c for c in live if not c.relayed] or live  # a relayed one only as a last resort
        # Deterministic choice for simultaneous dials: prefer the connection dialed by the
        # peer with the smaller PeerID (both sides compute the same answer).
        we_dial = self.me < peer_id
        for conn in live:
            if conn.outbound == we_dial:
                return conn
        return live[0]

    def counts(self) -> dict[str, int]:
        """Live connections by kind: ``{"direct": n, "relayed": m}``, from a snapshot (safe
        from another thread: the loop may change the table meanwhile)."""
        counts = {"direct": 0, "relayed": 0}
        for group in list(self.by_peer.values()):
            for conn in list(group):
                if conn.alive:
                    counts["relayed" if conn.relayed else "direct"] += 1
        return counts

    def peers(self) -> list[PeerID]:
        return [pid for pid, group in self.by_peer.items() if any(c.alive for c in group)]

    # -- the connection limit --------------------------------------------------------------
    def protect(self, peer_id: PeerID, tag: str) -> None:
        self.protected.setdefault(peer_id, set()).add(tag)

    def unprotect(self, peer_id: PeerID, tag: str) -> None:
        tags = self.protected.get(peer_id)
        if tags is not None:
            tags.discard(tag)
            if not tags:
                del self.protected[peer_id]

    def make_room(self, limit: int, reserved: int = 0) -> bool:
        """True if one more connection fits under ``limit`` (``reserved``: dials under way
        count too), closing the least recently used idle connection (no open streams, peer
        not protected) when the limit is reached; False if every connection is busy."""
        if self.count() + reserved < limit:
            return True
        idle = [
            c
            for group in self.by_peer.values()
            for c in group
            if c.session.num_streams == 0 and c.peer_id not in self.protected
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_used)
        self.log.info(
            "closing idle connection to %s (%s) to make room (limit %d)",
            victim.peer_id.short(),
            victim.remote_addr,
            limit,
        )
        victim.session._shutdown("closed to make room for a new connection")
        return self.count() + reserved < limit


async def close_quietly(stream: Any) -> None:
    """Close ``stream`` within a second, shielded from cancellation, ignoring any error: for
    sockets and sessions that failed or were refused, whose close may fail in many ways."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.aclose()
        except Exception:  # noqa: BLE001 - closing a broken stream may fail in many ways
            pass


def is_loopback(addr: str) -> bool:
    """``ip:port`` or a multiaddr text on a loopback IP (in-memory addresses are not)."""
    text = addr.split("/")[2] if addr.startswith("/ip") else addr.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def source_key(remote: str) -> str:
    """Who a per-source cap counts a remote as: its IPv4 address, or the /64 of an IPv6
    address (one machine usually owns a whole /64); other transports' addresses as they are.
    ``remote`` is a connection's remote address (``ip:port``, ``[v6]:port`` or a multiaddr)."""
    host = remote if remote.startswith("/") else remote.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return remote
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip), 64), strict=False))
    return str(ip)


__all__ = ["Connection", "ConnectionTable", "close_quietly", "is_loopback", "source_key"]
