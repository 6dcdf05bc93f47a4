"""P2PStream: a negotiated stream to one peer, speaking one protocol, with framed messages.

What handlers receive and ``Host.new_stream`` returns: a yamux stream after multistream-select
agreed on its protocol, with a buffered reader for framed msgpack messages (``send_msg``,
``receive_msg``), raw frames of other encodings (``receive_frame``) and raw payloads.
"""

from __future__ import annotations

from typing import Any

import trio

from .errors import MessageTooLargeError, ProtocolViolationError
from .identity import PeerID
from .messages import MessageReader, send_msg
from .yamux import YamuxSession, YamuxStream


class P2PStream(trio.abc.HalfCloseableStream):
    """A negotiated stream to ``remote_peer`` speaking ``protocol``, with framed messages."""

    def __init__(
        self,
        inner: trio.abc.HalfCloseableStream,
        yamux_stream: YamuxStream,
        remote_peer: PeerID,
        protocol: str,
        max_message_size: int,
        remote_addr: str = "",
    ) -> None:
        self._inner = inner
        self._yamux = yamux_stream
        self._reader = MessageReader(inner)
        self.remote_peer = remote_peer
        self.protocol = protocol
        self.max_message_size = max_message_size
        self.remote_addr = remote_addr  # the connection's remote address, for logs

    def __repr__(self) -> str:
        return f"<P2PStream {self.protocol} with {self.remote_peer.short()}>"

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)  # type: ignore[arg-type]  # trio-typing's stubs omit bytearray, trio takes it

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._reader.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._yamux.aclose()

    def reset(self) -> None:
        self._yamux.reset()

    def set_max_send_rate(self, rate: float | None) -> bool:
        """Cap the send rate (bytes/s; ``None`` lifts the cap) of the connection this stream
        runs on: it applies to every stream to this peer on that connection. False where the
        transport cannot pace (the in-memory network, or a system without the option)."""
        return self.session.set_max_send_rate(rate)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received on this stream that the application has not read yet."""
        return self._yamux.buffered_bytes + len(self._reader.buffered)

    @property
    def session(self) -> YamuxSession:
        """The yamux session (the connection) this stream runs on."""
        return self._yamux.session

    async def receive_exactly(self, n: int) -> bytes:
        """The next ``n`` raw bytes; StreamClosedError if the stream ends first."""
        return await self._reader.receive_exactly(n)

    async def receive_exactly_into(self, buffer: memoryview) -> None:
        """Fill ``buffer`` with the next ``len(buffer)`` raw bytes (a payload whose size a
        preceding message announced); StreamClosedError if the stream ends first."""
        await self._reader.receive_exactly_into(buffer)

    async def receive_frame(self, max_size: int) -> bytes:
        """One uvarint-length-prefixed frame, undecoded (protocols with their own encoding:
        relay, DCUtR, AutoNAT); MessageTooLargeError over ``max_size``. Unlike
        :meth:`receive_msg` it leaves the stream as it is: the protocol answers or resets."""
        return await self._reader.receive_frame(max_size)

    async def send_msg(self, obj: Any) -> None:
        """Send one framed msgpack message (MessageTooLargeError above ``max_message_size``)."""
        await send_msg(self, obj, self.max_message_size)

    async def receive_msg(self, max_size: int | None = None) -> Any:
        """Receive one framed message; a malformed or oversized message resets the stream."""
        try:
            return await self._reader.receive_msg(max_size or self.max_message_size)
        except (MessageTooLargeError, ProtocolViolationError):
            self.reset()
            raise


__all__ = ["P2PStream"]
