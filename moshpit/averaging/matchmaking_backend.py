"""Matchmaking's seam to the network (:class:`MatchmakingBackend`) and the real backend.

The matchmaking logic (``matchmaking.py``, ``matchmaking_leader.py``) talks to the DHT and
to other peers only through :class:`MatchmakingBackend`, so that tests drive it over an
in-process network. :class:`DHTMatchmakingBackend` is the real one: declarations are records
in a ``DHTNode``, join streams run over its ``Host``, where one :class:`MatchmakingDispatcher`
per Host routes each incoming stream to the averager (prefix) it is for.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import trio

from moshpit.averaging.group_info import MAX_ADDR_CHARS, GroupInfo
from moshpit.averaging.matchmaking_messages import (
    MATCHMAKING_PROTOCOL,
    MAX_ADDRS,
    MAX_REQUEST_BYTES,
    WITHDRAWN_EXTRA_SECONDS,
    Declaration,
)
from moshpit.averaging.matchmaking_state import MAX_CANDIDATES
from moshpit.netutil import aclose_quietly, is_network_error

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode
    from dht.p2p.host import Host
    from dht.p2p.identity import PeerID

logger = logging.getLogger(__name__)


class MsgStream(Protocol):
    """What matchmaking needs from a stream (``dht.p2p.P2PStream`` satisfies it)."""

    remote_peer: PeerID

    async def send_msg(self, obj: Any) -> None: ...

    async def receive_msg(self, max_size: int | None = None) -> Any: ...

    async def aclose(self) -> None: ...


# serves one join request: the stream and its first message (already read)
JoinHandler = Callable[[MsgStream, dict[str, Any]], Awaitable[None]]


class MatchmakingBackend(Protocol):
    """The seam between matchmaking logic and the DHT/network."""

    @property
    def local_peer(self) -> PeerID: ...

    def own_addrs(self) -> list[str]: ...

    def dht_time(self) -> float: ...

    async def declare(
        self, key: str, order: float, expiration: float, mode: str, schema: bytes | None = None
    ) -> bool:
        """Store our declaration (``schema`` is passed only when we have one)."""
        ...

    def withdraw(
        self, key: str, order: float, expiration: float, mode: str, schema: bytes | None = None
    ) -> None: ...

    async def list_candidates(self, key: str) -> list[Declaration]: ...

    async def open_stream(
        self, peer: PeerID, addrs: tuple[str, ...], dial_timeout: float
    ) -> MsgStream: ...

    def peer_to_bytes(self, peer: PeerID) -> bytes: ...

    def peer_from_bytes(self, data: bytes) -> PeerID: ...

    def decode_group(self, msg: Any) -> GroupInfo: ...

    def register(self, prefix: str, handler: JoinHandler) -> None: ...

    def unregister(self, prefix: str) -> None: ...


class MatchmakingDispatcher:
    """Reads the first message of an incoming matchmaking stream and hands it to the averager
    registered under its prefix, so several averagers can share one Host."""

    def __init__(self, first_message_timeout: float = 10.0):
        self.handlers: dict[str, JoinHandler] = {}
        self.first_message_timeout = first_message_timeout

    async def handle_stream(self, stream: MsgStream) -> None:
        try:
            msg = None
            with trio.move_on_after(self.first_message_timeout):
                msg = await stream.receive_msg(max_size=MAX_REQUEST_BYTES)
            if msg is None:
                logger.info(
                    "matchmaking stream from %s sent no request in time", stream.remote_peer
                )
                return
            prefix = msg.get("prefix") if isinstance(msg, Mapping) else None
            handler = self.handlers.get(prefix) if isinstance(prefix, str) else None
            if handler is None:
                why = (
                    "malformed request"
                    if not isinstance(prefix, str)
                    else "no averager under this prefix"
                )
                await stream.send_msg({"t": "reject", "why": why})
                return
            await handler(stream, msg)
        except Exception as e:
            if not is_network_error(e):
                raise
            logger.debug("matchmaking stream from %s failed: %r", stream.remote_peer, e)
        finally:
            await aclose_quietly(stream)


_dispatchers: weakref.WeakKeyDictionary[Host, MatchmakingDispatcher] = weakref.WeakKeyDictionary()


def dispatcher_for_host(host: Host) -> MatchmakingDispatcher:
    """The Host's matchmaking dispatcher, registering the stream handler on first use."""
    dispatcher = _dispatchers.get(host)
    if dispatcher is None:
        dispatcher = _dispatchers[host] = MatchmakingDispatcher()
        host.set_stream_handler(MATCHMAKING_PROTOCOL, dispatcher.handle_stream)
    return dispatcher


class DHTMatchmakingBackend:
    """The real backend: declarations in a ``DHTNode``, join streams over its ``Host``."""

    # reads and declarations use the peers that answered within this many seconds: one peer
    # that stalls (no answer, no refusal) would otherwise hold every read and store of the
    # key for the DHT's RPC timeout, as long as the matchmaker gives them, and its whole line
    # would see nobody (not even itself) for the round
    dht_patience = 1.5

    def __init__(self, node: DHTNode):
        from dht.p2p.identity import PeerID

        self._PeerID = PeerID
        self.node = node
        if node.host is None:
            raise ValueError("the DHT node has no Host (a loopback-fabric node cannot average)")
        self.host: Host = node.host
        self.dispatcher = dispatcher_for_host(self.host)

    @property
    def local_peer(self) -> PeerID:
        return self.host.peer_id

    def own_addrs(self) -> list[str]:
        visible = getattr(self.node, "get_visible_maddrs", None)
        addrs = visible() if visible is not None else []
        addrs = addrs or self.host.listen_addrs
        return [str(a) for a in addrs if len(str(a)) <= MAX_ADDR_CHARS][:MAX_ADDRS]

    def dht_time(self) -> float:
        from dht.kademlia.clock import get_dht_time

        return get_dht_time()

    async def declare(
        self,
        key: str,
        order: float,
        expiration: float,
        mode: str,
        schema: bytes | None = None,
    ) -> bool:
        value: dict[str, Any] = {"x": order, "a": self.own_addrs(), "m": mode}
        if schema is not None:
            value["s"] = schema
        subkey = self.local_peer.to_base58()
        return bool(
            await self.node.store(key, value, expiration, subkey, patience=self.dht_patience)
        )

    def withdraw(
        self, key: str, order: float, expiration: float, mode: str, schema: bytes | None = None
    ) -> None:
        # per subkey the record that expires last wins, so the withdrawal outlives the
        # declaration by a moment; stored in the background: the all-reduce does not wait
        value: dict[str, Any] = {"x": order, "a": [], "m": mode, "w": True}
        if schema is not None:
            value["s"] = schema
        timeout = max(1.0, expiration - self.dht_time())
        self.node.store_in_background(
            key, value, expiration + WITHDRAWN_EXTRA_SECONDS, self.local_peer.to_base58(),
            timeout=timeout,
        )  # fmt: skip

    async def list_candidates(self, key: str) -> list[Declaration]:
        found = await self.node.get(key, latest=True, patience=self.dht_patience)
        if found is None or not isinstance(found.value, Mapping):
            return []
        out = []
        for subkey, item in list(found.value.items())[:MAX_CANDIDATES]:
            try:
                out.append(Declaration.from_value(self._PeerID.from_base58(subkey), item.value))
            except Exception as e:  # a bad record from someone: ignore it, keep the rest
                logger.debug("ignoring bad declaration %r under %s: %s", subkey, key, e)
        return out

    async def open_stream(
        self, peer: PeerID, addrs: tuple[str, ...], dial_timeout: float
    ) -> MsgStream:
        if addrs and not self.host.is_connected(peer):
            from dht.p2p.multiaddr import Multiaddr

            parsed = []
            for a in addrs:
                try:
                    parsed.append(Multiaddr(a).without_peer_id())
                except ValueError:
                    continue
            if parsed:
                self.host.peerstore.add_addrs(peer, parsed)
        return await self.host.new_stream(peer, MATCHMAKING_PROTOCOL, timeout=dial_timeout)

    def peer_to_bytes(self, peer: PeerID) -> bytes:
        return peer.to_bytes()

    def peer_from_bytes(self, data: bytes) -> PeerID:
        return self._PeerID.from_bytes(data)

    def decode_group(self, msg: Any) -> GroupInfo:
        return GroupInfo.from_msg(msg)

    def register(self, prefix: str, handler: JoinHandler) -> None:
        if prefix in self.dispatcher.handlers:
            raise ValueError(f"an averager with prefix {prefix!r} already runs on this host")
        self.dispatcher.handlers[prefix] = handler

    def unregister(self, prefix: str) -> None:
        self.dispatcher.handlers.pop(prefix, None)
