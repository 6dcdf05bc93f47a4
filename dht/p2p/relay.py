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

This module is the reserving side (``RelayClient``, the ``stop`` handler) and dialing
``/p2p-circuit`` addresses; the hop side (``RelayService``, ``RelayLimits``) is in
``relay_service.py``, the messages in ``relay_messages.py``; both are re-exported here.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar

import trio

from .._logging import RateLimitedLogger
from .connection import Connection, is_loopback
from .errors import (
    DialError,
    MessageTooLargeError,
    P2PError,
    P2PTimeoutError,
    ProtocolNegotiationError,
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
    STREAM_ERRORS,
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayMessageError,
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
from .relay_service import (
    RESERVATION_TAG,
    Circuit,
    RelayLimits,
    RelayService,
    RelayStats,
    enable_relay_service,
)
from .stream import P2PStream

logger = logging.getLogger(__name__)

MAX_ADVERTISED_PER_RELAY = 4  # circuit addresses we announce per relay (the DHT takes 16 in all)

_T_contra = TypeVar("_T_contra", contravariant=True)


class TaskStarted(Protocol[_T_contra]):
    """The ``task_status`` that ``nursery.start`` passes (or a wrapper of it). Spelled out
    here because the trio stubs mypy reads (trio-typing's) have no ``trio.TaskStatus``."""

    def started(self, value: _T_contra) -> None: ...


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
        # bytes through the relay each way, as the relay counts them against its data limit
        self.sent = 0
        self.received = 0

    # A reset circuit (the relay cut it, its connection closed) is what a reset socket is to
    # the layers above: trio.BrokenResourceError, a lost connection rather than a bug.
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except StreamClosedError as e:
            raise trio.BrokenResourceError(f"relayed circuit closed: {e}") from e
        self.sent += len(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data = await self.stream.receive_some(max_bytes)
        except StreamClosedError as e:
            raise trio.BrokenResourceError(f"relayed circuit closed: {e}") from e
        self.received += len(data)
        return data

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
    circuit = _CircuitStream(stream)
    try:
        with trio.fail_after(host.limits.handshake_timeout):
            conn = await host.upgrade(circuit, expected, outbound=outbound, name=name)
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
    conn.relay_usage = lambda: max(circuit.sent, circuit.received)
    return conn


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


# Host.protect tag: the connection to a relay holding our slot is never closed to make room
RELAY_TAG = "relay: our reservation on it"


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
        # a refresh is one small hop message; every 30 s lets a relay that stopped serving
        # (its service closed, or it no longer answers) be noticed within a minute, not 15
        max_refresh_interval: float = 30.0,
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
        task_status: TaskStarted[Reservation] = trio.TASK_STATUS_IGNORED,
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
        failures = 0  # refreshes failed in a row
        try:
            while True:
                lost = self._lost.setdefault(relay, trio.Event())
                if not failures and self.host.is_connected(relay) and relay in self.reservations:
                    delay = min(max(1.0, rsvp.seconds_left() * 0.75), self.max_refresh_interval)
                    with trio.move_on_after(delay):
                        await lost.wait()
                try:
                    rsvp = await self.reserve(relay, addrs)
                except (P2PError, OSError) as e:
                    failures += 1
                    # a refusal, a relay that no longer speaks the hop protocol or a second
                    # failure in a row (it stopped answering) voids the old slot; one hiccup
                    # leaves a still valid one be
                    still_valid = self.host.is_connected(relay) and rsvp.seconds_left() > 0
                    stopped = isinstance(e, RelayError | ProtocolNegotiationError) or failures > 1
                    if stopped or not still_valid:
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
                failures = 0
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
        await send_quietly(
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
            msg = decode_stop(await receive_frame(stream, self.message_timeout, "stop request"))
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
            except (*STREAM_ERRORS, OSError) as e:
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
    "RELAY_TAG",
    "RESERVATION_TAG",
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
