"""Bad peers against a real Host over TCP. In every case the bad peer is dropped with a clear
log line and a well-behaved peer on the same host keeps getting real RPC answers."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from dht.p2p import Host, HostLimits, Identity, Multiaddr, P2PStream
from dht.p2p.multistream import encode_message, negotiate_outbound
from dht.p2p.noise import noise_handshake
from dht.p2p.varint import encode_uvarint
from dht.p2p.yamux import FLAG_SYN, TYPE_DATA, TYPE_WINDOW_UPDATE, pack_header

from .conftest import wait_until

LIMITS = HostLimits(
    handshake_timeout=1.0,
    keepalive_interval=0.5,
    keepalive_timeout=1.0,
    max_message_size=64 * 1024,
)


async def echo(peer, request):
    return request


async def firehose(stream: P2PStream):
    chunk = b"\xab" * (1024 * 1024)
    while True:
        await stream.send_all(chunk)


@asynccontextmanager
async def open_server(limits: HostLimits = LIMITS) -> AsyncIterator[tuple[Host, Multiaddr]]:
    async with Host.open(limits=limits) as host:
        (addr,) = await host.listen(["/ip4/127.0.0.1/tcp/0"])
        host.set_rpc_handler("/echo/1.0.0", echo)
        host.set_stream_handler("/firehose/1.0.0", firehose)
        yield host, addr


async def good_peer_works(addr: Multiaddr) -> None:
    async with Host.open() as good:
        await good.connect([addr])
        payload = {"ok": os.urandom(16)}
        assert await good.call(addr.peer_id, "/echo/1.0.0", payload, timeout=5) == payload


async def raw_connection(addr: Multiaddr) -> tuple[trio.SocketStream, str]:
    host, port = addr.tcp_endpoint()
    raw = await trio.open_tcp_stream(host, port)
    local = raw.socket.getsockname()
    return raw, f"{local[0]}:{local[1]}"


async def secure_connection(addr: Multiaddr, identity: Identity):
    """A real client up to the yamux layer, so the test can then misbehave on purpose."""
    raw, local = await raw_connection(addr)
    _, stream = await negotiate_outbound(raw, ["/noise"])
    secure = await noise_handshake(
        stream, identity, initiator=True, expected_peer=addr.peer_id, timeout=5
    )
    _, muxed = await negotiate_outbound(secure, ["/yamux/1.0.0"])
    return raw, muxed


async def wait_dropped(host: Host, peer) -> None:
    await wait_until(lambda: not host.is_connected(peer))


def logged(caplog, *needles: str) -> bool:
    return any(
        r.levelno >= logging.WARNING and all(n in r.getMessage() for n in needles)
        for r in caplog.records
    )


async def test_random_bytes_instead_of_multistream(caplog):
    async with open_server() as (host, addr):
        raw, local = await raw_connection(addr)
        await raw.send_all(os.urandom(4096))
        await wait_until(lambda: logged(caplog, "dropping inbound connection", local))
        # the host closed the connection on its side
        with trio.fail_after(5):
            while True:
                try:
                    if not await raw.receive_some():
                        break
                except trio.BrokenResourceError:
                    break
        assert logged(caplog, local, "security negotiation failed")
        await good_peer_works(addr)
        await raw.aclose()


async def test_truncated_noise_frame(caplog):
    async with open_server() as (host, addr):
        raw, local = await raw_connection(addr)
        await raw.send_all(encode_message("/multistream/1.0.0") + encode_message("/noise"))
        # a Noise frame announcing 200 bytes, of which only 10 arrive before EOF
        await raw.send_all(b"\x00\xc8" + b"\x01" * 10)
        await raw.send_eof()
        await wait_until(lambda: logged(caplog, "dropping inbound connection", local))
        await good_peer_works(addr)
        await raw.aclose()


async def test_yamux_frame_with_absurd_length(caplog):
    async with open_server() as (host, addr):
        bad = Identity.generate()
        raw, muxed = await secure_connection(addr, bad)
        await wait_until(lambda: host.is_connected(bad.peer_id))
        await muxed.send_all(pack_header(TYPE_DATA, FLAG_SYN, 1, 0xFFFFFFF0))
        await wait_dropped(host, bad.peer_id)
        assert logged(caplog, bad.peer_id.short(), "exceeds the receive window")
        await good_peer_works(addr)
        await raw.aclose()


async def test_message_over_the_size_cap(caplog):
    async with open_server() as (host, addr):
        bad_identity = Identity.generate()
        async with Host.open(identity=bad_identity) as bad:
            await bad.connect([addr])
            stream = await bad.new_stream(addr.peer_id, "/echo/1.0.0")
            # claims 1 GiB (cap is 64 KiB); the host must refuse before reading or allocating it
            await stream.send_all(encode_uvarint(1 << 30) + b"\0" * 100)
            await wait_dropped(host, bad.peer_id)
        assert logged(caplog, "dropping peer", bad_identity.peer_id.short(), "exceeds the cap")
        await good_peer_works(addr)


async def test_peer_that_opens_streams_and_never_reads(caplog):
    async with open_server() as (host, addr):
        bad = Identity.generate()
        raw, muxed = await secure_connection(addr, bad)
        proposal = encode_message("/multistream/1.0.0") + encode_message("/firehose/1.0.0")
        for sid in range(1, 41, 2):  # 20 streams, each asking for an endless download
            await muxed.send_all(pack_header(TYPE_WINDOW_UPDATE, FLAG_SYN, sid, 0))
            await muxed.send_all(pack_header(TYPE_DATA, 0, sid, len(proposal)) + proposal)
        # ... and never reads anything again.
        await wait_until(lambda: host.is_connected(bad.peer_id))
        session = host._best_connection(bad.peer_id).session
        peak_queued = 0
        while host.is_connected(bad.peer_id):
            peak_queued = max(peak_queued, session.queued_bytes)
            await trio.sleep(0.02)
        # 20 streams x 1 MiB handler writes, but flow control keeps the host's queue bounded
        assert 0 < peak_queued <= 2 * 1024 * 1024
        assert session.buffered_bytes == 0
        assert logged(caplog, bad.peer_id.short(), "keepalive")
        await good_peer_works(addr)
        await raw.aclose()


async def test_half_open_connection_is_detected(caplog):
    async with open_server() as (host, addr):
        bad = Identity.generate()
        raw, muxed = await secure_connection(addr, bad)
        await wait_until(lambda: host.is_connected(bad.peer_id))
        # The peer vanishes without FIN: nothing is read or written any more.
        await wait_dropped(host, bad.peer_id)
        assert logged(caplog, bad.peer_id.short(), "keepalive ping unanswered")
        await good_peer_works(addr)
        await raw.aclose()


async def test_peer_stalling_mid_handshake(caplog):
    async with open_server() as (host, addr):
        raw, local = await raw_connection(addr)
        await raw.send_all(encode_message("/multistream/1.0.0") + encode_message("/noise"))
        # ... and never sends Noise message 1. Meanwhile a good peer is served.
        await good_peer_works(addr)
        await wait_until(
            lambda: logged(caplog, "dropping inbound connection", local, "did not finish within")
        )
        assert host._pending_handshakes == 0
        await good_peer_works(addr)
        await raw.aclose()
