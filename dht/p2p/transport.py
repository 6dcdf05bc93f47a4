"""TCP transport: listen on and dial ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>`` multiaddrs.

Transports (this one and the in-memory one) share a small interface used by the Host:
``can_dial(maddr)``, ``await listen(maddr) -> [listener]`` where a listener has ``multiaddr``,
``await accept() -> (stream, remote_address_text)`` and ``aclose()``, and
``await dial(maddr, timeout) -> trio.abc.HalfCloseableStream``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import trio

from .errors import P2PTimeoutError
from .multiaddr import Multiaddr

logger = logging.getLogger(__name__)

_FAMILIES = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6, "dns": socket.AF_UNSPEC}
MAX_RESOLVED_ADDRESSES = 8  # a DNS answer is untrusted too: try only the first few


def _set_nodelay(stream: trio.SocketStream) -> None:
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError:  # pragma: no cover - not a TCP socket
        pass


def sockaddr_to_multiaddr(sockaddr: tuple) -> Multiaddr:
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host)
    proto = "ip4" if ip.version == 4 else "ip6"
    return Multiaddr(f"/{proto}/{ip}/tcp/{port}")


async def _local_addresses(family: int) -> list[str]:
    """Loopback plus the addresses this host's name resolves to (no interface enumeration
    exists in the standard library; this finds the primary address on typical machines)."""
    found = ["127.0.0.1" if family == socket.AF_INET else "::1"]
    try:
        infos = await trio.socket.getaddrinfo(
            socket.gethostname(), None, family, socket.SOCK_STREAM
        )
    except OSError:
        infos = []
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not ip.is_unspecified and not ip.is_link_local and str(ip) not in found:
            found.append(str(ip))
    return found[:MAX_RESOLVED_ADDRESSES]


class TCPListener:
    """One bound socket. ``multiaddr`` is the bound address (port 0 resolved); ``multiaddrs``
    are the addresses others can dial (a wildcard address expanded to concrete ones)."""

    def __init__(self, listener: trio.SocketListener) -> None:
        self._listener = listener
        self.multiaddr = sockaddr_to_multiaddr(listener.socket.getsockname())
        self.multiaddrs = [self.multiaddr]

    async def _expand_wildcard(self) -> None:
        host, port = self.multiaddr.tcp_endpoint()
        ip = ipaddress.ip_address(host)
        if ip.is_unspecified:
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            proto = "ip4" if ip.version == 4 else "ip6"
            self.multiaddrs = [
                Multiaddr(f"/{proto}/{a}/tcp/{port}") for a in await _local_addresses(family)
            ]

    async def accept(self) -> tuple[trio.SocketStream, str]:
        stream = await self._listener.accept()
        _set_nodelay(stream)
        try:
            peer = stream.socket.getpeername()
            remote = f"{peer[0]}:{peer[1]}"
        except OSError:
            remote = "<unknown>"
        return stream, remote

    async def aclose(self) -> None:
        await self._listener.aclose()


class TCPTransport:
    """TCP over trio sockets, with TCP_NODELAY (small RPCs must not wait for Nagle)."""

    def can_dial(self, maddr: Multiaddr) -> bool:
        return maddr.is_tcp()

    async def listen(self, maddr: Multiaddr | str) -> list[TCPListener]:
        host, port = Multiaddr(maddr).tcp_endpoint()
        listeners = [TCPListener(lst) for lst in await trio.open_tcp_listeners(port, host=host)]
        for listener in listeners:
            await listener._expand_wildcard()
        return listeners

    async def _resolve(self, maddr: Multiaddr) -> list[tuple[str, int]]:
        host, port = maddr.tcp_endpoint()
        kind = maddr.without_peer_id().protocols()[0]
        if kind not in _FAMILIES:
            return [(host, port)]
        infos = await trio.socket.getaddrinfo(host, port, _FAMILIES[kind], socket.SOCK_STREAM)
        seen: list[tuple[str, int]] = []
        for *_, sockaddr in infos:
            item = (sockaddr[0], port)
            if item not in seen:
                seen.append(item)
        if not seen:
            raise OSError(f"{host} did not resolve to any {kind} address")
        return seen[:MAX_RESOLVED_ADDRESSES]

    async def dial(self, maddr: Multiaddr | str, timeout: float = 10.0) -> trio.SocketStream:  # noqa: ASYNC109
        """Open a TCP connection; OSError if refused/unreachable, P2PTimeoutError on timeout."""
        maddr = Multiaddr(maddr)
        with trio.move_on_after(timeout) as scope:
            errors: list[str] = []
            for host, port in await self._resolve(maddr):
                try:
                    stream = await trio.open_tcp_stream(host, port)
                except OSError as e:
                    errors.append(f"{host}:{port}: {e}")
                    continue
                _set_nodelay(stream)
                return stream
            raise OSError("; ".join(errors))
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"TCP connect to {maddr} timed out after {timeout:.1f}s")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
