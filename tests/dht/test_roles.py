"""Roles follow reachability: public peers relay, private ones are reached through a relay
(or become DHT clients without one), and explicit ``client_mode`` overrides the choice.

Real DHT nodes on loopback TCP. AutoNAT's verdicts are real too: ``threshold=1`` lets one
peer decide, a Host that listens nowhere is private at once ("not listening"), and a node
whose listeners were closed is private because the dial-back is refused.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from dht import DHTNode
from dht.kademlia.clock import get_dht_time
from dht.p2p import Host, MemoryNetwork, Multiaddr
from dht.p2p.autonat import AutoNATConfig
from dht.p2p.relay import HOP_PROTOCOL, RelayLimits, split_circuit

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# one peer's answer decides; every request comes from 127.0.0.1, so no per-source cap
ONE = AutoNATConfig(
    threshold=1,
    dial_timeout=2.0,
    response_timeout=4.0,
    request_timeout=2.0,
    max_requests_per_peer=50,
    max_requests_per_source=500,
    max_requests_total=1000,
)
QUICK = dict(autonat=ONE, relay_check_interval=0.1, relay_failover_after=0.5, rpc_timeout=2.0)


async def wait_until(predicate: Any, limit: float = 10.0) -> None:
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - node state without an event to await
            await trio.sleep(0.02)


class Swarm:
    """DHT nodes, each in a task of its own so that any one can be stopped (a relay dies)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.scopes: dict[Any, trio.CancelScope] = {}

    async def start(self, *, silent: bool = False, **kwargs: Any) -> DHTNode:
        """A node; ``silent``: on a Host that listens nowhere (nobody can dial it)."""
        scope = trio.CancelScope()
        node = await self.nursery.start(self._run, scope, silent, {**QUICK, **kwargs})
        self.scopes[node.peer_id] = scope
        return node

    async def _run(
        self,
        scope: trio.CancelScope,
        silent: bool,
        kwargs: dict[str, Any],
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with scope:
            async with AsyncExitStack() as stack:
                if silent:
                    kwargs["host"] = await stack.enter_async_context(Host.open())
                else:
                    kwargs.setdefault("host_maddrs", LOOPBACK)
                node = await stack.enter_async_context(DHTNode.open(**kwargs))
                task_status.started(node)
                await trio.sleep_forever()

    def stop(self, node: DHTNode) -> None:
        self.scopes[node.peer_id].cancel()

    async def public_pair(self, **kwargs: Any) -> tuple[DHTNode, DHTNode]:
        """Two public peers (each dials the other back), serving relays unless told not to."""
        first = await self.start(**kwargs)
        second = await self.start(initial_peers=first.get_visible_maddrs(), **kwargs)
        with trio.fail_after(10):
            await first.autonat.probe([second.peer_id])
            await second.autonat.probe([first.peer_id])
        for node in (first, second):
            assert node.host.reachability.is_public, node.host.reachability
            await wait_until(lambda node=node: node.role is not None)
        return first, second

    async def private(self, boot: DHTNode, **kwargs: Any) -> DHTNode:
        """A peer nobody can dial (its Host listens nowhere): private at its first check."""
        node = await self.start(silent=True, initial_peers=boot.get_visible_maddrs(), **kwargs)
        await node.autonat.probe()
        assert node.host.reachability.is_private
        assert "not listening" in node.host.reachability.reason
        return node


def relay_of(node: DHTNode) -> Any:
    """The relay the node's first announced circuit address goes through."""
    return split_circuit(node.role.circuit_addrs[0])[0]


def contact_addrs(holder: DHTNode, peer: Any) -> list[Multiaddr] | None:
    for contact in holder.routing_table:
        if contact.peer_id == peer:
            return [Multiaddr.from_bytes(a) for a in contact.addrs]
    return None


async def test_private_peer_is_reached_through_a_relay_found_among_its_peers(caplog) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        r, s = await swarm.public_pair()
        await wait_until(lambda: r.relay_service is not None and s.relay_service is not None)
        assert r.role.serving_relay and not r.client_mode
        assert HOP_PROTOCOL in r.host._identify_info("").protocols  # advertised by identify
        assert r.role.describe().startswith("Reachability: public (1 of 1 peers dialed")
        assert "serving as a relay" in r.role.describe()

        a = await swarm.private(r, max_relays=1)
        await wait_until(lambda: a.role is not None and a.role.circuit_addrs)
        assert not a.client_mode and not a.role.client_mode  # a relay path: still a server
        relay = relay_of(a)
        assert relay in (r.peer_id, s.peer_id) and set(a._relay_client.reservations) == {relay}
        serving = r if relay == r.peer_id else s
        assert serving.relay_service.has_reservation(a.peer_id)
        # what it announces: its circuit addresses only (it has no other way in)
        assert a.get_visible_maddrs() == list(a.role.circuit_addrs)
        assert a._own_addrs() == [m.without_peer_id().to_bytes() for m in a.role.circuit_addrs]
        line = a.role.describe()
        assert line.startswith("Reachability: private (not listening"), line
        assert "reachable via relay /ip4/127.0.0.1/tcp/" in line and "/p2p-circuit" in line
        assert line.endswith("acting as a DHT server reached through the relay"), line
        # its requests carried the circuit address: the public peers' routing tables hold it
        for holder in (r, s):
            await wait_until(
                lambda holder=holder: (
                    (contact_addrs(holder, a.peer_id) or [None])[0] is not None
                    and all(m.is_circuit() for m in contact_addrs(holder, a.peer_id))
                )
            )

        # a third peer joins through the other public peer, finds `a` in the DHT and gets
        # its RPCs answered through the relay (it cannot dial `a` any other way)
        c = await swarm.start(initial_peers=s.get_visible_maddrs(), autonat=False)
        found = await c.find_nearest_peers(a.node_id, 5)
        contact = next(x for x in found if x.peer_id == a.peer_id)
        assert all(Multiaddr.from_bytes(raw).is_circuit() for raw in contact.addrs)
        assert await c.ping(a.peer_id)
        assert c.network.relayed_only(a.peer_id)
        assert c.network.relay_limit(a.peer_id).data == RelayLimits().circuit_data
        assert not c.network.relayed_only(s.peer_id)  # a direct connection
        # `a` serves records over the relayed connection: its value is found by `c`
        expiration = get_dht_time() + 60
        assert await a.store("held-by-a", "hello", expiration)
        assert await c.store("from-c", "world", expiration)
        assert (await c.get("held-by-a", latest=True)).value == "hello"
        assert (await a.get("from-c", latest=True)).value == "world"
        assert a.storage.num_records > 0  # it stores for others: a server
        nursery.cancel_scope.cancel()


async def test_without_a_relay_a_private_peer_is_a_client_until_one_takes_it() -> None:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        b, _ = await swarm.public_pair(relay=False)
        assert b.relay_service is None and HOP_PROTOCOL not in b.host._identify_info("").protocols
        a = await swarm.private(b)
        await wait_until(lambda: a.role is not None)
        assert a.client_mode and a.role.client_mode and not a.role.explicit
        assert a.get_visible_maddrs() == [] and a._own_addrs() == []
        line = a.role.describe()
        assert "no relay holds a slot" in line and "acting as a DHT client" in line, line
        assert await a.ping(b.peer_id)
        assert contact_addrs(b, a.peer_id) is None  # clients never enter routing tables
        # a relay appears and `a` meets it: it reserves a slot and becomes a server again
        r = await swarm.start(initial_peers=b.get_visible_maddrs(), relay=True)
        await r.autonat.probe([b.peer_id])
        await wait_until(lambda: r.relay_service is not None)
        await a.host.connect(r.get_visible_maddrs())
        await wait_until(lambda: a.role.circuit_addrs and not a.client_mode)
        assert relay_of(a) == r.peer_id
        await wait_until(lambda: contact_addrs(b, a.peer_id) is not None)  # re-announced
        nursery.cancel_scope.cancel()


async def test_explicit_client_mode_overrides_the_automatic_choice() -> None:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        r, s = await swarm.public_pair()
        await wait_until(lambda: r.relay_service is not None and s.relay_service is not None)
        boot = r.get_visible_maddrs()

        # client_mode=True: a client whatever happens, reserves nothing
        client = await swarm.private(r, client_mode=True)
        await wait_until(lambda: client.role is not None)
        assert client.client_mode and client.role.explicit and not client.role.circuit_addrs
        assert client._relay_client.reservations == {}
        assert "acting as a DHT client (client mode was set explicitly)" in client.role.describe()

        # behind a "NAT": the listeners close, so AutoNAT's dial-back is refused -> private
        async def nat(node: DHTNode) -> None:
            for listener in node.host._listeners:
                await listener.aclose()
            with trio.fail_after(10):
                await node.autonat.probe([r.peer_id])
            assert node.host.reachability.is_private, node.host.reachability

        # client_mode=False: stays a server announcing its own address, adds a relay path
        server = await swarm.start(initial_peers=boot, client_mode=False)
        direct = server.get_visible_maddrs()
        assert direct and not any(m.is_circuit() for m in direct)
        await nat(server)
        await wait_until(lambda: server.role is not None and server.role.circuit_addrs)
        assert not server.client_mode and server.role.explicit
        visible = server.get_visible_maddrs()
        assert visible == direct + list(server.role.circuit_addrs)
        assert server.relay_limit is None  # it claims direct reachability
        assert "client_mode=False was set explicitly" in server.role.describe()

        # client_mode unset, the same situation: the unreachable address is no longer announced
        auto = await swarm.start(initial_peers=boot)
        assert auto.client_mode_setting is None
        await nat(auto)
        await wait_until(lambda: auto.role is not None and auto.role.circuit_addrs)
        assert not auto.client_mode and not auto.role.explicit
        assert auto.get_visible_maddrs() == list(auto.role.circuit_addrs)
        assert auto.relay_limit == RelayLimits().limit
        nursery.cancel_scope.cancel()


async def test_when_the_relay_dies_the_reservation_moves_to_another() -> None:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        r1, r2 = await swarm.public_pair()
        await wait_until(lambda: r1.relay_service is not None and r2.relay_service is not None)
        a = await swarm.private(r1, max_relays=1)
        await wait_until(lambda: a.role is not None and a.role.circuit_addrs)
        first = relay_of(a)
        dying, other = (r1, r2) if first == r1.peer_id else (r2, r1)
        swarm.stop(dying)
        await wait_until(lambda: a.role.circuit_addrs and relay_of(a) == other.peer_id, 15)
        assert set(a._relay_client.reservations) == {other.peer_id}
        assert not a.client_mode
        assert all(split_circuit(m)[0] == other.peer_id for m in a.get_visible_maddrs())
        # reachable through the new relay
        c = await swarm.start(initial_peers=other.get_visible_maddrs(), autonat=False)
        await wait_until(lambda: contact_addrs(other, a.peer_id) is not None)
        assert all(m.is_circuit() for m in contact_addrs(other, a.peer_id))
        c.network.remember_addrs(a.peer_id, a._own_addrs())
        assert await c.ping(a.peer_id)
        assert c.network.relayed_only(a.peer_id)
        nursery.cancel_scope.cancel()


async def test_public_peers_serve_relays_with_the_given_limits() -> None:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        small = RelayLimits(circuit_data=4096)
        r, s = await swarm.public_pair(relay=small)
        await wait_until(lambda: r.relay_service is not None)
        assert r.relay_service.limits is small
        a = await swarm.private(r, max_relays=2)
        await wait_until(lambda: len(a.role.circuit_addrs if a.role else ()) >= 2)
        assert a.relay_limit.data == 4096  # what averaging reads: no reducing through it
        # the verdict turns private: the relay service stops, its reservations go
        await nat_then_private(r, s)
        await wait_until(lambda: r.relay_service is None and not r.role.serving_relay)
        assert HOP_PROTOCOL not in r.host._identify_info("").protocols
        nursery.cancel_scope.cancel()


async def nat_then_private(node: DHTNode, server: DHTNode) -> None:
    for listener in node.host._listeners:
        await listener.aclose()
    with trio.fail_after(10):
        await node.autonat.probe([server.peer_id])
    assert node.host.reachability.is_private


async def test_roles_on_the_memory_network_and_bad_settings() -> None:
    net = MemoryNetwork()
    async with DHTNode.open(transport=net.transport(), host_maddrs=["/memory/0"]) as plain:
        assert plain.autonat is None and not plain._roles_enabled()
        assert plain.client_mode_setting is None and not plain.client_mode
    async with DHTNode.open(
        transport=net.transport(), host_maddrs=["/memory/0"], relay=True
    ) as relaying:
        await wait_until(lambda: relaying.relay_service is not None)
        assert relaying.role is not None and relaying.role.serving_relay
        seen: list[Any] = []
        relaying.add_role_observer(seen.append)
        assert seen == [relaying.role]  # called at once with the current decision
    with pytest.raises(TypeError, match="relay must be"):
        async with DHTNode.open(transport=net.transport(), relay="yes"):
            pass
    with pytest.raises(ValueError, match="max_relays"):
        async with DHTNode.open(transport=net.transport(), host_maddrs=["/memory/0"], max_relays=0):
            pass


async def test_identify_tells_peers_the_announced_addresses_not_the_listen_ones() -> None:
    """Peers learn addresses from identify as well as from DHT records: a peer announcing
    its forwarded public port (or, when private, only its circuit addresses) must not have
    its unreachable LAN listen address put first in every other peer's peerstore."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        first = await swarm.start(autonat=False)
        public = Multiaddr("/ip4/203.0.113.7/tcp/31337")
        announcing = await swarm.start(
            autonat=False,
            initial_peers=first.get_visible_maddrs(),
            announce_maddrs=[public],
        )
        told = announcing.host._identify_info("").listen_addrs
        assert [a.without_peer_id() for a in told] == [public], told

        def known() -> list[Multiaddr]:
            return [a.without_peer_id() for a in first.host.peerstore.get_addrs(announcing.peer_id)]

        await wait_until(lambda: public in known())
        loopback = [a.without_peer_id() for a in announcing.host.listen_addrs]
        assert loopback and not any(a in known() for a in loopback), known()
        nursery.cancel_scope.cancel()


def test_public_by_configuration_needs_announce_addrs_or_a_global_listen_address() -> None:
    from dht.kademlia.roles import describe_limit, public_by_configuration
    from dht.p2p.relay_messages import Limit

    assert public_by_configuration(None, None) == ""
    wildcard = [Multiaddr("/ip4/0.0.0.0/tcp/4001")]  # which interface answers: not known
    assert public_by_configuration(wildcard, None) == ""
    lan = [Multiaddr("/ip4/192.168.1.5/tcp/4001"), Multiaddr("/ip4/127.0.0.1/tcp/4001")]
    assert public_by_configuration(lan, None) == ""
    vm = [Multiaddr("/ip4/203.0.113.10/tcp/4001")]
    assert public_by_configuration(vm, None) == "listening on the global address 203.0.113.10"
    assert public_by_configuration(lan, [Multiaddr("/ip4/198.51.100.3/tcp/4001")]) == (
        "announce_maddrs given"
    )
    assert describe_limit(RelayLimits().limit) == (
        "per relayed connection: 128 KiB each way, 120 s"
    )
    assert (
        describe_limit(Limit(0, 1000))
        == "per relayed connection: 1000 bytes each way, no time limit"
    )
    assert describe_limit(Limit(600, 64 << 20)) == "per relayed connection: 64 MiB each way, 600 s"


async def test_a_node_public_by_configuration_serves_a_relay_before_any_verdict() -> None:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        # AutoNAT runs (threshold 1) but has nobody to ask: without the configuration the
        # node would wait for a verdict before relaying
        node = await swarm.start(public_by_configuration="listening on the global address x")
        await wait_until(lambda: node.relay_service is not None)
        assert node.host.reachability.status.value == "unknown"
        line = node.role.describe()
        assert line.startswith("Reachability: unknown (not checked yet); serving as a relay")
        assert "(per relayed connection: 128 KiB each way, 120 s), public by configuration" in line
        plain = await swarm.start()
        await trio.sleep(0.3)  # several role passes (relay_check_interval 0.1 s)
        assert plain.relay_service is None and plain.role is None
        # relay=False still wins
        never = await swarm.start(public_by_configuration=True, relay=False)
        await trio.sleep(0.3)
        assert never.relay_service is None
        nursery.cancel_scope.cancel()
