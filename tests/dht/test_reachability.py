"""AutoNAT in the DHT: started over TCP, off on the in-memory network, exposed by the facade."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import trio

from dht import DHT, DHTNode
from dht.p2p import MemoryNetwork
from dht.p2p.autonat import PROTOCOL_ID, AutoNATConfig, ReachabilityStatus
from tests.timing import patience

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FAST = AutoNATConfig(dial_timeout=3.0, response_timeout=6.0)


async def test_dht_nodes_check_and_answer_reachability_over_tcp(caplog) -> None:
    caplog.set_level(logging.INFO)
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(DHTNode.open(host_maddrs=LOOPBACK, autonat=FAST))
        boot = first.get_visible_maddrs()
        # one process runs all five nodes: on a loaded machine a ping took over 10 s
        joining = patience(10.0)
        others = [
            await stack.enter_async_context(
                DHTNode.open(
                    initial_peers=boot,
                    host_maddrs=LOOPBACK,
                    autonat=FAST,
                    bootstrap_timeout=joining,
                )
            )
            for _ in range(3)
        ]
        client = await stack.enter_async_context(
            DHTNode.open(
                initial_peers=boot, client_mode=True, autonat=FAST, bootstrap_timeout=joining
            )
        )
        assert PROTOCOL_ID in first.host._stream_handlers  # servers answer checks...
        assert PROTOCOL_ID not in client.host._stream_handlers  # ...client-mode nodes do not
        me = others[-1]
        for node in [first, *others[:-1]]:
            await me.host.connect(node.host.listen_addrs)
        with trio.fail_after(patience(20.0)):
            await me.autonat.probe()
        assert me.host.reachability.status is ReachabilityStatus.PUBLIC, me.host.reachability
        # a client-mode node that does not listen cannot be reached, and says so at once
        await client.autonat.probe()
        assert client.host.reachability.is_private
        assert "not listening" in client.host.reachability.reason
        assert not any("announces itself as a DHT server" in r.getMessage() for r in caplog.records)
        # a server node nobody can reach any more: private, and the node says what to do
        for listener in me.host._listeners:
            await listener.aclose()
        with trio.fail_after(20):
            await me.autonat.probe()
        assert me.host.reachability.is_private, me.host.reachability
        assert any("announces itself as a DHT server" in r.getMessage() for r in caplog.records)


async def test_no_autonat_on_the_memory_network_unless_asked() -> None:
    network = MemoryNetwork()
    async with DHTNode.open(transport=network.transport(), host_maddrs=["/memory/0"]) as node:
        assert node.autonat is None
        assert PROTOCOL_ID not in node.host._stream_handlers
    async with DHTNode.open(host_maddrs=LOOPBACK, autonat=False) as node:
        assert node.autonat is None


def test_facade_exposes_reachability() -> None:
    with DHT(host_maddrs=LOOPBACK) as dht:
        reach = dht.reachability
        assert reach.status is ReachabilityStatus.UNKNOWN and reach.reason
        assert dht.node.autonat is not None
