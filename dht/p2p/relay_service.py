"""Circuit relay v2, the hop side: a public peer serving reservations and splicing circuits.

A peer behind a NAT reserves a slot here (``RESERVE``); a peer that wants to reach it asks
for a circuit (``CONNECT``); the relay opens a ``stop`` stream to the target over the
target's own connection and, once it accepts, copies bytes both ways. The two ends run
Noise + yamux over the circuit, so the relay sees ciphertext only (see ``relay.py`` for the
whole protocol and the reserving side).

Relaying costs the relay's bandwidth, so everything is bounded (:class:`RelayLimits`):
reservations (one per peer, a cap per source address and in total), circuits (per peer and
in total), hop requests per peer (token bucket), and every circuit's bytes (per direction)
and lifetime, as the spec's ``Limit``. Requests over a relayed connection (chains) are
refused. ``relay.py`` re-exports everything here.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from .._logging import RateLimitedLogger
from .connection import source_key
from .errors import (
    MessageTooLargeError,
    P2PTimeoutError,
    ProtocolViolationError,
    StreamClosedError,
    error_reason,
)
from .host import Host
from .identity import PeerID
from .multiaddr import Multiaddr
from .relay_messages import (
    HOP_PROTOCOL,
    MAX_MESSAGE_SIZE,
    STOP_PROTOCOL,
    STREAM_ERRORS,
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
    receive_frame,
    send_quietly,
    status_name,
)
from .stream import P2PStream

# both sides of the relay log as dht.p2p.relay: one name to filter on
logger = logging.getLogger("dht.p2p.relay")

SPLICE_CHUNK = 64 * 1024


# Host.protect tag: the connection a reservation lives on is never closed to make room
RESERVATION_TAG = "relay: holds a reservation here"


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
        await send_quietly(stream, frame, self.limits.message_timeout)

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
            body = await receive_frame(stream, self.limits.message_timeout, "hop request")
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
        await send_quietly(stream, encode_hop(reply), limits.message_timeout)

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
        except (*STREAM_ERRORS, OSError) as e:
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
        except (*STREAM_ERRORS, trio.TooSlowError) as e:
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
            except STREAM_ERRORS as e:
                circuit.cut(
                    f"{'initiator' if way == 0 else 'target'} side broke: {error_reason(e)}"
                )
                return
            if not data:
                try:
                    await sink.send_eof()
                except STREAM_ERRORS as e:
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
                except STREAM_ERRORS as e:
                    circuit.cut(
                        f"{'target' if way == 0 else 'initiator'} side broke: {error_reason(e)}"
                    )
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


__all__ = [
    "RESERVATION_TAG",
    "Circuit",
    "RelayLimits",
    "RelayService",
    "RelayStats",
    "enable_relay_service",
]
