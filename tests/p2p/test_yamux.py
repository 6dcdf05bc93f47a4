"""yamux: wire format, streams, half-close, reset, flow control, window tuning, limits."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.p2p.errors import ResourceLimitError, StreamClosedError, StreamResetError
from dht.p2p.memory import MemoryNetwork
from dht.p2p.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    HEADER,
    INITIAL_WINDOW,
    TYPE_DATA,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YamuxSession,
    pack_header,
)

from .conftest import DelayedSends, socket_stream_pair, yamux_pair


async def read_all(stream: trio.abc.ReceiveStream) -> bytes:
    out = bytearray()
    while True:
        data = await stream.receive_some()
        if not data:
            return bytes(out)
        out += data


async def read_frame(raw: trio.abc.ReceiveStream, buf: bytearray) -> tuple[tuple, bytes]:
    """Read one yamux frame from a raw stream (test helper acting as a remote peer)."""
    while len(buf) < 12:
        buf += await raw.receive_some()
    fields = HEADER.unpack(bytes(buf[:12]))
    del buf[:12]
    payload = b""
    if fields[1] == TYPE_DATA:
        while len(buf) < fields[4]:
            buf += await raw.receive_some()
        payload = bytes(buf[: fields[4]])
        del buf[: fields[4]]
    return fields, payload


async def test_header_layout_matches_spec():
    assert pack_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0) == bytes.fromhex(
        "000100010000000100000000"
    )
    assert pack_header(TYPE_DATA, FLAG_FIN | FLAG_ACK, 2, 5) == bytes.fromhex(
        "000000060000000200000005"
    )


async def test_open_sends_syn_with_odd_id_and_server_acks():
    client_raw, server_raw = socket_stream_pair()
    client = YamuxSession(client_raw, is_client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        buf = bytearray()
        stream = await client.open_stream()
        await stream.send_all(b"hi")
        frames = []
        while len(frames) < 3:
            frames.append(await read_frame(server_raw, buf))
        by_type = {(f[1], f[3]): (f, p) for f, p in frames}
        assert (TYPE_PING, 0) in by_type  # RTT probe sent at start
        (ver, _, flags, sid, length), _ = by_type[(TYPE_WINDOW_UPDATE, 1)]
        assert (ver, flags, sid, length) == (0, FLAG_SYN, 1, 0)
        (_, _, flags, sid, length), payload = by_type[(TYPE_DATA, 1)]
        assert payload == b"hi" and length == 2
        # The server side (our raw socket) opens stream 2 and sends data; the client accepts.
        await server_raw.send_all(pack_header(TYPE_DATA, FLAG_SYN, 2, 3) + b"abc")
        inbound = await client.accept_stream()
        assert inbound.stream_id == 2
        assert await inbound.receive_some() == b"abc"
        # the ACK rides on the first frame the accepting side sends ...
        await inbound.send_all(b"reply")
        (_, ftype, flags, sid, _), payload = await read_frame(server_raw, buf)
        assert (ftype, flags, sid, payload) == (TYPE_DATA, FLAG_ACK, 2, b"reply")
        # ... or is sent bare as soon as the reader has to wait
        await server_raw.send_all(pack_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 4, 0))
        quiet = await client.accept_stream()
        async with trio.open_nursery() as waiting:
            waiting.start_soon(quiet.receive_some)
            (_, ftype, flags, sid, length), _ = await read_frame(server_raw, buf)
            assert (ftype, flags, sid, length) == (TYPE_WINDOW_UPDATE, FLAG_ACK, 4, 0)
            waiting.cancel_scope.cancel()
        await client.aclose()


async def test_echo_both_directions_and_half_close():
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"request")
        await stream.send_eof()
        inbound = await server.accept_stream()
        assert inbound.stream_id % 2 == 1
        assert await read_all(inbound) == b"request"
        # half-closed by the client, but the server can still answer
        await inbound.send_all(b"response")
        await inbound.aclose()
        assert await read_all(stream) == b"response"
        with pytest.raises(trio.ClosedResourceError):
            await stream.send_all(b"more")
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert client.num_streams == 0 and server.num_streams == 0

        server_opened = await server.open_stream()
        assert server_opened.stream_id % 2 == 0
        await server_opened.send_all(b"x")
        assert await (await client.accept_stream()).receive_some() == b"x"


async def test_reset_reaches_the_remote():
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send_all(b"a")
        inbound = await server.accept_stream()
        assert await inbound.receive_some() == b"a"
        stream.reset()
        with pytest.raises(StreamResetError):
            await inbound.receive_some()
        with pytest.raises(StreamResetError):
            await inbound.send_all(b"b")
        with pytest.raises(StreamResetError):
            await stream.send_all(b"c")


async def test_thousand_concurrent_streams_on_one_connection():
    async with yamux_pair(max_streams=2048) as (client, server):

        async def serve():
            async with trio.open_nursery() as nursery:
                for _ in range(1000):
                    inbound = await server.accept_stream()
                    nursery.start_soon(echo, inbound)

        async def echo(s):
            data = await read_all(s)
            await s.send_all(hashlib.sha256(data).digest())
            await s.aclose()

        results = {}

        async def one(i):
            s = await client.open_stream()
            payload = i.to_bytes(4, "big") * (i % 50 + 1)
            await s.send_all(payload)
            await s.send_eof()
            results[i] = (await read_all(s)) == hashlib.sha256(payload).digest()
            await s.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            async with trio.open_nursery() as clients:
                for i in range(1000):
                    clients.start_soon(one, i)
        assert len(results) == 1000 and all(results.values())
        await trio.testing.wait_all_tasks_blocked()
        assert client.num_streams == 0 and server.num_streams == 0


async def test_unread_stream_is_bounded_by_its_window():
    async with yamux_pair() as (client, server):
        stream = await client.open_stream()
        sent = 0
        with trio.move_on_after(1.0) as scope:
            while True:
                await stream.send_all(b"x" * 65536)
                sent += 65536
        assert scope.cancelled_caught, "the sender must block when the window is exhausted"
        inbound = await server.accept_stream()
        assert sent <= INITIAL_WINDOW
        assert inbound.buffered_bytes <= INITIAL_WINDOW
        assert server.buffered_bytes <= INITIAL_WINDOW
        # reading releases the window and the stream continues, byte-exact
        total = 0
        async with trio.open_nursery() as nursery:

            async def more():
                await stream.send_all(b"y" * 1_000_000)
                await stream.send_eof()

            nursery.start_soon(more)
            total = len(await read_all(inbound))
        assert total >= 1_000_000


async def test_cancelled_send_leaves_no_partial_frame():
    async with yamux_pair() as (client, server):
        s1 = await client.open_stream()
        with trio.move_on_after(0.2):
            await s1.send_all(b"z" * (4 * INITIAL_WINDOW))  # blocks on the window, then cancelled
        s2 = await client.open_stream()
        await s2.send_all(b"still works")
        await s2.send_eof()
        inbound1 = await server.accept_stream()
        inbound2 = await server.accept_stream()
        got = await inbound1.receive_some()
        assert set(got) == {ord("z")}
        assert await read_all(inbound2) == b"still works"
        assert not client.closed and not server.closed


async def test_window_auto_tuning_on_a_high_latency_link(autojump_clock):
    net = MemoryNetwork(latency=0.05, bandwidth=200e6)  # 100 ms RTT, 200 MB/s
    transport_a, transport_b = net.transport(), net.transport()
    (listener,) = await transport_b.listen("/memory/0")
    raw_a = await transport_a.dial(listener.multiaddr)
    raw_b, _ = await listener.accept()
    size = 32 * 1024 * 1024
    async with yamux_pair(raw_a, raw_b) as (client, server):
        await trio.sleep(1)  # let the RTT probe finish
        assert client.rtt == pytest.approx(0.1, rel=0.01)
        assert server.rtt == pytest.approx(0.1, rel=0.01)
        stream = await client.open_stream()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def send():
                await stream.send_all(b"\0" * size)
                await stream.send_eof()

            nursery.start_soon(send)
            inbound = await server.accept_stream()
            received = len(await read_all(inbound))
        elapsed = trio.current_time() - start
        assert received == size
        assert inbound.receive_window > INITIAL_WINDOW
        # With a fixed 256 KiB window this would take size / 256 KiB * RTT = 12.8 s.
        assert elapsed < 0.5 * (size / INITIAL_WINDOW) * 0.1


async def test_stream_limit_refuses_with_rst():
    async with yamux_pair(max_streams=2) as (client, server):
        streams = [await client.open_stream() for _ in range(2)]
        for s in streams:
            await s.send_all(b".")
        with pytest.raises(ResourceLimitError):
            await client.open_stream()
        # the remote's limit: the client may only know after the RST
        client.max_streams = 10
        extra = await client.open_stream()
        await extra.send_all(b"!")
        with pytest.raises(StreamResetError):
            await extra.receive_some()
        assert not client.closed


@pytest.mark.parametrize(
    "frame, reason",
    [
        (pack_header(TYPE_DATA, FLAG_SYN, 1, 2**31), "exceeds the receive window"),
        (pack_header(TYPE_DATA, 0, 99, 2**32 - 1), "unknown stream"),
        (bytes([1]) + pack_header(TYPE_DATA, FLAG_SYN, 1, 1)[1:], "unsupported yamux version"),
        (pack_header(7, 0, 1, 0), "unknown yamux frame type"),
        (pack_header(TYPE_WINDOW_UPDATE, 0x40, 1, 0), "unknown yamux flags"),
        (pack_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 2, 0), "our id parity"),
    ],
)
async def test_protocol_violations_close_the_session(frame, reason, caplog):
    client_raw, server_raw = socket_stream_pair()
    server = YamuxSession(server_raw, is_client=False, name="victim")
    with caplog.at_level(logging.WARNING, logger="dht.p2p.yamux"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client_raw.send_all(frame)
            with trio.fail_after(5):
                await server.wait_closed()
    assert server.closed and reason in server.close_reason
    assert any("victim" in r.message and reason in r.message for r in caplog.records)


async def test_data_beyond_window_is_a_violation():
    client_raw, server_raw = socket_stream_pair()
    server = YamuxSession(server_raw, is_client=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await client_raw.send_all(pack_header(TYPE_DATA, FLAG_SYN, 1, INITIAL_WINDOW))
        await client_raw.send_all(b"\0" * INITIAL_WINDOW)
        await client_raw.send_all(pack_header(TYPE_DATA, 0, 1, 1) + b"!")
        with trio.fail_after(5):
            await server.wait_closed()
    assert "exceeds the receive window" in server.close_reason


async def test_ping_and_go_away():
    async with yamux_pair() as (client, server):
        rtt = await client.ping()
        assert 0 <= rtt < 1
        await server.aclose()
        with trio.fail_after(5):
            await client.wait_closed()
        with pytest.raises(StreamClosedError):
            await client.open_stream()


async def test_remote_go_away_blocks_new_streams_only():
    client_raw, server_raw = socket_stream_pair()
    client = YamuxSession(client_raw, is_client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        await server_raw.send_all(struct.pack(">BBHII", 0, 3, 0, 0, 0))
        await trio.sleep(0.1)
        assert client.remote_go_away
        with pytest.raises(StreamClosedError):
            await client.open_stream()
        await client.aclose()


async def test_keepalive_detects_a_silent_peer(autojump_clock, caplog):
    client_raw, server_raw = trio.testing.memory_stream_pair()
    client = YamuxSession(client_raw, is_client=True, keepalive_interval=5, keepalive_timeout=5)
    with caplog.at_level(logging.WARNING):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            # the "server" never answers anything
            with trio.fail_after(60):
                await client.wait_closed()
    assert client.close_reason == "keepalive timeout"
    assert any("keepalive" in r.message for r in caplog.records)
    del server_raw


def _never_answer_pings(session: YamuxSession, monkeypatch) -> None:
    """``session`` sends no pong: to its peer, every keepalive ping goes unanswered."""
    real = session._enqueue_control

    def no_pongs(ftype, flags, stream_id, length):
        if ftype == 2 and flags & 0x2:  # a Ping with ACK: the answer to the other's ping
            return
        real(ftype, flags, stream_id, length)

    monkeypatch.setattr(session, "_enqueue_control", no_pongs)


async def test_keepalive_keeps_a_connection_whose_data_keeps_arriving(autojump_clock, monkeypatch):
    """A pong stuck behind a full link is late, but a peer whose data keeps arriving is not
    half-open: the connection stays (it was closed mid-round on a 200-kbit/s race). Pings
    alone do not count, and once the data stops the keepalive closes it."""
    a, b = trio.testing.memory_stream_pair()
    async with yamux_pair(a, b, keepalive_interval=5, keepalive_timeout=5) as (client, server):
        _never_answer_pings(server, monkeypatch)
        outbound = await server.open_stream()
        inbound = await client.accept_stream()

        async def drain() -> None:
            with contextlib.suppress(StreamResetError):  # until the keepalive closes it
                while await inbound.receive_some():
                    pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            for _ in range(60):  # a minute of 10 kB/s, never a pong
                await outbound.send_all(b"x" * 10_000)
                await trio.sleep(1.0)
            assert not client.closed
            quiet_since = trio.current_time()
            with trio.fail_after(60):
                await client.wait_closed()
            assert client.close_reason == "keepalive timeout"
            assert trio.current_time() - quiet_since <= 5 + 5 + 5  # two pings at most
            nursery.cancel_scope.cancel()


async def test_keepalive_keeps_a_connection_whose_peer_keeps_reading_our_data(
    autojump_clock, monkeypatch
):
    """On a saturated home uplink the remote's pong and its little data can take longer than
    the keepalive's timeout, while the remote keeps granting window for the data we send it:
    it reads, so the connection is not half-open (7 KB in 20 s closed live connections in the
    200-kbit/s race). Once it stops granting, the keepalive closes it."""
    a, b = trio.testing.memory_stream_pair()
    async with yamux_pair(a, b, keepalive_interval=5, keepalive_timeout=5) as (client, server):
        _never_answer_pings(server, monkeypatch)
        outbound = await client.open_stream()
        inbound = await server.accept_stream()
        reading = trio.Event()

        async def drain() -> None:
            with contextlib.suppress(StreamResetError):
                while await inbound.receive_some():
                    if reading.is_set():
                        return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            received_at_start = client.bytes_received
            for _ in range(60):  # a minute of 20 kB/s upward, read by the server
                await outbound.send_all(b"x" * 20_000)
                await trio.sleep(1.0)
            # the server sent only window updates: far less than a busy link's worth
            assert client.bytes_received - received_at_start < 2_000
            assert not client.closed
            reading.set()  # the server stops reading: no more window
            quiet_since = trio.current_time()
            with trio.fail_after(60):
                await client.wait_closed()
            assert client.close_reason == "keepalive timeout"
            assert trio.current_time() - quiet_since <= 5 + 5 + 5 + 5
            nursery.cancel_scope.cancel()


async def test_rst_flag_on_data_frame():
    client_raw, server_raw = socket_stream_pair()
    client = YamuxSession(client_raw, is_client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        stream = await client.open_stream()
        await server_raw.send_all(pack_header(TYPE_WINDOW_UPDATE, FLAG_RST, stream.stream_id, 0))
        with pytest.raises(StreamResetError):
            await stream.receive_some()
        await client.aclose()


async def test_connection_buffer_cap_resets_the_stream_that_overflows(caplog):
    # two streams may each buffer 256 KiB, but the connection only 300 KiB in total
    async with yamux_pair(max_buffered=300 * 1024) as (client, server):
        first = await client.open_stream()
        await first.send_all(b"a" * INITIAL_WINDOW)
        inbound_first = await server.accept_stream()
        await trio.testing.wait_all_tasks_blocked()
        second = await client.open_stream()
        with caplog.at_level(logging.WARNING, logger="dht.p2p.yamux"):
            await second.send_all(b"b" * INITIAL_WINDOW)
            inbound_second = await server.accept_stream()
            with pytest.raises(StreamResetError):
                await inbound_second.receive_some()
        assert any("receive buffer full" in r.message for r in caplog.records)
        assert server.buffered_bytes <= 300 * 1024
        # the first stream and the connection are unaffected
        assert len(await inbound_first.receive_some()) > 0
        assert not server.closed


class GatedStream(trio.abc.Stream):
    """Records writes; every write waits until the test opens the gate."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.gate = trio.Event()

    async def send_all(self, data) -> None:
        await self.gate.wait()
        self.writes.append(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await self.gate.wait()

    async def receive_some(self, max_bytes=None) -> bytes:
        await trio.sleep_forever()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def frames_of(data: bytes) -> list[tuple]:
    out = []
    while data:
        fields = HEADER.unpack(data[:12])
        skip = 12 + (fields[4] if fields[1] == TYPE_DATA else 0)
        out.append(fields)
        data = data[skip:]
    return out


async def test_control_frames_overtake_queued_data_and_small_frames_coalesce():
    conn = GatedStream()
    session = YamuxSession(conn, is_client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits at the gate (RTT ping)
        stream = await session.open_stream()
        await stream.send_all(b"d" * 200_000)  # queued behind the gate
        await stream.send_all(b"small")
        await stream.send_eof()
        nursery.start_soon(session.ping)
        await trio.testing.wait_all_tasks_blocked()
        conn.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        frames = frames_of(b"".join(conn.writes))
        kinds = [(f[1], f[2]) for f in frames]
        # startup ping first, then the later ping overtakes the queued SYN and data
        assert kinds[0] == (TYPE_PING, FLAG_SYN) and kinds[1] == (TYPE_PING, FLAG_SYN)
        assert kinds[2:] == [
            (TYPE_WINDOW_UPDATE, FLAG_SYN),
            (TYPE_DATA, 0),
            (TYPE_DATA, 0),
            (TYPE_WINDOW_UPDATE, FLAG_FIN),
        ]
        # the small data frame and the FIN left in one write
        fin = pack_header(TYPE_WINDOW_UPDATE, FLAG_FIN, stream.stream_id, 0)
        assert any(b"small" in w and w.endswith(fin) for w in conn.writes)
        nursery.cancel_scope.cancel()


@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),  # version (1 = bad)
            st.integers(0, 4),  # type (4 = bad)
            st.integers(0, 0x1F),  # flags (0x10 = bad)
            st.integers(0, 6),  # stream id
            st.sampled_from([0, 1, 5, 1000, INITIAL_WINDOW, 2**31]),  # length
            st.binary(max_size=64),  # payload bytes that follow (may not match length)
        ),
        max_size=12,
    )
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_frames_never_crash_the_session(frames):
    async def scenario():
        a, b = trio.testing.memory_stream_pair()
        server = YamuxSession(b, is_client=False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)

            async def drain():  # the remote reads whatever we answer
                try:
                    while await a.receive_some():
                        pass
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

            nursery.start_soon(drain)

            async def accept_all():
                while True:
                    try:
                        stream = await server.accept_stream()
                    except StreamClosedError:
                        return
                    nursery.start_soon(read_all_quietly, stream)

            nursery.start_soon(accept_all)
            try:
                for version, ftype, flags, sid, length, payload in frames:
                    header = bytes([version, ftype]) + struct.pack(">HII", flags, sid, length)
                    await a.send_all(header + payload)
                await a.send_eof()
            except trio.BrokenResourceError:
                pass  # the session already closed the connection: fine
            await a.aclose()
            with trio.fail_after(5):
                await server.wait_closed()
            nursery.cancel_scope.cancel()
        assert server.closed and server.buffered_bytes <= server.max_buffered

    trio.run(scenario)


async def read_all_quietly(stream) -> None:
    try:
        while await stream.receive_some():
            pass
    except (StreamResetError, trio.ClosedResourceError):
        pass


class InterruptingStream(GatedStream):
    """Like GatedStream, but every write makes the session queue an urgent control frame.

    That is what a busy connection does: window updates and pings are produced while the
    writer is in the middle of a batch, and they overtake queued data at its next round.
    """

    def __init__(self, on_write) -> None:
        super().__init__()
        self.on_write = on_write

    async def send_all(self, data) -> None:
        await self.gate.wait()
        self.writes.append(bytes(data))
        self.on_write()


def parse_frames(data: bytes) -> list[tuple[tuple, bytes]]:
    """Strict parse of a yamux byte stream: every header must be valid (version 0, known type)."""
    out = []
    pos = 0
    while pos < len(data):
        assert len(data) - pos >= 12, f"truncated header at byte {pos}"
        fields = HEADER.unpack_from(data, pos)
        assert fields[0] == 0 and fields[1] <= 3, f"garbage header {fields} at byte {pos}"
        pos += 12
        payload = b""
        if fields[1] == TYPE_DATA:
            payload = data[pos : pos + fields[4]]
            assert len(payload) == fields[4], "truncated payload"
            pos += fields[4]
        out.append((fields, payload))
    return out


# Regression (commit 32290d2): the writer's batch could end right after a Data header, and the
# control frames queued meanwhile were written before that header's payload. The sweep moves the
# batch boundary across every byte of the second frame's header.
@pytest.mark.parametrize("first", range(INITIAL_WINDOW - 160, INITIAL_WINDOW, 5))
async def test_control_frames_never_land_between_a_data_header_and_its_payload(first):
    spares: list = []

    def reset_a_spare_stream() -> None:  # queues an urgent RST frame
        if spares:
            spares.pop().reset()

    conn = InterruptingStream(reset_a_spare_stream)
    session = YamuxSession(conn, is_client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits at the gate (RTT ping)
        spares.extend([await session.open_stream() for _ in range(3)])
        stream = await session.open_stream()
        payload = bytes(range(256)) * (INITIAL_WINDOW // 256)
        await stream.send_all(payload[:first])  # one frame: the whole initial window but a bit
        await stream.send_all(payload[first:])  # then a small frame whose header may end a batch
        conn.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        frames = parse_frames(b"".join(conn.writes))
        data = b"".join(p for f, p in frames if f[1] == TYPE_DATA and f[3] == stream.stream_id)
        assert data == payload
        assert sum(1 for f, _ in frames if f[2] & FLAG_RST) >= 2  # control frames were mixed in
        nursery.cancel_scope.cancel()


async def test_yamux_over_a_prefixed_secure_session_reads_the_prefix_first(nursery):
    """multistream hands yamux a PrefixedStream when the remote's first frames came with its
    answer. yamux must read through the wrapper, not through the SecureSession's fast path
    that the wrapper's attribute passthrough exposes (that lost the listener's RTT ping)."""
    from dht.p2p.identity import Identity
    from dht.p2p.multistream import PrefixedStream
    from dht.p2p.noise import noise_handshake

    a_raw, b_raw = socket_stream_pair()
    ids = Identity.generate(), Identity.generate()
    sessions = {}

    async def handshake(name, raw, ident, initiator):
        sessions[name] = await noise_handshake(raw, ident, initiator=initiator)

    async with trio.open_nursery() as hs:
        hs.start_soon(handshake, "a", a_raw, ids[0], True)
        hs.start_soon(handshake, "b", b_raw, ids[1], False)
    remote, local = sessions["a"], sessions["b"]
    wrapped = PrefixedStream(local, pack_header(TYPE_PING, FLAG_SYN, 0, 4242))
    session = YamuxSession(wrapped, is_client=False)
    nursery.start_soon(session.run)
    buf = bytearray()
    with trio.fail_after(10):
        while True:
            (_, ftype, flags, _, length), _ = await read_frame(remote, buf)
            if ftype == TYPE_PING and flags == FLAG_ACK:
                break
    assert length == 4242  # the ping in the prefix was answered
    await session.aclose()
    await remote.aclose()


class _SlowLink(DelayedSends):
    """A stream whose sends take as long as their bytes at ``rate`` (a slow uplink)."""

    def __init__(self, inner: trio.abc.HalfCloseableStream, rate: float) -> None:
        super().__init__(inner)
        self.rate = rate

    async def before_send(self, data) -> None:
        await trio.sleep(len(data) / self.rate)


async def test_a_request_overtakes_a_bulk_streams_queued_data_on_a_slow_link(autojump_clock):
    """One stream pushes megabytes over a 1 MB/s uplink; a request opened meanwhile is
    answered within a batch of the link's time (~50 ms), not after the megabyte or more
    queued before it (~1 s and more before light streams went first)."""
    client_raw, server_raw = trio.testing.memory_stream_pair()
    async with yamux_pair(_SlowLink(client_raw, 1e6), server_raw) as (client, server):
        answered: list[float] = []

        async def serve() -> None:
            async with trio.open_nursery() as inner:
                inner.start_soon(read_all, await server.accept_stream())
                request = await server.accept_stream()
                assert await request.receive_some() == b"ping"
                await request.send_all(b"pong")

        async def push() -> None:
            bulk = await client.open_stream()
            for _ in range(16):
                await bulk.send_all(b"x" * (256 * 1024))
            await bulk.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(push)
            await trio.sleep(1.0)  # the bulk stream has filled every queue by now
            asked = trio.current_time()
            request = await client.open_stream()
            await request.send_all(b"ping")
            assert await request.receive_some() == b"pong"
            answered.append(trio.current_time() - asked)
        assert answered[0] < 0.25, answered


async def test_streams_crossing_the_light_limit_keep_their_bytes_in_order(autojump_clock):
    """Frames of a stream go to the light queue, then (past LIGHT_STREAM_BYTES) to the other
    for good: every stream's bytes and its FIN still arrive whole and in order, while light
    and heavy streams interleave on a slow link."""
    client_raw, server_raw = trio.testing.memory_stream_pair()
    sizes = [10, 64 * 1024, 64 * 1024 + 1, 200_000, 3_000_000, 70_000, 5]
    payloads = [hashlib.sha256(bytes([i])).digest() * (n // 32 + 1) for i, n in enumerate(sizes)]
    payloads = [p[:n] for p, n in zip(payloads, sizes, strict=True)]
    received: dict[bytes, bytes] = {}
    async with yamux_pair(_SlowLink(client_raw, 2e6), server_raw) as (client, server):

        async def serve_one(stream) -> None:
            data = await read_all(stream)
            received[data[:32]] = data

        async def send(payload: bytes, delay: float) -> None:
            await trio.sleep(delay)
            stream = await client.open_stream()
            for i in range(0, len(payload), 50_000):  # several sends, some crossing the limit
                await stream.send_all(payload[i : i + 50_000])
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            for i, payload in enumerate(payloads):
                nursery.start_soon(send, payload, 0.1 * i)
            for _ in payloads:
                nursery.start_soon(serve_one, await server.accept_stream())
    assert sorted(received.values()) == sorted(payloads)


@pytest.mark.parametrize("who", ["local", "remote"])
async def test_a_reset_streams_queued_data_is_never_sent(autojump_clock, who):
    """Four bulk streams fill the queue of a 1 MB/s uplink (a window each, 1 MiB), then are
    reset (by us, or by the remote: their round was abandoned). Their queued frames are
    dropped, not sent: the remote would drop them anyway, and a transfer started right
    after gets the link once the frame on the wire is through, instead of after the dead
    megabyte (at 200 kbit/s an abandoned all-reduce round's data kept the link busy ~40 s)."""
    client_raw, server_raw = trio.testing.memory_stream_pair()
    async with yamux_pair(_SlowLink(client_raw, 1e6), server_raw) as (client, server):
        took: list[float] = []

        async def drain(stream) -> None:
            with contextlib.suppress(StreamResetError):
                while await stream.receive_some():
                    pass

        async def push(stream) -> None:
            with contextlib.suppress(StreamResetError, trio.ClosedResourceError):
                for _ in range(16):
                    await stream.send_all(b"x" * (256 * 1024))

        async with trio.open_nursery() as nursery:
            bulks, served = [], []
            for _ in range(4):
                bulks.append(await client.open_stream())
                nursery.start_soon(push, bulks[-1])
                served.append(await server.accept_stream())
                nursery.start_soon(drain, served[-1])
            await trio.sleep(0.3)
            queued = client.queued_bytes
            assert queued > 900 * 1024, queued
            for bulk, remote in zip(bulks, served, strict=True):
                (bulk if who == "local" else remote).reset()
            await trio.testing.wait_all_tasks_blocked()  # a remote RST has arrived by now
            assert all(bulk._reset for bulk in bulks)
            # what is left: the one frame (at most 256 KiB) the writer is sending
            assert client.queued_bytes <= 256 * 1024 + 64, client.queued_bytes
            started = trio.current_time()
            second = await client.open_stream()
            await second.send_all(b"y" * 200_000)
            await second.send_eof()
            got = await read_all(await server.accept_stream())
            took.append(trio.current_time() - started)
            nursery.cancel_scope.cancel()
        assert got == b"y" * 200_000
        # its own 0.2 s at 1 MB/s after the frame on the wire (<= 0.26 s), not also 0.75 s
        # of dead data
        assert took[0] < 0.6, (took, queued)
