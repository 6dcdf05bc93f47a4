"""Host over real TCP (and the memory network): handshake, streams, RPC, reuse, dedupe, MITM."""

from __future__ import annotations

import hashlib
import logging

import pytest
import trio
import trio.testing

from dht.p2p import (
    DialError,
    Host,
    HostLimits,
    Identity,
    MemoryNetwork,
    MessageTooLargeError,
    Multiaddr,
    P2PStream,
    P2PTimeoutError,
    PeerIDMismatchError,
    PeerStore,
    ProtocolNegotiationError,
    ProtocolViolationError,
    RemoteError,
    ResourceLimitError,
    StreamResetError,
    identify,
)
from dht.p2p.varint import decode_uvarint

from .conftest import wait_until

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


async def echo_rpc(peer, request):
    return {"echo": request, "peer": peer.to_bytes()}


async def test_handshake_ping_rpc_and_streams():
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        assert addrs == b.listen_addrs and addrs[0].peer_id == b.peer_id
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)

        async def stream_handler(stream: P2PStream):
            assert stream.protocol == "/sum/1.0.0" and stream.remote_peer == a.peer_id
            total = 0
            while True:
                msg = await stream.receive_msg()
                if msg is None:
                    break
                total += msg
            await stream.send_msg(total)

        b.set_stream_handler("/sum/1.0.0", stream_handler)

        pid = await a.connect(addrs)
        assert pid == b.peer_id and a.is_connected(pid) and a.connected_peers() == [pid]
        assert 0 < await a.ping(pid) < 1
        reply = await a.call(pid, "/echo/1.0.0", {"x": b"\x00" * 100, "y": [1, "two"]})
        assert reply == {
            "echo": {"x": b"\x00" * 100, "y": [1, "two"]},
            "peer": a.peer_id.to_bytes(),
        }

        stream = await a.new_stream(pid, "/sum/1.0.0")
        for i in range(100):
            await stream.send_msg(i)
        await stream.send_msg(None)
        assert await stream.receive_msg() == sum(range(100))
        await stream.aclose()
        # b sees a as connected too, and can call back over the same connection
        a.set_rpc_handler("/echo/1.0.0", echo_rpc)
        assert (await b.call(a.peer_id, "/echo/1.0.0", 7))["echo"] == 7
        assert len(a._conns[pid]) == 1 and len(b._conns[a.peer_id]) == 1


async def test_rpc_errors_and_timeouts(caplog):
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)

        async def failing(peer, request):
            raise ValueError("bad request: " + request)

        async def slow(peer, request):
            await trio.sleep_forever()

        b.set_rpc_handler("/fail/1.0.0", failing)
        b.set_rpc_handler("/slow/1.0.0", slow)
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        pid = await a.connect(addrs)
        with caplog.at_level(logging.WARNING, logger="dht.p2p.host"):
            with pytest.raises(RemoteError, match="ValueError: bad request: nope"):
                await a.call(pid, "/fail/1.0.0", "nope")
        assert any("/fail/1.0.0 handler raised" in r.message for r in caplog.records)
        with pytest.raises(P2PTimeoutError):
            await a.call(pid, "/slow/1.0.0", 1, timeout=0.3)
        with pytest.raises(ProtocolNegotiationError):
            await a.call(pid, "/nobody/1.0.0", 1)
        with pytest.raises(TypeError):
            await a.call(pid, "/echo/1.0.0", object())
        # the connection survived all of that
        assert (await a.call(pid, "/echo/1.0.0", "ok"))["echo"] == "ok"
        await trio.sleep(0.1)
        session = a._best_connection(pid).session
        assert session.num_streams == 0


async def test_connection_reuse_and_dial_dedupe():
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        a.peerstore.add_addrs(b.peer_id, addrs)
        dials = 0
        original = a.transport.dial

        async def counting_dial(*args, **kwargs):
            nonlocal dials
            dials += 1
            return await original(*args, **kwargs)

        a.transport.dial = counting_dial
        results = []

        async def one(i):
            results.append((await a.call(b.peer_id, "/echo/1.0.0", i))["echo"])

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        assert sorted(results) == list(range(20))
        assert dials == 1
        assert await a.connect(addrs) == b.peer_id
        assert dials == 1 and len(a._conns[b.peer_id]) == 1


async def test_simultaneous_dial_gives_one_usable_connection():
    async with Host.open() as a, Host.open() as b:
        addrs_a = await a.listen(LOCAL)
        addrs_b = await b.listen(LOCAL)
        for h in (a, b):
            h.set_rpc_handler("/echo/1.0.0", echo_rpc)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.connect, addrs_b)
            nursery.start_soon(b.connect, addrs_a)
        await trio.sleep(0.1)
        assert a.is_connected(b.peer_id) and b.is_connected(a.peer_id)
        # both sides route new streams over the same TCP connection
        ca, cb = a._best_connection(b.peer_id), b._best_connection(a.peer_id)
        assert ca.outbound != cb.outbound
        assert (await a.call(b.peer_id, "/echo/1.0.0", 1))["echo"] == 1
        assert (await b.call(a.peer_id, "/echo/1.0.0", 2))["echo"] == 2


async def test_wrong_peer_id_is_refused_and_not_kept(caplog):
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        impostor = Identity.generate().peer_id
        with pytest.raises(PeerIDMismatchError):
            await a.connect([addrs[0].without_peer_id()], peer_id=impostor)
        with pytest.raises(PeerIDMismatchError):
            await a.connect([str(addrs[0].without_peer_id()) + f"/p2p/{impostor}"])
        await trio.sleep(0.1)
        assert not a.is_connected(impostor) and not a.is_connected(b.peer_id)
        assert a.connected_peers() == [] and b.connected_peers() == []


async def test_dial_error_lists_every_address():
    async with Host.open() as a, Host.open() as b:
        await b.listen(LOCAL)
        port = b.listen_addrs[0].tcp_endpoint()[1]
    dead = Identity.generate().peer_id
    async with Host.open() as a:
        addrs = [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}"), Multiaddr("/memory/5")]
        with pytest.raises(DialError) as info:
            await a.connect(addrs, peer_id=dead)
        assert f"/ip4/127.0.0.1/tcp/{port}" in str(info.value)
        assert "/memory/5" in str(info.value)


async def test_observers_and_disconnect():
    events = []
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        observer = (lambda p: events.append(("up", p)), lambda p: events.append(("down", p)))
        a.add_connection_observer(*observer)
        pid = await a.connect(addrs)
        assert events == [("up", pid)]
        await a.disconnect(pid)
        await trio.sleep(0.1)
        assert events == [("up", pid), ("down", pid)]
        assert not a.is_connected(pid) and not b.is_connected(a.peer_id)
        # reconnects on demand
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        assert (await a.call(pid, "/echo/1.0.0", 3))["echo"] == 3
        assert events[-1] == ("up", pid)
        # removed: told of nothing more
        a.remove_connection_observer(*observer)
        a.remove_connection_observer(*observer)  # absent: no-op
        await a.disconnect(pid)
        await trio.sleep(0.1)
        assert events[-1] == ("up", pid) and len(events) == 3


async def test_thousand_concurrent_streams_between_hosts():
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)

        async def square(peer, x):
            await trio.sleep(0.01)
            return x * x

        b.set_rpc_handler("/sq/1.0.0", square)
        pid = await a.connect(addrs)
        results = {}

        async def one(i):
            results[i] = await a.call(pid, "/sq/1.0.0", i, timeout=60)

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        assert results == {i: i * i for i in range(1000)}


async def test_256_mib_transfer_is_byte_exact():
    size = 256 * 1024 * 1024
    chunk = bytes(range(256)) * 4096  # 1 MiB, varied content
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        received = {}

        async def sink(stream: P2PStream):
            h = hashlib.sha256()
            n = 0
            while True:
                data = await stream.receive_some()
                if not data:
                    break
                h.update(data)
                n += len(data)
            received["n"], received["digest"] = n, h.hexdigest()
            await stream.send_all(b"done")

        b.set_stream_handler("/sink/1.0.0", sink)
        pid = await a.connect(addrs)
        stream = await a.new_stream(pid, "/sink/1.0.0")
        sent = hashlib.sha256()
        for _ in range(size // len(chunk)):
            await stream.send_all(chunk)
            sent.update(chunk)
        await stream.send_eof()
        assert await stream.receive_some() == b"done"
        assert received == {"n": size, "digest": sent.hexdigest()}


async def test_memory_network_hosts_with_latency(autojump_clock):
    net = MemoryNetwork(latency=0.05)
    async with Host.open(transport=net.transport()) as a, Host.open(transport=net.transport()) as b:
        addrs = await b.listen(["/memory/0"])
        assert str(addrs[0]).startswith("/memory/")
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        pid = await a.connect(addrs)
        start = trio.current_time()
        assert (await a.call(pid, "/echo/1.0.0", "x"))["echo"] == "x"
        # one round trip on a warm connection (lazy multistream negotiation)
        assert trio.current_time() - start == pytest.approx(0.1, abs=1e-6)
        assert await a.ping(pid) == pytest.approx(0.1, abs=1e-6)


async def test_memory_network_partition_heal_and_kill(autojump_clock):
    net = MemoryNetwork(latency=0.01)
    limits = HostLimits(keepalive_interval=None)
    async with (
        Host.open(transport=net.transport(), limits=limits) as a,
        Host.open(transport=net.transport(), limits=limits) as b,
    ):
        (addr_a,) = await a.listen(["/memory/0"])
        (addr_b,) = await b.listen(["/memory/0"])
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        pid = await a.connect([addr_b])
        net.partition([addr_a], [addr_b])
        with pytest.raises(P2PTimeoutError):
            await a.call(pid, "/echo/1.0.0", 1, timeout=2)
        net.heal()
        assert (await a.call(pid, "/echo/1.0.0", 2))["echo"] == 2
        net.kill(addr_b)
        await trio.sleep(0.1)
        assert not a.is_connected(pid)
        with pytest.raises(DialError):
            await a.connect([addr_b])


async def test_hundred_hosts_in_one_loop(autojump_clock):
    net = MemoryNetwork(latency=0.005, bandwidth=10e6)
    n = 120
    hosts: list[Host] = []
    ready = trio.Event()
    done = trio.Event()

    async def run_host():
        async with Host.open(transport=net.transport()) as host:
            await host.listen(["/memory/0"])

            async def identify(peer, request):
                return [request, host.peer_id.to_bytes(), peer.to_bytes()]

            host.set_rpc_handler("/id/1.0.0", identify)
            hosts.append(host)
            if len(hosts) == n:
                ready.set()
            await done.wait()

    results = []

    async def ring(i):
        me = hosts[i]
        for j in (i + 1, i + 7):
            other = hosts[j % n]
            await me.connect(other.listen_addrs)
            reply = await me.call(other.peer_id, "/id/1.0.0", i)
            results.append(reply == [i, other.peer_id.to_bytes(), me.peer_id.to_bytes()])

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(run_host)
        await ready.wait()
        async with trio.open_nursery() as callers:
            for i in range(n):
                callers.start_soon(ring, i)
        done.set()
    assert len(results) == 2 * n and all(results)


async def test_connection_limit_trims_idle_then_refuses_when_busy(caplog):
    async with Host.open(limits=HostLimits(max_connections=1)) as server:
        addrs = await server.listen(LOCAL)
        server.set_rpc_handler("/echo/1.0.0", echo_rpc)
        release = trio.Event()

        async def hold(stream: P2PStream):
            await stream.send_all(b"busy")
            await release.wait()

        server.set_stream_handler("/hold/1.0.0", hold)
        async with Host.open() as first, Host.open() as second, Host.open() as third:
            await first.connect(addrs)
            await wait_until(lambda: server.is_connected(first.peer_id))
            # both identify exchanges are over: the connection is idle
            await first._best_connection(server.peer_id).identified.wait()
            conn = server._best_connection(first.peer_id)
            await conn.identified.wait()
            await wait_until(lambda: conn.session.num_streams == 0)
            # an idle connection is closed to make room for a new peer
            with caplog.at_level(logging.INFO, logger="dht.p2p.host"):
                await second.connect(addrs)
                assert (await second.call(server.peer_id, "/echo/1.0.0", 1))["echo"] == 1
            assert any("closing idle connection" in r.message for r in caplog.records)
            await wait_until(lambda: not first.is_connected(server.peer_id))
            assert server.connected_peers() == [second.peer_id]
            # while the only connection is busy, new peers are refused
            busy = await second.new_stream(server.peer_id, "/hold/1.0.0")
            assert await busy.receive_some() == b"busy"
            with caplog.at_level(logging.WARNING, logger="dht.p2p.host"):
                with pytest.raises((DialError, P2PTimeoutError)):
                    await third.connect(addrs, timeout=3)
            assert any("connection limit reached" in r.message for r in caplog.records)
            # and the limit applies to our own dials too
            (addr_third,) = await third.listen(LOCAL)
            with pytest.raises(ResourceLimitError):
                await server.connect([addr_third])
            release.set()
            assert (await second.call(server.peer_id, "/echo/1.0.0", 2))["echo"] == 2


async def test_message_size_cap_on_send():
    async with Host.open(limits=HostLimits(max_message_size=1000)) as a, Host.open() as b:
        addrs = await b.listen(LOCAL)
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        pid = await a.connect(addrs)
        with pytest.raises(MessageTooLargeError):
            await a.call(pid, "/echo/1.0.0", b"x" * 2000)
        assert (await a.call(pid, "/echo/1.0.0", b"x" * 10))["echo"] == b"x" * 10


async def test_peerstore_is_bounded():
    store = PeerStore(max_peers=3, max_addrs_per_peer=2)
    peers = [Identity.generate().peer_id for _ in range(4)]
    for i, pid in enumerate(peers):
        store.add_addrs(pid, [f"/ip4/10.0.0.{i}/tcp/{p}" for p in (1, 2, 3)])
    assert len(store) == 3 and peers[0] not in store
    assert store.get_addrs(peers[3]) == [
        Multiaddr("/ip4/10.0.0.3/tcp/1"),
        Multiaddr("/ip4/10.0.0.3/tcp/2"),
    ]
    with pytest.raises(ValueError):
        store.add_addrs(peers[1], [f"/ip4/10.0.0.9/tcp/1/p2p/{peers[2]}"])


async def test_tcp_ipv6_and_dns_addresses():
    async with Host.open() as a, Host.open() as b:
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        try:
            (v6,) = await b.listen(["/ip6/::1/tcp/0"])
        except OSError:
            v6 = None  # no IPv6 loopback on this machine: the DNS case below still runs
        (v4,) = await b.listen(LOCAL)
        port = v4.tcp_endpoint()[1]
        pid = await a.connect([f"/dns4/localhost/tcp/{port}/p2p/{b.peer_id}"])
        assert (await a.call(pid, "/echo/1.0.0", 1))["echo"] == 1
        if v6 is not None:
            assert str(v6).startswith("/ip6/::1/tcp/")
            async with Host.open() as c:
                await c.connect([v6])
                assert (await c.call(b.peer_id, "/echo/1.0.0", 2))["echo"] == 2


async def test_black_holed_address_costs_only_the_dial_stagger(autojump_clock):
    net = MemoryNetwork(latency=0.001)
    limits = HostLimits(handshake_timeout=10)
    async with (
        Host.open(transport=net.transport(), limits=limits) as a,
        Host.open(transport=net.transport(), limits=limits) as b,
    ):
        (good,) = await b.listen(["/memory/0"])
        # an address that accepts connections but never answers (nobody calls accept())
        (black_hole,) = await net.transport().listen("/memory/0")
        start = trio.current_time()
        pid = await a.connect([black_hole.multiaddr, good], peer_id=b.peer_id)
        assert pid == b.peer_id
        assert trio.current_time() - start < 1.0  # not the 10 s handshake timeout
        await trio.testing.wait_all_tasks_blocked()
        assert len(a._conns[pid]) == 1


async def test_memory_network_bandwidth_applies_to_host_streams(autojump_clock):
    net = MemoryNetwork(latency=0.01, bandwidth=1_000_000)
    size = 4 * 1024 * 1024
    async with Host.open(transport=net.transport()) as a, Host.open(transport=net.transport()) as b:
        addrs = await b.listen(["/memory/0"])
        got = {}

        async def sink(stream: P2PStream):
            n = 0
            while data := await stream.receive_some():
                n += len(data)
            got["n"], got["t"] = n, trio.current_time()

        b.set_stream_handler("/sink/1.0.0", sink)
        pid = await a.connect(addrs)
        stream = await a.new_stream(pid, "/sink/1.0.0")
        start = trio.current_time()
        await stream.send_all(b"\0" * size)
        await stream.send_eof()
        await wait_until(lambda: "n" in got)
        assert got["n"] == size
        # Noise + yamux add < 0.1 % of bytes; the link time dominates: size / bandwidth
        assert got["t"] - start == pytest.approx(size / 1e6, rel=0.01)


async def test_wildcard_listen_announces_dialable_addresses():
    async with Host.open() as a, Host.open() as b:
        addrs = await b.listen(["/ip4/0.0.0.0/tcp/0"])
        assert addrs and all("0.0.0.0" not in str(addr) for addr in addrs)
        assert any(str(addr).startswith("/ip4/127.0.0.1/tcp/") for addr in addrs)
        b.set_rpc_handler("/echo/1.0.0", echo_rpc)
        pid = await a.connect(addrs)
        assert (await a.call(pid, "/echo/1.0.0", 5))["echo"] == 5


async def test_identify_lets_a_host_redial_a_peer_that_dialed_it():
    async with Host.open() as a, Host.open() as b:
        (addr_a,) = await a.listen(LOCAL)
        (addr_b,) = await b.listen(LOCAL)
        a.set_rpc_handler("/echo/1.0.0", echo_rpc)
        await a.connect([addr_b])  # b only learns a's address through identify
        await wait_until(lambda: b.peerstore.get_addrs(a.peer_id) == [addr_a.without_peer_id()])
        await b.disconnect(a.peer_id)
        await wait_until(lambda: not a.is_connected(b.peer_id))
        assert (await b.call(a.peer_id, "/echo/1.0.0", 9))["echo"] == 9  # b dials a


def test_identify_message_roundtrip_and_validation():
    me = Identity.generate()
    info = identify.IdentifyInfo(
        listen_addrs=[Multiaddr("/ip4/10.1.2.3/tcp/4001"), Multiaddr("/memory/7")],
        protocols=["/ipfs/ping/1.0.0", "/x/1.0.0"],
        observed_addr=identify.observed_multiaddr("192.0.2.1:5555"),
        public_key=me.peer_id.public_key_proto(),
        agent_version="test",
        protocol_version=identify.PROTOCOL_VERSION,
    )
    framed = identify.encode_identify(info)
    length, start = decode_uvarint(framed)
    decoded = identify.decode_identify(framed[start:], me.peer_id)
    assert length == len(framed) - start
    assert decoded == info
    assert decoded.observed_addr == Multiaddr("/ip4/192.0.2.1/tcp/5555")
    with pytest.raises(ProtocolViolationError, match="does not match"):
        identify.decode_identify(framed[start:], Identity.generate().peer_id)
    with pytest.raises(ProtocolViolationError):
        identify.decode_identify(b"\x0a\xff\x01", me.peer_id)  # truncated field


async def test_stream_limit_per_connection_is_enforced_by_the_remote():
    async with Host.open(limits=HostLimits(max_streams_per_connection=4)) as server:
        addrs = await server.listen(LOCAL)
        release = trio.Event()

        async def hold(stream: P2PStream):
            await stream.send_all(b"open")
            await release.wait()

        server.set_stream_handler("/hold/1.0.0", hold)
        server.set_rpc_handler("/echo/1.0.0", echo_rpc)
        async with Host.open() as client:
            pid = await client.connect(addrs)
            await wait_until(lambda: server.is_connected(client.peer_id))
            await client._best_connection(server.peer_id).identified.wait()
            await server._best_connection(client.peer_id).identified.wait()
            session = server._best_connection(client.peer_id).session
            await wait_until(lambda: session.num_streams == 0)  # identify streams are done
            held = []
            for _ in range(4):
                stream = await client.new_stream(pid, "/hold/1.0.0")
                assert await stream.receive_some() == b"open"
                held.append(stream)
            with pytest.raises(StreamResetError):
                await client.new_stream(pid, "/hold/1.0.0")
            release.set()
            for stream in held:
                assert await stream.receive_some() == b""
                await stream.aclose()
            await trio.sleep(0.1)
            assert (await client.call(pid, "/echo/1.0.0", 1))["echo"] == 1
