"""Many DHT nodes in one trio loop, for tests and benchmarks (pair with MockClock).

``Swarm`` runs each node in its own task so any node can be stopped independently (churn).
Nodes talk over a :class:`~dht.kademlia.loopback.LoopbackFabric` by default, or over a
``dht.p2p.MemoryNetwork`` with real hosts when ``memory_network`` is given.
"""

from __future__ import annotations

import gc
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from dht.kademlia.loopback import LoopbackFabric
from dht.kademlia.node import DHTNode


class Swarm:
    def __init__(
        self,
        nursery: trio.Nursery,
        fabric: LoopbackFabric | None,
        memory_network: Any,
        node_kwargs: dict[str, Any],
    ):
        self._nursery = nursery
        self.fabric = fabric
        self.memory_network = memory_network
        self.node_kwargs = node_kwargs
        self.nodes: list[DHTNode] = []
        self._scopes: dict[Any, trio.CancelScope] = {}
        self._addrs: dict[Any, Any] = {}

    def alive(self) -> list[DHTNode]:
        return [n for n in self.nodes if n.peer_id in self._scopes]

    def bootstrap_address(self, node: DHTNode) -> Any:
        return self._addrs[node.peer_id]

    async def add(self, initial: list[DHTNode] | None = None, **overrides: Any) -> DHTNode:
        """Start one node joined through ``initial`` (default: one random live node)."""
        alive = self.alive()
        if initial is None:
            initial = [random.choice(alive)] if alive else []
        kwargs = {**self.node_kwargs, **overrides}
        return await self._nursery.start(
            self._run_node, [self._addrs[n.peer_id] for n in initial], kwargs
        )

    async def _run_node(
        self,
        initial_peers: list[Any],
        kwargs: dict[str, Any],
        task_status: Any = trio.TASK_STATUS_IGNORED,  # trio.TaskStatus: unknown to mypy on 3.10
    ) -> None:
        try:
            from dht.p2p import Identity
        except ImportError:
            from dht.p2p.identity import Identity

        identity = Identity.generate()
        with trio.CancelScope() as scope:
            if self.fabric is not None:
                network = self.fabric.network(identity.peer_id)
                opener = DHTNode.open(
                    network=network, identity=identity, initial_peers=initial_peers, **kwargs
                )
            else:
                opener = DHTNode.open(
                    identity=identity,
                    transport=self.memory_network.transport(),
                    host_maddrs=["/memory/0"],
                    initial_peers=initial_peers,
                    **kwargs,
                )
            async with opener as node:
                if self.fabric is not None:
                    self._addrs[node.peer_id] = node.peer_id
                else:
                    self._addrs[node.peer_id] = node.get_visible_maddrs()[0]
                self._scopes[node.peer_id] = scope
                self.nodes.append(node)
                task_status.started(node)
                await trio.sleep_forever()
        self._scopes.pop(identity.peer_id, None)

    def kill(self, node: DHTNode) -> None:
        """Stop a node abruptly: it goes silent for everyone else, then its tasks are cancelled."""
        if self.fabric is not None:
            self.fabric.kill(node.peer_id)
        elif node.host is not None:
            for addr in node.host.listen_addrs:
                self.memory_network.kill(addr.without_peer_id())
        scope = self._scopes.pop(node.peer_id, None)
        if scope is not None:
            scope.cancel()


# Allocations between two collections of the youngest generation while a swarm runs
# (CPython's default is 700).
SWARM_GC_THRESHOLD = 50_000


@contextmanager
def swarm_gc() -> Iterator[None]:
    """Collect garbage less often while one process holds a whole swarm.

    A real peer has a process, and so a heap, of its own; here every peer's long-lived state
    (routing tables, connections, keys) shares one heap, and each collection of the older
    generations walks all of it. With CPython's default thresholds, objects that live a
    little while (an RPC, a handshake) get promoted and trigger full collections that cost
    time in proportion to the whole swarm: about half of the CPU of a 128-peer simulation
    (benchmarks/sim_swarm.py). A larger youngest generation lets such objects die young, so
    collections (full ones above all) become rare. Only the collector's pacing changes:
    no peer behaves differently. The previous thresholds come back on exit.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], SWARM_GC_THRESHOLD), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


@asynccontextmanager
async def open_swarm(
    size: int,
    *,
    latency: float = 0.005,
    memory_network: Any = None,
    seed: int | None = None,
    **node_kwargs: Any,
) -> AsyncIterator[Swarm]:
    """Start ``size`` nodes, each joining through one random earlier node."""
    from dht.kademlia.validation import _peer_id_class

    PeerID = _peer_id_class()
    if seed is not None:
        random.seed(seed)
    # signature checks in worker threads would let an autojumping MockClock skip timeouts
    node_kwargs.setdefault("max_signatures_on_loop", 10**6)
    fabric = (
        None if memory_network is not None else LoopbackFabric(PeerID.from_bytes, latency=latency)
    )
    with swarm_gc():
        async with trio.open_nursery() as nursery:
            swarm = Swarm(nursery, fabric, memory_network, node_kwargs)
            for _ in range(size):
                await swarm.add()
            try:
                yield swarm
            finally:
                nursery.cancel_scope.cancel()
