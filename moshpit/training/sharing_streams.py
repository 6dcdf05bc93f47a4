"""The streams state sharing runs on: one request server per Host, and a requester's stream
kept open for request after request.

A stream rather than unary RPC, both ways: a donor holds an upload slot until its answer is
sent, and a joiner's worker keeps one stream per peer, so the yamux window grows instead of
starting at 256 KiB for every batch. What the messages mean is ``sharing_protocol``'s
business; here they are only moved and timed.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import trio

from moshpit.netutil import aclose_quietly, is_network_error, short
from moshpit.training.sharing_protocol import (
    KEEP_STREAM_SECONDS,
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    STATE_PROTOCOL,
    BadRequest,
    error_reply,
    request_prefix,
)

if TYPE_CHECKING:
    from dht.p2p.host import Host, P2PStream
    from dht.p2p.messages import MessageReader

__all__ = [
    "Channel",
    "IdleTimeout",
    "PrefixHandler",
    "StateService",
    "service_for",
]

logger = logging.getLogger("moshpit.training.sharing")  # one logger for state sharing


class PrefixHandler(Protocol):
    """Who answers the requests of one prefix (a ``StateSharing``)."""

    stats: dict[str, int]

    async def _serve(self, stream: P2PStream, request: dict[str, Any]) -> None:
        """Answer one request; BadRequest if it is malformed."""


class StateService:
    """Reads the requests of each incoming stream and hands them to the handler of their
    prefix, one after the other on that stream."""

    def __init__(self, request_timeout: float) -> None:
        self.handlers: dict[str, PrefixHandler] = {}
        self.request_timeout = request_timeout

    async def handle_stream(self, stream: P2PStream) -> None:
        """Answer requests one after the other until the requester closes the stream or sends
        nothing for ``request_timeout`` (the first request) or ``KEEP_STREAM_SECONDS``."""
        from dht.p2p.errors import StreamClosedError, StreamResetError

        wait = self.request_timeout  # for the first request; then as long as a requester idles
        try:
            while True:
                request = None
                with trio.move_on_after(wait):
                    try:
                        request = await stream.receive_msg(max_size=MAX_REQUEST_BYTES)
                    except StreamResetError:
                        raise
                    except StreamClosedError:
                        return  # the requester is done
                if request is None:
                    logger.debug("state stream from %s: no request in time", stream.remote_peer)
                    return
                try:
                    handler = self._route(request)
                    if wait != KEEP_STREAM_SECONDS:
                        handler.stats["streams"] += 1
                    wait = KEEP_STREAM_SECONDS
                    await handler._serve(stream, request)
                except BadRequest as e:
                    wait = KEEP_STREAM_SECONDS
                    logger.info("bad state request from %s: %s", short(stream.remote_peer), e)
                    with trio.move_on_after(self.request_timeout):
                        await stream.send_msg(error_reply(str(e)))
        except Exception as e:
            if not is_network_error(e):
                raise
            logger.debug("state stream from %s failed: %r", short(stream.remote_peer), e)
        finally:
            await aclose_quietly(stream)

    def _route(self, request: Any) -> PrefixHandler:
        handler = self.handlers.get(request_prefix(request))
        if handler is None:
            raise BadRequest("no state is served under this prefix here")
        return handler


_services: weakref.WeakKeyDictionary[Host, StateService] = weakref.WeakKeyDictionary()


def service_for(host: Host, request_timeout: float) -> StateService:
    """The request server of ``host``, registered for :data:`STATE_PROTOCOL` on first use."""
    service = _services.get(host)
    if service is None:
        service = _services[host] = StateService(request_timeout)
        host.set_stream_handler(STATE_PROTOCOL, service.handle_stream)
    return service


class IdleTimeout(trio.abc.ReceiveStream):
    """Receives from ``stream``, failing with P2PTimeoutError when no byte comes for
    ``idle`` seconds once the answer started (before that, it may queue behind our other
    answers from the same peer; the caller's overall deadline bounds that wait)."""

    def __init__(self, stream: P2PStream, idle: float) -> None:
        self.stream = stream
        self.idle = idle
        self.started = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        from dht.p2p.errors import P2PTimeoutError

        if not self.started:
            data = await self.stream.receive_some(max_bytes)
            self.started = True
            return data
        with trio.move_on_after(self.idle):
            return await self.stream.receive_some(max_bytes)
        raise P2PTimeoutError(f"no data for {self.idle:.1f}s from {short(self.stream.remote_peer)}")

    async def aclose(self) -> None:
        await self.stream.aclose()


class Channel:
    """A requester's stream to one peer, reused for request after request."""

    def __init__(self) -> None:
        self.stream: P2PStream | None = None
        self.idle: IdleTimeout | None = None
        self.reader: MessageReader | None = None
        self.last_used = 0.0

    def open(self, stream: P2PStream, idle: float) -> None:
        from dht.p2p.messages import MessageReader

        self.stream = stream
        self.idle = IdleTimeout(stream, idle)
        self.reader = MessageReader(self.idle)

    async def exchange(self, request: dict[str, Any], last: bool) -> Any:
        """Send ``request`` (then end our side if ``last``) and read its answer."""
        assert self.stream is not None and self.idle is not None and self.reader is not None
        await self.stream.send_msg(request)
        if last:
            await self.stream.send_eof()
        self.idle.started = False
        return await self.reader.receive_msg(MAX_RESPONSE_BYTES)

    def close(self) -> None:
        """Drop the stream at once (after a failure: whatever it still carries is lost)."""
        if self.stream is not None:
            self.stream.reset()
        self.stream = None

    async def aclose(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await stream.aclose()
