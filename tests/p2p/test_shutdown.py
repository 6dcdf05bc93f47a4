"""Leaving ``Host.open`` releases everything: tasks, threads, sockets (file descriptors)."""

from __future__ import annotations

import os
import threading

import trio
import trio.testing

from dht.p2p import Host, HostLimits, MemoryNetwork, P2PStream

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def busy_session(a: Host, b: Host) -> None:
    """Leave the hosts in a messy state: open streams, a running handler, a stalled handshake."""
    (addr,) = await b.listen(LOCAL)

    async def forever(stream: P2PStream):
        await stream.send_all(b"started")
        await trio.sleep_forever()

    async def echo(peer, request):
        return request

    b.set_stream_handler("/forever/1.0.0", forever)
    b.set_rpc_handler("/echo/1.0.0", echo)
    pid = await a.connect([addr])
    assert await a.call(pid, "/echo/1.0.0", "x") == "x"
    await a.ping(pid)
    stream = await a.new_stream(pid, "/forever/1.0.0")
    assert await stream.receive_some() == b"started"
    await (await a.new_stream(pid, "/echo/1.0.0")).send_all(b"\x05")  # half-sent request
    # a raw TCP peer that never finishes its handshake
    host, port = addr.tcp_endpoint()
    stalled = await trio.open_tcp_stream(host, port)
    return stalled


async def test_tcp_hosts_leave_nothing_behind():
    await trio.testing.wait_all_tasks_blocked()
    tasks, fds, threads = count_tasks(), count_fds(), threading.active_count()
    async with Host.open() as a, Host.open() as b:
        stalled = await busy_session(a, b)
        assert count_fds() > fds
    await stalled.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert count_tasks() == tasks
    assert count_fds() == fds
    assert threading.active_count() == threads


async def test_memory_hosts_leave_nothing_behind(autojump_clock):
    net = MemoryNetwork(latency=0.01)
    tasks = count_tasks()
    async with Host.open(transport=net.transport()) as a, Host.open(transport=net.transport()) as b:
        (addr,) = await b.listen(["/memory/0"])

        async def echo(peer, request):
            return request

        b.set_rpc_handler("/echo/1.0.0", echo)
        pid = await a.connect([addr])
        assert await a.call(pid, "/echo/1.0.0", 1) == 1
    await trio.testing.wait_all_tasks_blocked()
    assert count_tasks() == tasks
    assert not net._connections and not net._listeners


async def test_cancelling_the_owner_closes_the_host():
    await trio.testing.wait_all_tasks_blocked()
    tasks, fds = count_tasks(), count_fds()
    stalled = []
    with trio.move_on_after(0.5):
        async with Host.open() as a, Host.open(limits=HostLimits(handshake_timeout=30)) as b:
            stalled.append(await busy_session(a, b))
            await trio.sleep_forever()
    await stalled[0].aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert count_tasks() == tasks
    assert count_fds() == fds
