"""Message framing on a byte stream: unsigned-varint length prefix + msgpack body.

Everything read here comes from the network, so the length is checked against a cap before
any byte of the body is buffered, the body is accumulated only as it actually arrives, and
msgpack is unpacked with explicit limits. Large ``bytes`` values (tensor payloads) are sent
as msgpack ``bin`` without being copied into a packing buffer first: the encoder emits the
bin header and then hands the original buffer to the stream.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import trio

from .errors import MessageTooLargeError, ProtocolViolationError, StreamClosedError
from .varint import MAX_VARINT_BYTES, decode_uvarint, encode_uvarint

DEFAULT_MAX_MESSAGE_SIZE = 16 * 1024 * 1024
ZERO_COPY_MIN = 64 * 1024  # bytes values at least this large are not copied when packing
_WALK_MAX_DEPTH = 4
_WALK_MAX_ITEMS = 64  # bigger containers are packed in one C call (no per-item Python work)
_RECV_CHUNK = 256 * 1024

Segment = bytes | memoryview  # never a bytearray: the packing buffer is copied out


def own_method(obj: object, name: str) -> Any:
    """``obj.name`` if ``obj``'s class defines it, not a wrapper's attribute passthrough.

    A wrapper (e.g. multistream's PrefixedStream, which replays over-read bytes) may forward
    unknown attributes to the stream inside; calling the inner fast path would skip the
    wrapper's own buffered bytes.
    """
    return getattr(obj, name) if getattr(type(obj), name, None) is not None else None


async def fill_by_reads(stream: trio.abc.ReceiveStream, view: memoryview) -> int:
    """Fill ``view`` from ``stream``: through the stream's own ``receive_exactly_into`` when
    its class has one, else by reads copied in. Returns the bytes filled (short only at EOF)."""
    fill = own_method(stream, "receive_exactly_into")
    if fill is not None:
        filled: int = await fill(view)
        return filled
    have = 0
    while have < len(view):
        data = await stream.receive_some(len(view) - have)
        if not data:
            break
        view[have : have + len(data)] = data
        have += len(data)
    return have


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return struct.pack(">BB", 0xC4, n)
    if n < 0x10000:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _has_big_buffer(obj: Any, depth: int) -> bool:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return memoryview(obj).nbytes >= ZERO_COPY_MIN
    if depth >= _WALK_MAX_DEPTH:
        return False
    if isinstance(obj, dict):
        if len(obj) > _WALK_MAX_ITEMS:
            return False
        return any(_has_big_buffer(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if len(obj) > _WALK_MAX_ITEMS:
            return False
        return any(_has_big_buffer(v, depth + 1) for v in obj)
    return False


def _walk(obj: Any, packer: msgpack.Packer, cur: bytearray, out: list[Segment], depth: int) -> None:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj).cast("B")
        if view.nbytes >= ZERO_COPY_MIN:
            cur += _bin_header(view.nbytes)
            out.append(bytes(cur))
            cur.clear()
            out.append(obj if isinstance(obj, bytes) else view)
            return
        cur += packer.pack(obj)
        return
    if depth < _WALK_MAX_DEPTH and isinstance(obj, dict) and len(obj) <= _WALK_MAX_ITEMS:
        cur += packer.pack_map_header(len(obj))
        for k, v in obj.items():
            cur += packer.pack(k)
            _walk(v, packer, cur, out, depth + 1)
        return
    if depth < _WALK_MAX_DEPTH and isinstance(obj, (list, tuple)) and len(obj) <= _WALK_MAX_ITEMS:
        cur += packer.pack_array_header(len(obj))
        for v in obj:
            _walk(v, packer, cur, out, depth + 1)
        return
    cur += packer.pack(obj)


def pack_message(obj: Any, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> list[Segment]:
    """Encode ``obj`` as [varint length, body segments...]; raises MessageTooLargeError.

    Raises TypeError if ``obj`` is not msgpack-serializable.
    """
    if not _has_big_buffer(obj, 0):
        body = msgpack.packb(obj, use_bin_type=True)
        if len(body) > max_size:
            raise MessageTooLargeError(
                f"message of {len(body)} bytes exceeds the cap of {max_size}"
            )
        return [encode_uvarint(len(body)) + body]
    packer = msgpack.Packer(use_bin_type=True)
    segments: list[Segment] = []
    cur = bytearray()
    _walk(obj, packer, cur, segments, 0)
    if cur:
        segments.append(bytes(cur))
    size = sum(memoryview(s).nbytes for s in segments)
    if size > max_size:
        raise MessageTooLargeError(f"message of {size} bytes exceeds the cap of {max_size}")
    segments.insert(0, encode_uvarint(size))
    return segments


def unpack_body(body: bytes | bytearray | memoryview) -> Any:
    """Decode one message body with limits derived from its size; ProtocolViolationError if bad."""
    n = len(body)
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        # ExtraData/FormatError/StackError are ValueErrors; unhashable map keys are TypeErrors
        raise ProtocolViolationError(f"malformed msgpack message ({type(e).__name__}: {e})") from e


async def send_msg(
    stream: trio.abc.SendStream, obj: Any, max_size: int = DEFAULT_MAX_MESSAGE_SIZE
) -> None:
    """Frame and send one message. Small segments are joined so most messages are one write."""
    segments = pack_message(obj, max_size)
    if len(segments) == 1:
        await stream.send_all(segments[0])
        return
    pending = bytearray()
    for seg in segments:
        if memoryview(seg).nbytes >= ZERO_COPY_MIN:
            if pending:
                await stream.send_all(bytes(pending))
                pending.clear()
            await stream.send_all(seg)
        else:
            pending += seg
    if pending:
        await stream.send_all(bytes(pending))


class MessageReader:
    """Buffered reader over a receive stream that reads framed messages and raw bytes."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self._buf = b""

    @property
    def buffered(self) -> bytes:
        return self._buf

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Like the stream's receive_some, but returns already-buffered bytes first."""
        if self._buf:
            await trio.lowlevel.checkpoint()
            if max_bytes is None or max_bytes >= len(self._buf):
                data, self._buf = self._buf, b""
            else:
                data, self._buf = self._buf[:max_bytes], self._buf[max_bytes:]
            return data
        return await self.stream.receive_some(max_bytes)

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(_RECV_CHUNK)
        if not data:
            return False
        self._buf = self._buf + data if self._buf else data
        return True

    async def _read_length(self) -> int:
        while True:
            try:
                value, end = decode_uvarint(self._buf)
            except ValueError as e:
                if len(self._buf) >= MAX_VARINT_BYTES or "truncated" not in str(e):
                    raise ProtocolViolationError(f"bad message length prefix: {e}") from None
            else:
                self._buf = self._buf[end:]
                return value
            if not await self._fill():
                if self._buf:
                    raise StreamClosedError("stream ended inside a message length prefix")
                raise StreamClosedError("stream ended before the next message")

    async def receive_exactly(self, n: int) -> bytes:
        """Read exactly ``n`` bytes; memory grows only as data arrives."""
        if len(self._buf) >= n:
            data, self._buf = self._buf[:n], self._buf[n:]
            return data
        parts = [self._buf]
        have = len(self._buf)
        self._buf = b""
        while have < n:
            data = await self.stream.receive_some(_RECV_CHUNK)
            if not data:
                raise StreamClosedError(f"stream ended after {have} of {n} bytes of a message")
            if have + len(data) > n:
                cut = n - have
                self._buf = data[cut:]
                data = data[:cut]
            parts.append(data)
            have += len(data)
        return b"".join(parts)

    async def receive_exactly_into(self, buffer: memoryview) -> None:
        """Fill ``buffer`` with the next ``len(buffer)`` bytes (a raw payload after a message).

        Uses the stream's own ``receive_exactly_into`` when it has one (yamux: the bytes go
        from the decrypted receive buffer straight into ``buffer``), else reads and copies.
        StreamClosedError if the stream ends first.
        """
        view = memoryview(buffer).cast("B")
        n = len(view)
        have = min(len(self._buf), n)
        if have:
            view[:have] = memoryview(self._buf)[:have]
            self._buf = self._buf[have:]
        if have == n:
            await trio.lowlevel.checkpoint()
            return
        have += await fill_by_reads(self.stream, view[have:])
        if have < n:
            raise StreamClosedError(f"stream ended after {have} of {n} bytes of a payload")

    async def receive_frame(self, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> bytes:
        """Read one uvarint-length-prefixed frame without decoding it (e.g. a protobuf)."""
        length = await self._read_length()
        if length > max_size:
            raise MessageTooLargeError(
                f"incoming message of {length} bytes exceeds the cap of {max_size}"
            )
        return await self.receive_exactly(length)

    async def receive_msg(self, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> Any:
        """Read one framed message. StreamClosedError at clean EOF, MessageTooLargeError over cap."""
        return unpack_body(await self.receive_frame(max_size))


async def receive_msg(reader: MessageReader, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> Any:
    """Module-level convenience: ``await reader.receive_msg(max_size)``."""
    return await reader.receive_msg(max_size)
