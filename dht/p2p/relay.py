"""Circuit relay v2: reach a peer that cannot accept connections through a public peer.

A volunteer behind a NAT or firewall can dial out but nobody can dial it. It *reserves* a
slot on a publicly reachable peer running the relay service (``RelayClient.reserve``; kept
fresh by ``keep_reservation``) and advertises ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<me>``.
A peer that dials such an address opens a ``hop`` stream to the relay and asks it to CONNECT;
the relay opens a ``stop`` stream to the target over the target's own (outbound) connection
and, once the target accepts, splices the two streams byte for byte. The two ends then run
the usual Noise + yamux upgrade over the spliced streams (the dialer is the Noise initiator),
so the relayed connection is an ordinary connection of the Host: RPC, DHT and averaging run
over it unchanged, end-to-end encrypted and authenticated. The relay sees ciphertext only,
and could at most cut or delay it; it cannot impersonate either end (Noise proves PeerIDs).

Relaying costs the relay's bandwidth, so everything is bounded (``RelayLimits``): number of
reservations (one per peer, a cap per source address and in total), circuits (per peer and
in total), and every circuit's bytes (per direction) and lifetime, as the spec's ``Limit``.
Relayed connections are therefore for control traffic (DHT, matchmaking, small RPCs); a
connection knows it is relayed (``conn.relayed``, ``conn.relay_limit``) and the Host prefers a
direct connection to the same peer whenever it has one.

Spec: libp2p/specs relay/circuit-v2.md. Reservation vouchers (optional, advisory in the spec)
are neither issued nor checked.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import trio

from .._logging import RateLimitedLogger
from .connection import Connection, is_loopback, source_key
from .errors import (
    DialError,
    MessageTooLargeError,
    P2PError,
    P2PTimeoutError,
    ProtocolViolationError,
    RelayError,
    StreamClosedError,
    error_reason,
)
from .host import Host
from .identify import observed_multiaddr
from .identity import PeerID
from .multiaddr import Multiaddr
from .relay_messages import (
    HOP_PROTOCOL,
    MAX_MESSAGE_SIZE,
    STOP_PROTOCOL,
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayMessageError,
    ReservationInfo,
    Status,
    StopMessage,
    StopType,
    decode_hop,
    decode_stop,
    encode_hop,
    encode_stop,
    status_name,
)
from .stream import P2PStream

logger = logging.getLogger(__name__)

SPLICE_CHUNK = 64 * 1024
MAX_ADVERTISED_PER_RELAY = 4  # circuit addresses we announce per relay (the DHT takes 16 in all)
_STREAM_ERRORS = (P2PError, trio.BrokenResourceError, trio.ClosedResourceError)


# -- addresses ----------------------------------------------------------------------------------


def circuit_addr(relay_addr: Multiaddr, relay: PeerID, target: PeerID) -> Multiaddr:
    """``<relay_addr>/p2p/<relay>/p2p-circuit/p2p/<target>``: ``target`` reached via ``relay``."""
    base = relay_addr.with_peer_id(relay)
    return Multiaddr(f"{base}/p2p-circuit/p2p/{target.to_base58()}")


def split_circuit(maddr: Multiaddr) -> tuple[PeerID, Multiaddr | None, PeerID | None]:
    """``(relay, relay transport address or None, target or None)`` of a circuit address.

    Raises DialError for shapes this implementation does not dial: no relay PeerID before
    ``/p2p-circuit``, anything but ``/p2p/<target>`` after it, or a circuit over a circuit.
    """
    parts = maddr.components
    names = [name for name, _ in parts]
    if names.count("p2p-circuit") != 1:
        raise DialError(f"{maddr}: expected exactly one /p2p-circuit (no nested circuits)")
    cut = names.index("p2p-circuit")
    before, after = parts[:cut], parts[cut + 1 :]
    if not before or before[-1][0] != "p2p":
        raise DialError(f"{maddr}: /p2p-circuit must follow the relay's /p2p/<PeerID>")
    relay = before[-1][1]
    assert isinstance(relay, PeerID)
    if after and (len(after) != 1 or after[0][0] != "p2p"):
        raise DialError(f"{maddr}: only /p2p/<target PeerID> may follow /p2p-circuit")
    target = after[0][1] if after else None
    assert target is None or isinstance(target, PeerID)
    relay_addr = Multiaddr._from_components(before[:-1]) if len(before) > 1 else None
    return relay, relay_addr, target


def _circuit_remote_addr(relay_remote: str, relay: PeerID) -> str:
    """How a relayed connection names its remote (logs, identify's observed address)."""
    base = observed_multiaddr(relay_remote)
    prefix = str(base.without_peer_id()) if base is not None and base.peer_id is None else ""
    return f"{prefix}/p2p/{relay.to_base58()}/p2p-circuit"


# -- the circuit as a raw transport -------------------------------------------------------------


class _CircuitStream(trio.abc.HalfCloseableStream):
    """A relayed circuit as the raw byte stream under a Noise + yamux upgrade.

    Exposes only the plain stream interface: the P2PStream's message helpers and its yamux
    fast paths must not be taken for a raw transport's own (other signatures), and a relayed
    connection cannot pace the relay connection underneath it.
    """

    def __init__(self, stream: P2PStream) -> None:
        self.stream = stream

    # A reset circuit (the relay cut it, its connection closed) is what a reset socket is to
    # the layers above: trio.BrokenResourceError, a lost connection rather than a bug.
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except StreamClosedError as e:
            raise trio.BrokenResourceError(f"relayed circuit closed: {e}") from e

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            return await self.stream.receive_some(max_bytes)
        except StreamClosedError as e:
            raise trio.BrokenResourceError(f"relayed circuit closed: {e}") from e

    async def send_eof(self) -> None:
        try:
            await self.stream.send_eof()
        except StreamClosedError as e:
            raise trio.BrokenResourceError(f"relayed circuit closed: {e}") from e

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _upgrade_circuit(
    host: Host,
    stream: P2PStream,
    expected: PeerID,
    *,
    outbound: bool,
    name: str,
    limit: Limit | None,
) -> Connection:
    """Noise + yamux over a spliced stream; the connection is marked relayed (not registered)."""
    try:
        with trio.fail_after(host.limits.handshake_timeout):
            conn = await host.upgrade(
                _CircuitStream(stream), expected, outbound=outbound, name=name
            )
    except trio.TooSlowError:
        stream.reset()
        raise P2PTimeoutError(
            f"relayed handshake with {expected.short()} did not finish within "
            f"{host.limits.handshake_timeout:.1f}s"
        ) from None
    except BaseException:
        stream.reset()
        raise
    conn.relayed = True
    conn.relay_limit = limit
    return conn


async def _send_quietly(stream: P2PStream, frame: bytes, timeout: float) -> None:  # noqa: ASYNC109
    """Best effort: a status for a peer that may already be gone."""
    with trio.move_on_after(timeout):
        try:
            await stream.send_all(frame)
        except _STREAM_ERRORS:
            pass


async def _receive_frame(stream: P2PStream, timeout: float, what: str) -> bytes:  # noqa: ASYNC109
    """One length-prefixed relay message (at most MAX_MESSAGE_SIZE bytes) within ``timeout``."""
    with trio.move_on_after(timeout):
        return await stream.receive_frame(MAX_MESSAGE_SIZE)
    raise P2PTimeoutError(f"no {what} within {timeout:.1f}s")


# -- dialing a /p2p-circuit address -------------------------------------------------------------


async def dial_circuit(host: Host, expected: PeerID | None, target: Multiaddr) -> Connection:
    """Connect to ``expected`` through the relay named in ``target`` (the Host's dialer for
    ``/p2p-circuit`` addresses, see :func:`dial_circuits`).

    Opens a hop stream to the relay (dialing it if needed), sends CONNECT and, on OK, runs the
    usual outbound upgrade over the stream. Raises RelayError with the relay's status when it
    refuses, DialError for an unusable address, other P2PErrors as a direct dial would.
    """
    relay, relay_addr, named = split_circuit(target)
    expected = expected or named
    if expected is None:
        raise DialError(f"{target}: a circuit address must name its target (/p2p/<PeerID>)")
    if named is not None and named != expected:
        raise DialError(f"{target} names {named}, not {expected}")
    if relay in (expected, host.peer_id):
        raise DialError(f"{target}: the relay cannot be the target or ourselves")
    if relay_addr is not None:
        host.peerstore.add_addrs(relay, [relay_addr])
    timeout = host.limits.handshake_timeout
    stream = await host.open_stream(relay, HOP_PROTOCOL, timeout, lazy=True)
    try:
        with trio.fail_after(timeout):
            await stream.send_all(encode_hop(HopMessage(HopType.CONNECT, peer=PeerInfo(expected))))
            reply = decode_hop(await stream.receive_frame(MAX_MESSAGE_SIZE))
    except trio.TooSlowError:
        stream.reset()
        raise P2PTimeoutError(
            f"relay {relay.short()} did not answer CONNECT within {timeout}s"
        ) from None
    except BaseException:
        stream.reset()
        raise
    if reply.type != HopType.STATUS:
        stream.reset()
        raise ProtocolViolationError(
            f"relay {relay.short()} answered CONNECT with type {reply.type}"
        )
    if reply.status != Status.OK:
        stream.reset()
        raise RelayError(
            f"relay {relay.short()} refused a circuit to {expected.short()}: "
            f"{status_name(reply.status)}",
            status=reply.status,
        )
    name = str(target.without_peer_id())
    conn = await _upgrade_circuit(
        host, stream, expected, outbound=True, name=name, limit=reply.limit
    )
    logger.debug(
        "relayed connection to %s via %s (limit %s)", expected.short(), relay.short(), reply.limit
    )
    return conn


# -- relay service (hop side) -------------------------------------------------------------------


# Host.protect tags: the connection a reservation lives on is never closed to make room
RESERVATION_TAG = "relay: holds a reservation here"
RELAY_TAG = "relay: our reservation on it"


@dataclass
class RelayLimits:
    """What a relay grants. The defaults are the spec's (2 min and 128 KiB per circuit): enough
    to coordinate, too little to make a public volunteer a free bulk tunnel."""

    reservation_ttl: float = 3600.0  # seconds a reservation lasts unless refreshed
    max_reservations: int = 128
    # per IPv4 address / IPv6 /64: PeerIDs are free, so one machine must not take every slot
    max_reservations_per_source: int = 8
    circuit_duration: int = 120  # seconds a relayed connection may live; 0 = unlimited
    circuit_data: int = 128 * 1024  # bytes per direction per relayed connection; 0 = unlimited
    max_circuits: int = 64
    max_circuits_per_peer: int = 4  # as initiator or target
    request_rate: float = 1.0  # hop requests per second and peer (token bucket) ...
    request_burst: int = 8  # ... with this many at once
    max_tracked_peers: int = 4096  # rate-limit state kept (least recently seen dropped)
    message_timeout: float = 10.0  # a hop request must arrive within this
    connect_timeout: float = 10.0  # the target must accept a circuit within this
    max_announced_addrs: int = 8
    log_interval: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "max_reservations",
            "max_reservations_per_source",
            "max_circuits",
            "max_circuits_per_peer",
            "request_burst",
            "max_tracked_peers",
            "max_announced_addrs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"RelayLimits.{name} must be at least 1, got {getattr(self, name)}"
                )
        for name in ("circuit_duration", "circuit_data"):
            if getattr(self, name) < 0:
                raise ValueError(f"RelayLimits.{name} must be >= 0 (0 = unlimited)")
        if self.circuit_duration > 0xFFFFFFFF:
            raise ValueError("RelayLimits.circuit_duration must fit the wire's uint32 seconds")
        for name in (
            "reservation_ttl",
            "request_rate",
            "message_timeout",
            "connect_timeout",
            "log_interval",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"RelayLimits.{name} must be positive, got {getattr(self, name)}")

    @property
    def limit(self) -> Limit:
        return Limit(self.circuit_duration, self.circuit_data)


@dataclass
class RelayStats:
    reservations_accepted: int = 0
    reservations_refused: int = 0
    circuits_opened: int = 0
    circuits_refused: int = 0
    circuits_cut_data: int = 0
    circuits_cut_duration: int = 0
    malformed_requests: int = 0
    bytes_forwarded: int = 0


@dataclass(eq=False)
class Circuit:
    """One spliced connection: ``forwarded[0]`` bytes went src -> dst, ``forwarded[1]`` back."""

    src: PeerID
    dst: PeerID
    limit: Limit
    started: float
    forwarded: list[int] = field(default_factory=lambda: [0, 0])
    cut_reason: str | None = None  # why the relay ended it (None: the ends closed it)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def cut(self, reason: str) -> None:
        if self.cut_reason is None:
            self.cut_reason = reason
        self.scope.cancel()


@dataclass
class _Held:
    expires: float  # trio clock
    source: str


class _TokenBucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class RelayService:
    """The hop side: serves reservations and splices circuits for reserved peers.

    Enable it on a publicly reachable Host with ``enable_relay_service(host, limits)``.
    ``tap(circuit, direction, data)``, when set, sees every chunk spliced (diagnostics and
    tests: it is the very view a relay has, Noise ciphertext).
    """

    def __init__(
        self,
        host: Host,
        limits: RelayLimits | None = None,
        announce_addrs: Iterable[Multiaddr | str] | None = None,
    ) -> None:
        self.host = host
        self.limits = limits or RelayLimits()
        self._announce = [Multiaddr(a) for a in announce_addrs] if announce_addrs else None
        self._reservations: dict[PeerID, _Held] = {}
        self._per_source: dict[str, int] = {}
        self.circuits: set[Circuit] = set()
        self._circuits_per_peer: dict[PeerID, int] = {}
        self._buckets: OrderedDict[PeerID, _TokenBucket] = OrderedDict()
        self.stats = RelayStats()
        self.tap: Callable[[Circuit, int, bytes], None] | None = None
        self._log = RateLimitedLogger(logger, self.limits.log_interval, clock=trio.current_time)
        self._enabled = True
        host.set_stream_handler(HOP_PROTOCOL, self._serve_hop)
        host.add_connection_observer(lambda _peer: None, self._on_disconnect)

    def close(self) -> None:
        """Stop serving: new hop streams are refused, reservations dropped, circuits cut."""
        self._enabled = False
        self.host.set_stream_handler(HOP_PROTOCOL, None)
        for circuit in list(self.circuits):
            circuit.cut("relay service stopped")
        for peer in self._reservations:
            self.host.unprotect(peer, RESERVATION_TAG)
        self._reservations.clear()
        self._per_source.clear()

    # -- state ------------------------------------------------------------------------------
    def has_reservation(self, peer: PeerID) -> bool:
        held = self._reservations.get(peer)
        return held is not None and held.expires > trio.current_time()

    @property
    def reservation_count(self) -> int:
        self._purge_expired()
        return len(self._reservations)

    def public_addrs(self) -> list[Multiaddr]:
        """The relay's own addresses handed to reserving peers (with ``/p2p/<relay>``)."""
        if self._announce is not None:
            addrs = self._announce
        else:
            addrs = [a for a in self.host.listen_addrs if not a.is_circuit() and _specific(a)]
        me = self.host.peer_id
        return [a.with_peer_id(me) for a in addrs][: self.limits.max_announced_addrs]

    def _drop_reservation(self, peer: PeerID) -> None:
        held = self._reservations.pop(peer, None)
        if held is None:
            return
        self.host.unprotect(peer, RESERVATION_TAG)
        left = self._per_source.get(held.source, 0) - 1
        if left > 0:
            self._per_source[held.source] = left
        else:
            self._per_source.pop(held.source, None)

    def _purge_expired(self) -> None:
        now = trio.current_time()
        for peer in [p for p, held in self._reservations.items() if held.expires <= now]:
            self._drop_reservation(peer)

    def _on_disconnect(self, peer: PeerID) -> None:
        # the spec: a reservation is valid only while its peer stays connected
        self._drop_reservation(peer)

    def _allow_request(self, peer: PeerID) -> bool:
        limits = self.limits
        now = trio.current_time()
        bucket = self._buckets.pop(peer, None)
        if bucket is None:
            bucket = _TokenBucket(float(limits.request_burst), now)
        else:
            bucket.tokens = min(
                float(limits.request_burst),
                bucket.tokens + (now - bucket.stamp) * limits.request_rate,
            )
            bucket.stamp = now
        self._buckets[peer] = bucket  # most recently seen last
        while len(self._buckets) > limits.max_tracked_peers:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def _arrived_relayed(self, stream: P2PStream) -> bool:
        """Did this hop stream come over a relayed connection? (Chains are refused.)"""
        conn = self.host.connection_of(stream)
        return conn is not None and conn.relayed

    # -- the hop protocol -------------------------------------------------------------------
    async def _refuse(self, stream: P2PStream, status: Status, why: str, *, warn: bool) -> None:
        peer = stream.remote_peer
        if warn:
            self._log.warning(
                ("refused", status),
                "relay: %s from %s (%s): %s",
                status.name,
                peer.short(),
                stream.remote_addr,
                why,
            )
        else:
            logger.debug("relay: %s for %s: %s", status.name, peer.short(), why)
        frame = encode_hop(HopMessage(HopType.STATUS, status=status))
        await _send_quietly(stream, frame, self.limits.message_timeout)

    async def _serve_hop(self, stream: P2PStream) -> None:
        peer = stream.remote_peer
        if not self._enabled:
            await self._refuse(
                stream, Status.PERMISSION_DENIED, "relay service stopped", warn=False
            )
            return
        if not self._allow_request(peer):
            await self._refuse(
                stream,
                Status.RESOURCE_LIMIT_EXCEEDED,
                f"over {self.limits.request_rate}/s hop requests",
                warn=True,
            )
            return
        try:
            body = await _receive_frame(stream, self.limits.message_timeout, "hop request")
            msg = decode_hop(body)
        except (MessageTooLargeError, RelayMessageError, ProtocolViolationError) as e:
            self.stats.malformed_requests += 1
            await self._refuse(stream, Status.MALFORMED_MESSAGE, error_reason(e), warn=True)
            return
        except P2PTimeoutError as e:
            self._log.warning("hop-timeout", "relay: %s: %s", peer.short(), e)
            stream.reset()
            return
        except StreamClosedError:
            return  # the peer went away before asking anything
        if msg.type == HopType.RESERVE:
            await self._reserve(stream)
        elif msg.type == HopType.CONNECT:
            await self._connect(stream, msg)
        elif msg.type == HopType.STATUS:
            self.stats.malformed_requests += 1
            await self._refuse(
                stream, Status.UNEXPECTED_MESSAGE, "STATUS is not a request", warn=True
            )
        else:
            self.stats.malformed_requests += 1
            await self._refuse(
                stream, Status.MALFORMED_MESSAGE, f"unknown hop message type {msg.type}", warn=True
            )

    async def _reserve(self, stream: P2PStream) -> None:
        peer, limits = stream.remote_peer, self.limits
        if self._arrived_relayed(stream):
            self.stats.reservations_refused += 1
            await self._refuse(
                stream,
                Status.PERMISSION_DENIED,
                "reservation over a relayed connection",
                warn=False,
            )
            return
        self._purge_expired()
        existing = self._reservations.get(peer)
        source = existing.source if existing is not None else source_key(stream.remote_addr)
        if existing is None:  # a refresh never counts against the caps
            if len(self._reservations) >= limits.max_reservations:
                self.stats.reservations_refused += 1
                await self._refuse(
                    stream,
                    Status.RESERVATION_REFUSED,
                    f"all {limits.max_reservations} reservation slots taken",
                    warn=True,
                )
                return
            if self._per_source.get(source, 0) >= limits.max_reservations_per_source:
                self.stats.reservations_refused += 1
                await self._refuse(
                    stream,
                    Status.RESERVATION_REFUSED,
                    f"{limits.max_reservations_per_source} reservations from {source} already",
                    warn=True,
                )
                return
            self._per_source[source] = self._per_source.get(source, 0) + 1
        self._reservations[peer] = _Held(trio.current_time() + limits.reservation_ttl, source)
        self.host.protect(peer, RESERVATION_TAG)  # making room must not void the slot
        if not self.host.is_connected(peer):  # it left while we decided: nothing to hold
            self._drop_reservation(peer)
            return
        self.stats.reservations_accepted += 1
        expire = int(time.time() + limits.reservation_ttl)
        reply = HopMessage(
            HopType.STATUS,
            status=Status.OK,
            reservation=ReservationInfo(expire=expire, addrs=self.public_addrs()),
            limit=limits.limit,
        )
        logger.info(
            "relay: reservation for %s (%s) until %d", peer.short(), stream.remote_addr, expire
        )
        await _send_quietly(stream, encode_hop(reply), limits.message_timeout)

    def _target_reachable(self, dst: PeerID) -> bool:
        """A live reservation and a direct connection to ``dst`` (no active relaying)."""
        if not self.has_reservation(dst):
            return False
        return any(not c.relayed for c in self.host.connections(dst))

    async def _connect(self, stream: P2PStream, msg: HopMessage) -> None:
        src, limits = stream.remote_peer, self.limits
        if msg.peer is None:
            self.stats.malformed_requests += 1
            await self._refuse(
                stream, Status.MALFORMED_MESSAGE, "CONNECT without a peer", warn=True
            )
            return
        dst = msg.peer.id
        refusal: tuple[Status, str] | None = None
        if self._arrived_relayed(stream):
            refusal = (Status.PERMISSION_DENIED, "CONNECT over a relayed connection")
        elif dst == src or dst == self.host.peer_id:
            refusal = (Status.PERMISSION_DENIED, f"CONNECT to {dst.short()} (itself or the relay)")
        elif not self._target_reachable(dst):
            refusal = (Status.NO_RESERVATION, f"{dst.short()} holds no reservation")
        elif len(self.circuits) >= limits.max_circuits:
            refusal = (Status.RESOURCE_LIMIT_EXCEEDED, f"{limits.max_circuits} circuits active")
        elif (
            max(self._circuits_per_peer.get(p, 0) for p in (src, dst))
            >= limits.max_circuits_per_peer
        ):
            refusal = (
                Status.RESOURCE_LIMIT_EXCEEDED,
                f"{limits.max_circuits_per_peer} circuits per peer active",
            )
        if refusal is not None:
            self.stats.circuits_refused += 1
            await self._refuse(stream, refusal[0], refusal[1], warn=False)
            return
        circuit = Circuit(src, dst, limits.limit, trio.current_time())
        self.circuits.add(circuit)
        for p in (src, dst):
            self._circuits_per_peer[p] = self._circuits_per_peer.get(p, 0) + 1
        try:
            with circuit.scope:
                stop = await self._open_stop(stream, circuit)
                if stop is not None:
                    await self._splice(circuit, stream, stop)
        finally:
            self.circuits.discard(circuit)
            for p in (src, dst):
                left = self._circuits_per_peer.get(p, 0) - 1
                if left > 0:
                    self._circuits_per_peer[p] = left
                else:
                    self._circuits_per_peer.pop(p, None)

    async def _open_stop(self, stream: P2PStream, circuit: Circuit) -> P2PStream | None:
        """Ask the target to accept; answer the initiator. The stop stream on success."""
        limits = self.limits
        src, dst = circuit.src, circuit.dst
        stop: P2PStream | None = None
        why = ""
        try:
            with trio.fail_after(limits.connect_timeout):
                stop = await self.host.open_stream(
                    dst, STOP_PROTOCOL, limits.connect_timeout, lazy=True
                )
                request = StopMessage(StopType.CONNECT, peer=PeerInfo(src), limit=circuit.limit)
                await stop.send_all(encode_stop(request))
                answer = decode_stop(await stop.receive_frame(MAX_MESSAGE_SIZE))
            if answer.type != StopType.STATUS:
                why = f"target answered with stop message type {answer.type}"
            elif answer.status != Status.OK:
                why = f"target refused: {status_name(answer.status)}"
        except trio.TooSlowError:
            why = f"target did not answer within {limits.connect_timeout:.1f}s"
        except (*_STREAM_ERRORS, OSError) as e:
            why = error_reason(e)
        except BaseException:  # cancelled (relay stopping): leave no half-open stop stream
            if stop is not None:
                stop.reset()
            raise
        if why:
            if stop is not None:
                stop.reset()
            self.stats.circuits_refused += 1
            await self._refuse(
                stream, Status.CONNECTION_FAILED, f"to {dst.short()}: {why}", warn=False
            )
            return None
        assert stop is not None
        try:
            with trio.fail_after(limits.message_timeout):
                await stream.send_all(
                    encode_hop(HopMessage(HopType.STATUS, status=Status.OK, limit=circuit.limit))
                )
        except (*_STREAM_ERRORS, trio.TooSlowError) as e:
            logger.debug("relay: initiator %s gone before the circuit opened: %s", src.short(), e)
            stop.reset()
            stream.reset()
            return None
        return stop

    async def _splice(self, circuit: Circuit, src: P2PStream, dst: P2PStream) -> None:
        """Copy bytes both ways until both ends close, a limit is hit or a side breaks."""
        self.stats.circuits_opened += 1
        logger.debug("relay: circuit %s -> %s open", circuit.src.short(), circuit.dst.short())
        if circuit.limit.duration:
            circuit.scope.deadline = circuit.started + circuit.limit.duration
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pipe, circuit, src, dst, 0)
                nursery.start_soon(self._pipe, circuit, dst, src, 1)
        finally:
            if circuit.scope.cancel_called and circuit.cut_reason is None:
                if trio.current_time() >= circuit.scope.deadline:
                    circuit.cut_reason = f"duration limit of {circuit.limit.duration}s"
                    self.stats.circuits_cut_duration += 1
                else:
                    circuit.cut_reason = "relay closing"
            if circuit.cut_reason is not None:
                src.reset()
                dst.reset()
                logger.info(
                    "relay: circuit %s -> %s cut after %d/%d bytes: %s",
                    circuit.src.short(),
                    circuit.dst.short(),
                    circuit.forwarded[0],
                    circuit.forwarded[1],
                    circuit.cut_reason,
                )
            else:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await src.aclose()
                    await dst.aclose()

    async def _pipe(self, circuit: Circuit, source: P2PStream, sink: P2PStream, way: int) -> None:
        budget = circuit.limit.data
        while True:
            try:
                data = await source.receive_some(SPLICE_CHUNK)
            except _STREAM_ERRORS as e:
                circuit.cut(f"{'initiator' if way == 0 else 'target'} side broke: {error_reason(e)}")
                return
            if not data:
                try:
                    await sink.send_eof()
                except _STREAM_ERRORS as e:
                    circuit.cut(f"could not pass on EOF: {error_reason(e)}")
                return
            over = False
            if budget:
                room = budget - circuit.forwarded[way]
                if len(data) > room:
                    data, over = data[:room], True
            if data:
                if self.tap is not None:
                    self.tap(circuit, way, bytes(data))
                circuit.forwarded[way] += len(data)
                self.stats.bytes_forwarded += len(data)
                try:
                    await sink.send_all(data)
                except _STREAM_ERRORS as e:
                    circuit.cut(f"{'target' if way == 0 else 'initiator'} side broke: {error_reason(e)}")
                    return
            if over:
                self.stats.circuits_cut_data += 1
                circuit.cut(f"data limit of {budget} bytes")
                return


def _specific(maddr: Multiaddr) -> bool:
    """Not a wildcard listen address (nobody can dial 0.0.0.0)."""
    if not maddr.is_tcp():
        return True
    host = maddr.tcp_endpoint()[0]
    return host not in ("0.0.0.0", "::")


def enable_relay_service(
    host: Host,
    limits: RelayLimits | None = None,
    announce_addrs: Iterable[Multiaddr | str] | None = None,
) -> RelayService:
    """Serve circuit relay v2 on a publicly reachable ``host`` (opt-in: it spends bandwidth).

    ``announce_addrs``: the addresses reserving peers are told to advertise (default: the
    host's specific listen addresses)."""
    return RelayService(host, limits, announce_addrs)


# -- relay client (reserving side, stop side) ---------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """A slot on ``relay`` until ``expire`` (UNIX seconds) while we stay connected to it."""

    relay: PeerID
    expire: float
    relay_addrs: tuple[Multiaddr, ...]  # the relay's, each ending in /p2p/<relay>
    circuit_addrs: tuple[Multiaddr, ...]  # ours through this relay, to advertise
    limit: Limit | None  # per relayed connection; None = the relay set none
    voucher: bytes | None = None

    def seconds_left(self) -> float:
        return self.expire - time.time()


class RelayClient:
    """Reservations on relays for one Host, and the stop handler that accepts the relayed
    connections those relays bring in (only from relays we reserved with)."""

    MAX_RELAYS = 64  # relays we accept stop streams from (bounded: reservations are explicit)

    def __init__(
        self,
        host: Host,
        *,
        max_inbound_circuits: int = 32,
        max_refresh_interval: float = 900.0,
        message_timeout: float = 10.0,
    ) -> None:
        if max_inbound_circuits < 1:
            raise ValueError(f"max_inbound_circuits must be at least 1, got {max_inbound_circuits}")
        self.host = host
        self.max_inbound_circuits = max_inbound_circuits
        self.max_refresh_interval = max_refresh_interval
        self.message_timeout = message_timeout
        self.reservations: dict[PeerID, Reservation] = {}
        self._relays: OrderedDict[PeerID, None] = OrderedDict()  # stop streams accepted from
        self._lost: dict[PeerID, trio.Event] = {}
        self._advertised: dict[PeerID, tuple[Multiaddr, ...]] = {}
        self.inbound_circuits = 0
        self._observers: list[Callable[[], None]] = []
        self._log = RateLimitedLogger(logger, host.limits.log_interval, clock=trio.current_time)
        host.set_stream_handler(STOP_PROTOCOL, self._serve_stop)
        host.add_connection_observer(lambda _peer: None, self._on_disconnect)

    # -- reservations -----------------------------------------------------------------------
    async def reserve(
        self,
        relay: PeerID,
        addrs: Sequence[Multiaddr | str] = (),
        timeout: float = 10.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> Reservation:
        """Reserve (or refresh) a slot on ``relay`` (dialed at ``addrs`` if not connected).

        Raises RelayError with the relay's status if it refuses, other P2PErrors if it cannot
        be reached or answers nonsense. Does not advertise anything (``keep_reservation`` does).
        """
        host = self.host
        if relay == host.peer_id:
            raise DialError("cannot reserve a relay slot on ourselves")
        if addrs:
            host.peerstore.add_addrs(relay, [Multiaddr(a) for a in addrs])
        # trusted before asking: its stop stream may overtake our reading of its answer
        trusted_before = relay in self._relays
        self._trust(relay)
        try:
            with trio.move_on_after(timeout):
                stream = await host.open_stream(relay, HOP_PROTOCOL, timeout, lazy=True)
                try:
                    await stream.send_all(encode_hop(HopMessage(HopType.RESERVE)))
                    reply = decode_hop(await stream.receive_frame(MAX_MESSAGE_SIZE))
                except BaseException:
                    stream.reset()
                    raise
                await stream.aclose()
                return self._accept_reservation(relay, reply)
            raise P2PTimeoutError(f"reservation on {relay.short()} timed out after {timeout}s")
        except BaseException:
            if not trusted_before:
                self._relays.pop(relay, None)
            raise

    def _accept_reservation(self, relay: PeerID, reply: HopMessage) -> Reservation:
        if reply.type != HopType.STATUS:
            raise ProtocolViolationError(
                f"relay {relay.short()} answered RESERVE with type {reply.type}"
            )
        if reply.status != Status.OK:
            raise RelayError(
                f"relay {relay.short()} refused the reservation: {status_name(reply.status)}",
                status=reply.status,
            )
        info = reply.reservation
        if info is None or info.expire == 0:
            raise ProtocolViolationError(f"relay {relay.short()} accepted without a reservation")
        relay_addrs: list[Multiaddr] = []
        for addr in info.addrs:
            if addr.is_circuit() or addr.peer_id not in (None, relay):
                continue  # nested circuits / another peer's address: not ours to advertise
            base = addr.without_peer_id() if addr.peer_id is not None else addr
            if base.is_tcp() or base.is_memory():
                relay_addrs.append(base.with_peer_id(relay))
        if not relay_addrs:  # the relay told us nothing usable: the address we reached it at
            relay_addrs = [a.with_peer_id(relay) for a in self.host.peerstore.get_addrs(relay)]
        conn = self.host.best_connection(relay)
        if conn is not None and not is_loopback(conn.remote_addr):
            # as identify does: loopback addresses mean something only on the same machine
            relay_addrs = [a for a in relay_addrs if not is_loopback(str(a))]
        relay_addrs = relay_addrs[:MAX_ADVERTISED_PER_RELAY]
        me = self.host.peer_id
        rsvp = Reservation(
            relay=relay,
            expire=float(info.expire),
            relay_addrs=tuple(relay_addrs),
            circuit_addrs=tuple(circuit_addr(a.without_peer_id(), relay, me) for a in relay_addrs),
            limit=reply.limit,
            voucher=info.voucher,
        )
        if rsvp.seconds_left() <= 0:
            raise ProtocolViolationError(f"relay {relay.short()} granted an expired reservation")
        self.reservations[relay] = rsvp
        self.host.protect(relay, RELAY_TAG)
        logger.info(
            "reserved a relay slot on %s for %.0fs (limit %s)",
            relay.short(),
            rsvp.seconds_left(),
            rsvp.limit,
        )
        return rsvp

    async def keep_reservation(
        self,
        relay: PeerID,
        addrs: Sequence[Multiaddr | str] = (),
        *,
        task_status: trio.TaskStatus[Reservation] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Hold a reservation on ``relay`` and advertise our circuit addresses through it.

        Run it with ``await nursery.start(client.keep_reservation, relay, addrs)``: that
        returns the first Reservation, or raises if it cannot be made. Afterwards it refreshes
        well before expiry, re-reserves at once when the connection to the relay drops, and
        retries with backoff (withdrawing the addresses while it holds no slot). Cancelling
        the task withdraws the addresses.
        """
        rsvp = await self.reserve(relay, addrs)
        self._advertise(rsvp)
        task_status.started(rsvp)
        backoff = 1.0
        try:
            while True:
                lost = self._lost.setdefault(relay, trio.Event())
                if self.host.is_connected(relay) and relay in self.reservations:
                    delay = min(max(1.0, rsvp.seconds_left() * 0.75), self.max_refresh_interval)
                    with trio.move_on_after(delay):
                        await lost.wait()
                try:
                    rsvp = await self.reserve(relay, addrs)
                except (P2PError, OSError) as e:
                    # a refusal voids the old slot too; a hiccup leaves a still valid one be
                    still_valid = self.host.is_connected(relay) and rsvp.seconds_left() > 0
                    if isinstance(e, RelayError) or not still_valid:
                        self.reservations.pop(relay, None)
                        self._withdraw(relay)
                    self._log.warning(
                        ("reserve-failed", relay),
                        "relay reservation on %s failed (retry in %.0fs): %s",
                        relay.short(),
                        backoff,
                        error_reason(e),
                    )
                    await trio.sleep(backoff * random.uniform(0.8, 1.2))
                    backoff = min(backoff * 2, 60.0)
                    continue
                backoff = 1.0
                self._advertise(rsvp)
        finally:
            self._withdraw(relay)

    def circuit_addrs(self) -> list[Multiaddr]:
        """Our circuit addresses through every relay whose reservation is still valid."""
        return [
            a for r in self.reservations.values() if r.seconds_left() > 0 for a in r.circuit_addrs
        ]

    def add_observer(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` whenever the circuit addresses we advertise change (a slot
        gained, moved or lost), e.g. to refresh what a DHT node announces."""
        self._observers.append(on_change)

    def remove_observer(self, on_change: Callable[[], None]) -> None:
        if on_change in self._observers:
            self._observers.remove(on_change)

    def _notify(self) -> None:
        for callback in list(self._observers):
            try:
                callback()
            except Exception:
                logger.exception("relay address observer failed")

    def _trust(self, relay: PeerID) -> None:
        self._relays.pop(relay, None)
        self._relays[relay] = None
        while len(self._relays) > self.MAX_RELAYS:
            self._relays.popitem(last=False)

    def _advertise(self, rsvp: Reservation) -> None:
        """Add our circuit addresses to the Host's listen addresses (identify and the DHT
        announce those), replacing what this relay gave before."""
        before = self._advertised.pop(rsvp.relay, ())
        for addr in before:
            self.host.remove_listen_addr(addr)
        for addr in rsvp.circuit_addrs:
            self.host.add_listen_addr(addr)
        self._advertised[rsvp.relay] = rsvp.circuit_addrs
        if before != rsvp.circuit_addrs:
            self._notify()

    def _withdraw(self, relay: PeerID) -> None:
        gone = self._advertised.pop(relay, ())
        self.host.unprotect(relay, RELAY_TAG)
        for addr in gone:
            self.host.remove_listen_addr(addr)
        if gone:
            self._notify()

    def _on_disconnect(self, peer: PeerID) -> None:
        self.host.unprotect(peer, RELAY_TAG)
        if self.reservations.pop(peer, None) is not None:
            logger.info("lost the connection to relay %s: its reservation is void", peer.short())
        lost = self._lost.pop(peer, None)
        if lost is not None:
            lost.set()

    # -- the stop protocol ------------------------------------------------------------------
    async def _refuse_stop(self, stream: P2PStream, status: Status, why: str) -> None:
        self._log.warning(
            ("stop-refused", status),
            "refusing a relayed connection via %s: %s: %s",
            stream.remote_peer.short(),
            status.name,
            why,
        )
        await _send_quietly(
            stream, encode_stop(StopMessage(StopType.STATUS, status=status)), self.message_timeout
        )

    async def _serve_stop(self, stream: P2PStream) -> None:
        host, relay = self.host, stream.remote_peer
        if relay not in self._relays:
            await self._refuse_stop(
                stream, Status.PERMISSION_DENIED, "we hold no reservation there"
            )
            return
        try:
            msg = decode_stop(await _receive_frame(stream, self.message_timeout, "stop request"))
        except (MessageTooLargeError, RelayMessageError, ProtocolViolationError) as e:
            await self._refuse_stop(stream, Status.MALFORMED_MESSAGE, error_reason(e))
            return
        except P2PTimeoutError as e:
            logger.debug("stop stream from %s: %s", relay.short(), e)
            stream.reset()
            return
        except StreamClosedError:
            return
        if msg.type != StopType.CONNECT:
            status = (
                Status.UNEXPECTED_MESSAGE
                if msg.type == StopType.STATUS
                else Status.MALFORMED_MESSAGE
            )
            await self._refuse_stop(stream, status, f"stop message type {msg.type}")
            return
        if msg.peer is None or msg.peer.id in (host.peer_id, relay):
            await self._refuse_stop(
                stream, Status.MALFORMED_MESSAGE, "CONNECT without a usable peer"
            )
            return
        if self.inbound_circuits >= self.max_inbound_circuits:
            await self._refuse_stop(
                stream,
                Status.RESOURCE_LIMIT_EXCEEDED,
                f"{self.max_inbound_circuits} relayed connections",
            )
            return
        if host.closing or not host.make_room():
            await self._refuse_stop(
                stream, Status.RESOURCE_LIMIT_EXCEEDED, "connection limit reached"
            )
            return
        src = msg.peer.id
        self.inbound_circuits += 1
        try:
            with trio.fail_after(self.message_timeout):
                await stream.send_all(encode_stop(StopMessage(StopType.STATUS, status=Status.OK)))
            name = _circuit_remote_addr(stream.remote_addr, relay)
            try:
                conn = await _upgrade_circuit(
                    host, stream, src, outbound=False, name=name, limit=msg.limit
                )
            except (*_STREAM_ERRORS, OSError) as e:
                self._log.warning(
                    "relayed-handshake",
                    "relayed connection from %s via %s failed: %s",
                    src.short(),
                    relay.short(),
                    error_reason(e),
                )
                return
            if host.closing:
                await conn.session.aclose()
                return
            logger.debug(
                "relayed connection from %s via %s (limit %s)",
                src.short(),
                relay.short(),
                msg.limit,
            )
            await host.serve_connection(conn)  # counted in inbound_circuits while it lives
        except trio.TooSlowError:
            stream.reset()
        finally:
            self.inbound_circuits -= 1


_CLIENTS: weakref.WeakKeyDictionary[Host, RelayClient] = weakref.WeakKeyDictionary()


def relay_client(host: Host) -> RelayClient:
    """The Host's RelayClient (created, with its stop handler, on first use)."""
    client = _CLIENTS.get(host)
    if client is None:
        client = _CLIENTS[host] = RelayClient(host)
    return client


async def reserve(
    host: Host,
    relay: PeerID,
    addrs: Sequence[Multiaddr | str] = (),
    timeout: float = 10.0,  # noqa: ASYNC109 - the documented API takes a timeout
) -> Reservation:
    """``relay_client(host).reserve(relay, addrs, timeout)``."""
    return await relay_client(host).reserve(relay, addrs, timeout)


def dial_circuits(host: Host) -> None:
    """Host extension (see ``host.add_host_extension``): dial ``/p2p-circuit`` addresses
    through the relay they name (:func:`dial_circuit`)."""
    host.add_dialer(Multiaddr.is_circuit, functools.partial(dial_circuit, host))


__all__ = [
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "Circuit",
    "Limit",
    "RelayClient",
    "RelayLimits",
    "RelayService",
    "RelayStats",
    "Reservation",
    "circuit_addr",
    "dial_circuit",
    "dial_circuits",
    "enable_relay_service",
    "relay_client",
    "reserve",
    "split_circuit",
]
