"""In-memory network: exact latency/bandwidth under MockClock, bounded buffers, failures."""

from __future__ import annotations

import pytest
import trio

from dht.p2p import memory
from dht.p2p.memory import MemoryNetwork


@pytest.fixture(autouse=True, params=["fast-timers", "cancel-scopes"])
def timers(request, monkeypatch):
    """Every test runs with both ways of timing a wait: trio's deadline heap directly (the
    default where trio's internals allow it) and the cancel-scope fallback."""
    if request.param == "fast-timers":
        assert memory._FAST_TIMERS, "this trio's internals no longer fit memory._Waiter"
    else:
        monkeypatch.setattr(memory, "_FAST_TIMERS", False)
    return request.param


async def connected_pair(net: MemoryNetwork):
    ta, tb = net.transport(), net.transport()
    (la,) = await ta.listen("/memory/0")
    (lb,) = await tb.listen("/memory/0")
    a = await ta.dial(lb.multiaddr)
    b, remote = await lb.accept()
    assert remote == str(la.multiaddr)
    return la, lb, a, b


async def read_n(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = await stream.receive_some()
        assert data, "unexpected EOF"
        out += data
    return bytes(out)


async def test_latency_is_exact(autojump_clock):
    net = MemoryNetwork(latency=0.25)
    _, _, a, b = await connected_pair(net)
    start = trio.current_time()
    await a.send_all(b"hello")
    assert await b.receive_some() == b"hello"
    assert trio.current_time() - start == pytest.approx(0.25, abs=1e-9)
    await b.send_all(b"back")
    assert await a.receive_some() == b"back"
    assert trio.current_time() - start == pytest.approx(0.5, abs=1e-9)


async def test_bandwidth_is_exact(autojump_clock):
    net = MemoryNetwork(latency=0.1, bandwidth=1_000_000)
    _, _, a, b = await connected_pair(net)
    size = 3_000_000
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, b"\1" * size)
        data = await read_n(b, size)
    assert len(data) == size
    # serialization (size / bandwidth) + propagation (latency)
    assert trio.current_time() - start == pytest.approx(3.0 + 0.1, abs=1e-6)


async def test_set_link_overrides_defaults(autojump_clock):
    net = MemoryNetwork()
    la, lb, a, b = await connected_pair(net)
    net.set_link(la.multiaddr, lb.multiaddr, latency=1.0)
    start = trio.current_time()
    await a.send_all(b"x")
    await b.receive_some()
    assert trio.current_time() - start == pytest.approx(1.0)


async def test_slow_reader_blocks_the_sender(autojump_clock):
    net = MemoryNetwork(buffer_size=64 * 1024)
    _, _, a, b = await connected_pair(net)
    sent = 0
    with trio.move_on_after(10):
        while True:
            await a.send_all(b"\0" * 4096)
            sent += 4096
    assert sent <= 64 * 1024
    assert len(await b.receive_some()) > 0


async def test_partition_stalls_and_heal_resumes(autojump_clock):
    net = MemoryNetwork(latency=0.01)
    la, lb, a, b = await connected_pair(net)
    net.partition([la.multiaddr], [lb.multiaddr])
    await a.send_all(b"during partition")
    with trio.move_on_after(5) as scope:
        await b.receive_some()
    assert scope.cancelled_caught, "nothing crosses a partition"
    with pytest.raises(ConnectionRefusedError):
        await la.transport.dial(lb.multiaddr)  # new dials across the partition fail
    net.heal()
    with trio.fail_after(1):
        assert await b.receive_some() == b"during partition"


async def test_kill_breaks_connections_and_refuses_new_ones(autojump_clock):
    net = MemoryNetwork()
    la, lb, a, b = await connected_pair(net)
    net.kill(lb.multiaddr)
    with pytest.raises(trio.BrokenResourceError):
        await a.receive_some()
    with pytest.raises(trio.BrokenResourceError):
        await b.send_all(b"x")
    with pytest.raises(ConnectionRefusedError):
        await la.transport.dial(lb.multiaddr)
    # the killed node cannot dial out either, until it listens again
    with pytest.raises(ConnectionRefusedError):
        await lb.transport.dial(la.multiaddr)
    (revived,) = await lb.transport.listen(lb.multiaddr)
    stream = await lb.transport.dial(la.multiaddr)
    accepted, remote = await la.accept()
    assert remote == str(revived.multiaddr)
    await stream.aclose()
    await accepted.aclose()


async def test_eof_and_close():
    net = MemoryNetwork()
    _, _, a, b = await connected_pair(net)
    await a.send_all(b"data")
    await a.send_eof()
    assert await b.receive_some() == b"data"
    assert await b.receive_some() == b""
    await b.send_all(b"reply")
    assert await a.receive_some() == b"reply"
    await b.aclose()
    assert await a.receive_some() == b""

    _, _, c, d = await connected_pair(net)
    await d.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await c.send_all(b"to a closed peer")


async def test_dial_nobody_listening():
    net = MemoryNetwork()
    with pytest.raises(ConnectionRefusedError):
        await net.transport().dial("/memory/12345")


async def test_cancelled_receive_loses_nothing(autojump_clock):
    net = MemoryNetwork(latency=0.1)
    _, _, a, b = await connected_pair(net)
    await a.send_all(b"first")
    await trio.sleep(1)  # it has arrived
    with trio.CancelScope() as scope:
        scope.cancel()
        await b.receive_some()
    assert scope.cancelled_caught
    assert await b.receive_some() == b"first"


async def test_many_abandoned_timed_waits_keep_timing_exact(autojump_clock):
    """Reads given up long before their chunk arrives leave stale deadlines behind (thousands
    of them make trio prune its heap): the wait that is kept still ends exactly on time."""
    net = MemoryNetwork(latency=1000.0)
    _, _, a, b = await connected_pair(net)
    start = trio.current_time()
    await a.send_all(b"late")
    for _ in range(3000):
        with trio.move_on_after(0.01):
            await b.receive_some()
    assert await b.receive_some() == b"late"
    assert trio.current_time() - start == pytest.approx(1000.0, abs=1e-6)


async def test_many_readers_each_wake_at_their_arrival(autojump_clock):
    """Chunks in flight on many links at once are each delivered at their own time."""
    net = MemoryNetwork()
    pairs = []
    for i in range(20):
        la, lb, a, b = await connected_pair(net)
        net.set_link(la.multiaddr, lb.multiaddr, latency=0.01 * (20 - i), bandwidth=1000.0)
        pairs.append((a, b, 0.01 * (20 - i)))
    start = trio.current_time()
    arrived: dict[int, float] = {}

    async def read(i: int, b) -> None:
        assert await b.receive_some() == b"y" * 10
        arrived[i] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        for i, (a, b, _) in enumerate(pairs):
            nursery.start_soon(read, i, b)
            nursery.start_soon(a.send_all, b"y" * 10)
    for i, (_, _, latency) in enumerate(pairs):
        # 10 bytes at 1000 B/s serialize in 10 ms, then the link's latency
        assert arrived[i] == pytest.approx(0.01 + latency, abs=1e-9)
