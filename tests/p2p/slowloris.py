"""A slowloris attacker for tests: holds N idle TCP connections to a host, renewing each one
as soon as the host closes it. Runs as its own process (its sockets do not count against the
test process' file descriptors, and it does not share the test's event loop).

    python -m tests.p2p.slowloris HOST PORT CONNECTIONS SOURCE_IP [SOURCE_IP ...]

Also :func:`slow_to_speak_proxy`, a relay that makes a well-behaved newcomer slow to speak.

Prints ``ready`` once it has opened as many connections as it holds, and on SIGTERM
``opened=<n> closed_by_host=<n> failed=<n>`` before it exits. (Not "once every slot has
connected": at thousands of reconnects a second a slot's new port may hit one of the host's
TIME_WAIT entries, and its connect then waits for a SYN retransmit.)
"""

from __future__ import annotations

import resource
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio

from dht.p2p.multiaddr import Multiaddr


class Stats:
    def __init__(self) -> None:
        self.opened = 0
        self.closed_by_host = 0
        self.failed = 0
        self.target = 0


async def hold(host: str, port: int, source: str, stats: Stats, ready: trio.Event) -> None:
    """One connection slot: connect, send nothing, wait for the host to hang up, repeat."""
    while True:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=source)
        except OSError:
            stats.failed += 1
            await trio.sleep(0.05)  # refused or out of ports: do not spin
            continue
        stats.opened += 1
        if stats.opened >= stats.target:
            ready.set()
        try:
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, OSError):
            pass
        stats.closed_by_host += 1
        await stream.aclose()


@asynccontextmanager
async def slow_to_speak_proxy(target: Multiaddr, delay: float) -> AsyncIterator[Multiaddr]:
    """A TCP relay to ``target`` that connects at once but holds the dialer's first bytes for
    ``delay`` seconds: the host sees a newcomer that is slow to speak (a busy process, a
    congested uplink), which a flood churning through its slots faster than that locks out."""
    host, port = target.tcp_endpoint()

    async def pipe(src: trio.SocketStream, dst: trio.SocketStream, hold: float) -> None:
        await trio.sleep(hold)
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
            await dst.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def relay(client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(host, port)
        except OSError:
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(pipe, client, upstream, delay)
            nursery.start_soon(pipe, upstream, client, 0.0)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, relay, 0, host="127.0.0.1"))
        proxy_port = listener.socket.getsockname()[1]
        try:
            yield Multiaddr(f"/ip4/127.0.0.1/tcp/{proxy_port}/p2p/{target.peer_id}")
        finally:
            nursery.cancel_scope.cancel()


async def main(host: str, port: int, count: int, sources: list[str]) -> None:
    stats = Stats()
    stats.target = count
    ready = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(hold, host, port, sources[i % len(sources)], stats, ready)
            await ready.wait()
            print("ready", flush=True)
            async for _ in signals:
                break
            print(
                f"opened={stats.opened} closed_by_host={stats.closed_by_host} "
                f"failed={stats.failed}",
                flush=True,
            )
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
