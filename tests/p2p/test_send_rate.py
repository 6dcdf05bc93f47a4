"""Capping a connection's send rate (SO_MAX_PACING_RATE), on real TCP and through a Host."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from dht.p2p import Host, MemoryNetwork, TCPTransport
from dht.p2p.transport import SO_MAX_PACING_RATE, set_max_send_rate

UNLIMITED = 0xFFFFFFFF


def pacing_rate(stream: trio.SocketStream) -> int:
    raw = stream.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 4)
    return struct.unpack("=I", raw)[0]


async def tcp_pair(nursery: trio.Nursery) -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[trio.SocketStream] = []
    got = trio.Event()

    async def accept() -> None:
        accepted.append(await listeners[0].accept())
        got.set()

    nursery.start_soon(accept)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await got.wait()
    await listeners[0].aclose()
    return client, accepted[0]


async def test_cap_is_set_read_back_and_lifted():
    async with trio.open_nursery() as nursery:
        client, server = await tcp_pair(nursery)
        async with client, server:
            assert pacing_rate(client) == UNLIMITED
            assert set_max_send_rate(client, 1_500_000.7)
            assert pacing_rate(client) == 1_500_000
            assert set_max_send_rate(client, 10)  # below the floor: keep-alives still pass
            assert pacing_rate(client) == 1024
            assert set_max_send_rate(client, None)
            assert pacing_rate(client) == UNLIMITED
            for bad in (0, -5.0, float("nan")):
                with pytest.raises(ValueError, match="positive number of bytes/s"):
                    set_max_send_rate(client, bad)


async def test_a_capped_connection_really_sends_at_the_cap():
    """1.5 MB at 1 MB/s takes about a second; uncapped loopback takes about a millisecond."""
    payload = b"x" * 1_500_000
    async with trio.open_nursery() as nursery:
        client, server = await tcp_pair(nursery)
        async with client, server:
            assert set_max_send_rate(client, 1_000_000)
            started = trio.current_time()
            received = 0

            async def drain() -> None:
                nonlocal received
                while received < len(payload):
                    received += len(await server.receive_some(65536))

            async with trio.open_nursery() as inner:
                inner.start_soon(drain)
                await client.send_all(payload)
            elapsed = trio.current_time() - started
            assert received == len(payload)
            # the first few hundred KB leave at once (the initial window); the rest are paced
            assert elapsed > 0.5, elapsed


async def test_not_a_tcp_socket_cannot_be_capped():
    send, _ = trio.testing.memory_stream_pair()
    assert set_max_send_rate(send, 1e6) is False


async def test_host_streams_cap_their_tcp_connection_only():
    async with Host.open(transport=TCPTransport()) as a, Host.open(transport=TCPTransport()) as b:
        await b.listen(["/ip4/127.0.0.1/tcp/0"])
        b.set_stream_handler("/echo", lambda s: s.aclose())
        a.peerstore.add_addrs(b.peer_id, b.listen_addrs)
        stream = await a.new_stream(b.peer_id, "/echo")
        assert stream.set_max_send_rate(2e6) is True
        (conn,) = a._conns[b.peer_id]
        raw = conn.session.conn.raw
        assert pacing_rate(raw) == 2_000_000
        assert stream.set_max_send_rate(None) is True
        assert pacing_rate(raw) == UNLIMITED
        await stream.aclose()

    net = MemoryNetwork()
    async with Host.open(transport=net.transport()) as a, Host.open(transport=net.transport()) as b:
        await b.listen(["/memory/0"])
        b.set_stream_handler("/echo", lambda s: s.aclose())
        a.peerstore.add_addrs(b.peer_id, b.listen_addrs)
        stream = await a.new_stream(b.peer_id, "/echo")
        assert stream.set_max_send_rate(2e6) is False  # nothing to pace in memory
        await stream.aclose()
