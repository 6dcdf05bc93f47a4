"""libp2p Noise security: the ``/noise`` handshake and the encrypted ``SecureSession`` stream.

Wire format (libp2p noise spec): every Noise message, handshake or transport, is sent as a
2-byte big-endian length followed by that many bytes (so at most 65535, i.e. 65519 bytes of
plaintext plus the 16-byte tag). The handshake is ``Noise_XX_25519_ChaChaPoly_SHA256``
with an empty prologue; messages 2 and 3 carry a protobuf ``NoiseHandshakePayload``:

    identity_key = 1  (bytes: the libp2p protobuf PublicKey)
    identity_sig = 2  (bytes: signature of "noise-libp2p-static-key:" || static X25519 key)
    extensions   = 4  (optional NoiseExtensions; ignored here)

so each side proves that its libp2p identity owns the Noise static key. The dialer checks
the responder's identity *before* revealing its own in message 3.

Between moshpit peers the same handshake, payload and framing also run with AES-256-GCM as
the cipher (``Noise_XX_25519_AESGCM_SHA256``) under the protocol id ``AESGCM_PROTOCOL_ID``;
``SECURITY_PROTOCOLS`` maps each security protocol id to its cipher. libp2p peers only ever
see ``/noise``.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import struct
import sys
from collections.abc import Sequence

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from ._crypto_noise import (
    AESGCM_256,
    CHACHAPOLY,
    TAGLEN,
    CipherState,
    NoiseCipher,
    XXHandshakeState,
    x25519_public_bytes,
)
from ._proto import WIRE_LEN, ProtobufDecodeError, encode_bytes_field, iter_fields
from .errors import (
    HandshakeError,
    IdentityError,
    P2PTimeoutError,
    PeerIDMismatchError,
    ProtocolViolationError,
    StreamResetError,
)
from .identity import Identity, PeerID, decode_public_key, verify_ed25519
from .transport import set_max_send_rate

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/noise"  # libp2p: Noise_XX_25519_ChaChaPoly_SHA256
AESGCM_PROTOCOL_ID = "/moshpit/noise-aesgcm/1.0.0"  # moshpit only: Noise_XX_25519_AESGCM_SHA256
SECURITY_PROTOCOLS: dict[str, NoiseCipher] = {
    AESGCM_PROTOCOL_ID: AESGCM_256,
    PROTOCOL_ID: CHACHAPOLY,
}
# What a moshpit dialer proposes, in order: the faster cipher first, libp2p's /noise as the
# fallback (one extra round trip, only against peers that refuse the first).
DEFAULT_SECURITY_PROTOCOLS: tuple[str, ...] = (AESGCM_PROTOCOL_ID, PROTOCOL_ID)
SIGNATURE_PREFIX = b"noise-libp2p-static-key:"
MAX_FRAME = 0xFFFF  # 2-byte length prefix
MAX_PLAINTEXT = MAX_FRAME - TAGLEN  # 65519
SEND_BATCH = 1 << 20  # bytes of frames written per raw send_all (bulk)
_FRAME_ROOM = 2 * (2 + MAX_FRAME)  # the send buffer may pass SEND_BATCH by up to two frames
SEAL_ALL_LIMIT = 2 << 20  # sends up to this size are encrypted whole before the first write
# framing of SEAL_ALL_LIMIT bytes: 18 bytes per frame, frames hold >= _DIRECT_MIN bytes
# except the packed ones (full) and one per part; plus room for the last frames
_SEAL_ALL_ROOM = 18 * (SEAL_ALL_LIMIT // 4096 + 64) + _FRAME_ROOM
_SMALL_SEND = 64 * 1024  # sends up to this size use a fresh exact-size buffer
_DIRECT_MIN = 4096  # slices at least this large are encrypted in place; smaller ones packed
RECEIVE_CHUNK = 256 * 1024  # bytes asked from the raw stream per read
BULK_BUFFER = 1 << 20  # reused receive buffers once reads come back this large:
_BULK_READ = 128 * 1024
_IDLE_READ = 4096  # ... and dropped again after a read smaller than this
# Bulk buffers given back by sessions that went quiet, reused by the next session (or the same
# one) that enters bulk mode: an all-reduce's connections switch between bulk and small reads
# hundreds of times per round, and fresh 1 MiB buffers cost a zero-fill (or a page fault per
# page) each time: 2.4% of a 4 x 16M all-reduce's CPU samples. Bounded, so that a process
# never keeps more than _BULK_POOL_MAX MiB of idle buffers; shared by the threads of a
# process (list append/pop are atomic under the GIL).
_BULK_POOL: list[bytearray] = []
_BULK_POOL_MAX = 16


def _bulk_buffer() -> bytearray:
    try:
        return _BULK_POOL.pop()
    except IndexError:
        return bytearray(BULK_BUFFER)


def _recycle(buf: bytearray) -> None:
    if len(_BULK_POOL) < _BULK_POOL_MAX and len(buf) == BULK_BUFFER:
        _BULK_POOL.append(buf)


_LEN = struct.Struct(">H")
# cryptography >= 45 can encrypt/decrypt straight into our frame buffers (no extra copy).
_HAS_INTO = hasattr(ChaCha20Poly1305, "encrypt_into") and hasattr(AESGCM, "encrypt_into")
_FD_WRITES = sys.platform != "win32"  # sockets are file descriptors that os.write accepts


# ---------------------------------------------------------------------------------------------
# Handshake payload


def encode_handshake_payload(identity_key: bytes, identity_sig: bytes) -> bytes:
    return encode_bytes_field(1, identity_key) + encode_bytes_field(2, identity_sig)


def decode_handshake_payload(data: bytes) -> tuple[bytes, bytes]:
    """Return ``(identity_key, identity_sig)``; other fields (extensions) are ignored."""
    key: bytes | None = None
    sig: bytes | None = None
    try:
        for field, wire, value in iter_fields(data):
            if wire != WIRE_LEN:
                continue
            if field == 1:
                key = value  # type: ignore[assignment]
            elif field == 2:
                sig = value  # type: ignore[assignment]
    except ProtobufDecodeError as e:
        raise HandshakeError(f"malformed Noise handshake payload: {e}") from None
    if not key or not sig:
        raise HandshakeError("Noise handshake payload lacks identity_key or identity_sig")
    return key, sig


def _make_payload(identity: Identity, static_public: bytes) -> bytes:
    signature = identity.sign(SIGNATURE_PREFIX + static_public)
    return encode_handshake_payload(identity.public_key_proto, signature)


def _verify_payload(payload: bytes, remote_static: bytes) -> PeerID:
    """Check the remote's identity proof; return the PeerID it proved."""
    key_proto, signature = decode_handshake_payload(payload)
    try:
        public_key = decode_public_key(key_proto)
    except IdentityError as e:
        raise HandshakeError(f"remote identity key rejected: {e}") from None
    if not verify_ed25519(public_key, SIGNATURE_PREFIX + remote_static, signature):
        raise HandshakeError(
            "remote's signature over its Noise static key is invalid (identity not proven)"
        )
    return PeerID.from_public_key(public_key)


# ---------------------------------------------------------------------------------------------
# Framed I/O during the handshake


class _FrameReader:
    """Reads 2-byte-length-prefixed frames; keeps what it over-read for the session."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def read_frame(self, what: str) -> bytes:
        while True:
            if len(self.buffer) >= 2:
                (length,) = _LEN.unpack_from(self.buffer)
                if len(self.buffer) >= 2 + length:
                    frame = bytes(self.buffer[2 : 2 + length])
                    del self.buffer[: 2 + length]
                    return frame
            data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                state = "a truncated frame" if self.buffer else "nothing"
                raise HandshakeError(
                    f"connection closed during the Noise handshake while waiting for {what} "
                    f"(got {state})"
                )
            self.buffer += data


def _frame(message: bytes) -> bytes:
    if len(message) > MAX_FRAME:
        raise HandshakeError(f"Noise message of {len(message)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(message)) + message


async def noise_handshake(
    raw: trio.abc.Stream,
    identity: Identity,
    *,
    initiator: bool,
    expected_peer: PeerID | None = None,
    timeout: float | None = 10.0,  # noqa: ASYNC109 - part of the documented API
    cipher: NoiseCipher = CHACHAPOLY,
) -> SecureSession:
    """Run the libp2p Noise XX handshake on ``raw`` and return the encrypted session.

    ``cipher`` is the one the security protocol negotiated on ``raw`` stands for
    (``SECURITY_PROTOCOLS``); both sides must use the same, or the handshake fails.

    Raises HandshakeError (bad frames, signatures, decryption), PeerIDMismatchError (the remote
    proved an identity other than ``expected_peer``) and P2PTimeoutError (the remote stalled).
    The caller owns ``raw`` and should close it on any error.
    """
    static = X25519PrivateKey.generate()  # fresh per connection; identity binds it
    state = XXHandshakeState(initiator=initiator, static_key=static, cipher=cipher)
    payload = _make_payload(identity, x25519_public_bytes(static))
    reader = _FrameReader(raw)

    with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
        try:
            if initiator:
                await raw.send_all(_frame(state.write_message(b"")))
                remote_payload = state.read_message(await reader.read_frame("message 2"))
                remote_peer = _verify_payload(remote_payload, state.remote_static)  # type: ignore[arg-type]
                if expected_peer is not None and remote_peer != expected_peer:
                    # Stop before message 3: do not reveal who we are to an impostor.
                    raise PeerIDMismatchError(
                        f"dialed {expected_peer} but the remote proved it is {remote_peer}"
                    )
                await raw.send_all(_frame(state.write_message(payload)))
            else:
                state.read_message(await reader.read_frame("message 1"))
                await raw.send_all(_frame(state.write_message(payload)))
                remote_payload = state.read_message(await reader.read_frame("message 3"))
                remote_peer = _verify_payload(remote_payload, state.remote_static)  # type: ignore[arg-type]
                if expected_peer is not None and remote_peer != expected_peer:
                    raise PeerIDMismatchError(
                        f"expected {expected_peer} but the remote proved it is {remote_peer}"
                    )
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise HandshakeError(f"connection broke during the Noise handshake: {e}") from e
        send_cipher, receive_cipher = state.split()
        session = SecureSession(
            raw,
            local_peer=identity.peer_id,
            remote_peer=remote_peer,
            send_cipher=send_cipher,
            receive_cipher=receive_cipher,
            initial=bytes(reader.buffer),
            cipher=cipher,
        )
        logger.debug(
            "noise handshake done (%s, %s) with %s",
            "outbound" if initiator else "inbound",
            cipher.name,
            remote_peer.short(),
        )
        return session
    assert scope.cancelled_caught
    raise P2PTimeoutError(f"Noise handshake did not finish within {timeout} s")


# ---------------------------------------------------------------------------------------------


class SecureSession(trio.abc.HalfCloseableStream):
    """An authenticated, encrypted byte stream over ``raw`` (after ``noise_handshake``).

    ``send_all`` splits data into maximum-size Noise frames and writes up to ``SEND_BATCH``
    bytes of them with a single raw write; ``receive_some`` reads large chunks and decrypts
    every complete frame in them. A frame that fails authentication raises
    ProtocolViolationError; the raw stream ending mid-frame raises StreamResetError. Both are
    permanent for the session.
    """

    def __init__(
        self,
        raw: trio.abc.Stream,
        *,
        local_peer: PeerID,
        remote_peer: PeerID,
        send_cipher: CipherState,
        receive_cipher: CipherState,
        initial: bytes = b"",
        cipher: NoiseCipher = CHACHAPOLY,
    ) -> None:
        self.raw = raw
        self.cipher = cipher  # which cipher function the handshake agreed on (for logs, tests)
        self.local_peer = local_peer
        self.remote_peer = remote_peer
        self._send = send_cipher
        self._receive = receive_cipher
        self._rbuf = bytearray()  # the start of a frame split across raw reads (< 64 KiB)
        self._initial = bytes(initial)  # read past the handshake; decrypted on first receive
        self._plain: memoryview = memoryview(b"")  # decrypted, not yet returned
        self._eof = False
        self._error: Exception | None = None
        self._sending = False
        self._receiving = False
        # raw bytes moved each way, and when they last arrived (trio time): on a slow link one
        # 64-KiB frame takes seconds, and a wait that sees these move waits for a full link,
        # not for a peer that stopped reading or sending
        self.bytes_written = 0
        self.bytes_read = 0
        self.last_read = trio.current_time()
        self._plain_borrowed = False  # ``_plain`` lies in the reused bulk buffer
        self._cbuf: bytearray | None = None  # bulk mode: reused ciphertext buffer
        self._cview = memoryview(b"")
        self._pview = memoryview(b"")  # bulk mode: reused plaintext buffer
        self._cfill = 0  # bytes of a split frame at the start of ``_cbuf``
        self._sbuf: bytearray | None = None  # reused frame buffer for bulk sends (lazy)
        self._stage = bytearray()  # small parts packed into one frame (lazy, bulk only)
        # plaintext buffer of the last bulk read after leaving bulk mode: recycled once what
        # it holds was taken and the borrowed view expired (the next receive call)
        self._retired: bytearray | None = None

    # -- sending -------------------------------------------------------------------------------
    def _encrypt_batch(self, view: memoryview) -> bytearray:
        """Frame and encrypt ``view`` (<= SEND_BATCH bytes) into one contiguous buffer."""
        n = len(view)
        frames = max(1, -(-n // MAX_PLAINTEXT))
        out = bytearray(n + frames * (2 + TAGLEN))
        out_view = memoryview(out)
        aead = self._send.aead
        pos = 0
        for start in range(0, max(n, 1), MAX_PLAINTEXT):
            chunk = view[start : start + MAX_PLAINTEXT]
            size = len(chunk) + TAGLEN
            _LEN.pack_into(out, pos, size)
            nonce = self._send.next_nonce()
            if _HAS_INTO:
                aead.encrypt_into(nonce, chunk, None, out_view[pos + 2 : pos + 2 + size])  # type: ignore[union-attr]
            else:  # cryptography < 45
                out_view[pos + 2 : pos + 2 + size] = aead.encrypt(nonce, bytes(chunk), None)  # type: ignore[union-attr]
            pos += 2 + size
        return out

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.send_parts((data,))

    async def send_parts(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send the concatenation of ``parts`` (like ``send_all(b"".join(parts))``, minus the join).

        The yamux writer hands over a whole batch (headers, control frames and large payloads):
        small parts are packed together into shared Noise frames, large parts are encrypted
        straight from the caller's memory, and up to ``SEND_BATCH`` bytes of frames leave in
        one raw write from a buffer reused across calls (no allocation or page faults per batch).
        """
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this SecureSession")
        self._sending = True
        try:
            views = [memoryview(p).cast("B") for p in parts]
            try:
                total = sum(len(v) for v in views)
                if total == 0:
                    await trio.lowlevel.checkpoint()
                elif total <= _SMALL_SEND:
                    # Small writes (RPCs): one exact-size buffer, nothing kept per connection.
                    joined = views[0] if len(views) == 1 else b"".join(views)
                    await self._raw_send_all(memoryview(self._encrypt_batch(memoryview(joined))))
                else:
                    await self._send_large(views, total)
            finally:
                for v in views:
                    v.release()  # so the caller may resize a bytearray it passed us
        finally:
            self._sending = False

    async def _send_large(self, views: list[memoryview], total: int) -> None:
        if self._sbuf is None:
            self._sbuf = bytearray(SEAL_ALL_LIMIT + _SEAL_ALL_ROOM)
            self._stage = bytearray(MAX_PLAINTEXT)
        out = self._sbuf
        # Up to SEAL_ALL_LIMIT bytes (every batch of the yamux writer) are all encrypted
        # before the first write: callers' buffers are then never read after an await, which
        # yamux relies on to send views of a sender's buffer without copying them.
        flush_at = SEND_BATCH if total > SEAL_ALL_LIMIT else len(out)
        stage = self._stage
        staged = 0  # bytes of small parts waiting in ``stage`` for a shared frame
        pos = 0  # bytes of frames in ``out``
        with memoryview(out) as out_view, memoryview(stage) as stage_view:
            for view in views:
                n = len(view)
                start = 0
                while start < n:
                    size = min(n - start, MAX_PLAINTEXT)
                    if size < _DIRECT_MIN:  # a small part or a large part's tail: pack it
                        if staged + size > MAX_PLAINTEXT:
                            pos = self._seal(stage_view[:staged], out, out_view, pos)
                            staged = 0
                        stage_view[staged : staged + size] = view[start : start + size]
                        staged += size
                    else:
                        if staged:
                            pos = self._seal(stage_view[:staged], out, out_view, pos)
                            staged = 0
                        pos = self._seal(view[start : start + size], out, out_view, pos)
                    start += size
                    if pos > flush_at:
                        await self._raw_send_all(out_view[:pos])
                        pos = 0
            if staged:
                pos = self._seal(stage_view[:staged], out, out_view, pos)
            if pos:
                await self._raw_send_all(out_view[:pos])

    def set_max_send_rate(self, rate: float | None) -> bool:
        """Cap the underlying TCP connection's send rate (see ``transport.set_max_send_rate``)."""
        return set_max_send_rate(self.raw, rate)

    async def _raw_send_all(self, data: memoryview) -> None:
        """``self.raw.send_all(data)``; on a TCP socket, written straight to its descriptor.

        trio's send_all yields to the scheduler after every ``send`` call, and the kernel
        takes ~120 KB per call from a busy connection, so a 1 MiB batch cost ~8 schedule
        points and trio's wrapper code around each call. Here the task yields once per batch,
        or only where it waits for the socket to drain (the same errors as trio's).
        """
        raw = self.raw
        if type(raw) is not trio.SocketStream or not _FD_WRITES:
            await raw.send_all(data)
            self.bytes_written += len(data)
            return
        sock = raw.socket
        if sock.did_shutdown_SHUT_WR:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        total = len(data)
        sent = 0
        waited = False
        while sent < total:
            # closed (by aclose in this thread) -> -1; while it is not, the descriptor is
            # this socket's: nothing else runs between this check and the write
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the raw socket was closed")
            try:
                n = os.write(fd, data[sent:])
                sent += n
                self.bytes_written += n
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)  # type: ignore[arg-type]  # trio-typing's stubs: an int only; trio takes the socket
                waited = True
            except OSError as e:
                raise trio.BrokenResourceError(f"socket error while sending: {e!r}") from e
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _seal(self, chunk: memoryview, out: bytearray, out_view: memoryview, pos: int) -> int:
        """Encrypt ``chunk`` (<= MAX_PLAINTEXT bytes) as one frame at ``out[pos:]``; new end."""
        size = len(chunk) + TAGLEN
        _LEN.pack_into(out, pos, size)
        nonce = self._send.next_nonce()
        if _HAS_INTO:
            self._send.aead.encrypt_into(nonce, chunk, None, out_view[pos + 2 : pos + 2 + size])  # type: ignore[union-attr]
        else:  # cryptography < 45
            out_view[pos + 2 : pos + 2 + size] = self._send.aead.encrypt(nonce, bytes(chunk), None)  # type: ignore[union-attr]
        return pos + 2 + size

    async def wait_send_all_might_not_block(self) -> None:
        await self.raw.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close: passes through to the raw stream (TCP FIN); reading stays possible."""
        send_eof = getattr(self.raw, "send_eof", None)
        if send_eof is None:
            raise TypeError(f"{type(self.raw).__name__} does not support half-close")
        await send_eof()

    # -- receiving -----------------------------------------------------------------------------
    def _ingest(self, data: bytes | bytearray) -> None:
        """Decrypt every frame completed by ``data`` into ``self._plain``.

        Frames lying wholly inside ``data`` are decrypted in place (no copy into a staging
        buffer); only a frame split across reads is assembled in ``self._rbuf`` (< 64 KiB).
        """
        view = memoryview(data)
        n = len(view)
        pos = 0
        head: bytearray | None = None  # a split frame completed by this read
        rbuf = self._rbuf
        if rbuf:
            if len(rbuf) < 2:
                take = min(2 - len(rbuf), n)
                rbuf += view[:take]
                pos = take
            if len(rbuf) >= 2:
                (length,) = _LEN.unpack_from(rbuf)
                self._check_frame_length(length)
                take = min(2 + length - len(rbuf), n - pos)
                rbuf += view[pos : pos + take]
                pos += take
                if len(rbuf) == 2 + length:
                    head, self._rbuf = rbuf, bytearray()
        frames: list[int] = []  # start offsets (of the length prefix) in ``data``
        plain_len = len(head) - 2 - TAGLEN if head is not None else 0
        while n - pos >= 2:
            (length,) = _LEN.unpack_from(view, pos)
            self._check_frame_length(length)
            if n - pos - 2 < length:
                break
            frames.append(pos)
            plain_len += length - TAGLEN
            pos += 2 + length
        if pos < n:
            self._rbuf += view[pos:]
        if head is None and not frames:
            return
        out = bytearray(plain_len)
        out_view = memoryview(out)
        o = 0
        try:
            if head is not None:
                o = self._decrypt_frame(memoryview(head), 0, out_view, o)
            for start in frames:
                o = self._decrypt_frame(view, start, out_view, o)
        except InvalidTag:
            self._fail(
                ProtocolViolationError(
                    f"Noise frame from {self.remote_peer.short()} failed authentication "
                    "(tampered or corrupted); the session is unusable"
                )
            )
        self._plain = out_view
        self._plain_borrowed = False

    def _check_frame_length(self, length: int) -> None:
        if length < TAGLEN:
            self._fail(
                ProtocolViolationError(f"Noise frame of {length} bytes has no room for a tag")
            )

    def _decrypt_frame(self, source: memoryview, start: int, out: memoryview, o: int) -> int:
        """Decrypt the frame whose length prefix is at ``source[start]`` into ``out[o:]``."""
        length: int
        (length,) = _LEN.unpack_from(source, start)
        size = length - TAGLEN
        nonce = self._receive.next_nonce()
        ciphertext = source[start + 2 : start + 2 + length]
        if _HAS_INTO:
            self._receive.aead.decrypt_into(nonce, ciphertext, None, out[o : o + size])  # type: ignore[union-attr]
        else:  # cryptography < 45
            out[o : o + size] = self._receive.aead.decrypt(nonce, bytes(ciphertext), None)  # type: ignore[union-attr]
        return o + size

    def _fail(self, error: Exception) -> None:
        self._error = error
        raise error

    def _take(self, max_bytes: int | None, borrow: bool) -> bytes | bytearray | memoryview:
        plain = self._plain
        if max_bytes is None or max_bytes >= len(plain):
            self._plain = memoryview(b"")
            if self._plain_borrowed:
                # ``plain`` lies in the bulk buffer that the next read overwrites
                return plain if borrow else bytes(plain)
            obj = plain.obj
            if isinstance(obj, bytearray) and len(plain) == len(obj):
                plain.release()  # so the caller may resize the bytearray
                return obj  # the whole decrypted batch: hand it over without copying
            return bytes(plain)
        out = bytes(plain[:max_bytes])
        self._plain = plain[max_bytes:]
        return out

    def unread(self, data: bytes | bytearray | memoryview) -> None:
        """Put plaintext back in front of what receive_some returns next.

        For a layer that read ahead (multistream negotiation) and hands the session on.
        """
        if data:
            self._plain = memoryview(bytes(data) + bytes(self._plain))
            self._plain_borrowed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:  # type: ignore[override]  # trio-typing's stubs say bytes; trio returns bytearray too
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        return await self._receive_plain(max_bytes, borrow=False)  # type: ignore[return-value]

    async def receive_view(self) -> bytes | bytearray | memoryview:
        """``receive_some()`` for the yamux reader, which copies out what it keeps anyway.

        A ``memoryview`` result is *borrowed*: it points into the bulk receive buffer and is
        only valid until the next receive call (bytes/bytearray results are the caller's).
        Saves one allocation and copy of every byte on bulk transfers.
        """
        return await self._receive_plain(None, borrow=True)

    async def _receive_plain(
        self, max_bytes: int | None, borrow: bool
    ) -> bytes | bytearray | memoryview:
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this SecureSession")
        self._receiving = True
        try:
            retired = self._retired
            if retired is not None and (not self._plain or self._plain.obj is not retired):
                # views borrowed from it expired with this call and none of it is pending
                self._retired = None
                _recycle(retired)
            if self._error is not None:
                raise self._error
            if self._plain:
                await trio.lowlevel.checkpoint()
                return self._take(max_bytes, borrow)
            if self._initial:
                initial, self._initial = self._initial, b""
                self._ingest(initial)
                if self._plain:
                    await trio.lowlevel.checkpoint()
                    return self._take(max_bytes, borrow)
            while not self._plain:
                if self._eof:
                    partial = len(self._rbuf) + self._cfill
                    if partial:
                        self._fail(
                            StreamResetError(
                                f"connection to {self.remote_peer.short()} ended in the middle "
                                f"of a Noise frame ({partial} bytes of it received)"
                            )
                        )
                    return b""
                if self._cbuf is not None:
                    await self._read_bulk()
                    continue
                data = await self.raw.receive_some(RECEIVE_CHUNK)
                if data:
                    self.last_read = trio.current_time()
                    self.bytes_read += len(data)
                    self._ingest(data)
                    if len(data) >= _BULK_READ and isinstance(self.raw, trio.SocketStream):
                        self._enter_bulk_mode()
                else:
                    self._eof = True
            return self._take(max_bytes, borrow)
        finally:
            self._receiving = False

    # -- bulk receiving: reused buffers, recv_into ----------------------------------------------
    # Allocating fresh multi-100-KiB buffers per read costs a page fault on every page (glibc
    # returns freed large blocks to the OS); with two reused buffers a bulk transfer's bytes are
    # written once by the kernel, once by the AEAD and once more into what yamux delivers.
    def _enter_bulk_mode(self) -> None:
        self._cbuf = _bulk_buffer()
        self._cview = memoryview(self._cbuf)
        self._pview = memoryview(_bulk_buffer())
        self._cfill = len(self._rbuf)  # a split frame moves to the front of the new buffer
        self._cbuf[: self._cfill] = self._rbuf
        self._rbuf = bytearray()

    def _leave_bulk_mode(self) -> None:
        """Back to per-read buffers once traffic is small (idle connections keep no buffers)."""
        self._rbuf = bytearray(self._cview[: self._cfill])
        self._cview.release()
        _recycle(self._cbuf)  # type: ignore[arg-type]
        self._cbuf = None
        # ``_plain`` (and a view the caller borrows) may still point into the plaintext buffer
        plain_buf = self._pview.obj
        if isinstance(plain_buf, bytearray) and plain_buf is not self._retired:
            if self._retired is not None:
                _recycle(self._retired)
            self._retired = plain_buf
        self._cview = self._pview = memoryview(b"")
        self._cfill = 0

    async def _read_bulk(self) -> None:
        cbuf, cview, pview = self._cbuf, self._cview, self._pview
        assert cbuf is not None and isinstance(self.raw, trio.SocketStream)
        try:
            got = await self.raw.socket.recv_into(cview[self._cfill :])
        except OSError as e:  # what trio.SocketStream.receive_some would raise
            if e.errno == errno.EBADF:
                raise trio.ClosedResourceError("the raw socket was closed") from None
            raise trio.BrokenResourceError(f"socket error while receiving: {e!r}") from e
        if not got:
            self._eof = True
            return
        self.last_read = trio.current_time()
        self.bytes_read += got
        n = self._cfill + got
        pos = 0
        o = 0
        try:
            while n - pos >= 2:
                (length,) = _LEN.unpack_from(cbuf, pos)
                self._check_frame_length(length)
                if n - pos - 2 < length:
                    break
                o = self._decrypt_frame(cview, pos, pview, o)
                pos += 2 + length
        except InvalidTag:
            self._fail(
                ProtocolViolationError(
                    f"Noise frame from {self.remote_peer.short()} failed authentication "
                    "(tampered or corrupted); the session is unusable"
                )
            )
        tail = n - pos
        if tail and pos:
            cbuf[:tail] = bytes(cview[pos:n])  # the split frame's start (< 64 KiB) to the front
        self._cfill = tail
        self._plain = pview[:o]
        self._plain_borrowed = True
        if got < _IDLE_READ and not tail:
            self._leave_bulk_mode()

    async def aclose(self) -> None:
        await self.raw.aclose()

    def __repr__(self) -> str:
        return (
            f"<SecureSession {self.local_peer.short()} <-> {self.remote_peer.short()} "
            f"{self.cipher.name}>"
        )
