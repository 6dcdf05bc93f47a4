"""AutoNAT v1 (``/libp2p/autonat/1.0.0``): can peers on the Internet connect to this one?

A peer cannot tell by looking at its own interfaces whether it sits behind a NAT or a
firewall. So it asks peers it is connected to to dial it back: it sends a ``Dial`` message
listing its addresses, the other peer dials them on a *new* connection and answers ``OK``
(with the address that worked) or ``E_DIAL_ERROR``. Several peers must agree
(``threshold``, 3 by default) before the answer is believed: ``public`` if that many dialed
us back, ``private`` if that many could not and none could; anything else stays
``unknown``. The result is ``host.reachability`` (a :class:`Reachability`).

A young swarm (one bootstrap node and volunteers at home) has fewer servers than that, so
when fewer than ``threshold`` servers gave a verdict the peer decides on what it saw itself
(``reachability.decide``): a listen address that is globally routable and a direct
connection from another IP make it public; a failed dial-back, none that demonstrably
worked, and an observed address that none of its interfaces holds (a NAT rewrote it) make
it private. Such verdicts are provisional: checked again every ``recheck_interval``.

Server side, everything from the requester is untrusted:

* only the IP address the request arrived from is ever dialed (the requested addresses
  contribute their TCP ports, never their IPs), so a peer cannot make us connect to a third
  party (libp2p spec; RFC 3489 12.1.1); requests over relayed connections are refused, their
  IP cannot be seen;
* requests are rate-limited per peer, per source IP (IPv6: /64) and in total, at most
  ``max_concurrent_dials`` dial-backs run at once, at most ``max_dial_addrs`` ports are tried;
* a message is at most :data:`MAX_MESSAGE_SIZE` bytes, carries at most
  :data:`MAX_REQUEST_ADDRS` addresses; a malformed one is answered ``E_BAD_REQUEST`` and
  logged with the reason (rate-limited).

Wire format (uvarint-length-prefixed protobuf, proto2)::

    Message      {1 type: enum {DIAL=0, DIAL_RESPONSE=1}, 2 dial: Dial, 3 dialResponse}
    Dial         {1 peer: PeerInfo}
    PeerInfo     {1 id: bytes (PeerID), 2 addrs: repeated bytes (binary multiaddrs)}
    DialResponse {1 status: enum, 2 statusText: string, 3 addr: bytes}
    status: OK=0, E_DIAL_ERROR=100, E_DIAL_REFUSED=101, E_BAD_REQUEST=200, E_INTERNAL_ERROR=300

The addresses other peers *observed* us at (identify's ``observedAddr``,
:class:`ObservedAddrs`) and the verdict (:class:`Reachability`) are kept in
``reachability.py``, which the Host holds; they are re-exported here.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import trio

from .._logging import RateLimitedLogger
from ._proto import (
    WIRE_LEN,
    WIRE_VARINT,
    ProtobufDecodeError,
    encode_bytes_field,
    encode_varint_field,
    iter_fields,
)
from .errors import (
    IdentityError,
    MessageTooLargeError,
    MultiaddrError,
    P2PError,
    ProtocolViolationError,
    ResourceLimitError,
)
from .identity import Identity, PeerID
from .multiaddr import Multiaddr
from .reachability import (
    Arrivals,
    Evidence,
    IPAddress,
    ObservedAddrs,
    Reachability,
    ReachabilityStatus,
    decide,
    globally_routable,
    ip_of,
    settle,
    tcp_addr,
    tcp_port,
)
from .transport import local_ip_addresses
from .varint import encode_uvarint

if TYPE_CHECKING:
    from .connection import Connection
    from .host import Host
    from .stream import P2PStream

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/libp2p/autonat/1.0.0"
MAX_MESSAGE_SIZE = 4096  # a request with 16 addresses is a few hundred bytes
MAX_REQUEST_ADDRS = 32  # more addresses than this in one request: E_BAD_REQUEST
MAX_STATUS_TEXT = 256  # characters of statusText kept (and sent)
MAX_ENUM = (1 << 31) - 1  # protobuf enums are int32


class MessageType(IntEnum):
    DIAL = 0
    DIAL_RESPONSE = 1


class ResponseStatus(IntEnum):
    OK = 0
    E_DIAL_ERROR = 100
    E_DIAL_REFUSED = 101
    E_BAD_REQUEST = 200
    E_INTERNAL_ERROR = 300


def status_name(status: int) -> str:
    """``"E_DIAL_ERROR"`` for 100, ``"status 7"`` for a code we do not know."""
    try:
        return ResponseStatus(status).name
    except ValueError:
        return f"status {status}"


class AutoNATMessageError(ProtocolViolationError):
    """An AutoNAT message is malformed (wrong wire type, missing field, over a cap...)."""


@dataclass(frozen=True)
class DialRequest:
    """``Dial``: the requester's PeerID (None if it left it out) and addresses to dial.
    ``skipped`` counts addresses that did not parse (kinds we do not support)."""

    peer_id: PeerID | None
    addrs: tuple[Multiaddr, ...]
    skipped: int = 0


@dataclass(frozen=True)
class DialResponse:
    """``DialResponse``: ``status`` is kept as an int (an unknown code is the caller's call)."""

    status: int
    text: str = ""
    addr: Multiaddr | None = None


# -- codec --------------------------------------------------------------------------------------


def encode_dial(peer_id: PeerID, addrs: Iterable[Multiaddr]) -> bytes:
    """A ``Message{type: DIAL}`` body (no length prefix)."""
    info = bytearray(encode_bytes_field(1, peer_id.to_bytes()))
    for addr in list(addrs)[:MAX_REQUEST_ADDRS]:
        info += encode_bytes_field(2, addr.to_bytes())
    dial = encode_bytes_field(1, bytes(info))
    return encode_varint_field(1, MessageType.DIAL) + encode_bytes_field(2, dial)


def encode_dial_response(response: DialResponse) -> bytes:
    """A ``Message{type: DIAL_RESPONSE}`` body (no length prefix)."""
    body = bytearray(encode_varint_field(1, int(response.status)))
    if response.text:
        body += encode_bytes_field(2, response.text[:MAX_STATUS_TEXT].encode())
    if response.addr is not None:
        body += encode_bytes_field(3, response.addr.to_bytes())
    return encode_varint_field(1, MessageType.DIAL_RESPONSE) + encode_bytes_field(3, bytes(body))


def frame(body: bytes) -> bytes:
    """``body`` with its uvarint length prefix, as it goes on the stream."""
    return encode_uvarint(len(body)) + body


def _fields(data: bytes, what: str, expected: dict[int, int]) -> dict[int, list[int | bytes]]:
    """Every field of a message, grouped by number; a known field with another wire type than
    ``expected`` is an error, unknown fields are dropped (forward compatibility)."""
    out: dict[int, list[int | bytes]] = {}
    try:
        for number, wire, value in iter_fields(data):
            want = expected.get(number)
            if want is None:
                continue
            if wire != want:
                raise AutoNATMessageError(f"{what} field {number} has wire type {wire}, not {want}")
            out.setdefault(number, []).append(value)
    except ProtobufDecodeError as e:
        raise AutoNATMessageError(f"malformed {what}: {e}") from None
    return out


def _single(fields: dict[int, list[int | bytes]], number: int, what: str) -> int | bytes | None:
    values = fields.get(number)
    if not values:
        return None
    if len(values) > 1:
        raise AutoNATMessageError(f"{what} repeats field {number}")
    return values[0]


def _enum(value: int | bytes | None, what: str) -> int | None:
    if value is None:
        return None
    assert isinstance(value, int)
    if value > MAX_ENUM:
        raise AutoNATMessageError(f"{what} {value} is out of range")
    return value


def _decode_dial(data: bytes) -> DialRequest:
    dial = _fields(data, "Dial", {1: WIRE_LEN})
    peer = _single(dial, 1, "Dial")
    if peer is None:
        raise AutoNATMessageError("Dial has no peer")
    assert isinstance(peer, bytes)
    info = _fields(peer, "PeerInfo", {1: WIRE_LEN, 2: WIRE_LEN})
    raw_id = _single(info, 1, "PeerInfo")
    peer_id = None
    if raw_id is not None:
        assert isinstance(raw_id, bytes)
        try:
            peer_id = PeerID.from_bytes(raw_id)
        except (IdentityError, ValueError) as e:
            raise AutoNATMessageError(f"PeerInfo.id is not a PeerID: {e}") from None
    raw_addrs = info.get(2, [])
    if len(raw_addrs) > MAX_REQUEST_ADDRS:
        raise AutoNATMessageError(
            f"Dial lists {len(raw_addrs)} addresses (at most {MAX_REQUEST_ADDRS})"
        )
    addrs: list[Multiaddr] = []
    skipped = 0
    for raw in raw_addrs:
        assert isinstance(raw, bytes)
        try:
            addrs.append(Multiaddr.from_bytes(raw))
        except MultiaddrError:
            skipped += 1  # an address kind we do not support (quic, ws...): not ours to dial
    return DialRequest(peer_id, tuple(addrs), skipped)


def _decode_response(data: bytes) -> DialResponse:
    resp = _fields(data, "DialResponse", {1: WIRE_VARINT, 2: WIRE_LEN, 3: WIRE_LEN})
    status = _enum(_single(resp, 1, "DialResponse"), "DialResponse.status")
    if status is None:  # proto2 would read OK: never take a missing status as a success
        raise AutoNATMessageError("DialResponse has no status")
    raw_text = _single(resp, 2, "DialResponse")
    text = ""
    if raw_text is not None:
        assert isinstance(raw_text, bytes)
        try:
            text = raw_text.decode("utf-8")[:MAX_STATUS_TEXT]
        except UnicodeDecodeError:
            raise AutoNATMessageError("DialResponse.statusText is not UTF-8") from None
    raw_addr = _single(resp, 3, "DialResponse")
    addr = None
    if raw_addr is not None:
        assert isinstance(raw_addr, bytes)
        try:
            addr = Multiaddr.from_bytes(raw_addr)
        except MultiaddrError:
            addr = None  # informational only
    return DialResponse(status, text, addr)


def decode_message(data: bytes) -> DialRequest | DialResponse:
    """Parse a ``Message`` body; AutoNATMessageError if it is malformed or over a cap."""
    if len(data) > MAX_MESSAGE_SIZE:
        raise AutoNATMessageError(f"message of {len(data)} bytes (at most {MAX_MESSAGE_SIZE})")
    msg = _fields(bytes(data), "Message", {1: WIRE_VARINT, 2: WIRE_LEN, 3: WIRE_LEN})
    kind = _enum(_single(msg, 1, "Message"), "Message.type")
    kind = MessageType.DIAL if kind is None else kind  # proto2's default
    if kind == MessageType.DIAL:
        dial = _single(msg, 2, "Message")
        if dial is None:
            raise AutoNATMessageError("DIAL message without a dial field")
        assert isinstance(dial, bytes)
        return _decode_dial(dial)
    if kind == MessageType.DIAL_RESPONSE:
        resp = _single(msg, 3, "Message")
        if resp is None:
            raise AutoNATMessageError("DIAL_RESPONSE message without a dialResponse field")
        assert isinstance(resp, bytes)
        return _decode_response(resp)
    raise AutoNATMessageError(f"unknown message type {kind}")


# -- addresses ----------------------------------------------------------------------------------


def _source_key(ip: IPAddress) -> str:
    """What per-source limits count: the IPv4 address, or the /64 of an IPv6 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(ip), 64), strict=False))
    return str(ip)


def dial_targets(
    requested: Iterable[Multiaddr], observed_ip: IPAddress, requester: PeerID, limit: int
) -> list[Multiaddr]:
    """The addresses a server dials back: the TCP ports of the requested addresses, at the IP
    the request came from, whatever IP the requester wrote (it may not know its public IP,
    and dialing any other IP would let it aim us at a third party). Relayed addresses, DNS
    names and addresses of another peer are skipped; at most ``limit``, no repeats."""
    out: list[Multiaddr] = []
    for addr in requested:
        if addr.peer_id is not None and addr.peer_id != requester:
            continue
        port = tcp_port(addr)
        if port is None:
            continue
        target = tcp_addr(observed_ip, port)
        if target not in out:
            out.append(target)
            if len(out) >= limit:
                break
    return out


@dataclass
class AutoNATConfig:
    """Knobs of :class:`AutoNAT` (server limits first, then the client's decision rule)."""

    # server
    dial_timeout: float = 15.0  # one dial-back, all its addresses
    request_timeout: float = 10.0  # the request must arrive by then
    max_dial_addrs: int = 4  # ports tried per request
    max_concurrent_dials: int = 8
    max_requests_per_peer: int = 3  # per rate_window
    max_requests_per_source: int = 6  # per IPv4 address / IPv6 /64 per rate_window
    max_requests_total: int = 60  # per rate_window
    rate_window: float = 60.0
    # client
    threshold: int = 3  # servers that must agree
    max_servers: int = 6  # asked per round (at once)
    response_timeout: float = 30.0  # must exceed the servers' dial_timeout
    retry_interval: float = 60.0  # next round while unknown
    refresh_interval: float = 900.0  # next round once decided
    recheck_interval: float = 60.0  # next round after a provisional (young-swarm) verdict
    max_offered_addrs: int = 16

    def __post_init__(self) -> None:
        for name in (
            "max_dial_addrs",
            "max_concurrent_dials",
            "max_requests_per_peer",
            "max_requests_per_source",
            "max_requests_total",
            "threshold",
            "max_servers",
            "max_offered_addrs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"AutoNATConfig.{name} must be at least 1, got {getattr(self, name)}"
                )
        for name in (
            "dial_timeout",
            "request_timeout",
            "rate_window",
            "response_timeout",
            "recheck_interval",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"AutoNATConfig.{name} must be positive, got {getattr(self, name)}"
                )


class _RateLimiter:
    """Fixed-window request counters: per peer, per source, in total. The per-peer and
    per-source tables can hold at most ``total`` entries, so memory is bounded too."""

    def __init__(self, per_peer: int, per_source: int, total: int, window: float) -> None:
        self.per_peer, self.per_source, self.total, self.window = (
            per_peer,
            per_source,
            total,
            window,
        )
        self._ends = float("-inf")
        self._count = 0
        self._peers: dict[PeerID, int] = {}
        self._sources: dict[str, int] = {}

    def refuse(self, peer: PeerID, source: str | None, now: float) -> str | None:
        """None if the request may go on (and count it), else why not."""
        if now >= self._ends:
            self._ends, self._count = now + self.window, 0
            self._peers.clear()
            self._sources.clear()
        if self._count >= self.total:
            return f"too many requests ({self.total} per {self.window:.0f}s in total)"
        if self._peers.get(peer, 0) >= self.per_peer:
            return f"too many requests from this peer ({self.per_peer} per {self.window:.0f}s)"
        if source is not None and self._sources.get(source, 0) >= self.per_source:
            return f"too many requests from {source} ({self.per_source} per {self.window:.0f}s)"
        self._count += 1
        self._peers[peer] = self._peers.get(peer, 0) + 1
        if source is not None:
            self._sources[source] = self._sources.get(source, 0) + 1
        return None


@dataclass
class _Answer:
    server: PeerID
    status: int | None  # None: no usable answer (see error)
    text: str = ""
    addr: Multiaddr | None = None
    error: str = ""


@dataclass
class ProbeResult:
    """One round: which servers said what, and everything the verdict rested on (kept for
    logs, tests, and to decide again when new evidence arrives between rounds)."""

    reachability: Reachability
    answers: list[_Answer] = field(default_factory=list)
    evidence: Evidence = field(default_factory=Evidence)
    started: float = 0.0  # time.monotonic() when the round began


class AutoNAT:
    """AutoNAT v1 for one Host: :meth:`serve` answers other peers, :meth:`probe` asks them.

    :meth:`run` probes periodically (every ``retry_interval`` while the answer is unknown,
    every ``recheck_interval`` after a provisional verdict, every ``refresh_interval`` once
    decided) and keeps ``host.reachability`` current; an inconclusive round does not
    overturn an earlier decision (see ``reachability.settle``). It also decides again,
    without asking anyone, when a direct connection arrives from another IP while the peer
    is not known to be public (a bootstrap node learns it is public as its first peers
    connect). ``on_change(reachability)`` callbacks run after the first round and whenever
    the status changes.
    """

    def __init__(self, host: Host, config: AutoNATConfig | None = None) -> None:
        self.host = host
        self.config = config or AutoNATConfig()
        self._limiter = _RateLimiter(
            self.config.max_requests_per_peer,
            self.config.max_requests_per_source,
            self.config.max_requests_total,
            self.config.rate_window,
        )
        self._active_dials = 0
        # dial-backs prove this key, not the host's (the spec allows another PeerID): the
        # requester must not take a connection we close at once for its connection to us
        self._dialback_identity = Identity.generate()
        self._log = RateLimitedLogger(logger, clock=time.monotonic)
        self._observers: list[Callable[[Reachability], None]] = []
        self.changed = trio.Event()  # set (and replaced) whenever the status changes
        self.last_round: ProbeResult | None = None
        # direct connections that reached us (dial-backs among them), for the evidence
        self.arrivals = Arrivals(ttl=self.config.refresh_interval)
        self._arrived = trio.Event()  # set when one arrives from another IP (wakes run())
        self._interfaces: tuple[float, frozenset[IPAddress]] | None = None
        host.add_connection_hook(self._on_connection)

    # -- server ---------------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer ``/libp2p/autonat/1.0.0`` requests on the host."""
        self.host.set_stream_handler(PROTOCOL_ID, self._handle)

    def stop_serving(self) -> None:
        self.host.set_stream_handler(PROTOCOL_ID, None)

    async def _handle(self, stream: P2PStream) -> None:
        peer = stream.remote_peer
        with trio.move_on_after(self.config.request_timeout) as scope:
            try:
                body = await stream.receive_frame(MAX_MESSAGE_SIZE)
            except (MessageTooLargeError, ProtocolViolationError) as e:
                # answered, then closed by the host (the rest of the bytes are dropped)
                await self._respond(stream, self._bad(peer, "framing", f"unreadable request: {e}"))
                return
        if scope.cancelled_caught:
            self._log.info(
                ("slow", peer),
                "autonat: dropping request from %s: nothing within %.1fs",
                peer.short(),
                self.config.request_timeout,
            )
            stream.reset()
            return
        await self._respond(stream, await self._answer(stream, body))

    async def _respond(self, stream: P2PStream, response: DialResponse) -> None:
        with trio.move_on_after(self.config.request_timeout):
            await stream.send_all(frame(encode_dial_response(response)))

    def _bad(self, peer: PeerID, kind: str, why: str) -> DialResponse:
        self._log.info(
            ("bad-request", kind), "autonat: dropping request from %s: %s", peer.short(), why
        )
        return DialResponse(ResponseStatus.E_BAD_REQUEST, why[:MAX_STATUS_TEXT])

    def _refused(self, peer: PeerID, kind: str, why: str) -> DialResponse:
        self._log.info(
            ("refused", kind), "autonat: refusing request from %s: %s", peer.short(), why
        )
        return DialResponse(ResponseStatus.E_DIAL_REFUSED, why[:MAX_STATUS_TEXT])

    def _arrived_relayed(self, stream: P2PStream) -> bool:
        conn = self.host.connection_of(stream)
        return conn is not None and conn.relayed

    async def _answer(self, stream: P2PStream, body: bytes) -> DialResponse:
        peer = stream.remote_peer
        observed = ip_of(stream.remote_addr)
        source = _source_key(observed) if observed is not None else None
        why = self._limiter.refuse(peer, source, time.monotonic())
        if why is not None:
            return self._refused(peer, "rate", why)
        try:
            request = decode_message(body)
        except AutoNATMessageError as e:
            return self._bad(peer, "malformed", str(e))
        if not isinstance(request, DialRequest):
            return self._bad(peer, "type", "expected a DIAL message, got DIAL_RESPONSE")
        if request.peer_id is not None and request.peer_id != peer:
            return self._bad(peer, "peer", "the request names another peer")
        if observed is None or self._arrived_relayed(stream):
            return self._refused(
                peer,
                "unverifiable",
                f"cannot see the requester's IP (connection {stream.remote_addr})",
            )
        targets = dial_targets(request.addrs, observed, peer, self.config.max_dial_addrs)
        if not targets:
            return DialResponse(ResponseStatus.E_DIAL_ERROR, "no dialable TCP address")
        if self._active_dials >= self.config.max_concurrent_dials:
            return self._refused(peer, "busy", "too many dial-backs in progress")
        self._active_dials += 1
        try:
            addr = await self.host.dial_new_connection(
                peer, targets, timeout=self.config.dial_timeout, identity=self._dialback_identity
            )
        except ResourceLimitError as e:  # our connection table is full of busy connections
            return self._refused(peer, "limit", str(e))
        except P2PError as e:  # refused, unreachable, timed out, someone else answered...
            logger.debug("autonat: dial-back to %s failed: %s", peer.short(), e)
            return DialResponse(ResponseStatus.E_DIAL_ERROR, str(e)[:MAX_STATUS_TEXT])
        except Exception:  # a bug reachable from a request must not take the host down
            logger.exception("autonat: dial-back to %s failed unexpectedly", peer.short())
            return DialResponse(ResponseStatus.E_INTERNAL_ERROR, "internal error")
        finally:
            self._active_dials -= 1
        logger.debug("autonat: dialed %s back at %s", peer.short(), addr)
        return DialResponse(ResponseStatus.OK, "", addr)

    # -- client ---------------------------------------------------------------------------------
    def add_observer(self, on_change: Callable[[Reachability], None]) -> None:
        """Call ``on_change(reachability)`` after the first round (whatever it found) and
        whenever the status changes."""
        self._observers.append(on_change)

    def offered_addrs(self) -> list[Multiaddr]:
        """What we ask servers to dial: our TCP listen addresses, then the candidates from
        observed addresses (servers use only the ports: they dial the IP they see)."""
        listen = [a for a in self.host.listen_addrs if tcp_port(a) is not None]
        out: list[Multiaddr] = []
        for addr in listen + self.host.observed_addrs.candidates(listen):
            addr = addr.without_peer_id()
            if addr not in out:
                out.append(addr)
        return out[: self.config.max_offered_addrs]

    def _servers(self) -> list[PeerID]:
        """Connected peers with a direct connection, in random order."""
        peers = []
        for peer in self.host.connected_peers():
            conn = self.host.best_connection(peer)
            if conn is not None and not getattr(conn, "relayed", False):
                peers.append(peer)
        random.shuffle(peers)
        return peers

    # -- evidence of our own ------------------------------------------------------------------
    def _on_connection(self, conn: Connection) -> None:
        """Host hook: note every direct connection that reached us (a genuine dial-back is
        one, so is any peer that could connect); wake :meth:`run` for one from another IP."""
        if conn.outbound or conn.relayed or conn.hole_punched:
            return
        ip = ip_of(conn.remote_addr)
        if ip is None:
            return
        self.arrivals.record(ip, conn)
        if not ip.is_loopback and ip not in self._our_ips():
            self._arrived.set()

    def _our_ips(self) -> frozenset[IPAddress]:
        """The IPs of our interfaces (cached, refreshed by :meth:`_refresh_interfaces`) and
        of our TCP listen addresses."""
        ips = set(self._interfaces[1]) if self._interfaces is not None else set()
        for addr in self.host.listen_addrs:
            ip = ip_of(addr)
            if ip is not None:
                ips.add(ip)
        return frozenset(ips)

    async def _refresh_interfaces(self) -> None:
        """Look up our interface addresses (at most once a minute, off the event loop)."""
        now = time.monotonic()
        if self._interfaces is not None and now - self._interfaces[0] < 60.0:
            return

        def lookup() -> frozenset[IPAddress]:
            found: set[IPAddress] = set()
            for family in (socket.AF_INET, socket.AF_INET6):
                try:
                    texts = local_ip_addresses(family)
                except OSError:
                    continue
                for text in texts:
                    try:
                        found.add(ipaddress.ip_address(text.split("%")[0]))
                    except ValueError:
                        continue
            return frozenset(found)

        self._interfaces = (now, await trio.to_thread.run_sync(lookup))

    def evidence(self, answers: Sequence[_Answer] = (), since: float | None = None) -> Evidence:
        """What a verdict rests on: ``answers`` (a round's), the connections that arrived
        since ``since`` (the round's start), and what this peer sees of itself now."""
        ports = {tcp_port(a) for a in self.offered_addrs()}
        ok = [a for a in answers if a.status == ResponseStatus.OK]
        failed = [a for a in answers if a.status == ResponseStatus.E_DIAL_ERROR]
        ours = self._our_ips()
        listen_ips = [ip_of(a) for a in self.host.listen_addrs if tcp_port(a) is not None]
        seen = [ip_of(a) for a in self.host.observed_addrs.observed()]
        return Evidence(
            dialed_back=len(ok),
            could_not=len(failed),
            no_verdict=len(answers) - len(ok) - len(failed),
            # a reported address on a port we never offered is a server's invention
            reached_at=tuple(
                a.addr for a in ok if a.addr is not None and tcp_port(a.addr) in ports
            ),
            arrivals=self.arrivals.since(since) if since is not None else 0,
            global_addrs=tuple(
                dict.fromkeys(ip for ip in listen_ips if ip is not None and globally_routable(ip))
            ),
            connected_from=self.arrivals.sources(ours),
            seen_at=tuple(dict.fromkeys(ip for ip in seen if ip is not None and ip not in ours)),
        )

    # -- asking -------------------------------------------------------------------------------
    async def _ask(self, server: PeerID, request: bytes) -> _Answer:
        timeout = self.config.response_timeout
        try:
            with trio.fail_after(timeout):
                stream = await self.host.new_stream(server, PROTOCOL_ID, timeout, lazy=True)
                try:
                    await stream.send_all(frame(request))
                    await stream.send_eof()
                    body = await stream.receive_frame(MAX_MESSAGE_SIZE)
                except BaseException:
                    stream.reset()
                    raise
                await stream.aclose()
            response = decode_message(body)
        except trio.TooSlowError:
            return _Answer(server, None, error=f"no answer within {timeout:.0f}s")
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            return _Answer(server, None, error=str(e) or type(e).__name__)
        if not isinstance(response, DialResponse):
            return _Answer(server, None, error="answered with a DIAL message")
        return _Answer(server, response.status, response.text, response.addr)

    async def probe(self, servers: Sequence[PeerID] | None = None) -> ProbeResult:
        """Ask up to ``max_servers`` servers (default: connected peers) at once and decide.

        Sets ``host.reachability`` when the round is decisive (or nothing was decided yet;
        see ``reachability.settle``)."""
        cfg = self.config
        addrs = self.offered_addrs()
        if not addrs:
            result = ProbeResult(
                Reachability(
                    ReachabilityStatus.PRIVATE,
                    "not listening on any TCP address: nobody can connect to this peer",
                    decided_at=time.time(),
                )
            )
            self._publish(result)
            return result
        await self._refresh_interfaces()
        chosen = list(servers) if servers is not None else self._servers()
        chosen = [s for s in dict.fromkeys(chosen) if s != self.host.peer_id][: cfg.max_servers]
        request = encode_dial(self.host.peer_id, addrs)
        answers: list[_Answer] = []
        started = self.arrivals.now()

        async def ask(server: PeerID) -> None:
            answers.append(await self._ask(server, request))

        async with trio.open_nursery() as nursery:
            for server in chosen:
                nursery.start_soon(ask, server)
        for a in answers:
            logger.debug(
                "autonat: %s answered %s %s",
                a.server.short(),
                status_name(a.status) if a.status is not None else "nothing",
                a.text or a.error,
            )
        evidence = self.evidence(answers, started)
        result = ProbeResult(
            decide(evidence, cfg.threshold, time.time()), answers, evidence, started
        )
        self._publish(result)
        return result

    def reassess(self) -> None:
        """Decide again on the last round's answers and what we see of ourselves now (a
        connection arrived): no server is asked. Only a change is published."""
        last = self.last_round
        answers = last.answers if last is not None else []
        since = last.started if last is not None else None
        evidence = self.evidence(answers, since)
        new = decide(evidence, self.config.threshold, time.time())
        if new.status is not ReachabilityStatus.UNKNOWN and new.status is not (
            self.host.reachability.status
        ):
            self._publish(ProbeResult(new, list(answers), evidence, since or 0.0))

    def _publish(self, result: ProbeResult) -> None:
        first = self.last_round is None
        self.last_round = result
        old = self.host.reachability
        new = settle(old, result.reachability, result.evidence)
        if new is old:
            logger.debug("autonat: keeping %s (this round: %s)", old, result.reachability.reason)
            return
        self.host.reachability = new
        if new.status is old.status and not first:
            return
        logger.info("reachability: %s", new)
        self.changed.set()
        self.changed = trio.Event()
        for callback in list(self._observers):
            try:
                callback(new)
            except Exception:
                logger.exception("reachability observer failed")

    async def _wait_for(self, seconds: float) -> None:
        """Sleep ``seconds``; meanwhile, each time a direct connection arrives from another IP
        while we are not known to be public, decide again (see :meth:`reassess`)."""
        deadline = trio.current_time() + seconds
        while True:
            self._arrived = trio.Event()
            with trio.move_on_at(deadline):
                await self._arrived.wait()
            if not self._arrived.is_set():
                return
            if not self.host.reachability.is_public:
                await self._refresh_interfaces()
                self.reassess()

    async def run(self, first_delay: float = 2.0) -> None:
        """Probe now and then until cancelled (a task in the owner's nursery): soon after
        start (peers connect while a node joins), then backing off from ``first_delay`` to
        ``retry_interval`` while the answer is unknown, every ``recheck_interval`` while it
        is provisional, every ``refresh_interval`` once decided. Between rounds, a direct
        connection from another IP makes it decide again at once (see :meth:`reassess`)."""
        delay = wait = first_delay
        while True:
            await self._wait_for(wait)
            await self.probe()
            reach = self.host.reachability
            if reach.status is ReachabilityStatus.UNKNOWN:
                delay = wait = min(delay * 2, self.config.retry_interval)
            elif reach.provisional:
                wait = self.config.recheck_interval
            else:
                wait = self.config.refresh_interval


__all__ = [
    "PROTOCOL_ID",
    "AutoNAT",
    "AutoNATConfig",
    "AutoNATMessageError",
    "DialRequest",
    "DialResponse",
    "MessageType",
    "ObservedAddrs",
    "ProbeResult",
    "Reachability",
    "ReachabilityStatus",
    "ResponseStatus",
    "decode_message",
    "dial_targets",
    "encode_dial",
    "encode_dial_response",
]
