"""Fuzz targets of ``dht.p2p``: varints, protobuf, multistream-select, Noise (payload,
handshake messages, transport frames), yamux frames, identify, public keys, PeerIDs,
multiaddrs and the framed msgpack messages every protocol above rides on.

Keys are fixed (``Identity.from_seed``, fixed X25519 keys), so the seeds in the corpus are
byte-for-byte reproducible and a mutated Noise message still meets the same keys.
"""

from __future__ import annotations

import base64
import pickle
import struct

import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import strategies as st

from dht.p2p._crypto_noise import AESGCM_256, CHACHAPOLY, TAGLEN, CipherState, XXHandshakeState
from dht.p2p._proto import (
    WIRE_LEN,
    WIRE_VARINT,
    ProtobufDecodeError,
    encode_bytes_field,
    encode_varint_field,
    iter_fields,
)
from dht.p2p.errors import (
    HandshakeError,
    IdentityError,
    MessageTooLargeError,
    MultiaddrError,
    ProtocolNegotiationError,
    ProtocolViolationError,
    StreamClosedError,
    StreamResetError,
)
from dht.p2p.identify import (
    MAX_LISTEN_ADDRS,
    MAX_PROTOCOLS,
    IdentifyInfo,
    decode_identify,
    encode_identify,
)
from dht.p2p.identity import (
    Identity,
    PeerID,
    decode_public_key,
    decode_public_key_proto,
    encode_public_key,
    verify_ed25519,
)
from dht.p2p.messages import MessageReader, pack_message, unpack_body
from dht.p2p.multiaddr import Multiaddr, parse_multiaddr_list
from dht.p2p.multistream import (
    MULTISTREAM_PROTOCOL,
    LazyOutboundStream,
    encode_message,
    list_protocols,
    negotiate_inbound,
    negotiate_outbound,
)
from dht.p2p.noise import (
    SIGNATURE_PREFIX,
    SecureSession,
    _make_payload,
    _verify_payload,
    decode_handshake_payload,
    encode_handshake_payload,
    noise_handshake,
)
from dht.p2p.varint import MAX_VARINT_BYTES, decode_uvarint, encode_uvarint
from dht.p2p.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    HEADER,
    INITIAL_WINDOW,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YamuxSession,
    pack_header,
)

from ._harness import (
    MSGPACK_VALUES,
    ScriptedStream,
    Target,
    control,
    register,
    run_trio,
    same,
    split_control,
)

ALICE = Identity.from_seed(b"\x01" * 32)
BOB = Identity.from_seed(b"\x02" * 32)
PEERS = [ALICE.peer_id, BOB.peer_id, PeerID(b"\x12\x20" + bytes(range(32)))]  # last: sha2-256


def _x25519(byte: int) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(bytes([byte]) * 32)


def _x25519_public(key: X25519PrivateKey) -> bytes:
    from dht.p2p._crypto_noise import x25519_public_bytes

    return x25519_public_bytes(key)


def _cid(peer: PeerID) -> str:
    raw = encode_uvarint(1) + encode_uvarint(0x72) + peer.to_bytes()
    return "b" + base64.b32encode(raw).decode().lower().rstrip("=")


def _text(data: bytes) -> str:
    """Text inputs travel as UTF-8 with surrogateescape, so lone surrogates (what Python makes
    of undecodable bytes in argv and environment variables) are reachable too."""
    return data.decode("utf-8", "surrogateescape")


def _raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


# ---------------------------------------------------------------------------------------------
# varint and protobuf


def check_varint(data: bytes) -> None:
    for offset in (0, 1):
        try:
            value, end = decode_uvarint(data, offset)
        except ValueError:
            continue
        assert offset < end <= offset + MAX_VARINT_BYTES
        assert 0 <= value < 1 << 63
        assert encode_uvarint(value) == data[offset:end]  # only minimal encodings decode
        assert decode_uvarint(memoryview(bytearray(data)), offset) == (value, end)


register(
    Target(
        "varint",
        "p2p",
        check_varint,
        seeds=lambda: {f"v{v}": encode_uvarint(v) for v in (0, 1, 127, 128, 300, 2**32, 2**63 - 1)},
        valid=lambda: st.builds(
            lambda v, tail: encode_uvarint(v) + tail,
            st.integers(0, 2**63 - 1),
            st.binary(max_size=3),
        ),
        max_size=12,
    )
)


def check_protobuf(data: bytes) -> None:
    try:
        fields = list(iter_fields(data))
    except ProtobufDecodeError:
        return
    again = bytearray()  # re-encoding what was decoded gives the input back: no data skipped
    for number, wire, value in fields:
        assert number > 0
        if wire == WIRE_VARINT:
            again += encode_varint_field(number, value)  # type: ignore[arg-type]
        elif wire == WIRE_LEN:
            again += encode_bytes_field(number, value)  # type: ignore[arg-type]
        else:
            assert isinstance(value, bytes) and len(value) == (8 if wire == 1 else 4)
            again += encode_uvarint(number << 3 | wire) + value
    assert bytes(again) == data


def _protobuf_seeds() -> dict[str, bytes]:
    return {
        "public-key": ALICE.public_key_proto,
        "noise-payload": _make_payload(ALICE, _x25519_public(_x25519(5))),
        "fixed-width": encode_uvarint(1 << 3 | 1)
        + bytes(8)
        + encode_uvarint(2 << 3 | 5)
        + bytes(4),
    }


register(
    Target(
        "protobuf",
        "p2p",
        check_protobuf,
        seeds=_protobuf_seeds,
        valid=lambda: st.lists(
            st.one_of(
                st.builds(encode_varint_field, st.integers(1, 2**20), st.integers(0, 2**63 - 1)),
                st.builds(encode_bytes_field, st.integers(1, 2**20), st.binary(max_size=40)),
            ),
            max_size=5,
        ).map(b"".join),
    )
)


# ---------------------------------------------------------------------------------------------
# multistream-select

SUPPORTED = ("/moshpit/dht/1.0.0", "/yamux/1.0.0")


def _messages(buf: bytes) -> list[bytes]:
    """Parse what we sent: it must be a sequence of well-formed multistream messages."""
    out, pos = [], 0
    while pos < len(buf):
        length, pos = decode_uvarint(buf, pos)
        body = buf[pos : pos + length]
        assert len(body) == length and body.endswith(b"\n"), buf
        out.append(body)
        pos += length
    return out


async def _read_rest(stream: trio.abc.ReceiveStream) -> bytes:
    rest = bytearray()
    while chunk := await stream.receive_some(4096):
        rest += chunk
    return bytes(rest)


async def _listener(data: bytes) -> None:
    mode, chunk, payload = split_control(data)
    remote = ScriptedStream(payload, chunk)
    supported = SUPPORTED if mode % 2 == 0 else (lambda p: p in SUPPORTED)
    try:
        protocol, stream = await negotiate_inbound(remote, supported, timeout=None)
    except ProtocolNegotiationError:
        return
    assert protocol in SUPPORTED
    # the bytes after the negotiation reach the protocol untouched
    assert payload.endswith(await _read_rest(stream))
    sent = _messages(bytes(remote.sent))
    assert sent[0] == MULTISTREAM_PROTOCOL.encode() + b"\n"
    assert sent[-1] == protocol.encode() + b"\n"


def check_multistream_listener(data: bytes) -> None:
    run_trio(_listener, data)


def _multistream(items: list[str], tail: bytes) -> bytes:
    """A multistream header, then ``items`` as messages, then raw ``tail`` bytes."""
    return encode_message(MULTISTREAM_PROTOCOL) + b"".join(map(encode_message, items)) + tail


register(
    Target(
        "multistream_listener",
        "p2p",
        check_multistream_listener,
        seeds=lambda: {
            "accept": control(0) + _multistream(["/moshpit/dht/1.0.0"], b"payload"),
            "na-then-accept": control(1, 2) + _multistream(["/other/1", "/yamux/1.0.0"], b""),
            "ls": control(0, 0) + _multistream(["ls", "/yamux/1.0.0"], b"\x00\x01"),
            "empty-proposal": control(0) + _multistream([""], b""),
        },
        valid=lambda: st.builds(
            lambda c, items, tail: control(c >> 3, c & 7) + _multistream(items, tail),
            st.integers(0, 15),
            st.lists(st.sampled_from(SUPPORTED + ("ls", "/x", "na", "")), max_size=4),
            st.binary(max_size=8),
        ),
    )
)


async def _dialer(data: bytes) -> None:
    mode, chunk, payload = split_control(data)
    remote = ScriptedStream(payload, chunk)
    try:
        if mode % 2 == 0:
            protocol, stream = await negotiate_outbound(remote, list(SUPPORTED), timeout=None)
            assert protocol in SUPPORTED
        else:
            stream = LazyOutboundStream(remote, SUPPORTED[0], timeout=None)
            await stream.send_all(b"request")
            await stream.ensure_negotiated()
            assert stream.negotiated
    except ProtocolNegotiationError:
        return
    assert payload.endswith(await _read_rest(stream))
    assert _messages(bytes(remote.sent).removesuffix(b"request"))[0] == (
        MULTISTREAM_PROTOCOL.encode() + b"\n"
    )


def check_multistream_dialer(data: bytes) -> None:
    run_trio(_dialer, data)


register(
    Target(
        "multistream_dialer",
        "p2p",
        check_multistream_dialer,
        seeds=lambda: {
            "echo": control(0) + _multistream([SUPPORTED[0]], b"response"),
            "na-then-echo": control(0, 3) + _multistream(["na", SUPPORTED[1]], b""),
            "lazy-echo": control(1) + _multistream([SUPPORTED[0]], b"\x05hello"),
            "refused": control(0) + _multistream(["na", "na"], b""),
        },
        valid=lambda: st.builds(
            lambda c, items, tail: control(c >> 3, c & 7) + _multistream(items, tail),
            st.integers(0, 15),
            st.lists(st.sampled_from(SUPPORTED + ("na", "/x", "")), max_size=3),
            st.binary(max_size=8),
        ),
    )
)


def _ls_answer(protocols: list[str], final_newline: bool = True) -> bytes:
    body = b"".join(map(encode_message, protocols)) + (b"\n" if final_newline else b"")
    return encode_message(MULTISTREAM_PROTOCOL) + encode_uvarint(len(body)) + body


async def _ls(data: bytes) -> None:
    _, chunk, payload = split_control(data)
    remote = ScriptedStream(payload, chunk)
    try:
        protocols = await list_protocols(remote, timeout=None)
    except ProtocolNegotiationError:
        return
    # the entries come from the ls answer alone: re-encoded, they are its body
    header = encode_message(MULTISTREAM_PROTOCOL)
    length, start = decode_uvarint(payload, len(header))
    body = payload[start : start + length]
    entries = b"".join(encode_message(p) for p in protocols)
    assert body in (entries, entries + b"\n"), (body, protocols)


def check_multistream_ls(data: bytes) -> None:
    run_trio(_ls, data)


register(
    Target(
        "multistream_ls",
        "p2p",
        check_multistream_ls,
        seeds=lambda: {
            "two": control(0) + _ls_answer(list(SUPPORTED)),
            "none": control(0, 1) + _ls_answer([]),
            "no-final-newline": control(0) + _ls_answer(["/a"], final_newline=False),
        },
        valid=lambda: st.one_of(
            st.builds(
                lambda c, items, nl, tail: control(0, c) + _ls_answer(items, nl) + tail,
                st.integers(0, 7),
                st.lists(st.sampled_from(SUPPORTED + ("/x", "ls")), max_size=3),
                st.booleans(),
                st.binary(max_size=6),
            ),
            # entries whose lengths disagree with the text that follows them
            st.builds(
                lambda c, entries, tail: control(0, c) + _ls_raw(entries) + tail,
                st.integers(0, 7),
                st.lists(
                    st.tuples(st.integers(0, 12), st.sampled_from(["/a\n", "/bc", "\n"])),
                    max_size=3,
                ),
                st.sampled_from([b"", b"/x\n", b"/yz\n\x03/q\n"]),
            ),
        ),
    )
)


def _ls_raw(entries: list[tuple[int, str]]) -> bytes:
    body = b"".join(encode_uvarint(n) + text.encode() for n, text in entries)
    return encode_message(MULTISTREAM_PROTOCOL) + encode_uvarint(len(body)) + body


# ---------------------------------------------------------------------------------------------
# Noise: handshake payload, handshake messages, transport frames

I_STATIC, I_EPHEMERAL, R_STATIC, R_EPHEMERAL = (_x25519(b) for b in (3, 4, 5, 6))
CIPHERS = (CHACHAPOLY, AESGCM_256)


def _check_proof(payload: bytes, remote_static: bytes) -> None:
    """A payload accepted by _verify_payload really proves the key it names."""
    peer = _verify_payload(payload, remote_static)
    key, signature = decode_handshake_payload(payload)
    raw = decode_public_key(key)
    assert peer == PeerID.from_public_key(raw)
    assert verify_ed25519(raw, SIGNATURE_PREFIX + remote_static, signature)


def check_noise_payload(data: bytes) -> None:
    try:
        key, signature = decode_handshake_payload(data)
    except HandshakeError:
        return
    assert key and signature
    assert decode_handshake_payload(encode_handshake_payload(key, signature)) == (key, signature)
    try:
        _check_proof(data, _x25519_public(R_STATIC))
    except HandshakeError:
        pass


register(
    Target(
        "noise_payload",
        "p2p",
        check_noise_payload,
        seeds=lambda: {
            "alice": _make_payload(ALICE, _x25519_public(R_STATIC)),
            "wrong-static": _make_payload(BOB, _x25519_public(I_STATIC)),
        },
        valid=lambda: st.builds(
            encode_handshake_payload,
            st.one_of(
                st.sampled_from([ALICE.public_key_proto, BOB.public_key_proto]),
                st.binary(min_size=1, max_size=40),
            ),
            st.binary(min_size=1, max_size=70),
        ),
    )
)


def _handshake_states(cipher_index: int) -> tuple[XXHandshakeState, XXHandshakeState]:
    cipher = CIPHERS[cipher_index % 2]
    initiator = XXHandshakeState(True, I_STATIC, ephemeral_key=I_EPHEMERAL, cipher=cipher)
    responder = XXHandshakeState(False, R_STATIC, ephemeral_key=R_EPHEMERAL, cipher=cipher)
    return initiator, responder


def check_noise_handshake(data: bytes) -> None:
    """First byte: (cipher << 1 | role) << 3. role 0: the responder reads a fuzzed message 1;
    1: the initiator reads a fuzzed message 2; 2: the responder reads a fuzzed message 3."""
    mode, _, message = split_control(data)
    role, cipher_index = mode % 3, (mode // 3) % 2
    initiator, responder = _handshake_states(cipher_index)
    try:
        if role == 0:
            responder.read_message(message)
            responder.write_message(_make_payload(BOB, _x25519_public(R_STATIC)))
            return
        first = initiator.write_message(b"")
        if role == 1:
            payload = initiator.read_message(message)
            _check_proof(payload, initiator.remote_static)  # type: ignore[arg-type]
            initiator.write_message(_make_payload(ALICE, _x25519_public(I_STATIC)))
            initiator.split()
        else:
            responder.read_message(first)
            initiator.read_message(responder.write_message(b"r"))
            payload = responder.read_message(message)
            _check_proof(payload, responder.remote_static)  # type: ignore[arg-type]
            responder.split()
    except HandshakeError:
        return


def _transcript(cipher_index: int, payload2: bytes, payload3: bytes) -> tuple[bytes, bytes, bytes]:
    initiator, responder = _handshake_states(cipher_index)
    first = initiator.write_message(b"")
    responder.read_message(first)
    second = responder.write_message(payload2)
    initiator.read_message(second)
    return first, second, initiator.write_message(payload3)


def _handshake_message(role: int, cipher_index: int, payload: bytes) -> bytes:
    """A well-encrypted message for ``role`` (1: message 2, 2: message 3) carrying ``payload``."""
    first, second, third = _transcript(cipher_index, payload if role == 1 else b"r", payload)
    message = (first, second, third)[role]
    return control(role + 3 * cipher_index) + message


def _noise_handshake_seeds() -> dict[str, bytes]:
    bob = _make_payload(BOB, _x25519_public(R_STATIC))
    alice = _make_payload(ALICE, _x25519_public(I_STATIC))
    seeds = {}
    for c, name in enumerate(("chachapoly", "aesgcm")):
        seeds[f"{name}-msg1"] = _handshake_message(0, c, b"")
        seeds[f"{name}-msg2"] = _handshake_message(1, c, bob)
        seeds[f"{name}-msg3"] = _handshake_message(2, c, alice)
    return seeds


register(
    Target(
        "noise_handshake",
        "p2p",
        check_noise_handshake,
        seeds=_noise_handshake_seeds,
        valid=lambda: st.builds(
            _handshake_message,
            st.sampled_from([1, 2]),
            st.integers(0, 1),
            st.one_of(
                st.sampled_from(
                    [
                        _make_payload(BOB, _x25519_public(R_STATIC)),
                        _make_payload(ALICE, _x25519_public(I_STATIC)),
                    ]
                ),
                st.binary(max_size=120),
            ),
        ),
    )
)


async def _handshake_stream(data: bytes) -> None:
    mode, chunk, payload = split_control(data)
    remote = ScriptedStream(payload, chunk)
    try:
        await noise_handshake(
            remote, ALICE, initiator=bool(mode & 1), timeout=None, cipher=CIPHERS[(mode >> 1) % 2]
        )
    except HandshakeError:
        return
    # our keys are fresh per connection: bytes scripted in advance can never complete it
    raise AssertionError("a Noise handshake succeeded against a scripted remote")


def check_noise_handshake_stream(data: bytes) -> None:
    run_trio(_handshake_stream, data)


def _frames(messages: list[bytes]) -> bytes:
    return b"".join(struct.pack(">H", len(m)) + m for m in messages)


register(
    Target(
        "noise_handshake_stream",
        "p2p",
        check_noise_handshake_stream,
        seeds=lambda: {
            "responder-msg1": control(0) + _frames([_transcript(0, b"", b"")[0]]),
            "initiator-msg2": control(1, 4) + _frames([_transcript(0, b"x", b"")[1]]),
            "aesgcm-msg1": control(2, 1) + _frames([_transcript(1, b"", b"")[0], b"\x00" * 48]),
        },
        valid=lambda: st.builds(
            lambda c, msgs: control(c >> 3, c & 7) + _frames(msgs),
            st.integers(0, 31),
            st.lists(st.binary(max_size=100), max_size=3),
        ),
    )
)

TRANSPORT_KEY = bytes(range(32))


def _reference_plaintext(raw: bytes, cipher_index: int) -> tuple[bytes, type | None]:
    """What a correct receiver makes of ``raw``: the plaintext of the frames before the first
    bad one, and how the stream ends (None: cleanly; the error type otherwise)."""
    state = CipherState(TRANSPORT_KEY, CIPHERS[cipher_index])
    out = bytearray()
    pos = 0
    while len(raw) - pos >= 2:
        (length,) = struct.unpack_from(">H", raw, pos)
        if length < TAGLEN:
            return bytes(out), ProtocolViolationError
        if len(raw) - pos - 2 < length:
            return bytes(out), StreamResetError
        try:
            out += state.decrypt_with_ad(None, raw[pos + 2 : pos + 2 + length])
        except HandshakeError:
            return bytes(out), ProtocolViolationError
        pos += 2 + length
    return bytes(out), (StreamResetError if pos < len(raw) else None)


async def _transport(data: bytes) -> None:
    mode, chunk, raw = split_control(data)
    cipher_index, initial_part, borrow = mode & 1, bool(mode & 2), bool(mode & 4)
    initial, rest = (raw[:chunk], raw[chunk:]) if initial_part else (b"", raw)
    session = SecureSession(
        ScriptedStream(rest, chunk),
        local_peer=ALICE.peer_id,
        remote_peer=BOB.peer_id,
        send_cipher=CipherState(bytes(32), CIPHERS[cipher_index]),
        receive_cipher=CipherState(TRANSPORT_KEY, CIPHERS[cipher_index]),
        initial=initial,
        cipher=CIPHERS[cipher_index],
    )
    got = bytearray()
    ending: type | None = None
    try:
        while True:
            part = await (session.receive_view() if borrow else session.receive_some(chunk))
            if not part:
                break
            got += part
    except (ProtocolViolationError, StreamResetError) as e:
        ending = type(e)
        try:  # the failure is permanent
            await session.receive_some()
        except ending:
            pass
        else:
            raise AssertionError("a failed Noise session delivered data again") from None
    expected, expected_ending = _reference_plaintext(raw, cipher_index)
    assert ending is expected_ending, (ending, expected_ending)
    if ending is ProtocolViolationError:
        assert expected.startswith(got)  # frames of the failing read may be dropped
    else:
        assert bytes(got) == expected


def check_noise_transport(data: bytes) -> None:
    run_trio(_transport, data)


def _sealed(cipher_index: int, plaintexts: list[bytes]) -> bytes:
    state = CipherState(TRANSPORT_KEY, CIPHERS[cipher_index])
    return _frames([state.encrypt_with_ad(None, p) for p in plaintexts])


register(
    Target(
        "noise_transport",
        "p2p",
        check_noise_transport,
        seeds=lambda: {
            "one-frame": control(0) + _sealed(0, [b"hello"]),
            "frames-small-reads": control(0, 2) + _sealed(0, [b"a", b"", b"bc" * 40]),
            "aesgcm-initial": control(3, 5) + _sealed(1, [b"x" * 20, b"y"]),
            "borrowed": control(4, 6) + _sealed(0, [bytes(300)]),
        },
        valid=lambda: st.builds(
            lambda c, cipher, plains: (
                control((c >> 3) & ~1 | cipher, c & 7) + _sealed(cipher, plains)
            ),
            st.integers(0, 63),
            st.integers(0, 1),
            st.lists(st.binary(max_size=40), max_size=4),
        ),
    )
)


# ---------------------------------------------------------------------------------------------
# yamux

MAX_TEST_STREAMS = 4


def _yamux_reference(payload: bytes) -> dict[int, bytes] | None:
    """Per-stream bytes a correct session delivers for a *simple* input (streams opened by the
    remote with SYN, data within the window, nothing after FIN); None for anything else."""
    streams: dict[int, bytearray] = {}
    finished: set[int] = set()
    pos = 0
    while pos < len(payload):
        if len(payload) - pos < HEADER.size:
            return None
        version, ftype, flags, sid, length = HEADER.unpack_from(payload, pos)
        pos += HEADER.size
        if (
            version
            or ftype not in (TYPE_DATA, TYPE_WINDOW_UPDATE)
            or flags & ~(FLAG_SYN | FLAG_FIN)
        ):
            return None
        if sid % 2 == 0 or sid in finished:
            return None
        if flags & FLAG_SYN:
            if sid in streams or len(streams) >= MAX_TEST_STREAMS:
                return None
            streams[sid] = bytearray()
        elif sid not in streams:
            return None
        if ftype == TYPE_DATA:
            if len(payload) - pos < length or len(streams[sid]) + length > INITIAL_WINDOW:
                return None
            streams[sid] += payload[pos : pos + length]
            pos += length
        if flags & FLAG_FIN:
            finished.add(sid)
    return {sid: bytes(buf) for sid, buf in streams.items()}


async def _yamux(data: bytes) -> None:
    _, chunk, payload = split_control(data)
    conn = ScriptedStream(payload, chunk, hold_open=True)
    session = YamuxSession(
        conn, is_client=False, max_streams=8, accept_backlog=MAX_TEST_STREAMS, name="fuzz"
    )
    received: dict[int, bytearray] = {}

    async def read(stream) -> None:
        buf = received.setdefault(stream.stream_id, bytearray())
        try:
            while part := await stream.receive_some():
                buf += part
        except StreamClosedError:  # reset (StreamResetError is one) or closed
            pass

    async def accept(nursery: trio.Nursery) -> None:
        try:
            while True:
                nursery.start_soon(read, await session.accept_stream())
        except StreamClosedError:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        nursery.start_soon(accept, nursery)
        await trio.testing.wait_all_tasks_blocked()
        expected = _yamux_reference(payload)
        if expected is not None:
            assert not session.closed, session.close_reason
            assert {sid: bytes(buf) for sid, buf in received.items()} == expected
        nursery.cancel_scope.cancel()
    # an exception inside the session's reader shows as a "transport error"; the remote can
    # only ever cause a protocol violation
    reason = session.close_reason
    assert reason in ("", "session ended") or reason.startswith("protocol violation"), reason


def check_yamux(data: bytes) -> None:
    run_trio(_yamux, data)


def _yamux_frames(frames: list[tuple[int, int, int, int, bytes]]) -> bytes:
    return b"".join(
        pack_header(t, f, s, len(d) if t == TYPE_DATA else n) + d for t, f, s, n, d in frames
    )


@st.composite
def _yamux_sessions(draw: st.DrawFn) -> bytes:
    """A well-formed remote: streams opened with SYN, data frames, FIN, pings, updates."""
    frames: list[tuple[int, int, int, int, bytes]] = []
    opened: set[int] = set()
    closed: set[int] = set()
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            frames.append((TYPE_PING, FLAG_SYN, 0, draw(st.integers(0, 2**32 - 1)), b""))
            continue
        sid = draw(st.sampled_from([1, 3, 5, 7]))
        if sid in closed:
            continue
        flags = 0 if sid in opened else FLAG_SYN
        opened.add(sid)
        if draw(st.booleans()):
            flags |= FLAG_FIN
            closed.add(sid)
        if kind == 1:
            frames.append((TYPE_WINDOW_UPDATE, flags, sid, draw(st.integers(0, 2**20)), b""))
        else:
            frames.append((TYPE_DATA, flags, sid, 0, draw(st.binary(max_size=48))))
    return control(0, draw(st.integers(0, 7))) + _yamux_frames(frames)


register(
    Target(
        "yamux",
        "p2p",
        check_yamux,
        seeds=lambda: {
            "stream": control(0)
            + _yamux_frames(
                [
                    (TYPE_DATA, FLAG_SYN, 1, 0, b"hello"),
                    (TYPE_DATA, FLAG_FIN, 1, 0, b" world"),
                ]
            ),
            "two-streams-small-reads": control(0, 3)
            + _yamux_frames(
                [
                    (TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0, b""),
                    (TYPE_DATA, FLAG_SYN, 3, 0, b"b" * 30),
                    (TYPE_DATA, 0, 1, 0, b"a"),
                    (TYPE_DATA, FLAG_FIN, 3, 0, b""),
                ]
            ),
            "ping-goaway": control(0)
            + _yamux_frames(
                [
                    (TYPE_PING, FLAG_SYN, 0, 7, b""),
                    (TYPE_PING, FLAG_ACK, 0, 9, b""),
                    (TYPE_GO_AWAY, 0, 0, 0, b""),
                ]
            ),
            "reset": control(0)
            + _yamux_frames(
                [
                    (TYPE_DATA, FLAG_SYN, 1, 0, b"x"),
                    (TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0, b""),
                ]
            ),
        },
        valid=_yamux_sessions,
    )
)


# ---------------------------------------------------------------------------------------------
# identify, public keys, PeerIDs, multiaddrs

_DNS_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x2FFF, exclude_characters="/\x7f")
_COMPONENTS = st.one_of(
    st.ip_addresses(v=4).map(lambda a: f"/ip4/{a}"),
    st.ip_addresses(v=6).map(lambda a: f"/ip6/{a}"),
    st.integers(0, 65535).map(lambda p: f"/tcp/{p}"),
    st.integers(0, 2**64 - 1).map(lambda m: f"/memory/{m}"),
    st.builds(
        lambda p, n: f"/{p}/{n}",
        st.sampled_from(["dns", "dns4", "dns6"]),
        st.text(_DNS_CHARS, min_size=1, max_size=16),
    ),
    st.sampled_from(PEERS).map(lambda p: f"/p2p/{p}"),
)
MULTIADDRS = st.lists(_COMPONENTS, min_size=1, max_size=4).map(
    lambda parts: Multiaddr("".join(parts))
)
SEED_ADDRS = [
    Multiaddr("/ip4/203.0.113.7/tcp/31337"),
    Multiaddr(f"/ip6/2001:db8::1/tcp/4001/p2p/{ALICE.peer_id}"),
    Multiaddr("/dns4/example.com/tcp/443"),
    Multiaddr("/memory/42"),
    Multiaddr(f"/p2p/{BOB.peer_id}"),
]


def _identify_body(info: IdentifyInfo) -> bytes:
    framed = encode_identify(info)
    _, start = decode_uvarint(framed)
    return framed[start:]


def check_identify(data: bytes) -> None:
    try:
        info = decode_identify(data, ALICE.peer_id)
    except ProtocolViolationError:
        return
    assert len(info.listen_addrs) <= MAX_LISTEN_ADDRS and len(info.protocols) <= MAX_PROTOCOLS
    assert all(a.peer_id is None for a in info.listen_addrs)
    if info.public_key is not None:
        assert PeerID.from_public_key_proto(info.public_key) == ALICE.peer_id
    assert decode_identify(_identify_body(info), ALICE.peer_id) == info


register(
    Target(
        "identify",
        "p2p",
        check_identify,
        seeds=lambda: {
            "full": _identify_body(
                IdentifyInfo(
                    listen_addrs=SEED_ADDRS[:4],
                    protocols=list(SUPPORTED),
                    observed_addr=SEED_ADDRS[0],
                    public_key=ALICE.public_key_proto,
                    agent_version="moshpit/0.1.0",
                    protocol_version="ipfs/0.1.0",
                )
            ),
            "wrong-key": _identify_body(IdentifyInfo(public_key=BOB.public_key_proto)),
            "empty": b"",
        },
        valid=lambda: st.builds(
            lambda addrs, protos, observed, key: _identify_body(
                IdentifyInfo(
                    listen_addrs=addrs,
                    protocols=protos,
                    observed_addr=observed,
                    public_key=key,
                )
            ),
            st.lists(MULTIADDRS.filter(lambda m: m.protocols() != ["p2p"]), max_size=3),
            st.lists(st.text(max_size=12), max_size=3),
            st.none() | MULTIADDRS,
            st.sampled_from([None, ALICE.public_key_proto]),
        ),
    )
)


def check_public_key(data: bytes) -> None:
    try:
        key_type, key_data = decode_public_key_proto(data)
    except IdentityError:
        pass
    else:
        assert isinstance(key_type, int) and isinstance(key_data, bytes)
    try:
        raw = decode_public_key(data)
    except IdentityError:
        pass
    else:
        assert len(raw) == 32 and decode_public_key(encode_public_key(raw)) == raw
        assert PeerID.from_public_key(raw).public_key_bytes() == raw
    try:
        peer = PeerID.from_public_key_proto(data)
    except IdentityError:
        return
    assert PeerID.from_bytes(peer.to_bytes()) == peer


register(
    Target(
        "public_key",
        "p2p",
        check_public_key,
        seeds=lambda: {
            "ed25519": ALICE.public_key_proto,
            "rsa-type": encode_varint_field(1, 0) + encode_bytes_field(2, bytes(40)),
            "unknown-type": encode_varint_field(1, 9) + encode_bytes_field(2, bytes(32)),
        },
        valid=lambda: st.builds(
            lambda t, d: encode_varint_field(1, t) + encode_bytes_field(2, d),
            st.integers(0, 5),
            st.binary(min_size=30, max_size=34),
        ),
    )
)


def check_peer_id_bytes(data: bytes) -> None:
    try:
        peer = PeerID.from_bytes(data)
    except IdentityError:
        return
    assert peer.to_bytes() == data
    text = peer.to_base58()
    assert PeerID.from_base58(text) == peer == PeerID.from_string(text)
    assert pickle.loads(pickle.dumps(peer)) == peer
    try:
        assert len(peer.public_key_bytes()) == 32
    except IdentityError:
        pass
    assert peer.verify(b"data", bytes(64)) is False
    assert hash(peer) == hash(PeerID(data)) and peer.short()


register(
    Target(
        "peer_id_bytes",
        "p2p",
        check_peer_id_bytes,
        seeds=lambda: {f"peer{i}": p.to_bytes() for i, p in enumerate(PEERS)},
        valid=lambda: st.sampled_from(PEERS).map(PeerID.to_bytes),
        max_size=64,
    )
)


def check_peer_id_text(data: bytes) -> None:
    text = _text(data)
    try:
        peer = PeerID.from_string(text)
    except IdentityError:
        return
    assert PeerID.from_bytes(peer.to_bytes()) == peer
    if not text.startswith("b"):
        assert peer.to_base58() == text  # base58 text has one spelling per PeerID
    try:
        maddr = Multiaddr(f"/p2p/{text}")
    except MultiaddrError:
        return
    assert maddr.peer_id == peer


register(
    Target(
        "peer_id_text",
        "p2p",
        check_peer_id_text,
        seeds=lambda: {
            **{f"base58-{i}": str(p).encode() for i, p in enumerate(PEERS)},
            **{f"cid-{i}": _cid(p).encode() for i, p in enumerate(PEERS[:2])},
        },
        valid=lambda: (
            st.sampled_from(PEERS)
            .flatmap(lambda p: st.sampled_from([str(p), _cid(p), _cid(p).upper()]))
            .map(_raw)
        ),
        max_size=80,
    )
)


def _check_multiaddr(maddr: Multiaddr) -> None:
    """Both forms round-trip, and every accessor answers or raises MultiaddrError."""
    assert Multiaddr.from_bytes(maddr.to_bytes()) == maddr
    assert Multiaddr(str(maddr)) == maddr
    assert pickle.loads(pickle.dumps(maddr)) == maddr
    for accessor in (maddr.tcp_endpoint, maddr.memory_id, maddr.without_peer_id):
        try:
            accessor()
        except MultiaddrError:
            pass
    assert maddr.peer_id is None or isinstance(maddr.peer_id, PeerID)
    maddr.is_tcp(), maddr.is_memory(), maddr.protocols(), hash(maddr)


def check_multiaddr_bytes(data: bytes) -> None:
    try:
        maddr = Multiaddr.from_bytes(data)
    except MultiaddrError:
        return
    assert maddr.to_bytes() == data  # the binary form has one spelling per address
    _check_multiaddr(maddr)


register(
    Target(
        "multiaddr_bytes",
        "p2p",
        check_multiaddr_bytes,
        seeds=lambda: {f"addr{i}": a.to_bytes() for i, a in enumerate(SEED_ADDRS)},
        valid=lambda: MULTIADDRS.map(Multiaddr.to_bytes),
        max_size=96,
    )
)


def check_multiaddr_text(data: bytes) -> None:
    text = _text(data)
    try:
        maddr = Multiaddr(text)
    except MultiaddrError:
        pass
    else:
        _check_multiaddr(maddr)
    try:
        parsed = parse_multiaddr_list([text], "initial_peers")
    except MultiaddrError:
        return
    assert len(parsed) == 1 and (parsed[0].is_tcp() or parsed[0].is_memory())


register(
    Target(
        "multiaddr_text",
        "p2p",
        check_multiaddr_text,
        seeds=lambda: {
            **{f"addr{i}": str(a).encode() for i, a in enumerate(SEED_ADDRS)},
            "ipfs-legacy": f"/ip4/1.2.3.4/tcp/5/ipfs/{BOB.peer_id}/".encode(),
        },
        valid=lambda: MULTIADDRS.map(lambda m: _raw(str(m))),
        max_size=96,
    )
)


# ---------------------------------------------------------------------------------------------
# framed msgpack messages (every RPC, the DHT, all-reduce, matchmaking, state sharing)


def _packed(obj: object) -> bytes:
    return b"".join(bytes(s) for s in pack_message(obj))


def check_message_body(data: bytes) -> None:
    try:
        obj = unpack_body(data)
    except ProtocolViolationError:
        return
    framed = _packed(obj)
    _, start = decode_uvarint(framed)
    assert same(unpack_body(framed[start:]), obj)


def _body(obj: object) -> bytes:
    framed = _packed(obj)
    return framed[decode_uvarint(framed)[1] :]


register(
    Target(
        "message_body",
        "p2p",
        check_message_body,
        seeds=lambda: {
            "map": _body(
                {"op": "ping", "from": {"addrs": [b"\x04\x7f\x00\x00\x01"], "client": False}}
            ),
            "nested": _body([[1, 2.5, None], {"k": b"v"}, True, "text"]),
            "bin16": _body(b"x" * 300),
        },
        valid=lambda: MSGPACK_VALUES.map(_body),
    )
)


async def _frames_reader(data: bytes) -> None:
    mode, chunk, payload = split_control(data)
    reader = MessageReader(ScriptedStream(payload, chunk))
    try:
        for _ in range(64):
            msg = await reader.receive_msg(max_size=1024)
            # a message announcing a raw payload: read it the way all-reduce does
            raw = msg.get("len") if mode & 1 and isinstance(msg, dict) else None
            if type(raw) is int and 0 <= raw <= 64:
                await reader.receive_exactly_into(memoryview(bytearray(raw)))
    except (ProtocolViolationError, MessageTooLargeError, StreamClosedError):
        return


def check_message_frames(data: bytes) -> None:
    run_trio(_frames_reader, data)


register(
    Target(
        "message_frames",
        "p2p",
        check_message_frames,
        seeds=lambda: {
            "two": control(0) + _packed({"a": 1}) + _packed([b"x" * 10]),
            "raw-payload": control(1, 2) + _packed({"t": "chunk", "len": 4}) + b"abcd" + _packed(1),
            "too-large": control(0) + encode_uvarint(5000) + b"\x00",
        },
        valid=lambda: st.builds(
            lambda c, objs: control(c >> 3, c & 7) + b"".join(map(_packed, objs)),
            st.integers(0, 15),
            st.lists(MSGPACK_VALUES, max_size=3),
        ),
    )
)


# ---------------------------------------------------------------------------------------------
# circuit relay v2 (relay_messages.py): hop and stop messages


def _relay_body(frame: bytes) -> bytes:
    _, start = decode_uvarint(frame)
    return frame[start:]


def _relay_round_trip(msg, encode, decode) -> None:  # noqa: ANN001 - two message classes
    if msg.limit is not None and msg.limit.unlimited:
        msg.limit = None  # "no limit" has one encoding: the field left out
    assert decode(_relay_body(encode(msg))) == msg


def check_relay_hop(data: bytes) -> None:
    from dht.p2p.relay_messages import RelayMessageError, decode_hop, encode_hop

    try:
        msg = decode_hop(data)
    except RelayMessageError:
        return
    _relay_round_trip(msg, encode_hop, decode_hop)


def check_relay_stop(data: bytes) -> None:
    from dht.p2p.relay_messages import RelayMessageError, decode_stop, encode_stop

    try:
        msg = decode_stop(data)
    except RelayMessageError:
        return
    _relay_round_trip(msg, encode_stop, decode_stop)


def _relay_seeds(kind: str) -> dict[str, bytes]:
    from dht.p2p import relay_messages as rm

    relay_addr = SEED_ADDRS[0].with_peer_id(BOB.peer_id)
    peer = rm.PeerInfo(ALICE.peer_id, [SEED_ADDRS[0]])
    if kind == "hop":
        msgs = {
            "reserve": rm.HopMessage(rm.HopType.RESERVE),
            "connect": rm.HopMessage(rm.HopType.CONNECT, peer=peer),
            "reserved": rm.HopMessage(
                rm.HopType.STATUS,
                status=rm.Status.OK,
                reservation=rm.ReservationInfo(1_900_000_000, [relay_addr], b"voucher"),
                limit=rm.Limit(120, 131072),
            ),
            "refused": rm.HopMessage(rm.HopType.STATUS, status=rm.Status.NO_RESERVATION),
        }
        return {name: _relay_body(rm.encode_hop(m)) for name, m in msgs.items()}
    msgs = {
        "connect": rm.StopMessage(rm.StopType.CONNECT, peer=peer, limit=rm.Limit(120, 131072)),
        "ok": rm.StopMessage(rm.StopType.STATUS, status=rm.Status.OK),
    }
    return {name: _relay_body(rm.encode_stop(m)) for name, m in msgs.items()}


register(Target("relay_hop", "p2p", check_relay_hop, seeds=lambda: _relay_seeds("hop")))
register(Target("relay_stop", "p2p", check_relay_stop, seeds=lambda: _relay_seeds("stop")))


# ---------------------------------------------------------------------------------------------
# AutoNAT v1 (autonat.py): Dial and DialResponse messages


def check_autonat(data: bytes) -> None:
    from dht.p2p.autonat import (
        AutoNATMessageError,
        DialRequest,
        decode_message,
        encode_dial,
        encode_dial_response,
    )

    try:
        msg = decode_message(data)
    except AutoNATMessageError:
        return
    if isinstance(msg, DialRequest):
        if msg.peer_id is not None:  # the encoder always names the peer
            again = decode_message(encode_dial(msg.peer_id, msg.addrs))
            assert again == DialRequest(msg.peer_id, msg.addrs, 0)
    else:
        assert decode_message(encode_dial_response(msg)) == msg


def _autonat_seeds() -> dict[str, bytes]:
    from dht.p2p.autonat import DialResponse, ResponseStatus, encode_dial, encode_dial_response

    return {
        "dial": encode_dial(ALICE.peer_id, SEED_ADDRS[:2]),
        "ok": encode_dial_response(DialResponse(ResponseStatus.OK, "", SEED_ADDRS[0])),
        "error": encode_dial_response(DialResponse(ResponseStatus.E_DIAL_ERROR, "refused")),
    }


register(Target("autonat", "p2p", check_autonat, seeds=_autonat_seeds))


# ---------------------------------------------------------------------------------------------
# DCUtR (dcutr.py): HolePunch messages


def check_dcutr(data: bytes) -> None:
    from dht.p2p.dcutr import (
        MAX_ADDRS,
        DCUtRMessageError,
        HolePunchType,
        decode_hole_punch,
        dialable_addrs,
        encode_hole_punch,
    )

    try:
        msg = decode_hole_punch(data)
    except DCUtRMessageError:
        return
    assert msg.type in (HolePunchType.CONNECT, HolePunchType.SYNC)
    assert len(msg.addrs) + msg.skipped <= MAX_ADDRS
    assert decode_hole_punch(encode_hole_punch(msg)) == msg
    for addr in dialable_addrs(msg.addrs, allow_loopback=True):  # what would be dialed
        assert addr.is_tcp() and not addr.is_circuit() and addr.peer_id is None


def _dcutr_seeds() -> dict[str, bytes]:
    from dht.p2p.dcutr import HolePunch, HolePunchType, encode_hole_punch

    return {
        "connect": encode_hole_punch(HolePunch(HolePunchType.CONNECT, tuple(SEED_ADDRS[:3]))),
        "sync": encode_hole_punch(HolePunch(HolePunchType.SYNC)),
    }


register(Target("dcutr", "p2p", check_dcutr, seeds=_dcutr_seeds))
