"""What the Host and the protocols built on it (relay, hole punching, AutoNAT) share about a
connection: its type, how its remote address is read, and how to close a stream that may
already be broken.

It sits below ``host.py`` so that both sides import it and neither imports the other's
internals: the Host creates and registers :class:`Connection` objects, the protocols read
them (``host.connections(peer)``) or hand new ones to the Host (``host.add_connection``).
"""

from __future__ import annotations

import ipaddress
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
        self.last_used = trio.current_time()  # last stream opened or accepted
        self.identified = trio.Event()  # our identify exchange on it finished (or failed)
        # through a circuit relay (relay.py): limited in bytes and time, used only when there
        # is no direct connection; relay_limit is the relay's Limit (None: it stated none)
        self.relayed = False
        self.relay_limit: Any = None
        # direct, opened by hole punching (dcutr.py) beside a relayed connection
        self.hole_punched = False

    @property
    def alive(self) -> bool:
        """Open, and the remote has not announced it is going away (GoAway)."""
        return not self.session.closed and not self.session.remote_go_away


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


__all__ = ["Connection", "close_quietly", "is_loopback", "source_key"]
