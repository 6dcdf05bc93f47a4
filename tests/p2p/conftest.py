"""Shared helpers for the network tests: real socket pairs and running yamux sessions."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from dht.p2p.yamux import YamuxSession


def socket_stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two connected trio streams over a real (Unix) socket pair."""
    a, b = socket.socketpair()
    return (
        trio.SocketStream(trio.socket.from_stdlib_socket(a)),
        trio.SocketStream(trio.socket.from_stdlib_socket(b)),
    )


@asynccontextmanager
async def yamux_pair(
    conn_a: trio.abc.Stream | None = None,
    conn_b: trio.abc.Stream | None = None,
    **kwargs,
) -> AsyncIterator[tuple[YamuxSession, YamuxSession]]:
    """A running client/server yamux session pair; both are closed on exit."""
    if conn_a is None or conn_b is None:
        conn_a, conn_b = socket_stream_pair()
    client = YamuxSession(conn_a, is_client=True, name="client", **kwargs)
    server = YamuxSession(conn_b, is_client=False, name="server", **kwargs)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        nursery.start_soon(server.run)
        try:
            yield client, server
        finally:
            await client.aclose()
            await server.aclose()


async def wait_until(predicate, limit: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` (log records, connection tables: state without an event to await)."""
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - there is no event for this external state
            await trio.sleep(interval)


class DelayedSends(trio.abc.HalfCloseableStream):
    """Wraps a stream; every send first awaits :meth:`before_send` (a stalled or slow
    network, as the subclass decides). Everything else passes through."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        self.inner = inner

    async def before_send(self, data) -> None:
        await trio.lowlevel.checkpoint()

    async def send_all(self, data) -> None:
        await self.before_send(data)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()
