"""The Host: connections to peers (TCP or in-memory -> Noise -> yamux), streams, unary RPC.

Connection establishment is libp2p's: multistream-select ``/noise`` on the raw connection,
the Noise XX handshake (which proves the remote's PeerID), multistream-select
``/yamux/1.0.0`` on the secured channel, then yamux. Between two moshpit hosts the dialer's
first proposal, ``/moshpit/noise-aesgcm/1.0.0`` (the same handshake with AES-256-GCM), is
accepted instead; a libp2p peer answers ``na`` to it and gets ``/noise``. Every stream
negotiates its protocol with multistream-select; unary RPCs negotiate *lazily* (proposal,
request and FIN leave in one write), so a call on a warm connection is one round trip.

Connections: at most one dial per peer is in flight (concurrent callers share it). If two
peers dial each other at the same moment both connections are kept; new streams then go
over the connection dialed by the peer with the smaller PeerID, so both sides pick the same
one (the other idles until it is closed with the host or the peer). Every new connection
runs libp2p identify, so the peerstore learns where a peer that dialed us listens. A peer's
addresses are dialed "happy eyeballs" style (staggered, first success wins).

The parts with a job of their own live beside this file: ``upgrade.py`` (the secure
channel), ``connection.py`` (the connection table), ``inbound.py`` + ``admission.py`` (the
accept path and who is dropped under a flood), ``dialing.py`` (happy eyeballs),
``stream.py`` (P2PStream). What stays here, about a thousand lines, is the Host itself:
they share one connection table, one nursery and one closing state (dialing with its
shared pending dials, serving connections, stream handlers, identify, ping, unary RPC,
and the public surface the protocols built on it use); splitting it further would mean
handing its private state to other modules, which the layering forbids
(``tests/p2p/test_layering.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from .._logging import RateLimitedLogger
from . import identify, multistream
from .connection import (
    Connection,
    ConnectionHook,
    ConnectionTable,
    close_quietly,
    is_loopback,
)
from .dialing import dial_first
from .errors import (
    DialError,
    MessageTooLargeError,
    P2PError,
    P2PTimeoutError,
    ProtocolViolationError,
    RemoteError,
    ResourceLimitError,
    StreamClosedError,
    error_reason,
)
from .identity import Identity, PeerID
from .inbound import Acceptor, InboundClaim, raise_open_file_limit
from .messages import DEFAULT_MAX_MESSAGE_SIZE, MessageReader
from .multiaddr import Multiaddr
from .noise import DEFAULT_SECURITY_PROTOCOLS
from .peerstore import PeerStore
from .reachability import ObservedAddrs, Reachability
from .stream import P2PStream
from .transport import TCPTransport
from .upgrade import check_security_protocols, secure_channel
from .yamux import (
    DEFAULT_MAX_STREAM_WINDOW,
    GO_AWAY_PROTOCOL_ERROR,
    INITIAL_WINDOW,
    YamuxSession,
    YamuxStream,
)

logger = logging.getLogger(__name__)

NOISE_PROTOCOL = "/noise"
PING_PROTOCOL = "/ipfs/ping/1.0.0"
PING_SIZE = 32

StreamHandler = Callable[[P2PStream], Awaitable[None]]
RpcHandler = Callable[[PeerID, Any], Awaitable[Any]]
# see Host.add_dialer, Host.add_connection_hook, Host.claim_inbound, add_host_extension
Dialer = Callable[[PeerID | None, Multiaddr], Awaitable[Connection]]
HostExtension = Callable[["Host"], None]


@dataclass
class HostLimits:
    """Resource limits of a Host. Everything a remote can make us allocate is bounded here."""

    max_connections: int = 512
    # inbound handshakes whose dialer has spoken (sent its multistream header and security
    # proposal): these cost Noise work, so few run at once
    max_pending_handshakes: int = 64
    # accepted sockets that have not spoken yet: only a descriptor and a task each, so many are
    # held (fewer if the open-file limit is low) and a flood of idle sockets does not churn
    # through them faster than a newcomer can say its first bytes
    max_silent_connections: int = 1024
    max_pending_handshakes_per_source: int = 8  # silent or not, per IPv4 address / IPv6 /64
    max_streams_per_connection: int = 1024
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    stream_window: int = INITIAL_WINDOW
    max_stream_window: int = DEFAULT_MAX_STREAM_WINDOW
    max_buffered_per_connection: int = 64 * 1024 * 1024
    handshake_timeout: float = 10.0
    # inbound: the dialer's multistream header and /noise proposal must arrive by then, so a
    # silent socket frees its pending-handshake slot long before handshake_timeout
    handshake_start_timeout: float = 2.0
    negotiation_timeout: float = 10.0  # inbound stream: protocol proposal must arrive by then
    rpc_request_timeout: float = 30.0  # inbound RPC: the request must arrive by then
    keepalive_interval: float | None = 15.0
    keepalive_timeout: float = 20.0
    log_interval: float = 10.0  # repetitive WARNINGs (refused connections...): one per interval

    def __post_init__(self) -> None:
        for name in (
            "max_pending_handshakes",
            "max_silent_connections",
            "max_pending_handshakes_per_source",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HostLimits.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("handshake_timeout", "handshake_start_timeout", "log_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HostLimits.{name} must be positive, got {getattr(self, name)}")


class _PendingDial:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.connection: Connection | None = None
        self.error: BaseException | None = None


_extensions: list[HostExtension] = []


def add_host_extension(extension: HostExtension) -> None:
    """Run ``extension(host)`` in every Host that :meth:`Host.open` starts from now on,
    before its block runs.

    This is how the protocols built on the Host plug into it without ``host.py`` importing
    them (the dependency points one way: they import the Host, never the reverse).
    ``dht/p2p/__init__.py`` registers the defaults: dialing ``/p2p-circuit`` addresses
    (``relay.py``) and hole punching per ``Host.open(hole_punching=...)`` (``dcutr.py``).
    An extension uses the Host's public surface only (see the class docstring)."""
    if extension not in _extensions:
        _extensions.append(extension)


class Host:
    """A libp2p-compatible host. Create it with ``async with Host.open(...) as host``.

    Besides the user API (connect, streams, RPC, ping, observers; docs/internal-api.md), the
    Host offers a small surface to the protocols built on it (``relay.py``, ``dcutr.py``,
    ``autonat.py``), which use nothing else of it:

    * reading connections: :meth:`connections`, :meth:`best_connection`,
      :meth:`connection_of` (a stream's), :attr:`listeners`, :attr:`listen_addrs`,
      :attr:`closing`;
    * adding connections: :meth:`upgrade` / :meth:`upgrade_raw_connection` secure a raw
      stream, then :meth:`add_connection` (served in the host's nursery) or
      :meth:`serve_connection` (in the caller's task) registers it; :meth:`make_room` checks
      the connection limit first; :meth:`add_dialer` dials addresses the transport cannot;
    * being told: :meth:`add_connection_hook` (every connection as it registers),
      :meth:`claim_inbound` (sockets from one remote, before the accept path);
    * acting: :meth:`open_stream` (a stream under the caller's deadline),
      :meth:`set_stream_handler`, :meth:`supports`, :meth:`add_listen_addr`,
      :meth:`protect`, :meth:`start_soon` (a task in the host's nursery).

    Those protocols plug into every Host through :func:`add_host_extension`; ``host.py``
    imports none of them.
    """

    def __init__(
        self,
        identity: Identity,
        transport: Any,
        limits: HostLimits,
        nursery: trio.Nursery,
        security_protocols: Sequence[str] = DEFAULT_SECURITY_PROTOCOLS,
        hole_punching: Any = False,
    ) -> None:
        self.identity = identity
        self.security_protocols = check_security_protocols(security_protocols)
        self.peer_id: PeerID = identity.peer_id
        self.transport = transport
        self.limits = limits
        self.peerstore = PeerStore()
        # where peers see us (identify) and whether they can reach us (set by autonat.AutoNAT)
        self.observed_addrs = ObservedAddrs()
        self.reachability = Reachability()
        self._nursery = nursery
        self._listeners: list[Any] = []
        self._listen_addrs: list[Multiaddr] = []
        # registered connections per peer (the table's dict: tests read it as host._conns)
        self._table = ConnectionTable(self.peer_id, logger)
        self._conns = self._table.by_peer
        self._dials: dict[PeerID, _PendingDial] = {}
        # One WARNING per category and interval under abuse (trio's clock: MockClock-friendly).
        self._log = RateLimitedLogger(logger, limits.log_interval, clock=trio.current_time)
        # the accept path (inbound.py): claims, admission of pending handshakes, upgrades;
        # each socket's task is looked up as self._handle_inbound when it starts
        self._acceptor = Acceptor(self, self._log, lambda *args: self._handle_inbound(*args))
        self._admission = self._acceptor.admission
        self._inbound_claims = self._acceptor.claims
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._rpc_handlers: dict[str, RpcHandler] = {}
        # What identify tells peers about where we listen (None: our listen addresses). The
        # DHT sets it to the addresses it announces (a forwarded public port; only circuit
        # addresses while unreachable), so peers do not first try a LAN address they cannot reach.
        self.announced_addrs: Callable[[], list[Multiaddr]] | None = None
        self._closing = False
        # the extension points (see the class docstring)
        self._dialers: list[tuple[Callable[[Multiaddr], bool], Dialer]] = []
        # Host.open's hole_punching, checked: False (off), or the config of the hole puncher
        # (None: its defaults) that the hole-punching extension starts
        self.hole_punching = hole_punching
        self.hole_puncher: Any = None  # dcutr.HolePuncher, while hole punching is on
        self._stream_handlers[PING_PROTOCOL] = self._serve_ping
        self._stream_handlers[identify.PROTOCOL_ID] = self._serve_identify

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        identity: Identity | None = None,
        transport: Any = None,
        limits: HostLimits | None = None,
        security_protocols: Sequence[str] = DEFAULT_SECURITY_PROTOCOLS,
        hole_punching: Any = None,
    ) -> AsyncIterator[Host]:
        """Run a host for the duration of the block; leaving it closes everything it owns.

        ``security_protocols``: what this host dials with (proposed in this order) and accepts;
        ``("/noise",)`` turns the AES-GCM variant off (libp2p's ChaChaPoly only).
        ``hole_punching``: DCUtR (``dcutr.py``), upgrading relayed connections to direct ones.
        ``None`` (default): on over a TCP transport that can share ports, off otherwise;
        ``True`` / ``False``; or a ``dcutr.HolePunchConfig``. ``host.hole_puncher`` is the
        service while it is on (``host.hole_puncher.stop()`` turns it off later)."""
        security_protocols = check_security_protocols(security_protocols)  # before any task
        transport = transport if transport is not None else TCPTransport()
        hole_punching = _hole_punching_setting(transport, hole_punching)
        async with trio.open_nursery() as nursery:
            host = cls(
                identity or Identity.generate(),
                transport,
                limits or HostLimits(),
                nursery,
                security_protocols,
                hole_punching,
            )
            for extension in list(_extensions):
                extension(host)
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True):
                    await host._close()
                nursery.cancel_scope.cancel()

    @property
    def closing(self) -> bool:
        """The host is shutting down: it accepts, dials and registers nothing new."""
        return self._closing

    async def _close(self) -> None:
        self._closing = True
        self._log.flush(force=True)
        for listener in self._listeners:
            try:
                await listener.aclose()
            except (OSError, trio.ClosedResourceError):
                pass
        self._listeners.clear()
        conns = [c for group in self._conns.values() for c in group]
        with trio.move_on_after(1.0):
            async with trio.open_nursery() as nursery:
                for conn in conns:
                    nursery.start_soon(conn.session.aclose)
        for conn in conns:
            conn.session._shutdown("host closed")

    # -- listening -----------------------------------------------------------------------
    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """Where we can be reached (with ``/p2p/<id>``): our listeners' addresses, then those
        added with :meth:`add_listen_addr`. What identify tells peers unless
        ``announced_addrs`` says otherwise."""
        return list(self._listen_addrs)

    @property
    def listeners(self) -> tuple[Any, ...]:
        """The transport listeners accepting for us (hole punching reads their ports)."""
        return tuple(self._listeners)

    def add_listen_addr(self, addr: Multiaddr) -> None:
        """List ``addr`` among our listen addresses (once) although no listener of ours is
        bound to it: a relay's circuit address through which we can be reached."""
        if addr not in self._listen_addrs:
            self._listen_addrs.append(addr)

    def remove_listen_addr(self, addr: Multiaddr) -> None:
        """Stop listing ``addr`` (e.g. the relay slot behind it was lost); no-op if absent."""
        if addr in self._listen_addrs:
            self._listen_addrs.remove(addr)

    async def listen(self, maddrs: Iterable[Multiaddr | str]) -> list[Multiaddr]:
        """Start accepting connections; returns the actual addresses, with ``/p2p/<id>``."""
        self._acceptor.fit_silent_cap_to_file_limit()
        added: list[Multiaddr] = []
        for maddr in maddrs:
            for listener in await self.transport.listen(Multiaddr(maddr)):
                self._listeners.append(listener)
                # a wildcard listener (0.0.0.0 / ::) is announced with concrete addresses
                for bound in getattr(listener, "multiaddrs", [listener.multiaddr]):
                    addr = bound.with_peer_id(self.peer_id)
                    self._listen_addrs.append(addr)
                    added.append(addr)
                self._nursery.start_soon(self._acceptor.run, listener)
        return added

    async def _handle_inbound(self, raw: trio.abc.Stream, remote: str, pending: Any) -> None:
        """One admitted inbound socket: upgrade it as the responder and serve it."""
        await self._acceptor.handle(raw, remote, pending)

    # admission's tables under the names tests watch
    _handshakes = property(lambda self: self._admission.handshakes)
    _handshakes_by_source = property(lambda self: self._admission.by_source)
    _silent_by_source = property(lambda self: self._admission.silent_by_source)
    _sources_by_silent_count = property(lambda self: self._admission.sources_by_silent_count)
    _spoken = property(lambda self: self._admission.spoken)
    _silent_count = property(lambda self: self._admission.silent_count)
    _pending_handshakes = property(lambda self: self._admission.pending_count)

    # -- upgrading a raw connection ------------------------------------------------------
    async def upgrade(
        self,
        raw: trio.abc.Stream,
        expected: PeerID | None,
        *,
        outbound: bool,
        name: str,
        on_security_negotiated: Callable[[], None] | None = None,
    ) -> Connection:
        """Secure and multiplex ``raw`` in the given role and return the connection, not
        registered; ``name`` becomes its ``remote_addr``. The bare step: no deadline and no
        cleanup, the caller bounds it and closes (or resets) ``raw`` if it fails (relay.py
        over a circuit, the accept path); :meth:`upgrade_raw_connection` does both.
        ``on_security_negotiated`` runs once a security protocol is agreed on."""
        peer_id, muxed = await secure_channel(
            raw,
            self.identity,
            self.security_protocols,
            outbound=outbound,
            expected=expected,
            timeout=self.limits.handshake_timeout,
            on_security_negotiated=on_security_negotiated,
        )
        limits = self.limits
        session = YamuxSession(
            muxed,
            is_client=outbound,
            stream_window=limits.stream_window,
            max_stream_window=limits.max_stream_window,
            max_streams=limits.max_streams_per_connection,
            max_buffered=limits.max_buffered_per_connection,
            keepalive_interval=limits.keepalive_interval,
            keepalive_timeout=limits.keepalive_timeout,
            name=f"{peer_id.short()}@{name}",
        )
        return Connection(peer_id, session, outbound=outbound, remote_addr=name)

    async def upgrade_raw_connection(
        self,
        raw: trio.abc.Stream,
        expected: PeerID,
        *,
        outbound: bool,
        name: str,
    ) -> Connection:
        """Secure and multiplex an already connected raw stream in the given role and return
        the connection, not yet registered (:meth:`add_connection` does that).

        ``outbound=True``: this side is the initiator of multistream-select, Noise and yamux,
        whichever socket "connected" (hole punching: a TCP simultaneous open has no dialer;
        the roles come from the protocol that set it up). The remote must prove ``expected``
        within ``handshake_timeout``; on any failure ``raw`` is closed and the error raised
        (P2PError, OSError, trio.BrokenResourceError...)."""
        if self._closing:
            await close_quietly(raw)
            raise DialError("host is closing")
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                return await self.upgrade(raw, expected, outbound=outbound, name=name)
        except trio.TooSlowError:
            await close_quietly(raw)
            raise P2PTimeoutError(
                f"handshake with {expected.short()} over {name} did not finish within "
                f"{self.limits.handshake_timeout:.1f}s"
            ) from None
        except BaseException:
            await close_quietly(raw)
            raise

    # -- connection bookkeeping ----------------------------------------------------------
    def _register(self, conn: Connection) -> None:
        """Make a new connection usable at once (before its serving task starts)."""
        self._table.add(conn)

    def _start_serving(self, conn: Connection) -> None:
        """Register a new connection and serve it in a task of the host's nursery."""
        self._register(conn)
        self._nursery.start_soon(self._serve_connection, conn)

    async def add_connection(self, conn: Connection) -> bool:
        """Register an upgraded connection and serve it (a task in the host nursery), as
        dialing does: new streams to its peer may take it at once. False, and the connection
        closed, if the host is closing or the connection limit is full of busy connections."""
        if self._closing or not self._make_room():
            await close_quietly(conn.session)
            return False
        self._start_serving(conn)
        return True

    async def serve_connection(self, conn: Connection) -> None:
        """Register an upgraded connection and serve it in the calling task until it closes,
        for a protocol whose own bookkeeping lasts as long as the connection (relay.py counts
        the relayed connections it accepted). Closed at once if the host is closing. Unlike
        :meth:`add_connection` it does not make room: call :meth:`make_room` first."""
        if self._closing:
            await conn.session.aclose()
            return
        self._register(conn)
        await self._serve_connection(conn)

    async def _serve_connection(self, conn: Connection) -> None:
        """Run a registered connection until it closes (a task in the host nursery)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.session.run)
            nursery.start_soon(self._identify_peer, conn)
            while True:
                try:
                    ystream = await conn.session.accept_stream()
                except StreamClosedError:
                    break
                nursery.start_soon(self._handle_stream, conn, ystream)

    def _drop(self, conn: Connection, reason: str) -> None:
        """Close a connection whose peer broke the protocol (GoAway with an error code)."""
        logger.warning("dropping peer %s (%s): %s", conn.peer_id.short(), conn.remote_addr, reason)
        if self._closing:
            conn.session._shutdown(f"dropped: {reason}")
        else:
            self._nursery.start_soon(conn.session.aclose, GO_AWAY_PROTOCOL_ERROR)

    def add_connection_observer(
        self, on_connect: Callable[[PeerID], None], on_disconnect: Callable[[PeerID], None]
    ) -> None:
        """Call ``on_connect(peer)`` when the first connection to a peer opens and
        ``on_disconnect(peer)`` when its last one closes."""
        self._table.observers.append((on_connect, on_disconnect))

    def remove_connection_observer(
        self, on_connect: Callable[[PeerID], None], on_disconnect: Callable[[PeerID], None]
    ) -> None:
        """Stop calling a pair given to :meth:`add_connection_observer` (no-op if absent)."""
        pair = (on_connect, on_disconnect)
        self._table.observers[:] = [o for o in self._table.observers if o != pair]

    def connections(self, peer_id: PeerID | None = None) -> list[Connection]:
        """The live connections to ``peer_id`` (to every peer if None), oldest first.

        A snapshot to read: connections come and go through the Host only (dialing,
        accepting, :meth:`add_connection`, :meth:`serve_connection`)."""
        return self._table.live(peer_id)

    def connection_of(self, stream: P2PStream) -> Connection | None:
        """The registered connection ``stream`` runs on (None once that one is gone): a
        protocol asks whether a request came over a relay."""
        return self._table.of_session(stream.remote_peer, stream.session)

    def best_connection(self, peer_id: PeerID) -> Connection | None:
        """The connection new streams to ``peer_id`` take (None if there is no live one): a
        direct one before a relayed one; between simultaneous dials, the one dialed by the
        peer with the smaller PeerID, so that both sides pick the same."""
        return self._table.best(peer_id)

    _best_connection = best_connection  # the name tests use

    def is_connected(self, peer_id: PeerID) -> bool:
        return self.best_connection(peer_id) is not None

    def last_heard_from(self, peer_id: PeerID) -> float | None:
        """When bytes last arrived from ``peer_id`` on any live connection (trio time), or
        None without one: tells a peer that is slow to answer (its link is full) from one
        that is gone."""
        times = [c.session.last_received for c in self._conns.get(peer_id, ())]
        return max(times) if times else None

    def bytes_received_from(self, peer_id: PeerID) -> int | None:
        """Bytes received from ``peer_id`` so far over its live connections (None without
        one). A wait that sees this grow waits for a full link, not for a peer that stopped
        sending (what a round's stall limits must tell apart); pings and small RPCs move it
        by a few bytes only."""
        conns = self._conns.get(peer_id, ())
        return sum(c.session.bytes_received for c in conns) if conns else None

    def bytes_sent_to(self, peer_id: PeerID) -> int | None:
        """Bytes sent to ``peer_id`` so far over its live connections (None without one):
        the other direction of :meth:`bytes_received_from`."""
        conns = self._conns.get(peer_id, ())
        return sum(c.session.bytes_sent for c in conns) if conns else None

    def connection_counts(self) -> dict[str, int]:
        """Live connections by kind: ``{"direct": n, "relayed": m}`` (for monitoring).

        Safe to call from another thread: it counts a snapshot of the bookkeeping, which
        the loop may change meanwhile."""
        return self._table.counts()

    def connected_peers(self) -> list[PeerID]:
        return self._table.peers()

    async def disconnect(self, peer_id: PeerID) -> None:
        """Close every connection to ``peer_id`` (GoAway, then close)."""
        for conn in list(self._conns.get(peer_id, ())):
            await conn.session.aclose()
        await trio.lowlevel.checkpoint()

    # -- extension points (see the class docstring) -------------------------------------
    def add_connection_hook(self, hook: ConnectionHook) -> None:
        """Call ``hook(conn)`` with every connection as it is registered, before any stream
        runs on it (hole punching watches for relayed and direct ones). A hook must not block;
        one that raises is logged and the others still run."""
        self._table.hooks.append(hook)

    def remove_connection_hook(self, hook: ConnectionHook) -> None:
        if hook in self._table.hooks:
            self._table.hooks.remove(hook)

    def claim_inbound(self, remote: str, claim: InboundClaim) -> bool:
        """Offer sockets accepted from exactly ``remote`` (``ip:port`` as the listener names
        it) to ``claim(raw, remote)`` before the accept path: True from it means it took the
        socket over (hole punching upgrades it in its own role). False, and nothing changed,
        if another claim holds ``remote``; :meth:`release_inbound` ends it."""
        if remote in self._inbound_claims:
            return False
        self._inbound_claims[remote] = claim
        return True

    def release_inbound(self, remote: str, claim: InboundClaim) -> None:
        """End ``claim`` on ``remote`` (no-op if another holds it or it was released)."""
        if self._inbound_claims.get(remote) is claim:
            del self._inbound_claims[remote]

    def add_dialer(self, matches: Callable[[Multiaddr], bool], dial: Dialer) -> None:
        """Dial the addresses ``matches`` accepts with ``await dial(expected, addr)`` instead
        of the transport (relay.py: ``/p2p-circuit`` addresses). ``dial`` returns an upgraded
        connection, unregistered, proving ``expected`` when that is not None; the Host
        registers it as any dialed connection. The first matching dialer is used."""
        self._dialers.append((matches, dial))

    def start_soon(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``async_fn(*args)`` in the host's nursery: cancelled when the host closes."""
        self._nursery.start_soon(async_fn, *args)

    def make_room(self) -> bool:
        """True if one more connection fits the connection limit, closing the least recently
        used idle connection (no streams, peer not protected) to make room when needed;
        False if every connection is busy."""
        return self._make_room()

    # -- dialing -------------------------------------------------------------------------
    async def connect(
        self,
        addrs: Sequence[Multiaddr | str] | Multiaddr | str,
        peer_id: PeerID | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> PeerID:
        """Connect (or reuse a connection) and return the remote's proven PeerID.

        Raises DialError (each address' failure listed), PeerIDMismatchError if the remote is
        not ``peer_id`` (or the ``/p2p/`` id in the address), P2PTimeoutError.
        """
        if isinstance(addrs, (str, Multiaddr)):
            addrs = [addrs]
        maddrs = [Multiaddr(a) for a in addrs]
        if peer_id is None:
            ids = {m.peer_id for m in maddrs if m.peer_id is not None}
            if len(ids) > 1:
                raise ValueError("the addresses name different peers; pass peer_id explicitly")
            peer_id = ids.pop() if ids else None
        if peer_id is None:
            return await self._dial_unknown(maddrs, timeout)
        if peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        self.peerstore.add_addrs(peer_id, maddrs)
        current = self.best_connection(peer_id)
        direct = [m for m in maddrs if not m.is_circuit()]
        if current is not None and current.relayed and direct:
            await self._dial_beside_relayed(peer_id, direct, timeout)
            return peer_id
        await self._get_connection(peer_id, timeout)
        return peer_id

    async def _dial_beside_relayed(
        self,
        peer_id: PeerID,
        addrs: list[Multiaddr],
        timeout: float,  # noqa: ASYNC109
    ) -> None:
        """Dial direct addresses of a peer we reach only through a relay; new streams then
        take the direct connection (the relayed one idles until its relay's limits end it)."""
        self._check_connection_limit()
        with trio.move_on_after(timeout) as scope:
            conn = await self._dial_addrs(peer_id, addrs)
        if scope.cancelled_caught:
            raise P2PTimeoutError(f"could not connect to {peer_id.short()} within {timeout:.1f}s")
        if self._closing:
            await conn.session.aclose()
            raise DialError("host is closing")
        self._start_serving(conn)

    async def dial_new_connection(
        self,
        peer_id: PeerID,
        addrs: Sequence[Multiaddr | str],
        timeout: float = 10.0,  # noqa: ASYNC109 - the documented API takes a timeout
        *,
        identity: Identity | None = None,
    ) -> Multiaddr:
        """Dial ``peer_id`` at ``addrs`` on a connection of its own (even if one is open),
        prove its PeerID, close it; returns the address that worked. AutoNAT's dial-back:
        reusing the connection a request came on would prove nothing about reachability.

        With ``identity`` the handshake proves that key instead of ours, so the remote does
        not count this short-lived connection as one to us (it might pick it for its next
        streams to us, and it is about to close)."""
        if peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        if self._closing:
            raise DialError("host is closing")
        self._check_connection_limit()
        dialer = self
        if identity is not None:  # a host object that only dials: no tasks, never registers
            dialer = Host(
                identity, self.transport, self.limits, self._nursery, self.security_protocols
            )
            for extension in list(_extensions):  # its own circuit dialer (hole punching off)
                extension(dialer)
        with trio.move_on_after(timeout) as scope:
            conn = await dialer._dial_addrs(peer_id, [Multiaddr(a) for a in addrs])
        if scope.cancelled_caught:
            raise P2PTimeoutError(f"could not connect to {peer_id.short()} within {timeout:.1f}s")
        await close_quietly(conn.session)  # never registered nor run: nothing else uses it
        return Multiaddr(conn.remote_addr)

    def _check_connection_limit(self) -> None:
        if not self._make_room(len(self._dials)):
            raise ResourceLimitError(
                f"connection limit reached ({self.limits.max_connections} connections/dials, "
                "all of them busy)"
            )

    def protect(self, peer_id: PeerID, tag: str) -> None:
        """Never close connections to ``peer_id`` to make room while ``tag`` holds (a relay
        reservation lives exactly as long as its connection, which idles between circuits)."""
        self._table.protect(peer_id, tag)

    def unprotect(self, peer_id: PeerID, tag: str) -> None:
        self._table.unprotect(peer_id, tag)

    def is_protected(self, peer_id: PeerID) -> bool:
        return peer_id in self._table.protected

    def _make_room(self, reserved: int = 0) -> bool:
        """make_room, counting ``reserved`` dials under way as connections."""
        return self._table.make_room(self.limits.max_connections, reserved)

    async def _dial_unknown(self, maddrs: list[Multiaddr], timeout: float) -> PeerID:  # noqa: ASYNC109
        self._check_connection_limit()
        with trio.move_on_after(timeout) as scope:
            conn = await self._dial_addrs(None, maddrs)
            existing = self.best_connection(conn.peer_id)
            self.peerstore.add_addrs(conn.peer_id, maddrs)
            if existing is not None:
                await conn.session.aclose()
                return conn.peer_id
            self._start_serving(conn)
            return conn.peer_id
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"could not connect to {[str(m) for m in maddrs]} within {timeout}s")

    async def _get_connection(self, peer_id: PeerID, timeout: float) -> Connection:  # noqa: ASYNC109
        conn = self.best_connection(peer_id)
        if conn is not None:
            return conn
        if self._closing:
            raise DialError("host is closing")
        pending = self._dials.get(peer_id)
        if pending is None:
            self._check_connection_limit()
            pending = _PendingDial()
            self._dials[peer_id] = pending
            self._nursery.start_soon(self._dial_task, peer_id, pending, timeout)
        with trio.move_on_after(timeout) as scope:
            await pending.done.wait()
        if scope.cancelled_caught:
            raise P2PTimeoutError(f"could not connect to {peer_id.short()} within {timeout:.1f}s")
        if pending.error is not None:
            raise pending.error
        assert pending.connection is not None
        return pending.connection

    async def _dial_task(self, peer_id: PeerID, pending: _PendingDial, timeout: float) -> None:  # noqa: ASYNC109
        try:
            with trio.move_on_after(timeout) as scope:
                addrs = self.peerstore.get_addrs(peer_id)
                if not addrs:
                    raise DialError(f"no known addresses for {peer_id.short()}")
                pending.connection = await self._dial_addrs(peer_id, addrs)
            if scope.cancelled_caught:
                pending.error = P2PTimeoutError(
                    f"could not connect to {peer_id.short()} within {timeout:.1f}s"
                )
        except P2PError as e:
            pending.error = e
        finally:
            self._dials.pop(peer_id, None)
        conn = pending.connection
        if conn is not None:
            if self._closing:
                await conn.session.aclose()
                pending.connection, pending.error = None, DialError("host is closing")
            else:
                self._start_serving(conn)
        pending.done.set()

    async def _dial_addrs(self, expected: PeerID | None, addrs: list[Multiaddr]) -> Connection:
        """Dial the addresses "happy eyeballs" style (dialing.py) and return the first
        upgraded connection, not registered."""
        return await dial_first(addrs, partial(self._dial_one, expected), expected, logger)

    async def _dial_one(self, expected: PeerID | None, target: Multiaddr) -> Connection:
        for matches, dial in self._dialers:
            if matches(target):
                return await dial(expected, target)
        if not self.transport.can_dial(target):
            raise DialError("transport cannot dial this address")
        raw = await self.transport.dial(target, timeout=self.limits.handshake_timeout)
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                return await self.upgrade(raw, expected, outbound=True, name=str(target))
        except BaseException:
            await close_quietly(raw)
            raise

    # -- streams -------------------------------------------------------------------------
    def set_stream_handler(self, protocol: str, handler: StreamHandler | None) -> None:
        """Serve ``protocol`` with ``async def handler(stream: P2PStream)`` (None removes it)."""
        self._rpc_handlers.pop(protocol, None)
        if handler is None:
            self._stream_handlers.pop(protocol, None)
        else:
            self._stream_handlers[protocol] = handler

    def set_rpc_handler(self, protocol: str, fn: RpcHandler | None) -> None:
        """Serve ``protocol`` as unary RPC with ``async def fn(peer, request) -> response``."""
        self._stream_handlers.pop(protocol, None)
        if fn is None:
            self._rpc_handlers.pop(protocol, None)
        else:
            self._rpc_handlers[protocol] = fn

    def supports(self, protocol: str) -> bool:
        """Do we serve ``protocol`` (as a stream handler or an RPC)?"""
        return protocol in self._stream_handlers or protocol in self._rpc_handlers

    _supports = supports  # the name tests use

    async def new_stream(
        self,
        peer_id: PeerID,
        protocol: str,
        timeout: float = 10.0,  # noqa: ASYNC109 - the documented API takes a timeout
        *,
        lazy: bool = False,
        direct_wait: float = 0.0,
    ) -> P2PStream:
        """Open a stream speaking ``protocol`` (dialing via the peerstore if needed).

        With ``lazy=True`` the protocol proposal is sent along with the first data and a
        refusal surfaces as ProtocolNegotiationError on the first read (saves a round trip).
        ``direct_wait``: for bulk transfers, seconds the stream may wait for a hole punch that
        is under way (or that our relayed dial starts) rather than take the relayed
        connection (``dcutr.HolePuncher.wait_for_direct``); within ``timeout``.
        """
        with trio.move_on_after(timeout) as scope:
            return await self.open_stream(
                peer_id, protocol, timeout, lazy=lazy, direct_wait=direct_wait
            )
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"opening {protocol} to {peer_id.short()} timed out after {timeout}s")

    async def open_stream(
        self,
        peer_id: PeerID,
        protocol: str,
        timeout: float,  # noqa: ASYNC109 - bounds the dial only, see the docstring
        *,
        lazy: bool = False,
        direct_wait: float = 0.0,
    ) -> P2PStream:
        """:meth:`new_stream` without a deadline of its own: ``timeout`` bounds waiting for a
        dial, the caller bounds the whole (protocols that put several steps under one
        deadline: a relay request and its answer, an RPC)."""
        conn = await self._get_connection(peer_id, timeout)
        if conn.relayed and direct_wait > 0 and self.hole_puncher is not None:
            if await self.hole_puncher.wait_for_direct(peer_id, direct_wait):
                conn = self.best_connection(peer_id) or conn
        ystream = await conn.session.open_stream()
        conn.last_used = trio.current_time()
        try:
            _, stream = await multistream.negotiate_outbound(
                ystream, [protocol], timeout, lazy=lazy
            )
        except BaseException:
            ystream.reset()
            raise
        return P2PStream(stream, ystream, peer_id, protocol, self.limits.max_message_size)

    async def _handle_stream(self, conn: Connection, ystream: YamuxStream) -> None:
        conn.last_used = trio.current_time()
        try:
            protocol, stream = await multistream.negotiate_inbound(
                ystream, self.supports, self.limits.negotiation_timeout
            )
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as e:
            logger.debug("stream from %s: negotiation failed: %s", conn.peer_id.short(), e)
            # FIN rather than RST: a lazy dialer must still get to read our "na" answer.
            await ystream.aclose()
            return
        p2p = P2PStream(
            stream, ystream, conn.peer_id, protocol, self.limits.max_message_size, conn.remote_addr
        )
        rpc = self._rpc_handlers.get(protocol)
        try:
            if rpc is not None:
                await self._serve_rpc(p2p, rpc)
            else:
                handler = self._stream_handlers.get(protocol)
                if handler is None:  # removed after negotiation
                    raise StreamClosedError(f"no handler for {protocol} any more")
                await handler(p2p)
        except (StreamClosedError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            logger.debug("%s handler: stream from %s ended: %s", protocol, conn.peer_id.short(), e)
            p2p.reset()
        except (MessageTooLargeError, ProtocolViolationError) as e:
            p2p.reset()
            self._drop(conn, f"{protocol}: {error_reason(e)}")
        except P2PError as e:
            logger.info("%s handler: peer %s: %s", protocol, conn.peer_id.short(), error_reason(e))
            p2p.reset()
        except Exception:
            logger.exception(
                "%s handler failed on a stream from %s", protocol, conn.peer_id.short()
            )
            p2p.reset()
        else:
            await p2p.aclose()

    # -- identify ------------------------------------------------------------------------
    def _identify_info(self, remote_addr: str) -> identify.IdentifyInfo:
        protocols = set(self._stream_handlers) | set(self._rpc_handlers)
        if self.hole_puncher is not None:
            protocols.difference_update(self.hole_puncher.hidden_protocols())
        return identify.IdentifyInfo(
            listen_addrs=self.listen_addrs
            if self.announced_addrs is None
            else self.announced_addrs(),
            protocols=sorted(protocols),
            observed_addr=identify.observed_multiaddr(remote_addr),
            public_key=self.peer_id.public_key_proto(),
            agent_version=identify.AGENT_VERSION,
            protocol_version=identify.PROTOCOL_VERSION,
        )

    async def _serve_identify(self, stream: P2PStream) -> None:
        await stream.send_all(identify.encode_identify(self._identify_info(stream.remote_addr)))

    async def _identify_peer(self, conn: Connection) -> None:
        """Learn where a newly connected peer listens (so it can be redialed later)."""
        try:
            await self._identify_exchange(conn)
        finally:
            conn.identified.set()

    async def _identify_exchange(self, conn: Connection) -> None:
        with trio.move_on_after(self.limits.handshake_timeout):
            try:
                ystream = await conn.session.open_stream()
            except P2PError:
                return
            try:
                _, stream = await multistream.negotiate_outbound(
                    ystream, [identify.PROTOCOL_ID], self.limits.handshake_timeout, lazy=True
                )
                await stream.send_eof()  # sends the proposal; we have nothing else to say
                body = await MessageReader(stream).receive_frame(identify.MAX_MESSAGE_SIZE)
                info = identify.decode_identify(body, conn.peer_id)
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                logger.debug("identify %s: %s", conn.peer_id.short(), error_reason(e))
                ystream.reset()
                return
            except Exception as e:  # untrusted input must not crash the connection's tasks
                logger.warning(
                    "identify %s: unexpected %s",
                    conn.peer_id.short(),
                    error_reason(e),
                    exc_info=True,
                )
                ystream.reset()
                return
            await ystream.aclose()
            conn.remote_protocols = frozenset(info.protocols)
            if not conn.relayed:  # over a circuit the remote sees the relay, not us
                self.observed_addrs.record(conn.peer_id, info.observed_addr)
            addrs = [a for a in info.listen_addrs if a.is_circuit() or self.transport.can_dial(a)]
            if not is_loopback(conn.remote_addr):
                addrs = [a for a in addrs if not is_loopback(str(a))]
            if addrs:
                self.peerstore.add_addrs(conn.peer_id, addrs)

    async def _serve_ping(self, stream: P2PStream) -> None:
        """/ipfs/ping/1.0.0: echo 32-byte payloads until the dialer closes."""
        while True:
            try:
                payload = await stream.receive_exactly(PING_SIZE)
            except StreamClosedError:
                return
            await stream.send_all(payload)

    async def ping(self, peer_id: PeerID, timeout: float = 5.0) -> float:  # noqa: ASYNC109
        """Round-trip time (seconds) of one /ipfs/ping/1.0.0 exchange."""
        with trio.move_on_after(timeout) as scope:
            stream = await self.open_stream(peer_id, PING_PROTOCOL, timeout, lazy=True)
            try:
                payload = os.urandom(PING_SIZE)
                start = trio.current_time()
                await stream.send_all(payload)
                echo = await stream.receive_exactly(PING_SIZE)
                rtt = trio.current_time() - start
                if echo != payload:
                    raise ProtocolViolationError(
                        f"{peer_id.short()} answered ping with other bytes"
                    )
            except BaseException:
                stream.reset()
                raise
            await stream.aclose()
            return rtt
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"ping to {peer_id.short()} timed out after {timeout}s")

    # -- unary RPC -----------------------------------------------------------------------
    async def call(
        self,
        peer_id: PeerID,
        protocol: str,
        request: Any,
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> Any:
        """Unary RPC: one request message, one response message (see docs/network.md).

        Raises RemoteError if the remote handler failed, P2PTimeoutError on timeout,
        ProtocolNegotiationError if the remote does not serve ``protocol``.
        """
        with trio.move_on_after(timeout) as scope:
            stream = await self.open_stream(peer_id, protocol, timeout, lazy=True)
            try:
                await stream.send_msg(request)
                await stream.send_eof()
                response = await stream.receive_msg()
            except BaseException:
                stream.reset()
                raise
            await stream.aclose()
            if isinstance(response, dict) and len(response) == 1:
                if "ok" in response:
                    return response["ok"]
                if "err" in response and isinstance(response["err"], str):
                    raise RemoteError(response["err"][:4096])
            raise ProtocolViolationError(
                f"{peer_id.short()} sent a malformed RPC response on {protocol}"
            )
        assert scope.cancelled_caught
        raise P2PTimeoutError(f"{protocol} call to {peer_id.short()} timed out after {timeout}s")

    async def _serve_rpc(self, stream: P2PStream, fn: RpcHandler) -> None:
        with trio.move_on_after(self.limits.rpc_request_timeout) as scope:
            request = await stream.receive_msg()
        if scope.cancelled_caught:
            raise P2PTimeoutError(f"no request within {self.limits.rpc_request_timeout:.1f}s")
        try:
            result = await fn(stream.remote_peer, request)
            await stream.send_msg({"ok": result})
        except (StreamClosedError, trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as e:
            logger.warning(
                "%s handler raised for a request from %s: %r",
                stream.protocol,
                stream.remote_peer.short(),
                e,
            )
            logger.debug("handler traceback", exc_info=True)
            await stream.send_msg({"err": f"{type(e).__name__}: {e}"[:4096]})


def _hole_punching_setting(transport: Any, setting: Any) -> Any:
    """``Host.open(hole_punching=...)`` checked: False (off), or the HolePuncher's config
    (None: the defaults). ValueError for ``True`` on a transport that cannot share ports."""
    if setting is False:
        return False
    can = bool(getattr(transport, "reuse_port", False))
    if setting is None:
        return None if can else False
    if setting is True:
        if not can:
            raise ValueError(
                "hole_punching=True needs a transport that shares its listen ports "
                "(TCPTransport with reuse_port, on a platform with SO_REUSEPORT)"
            )
        return None
    return setting  # a HolePunchConfig


__all__ = [
    "Host",
    "HostLimits",
    "P2PStream",
    "add_host_extension",
    "raise_open_file_limit",  # lives in inbound.py; benchmarks import it from here
]
