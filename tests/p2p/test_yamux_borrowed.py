"""yamux sends views of a caller's mutable buffer without copying them: send_all returns only
once they are sent, and a cancelled send copies what is still queued, so a caller that
reuses its buffer afterwards never changes what the remote receives."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from dht.p2p.identity import Identity
from dht.p2p.noise import noise_handshake

from .conftest import DelayedSends, socket_stream_pair, yamux_pair


async def _secure_pair(a_raw=None, b_raw=None):
    """Noise sessions over two connected raw streams (a fresh socket pair by default)."""
    if a_raw is None or b_raw is None:
        a_raw, b_raw = socket_stream_pair()
    sessions = {}

    async def handshake(name, raw, initiator):
        sessions[name] = await noise_handshake(raw, Identity.generate(), initiator=initiator)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(handshake, "a", a_raw, True)
        nursery.start_soon(handshake, "b", b_raw, False)
    return sessions["a"], sessions["b"]


async def _pair(secure: bool):
    if secure:
        return yamux_pair(*(await _secure_pair()))
    return yamux_pair()


async def _read_all(stream) -> bytes:
    out = bytearray()
    while data := await stream.receive_some():
        out += data
    return bytes(out)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "noise"])
async def test_buffer_reused_right_after_send_all(secure):
    original = os.urandom(3 * 1024 * 1024 + 5)
    async with await _pair(secure) as (client, server):
        stream = await client.open_stream()
        got = {}

        async def reader():
            inbound = await server.accept_stream()
            got["data"] = await _read_all(inbound)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            buf = bytearray(original)
            for _ in range(3):
                await stream.send_all(buf)
                buf[:] = os.urandom(len(buf))  # the caller reuses its buffer at once
                original += bytes(buf)
            original = original[: -len(buf)]  # the last refill was never sent
            await stream.send_eof()
        assert got["data"] == original
        assert not client._borrowed and stream._borrowed_pending == 0


class _Gate(DelayedSends):
    """A stream whose writes wait while the gate is shut (a stalled network)."""

    def __init__(self, inner: trio.SocketStream) -> None:
        super().__init__(inner)
        self.open = trio.Event()
        self.open.set()

    async def before_send(self, data) -> None:
        await self.open.wait()


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "noise"])
async def test_cancelled_send_never_leaks_later_writes_to_the_buffer(secure):
    """The network stalls with megabytes of the send queued as views of the caller's buffer;
    the send is cancelled and the buffer overwritten: whatever the remote gets afterwards is
    a prefix of the original (queued views were copied; the batch the writer holds was
    already encrypted, or copied on a plain stream)."""
    original = os.urandom(4 * 1024 * 1024)
    a_raw, b_raw = socket_stream_pair()
    gate = _Gate(a_raw)
    conns = await _secure_pair(gate, b_raw) if secure else (gate, b_raw)
    async with yamux_pair(*conns, stream_window=16 * 1024 * 1024) as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"hello")
        inbound = await server.accept_stream()
        assert await inbound.receive_some() == b"hello"
        await inbound.send_all(b"ok")  # its window grant travelled before this answer
        assert await stream.receive_some() == b"ok"
        gate.open = trio.Event()  # the network stalls
        buf = bytearray(original)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, buf)
            await trio.testing.wait_all_tasks_blocked()
            # views of ``buf`` are queued, or held by the stalled writer, when it is cancelled
            assert stream._borrowed_pending > 0
            nursery.cancel_scope.cancel()
        buf[:] = b"\xff" * len(buf)
        assert stream._borrowed_pending == 0 and not client._borrowed
        gate.open.set()
        await stream.aclose()
        with trio.fail_after(20):
            received = await _read_all(inbound)
        assert 0 < len(received) <= len(original)
        assert received == original[: len(received)]
