"""DCUtR (``/libp2p/dcutr``): upgrade a relayed connection to a direct one by hole punching.

Two peers behind NATs reach each other through a circuit relay (``relay.py``), but the relay
allows only a trickle of bytes per connection. Both NATs let *outbound* connections through
and answer them, so if each peer opens a TCP connection to the other's public address at the
same moment, each NAT sees its own peer's SYN go out first and takes the other's SYN for the
answer: a TCP *simultaneous open* through both NATs. DCUtR (libp2p specs, relay/DCUtR.md)
coordinates that moment over the relayed connection:

1. B, the peer that was dialed through the relay (the *inbound* side of the relayed
   connection), opens a ``/libp2p/dcutr`` stream on it and sends ``CONNECT`` with its public
   addresses, starting a timer;
2. A, the peer that dialed, answers ``CONNECT`` with its own addresses;
3. B takes the round-trip time, sends ``SYNC`` and waits half of it;
4. A dials all of B's addresses as soon as ``SYNC`` arrives, B dials A's when its wait ends,
   so both SYNs leave at about the same time;
5. whatever TCP connection comes up first is secured with A as the initiator (multistream,
   Noise, yamux) and B as the responder, whichever socket technically "connected", and is
   registered as an ordinary direct connection: new streams take it, and the relayed
   connection is closed as soon as its streams have ended (at most ``retire_grace`` seconds
   of waiting for them; a busy one is left to the relay's limits): it would only hold one
   of the relay's circuit slots and keep the relay in the path of whatever still used it.

B tries up to ``max_attempts`` (3) times, then gives up and logs why; the relayed
connection stays usable in any case.

A NAT maps each local ``ip:port`` to a public port, so the dials must leave from the port the
peer listens on: that is the port we put into our addresses (``TCPTransport`` shares its
listen ports, ``dial(local_port=...)``). The addresses offered are what other peers observed
us at (identify's observed address, the relay's view included) with our listen port in
place of the observed one (for an endpoint-independent NAT that keeps the port, the common
home router, that *is* the mapping), and our public listen addresses. A symmetric NAT (a new
random port per destination: carrier-grade and many corporate NATs) maps the punching dial
to a port nobody announced, so punching through it fails; the peers stay on the relay.

Everything from the network is untrusted: messages are at most :data:`MAX_MESSAGE_SIZE`
bytes and :data:`MAX_ADDRS` addresses, unknown or out-of-order message types end the
exchange (logged with the reason, rate-limited), the addresses dialed are filtered (TCP over
IPv4/IPv6 only; no loopback, link-local, unspecified, multicast, relayed addresses), every
wait has a timeout, and a peer can start only a few exchanges per minute.

The messages and their strict codec are in ``dcutr_messages.py`` (re-exported here); one
attempt's dials and socket take-overs in ``dcutr_punch.py``.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from .._logging import RateLimitedLogger
from . import multistream
from .connection import Connection
from .dcutr_messages import (
    MAX_ADDRS,
    MAX_MESSAGE_SIZE,
    DCUtRMessageError,
    HolePunch,
    HolePunchType,
    decode_hole_punch,
    encode_hole_punch,
    frame,
)
from .dcutr_punch import STREAM_ERRORS as _STREAM_ERRORS
from .dcutr_punch import Punch
from .errors import (
    MessageTooLargeError,
    P2PTimeoutError,
    ProtocolNegotiationError,
    ProtocolViolationError,
    error_reason,
)
from .host import Host
from .identity import PeerID
from .multiaddr import Multiaddr
from .stream import P2PStream

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/libp2p/dcutr"
MAX_TRACKED_PEERS = 1024  # per-peer rate-limit state kept (least recently seen dropped)
# after this many exchanges in a row ended without a direct connection (behind a symmetric
# NAT every one does), wait_for_direct stops waiting for punches: they go on, nobody waits
HOPELESS_AFTER_FAILURES = 3
# seconds a bulk transfer to a peer we reach only through a relay may wait for the punch
# under way (``Host.new_stream(direct_wait=...)``), each caller capping it by its own
# timeout: a relay's bytes are its operator's (often the swarm's one public bootstrap),
# and its circuits are capped
BULK_DIRECT_WAIT = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


# -- addresses ----------------------------------------------------------------------------------


def _ip_port(addr: Multiaddr | None) -> tuple[IPAddress, int] | None:
    """``(ip, port)`` of ``/ip4|ip6/<ip>/tcp/<port>[/p2p/<id>]``, else None."""
    if addr is None:
        return None
    parts = addr.components
    if parts and parts[-1][0] == "p2p":
        parts = parts[:-1]
    if len(parts) != 2 or parts[0][0] not in ("ip4", "ip6") or parts[1][0] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(str(parts[0][1]).split("%")[0])
        port = int(parts[1][1])  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, port


def _tcp_addr(ip: IPAddress, port: int) -> Multiaddr:
    return Multiaddr(f"/ip{ip.version}/{ip}/tcp/{port}")


def dialable_addrs(
    addrs: Iterable[Multiaddr],
    *,
    peer: PeerID | None = None,
    allow_loopback: bool = False,
    limit: int = MAX_ADDRS,
) -> list[Multiaddr]:
    """The addresses worth a hole-punching dial, as ``/ip4|ip6/<ip>/tcp/<port>``: TCP over an
    IP literal only (no DNS, no relayed address), not loopback (unless ``allow_loopback``: one
    machine's tests), link-local, unspecified, multicast or IPv4-reserved; an address naming
    another peer than ``peer`` is dropped. No repeats, at most ``limit``."""
    out: list[Multiaddr] = []
    for addr in addrs:
        if addr.is_circuit():
            continue
        if peer is not None and addr.peer_id is not None and addr.peer_id != peer:
            continue
        endpoint = _ip_port(addr)
        if endpoint is None:
            continue
        ip, port = endpoint
        if not 0 < port < 65536:
            continue
        if ip.is_loopback and not allow_loopback:
            continue
        if ip.is_link_local or ip.is_unspecified or ip.is_multicast:
            continue
        if isinstance(ip, ipaddress.IPv4Address) and ip.is_reserved:  # 240/4, broadcast
            continue
        target = _tcp_addr(ip, port)
        if target not in out:
            out.append(target)
            if len(out) >= limit:
                break
    return out


def listen_ports(host: Host) -> dict[int, int]:
    """``{ip version: port}`` of the host's TCP listeners that share their port with dials."""
    ports: dict[int, int] = {}
    for listener in host.listeners:
        if not getattr(listener, "reuse_port", False):
            continue
        endpoint = _ip_port(getattr(listener, "multiaddr", None))
        if endpoint is not None:
            ports.setdefault(endpoint[0].version, endpoint[1])
    return ports


def offered_addrs(host: Host, *, allow_loopback: bool = False, limit: int = 8) -> list[Multiaddr]:
    """The addresses we tell a peer to dial: each IP other peers observed us at (confirmed
    ones first, then single reports, most reported first) with our listen port of that IP
    version, then our public (global) listen addresses. Empty without a shared listen port."""
    ports = listen_ports(host)
    if not ports:
        return []
    observed = host.observed_addrs
    ips: list[IPAddress] = list(observed.confirmed_ips())
    for addr, _count in sorted(observed.observed().items(), key=lambda item: -item[1]):
        endpoint = _ip_port(addr)
        if endpoint is not None and endpoint[0] not in ips:
            ips.append(endpoint[0])
    candidates = [_tcp_addr(ip, ports[ip.version]) for ip in ips if ip.version in ports]
    for addr in host.listen_addrs:
        endpoint = _ip_port(addr)
        if endpoint is None:
            continue  # relayed and other non-TCP addresses
        ip = endpoint[0]
        if ip.is_global or (allow_loopback and ip.is_loopback):
            candidates.append(addr.without_peer_id())
    return dialable_addrs(candidates, allow_loopback=allow_loopback, limit=limit)


# -- the service --------------------------------------------------------------------------------


@dataclass
class HolePunchConfig:
    """Knobs of :class:`HolePuncher` (``Host.open(hole_punching=HolePunchConfig(...))``)."""

    max_attempts: int = 3  # exchanges B starts for one relayed connection
    message_timeout: float = 10.0  # each message (and opening the stream) must arrive by then
    punch_timeout: float = 5.0  # the dials of one attempt; handshakes under way may finish
    retry_delay: float = 1.0  # between B's attempts
    redial_interval: float = 0.2  # an address whose dial failed at once (a reset) is redialed
    identify_wait: float = 2.0  # wait for identify (observed addresses) before offering ours
    max_offered_addrs: int = 8
    max_dial_addrs: int = 8  # of the peer's addresses, dialed at once
    max_concurrent: int = 16  # exchanges in progress, both roles
    max_exchanges_per_peer: int = 6  # exchanges a peer may start with us per rate_window
    rate_window: float = 60.0
    allow_loopback: bool = False  # offer and dial loopback addresses (tests on one machine)
    # after a punch: how long the relayed connection's open streams may take to end before
    # it is closed (it is closed at once when idle); still busy then, the relay's limits end it
    retire_grace: float = 30.0
    retire_poll: float = 0.5
    # A: after we dial a peer that speaks DCUtR through a relay, how long we count on its
    # CONNECT arriving (B waits for identify first); wait_for_direct waits no longer for it
    exchange_expected_within: float = 3.0

    def __post_init__(self) -> None:
        for name in (
            "max_attempts",
            "max_offered_addrs",
            "max_dial_addrs",
            "max_concurrent",
            "max_exchanges_per_peer",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"HolePunchConfig.{name} must be at least 1, got {getattr(self, name)}"
                )
        if self.max_offered_addrs > MAX_ADDRS or self.max_dial_addrs > MAX_ADDRS:
            raise ValueError(f"HolePunchConfig: at most {MAX_ADDRS} addresses per message")
        for name in (
            "message_timeout",
            "punch_timeout",
            "redial_interval",
            "rate_window",
            "retire_grace",
            "retire_poll",
            "exchange_expected_within",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"HolePunchConfig.{name} must be positive, got {getattr(self, name)}"
                )
        for name in ("retry_delay", "identify_wait"):
            if getattr(self, name) < 0:
                raise ValueError(f"HolePunchConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class HolePunchResult:
    """How one hole punch ended. ``initiated``: we started it (we are B, the peer that was
    dialed through the relay; ``attempts`` up to ``max_attempts``); else we answered one
    exchange (A). ``addr``: the direct connection's remote address, on success."""

    peer: PeerID
    initiated: bool
    success: bool
    attempts: int
    seconds: float
    addr: str = ""
    reason: str = ""


@dataclass
class HolePunchStats:
    started: int = 0  # exchanges we started (B) or answered (A)
    succeeded: int = 0
    failed: int = 0
    refused: int = 0  # streams we did not answer (busy, rate limit, not relayed...)
    malformed: int = 0  # exchanges dropped for a bad message


class _GiveUp(Exception):
    """An attempt failed in a way another attempt would not fix."""


class HolePuncher:
    """DCUtR for one Host: starts the upgrade of every inbound relayed connection (B) and
    answers the peers that start one (A). :meth:`start` (``Host.open`` does it by default
    over TCP) and :meth:`stop` turn it on and off.

    ``results`` keeps the last 64 outcomes; ``add_observer(callback)`` is called with each
    :class:`HolePunchResult` as it comes.
    """

    def __init__(self, host: Host, config: HolePunchConfig | None = None) -> None:
        self.host = host
        self.config = config or HolePunchConfig()
        self.enabled = False
        self.stats = HolePunchStats()
        self.results: deque[HolePunchResult] = deque(maxlen=64)
        self._observers: list[Callable[[HolePunchResult], None]] = []
        # peers with an exchange in progress: one we started (B), one we answer (A)
        self._initiating: set[PeerID] = set()
        self._answering: set[PeerID] = set()
        # per peer, events set when a direct connection to it registers (see _watch_direct)
        self._direct: dict[PeerID, list[trio.Event]] = {}
        self._recent: OrderedDict[PeerID, deque[float]] = OrderedDict()
        # set (and replaced) when a connection registers or an exchange ends: what
        # wait_for_direct wakes on
        self._changed = trio.Event()
        # exchanges (B: attempts) that ended without a direct connection since a success
        self._failed_in_a_row = 0
        self._log = RateLimitedLogger(logger, host.limits.log_interval, clock=trio.current_time)

    # -- switching ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.enabled:
            return
        self.enabled = True
        self.host.set_stream_handler(PROTOCOL_ID, self._serve)
        self.host.add_connection_hook(self._on_connection)

    def stop(self) -> None:
        """No new exchanges (either role); those under way end within their timeouts."""
        self.enabled = False
        self.host.set_stream_handler(PROTOCOL_ID, None)
        self.host.remove_connection_hook(self._on_connection)
        if self.host.hole_puncher is self:
            self.host.hole_puncher = None

    def hidden_protocols(self) -> tuple[str, ...]:
        """What identify leaves out: DCUtR while we have no listen port shared with our
        dials, without which we cannot punch in either role. A peer that dialed us through
        a relay then knows no exchange is coming, and does not wait for one."""
        return () if listen_ports(self.host) else (PROTOCOL_ID,)

    def add_observer(self, callback: Callable[[HolePunchResult], None]) -> None:
        self._observers.append(callback)

    # -- shared helpers -------------------------------------------------------------------------
    @property
    def busy(self) -> int:
        """Exchanges in progress, both roles."""
        return len(self._initiating) + len(self._answering)

    def _has_direct(self, peer: PeerID) -> bool:
        return any(not c.relayed for c in self.host.connections(peer))

    def _direct_addr(self, peer: PeerID) -> str:
        for conn in self.host.connections(peer):
            if not conn.relayed:
                return conn.remote_addr
        return ""

    def _wake_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _on_connection(self, conn: Connection) -> None:
        """Host hook: every registered connection."""
        self._wake_waiters()
        peer = conn.peer_id
        if not conn.relayed:
            events = self._direct.get(peer)
            if events:  # an exchange with this peer is under way
                conn.hole_punched = True
                for event in events:
                    event.set()
            return
        if not self.enabled or conn.outbound or peer in self._initiating or self._has_direct(peer):
            return
        if not listen_ports(self.host):
            logger.debug(
                "dcutr: no hole punch with %s: we listen on no TCP port that dials can share",
                peer.short(),
            )
            return
        if self.busy >= self.config.max_concurrent:
            self._log.info(
                "busy",
                "dcutr: no hole punch with %s: %d in progress",
                peer.short(),
                self.busy,
            )
            return
        self._initiating.add(peer)
        self.host.start_soon(self._initiate, conn)

    def _finish(self, result: HolePunchResult) -> None:
        self.results.append(result)
        if result.success:
            self._failed_in_a_row = 0
        elif not result.initiated:  # B counted its attempts as they failed
            self._failed_in_a_row += 1
        self._wake_waiters()
        if result.success:
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        for callback in list(self._observers):
            try:
                callback(result)
            except Exception:
                logger.exception("hole punch observer failed")

    # -- before a bulk transfer ------------------------------------------------------------------
    def _punch_expected_until(self, peer: PeerID) -> float | None:
        """Until when a hole punch with ``peer`` may still bring a direct connection (inf
        while an exchange is under way), or None if none is coming.

        B starts its exchange as the relayed connection registers, so it knows; A only
        expects one on a relayed connection it dialed to a peer that speaks DCUtR, for
        ``exchange_expected_within`` seconds, unless an exchange began on it already. Nothing
        is coming either once our punches keep failing (``HOPELESS_AFTER_FAILURES``)."""
        if not self.enabled or self._has_direct(peer):
            return None
        if self._failed_in_a_row >= HOPELESS_AFTER_FAILURES:
            return None
        if peer in self._initiating or peer in self._answering:
            return math.inf
        now = trio.current_time()
        times = self._recent.get(peer)
        last_exchange = times[-1] if times else -math.inf
        until = None
        for conn in self.host.connections(peer):
            speaks = not conn.identified.is_set() or PROTOCOL_ID in conn.remote_protocols
            end = conn.opened_at + self.config.exchange_expected_within
            if conn.relayed and conn.outbound and speaks and last_exchange < conn.opened_at:
                if end > now and (until is None or end > until):
                    until = end
        return until

    async def wait_for_direct(self, peer: PeerID, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait at most ``timeout`` seconds while a hole punch with ``peer`` is under way or
        about to begin; True if we hold a direct connection to it now.

        For bulk transfers: a relay's bytes are its operator's (often the one public
        bootstrap everyone shares), and its circuits are capped, so bytes that can wait a
        moment for the punched connection should."""
        with trio.move_on_after(timeout):
            while (until := self._punch_expected_until(peer)) is not None:
                changed = self._changed
                # until identify answers, A cannot tell whether the peer speaks DCUtR at all
                unidentified = [
                    c.identified
                    for c in self.host.connections(peer)
                    if c.relayed and c.outbound and not c.identified.is_set()
                ]
                with trio.move_on_at(until):
                    await (unidentified[0] if unidentified else changed).wait()
        return self._has_direct(peer)

    async def _our_addrs(self) -> list[Multiaddr]:
        """Our addresses to offer, after a bounded wait for identify on direct connections
        (where observed addresses come from) that are still running it."""
        pending = [
            c for c in self.host.connections() if not c.relayed and not c.identified.is_set()
        ]
        if pending and self.config.identify_wait > 0:
            with trio.move_on_after(self.config.identify_wait):
                for conn in pending:
                    await conn.identified.wait()
        return offered_addrs(
            self.host,
            allow_loopback=self.config.allow_loopback,
            limit=self.config.max_offered_addrs,
        )

    def _theirs(self, msg: HolePunch, peer: PeerID) -> list[Multiaddr]:
        return dialable_addrs(
            msg.addrs,
            peer=peer,
            allow_loopback=self.config.allow_loopback,
            limit=self.config.max_dial_addrs,
        )

    async def _send(self, stream: P2PStream, msg: HolePunch) -> None:
        timeout = self.config.message_timeout
        with trio.move_on_after(timeout):
            await stream.send_all(frame(encode_hole_punch(msg)))
            return
        raise P2PTimeoutError(f"could not send {msg.type.name} within {timeout:.1f}s")

    async def _receive(self, stream: P2PStream, expected: HolePunchType) -> HolePunch:
        """The next message, which must be of type ``expected``."""
        timeout = self.config.message_timeout
        with trio.move_on_after(timeout):
            try:
                body = await stream.receive_frame(MAX_MESSAGE_SIZE)
            except (MessageTooLargeError, ProtocolViolationError) as e:
                raise DCUtRMessageError(str(e)) from None
            msg = decode_hole_punch(body)
            if msg.type != expected:
                raise DCUtRMessageError(f"expected {expected.name}, got {msg.type.name}")
            return msg
        raise P2PTimeoutError(f"no {expected.name} within {timeout:.1f}s")

    # -- B: we were dialed through a relay; we start ---------------------------------------------
    async def _initiate(self, conn: Connection) -> None:
        peer, cfg = conn.peer_id, self.config
        started = trio.current_time()
        attempts = 0
        reason = ""
        self.stats.started += 1
        try:
            while attempts < cfg.max_attempts:
                if self._has_direct(peer) or not conn.alive or not self.enabled:
                    break
                if not self._count_exchange(peer):
                    reason = (
                        f"over {cfg.max_exchanges_per_peer} exchanges with this peer per "
                        f"{cfg.rate_window:.0f}s"
                    )
                    break
                attempts += 1
                try:
                    addr = await self._attempt(conn)
                except _GiveUp as e:
                    reason = str(e)
                    self._failed_in_a_row += 1
                    break
                except (*_STREAM_ERRORS, OSError) as e:
                    reason = error_reason(e)
                    logger.debug(
                        "dcutr: attempt %d with %s failed: %s", attempts, peer.short(), reason
                    )
                else:
                    if addr is not None:
                        break
                    reason = f"no direct connection within {cfg.punch_timeout:.1f}s"
                self._failed_in_a_row += 1  # each attempt counts, as A counts each exchange
                self._wake_waiters()
                if attempts < cfg.max_attempts:
                    await trio.sleep(cfg.retry_delay)
            if not conn.alive and not reason:
                reason = "the relayed connection closed"
        except Exception as e:  # a bug reachable from a peer must not take the host down
            logger.warning(
                "dcutr: hole punch with %s: unexpected %s", peer.short(), error_reason(e)
            )
            reason = error_reason(e)
        finally:
            self._initiating.discard(peer)
        self._conclude(peer, True, attempts, trio.current_time() - started, reason)

    def _conclude(
        self, peer: PeerID, initiated: bool, attempts: int, seconds: float, reason: str
    ) -> None:
        success = self._has_direct(peer)
        addr = self._direct_addr(peer)
        if success:
            self.host.start_soon(self._retire_relayed, peer)
            logger.info(
                "hole punching: direct connection to %s at %s (%d attempt(s), %.2fs)",
                peer.short(),
                addr,
                attempts,
                seconds,
            )
        elif initiated:
            logger.info(
                "hole punching: no direct connection to %s after %d attempt(s) in %.1fs: %s; "
                "it stays reachable through the relay",
                peer.short(),
                attempts,
                seconds,
                reason or "gave up",
            )
        else:  # B decides whether to try again and logs the outcome; debug only here
            logger.debug(
                "hole punching: exchange started by %s ended without a direct connection "
                "(%.1fs): %s",
                peer.short(),
                seconds,
                reason or "gave up",
            )
        self._finish(
            HolePunchResult(
                peer, initiated, success, attempts, seconds, addr, "" if success else reason
            )
        )

    async def _retire_relayed(self, peer: PeerID) -> None:
        """Close the relayed connections to ``peer`` once a punched direct one carries new
        streams, each as soon as it has no open stream (see the module docstring)."""
        cfg = self.config
        with trio.move_on_after(cfg.retire_grace):
            while self._has_direct(peer):
                relayed = [c for c in self.host.connections(peer) if c.relayed and c.alive]
                if not relayed:
                    return
                for conn in relayed:
                    if conn.session.num_streams == 0:
                        logger.debug(
                            "hole punching: closing the relayed connection to %s (%s): the "
                            "direct one carries the traffic",
                            peer.short(),
                            conn.remote_addr,
                        )
                        await conn.session.aclose()
                await trio.sleep(cfg.retire_poll)

    async def _open_on(self, conn: Connection) -> P2PStream:
        """A ``/libp2p/dcutr`` stream on that very connection (lazy negotiation: the proposal
        leaves with CONNECT; a refusal surfaces on the first read)."""
        timeout = self.config.message_timeout
        with trio.move_on_after(timeout):
            ystream = await conn.session.open_stream()
            conn.last_used = trio.current_time()
            _, inner = await multistream.negotiate_outbound(
                ystream, [PROTOCOL_ID], timeout, lazy=True
            )
            return P2PStream(
                inner,
                ystream,
                conn.peer_id,
                PROTOCOL_ID,
                self.host.limits.max_message_size,
                conn.remote_addr,
            )
        raise P2PTimeoutError(f"could not open a {PROTOCOL_ID} stream within {timeout:.1f}s")

    async def _attempt(self, conn: Connection) -> str | None:
        """One exchange as B; the direct connection's address, or None."""
        direct = self._watch_direct(conn.peer_id)
        try:
            return await self._attempt_watched(conn, direct)
        finally:
            self._unwatch_direct(conn.peer_id, direct)

    def _watch_direct(self, peer: PeerID) -> trio.Event:
        """An event set when a direct connection to ``peer`` registers, whichever way it
        came (our dial, the peer's dial reaching our listener): for the whole exchange, since
        the peer may dial us before we dial it."""
        direct = trio.Event()
        self._direct.setdefault(peer, []).append(direct)
        return direct

    def _unwatch_direct(self, peer: PeerID, direct: trio.Event) -> None:
        events = self._direct.get(peer, [])
        if direct in events:
            events.remove(direct)
        if not events:
            self._direct.pop(peer, None)

    async def _attempt_watched(self, conn: Connection, direct: trio.Event) -> str | None:
        peer = conn.peer_id
        ours = await self._our_addrs()
        if not ours:
            raise _GiveUp("no public address of ours to offer (nobody observed one yet)")
        stream = await self._open_on(conn)
        try:
            start = trio.current_time()
            await self._send(stream, HolePunch(HolePunchType.CONNECT, tuple(ours)))
            try:
                reply = await self._receive(stream, HolePunchType.CONNECT)
            except ProtocolNegotiationError as e:
                raise _GiveUp(f"the peer does not speak {PROTOCOL_ID}: {e}") from None
            except DCUtRMessageError as e:
                self.stats.malformed += 1
                raise _GiveUp(f"bad answer: {e}") from None
            rtt = trio.current_time() - start
            theirs = self._theirs(reply, peer)
            if not theirs:
                raise _GiveUp(
                    f"the peer offered no address we can dial ({len(reply.addrs)} offered)"
                )
            await self._send(stream, HolePunch(HolePunchType.SYNC))
        except BaseException:
            stream.reset()
            raise
        await stream.aclose()
        logger.debug(
            "dcutr: %s answered in %.1f ms; dialing %s in %.1f ms",
            peer.short(),
            rtt * 1000,
            ", ".join(map(str, theirs)),
            rtt * 500,
        )
        await trio.sleep(rtt / 2)
        return await self._punch(peer, theirs, outbound=False, direct=direct)

    # -- A: we dialed through the relay; the other side starts -----------------------------------
    def _count_exchange(self, peer: PeerID) -> bool:
        """Count one exchange with ``peer`` (either role); False if over the per-peer rate
        (a peer that reconnects through the relay again and again must not make us dial
        addresses of its choosing again and again)."""
        cfg = self.config
        now = trio.current_time()
        times = self._recent.pop(peer, None) or deque()
        while times and times[0] <= now - cfg.rate_window:
            times.popleft()
        self._recent[peer] = times  # most recently seen last
        while len(self._recent) > MAX_TRACKED_PEERS:
            self._recent.popitem(last=False)
        if len(times) >= cfg.max_exchanges_per_peer:
            return False
        times.append(now)
        return True

    def _admit(self, peer: PeerID) -> str | None:
        """None if ``peer`` may start an exchange now (and count it), else why not."""
        cfg = self.config
        if peer in self._answering:
            return "an exchange with this peer is already in progress"
        if peer in self._initiating and self.host.peer_id < peer:
            # both of us were dialed through a relay and started: the exchange started by
            # the peer with the smaller PeerID goes on (the other side answers it)
            return "we started an exchange with this peer ourselves (smaller PeerID)"
        if self.busy >= cfg.max_concurrent:
            return f"{self.busy} hole punches in progress"
        if not self._count_exchange(peer):
            return f"over {cfg.max_exchanges_per_peer} exchanges per {cfg.rate_window:.0f}s"
        return None

    def _refuse(self, stream: P2PStream, kind: str, why: str) -> None:
        self.stats.refused += 1
        self._log.info(
            ("refused", kind),
            "dcutr: not answering %s: %s",
            stream.remote_peer.short(),
            why,
        )
        stream.reset()

    async def _serve(self, stream: P2PStream) -> None:
        """The ``/libp2p/dcutr`` handler (we are A)."""
        peer = stream.remote_peer
        conn = self.host.connection_of(stream)
        if not self.enabled:
            self._refuse(stream, "off", "hole punching is off")
            return
        if conn is None or not conn.relayed or not conn.outbound:
            self._refuse(
                stream, "direct", "the stream did not come over a relayed connection we dialed"
            )
            return
        if self._has_direct(peer):
            self._refuse(stream, "connected", "we already have a direct connection")
            return
        why = self._admit(peer)
        if why is not None:
            self._refuse(stream, "limit", why)
            return
        self._answering.add(peer)
        self.stats.started += 1
        started = trio.current_time()
        reason = ""
        direct = self._watch_direct(peer)
        punch = Punch(self.host, self.config, peer, outbound=True, direct=direct)
        try:
            try:
                connect = await self._receive(stream, HolePunchType.CONNECT)
                theirs = self._theirs(connect, peer)
                # B dials half a round trip after its SYNC: under load that SYN can reach
                # our listener before we read the SYNC. Claimed from now on, such a socket
                # waits for the punch instead of sitting in the accept path, where both
                # sides would wait for the other to speak first
                punch.claim(self._targets(theirs))
                ours = await self._our_addrs()
                await self._send(stream, HolePunch(HolePunchType.CONNECT, tuple(ours)))
                await self._receive(stream, HolePunchType.SYNC)
            except DCUtRMessageError as e:
                self.stats.malformed += 1
                reason = f"bad message: {e}"
                self._log.warning(
                    ("malformed", peer), "dcutr: dropping the exchange with %s: %s", peer.short(), e
                )
                stream.reset()
                return
            except _STREAM_ERRORS as e:
                reason = error_reason(e)
                self._log.info(
                    ("ended", peer),
                    "dcutr: dropping the exchange with %s: %s",
                    peer.short(),
                    reason,
                )
                stream.reset()
                return
            await stream.aclose()
            if not theirs:
                reason = f"the peer offered no address we can dial ({len(connect.addrs)} offered)"
                return
            if not ours:
                reason = "we had no address to offer"
            addr = await self._punch(peer, theirs, outbound=True, direct=direct, punch=punch)
            if addr is None:
                reason = f"no direct connection within {self.config.punch_timeout:.1f}s"
        finally:
            await punch.end()
            self._unwatch_direct(peer, direct)
            self._answering.discard(peer)
            self._conclude(peer, False, 1, trio.current_time() - started, reason)

    # -- the punch itself -----------------------------------------------------------------------
    def _targets(self, addrs: list[Multiaddr]) -> list[tuple[Multiaddr, int]]:
        """The addresses we can punch, each with our listen port of its IP version."""
        ports = listen_ports(self.host)
        targets: list[tuple[Multiaddr, int]] = []
        for addr in addrs:
            endpoint = _ip_port(addr)
            if endpoint is not None and endpoint[0].version in ports:
                targets.append((addr, ports[endpoint[0].version]))
        return targets

    async def _punch(
        self,
        peer: PeerID,
        addrs: list[Multiaddr],
        *,
        outbound: bool,
        direct: trio.Event,
        punch: Punch | None = None,
    ) -> str | None:
        """Dial every address from our listen port for ``punch_timeout`` and secure the first
        connection that comes up, ``outbound`` (A) or not (B) whichever way TCP connected;
        the direct connection's remote address, or None.

        A takes the first connection that completes its handshake and closes the rest. B
        keeps every connection that completes (A closes the ones it did not pick, and B
        cannot know which one A picked). A socket that reaches A's listener from one of B's
        addresses (no NAT in the way, or B's SYN came first) is taken over from the accept
        path so A stays the initiator; one that reaches B's listener takes the normal
        inbound path, where B is the responder anyway. ``punch``: A's, its claims made
        early."""
        targets = self._targets(addrs)
        if self._has_direct(peer):  # the peer's dial reached our listener already
            return self._direct_addr(peer)
        if not targets:
            return None
        if punch is None:
            punch = Punch(self.host, self.config, peer, outbound=outbound, direct=direct)
        winner = await punch.run(targets)
        if winner is not None:
            return winner.remote_addr
        if self._has_direct(peer):
            return self._direct_addr(peer)
        if punch.failures:
            logger.debug(
                "dcutr: punching %s failed: %s",
                peer.short(),
                "; ".join(f"{k}: {v}" for k, v in punch.failures.items()),
            )
        return None


def start_hole_punching(host: Host) -> None:
    """Host extension (see ``host.add_host_extension``): a :class:`HolePuncher` per
    ``host.hole_punching`` (what ``Host.open(hole_punching=...)`` resolved: False for off,
    else the config, None for the defaults), as ``host.hole_puncher``."""
    if host.hole_punching is False:
        return
    host.hole_puncher = HolePuncher(host, host.hole_punching)
    host.hole_puncher.start()


__all__ = [
    "BULK_DIRECT_WAIT",
    "MAX_ADDRS",
    "MAX_MESSAGE_SIZE",
    "PROTOCOL_ID",
    "DCUtRMessageError",
    "HolePunch",
    "HolePunchConfig",
    "HolePunchResult",
    "HolePunchStats",
    "HolePunchType",
    "HolePuncher",
    "decode_hole_punch",
    "dialable_addrs",
    "encode_hole_punch",
    "frame",
    "listen_ports",
    "offered_addrs",
    "start_hole_punching",
]
