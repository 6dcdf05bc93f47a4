"""multistream-select 1.0.0: byte-exact messages, negotiation both ways, lazy mode, garbage."""

from __future__ import annotations

import os
from functools import partial

import pytest
import trio
import trio.testing

from dht.p2p.errors import P2PTimeoutError, ProtocolNegotiationError
from dht.p2p.multistream import (
    LazyOutboundStream,
    PrefixedStream,
    encode_message,
    list_protocols,
    negotiate_inbound,
    negotiate_outbound,
)


def test_message_encoding_matches_spec():
    # From the multistream-select README: "\x13/multistream/1.0.0\n"
    assert encode_message("/multistream/1.0.0") == b"\x13/multistream/1.0.0\n"
    assert encode_message("na") == b"\x03na\n"
    with pytest.raises(ValueError):
        encode_message("x" * 2000)


async def _pair(dialer, listener):
    results = {}
    a, b = trio.testing.memory_stream_pair()

    async def run(name, fn, stream):
        results[name] = await fn(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "d", dialer, a)
        nursery.start_soon(run, "l", listener, b)
    return results["d"], results["l"]


async def test_negotiation_success_and_payload_replay():
    async def dialer(s):
        proto, s2 = await negotiate_outbound(s, ["/echo/1.0.0"])
        await s2.send_all(b"ping")
        return proto, await s2.receive_some()

    async def listener(s):
        proto, s2 = await negotiate_inbound(s, {"/echo/1.0.0"})
        data = await s2.receive_some()
        await s2.send_all(data.upper())
        return proto

    (proto, reply), lproto = await _pair(dialer, listener)
    assert proto == lproto == "/echo/1.0.0" and reply == b"PING"


async def test_na_falls_back_to_second_protocol_with_predicate():
    async def dialer(s):
        return (await negotiate_outbound(s, ["/new/2.0.0", "/old/1.0.0"]))[0]

    async def listener(s):
        return (await negotiate_inbound(s, lambda p: p.startswith("/old/")))[0]

    assert await _pair(dialer, listener) == ("/old/1.0.0", "/old/1.0.0")


async def test_none_supported():
    async def dialer(s):
        with pytest.raises(ProtocolNegotiationError, match="none of the protocols"):
            await negotiate_outbound(s, ["/a", "/b"])
        await s.aclose()

    async def listener(s):
        with pytest.raises(ProtocolNegotiationError, match="closed by remote"):
            await negotiate_inbound(s, {"/c"})

    await _pair(dialer, listener)


async def test_exact_bytes_on_the_wire():
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(negotiate_outbound, a, ["/x/1"])
        got = b""
        while len(got) < 26:
            got += await b.receive_some()
        assert got == b"\x13/multistream/1.0.0\n" + b"\x05/x/1\n"
        await b.send_all(b"\x13/multistream/1.0.0\n\x05/x/1\nEXTRA")
    # what the listener sent after its echo is replayed by the returned stream
    a2, b2 = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        await b2.send_all(b"\x13/multistream/1.0.0\n\x05/x/1\nEXTRA")
        proto, stream = await negotiate_outbound(a2, ["/x/1"])
        assert isinstance(stream, PrefixedStream)
        assert await stream.receive_some(2) == b"EX"
        assert await stream.receive_some() == b"TRA"
        nursery.cancel_scope.cancel()


async def test_lazy_negotiation_one_round_trip():
    a, b = trio.testing.memory_stream_pair()
    proto, lazy = await negotiate_outbound(a, ["/rpc/1"], lazy=True)
    assert isinstance(lazy, LazyOutboundStream) and not lazy.negotiated
    await lazy.send_all(b"request")
    # header, proposal and payload went out in ONE write
    first = await b.receive_some()
    assert first == b"\x13/multistream/1.0.0\n\x07/rpc/1\nrequest"

    async def server():
        b.receive_some = _replay(b, first)  # type: ignore[method-assign]
        p, s = await negotiate_inbound(b, {"/rpc/1"})
        assert await s.receive_some() == b"request"
        await s.send_all(b"response")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        assert await lazy.receive_some() == b"response"
    assert lazy.negotiated


def _replay(stream, data):
    original = stream.receive_some
    pending = [data]

    async def receive_some(max_bytes=None):
        if pending:
            return pending.pop()
        return await original(max_bytes)

    return receive_some


async def test_lazy_refused_raises_on_first_read():
    async def dialer(s):
        _, lazy = await negotiate_outbound(s, ["/missing/1"], lazy=True)
        await lazy.send_all(b"x")
        with pytest.raises(ProtocolNegotiationError, match="refused protocol '/missing/1'"):
            await lazy.receive_some()
        with pytest.raises(ProtocolNegotiationError):  # sticky
            await lazy.receive_some()
        await s.aclose()

    async def listener(s):
        with pytest.raises(ProtocolNegotiationError):
            await negotiate_inbound(s, {"/other/1"})

    await _pair(dialer, listener)


async def test_lazy_needs_single_protocol():
    with pytest.raises(ValueError, match="exactly one"):
        await negotiate_outbound(trio.testing.memory_stream_pair()[0], ["/a", "/b"], lazy=True)


async def test_ls():
    async def dialer(s):
        return await list_protocols(s)

    async def listener(s):
        with pytest.raises(ProtocolNegotiationError):
            await negotiate_inbound(s, {"/b/1", "/a/1"})

    async def dialer_then_close(s):
        try:
            return await dialer(s)
        finally:
            await s.aclose()

    protocols, _ = await _pair(dialer_then_close, listener)
    assert protocols == ["/a/1", "/b/1"]


@pytest.mark.parametrize("seed", range(20))
async def test_random_bytes_fail_fast(seed, autojump_clock):
    garbage = os.urandom(64)
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(garbage)
    with pytest.raises((ProtocolNegotiationError, P2PTimeoutError)):
        await negotiate_inbound(b, {"/x"}, timeout=1)
    a2, b2 = trio.testing.memory_stream_pair()
    await b2.send_all(garbage)
    with pytest.raises((ProtocolNegotiationError, P2PTimeoutError)):
        await negotiate_outbound(a2, ["/x"], timeout=1)


async def test_garbage_messages_are_named():
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"\xff\xff\x7f" + b"x" * 10)
    with pytest.raises(ProtocolNegotiationError, match="instead of the header"):
        await negotiate_inbound(b, {"/x"})
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ProtocolNegotiationError, match="GET"):
        await negotiate_inbound(b, {"/x"})
    header = encode_message("/multistream/1.0.0")
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(header + b"\xff\xff\x7f")
    with pytest.raises(ProtocolNegotiationError, match="not speaking multistream"):
        await negotiate_inbound(b, {"/x"})
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(header + b"\x03abc")
    with pytest.raises(ProtocolNegotiationError, match="newline"):
        await negotiate_inbound(b, {"/x"})
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(encode_message("/multistream/2.0.0"))
    with pytest.raises(ProtocolNegotiationError, match="does not speak"):
        await negotiate_inbound(b, {"/x"})


async def test_too_many_proposals():
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(encode_message("/multistream/1.0.0") + encode_message("/no") * 40)
    with pytest.raises(ProtocolNegotiationError, match="proposals"):
        await negotiate_inbound(b, {"/x"})


async def test_stall_times_out(autojump_clock):
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(encode_message("/multistream/1.0.0"))
    start = trio.current_time()
    with pytest.raises(P2PTimeoutError):
        await negotiate_inbound(b, {"/x"}, timeout=5)
    assert trio.current_time() - start == pytest.approx(5)


async def test_over_real_tcp():
    async def serve(stream):
        proto, s = await negotiate_inbound(stream, {"/tcp-test/1"})
        await s.send_all(await s.receive_some())
        await s.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        _, lazy = await negotiate_outbound(client, ["/tcp-test/1"], lazy=True)
        await lazy.send_all(b"hello")
        assert await lazy.receive_some() == b"hello"
        await lazy.aclose()
        nursery.cancel_scope.cancel()


async def test_inbound_accepts_a_single_string_exactly():
    async def dialer(s):
        return (await negotiate_outbound(s, ["/a", "/abc"]))[0]

    async def listener(s):
        return (await negotiate_inbound(s, "/abc"))[0]

    assert await _pair(dialer, listener) == ("/abc", "/abc")
