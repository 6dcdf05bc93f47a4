"""Noise with AES-256-GCM between moshpit peers: vectors, nonce layout, negotiation, fallback.

``/moshpit/noise-aesgcm/1.0.0`` runs ``Noise_XX_25519_AESGCM_SHA256`` with libp2p's payload
and framing; a moshpit dialer proposes it first and falls back to ``/noise`` (ChaChaPoly).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from dht.p2p import Host, Identity, MemoryNetwork
from dht.p2p._crypto_noise import AESGCM_256, CHACHAPOLY, CipherState, XXHandshakeState
from dht.p2p.errors import HandshakeError, ProtocolViolationError
from dht.p2p.multistream import negotiate_outbound
from dht.p2p.noise import (
    AESGCM_PROTOCOL_ID,
    DEFAULT_SECURITY_PROTOCOLS,
    PROTOCOL_ID,
    SecureSession,
    noise_handshake,
)

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
NOISE_ONLY = (PROTOCOL_ID,)

# Produced by an independent implementation (the `noiseprotocol` package, 0.3.1) for
# Noise_XX_25519_AESGCM_SHA256, empty prologue, private keys initiator s=01*32 e=02*32,
# responder s=03*32 e=04*32, payloads "", "resp", "init"; then transport messages "hello"
# (initiator, n=0), "world" (responder, n=0) and the initiator's "x" at n=3 (after two more).
KEYS = {name: bytes([i] * 32) for i, name in enumerate(["is", "ie", "rs", "re"], 1)}
M1 = "ce8d3ad1ccb633ec7b70c17814a5c76ecd029685050d344745ba05870e587d59"
M2 = (
    "ac01b2209e86354fb853237b5de0f4fab13c7fcbf433a61c019369617fecf10bd4c9856676fde558f69b9347"
    "b4f34194bf4af4b72afef9b550038a764652bcd4bb9b3bd55e55511a2348555ee4448dc86fb280fccdb31826"
    "9b186f422dc35bdce09e495b"
)
M3 = (
    "599b61d8987775d21570135cae3d36e5cdf4629e9dd0f9506de827d8ee9e17edfcedb2bb3957fab26094e0ae"
    "b1ffd09cfe745fa9da85925c14b3b8ea86c9efccdf408a3d"
)
T1 = "1e9f96ef3a1545be8ccd5e329a0eb2985530379780"
T2 = "b9b81d2c1ad0c6fd2a59251ca9e42c90ad38c8f46a"
T1_N3 = "18bacae2574b7933991773d48a7daa7d8c"
INITIATOR_SEND_KEY = "66fb46d684e97be61b40186b21461be1b628d52279667b53530296885e9a66f5"


def test_aesgcm_state_machine_matches_independent_vectors():
    key = X25519PrivateKey.from_private_bytes
    ini = XXHandshakeState(True, key(KEYS["is"]), ephemeral_key=key(KEYS["ie"]), cipher=AESGCM_256)
    res = XXHandshakeState(False, key(KEYS["rs"]), ephemeral_key=key(KEYS["re"]), cipher=AESGCM_256)
    m1 = ini.write_message(b"")
    assert m1.hex() == M1
    assert res.read_message(m1) == b""
    m2 = res.write_message(b"resp")
    assert m2.hex() == M2
    assert ini.read_message(m2) == b"resp"
    m3 = ini.write_message(b"init")
    assert m3.hex() == M3
    assert res.read_message(m3) == b"init"
    i_send, i_recv = ini.split()
    r_send, r_recv = res.split()
    assert isinstance(i_send.aead, AESGCM)
    assert i_send.encrypt_with_ad(None, b"hello").hex() == T1
    assert r_send.encrypt_with_ad(None, b"world").hex() == T2
    assert r_recv.decrypt_with_ad(None, bytes.fromhex(T1)) == b"hello"
    assert i_recv.decrypt_with_ad(None, bytes.fromhex(T2)) == b"world"
    i_send.encrypt_with_ad(None, b"x")
    i_send.encrypt_with_ad(None, b"x")
    assert i_send.encrypt_with_ad(None, b"x").hex() == T1_N3  # the counter's byte order


def test_protocol_name_seeds_the_handshake_hash():
    # same keys, other cipher: the ChaChaPoly handshake differs from message 2 on
    key = X25519PrivateKey.from_private_bytes
    assert AESGCM_256.protocol_name == b"Noise_XX_25519_AESGCM_SHA256"
    assert CHACHAPOLY.protocol_name == b"Noise_XX_25519_ChaChaPoly_SHA256"
    a = XXHandshakeState(True, key(KEYS["is"]), ephemeral_key=key(KEYS["ie"]), cipher=AESGCM_256)
    c = XXHandshakeState(True, key(KEYS["is"]), ephemeral_key=key(KEYS["ie"]))
    a.write_message(b"")
    c.write_message(b"")
    assert a.handshake_hash != c.handshake_hash


def test_nonce_layouts_per_spec():
    # Noise spec section 12: ChaChaPoly 4 zero bytes + LE64 counter, AESGCM 4 zero bytes + BE64
    n = 0x0102030405060708
    assert AESGCM_256.nonce_bytes(n) == bytes(4) + bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert CHACHAPOLY.nonce_bytes(n) == bytes(4) + bytes([8, 7, 6, 5, 4, 3, 2, 1])


@pytest.mark.parametrize(
    ("cipher", "aead", "order"), [(AESGCM_256, AESGCM, ">"), (CHACHAPOLY, ChaCha20Poly1305, "<")]
)
async def test_transport_frames_match_the_aead_with_spec_nonces(cipher, aead, order):
    """SecureSession frames equal what ``cryptography`` gives for the spec's nonce bytes."""
    key = bytes(range(32))
    start = 2**32 + 0x0102  # a counter whose byte order shows (and past 32 bits)
    a, b = trio.testing.memory_stream_pair()
    me, other = Identity.generate().peer_id, Identity.generate().peer_id
    send = CipherState(key, cipher)
    send.n = start
    sa = SecureSession(
        a, local_peer=me, remote_peer=other, send_cipher=send, receive_cipher=CipherState()
    )
    receive = CipherState(key, cipher)
    receive.n = start
    sb = SecureSession(
        b, local_peer=other, remote_peer=me, send_cipher=CipherState(), receive_cipher=receive
    )
    first, second = b"first frame", os.urandom(70_000)  # the second spans two frames
    await sa.send_all(first)
    await sa.send_all(second)
    wire = b""
    while len(wire) < 2 + len(first) + 16 + 4 + len(second) + 32:
        wire += await b.receive_some()
    reference = aead(key)
    expected = bytearray()
    pieces = [first, second[:65519], second[65519:]]
    for i, plain in enumerate(pieces):
        nonce = bytes(4) + struct.pack(order + "Q", start + i)
        sealed = reference.encrypt(nonce, plain, None)
        expected += struct.pack(">H", len(sealed)) + sealed
    assert wire == bytes(expected)
    # and the receiving side decrypts what the reference AEAD sealed
    await a.send_all(bytes(expected))
    got = b""
    while len(got) < len(first) + len(second):
        got += await sb.receive_some()
    assert got == first + second


async def _session_pair(cipher_a, cipher_b):
    a, b = trio.testing.memory_stream_pair()
    out = {}

    async def side(name, stream, initiator, cipher):
        try:
            out[name] = await noise_handshake(
                stream, Identity.generate(), initiator=initiator, cipher=cipher, timeout=5
            )
        except HandshakeError as e:
            out[name] = e
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "a", a, True, cipher_a)
        nursery.start_soon(side, "b", b, False, cipher_b)
    return out["a"], out["b"]


async def test_cipher_mismatch_fails_the_handshake():
    # one side in AESGCM, the other in ChaChaPoly: message 2's encrypted static key fails
    sa, sb = await _session_pair(AESGCM_256, CHACHAPOLY)
    assert isinstance(sa, HandshakeError) and "authentication" in str(sa)
    assert isinstance(sb, HandshakeError)


@pytest.mark.parametrize("cipher", [AESGCM_256, CHACHAPOLY], ids=lambda c: c.name)
async def test_tampered_ciphertext_rejected_under_both_ciphers(cipher):
    sa, sb = await _session_pair(cipher, cipher)
    assert sa.cipher is cipher and sb.cipher is cipher
    await sa.send_all(b"before")
    assert await sb.receive_some() == b"before"
    frame = sa._encrypt_batch(memoryview(b"secret message"))
    frame[10] ^= 0x01
    await sa.raw.send_all(frame)
    with pytest.raises(ProtocolViolationError, match="failed authentication"):
        await sb.receive_some()
    with pytest.raises(ProtocolViolationError):  # permanent
        await sb.receive_some()


async def test_aesgcm_copying_fallback_matches_the_fast_path(monkeypatch):
    """cryptography < 45 (no encrypt_into/decrypt_into): same wire format under AES-GCM."""
    import dht.p2p.noise as noise_mod

    sa, sb = await _session_pair(AESGCM_256, AESGCM_256)
    payload = os.urandom(2 * 65519 + 5)
    await sa.send_all(payload)  # fast path
    monkeypatch.setattr(noise_mod, "_HAS_INTO", False)
    await sa.send_all(payload)  # fallback path
    got = b""
    while len(got) < 2 * len(payload):
        got += await sb.receive_some()
    assert got == payload * 2


# --- Hosts ----------------------------------------------------------------------------------


def _ciphers(a: Host, b: Host) -> tuple[str, str]:
    """The cipher each side's connection to the other runs (its SecureSession)."""
    (conn_a,) = a._conns[b.peer_id]
    (conn_b,) = b._conns[a.peer_id]
    return conn_a.session.conn.cipher.name, conn_b.session.conn.cipher.name


async def _bulk(a: Host, b: Host, size: int) -> None:
    """Send ``size`` random bytes a -> b on a stream; b answers the SHA-256 of what it got."""

    async def sink(stream):
        digest = hashlib.sha256()
        while data := await stream.receive_some():
            digest.update(data)
        await stream.send_all(digest.digest())
        await stream.aclose()

    b.set_stream_handler("/test/sink/1.0.0", sink)
    stream = await a.new_stream(b.peer_id, "/test/sink/1.0.0")
    payload = os.urandom(size)
    await stream.send_all(payload)
    await stream.send_eof()
    answer = b""
    while len(answer) < 32:
        data = await stream.receive_some()
        assert data
        answer += data
    assert answer == hashlib.sha256(payload).digest()


async def test_hosts_negotiate_aesgcm_over_tcp_and_move_bulk_data():
    async with Host.open() as a, Host.open() as b:
        assert a.security_protocols == DEFAULT_SECURITY_PROTOCOLS
        addrs = await b.listen(LOCAL)
        await a.connect(addrs)
        assert _ciphers(a, b) == ("AESGCM", "AESGCM")
        with trio.fail_after(60):
            await _bulk(a, b, 24 * 1024 * 1024 + 12345)
        assert await a.ping(b.peer_id) >= 0


async def test_hosts_negotiate_aesgcm_over_memory_network(autojump_clock):
    net = MemoryNetwork(latency=0.01, bandwidth=50e6)
    async with (
        Host.open(transport=net.transport()) as a,
        Host.open(transport=net.transport()) as b,
    ):
        addrs = await b.listen(["/memory/0"])
        await a.connect(addrs)
        assert _ciphers(a, b) == ("AESGCM", "AESGCM")
        await _bulk(a, b, 4 * 1024 * 1024)


@pytest.mark.parametrize(
    ("dialer", "listener"),
    [(DEFAULT_SECURITY_PROTOCOLS, NOISE_ONLY), (NOISE_ONLY, DEFAULT_SECURITY_PROTOCOLS)],
    ids=["listener-noise-only", "dialer-noise-only"],
)
async def test_chachapoly_when_one_side_only_offers_noise(dialer, listener):
    async with (
        Host.open(security_protocols=dialer) as a,
        Host.open(security_protocols=listener) as b,
    ):
        addrs = await b.listen(LOCAL)
        await a.connect(addrs)
        assert _ciphers(a, b) == ("ChaChaPoly", "ChaChaPoly")
        with trio.fail_after(60):
            await _bulk(a, b, 2 * 1024 * 1024)


async def _connect_time(net: MemoryNetwork, dialer, listener) -> float:
    async with (
        Host.open(transport=net.transport(), security_protocols=dialer) as a,
        Host.open(transport=net.transport(), security_protocols=listener) as b,
    ):
        addrs = await b.listen(["/memory/0"])
        start = trio.current_time()
        await a.connect(addrs)
        return trio.current_time() - start


async def test_aesgcm_first_costs_no_round_trip_between_moshpit_peers(autojump_clock):
    """Connection setup in simulated time: AES-GCM-first against a moshpit listener takes as
    long as /noise alone; only a listener that refuses it (libp2p) costs one more round trip."""
    latency = 0.05
    net = MemoryNetwork(latency=latency)
    default = DEFAULT_SECURITY_PROTOCOLS
    both_aes = await _connect_time(net, default, default)
    both_noise = await _connect_time(net, NOISE_ONLY, NOISE_ONLY)
    fallback = await _connect_time(net, default, NOISE_ONLY)
    assert both_aes == pytest.approx(both_noise, abs=1e-9)
    assert fallback == pytest.approx(both_noise + 2 * latency, abs=1e-9)


async def test_listener_accepts_both_protocol_ids():
    """A bare dialer may pick either id from a default Host (it lists both with ``ls``)."""
    from dht.p2p.multistream import list_protocols

    async with Host.open() as host:
        (addr,) = await host.listen(LOCAL)
        tcp_host, port = addr.tcp_endpoint()
        raw = await trio.open_tcp_stream(tcp_host, port)
        async with raw:
            assert sorted(await list_protocols(raw)) == sorted([AESGCM_PROTOCOL_ID, PROTOCOL_ID])
        for protocol, cipher in [(AESGCM_PROTOCOL_ID, AESGCM_256), (PROTOCOL_ID, CHACHAPOLY)]:
            raw = await trio.open_tcp_stream(tcp_host, port)
            async with raw:
                chosen, stream = await negotiate_outbound(raw, [protocol])
                assert chosen == protocol
                # the cipher must match the id: the handshake would fail otherwise
                session = await noise_handshake(
                    stream,
                    Identity.generate(),
                    initiator=True,
                    expected_peer=host.peer_id,
                    cipher=cipher,
                    timeout=10,
                )
                assert session.cipher is cipher


async def test_noise_only_listener_refuses_the_aesgcm_id():
    async with Host.open(security_protocols=NOISE_ONLY) as host:
        (addr,) = await host.listen(LOCAL)
        raw = await trio.open_tcp_stream(*addr.tcp_endpoint())
        async with raw:
            # "na" to the first proposal, then the echo of the second
            chosen, _ = await negotiate_outbound(raw, [AESGCM_PROTOCOL_ID, PROTOCOL_ID])
            assert chosen == PROTOCOL_ID


@pytest.mark.parametrize(
    "bad", [(), ("/tls/1.0.0",), (PROTOCOL_ID, PROTOCOL_ID)], ids=["empty", "unknown", "repeat"]
)
async def test_bad_security_protocol_lists_are_refused(bad):
    with pytest.raises(ValueError, match="security_protocols"):
        async with Host.open(security_protocols=bad):
            pass


# --- py-libp2p only ever sees /noise ----------------------------------------------------------


@pytest.mark.interop
async def test_default_host_falls_back_to_noise_against_libp2p():
    from .test_interop_libp2p import libp2p_listener

    async with libp2p_listener() as maddr, Host.open() as host:
        pid = await host.connect([maddr], peer_id=maddr.peer_id, timeout=20)
        (conn,) = host._conns[pid]
        assert conn.session.conn.cipher is CHACHAPOLY
        assert await host.ping(pid, timeout=10) >= 0


@pytest.mark.interop
async def test_libp2p_dialer_gets_chachapoly_from_a_default_host(caplog):
    from .test_interop_libp2p import _env, _peer_command

    caplog.set_level(logging.DEBUG, logger="dht.p2p.noise")
    async with Host.open() as host:
        (addr,) = await host.listen(LOCAL)
        proc = await trio.run_process(
            _peer_command("ping", str(addr), "--count", "1"),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_env(),
        )
        assert proc.returncode == 0, proc.stderr.decode()
    messages = [r.getMessage() for r in caplog.records]
    inbound = [m for m in messages if m.startswith("noise handshake done (inbound")]
    assert inbound and all("ChaChaPoly" in m for m in inbound), inbound
