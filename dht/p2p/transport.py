"""TCP transport: listen on and dial ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>`` multiaddrs.

Transports (this one and the in-memory one) share a small interface used by the Host:
``can_dial(maddr)``, ``await listen(maddr) -> [listener]`` where a listener has ``multiaddr``,
``await accept() -> (stream, remote_address_text)`` and ``aclose()``, and
``await dial(maddr, timeout) -> trio.abc.HalfCloseableStream``.

Port reuse (for hole punching, ``dcutr.py``): a NAT maps each local ``ip:port`` to a public
port, so a hole-punching dial must leave from the port we listen on, the one whose mapping
we told the other side. TCP listeners therefore bind with ``SO_REUSEADDR``, then enable
``SO_REUSEPORT``, and ``dial(..., local_port=p)`` binds its socket to port ``p`` with
``SO_REUSEPORT`` before connecting. The listener binds *before* it enables ``SO_REUSEPORT``,
so a port someone already holds (a second moshpit process on the same fixed port) is still
"address already in use" rather than a silently shared port.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
import sys
from typing import Any

import trio

from .errors import P2PTimeoutError
from .multiaddr import Multiaddr

if sys.version_info < (3, 11):  # pragma: no cover - trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

_FAMILIES = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6, "dns": socket.AF_UNSPEC}
MAX_RESOLVED_ADDRESSES = 8  # a DNS answer is untrusted too: try only the first few


def _is_refusal(error: BaseException) -> bool:
    """Did the peer's host refuse the connection (RST: no listener on that port)? trio
    reports a failed connect as an OSError caused by a group of per-address errors."""
    if isinstance(error, ConnectionRefusedError):
        return True
    cause = error.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(_is_refusal(e) for e in cause.exceptions)
    return isinstance(cause, ConnectionRefusedError)


# Unsent bytes the kernel may hold before the socket stops reporting itself writable
# (Linux's TCP_NOTSENT_LOWAT). Without it a slow link's socket buffers megabytes, and
# whatever the multiplexer writes next (a request of another stream, light or not) waits
# behind them; with it, the multiplexer's own order (yamux.LIGHT_STREAM_BYTES) holds.
NOTSENT_LOWAT = 32 * 1024
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def _set_socket_options(stream: trio.SocketStream) -> None:
    """TCP_NODELAY, and a bounded queue of unsent bytes where the system has the option."""
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError:  # pragma: no cover - not a TCP socket
        pass
    if sys.platform.startswith("linux"):
        try:
            stream.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        except OSError:  # pragma: no cover - an old kernel
            pass


# Linux's SO_MAX_PACING_RATE (not every Python exports the name); other systems lack the option
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_UNLIMITED_RATE = 0xFFFFFFFF  # the kernel's "no cap" value
MIN_SEND_RATE = 1024  # bytes/s: a smaller cap would stall a connection's keep-alives


def set_max_send_rate(stream: object, rate: float | None) -> bool:
    """Cap a TCP connection's send rate at ``rate`` bytes/s (``None``: lift the cap).

    The kernel paces the connection's packets (``SO_MAX_PACING_RATE``), so a sender with
    several connections can share its uplink among them at rates it chooses, instead of
    bursting into a receiver's already-busy downlink. False where it cannot be done: not a
    TCP socket (the in-memory transport), or a system without the option.
    """
    if not isinstance(stream, trio.SocketStream):
        return False
    if rate is None:
        value = _UNLIMITED_RATE
    else:
        if not rate > 0:
            raise ValueError(f"rate must be a positive number of bytes/s, got {rate!r}")
        value = min(_UNLIMITED_RATE - 1, max(MIN_SEND_RATE, int(rate)))
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", value))
    except OSError as e:
        logger.debug("cannot set SO_MAX_PACING_RATE: %s", e)
        return False
    return True


def sockaddr_to_multiaddr(sockaddr: tuple[Any, ...]) -> Multiaddr:
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host)
    proto = "ip4" if ip.version == 4 else "ip6"
    return Multiaddr(f"/{proto}/{ip}/tcp/{port}")


# Linux netlink (rtnetlink) constants for an RTM_GETADDR dump; see rtnetlink(7).
_NLMSG_HDR = struct.Struct("=LHHLL")  # length, type, flags, sequence, port id
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
_RTATTR = struct.Struct("=HH")  # length, type
_NLMSG_ERROR, _NLMSG_DONE, _RTM_NEWADDR, _RTM_GETADDR = 2, 3, 20, 22
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_IFA_F_DADFAILED = 0x08
_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_UP = 0x8913, 0x8915, 0x1
_NETLINK_MAX_BYTES = 1 << 22  # stop reading a (local, but still bounded) dump after 4 MiB
MAX_ANNOUNCED_PER_LISTENER = 8  # the DHT carries at most 16 addresses per peer
# documentation-only addresses (RFC 5737 / RFC 3849): a UDP connect picks a route, sends nothing
_ROUTE_PROBES: dict[int, str] = {socket.AF_INET: "198.51.100.1", socket.AF_INET6: "2001:db8::1"}


def _interface_is_up(index: int) -> bool:
    """True unless the kernel says the interface is administratively down (or is unknown)."""
    try:
        import fcntl

        name = socket.if_indextoname(index).encode()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, struct.pack("16sH22x", name, 0))
    except (OSError, ImportError, ValueError):
        return True  # cannot tell: keep the address rather than hide a usable one
    return bool(struct.unpack_from("H", reply, 16)[0] & _IFF_UP)


def _netlink_addresses(family: int) -> list[str]:
    """Every address of ``family`` on an up interface, from the kernel's rtnetlink dump (Linux)."""
    af_netlink = getattr(socket, "AF_NETLINK", None)
    if af_netlink is None:
        raise OSError("no AF_NETLINK on this platform")
    seq = 1
    request = _NLMSG_HDR.pack(
        _NLMSG_HDR.size + _IFADDRMSG.size, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0
    ) + _IFADDRMSG.pack(family, 0, 0, 0, 0)
    found: list[tuple[str, int]] = []
    with socket.socket(af_netlink, socket.SOCK_RAW, 0) as sock:  # 0 = NETLINK_ROUTE
        sock.settimeout(1.0)
        sock.bind((0, 0))
        sock.send(request)
        received = 0
        while received < _NETLINK_MAX_BYTES:
            data = sock.recv(65536)
            if not data:
                raise OSError("netlink socket closed during the address dump")
            received += len(data)
            pos = 0
            while pos + _NLMSG_HDR.size <= len(data):
                length, kind, _, msg_seq, _ = _NLMSG_HDR.unpack_from(data, pos)
                if length < _NLMSG_HDR.size or pos + length > len(data):
                    raise OSError("malformed netlink message in the address dump")
                if kind == _NLMSG_DONE:
                    return [addr for addr, index in found if _interface_is_up(index)]
                if kind == _NLMSG_ERROR:
                    raise OSError("the kernel refused the netlink address dump")
                if kind == _RTM_NEWADDR and msg_seq == seq:
                    item = _parse_newaddr(data[pos + _NLMSG_HDR.size : pos + length], family)
                    if item is not None:
                        found.append(item)
                pos += (length + 3) & ~3
    raise OSError("netlink address dump too large")


def _parse_newaddr(body: bytes, family: int) -> tuple[str, int] | None:
    """``(address, interface index)`` of one RTM_NEWADDR message, or None to skip it."""
    if len(body) < _IFADDRMSG.size:
        return None
    msg_family, _, flags, _, index = _IFADDRMSG.unpack_from(body)
    if msg_family != family or flags & _IFA_F_DADFAILED:
        return None
    attrs: dict[int, bytes] = {}
    pos = _IFADDRMSG.size
    while pos + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, pos)
        if length < _RTATTR.size or pos + length > len(body):
            break
        attrs.setdefault(kind, body[pos + _RTATTR.size : pos + length])
        pos += (length + 3) & ~3
    # IFA_LOCAL is this host's side of a point-to-point link; IFA_ADDRESS otherwise
    raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
    if raw is None or len(raw) != (4 if family == socket.AF_INET else 16):
        return None
    return socket.inet_ntop(family, raw), index


def _ioctl_ipv4_addresses() -> list[str]:
    """The primary IPv4 address of each up interface (Linux ioctls; no aliases)."""
    import fcntl

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for index, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(
                    sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # no IPv4 address on this interface
            if _interface_is_up(index):
                found.append(socket.inet_ntoa(reply[20:24]))
    return found


def _route_source_address(family: int) -> str | None:
    """The source address the kernel picks for an outbound route (None without a route)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((_ROUTE_PROBES[family], 9))  # UDP connect: selects a route, sends nothing
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return None


def local_ip_addresses(family: int) -> list[str]:
    """Addresses other machines may reach this one at, best first, loopback last.

    The standard library has no interface enumeration, so on Linux this asks the kernel
    (rtnetlink, then per-interface ioctls) and everywhere the source address of the default
    route. Unspecified, link-local and multicast addresses are dropped. Fast (local syscalls
    only), but call it off the event loop.
    """
    candidates: list[str] = []
    source = _route_source_address(family)
    if source is not None:
        candidates.append(source)
    enumerated = True
    try:
        candidates += _netlink_addresses(family)
    except OSError as e:
        logger.debug("netlink address dump failed (%s); trying ioctls", e)
        try:
            candidates += _ioctl_ipv4_addresses() if family == socket.AF_INET else []
        except (OSError, ImportError) as e2:
            logger.debug("interface ioctls failed (%s); using the route source only", e2)
            enumerated = False
    usable: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for text in candidates:
        try:
            ip = ipaddress.ip_address(text.split("%")[0])
        except ValueError:
            continue
        if ip.is_unspecified or ip.is_link_local or ip.is_multicast or ip in usable:
            continue
        usable.append(ip)
    loopback = ipaddress.ip_address("127.0.0.1" if family == socket.AF_INET else "::1")
    if (not enumerated or not usable) and loopback not in usable:
        usable.append(loopback)  # interfaces unknown: local peers can still use loopback
    # the route's source first, then public, then private addresses; loopback last
    usable.sort(key=lambda ip: (ip.is_loopback, str(ip) != source, not ip.is_global))
    ordered = [str(ip) for ip in usable]
    if len(ordered) > MAX_ANNOUNCED_PER_LISTENER:  # keep loopback for local peers
        tail = [a for a in ordered if ipaddress.ip_address(a).is_loopback][:1]
        ordered = [a for a in ordered if a not in tail][: MAX_ANNOUNCED_PER_LISTENER - len(tail)]
        ordered += tail
    return ordered


LISTEN_BACKLOG = 0xFFFF  # the kernel caps it at net.core.somaxconn (as trio's default does)


def port_reuse_supported() -> bool:
    """Whether this platform has ``SO_REUSEPORT`` (Linux, the BSDs, macOS; not Windows)."""
    return hasattr(socket, "SO_REUSEPORT")


def _enable_port_reuse(sock: trio.socket.SocketType) -> bool:
    """Let other sockets of this process bind the same port (hole-punching dials)."""
    if not port_reuse_supported():
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError as e:  # pragma: no cover - a kernel without the option
        logger.debug("cannot set SO_REUSEPORT: %s", e)
        return False
    return True


async def _open_listeners(host: str, port: int, reuse_port: bool) -> list[tuple[Any, bool]]:
    """Bound, listening trio sockets for ``host:port`` with whether each allows port reuse.

    ``bind`` happens before ``SO_REUSEPORT`` is set: a port another socket holds fails with
    EADDRINUSE as it always did (setting it first would let two processes share the port, and
    the kernel would split the incoming connections between them).
    """
    infos = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    seen: list[tuple[int, tuple[Any, ...]]] = []
    out: list[tuple[Any, bool]] = []
    try:
        for family, kind, proto, _, sockaddr in infos:
            if (family, sockaddr) in seen:
                continue
            seen.append((family, sockaddr))
            try:
                sock = trio.socket.socket(family, kind, proto)
            except OSError as e:
                if e.errno == errno.EAFNOSUPPORT and len(infos) > 1:
                    continue  # a name that resolves to IPv6 too, on a host without IPv6
                raise
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                shared = reuse_port and _enable_port_reuse(sock)
                sock.listen(LISTEN_BACKLOG)
            except BaseException:
                sock.close()
                raise
            out.append((sock, shared))
    except BaseException:
        for sock, _ in out:
            sock.close()
        raise
    if not out:
        raise OSError(f"cannot listen on {host}:{port}: no usable address family")
    return out


async def connect_from_port(host: str, port: int, local_port: int) -> trio.SocketStream:
    """A TCP connection to ``host:port`` whose local port is ``local_port`` (shared with our
    listener through ``SO_REUSEPORT``): the NAT maps it to the public port we announced.

    OSError if the port cannot be shared (no SO_REUSEPORT here, or the listener lacks it), the
    exact connection already exists (EADDRNOTAVAIL), or the connect fails."""
    if not port_reuse_supported():
        raise OSError("SO_REUSEPORT is not available on this platform")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        await sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", local_port))
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    stream = trio.SocketStream(sock)
    _set_socket_options(stream)
    return stream


class TCPListener:
    """One bound socket. ``multiaddr`` is the bound address (port 0 resolved); ``multiaddrs``
    are the addresses others can dial (a wildcard address expanded to concrete ones);
    ``reuse_port``: dials may leave from this port (``TCPTransport.dial(local_port=...)``)."""

    def __init__(self, listener: trio.SocketListener, reuse_port: bool = False) -> None:
        self._listener = listener
        self.multiaddr = sockaddr_to_multiaddr(listener.socket.getsockname())
        self.multiaddrs = [self.multiaddr]
        self.reuse_port = reuse_port

    async def _expand_wildcard(self) -> None:
        host, port = self.multiaddr.tcp_endpoint()
        ip = ipaddress.ip_address(host)
        if ip.is_unspecified:
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            proto = "ip4" if ip.version == 4 else "ip6"
            found = await trio.to_thread.run_sync(local_ip_addresses, family)
            self.multiaddrs = [Multiaddr(f"/{proto}/{a}/tcp/{port}") for a in found]

    async def accept(self) -> tuple[trio.SocketStream, str]:
        stream = await self._listener.accept()
        _set_socket_options(stream)
        try:
            peer = stream.socket.getpeername()
            remote = f"{peer[0]}:{peer[1]}"
        except OSError:
            remote = "<unknown>"
        return stream, remote

    async def aclose(self) -> None:
        await self._listener.aclose()


class TCPTransport:
    """TCP over trio sockets, with TCP_NODELAY (small RPCs must not wait for Nagle).

    ``reuse_port`` (default on where the platform has it): listeners share their port with
    hole-punching dials (see the module docstring); off, ``dial(local_port=...)`` fails."""

    def __init__(self, *, reuse_port: bool = True) -> None:
        self.reuse_port = reuse_port and port_reuse_supported()

    def can_dial(self, maddr: Multiaddr) -> bool:
        return maddr.is_tcp()

    async def listen(self, maddr: Multiaddr | str) -> list[TCPListener]:
        host, port = Multiaddr(maddr).tcp_endpoint()
        listeners = [
            TCPListener(trio.SocketListener(sock), shared)
            for sock, shared in await _open_listeners(host, port, self.reuse_port)
        ]
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

    async def dial(
        self,
        maddr: Multiaddr | str,
        timeout: float = 10.0,  # noqa: ASYNC109
        *,
        local_port: int | None = None,
    ) -> trio.SocketStream:
        """Open a TCP connection; OSError if refused/unreachable, P2PTimeoutError on timeout.

        ``local_port``: leave from that port, shared with our listener on it (hole punching;
        needs ``reuse_port``), instead of an ephemeral one."""
        maddr = Multiaddr(maddr)
        if local_port is not None and not self.reuse_port:
            raise OSError("this transport does not share ports (reuse_port is off)")
        with trio.move_on_after(timeout) as scope:
            errors: list[str] = []
            refused = True
            for host, port in await self._resolve(maddr):
                try:
                    if local_port is None:
                        stream = await trio.open_tcp_stream(host, port)
                    else:
                        stream = await connect_from_port(host, port, local_port)
                except OSError as e:
                    if _is_refusal(e):
                        errors.append(f"{host}:{port}: connection refused")
                    else:
                        errors.append(f"{host}:{port}: {e}")
                        refused = False
                    continue
                _set_socket_options(stream)
                return stream
            # refused: the host answered at once that nothing listens on that port
            raise (ConnectionRefusedError if refused and errors else OSError)("; ".join(errors))
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"TCP connect to {maddr} timed out after {timeout:.1f}s")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
