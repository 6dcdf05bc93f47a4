"""A direct in-process RPC fabric for large DHT simulations.

It skips the transport stack (no Noise, no yamux) but keeps what matters for the DHT's logic:
every request and response is msgpack-encoded and decoded like on the wire, each hop costs
``latency`` seconds of (virtual) time, handler errors come back as errors, and a killed peer
makes calls hang until the caller's timeout, like a silent machine. Use it under
``trio.testing.MockClock`` to simulate thousands of peers; use ``dht.p2p.MemoryNetwork`` with
real hosts when the transport itself is under test.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import trio

from dht.kademlia.network import PeerUnreachableError, RPCHandler

logger = logging.getLogger(__name__)


class LoopbackFabric:
    """Connects :class:`LoopbackNetwork` endpoints by PeerID; counts messages."""

    def __init__(self, peer_from_bytes: Callable[[bytes], Any], latency: float = 0.005):
        self.latency = latency
        self.peer_from_bytes = peer_from_bytes
        self._handlers: dict[Any, RPCHandler | None] = {}
        self._dead: set[Any] = set()
        self.messages = 0
        self.sent_by: Counter[Any] = Counter()  # requests sent, per source peer
        self.by_op: Counter[str] = Counter()  # requests sent, per DHT operation

    def reset_counters(self) -> None:
        self.messages = 0
        self.sent_by.clear()
        self.by_op.clear()

    def network(self, peer_id: Any) -> LoopbackNetwork:
        self._handlers[peer_id] = None
        self._dead.discard(peer_id)
        return LoopbackNetwork(self, peer_id)

    def kill(self, peer_id: Any) -> None:
        """Make ``peer_id`` silent: calls to it time out, calls from it fail."""
        self._dead.add(peer_id)

    def is_alive(self, peer_id: Any) -> bool:
        return peer_id in self._handlers and peer_id not in self._dead

    async def deliver(self, source: Any, target: Any, request: Any, time_limit: float) -> Any:
        self.messages += 1
        self.sent_by[source] += 1
        op = request.get("op") if isinstance(request, dict) else None
        self.by_op[op if isinstance(op, str) else "other"] += 1
        handler = self._handlers.get(target)
        if handler is None or not self.is_alive(target) or not self.is_alive(source):
            await trio.sleep(time_limit)
            raise PeerUnreachableError(f"DHT RPC to {target} timed out")
        wire_request = msgpack.unpackb(msgpack.packb(request, use_bin_type=True), raw=False)
        await trio.sleep(self.latency)
        try:
            response = await handler(source, wire_request)
        except Exception as e:  # noqa: BLE001 - the remote's failure becomes the caller's error
            raise PeerUnreachableError(f"{target} refused a DHT request: {e}", answered=True) from e
        wire_response = msgpack.unpackb(msgpack.packb(response, use_bin_type=True), raw=False)
        await trio.sleep(self.latency)
        if not self.is_alive(target):
            raise PeerUnreachableError(f"{target} died during the request")
        return wire_response


class LoopbackNetwork:
    """One peer's endpoint on a :class:`LoopbackFabric`; its address is its PeerID bytes."""

    def __init__(self, fabric: LoopbackFabric, peer_id: Any):
        self.fabric = fabric
        self.peer_id = peer_id

    def set_handler(self, handler: RPCHandler | None) -> None:
        self.fabric._handlers[self.peer_id] = handler

    async def call(self, peer_id: Any, request: Any, time_limit: float) -> Any:
        with trio.move_on_after(time_limit):
            return await self.fabric.deliver(self.peer_id, peer_id, request, time_limit)
        raise PeerUnreachableError(f"DHT RPC to {peer_id} timed out")

    async def connect(self, address: Any, time_limit: float) -> tuple[Any, tuple[bytes, ...]]:
        peer_id = (
            address if not isinstance(address, bytes) else self.fabric.peer_from_bytes(address)
        )
        if not self.fabric.is_alive(peer_id):
            await trio.sleep(min(time_limit, 1.0))
            raise PeerUnreachableError(f"cannot reach initial peer {peer_id}")
        return peer_id, (peer_id.to_bytes(),)

    def remember_addrs(self, peer_id: Any, addrs: Sequence[bytes], informant: Any = None) -> None:
        pass  # the fabric routes by PeerID

    def usable_addrs(self, addrs: Sequence[bytes], informant: Any) -> tuple[bytes, ...]:
        return tuple(addrs)  # PeerIDs, not addresses

    def own_addrs(self) -> list[bytes]:
        return [self.peer_id.to_bytes()]

    def peer_from_bytes(self, data: bytes) -> Any:
        return self.fabric.peer_from_bytes(data)
