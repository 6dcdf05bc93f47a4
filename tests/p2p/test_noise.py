"""Noise XX (libp2p flavour): state machine vectors, handshake, transport framing, attacks."""

from __future__ import annotations

import os
from functools import partial

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dht.p2p._crypto_noise import XXHandshakeState, hkdf, nonce_bytes
from dht.p2p.errors import (
    HandshakeError,
    P2PTimeoutError,
    PeerIDMismatchError,
    ProtocolViolationError,
    StreamResetError,
)
from dht.p2p.identity import Identity
from dht.p2p.noise import (
    MAX_PLAINTEXT,
    SIGNATURE_PREFIX,
    SecureSession,
    decode_handshake_payload,
    encode_handshake_payload,
    noise_handshake,
)

# Produced by an independent implementation (the `noiseprotocol` package) for
# Noise_XX_25519_ChaChaPoly_SHA256, empty prologue, static/ephemeral private keys
# initiator s=01*32 e=02*32, responder s=03*32 e=04*32, payloads "", "resp", "init",
# then transport messages "hello" (initiator) and "world" (responder).
KEYS = {name: bytes([i] * 32) for i, name in enumerate(["is", "ie", "rs", "re"], 1)}
M1 = "ce8d3ad1ccb633ec7b70c17814a5c76ecd029685050d344745ba05870e587d59"
M2 = (
    "ac01b2209e86354fb853237b5de0f4fab13c7fcbf433a61c019369617fecf10bb719b14d19eaf5ca91c8974"
    "8c5ce8668e6864f05ee2367682b3e0c2fd086f0b4f64162733f3fe548251c518fe8c03cced86cd8125d8cbc"
    "32cc4d3acd5379ed88530b53fd"
)
M3 = (
    "539a5cf3ae8a0a9134b32bfa775a1522db3558a1351ed4101989b8b88aa6a6f003ca12093fd0c1da0a742184"
    "ed0dd1472e0cdd5f1f148bf56228b371db8fb39d01b1334d"
)
T1 = "f5c8fdccae8939c5a6d0d9be2753d6cf345c85961d"
T2 = "ef940bdf5a86302dad53e2e4243977a108057c9693"


def test_state_machine_matches_independent_vectors():
    key = X25519PrivateKey.from_private_bytes
    ini = XXHandshakeState(True, key(KEYS["is"]), ephemeral_key=key(KEYS["ie"]))
    res = XXHandshakeState(False, key(KEYS["rs"]), ephemeral_key=key(KEYS["re"]))
    m1 = ini.write_message(b"")
    assert m1.hex() == M1
    assert res.read_message(m1) == b""
    m2 = res.write_message(b"resp")
    assert m2.hex() == M2
    assert ini.read_message(m2) == b"resp"
    m3 = ini.write_message(b"init")
    assert m3.hex() == M3
    assert res.read_message(m3) == b"init"
    assert ini.handshake_hash == res.handshake_hash
    i_send, i_recv = ini.split()
    r_send, r_recv = res.split()
    assert i_send.encrypt_with_ad(None, b"hello").hex() == T1
    assert r_send.encrypt_with_ad(None, b"world").hex() == T2
    assert r_recv.decrypt_with_ad(None, bytes.fromhex(T1)) == b"hello"
    assert i_recv.decrypt_with_ad(None, bytes.fromhex(T2)) == b"world"


def test_primitives():
    assert nonce_bytes(1) == b"\0\0\0\0" + (1).to_bytes(8, "little")
    a, b = hkdf(b"k" * 32, b"ikm", 2)
    assert len(a) == len(b) == 32 and a != b
    ini = XXHandshakeState(True, X25519PrivateKey.generate())
    with pytest.raises(HandshakeError, match="out of turn"):
        ini.read_message(b"\0" * 32)


def test_tampered_handshake_message_rejected():
    ini = XXHandshakeState(True, X25519PrivateKey.generate())
    res = XXHandshakeState(False, X25519PrivateKey.generate())
    res.read_message(ini.write_message(b""))
    m2 = bytearray(res.write_message(b"payload"))
    m2[40] ^= 1  # inside the encrypted static key
    with pytest.raises(HandshakeError, match="authentication"):
        ini.read_message(bytes(m2))


def test_low_order_point_rejected():
    ini = XXHandshakeState(True, X25519PrivateKey.generate())
    ini.write_message(b"")
    with pytest.raises(HandshakeError, match="X25519"):
        ini.read_message(b"\0" * 32 + b"\0" * 64)


def test_payload_codec():
    encoded = encode_handshake_payload(b"key", b"sig")
    assert decode_handshake_payload(encoded + b"\x22\x00") == (b"key", b"sig")  # extensions ok
    with pytest.raises(HandshakeError, match="lacks"):
        decode_handshake_payload(b"\x0a\x03key")
    with pytest.raises(HandshakeError, match="malformed"):
        decode_handshake_payload(b"\x0a\x09key")


async def _handshake_pair(a, b, id_a, id_b, kw_a=None, kw_b=None):
    out = {}

    async def side(name, stream, ident, initiator, extra):
        out[name] = await noise_handshake(stream, ident, initiator=initiator, **(extra or {}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "a", a, id_a, True, kw_a)
        nursery.start_soon(side, "b", b, id_b, False, kw_b)
    return out["a"], out["b"]


async def test_handshake_memory_and_identities():
    id_a, id_b = Identity.generate(), Identity.generate()
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(
        a, b, id_a, id_b, kw_a={"expected_peer": id_b.peer_id}, kw_b={"expected_peer": id_a.peer_id}
    )
    assert sa.local_peer == id_a.peer_id and sa.remote_peer == id_b.peer_id
    assert sb.local_peer == id_b.peer_id and sb.remote_peer == id_a.peer_id
    assert sa.raw is a
    await sa.send_all(b"ping")
    assert await sb.receive_some() == b"ping"
    await sb.send_all(b"pong")
    assert await sa.receive_some() == b"pong"


async def test_handshake_lockstep():
    """No step of the handshake needs both sides to write at once."""
    a, b = trio.testing.lockstep_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, b"x" * 100_000)
        got = b""
        while len(got) < 100_000:
            got += await sb.receive_some()
    assert got == b"x" * 100_000


SIZES = [
    1,
    MAX_PLAINTEXT - 1,
    MAX_PLAINTEXT,
    MAX_PLAINTEXT + 1,
    2 * MAX_PLAINTEXT,
    2 * MAX_PLAINTEXT + 1,
    (1 << 20) - 1,
    1 << 20,
    (1 << 20) + 1,
    3 * (1 << 20) + 12345,
]


@pytest.fixture
async def tcp_sessions(nursery):
    """A SecureSession pair over real loopback TCP."""
    id_a, id_b = Identity.generate(), Identity.generate()
    accepted = trio.Event()
    server_stream = {}

    async def handler(stream):
        server_stream["s"] = stream
        accepted.set()
        await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await accepted.wait()
    sa, sb = await _handshake_pair(
        client, server_stream["s"], id_a, id_b, kw_a={"expected_peer": id_b.peer_id}
    )
    yield sa, sb
    await sa.aclose()
    await sb.aclose()


async def _receive_exactly(stream, n):
    parts, got = [], 0
    while got < n:
        data = await stream.receive_some()
        assert data, "unexpected EOF"
        parts.append(bytes(data))
        got += len(data)
    assert got == n
    return b"".join(parts)


@pytest.mark.parametrize("size", SIZES)
async def test_sizes_around_frame_boundaries_over_tcp(tcp_sessions, size):
    sa, sb = tcp_sessions
    payload = os.urandom(size)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, payload)
        assert await _receive_exactly(sb, size) == payload
    reply = payload[::-1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sb.send_all, memoryview(reply))
        assert await _receive_exactly(sa, size) == reply


async def test_many_small_writes_and_max_bytes(tcp_sessions):
    sa, sb = tcp_sessions
    chunks = [os.urandom(n) for n in (1, 2, 3, 500, 70000, 7)]
    for c in chunks:
        await sa.send_all(c)
    await sa.send_all(b"")  # no-op, not a frame
    expected = b"".join(chunks)
    got = bytearray()
    while len(got) < len(expected):
        piece = await sb.receive_some(1000)
        assert 0 < len(piece) <= 1000
        got += piece
    assert got == expected


async def test_half_close_over_tcp(tcp_sessions):
    sa, sb = tcp_sessions
    await sa.send_all(b"last words")
    await sa.send_eof()
    assert await _receive_exactly(sb, 10) == b"last words"
    assert await sb.receive_some() == b""
    await sb.send_all(b"still open")  # the other direction keeps working
    assert await _receive_exactly(sa, 10) == b"still open"


async def test_mitm_wrong_expected_peer_over_tcp(nursery):
    id_a, id_b, someone_else = Identity.generate(), Identity.generate(), Identity.generate()
    result = {}
    done = trio.Event()

    async def handler(stream):
        try:
            await noise_handshake(stream, id_b, initiator=False, timeout=5)
        except HandshakeError as e:
            result["server"] = e
        await stream.aclose()
        done.set()

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    with pytest.raises(PeerIDMismatchError, match=str(id_b.peer_id)):
        await noise_handshake(
            client, id_a, initiator=True, expected_peer=someone_else.peer_id, timeout=5
        )
    await client.aclose()
    with trio.fail_after(5):
        await done.wait()
    # the dialer never sent message 3, so the responder never learned the dialer's identity
    assert "connection closed" in str(result["server"])


async def test_tampered_ciphertext_is_rejected():
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    # intercept: encrypt via sa into a buffer, flip a bit, deliver to sb's raw stream
    frame = sa._encrypt_batch(memoryview(b"secret message"))
    frame[10] ^= 0x01
    await sa.raw.send_all(frame)
    with pytest.raises(ProtocolViolationError, match="failed authentication"):
        await sb.receive_some()
    with pytest.raises(ProtocolViolationError):  # permanent
        await sb.receive_some()


async def test_replayed_frame_is_rejected():
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    frame = sa._encrypt_batch(memoryview(b"pay me once"))
    await sa.raw.send_all(bytes(frame) + bytes(frame))
    with pytest.raises(ProtocolViolationError):
        await sb.receive_some()


async def test_truncated_frame_at_eof():
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    frame = sa._encrypt_batch(memoryview(b"x" * 100))
    await sa.raw.send_all(frame[:50])
    await sa.raw.send_eof()
    with pytest.raises(StreamResetError, match="middle of a Noise frame"):
        await sb.receive_some()


async def test_clean_eof_returns_empty():
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    await sa.send_eof()
    assert await sb.receive_some() == b""


async def test_truncated_handshake_frame():
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"\x00\x20" + b"\x01" * 10)
    await a.send_eof()
    with pytest.raises(HandshakeError, match="truncated frame"):
        await noise_handshake(b, Identity.generate(), initiator=False)


async def test_garbage_first_message():
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"\x00\x05hello")
    with pytest.raises(HandshakeError, match="too short"):
        await noise_handshake(b, Identity.generate(), initiator=False)


async def test_stall_mid_handshake_times_out(autojump_clock):
    a, b = trio.testing.memory_stream_pair()
    start = trio.current_time()
    with pytest.raises(P2PTimeoutError, match="3 s"):
        # the responder never answers message 1
        await noise_handshake(a, Identity.generate(), initiator=True, timeout=3)
    assert trio.current_time() - start == pytest.approx(3)
    assert await b.receive_some()  # message 1 was sent


async def test_bad_signature_rejected(monkeypatch):
    """A responder whose payload signs some other static key must be refused."""
    import dht.p2p.noise as noise_mod

    real = noise_mod._make_payload

    honest, liar = Identity.generate(), Identity.generate()

    def forged(identity, static_public):
        if identity is liar:
            return real(identity, bytes(32))  # signature over the wrong static key
        return real(identity, static_public)

    monkeypatch.setattr(noise_mod, "_make_payload", forged)
    a, b = trio.testing.memory_stream_pair()

    async def responder():
        try:
            await noise_handshake(b, liar, initiator=False, timeout=5)
        except HandshakeError:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(responder)
        with pytest.raises(HandshakeError, match="signature"):
            await noise_handshake(a, honest, initiator=True, timeout=5)
        await a.aclose()


async def test_payload_with_wrong_key_type_rejected():
    """identity_key must be an Ed25519 libp2p PublicKey."""
    from dht.p2p import noise as noise_mod

    secp = bytes.fromhex(
        "08021221037777e994e452c21604f91de093ce415f5432f701dd8cd1a7a6fea0e630bfca99"
    )
    payload = encode_handshake_payload(secp, b"\0" * 64)
    with pytest.raises(HandshakeError, match="Secp256k1"):
        noise_mod._verify_payload(payload, bytes(32))


async def test_signature_prefix_is_libp2p():
    assert SIGNATURE_PREFIX == b"noise-libp2p-static-key:"


async def test_concurrent_send_is_refused():
    a, b = trio.testing.lockstep_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, b"x" * 10)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await sa.send_all(b"y")
        assert await sb.receive_some() == b"x" * 10
    assert isinstance(sa, SecureSession)


class _Trickle(trio.abc.HalfCloseableStream):
    """Delivers what ``inner`` received in small random pieces (frames split across reads)."""

    def __init__(self, inner, seed=0):
        import random

        self.inner = inner
        self.rng = random.Random(seed)

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(self.rng.randint(1, 7000))

    async def send_all(self, data):
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self):
        await self.inner.send_eof()

    async def aclose(self):
        await self.inner.aclose()


async def test_frames_split_across_many_small_reads():
    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, _Trickle(b), Identity.generate(), Identity.generate())
    payload = os.urandom(3 * MAX_PLAINTEXT + 999)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, payload)
        assert await _receive_exactly(sb, len(payload)) == payload


class _SlowLink(_Trickle):
    """Sends what it is given 1 KiB per second (a very full uplink)."""

    slow = False

    async def send_all(self, data):
        if not self.slow:
            await self.inner.send_all(data)
            return
        view = memoryview(bytes(data))
        for i in range(0, len(view), 1024):
            await self.inner.send_all(view[i : i + 1024])
            await trio.sleep(1.0)


async def test_bytes_of_a_frame_still_arriving_count_as_read_and_writes_as_sent(autojump_clock):
    """Over a slow link one 64-KiB frame takes a minute to arrive: ``last_read`` and
    ``bytes_read`` move with every piece (the keepalive, the DHT and the all-reduce's stall
    limits see a busy peer, not a silent one). ``bytes_written`` counts every write that went
    through (on a TCP socket each ``os.write``; on another stream, as here, each send)."""
    a, b = trio.testing.memory_stream_pair()
    slow = _SlowLink(a)
    sa, sb = await _handshake_pair(slow, b, Identity.generate(), Identity.generate())
    slow.slow = True
    payload = os.urandom(MAX_PLAINTEXT)
    started = trio.current_time()
    read_before, written_before = sb.bytes_read, sa.bytes_written
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, payload)
        nursery.start_soon(_receive_exactly, sb, len(payload))
        await trio.sleep(30.5)  # half the frame is in: nothing decrypted yet
        assert sb.last_read >= trio.current_time() - 1.0
        assert sb.last_read > started + 29
        assert 29 * 1024 <= sb.bytes_read - read_before <= 32 * 1024
    assert trio.current_time() - started > 60  # the frame took a minute
    assert sa.bytes_written - written_before == len(payload) + 18  # length prefix + tag


class _HoldMessage3(trio.abc.HalfCloseableStream):
    """Holds back the 2nd write (Noise message 3) and sends it together with the 3rd."""

    def __init__(self, inner):
        self.inner = inner
        self.writes = 0
        self.held = b""

    async def send_all(self, data):
        self.writes += 1
        if self.writes == 2:
            self.held = bytes(data)
            await trio.lowlevel.checkpoint()
            return
        await self.inner.send_all(self.held + bytes(data))
        self.held = b""

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self):
        await self.inner.send_eof()

    async def aclose(self):
        await self.inner.aclose()


async def test_transport_data_arriving_with_message_3():
    """Bytes read past the handshake are decrypted, not lost."""
    a, b = trio.testing.memory_stream_pair()
    id_a, id_b = Identity.generate(), Identity.generate()
    result = {}

    async def responder():
        result["sb"] = await noise_handshake(b, id_b, initiator=False, timeout=5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(responder)
        sa = await noise_handshake(_HoldMessage3(a), id_a, initiator=True, timeout=5)
        await sa.send_all(b"early data")  # leaves in the same write as message 3
    sb = result["sb"]
    assert sb._initial  # the responder over-read into the transport phase
    assert await sb.receive_some() == b"early data"


async def test_responder_rejects_initiator_with_bad_signature(monkeypatch):
    import dht.p2p.noise as noise_mod

    real = noise_mod._make_payload
    honest, liar = Identity.generate(), Identity.generate()

    def forged(identity, static_public):
        return real(identity, bytes(32) if identity is liar else static_public)

    monkeypatch.setattr(noise_mod, "_make_payload", forged)
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(noise_handshake, a, liar, initiator=True, timeout=5))
        with pytest.raises(HandshakeError, match="signature"):
            await noise_handshake(b, honest, initiator=False, timeout=5)
        nursery.cancel_scope.cancel()


async def test_fallback_without_encrypt_into(monkeypatch):
    """cryptography < 45 has no encrypt_into/decrypt_into; the copying path must match."""
    import dht.p2p.noise as noise_mod

    a, b = trio.testing.memory_stream_pair()
    sa, sb = await _handshake_pair(a, b, Identity.generate(), Identity.generate())
    payload = os.urandom(2 * MAX_PLAINTEXT + 5)
    await sa.send_all(payload)  # fast path
    monkeypatch.setattr(noise_mod, "_HAS_INTO", False)
    await sa.send_all(payload)  # fallback path, same wire format
    assert await _receive_exactly(sb, 2 * len(payload)) == payload * 2
    monkeypatch.setattr(noise_mod, "_HAS_INTO", True)
    await sb.send_all(payload)
    monkeypatch.setattr(noise_mod, "_HAS_INTO", False)
    assert await _receive_exactly(sa, len(payload)) == payload


async def test_bulk_mode_send_parts_and_borrowed_views_over_tcp(tcp_sessions, monkeypatch):
    """The bulk paths: send_parts packs small parts and encrypts large ones in place; the
    receiver switches to reused buffers (receive_view lends them) and back to per-read ones."""
    sa, sb = tcp_sessions
    entered = []
    original_enter = sb._enter_bulk_mode
    monkeypatch.setattr(sb, "_enter_bulk_mode", lambda: (entered.append(1), original_enter()))
    rng = __import__("random").Random(7)
    parts = []
    for _ in range(300):  # headers, payloads, tails around MAX_PLAINTEXT and the batch size
        size = rng.choice([0, 1, 12, 100, 4095, 4096, MAX_PLAINTEXT, MAX_PLAINTEXT + 1, 262144])
        parts.append(os.urandom(size))
    parts.append(bytearray(os.urandom(70_000)))  # mutable parts work too
    expected = b"".join(parts)
    received = bytearray()

    async def receive():
        while len(received) < len(expected):
            view = await sb.receive_view()
            assert view, "stream ended early"
            received.extend(view)  # a borrowed view is valid until the next receive

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        for start in range(0, len(parts), 40):
            await sa.send_parts(parts[start : start + 40])
    assert received == expected
    assert entered, "the receiver never switched to its bulk buffers"
    # small traffic afterwards: the receiver drops its bulk buffers and still reads correctly
    for i in range(5):
        await sa.send_all(b"small %d" % i)
        assert await _receive_exactly(sb, len(b"small %d" % i)) == b"small %d" % i
    assert sb._cbuf is None


async def test_tampered_frame_in_bulk_mode_is_detected(tcp_sessions):
    sa, sb = tcp_sessions
    payload = os.urandom(512 * 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, payload)
        assert await _receive_exactly(sb, len(payload)) == payload
        if sb._cbuf is None:  # reads came back small: switch as a large read would
            sb._enter_bulk_mode()
        frame = bytearray(sa._encrypt_batch(memoryview(os.urandom(300_000))))
        frame[70_000] ^= 1  # a bit flip in the second frame
        nursery.start_soon(sa.raw.send_all, bytes(frame))
        with pytest.raises(ProtocolViolationError, match="authentication"):
            await _receive_exactly(sb, 300_000)
        with pytest.raises(ProtocolViolationError):  # permanent
            await sb.receive_some()


async def test_unread_puts_plaintext_back_in_front(tcp_sessions):
    sa, sb = tcp_sessions
    await sa.send_all(b"world")
    sb.unread(b"hello ")
    assert await _receive_exactly(sb, 11) == b"hello world"


async def test_a_send_larger_than_the_socket_buffer_waits_and_arrives_intact(
    tcp_sessions, monkeypatch
):
    """Batches go to the TCP descriptor directly; when the socket is full the sender waits
    for it to drain (the receiver starts late) and every byte arrives in order."""
    import dht.p2p.noise as noise_module

    sa, sb = tcp_sessions
    waits = []
    wait_writable = trio.lowlevel.wait_writable

    async def counting_wait(sock):
        waits.append(sock)
        await wait_writable(sock)

    monkeypatch.setattr(noise_module.trio.lowlevel, "wait_writable", counting_wait)
    payload = os.urandom(12 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sa.send_all, payload)
        await trio.sleep(0.2)  # the kernel buffers fill; the sender must wait
        assert await _receive_exactly(sb, len(payload)) == payload
    assert waits and all(w is sa.raw.socket for w in waits)


async def test_sending_on_a_closed_or_reset_connection_raises_trio_errors(tcp_sessions):
    sa, sb = tcp_sessions
    await sb.raw.aclose()  # the peer goes away: its kernel answers with RST
    with pytest.raises(trio.BrokenResourceError, match="socket error while sending"):
        with trio.fail_after(10):
            for _ in range(1000):
                await sa.send_all(os.urandom(1 << 20))
                await trio.sleep(0.001)
    await sa.raw.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sa.send_all(os.urandom(1 << 20))


async def test_sending_after_send_eof_raises_closed_resource_error(tcp_sessions):
    sa, _ = tcp_sessions
    await sa.send_eof()
    with pytest.raises(trio.ClosedResourceError, match="after sending EOF"):
        await sa.send_all(os.urandom(1 << 20))
