"""Reading a payload straight into the caller's buffer: yamux ``receive_exactly_into`` and the
layers above it (multistream's PrefixedStream, MessageReader, P2PStream)."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from dht.p2p.errors import StreamClosedError, StreamResetError
from dht.p2p.messages import MessageReader, send_msg
from dht.p2p.multistream import PrefixedStream
from dht.p2p.yamux import FLAG_SYN, TYPE_DATA, TYPE_WINDOW_UPDATE, YamuxSession, pack_header

from .conftest import yamux_pair


async def _accept_and_send(server, data: bytes, *, eof: bool = True, pieces: int = 7):
    stream = await server.accept_stream()
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        await stream.send_all(data[i : i + step])
    if eof:
        await stream.send_eof()
    return stream


@pytest.mark.parametrize("reader_first", [True, False])
async def test_mixed_reads_return_exactly_the_bytes_sent(reader_first):
    """Small reads and large receive_exactly_into calls interleaved, with the reader either
    waiting before the data arrives (the direct path) or arriving after it was buffered."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"go")
        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_accept_and_send, server, data)
            if not reader_first:  # a window's worth arrives (buffered) before we read
                await trio.testing.wait_all_tasks_blocked()
            sizes = [5, 1 << 20, 3, 300_000, 64 * 1024, 1 << 20]
            i = 0
            while len(got) < len(data):
                want = min(sizes[i % len(sizes)], len(data) - len(got))
                i += 1
                if want > 1000:
                    buf = bytearray(want)
                    assert await stream.receive_exactly_into(memoryview(buf)) == want
                    got += buf
                else:
                    got += await stream.receive_some(want)
        assert bytes(got) == data
        assert await stream.receive_some() == b""
        assert stream.buffered_bytes == 0 and client.buffered_bytes == 0


async def test_cancelled_receive_into_loses_nothing():
    data = os.urandom(700_000)
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"go")
        inbound = await server.accept_stream()
        buf = bytearray(1 << 20)
        async with trio.open_nursery() as nursery:

            async def send_part():
                await inbound.send_all(data[:300_000])

            nursery.start_soon(send_part)
            with trio.move_on_after(0.5):  # the buffer never fills: 300 kB of 1 MiB arrive
                await stream.receive_exactly_into(memoryview(buf))
        await inbound.send_all(data[300_000:])
        await inbound.send_eof()
        rest = bytearray(len(data))
        assert await stream.receive_exactly_into(memoryview(rest)) == len(data)
        assert bytes(rest) == data


async def test_eof_and_reset_while_receiving_into():
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"go")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_accept_and_send, server, b"x" * 100)
            buf = bytearray(200)
            assert await stream.receive_exactly_into(memoryview(buf)) == 100
            assert bytes(buf[:100]) == b"x" * 100

        second = await client.open_stream()
        await second.send_all(b"go")
        inbound = await server.accept_stream()
        async with trio.open_nursery() as nursery:

            async def reset_soon():
                await inbound.send_all(b"y" * 10)
                await trio.testing.wait_all_tasks_blocked()
                inbound.reset()

            nursery.start_soon(reset_soon)
            with pytest.raises(StreamResetError):
                await second.receive_exactly_into(memoryview(bytearray(1000)))
        with pytest.raises(TypeError, match="writable"):
            await stream.receive_exactly_into(memoryview(b"read-only"))


class _PlainStream(trio.abc.ReceiveStream):
    """A receive stream without receive_exactly_into (the fallback path)."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    async def receive_some(self, max_bytes=None):
        await trio.lowlevel.checkpoint()
        n = min(self.step, len(self.data), max_bytes or self.step)
        out, self.data = self.data[:n], self.data[n:]
        return out

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("wrapped", [False, True])
async def test_message_then_raw_payload_through_reader_and_prefix(wrapped):
    """A message and the payload behind it, with part of the payload already read ahead
    (by MessageReader, or replayed by PrefixedStream) and the rest from the stream."""
    payload = os.urandom(50_000)
    stream = trio.testing.MemorySendStream()
    await send_msg(stream, {"len": len(payload)})
    await stream.send_all(payload)
    wire = stream.get_data_nowait()
    inner: trio.abc.ReceiveStream = _PlainStream(wire[10:], 4096)
    if wrapped:
        inner = PrefixedStream(inner, wire[:10])
    else:
        inner = _PlainStream(wire, 4096)
    reader = MessageReader(inner)
    msg = await reader.receive_msg()
    buf = bytearray(msg["len"])
    await reader.receive_exactly_into(memoryview(buf))
    assert bytes(buf) == payload
    with pytest.raises(StreamClosedError, match="payload"):
        await reader.receive_exactly_into(memoryview(bytearray(1)))


async def test_a_payload_behind_its_header_in_one_read_goes_straight_into_the_readers_buffer():
    """The header frame and the payload frames after it arrive in one read of the connection:
    the session lets the woken reader parse the header and post its buffer before handing out
    the rest, so the payload is copied once (into the buffer), never through the stream's
    queue."""
    client_raw, server_raw = trio.testing.memory_stream_pair()
    client = YamuxSession(client_raw, is_client=True, name="client")
    header, payload = b"HEADER", os.urandom(200_000)  # within the initial window
    got: dict[str, bytes] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        await server_raw.send_all(pack_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 2, 0))
        stream = await client.accept_stream()

        async def read_message() -> None:
            got["header"] = await stream.receive_some()
            buf = bytearray(len(payload))
            assert await stream.receive_exactly_into(memoryview(buf)) == len(payload)
            got["payload"] = bytes(buf)

        async with trio.open_nursery() as reading:
            reading.start_soon(read_message)
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for the header
            frames = bytearray(pack_header(TYPE_DATA, 0, 2, len(header)) + header)
            for i in range(0, len(payload), 50_000):
                piece = payload[i : i + 50_000]
                frames += pack_header(TYPE_DATA, 0, 2, len(piece)) + piece
            await server_raw.send_all(bytes(frames))  # one read for the session
        assert got == {"header": header, "payload": payload}
        assert stream.bytes_through_buffer == len(header)
        await client.aclose()
        nursery.cancel_scope.cancel()
