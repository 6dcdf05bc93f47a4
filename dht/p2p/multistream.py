"""multistream-select 1.0.0: agree on which protocol a connection or stream speaks.

Every message is ``uvarint(len(body)) || body`` where ``body`` is UTF-8 text ending in
``\\n``. Both sides first exchange the header ``/multistream/1.0.0``; the dialer then proposes
protocols one at a time and the listener either echoes the proposal (accepted) or answers
``na``. ``ls`` asks the listener for its protocol list.

Besides the classic round-trip form, the dialer may negotiate *lazily* when it proposes a
single protocol: header, proposal and the first payload bytes go out in one write, and the
echo is checked when the first response bytes are read. That makes a unary RPC on a fresh
stream cost one round trip instead of two.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import trio

from .errors import P2PTimeoutError, ProtocolNegotiationError
from .messages import fill_by_reads
from .varint import decode_uvarint, encode_uvarint

logger = logging.getLogger(__name__)

MULTISTREAM_PROTOCOL = "/multistream/1.0.0"
NA = "na"
LS = "ls"
MAX_MESSAGE_SIZE = 1024  # a protocol name longer than this is garbage or an attack
MAX_ATTEMPTS = 32  # proposals (outbound) or commands (inbound) before giving up
MAX_LS_RESPONSE = 64 * 1024
_READ_CHUNK = 4096

Supported = Callable[[str], bool] | Collection[str]
# The stream negotiated on: what comes back is it or a wrapper around it, so a half-closeable
# stream (a yamux stream) stays half-closeable for the caller.
S = TypeVar("S", bound=trio.abc.Stream)


def encode_message(text: str) -> bytes:
    """One multistream message: varint length, UTF-8 text, newline."""
    body = text.encode("utf-8") + b"\n"
    if len(body) > MAX_MESSAGE_SIZE:
        raise ValueError(f"multistream message too long ({len(body)} > {MAX_MESSAGE_SIZE} bytes)")
    return encode_uvarint(len(body)) + body


_HEADER = encode_message(MULTISTREAM_PROTOCOL)


def _check_protocol_name(protocol: str) -> None:
    if not isinstance(protocol, str) or not protocol or "\n" in protocol:
        raise ValueError(f"invalid protocol id {protocol!r}")
    encode_message(protocol)  # length check


class _Reader:
    """Reads multistream messages from a stream, keeping bytes that arrive past them.

    Without a stream it reads only ``initial`` (the entries of an ``ls`` answer, which must
    not run on into the bytes that follow the answer)."""

    def __init__(self, stream: trio.abc.ReceiveStream | None, initial: bytes = b"") -> None:
        self.stream = stream
        self.buffer = bytearray(initial)

    async def _fill(self, what: str) -> None:
        if self.stream is None:
            raise ProtocolNegotiationError(f"{what} runs past the end of the message holding it")
        data = await self.stream.receive_some(_READ_CHUNK)
        if not data:
            raise ProtocolNegotiationError(f"stream closed by remote while waiting for {what}")
        self.buffer += data

    async def read_raw(self, what: str, limit: int = MAX_MESSAGE_SIZE) -> bytes:
        """One length-prefixed frame (without judging its content)."""
        while True:
            try:
                length, start = decode_uvarint(self.buffer)
            except ValueError as e:
                if "truncated" not in str(e):
                    raise ProtocolNegotiationError(
                        f"garbage instead of a multistream message while waiting for {what}: {e}"
                    ) from None
                await self._fill(what)
                continue
            if length > limit:
                raise ProtocolNegotiationError(
                    f"multistream message of {length} bytes (max {limit}) while waiting for "
                    f"{what}: the remote is not speaking multistream-select"
                )
            if len(self.buffer) >= start + length:
                body = bytes(self.buffer[start : start + length])
                del self.buffer[: start + length]
                return body
            await self._fill(what)

    async def read_header(self) -> None:
        """Read the multistream header, failing as soon as the bytes cannot be it."""
        expected = _HEADER
        while len(self.buffer) < len(expected):
            if not expected.startswith(self.buffer):
                break
            await self._fill("the multistream header")
        if self.buffer[: len(expected)] != expected:
            raise ProtocolNegotiationError(
                f"remote does not speak {MULTISTREAM_PROTOCOL}: it sent "
                f"{bytes(self.buffer[:64])!r} instead of the header"
            )
        del self.buffer[: len(expected)]

    async def read_message(self, what: str) -> str:
        body = await self.read_raw(what)
        if not body.endswith(b"\n"):
            raise ProtocolNegotiationError(
                f"multistream message without trailing newline while waiting for {what}: "
                f"{body[:64]!r}"
            )
        try:
            return body[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolNegotiationError(
                f"multistream message is not UTF-8 while waiting for {what}: {body[:64]!r}"
            ) from None

    def leftover(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


def _wrap(stream: S, leftover: bytes) -> S | PrefixedStream:
    return PrefixedStream(stream, leftover) if leftover else stream


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else timeout


async def negotiate_outbound(
    stream: S,
    protocols: Sequence[str],
    timeout: float | None = 10.0,  # noqa: ASYNC109 - part of the documented API
    *,
    lazy: bool = False,
) -> tuple[str, S | PrefixedStream | LazyOutboundStream]:
    """Dialer side: propose ``protocols`` in order; return the accepted one and the stream.

    The returned stream replays any bytes the remote sent right after its answer. With
    ``lazy=True`` (only for a single protocol) nothing is sent or awaited yet: a
    ``LazyOutboundStream`` is returned that sends the negotiation together with the first
    payload and checks the remote's answer on the first read.
    """
    if isinstance(protocols, str):
        protocols = [protocols]
    if not protocols:
        raise ValueError("no protocols to propose")
    if len(protocols) > MAX_ATTEMPTS:
        raise ValueError(f"at most {MAX_ATTEMPTS} protocols may be proposed")
    for protocol in protocols:
        _check_protocol_name(protocol)
    if lazy:
        if len(protocols) != 1:
            raise ValueError("lazy negotiation needs exactly one protocol")
        return protocols[0], LazyOutboundStream(stream, protocols[0], timeout=timeout)

    with trio.move_on_after(_deadline(timeout)) as scope:
        reader = _Reader(stream)
        # Header and first proposal in one write: the listener never needs our header first.
        await stream.send_all(encode_message(MULTISTREAM_PROTOCOL) + encode_message(protocols[0]))
        await reader.read_header()
        for i, protocol in enumerate(protocols):
            if i > 0:
                await stream.send_all(encode_message(protocol))
            answer = await reader.read_message(f"the answer to {protocol!r}")
            if answer == protocol:
                return protocol, _wrap(stream, reader.leftover())
            if answer != NA:
                raise ProtocolNegotiationError(
                    f"remote answered {answer[:64]!r} to our proposal {protocol!r} "
                    "(expected the echo or 'na')"
                )
            logger.debug("remote does not support %s", protocol)
        raise ProtocolNegotiationError(f"remote supports none of the protocols {list(protocols)}")
    assert scope.cancelled_caught
    raise P2PTimeoutError(f"multistream-select did not finish within {timeout} s")


async def negotiate_inbound(
    stream: S,
    supported: Supported,
    timeout: float | None = 10.0,  # noqa: ASYNC109 - part of the documented API
) -> tuple[str, S | PrefixedStream]:
    """Listener side: answer proposals until one is ``supported``; return it and the stream.

    ``supported`` is a collection of protocol ids or a predicate (then ``ls`` lists nothing).
    """
    accepts: Callable[[str], bool]
    if isinstance(supported, str):
        supported = {supported}  # a bare string would otherwise accept its substrings
    if callable(supported):
        accepts = supported
        listing: list[str] = []
    else:
        accepts = supported.__contains__
        listing = sorted(supported)

    with trio.move_on_after(_deadline(timeout)) as scope:
        reader = _Reader(stream)
        await reader.read_header()
        # Answer the header only after reading it: this works with dialers that wait for our
        # header before proposing, and never needs both sides to write at once.
        await stream.send_all(encode_message(MULTISTREAM_PROTOCOL))
        for _ in range(MAX_ATTEMPTS):
            command = await reader.read_message("a protocol proposal")
            if command == LS:
                await stream.send_all(_encode_ls(listing))
            elif command and accepts(command):
                await stream.send_all(encode_message(command))
                return command, _wrap(stream, reader.leftover())
            else:
                logger.debug("refusing unsupported protocol %r", command[:64])
                await stream.send_all(encode_message(NA))
        raise ProtocolNegotiationError(
            f"remote made {MAX_ATTEMPTS} proposals without a supported protocol"
        )
    assert scope.cancelled_caught
    raise P2PTimeoutError(f"multistream-select did not finish within {timeout} s")


def _encode_ls(protocols: list[str]) -> bytes:
    """``ls`` answer: one message whose body lists each protocol as its own message."""
    body = bytearray()
    for protocol in protocols:
        item = encode_message(protocol)
        if len(body) + len(item) + 1 > MAX_LS_RESPONSE:
            break
        body += item
    body += b"\n"
    return encode_uvarint(len(body)) + bytes(body)


async def list_protocols(
    stream: trio.abc.Stream,
    timeout: float | None = 10.0,  # noqa: ASYNC109 - part of the documented API
) -> list[str]:
    """Ask the listener for its protocols with ``ls`` (the stream is unusable afterwards)."""
    with trio.move_on_after(_deadline(timeout)) as scope:
        reader = _Reader(stream)
        await stream.send_all(encode_message(MULTISTREAM_PROTOCOL) + encode_message(LS))
        await reader.read_header()
        body = await reader.read_raw("the ls answer", limit=MAX_LS_RESPONSE)
        inner = _Reader(None, body)
        protocols = []
        while inner.buffer and bytes(inner.buffer) != b"\n":
            protocols.append(await inner.read_message("an ls entry"))
        return protocols
    assert scope.cancelled_caught
    raise P2PTimeoutError(f"multistream ls did not finish within {timeout} s")


class PrefixedStream(trio.abc.HalfCloseableStream):
    """A stream that first returns ``prefix`` (bytes already read), then reads ``inner``."""

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self.inner = inner
        self._prefix = memoryview(bytes(prefix))

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:  # type: ignore[override]  # trio-typing's stubs say bytes; trio returns bytearray too
        if self._prefix:
            n = (
                len(self._prefix)
                if max_bytes is None
                else max(1, min(max_bytes, len(self._prefix)))
            )
            out = bytes(self._prefix[:n])
            self._prefix = self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return out
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)  # type: ignore[arg-type]  # trio-typing's stubs omit bytearray, trio takes it

    async def receive_exactly_into(self, buffer: memoryview) -> int:
        """The prefix first, then the inner stream's fast path (or plain reads); returns how
        many bytes arrived (fewer than ``len(buffer)`` only at EOF)."""
        view = memoryview(buffer).cast("B")
        n = len(view)
        have = min(len(self._prefix), n)
        if have:
            view[:have] = self._prefix[:have]
            self._prefix = self._prefix[have:]
        if have == n:
            await trio.lowlevel.checkpoint()
            return n
        return have + await fill_by_reads(self.inner, view[have:])

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        send_eof = getattr(self.inner, "send_eof", None)
        if send_eof is None:
            raise TypeError(f"{type(self.inner).__name__} does not support half-close")
        await send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # passthrough of e.g. remote_peer, socket
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class LazyOutboundStream(trio.abc.HalfCloseableStream):
    """Dialer stream whose multistream negotiation rides along with the first payload.

    The first ``send_all``/``send_eof`` prepends header + proposal; the first
    ``receive_some`` (with ``timeout`` for the answer) verifies the remote's header and echo
    and raises ProtocolNegotiationError if it refused. ``negotiated`` tells whether the echo
    has been checked yet.
    """

    def __init__(self, inner: trio.abc.Stream, protocol: str, timeout: float | None = 10.0):
        _check_protocol_name(protocol)
        self.inner = inner
        self.protocol = protocol
        self._timeout = timeout
        self._request: bytes | None = encode_message(MULTISTREAM_PROTOCOL) + encode_message(
            protocol
        )
        self._verified = False
        self._failure: ProtocolNegotiationError | None = None
        self._prefix = memoryview(b"")

    @property
    def negotiated(self) -> bool:
        return self._verified

    async def _flush_request(self, data: bytes | bytearray | memoryview = b"") -> None:
        request, self._request = self._request, None
        if request is None:
            if data:
                await self.inner.send_all(data)  # type: ignore[arg-type]  # trio-typing's stubs omit bytearray, trio takes it
            return
        await self.inner.send_all(request + bytes(data) if data else request)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._flush_request(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._flush_request()
        send_eof = getattr(self.inner, "send_eof", None)
        if send_eof is None:
            raise TypeError(f"{type(self.inner).__name__} does not support half-close")
        await send_eof()

    async def ensure_negotiated(self) -> None:
        """Send the proposal if not yet sent and wait for the remote's acceptance."""
        if self._verified:
            return
        if self._failure is not None:
            raise self._failure
        if self._request is not None:
            await self._flush_request()
        with trio.move_on_after(_deadline(self._timeout)) as scope:
            reader = _Reader(self.inner)
            try:
                await reader.read_header()
                answer = await reader.read_message(f"the answer to {self.protocol!r}")
                if answer != self.protocol:
                    raise ProtocolNegotiationError(
                        f"remote refused protocol {self.protocol!r} (answered {answer[:64]!r})"
                    )
            except ProtocolNegotiationError as e:
                self._failure = e
                raise
            self._verified = True
            self._prefix = memoryview(reader.leftover())
            return
        assert scope.cancelled_caught
        raise P2PTimeoutError(
            f"no multistream answer for {self.protocol!r} within {self._timeout} s"
        )

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:  # type: ignore[override]  # trio-typing's stubs say bytes; trio returns bytearray too
        if not self._verified:
            await self.ensure_negotiated()
        if self._prefix:
            n = (
                len(self._prefix)
                if max_bytes is None
                else max(1, min(max_bytes, len(self._prefix)))
            )
            out = bytes(self._prefix[:n])
            self._prefix = self._prefix[n:]
            return out
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
