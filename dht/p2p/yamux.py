"""yamux stream multiplexer (hashicorp spec, as used by libp2p as ``/yamux/1.0.0``).

One :class:`YamuxSession` runs over any reliable byte stream (a Noise session in production,
an in-memory pipe in tests) and carries many :class:`YamuxStream` s. Design points:

* A single writer task owns the underlying stream. Callers only *enqueue* whole frames, so
  cancelling a caller can never leave half a frame on the wire, and queued small frames are
  coalesced into one write.
* Every stream has a receive window (256 KiB initially, as the spec requires). The buffer of
  a stream never exceeds the window we granted, so a reader that never reads costs at most
  one window of memory; the sender simply blocks. A session-wide cap bounds the sum.
* Window auto-tuning (as go-yamux does): when a reader consumed a whole window in less than
  four round trips, the window is doubled (up to ``max_stream_window``) so a single bulk
  stream is not capped at 256 KiB per RTT.
* Anything the remote gets wrong (bad version/type, unknown flags, data beyond the window,
  absurd lengths, duplicate stream ids) is a protocol violation: the session is closed with
  a GoAway and a log line naming the reason. Lengths are checked before anything is
  allocated.

One file of about a thousand lines: :class:`YamuxSession` and :class:`YamuxStream` are two
halves of one state machine (the writer queue, the windows, the receive loop handing
borrowed buffers straight to a stream's reader) and call into each other's private state;
split apart, each would reach into the other's internals.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from .errors import (
    P2PTimeoutError,
    ProtocolViolationError,
    ResourceLimitError,
    StreamClosedError,
    StreamResetError,
)
from .messages import own_method

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/yamux/1.0.0"

VERSION = 0
TYPE_DATA = 0
TYPE_WINDOW_UPDATE = 1
TYPE_PING = 2
TYPE_GO_AWAY = 3

FLAG_SYN = 0x1
FLAG_ACK = 0x2
FLAG_FIN = 0x4
FLAG_RST = 0x8
_KNOWN_FLAGS = FLAG_SYN | FLAG_ACK | FLAG_FIN | FLAG_RST

GO_AWAY_NORMAL = 0
GO_AWAY_PROTOCOL_ERROR = 1
GO_AWAY_INTERNAL_ERROR = 2

HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size  # 12
INITIAL_WINDOW = 256 * 1024
DEFAULT_MAX_STREAM_WINDOW = 16 * 1024 * 1024
# go-yamux doubles a stream's window when the reader consumed it within 4 RTTs. In Python the
# time to process a window is much longer than a loopback RTT, so bulk streams would never
# qualify; the epoch therefore has this floor (a stream draining >= 6.5 MB/s grows).
WINDOW_TUNING_MIN_EPOCH = 0.02
MAX_FRAME_PAYLOAD = 256 * 1024  # we never send a Data frame larger than this
_RECV_CHUNK = 256 * 1024
_OUT_LIMIT = 1024 * 1024  # queued outgoing bytes before data senders wait
_OUT_HARD_LIMIT = (
    4 * _OUT_LIMIT
)  # control frames (pongs, RSTs, ...) beyond this: remote not reading
# a keepalive ping may go unanswered while at least this much arrives meanwhile, or while the
# remote grants window for data we sent (it reads us): its pong is queued behind data on a
# full link. Pings and small frames alone do not count.
KEEPALIVE_BUSY_BYTES = 32 * 1024
_COALESCE_LIMIT = 64 * 1024  # senders yield to the writer once this much is queued
# A stream that has sent no more than this is light (a request, a reply, a handshake, the
# first message of a transfer): its frames are written before those of heavier streams. On a
# 1 Mbit/s uplink a 100-byte request queued behind one bulk stream's data took 4.4 s to be
# answered, behind three 12 s, past every RPC timeout of the DHT.
LIGHT_STREAM_BYTES = 64 * 1024
# The writer hands the layer below batches worth about this long at the rate it drained the
# last ones (between _MIN_BATCH and the queue's size): a light frame waits at most one batch.
_BATCH_SECONDS = 0.05
_MIN_BATCH = 16 * 1024
_SINK_YIELDS = 3  # checkpoints the reader gives a woken stream reader (see _let_reader_post_sink)


def pack_header(ftype: int, flags: int, stream_id: int, length: int) -> bytes:
    return HEADER.pack(VERSION, ftype, flags, stream_id, length)


class _Violation(ProtocolViolationError):
    """Internal: the remote broke the protocol; the message is the reason."""


class YamuxStream(trio.abc.HalfCloseableStream):
    """One logical stream. Implements trio's HalfCloseableStream; ``reset()`` aborts it."""

    def __init__(self, session: YamuxSession, stream_id: int, max_window: int) -> None:
        self.session = session
        self.stream_id = stream_id
        # received, not yet read; a memoryview only for the unread tail of a chunk that a
        # receive_exactly_into() took the front of (no copy of the rest)
        self._chunks: deque[bytes | bytearray | memoryview] = deque()
        self._buffered = 0
        # receive_exactly_into(): the caller's buffer, filled by the session's reader directly
        # from the layer below (one copy, none through ``_chunks``), and how much of it is full
        self._sink: memoryview | None = None
        self._sink_fill = 0
        # received bytes that waited in ``_chunks`` (copied there, then again to the reader)
        # instead of going straight into a receive_exactly_into() buffer: for tests, profiling
        self.bytes_through_buffer = 0
        # How many bytes the remote may still send before we grant more.
        self._recv_remaining = INITIAL_WINDOW
        self._recv_window = INITIAL_WINDOW  # the window size we aim to keep granted
        self._target_window = max_window  # auto-tuning grows the window up to this
        self._consumed_since_update = 0
        self._epoch_start = trio.current_time()
        self._send_window = INITIAL_WINDOW
        self._remote_eof = False
        self._local_eof = False
        self._read_closed = False
        self._reset = False
        self._reset_reason = ""
        self._recv_lot = trio.lowlevel.ParkingLot()
        self._send_lot = trio.lowlevel.ParkingLot()
        self._reading = False
        self._sending = False
        self._borrowed_pending = 0  # pieces of the caller's buffer still queued, not yet sent
        self._ack_pending = False  # inbound stream whose ACK rides on our first frame
        self._sent_total = 0  # payload bytes queued so far (LIGHT_STREAM_BYTES)

    @property
    def heavy(self) -> bool:
        """Past LIGHT_STREAM_BYTES: its frames queue after light streams' (for good, since
        ``_sent_total`` only grows, so they stay in order)."""
        return self._sent_total > LIGHT_STREAM_BYTES

    # -- introspection -------------------------------------------------------------------
    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet read by the application."""
        return self._buffered

    @property
    def receive_window(self) -> int:
        return self._recv_window

    @property
    def is_reset(self) -> bool:
        return self._reset

    def __repr__(self) -> str:
        return f"<YamuxStream {self.stream_id} on {self.session.name}>"

    def _flags(self, flags: int) -> int:
        """Flags for the next frame of this stream, with a pending ACK folded in."""
        if self._ack_pending:
            self._ack_pending = False
            return flags | FLAG_ACK
        return flags

    # -- receiving -----------------------------------------------------------------------
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:  # type: ignore[override]  # trio-typing's stubs say bytes; trio returns bytearray too
        if self._reading:
            raise trio.BusyResourceError("another task is already reading from this stream")
        self._reading = True
        try:
            while not self._chunks:
                self._raise_if_unreadable()
                if self._remote_eof:
                    await trio.lowlevel.checkpoint()
                    return b""
                if self._ack_pending and not self.session.closed:
                    # about to wait: acknowledge now rather than with a later frame
                    self.session._enqueue_control(
                        TYPE_WINDOW_UPDATE, self._flags(0), self.stream_id, 0
                    )
                await self._recv_lot.park()
            await trio.lowlevel.checkpoint_if_cancelled()
            chunk = self._chunks.popleft()
            if max_bytes is not None and max_bytes < len(chunk):
                if max_bytes < 1:
                    self._chunks.appendleft(chunk)
                    raise ValueError("max_bytes must be >= 1")
                self._chunks.appendleft(chunk[max_bytes:])
                chunk = chunk[:max_bytes]
            if isinstance(chunk, memoryview):
                chunk = bytes(chunk)
            self._unbuffer(len(chunk))
            return chunk
        finally:
            self._reading = False

    async def receive_exactly_into(self, buffer: memoryview) -> int:
        """Fill ``buffer`` with the next ``len(buffer)`` bytes of the stream; return how many
        arrived (fewer only at EOF).

        For bulk payloads whose size the caller knows (a tensor chunk after its header):
        what is already buffered is copied in, and the rest goes from the connection's
        decrypted receive buffer straight into ``buffer``, without an intermediate ``bytes``
        per frame. The task sleeps until the buffer is full, not once per frame. Cancelled
        midway, the bytes already written are put back in front of the stream (nothing is
        lost; a later read returns them).
        """
        if self._reading:
            raise trio.BusyResourceError("another task is already reading from this stream")
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise TypeError("receive_exactly_into needs a writable buffer")
        n = len(view)
        self._reading = True
        try:
            filled = 0
            while filled < n and self._chunks:
                chunk = self._chunks.popleft()
                take = min(len(chunk), n - filled)
                view[filled : filled + take] = memoryview(chunk)[:take]
                if take < len(chunk):
                    self._chunks.appendleft(memoryview(chunk)[take:])
                filled += take
                self._unbuffer(take)
            if filled == n:
                await trio.lowlevel.checkpoint()
                return n
            self._raise_if_unreadable()
            if self._remote_eof:
                await trio.lowlevel.checkpoint()
                return filled
            if self._ack_pending and not self.session.closed:
                self.session._enqueue_control(TYPE_WINDOW_UPDATE, self._flags(0), self.stream_id, 0)
            self._sink, self._sink_fill = view, filled
            try:
                while self._sink_fill < n and not (self._remote_eof or self._reset):
                    if self._read_closed:
                        break
                    await self._recv_lot.park()
            except BaseException:
                self._return_sink()  # cancelled: keep what arrived readable
                raise
            got = self._sink_fill
            self._sink = None
            self._sink_fill = 0
            self._raise_if_unreadable()
            return got
        finally:
            self._reading = False

    def _return_sink(self) -> None:
        """Put what a cancelled receive_exactly_into() got back in front of the stream."""
        sink, fill = self._sink, self._sink_fill
        self._sink = None
        self._sink_fill = 0
        if sink is not None and fill and not (self._reset or self._read_closed):
            data = bytes(sink[:fill])
            self._chunks.appendleft(data)
            self._buffered += fill
            self.session._buffered += fill

    def _unbuffer(self, n: int) -> None:
        self._buffered -= n
        self.session._buffered -= n
        self._consumed(n)

    def _raise_if_unreadable(self) -> None:
        if self._reset:
            raise StreamResetError(f"yamux stream {self.stream_id} was reset: {self._reset_reason}")
        if self._read_closed:
            raise trio.ClosedResourceError("stream was closed locally")

    def _consumed(self, n: int) -> None:
        """Return window credit after the application read ``n`` bytes, tuning the window."""
        self._consumed_since_update += n
        if self._remote_eof or self._reset:
            return
        # A quarter, not half (go-yamux): frames of the layer below (Noise: 64 KiB) make
        # consumption lumpy, and at half the sender could run dry before the update lands.
        if self._consumed_since_update < self._recv_window // 4:
            return
        delta = self._consumed_since_update
        now = trio.current_time()
        rtt = self.session.rtt
        if (
            self._recv_window < self._target_window
            and rtt is not None
            and now - self._epoch_start < max(4 * rtt, WINDOW_TUNING_MIN_EPOCH)
        ):
            grown = min(self._recv_window * 2, self._target_window)
            if self.session._may_grow(grown - self._recv_window):
                delta += grown - self._recv_window
                self._recv_window = grown
        self._epoch_start = now
        self._consumed_since_update = 0
        self._recv_remaining += delta
        self.session._enqueue_control(TYPE_WINDOW_UPDATE, self._flags(0), self.stream_id, delta)

    # -- sending -------------------------------------------------------------------------
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            # bytes are immutable: frames reference them. A mutable buffer (a tensor's memory)
            # is not copied either: its frames are queued as views, and send_all returns only
            # once the writer has sent them, so the caller may reuse the buffer afterwards.
            # Cancelled before that, the views still queued are replaced by copies.
            immutable = isinstance(data, bytes)
            view = memoryview(data).cast("B")
            total = len(view)
            offset = 0
            if total == 0:
                self._raise_if_unwritable()
                await trio.lowlevel.checkpoint()
                return
            owner = None if immutable else self
            try:
                while offset < total:
                    self._raise_if_unwritable()
                    if self._send_window <= 0:
                        await self._send_lot.park()
                        continue
                    n = min(total - offset, self._send_window, MAX_FRAME_PAYLOAD)
                    await self.session._wait_send_space(self._sent_total + n <= LIGHT_STREAM_BYTES)
                    self._raise_if_unwritable()
                    if self._send_window <= 0:
                        continue
                    n = min(n, self._send_window)
                    if isinstance(data, bytes) and n == total:  # (``immutable``, for mypy)
                        piece: bytes | memoryview = data
                    else:
                        piece = view[offset : offset + n]
                    self._send_window -= n
                    self._sent_total += n
                    self.session._enqueue_data(
                        self.stream_id, piece, self._flags(0), owner, heavy=self.heavy
                    )
                    offset += n
                await self.session._after_enqueue()
                while self._borrowed_pending:
                    self._raise_if_unwritable()
                    await self._send_lot.park()
            except BaseException:
                if self._borrowed_pending:
                    self.session._copy_borrowed(self)
                raise
        finally:
            self._sending = False

    def _raise_if_unwritable(self) -> None:
        if self._reset:
            raise StreamResetError(f"yamux stream {self.stream_id} was reset: {self._reset_reason}")
        if self._local_eof:
            raise trio.ClosedResourceError("send_eof() or aclose() was already called")
        if self.session.closed:
            raise StreamResetError(f"connection closed: {self.session.close_reason}")

    async def wait_send_all_might_not_block(self) -> None:
        while self._send_window <= 0 and not self._reset and not self._local_eof:
            await self._send_lot.park()
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        if self._local_eof or self._reset:
            await trio.lowlevel.checkpoint()
            return
        self._local_eof = True
        if not self.session.closed:
            self.session._enqueue_control(
                TYPE_WINDOW_UPDATE, self._flags(FLAG_FIN), self.stream_id, 0
            )
        self.session._maybe_forget(self)
        await self.session._after_enqueue()

    async def aclose(self) -> None:
        """Half-close our side (FIN) and stop reading. Unread incoming data is discarded."""
        self._close_read_side()
        if not self._local_eof and not self._reset:
            self._local_eof = True
            if not self.session.closed:
                self.session._enqueue_control(
                    TYPE_WINDOW_UPDATE, self._flags(FLAG_FIN), self.stream_id, 0
                )
        self._send_lot.unpark_all()
        self.session._maybe_forget(self)
        await self.session._after_enqueue()

    def _close_read_side(self) -> None:
        if self._read_closed:
            return
        self._read_closed = True
        dropped = self._buffered
        self._chunks.clear()
        self._buffered = 0
        self.session._buffered -= dropped
        if dropped and not self._remote_eof and not self._reset and not self.session.closed:
            # Give the credit back so a remote still writing is not stuck; its bytes are dropped.
            self._recv_remaining += dropped
            self.session._enqueue_control(
                TYPE_WINDOW_UPDATE, self._flags(0), self.stream_id, dropped
            )
        self._recv_lot.unpark_all()

    def reset(self) -> None:
        """Abort the stream in both directions (sends RST)."""
        if self._reset:
            return
        if not self.session.closed and not (self._local_eof and self._remote_eof):
            self.session._enqueue_control(
                TYPE_WINDOW_UPDATE, self._flags(FLAG_RST), self.stream_id, 0
            )
        self._mark_reset("reset locally")

    def _mark_reset(self, reason: str) -> None:
        if self._reset:
            return
        self._reset = True
        self._reset_reason = reason
        if not self.session.closed:
            self.session._drop_queued(self.stream_id)
        self.session._buffered -= self._buffered
        self._buffered = 0
        self._chunks.clear()
        self._recv_lot.unpark_all()
        self._send_lot.unpark_all()
        self.session._forget(self)

    # -- called by the session's reader --------------------------------------------------
    def _deliver(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer a payload; a memoryview (borrowed from the layer below) is copied here."""
        if self._read_closed or self._reset:
            # Nobody will read it: return the credit immediately.
            if not self._reset and not self._remote_eof:
                self._recv_remaining += len(data)
                self.session._enqueue_control(
                    TYPE_WINDOW_UPDATE, self._flags(0), self.stream_id, len(data)
                )
            return
        sink = self._sink
        if sink is not None and self._sink_fill < len(sink):
            # a reader waits in receive_exactly_into (nothing else is buffered before this)
            fill = self._sink_fill
            take = min(len(sink) - fill, len(data))
            sink[fill : fill + take] = data[:take] if take < len(data) else data
            self._sink_fill = fill + take
            self._consumed(take)  # window credit at once: the bytes are where they belong
            if self._sink_fill == len(sink):
                self._recv_lot.unpark_all()  # full; the rest of ``data`` is buffered below
            if take == len(data):
                return
            data = data[take:]
        self._chunks.append(bytes(data) if isinstance(data, memoryview) else data)
        self.bytes_through_buffer += len(data)
        self._buffered += len(data)
        self.session._buffered += len(data)
        self._recv_lot.unpark_all()

    def _reader_may_post_sink(self) -> bool:
        """A reader was woken by buffered data and has not run yet (it may post a sink)."""
        return self._reading and self._sink is None and bool(self._chunks) and not self._reset

    def _on_remote_fin(self) -> None:
        self._remote_eof = True
        self._recv_lot.unpark_all()
        self.session._maybe_forget(self)

    def _on_window_update(self, delta: int) -> None:
        self._send_window += delta
        if self._send_window > 0:
            self._send_lot.unpark_all()


class YamuxSession:
    """A yamux connection. Run it with ``async with session:`` (or ``await session.run()``).

    ``is_client`` decides stream id parity (odd for the dialer). Inbound streams are
    delivered through :meth:`accept_stream`; at most ``accept_backlog`` (default: all
    ``max_streams``) may wait there, extra ones are refused with RST, as are streams beyond
    ``max_streams``.
    """

    def __init__(
        self,
        conn: trio.abc.Stream,
        *,
        is_client: bool,
        stream_window: int = INITIAL_WINDOW,
        max_stream_window: int = DEFAULT_MAX_STREAM_WINDOW,
        max_streams: int = 1024,
        max_buffered: int = 64 * 1024 * 1024,
        accept_backlog: int | None = None,
        keepalive_interval: float | None = None,
        keepalive_timeout: float = 10.0,
        name: str = "",
        on_close: Callable[[YamuxSession], Any] | None = None,
    ) -> None:
        if stream_window < INITIAL_WINDOW:
            raise ValueError("yamux stream_window must be >= 256 KiB (the spec's initial window)")
        if max_stream_window < stream_window or max_stream_window >= 2**31:
            raise ValueError("max_stream_window must be >= stream_window and < 2 GiB")
        self.conn = conn
        self.is_client = is_client
        self.name = name or ("client" if is_client else "server")
        self.stream_window = stream_window
        self.max_stream_window = max_stream_window
        self.max_streams = max_streams
        self.max_buffered = max_buffered
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.rtt: float | None = None
        self.closed = False
        self.close_reason = ""
        self.remote_go_away = False
        self._on_close = on_close
        self._next_id = 1 if is_client else 2
        self._streams: dict[int, YamuxStream] = {}
        self._buffered = 0
        self._granted_extra = 0  # window growth beyond the initial window, summed over streams
        self._accept_send, self._accept_recv = trio.open_memory_channel[YamuxStream](
            max_streams if accept_backlog is None else accept_backlog
        )
        # outgoing frame queues, consumed by the writer task: light streams' frames first
        # (LIGHT_STREAM_BYTES), then the others'. A stream's frames go to one queue until it
        # turns heavy, then to the other for good, so they stay in order: the first queue is
        # always emptied before the writer takes from the second.
        self._first: deque[bytes | memoryview] = deque()
        self._first_bytes = 0
        self._out: deque[bytes | memoryview] = deque()
        # when the reader last got bytes (see last_received), and bytes moved each way (see
        # bytes_received / bytes_sent)
        self._last_read = trio.current_time()
        self._window_grants = 0  # window updates for our data: the remote's reader is alive
        self._bytes_read = 0
        self._bytes_written = 0
        self._batch_limit = _OUT_LIMIT  # see _BATCH_SECONDS
        # Window updates, pings/pongs, ACKs and RSTs may overtake queued data (a window update
        # stuck behind megabytes of our own data would stall the remote's sender). SYN and FIN
        # must stay ordered with their stream's data, so they use the queue its data uses.
        self._urgent: deque[bytes] = deque()
        self._out_bytes = 0
        # queued pieces that are views of a sender's buffer (id -> the sending stream)
        self._borrowed: dict[int, YamuxStream] = {}
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._space_lot = trio.lowlevel.ParkingLot()
        self._pings: dict[int, trio.Event] = {}
        self._ping_counter = int.from_bytes(os.urandom(2), "big")
        self._done = trio.Event()
        self._cancel_scope: trio.CancelScope | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the session until it closes (remote EOF, violation, or :meth:`aclose`)."""
        try:
            with trio.CancelScope() as scope:
                self._cancel_scope = scope
                if self.closed:
                    scope.cancel()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._measure_rtt)
                    if self.keepalive_interval:
                        nursery.start_soon(self._keepalive)
        finally:
            self._shutdown("session ended")
            with trio.CancelScope(shield=True):
                try:
                    with trio.move_on_after(1.0):
                        await self.conn.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                except Exception as e:  # noqa: BLE001 - closing must never raise here
                    logger.debug("yamux %s: error closing transport: %r", self.name, e)
            self._done.set()

    async def wait_closed(self) -> None:
        await self._done.wait()

    async def aclose(self, code: int = GO_AWAY_NORMAL) -> None:
        """Send GoAway (best effort, briefly) and close the session and all its streams."""
        if self._cancel_scope is None:
            # run() never started: nobody else will close the transport.
            self._shutdown("closed locally")
            with trio.CancelScope(shield=True):
                try:
                    await self.conn.aclose()
                except Exception:  # noqa: BLE001 - best effort
                    pass
            return
        if not self.closed:
            self._enqueue_control(TYPE_GO_AWAY, 0, 0, code, force=True)
            with trio.move_on_after(0.5) as flush_scope:
                flush_scope.shield = True
                while (self._first or self._out or self._urgent) and not self.closed:
                    await self._space_lot.park()
            self._shutdown("closed locally")
        with trio.CancelScope(shield=True):
            await self._done.wait()

    def _shutdown(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        for stream in list(self._streams.values()):
            stream._mark_reset(f"connection closed ({reason})")
        self._streams.clear()
        self._accept_send.close()
        self._writer_lot.unpark_all()
        self._space_lot.unpark_all()
        for owner in set(self._borrowed.values()):  # senders waiting for their views to go
            owner._send_lot.unpark_all()
        for ev in self._pings.values():
            ev.set()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()
        if self._on_close is not None:
            try:
                self._on_close(self)
            except Exception:  # noqa: BLE001 - observers must not break teardown
                logger.exception("yamux %s: on_close callback failed", self.name)

    def _fail(self, reason: str, code: int = GO_AWAY_PROTOCOL_ERROR) -> None:
        logger.warning("yamux %s: protocol violation, closing connection: %s", self.name, reason)
        try:
            self._enqueue_control(TYPE_GO_AWAY, 0, 0, code, force=True)
        except ResourceLimitError:
            pass
        self._shutdown(f"protocol violation: {reason}")

    # -- public API ----------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def set_max_send_rate(self, rate: float | None) -> bool:
        """Cap this connection's send rate, every stream together (False where the secure
        channel or transport below cannot)."""
        setter = getattr(self.conn, "set_max_send_rate", None)
        return bool(setter(rate)) if setter is not None else False

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not yet read by the application, summed over streams."""
        return self._buffered

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting for the writer task (bounded: data senders wait above 1 MiB)."""
        return self._out_bytes

    @property
    def last_received(self) -> float:
        """When bytes last arrived from the peer (trio time): the secure channel's raw reads
        where it tells (over a slow link one 64-KiB frame takes seconds), else the reader's.
        A peer whose request timed out while this moved is busy, not gone (the DHT keeps
        such contacts)."""
        below = getattr(self.conn, "last_read", None)
        return max(self._last_read, below) if isinstance(below, float) else self._last_read

    @property
    def bytes_received(self) -> int:
        """Bytes received on this connection so far (the secure channel's raw reads where it
        counts them, as they arrive; else what the reader got)."""
        below = getattr(self.conn, "bytes_read", None)
        return below if isinstance(below, int) else self._bytes_read

    @property
    def bytes_sent(self) -> int:
        """Bytes written to this connection so far (the secure channel's socket writes where
        it counts them, each as it goes through; else the writer's batches)."""
        below = getattr(self.conn, "bytes_written", None)
        return below if isinstance(below, int) else self._bytes_written

    async def open_stream(self) -> YamuxStream:
        """Open an outbound stream. Data may be sent immediately (before the remote's ACK)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.closed:
            raise StreamResetError(f"connection closed: {self.close_reason}")
        if self.remote_go_away:
            raise StreamClosedError("remote sent GoAway: no new streams on this connection")
        if len(self._streams) >= self.max_streams:
            raise ResourceLimitError(f"too many streams on this connection ({self.max_streams})")
        if self._next_id >= 2**32 - 2:
            raise ResourceLimitError("yamux stream ids exhausted on this connection")
        await self._wait_send_space(light=True)  # a new stream is light
        if self.closed:
            raise StreamResetError(f"connection closed: {self.close_reason}")
        sid = self._next_id
        self._next_id += 2
        stream = YamuxStream(self, sid, self.max_stream_window)
        self._streams[sid] = stream
        self._enqueue_control(TYPE_WINDOW_UPDATE, FLAG_SYN, sid, self._initial_grant(stream))
        return stream

    async def accept_stream(self) -> YamuxStream:
        """Wait for the next inbound stream; raises StreamClosedError once the session closed."""
        try:
            return await self._accept_recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StreamClosedError(f"connection closed: {self.close_reason}") from None

    async def ping(self, timeout: float = 10.0) -> float:  # noqa: ASYNC109 - API takes timeouts
        """Round-trip time of a yamux Ping, in seconds."""
        if self.closed:
            raise StreamResetError(f"connection closed: {self.close_reason}")
        self._ping_counter = (self._ping_counter + 1) & 0xFFFFFFFF
        opaque = self._ping_counter
        event = trio.Event()
        self._pings[opaque] = event
        start = trio.current_time()
        try:
            self._enqueue_control(TYPE_PING, FLAG_SYN, 0, opaque)
            with trio.move_on_after(timeout):
                await event.wait()
        finally:
            self._pings.pop(opaque, None)
        if self.closed:
            raise StreamResetError(f"connection closed: {self.close_reason}")
        if not event.is_set():
            raise P2PTimeoutError(f"yamux ping got no answer within {timeout:.1f}s")
        rtt = trio.current_time() - start
        self.rtt = rtt if self.rtt is None else 0.75 * self.rtt + 0.25 * rtt
        return rtt

    # -- window accounting shared by streams ---------------------------------------------
    def _may_grow(self, extra: int) -> bool:
        """Window growth is allowed while the sum of all granted windows stays under the cap."""
        committed = len(self._streams) * INITIAL_WINDOW + self._granted_extra
        if committed + extra > self.max_buffered:
            return False
        self._granted_extra += extra
        return True

    def _forget(self, stream: YamuxStream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            self._granted_extra -= stream._recv_window - INITIAL_WINDOW

    def _maybe_forget(self, stream: YamuxStream) -> None:
        """A stream closed in both directions needs no more bookkeeping."""
        if stream._local_eof and stream._remote_eof:
            self._forget(stream)

    # -- writing -------------------------------------------------------------------------
    async def _after_enqueue(self) -> None:
        """End of a send: yield to the scheduler only once enough is queued to be worth a write.

        Not yielding after every small frame lets a task queue e.g. protocol echo, response
        and FIN back to back, and the writer then sends them as one write (one Noise frame,
        one syscall, one wake-up on the remote). Cancellation is still honoured here.
        """
        if self._out_bytes >= _COALESCE_LIMIT:
            await trio.lowlevel.checkpoint()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()

    async def _wait_send_space(self, light: bool = False) -> None:
        """Data senders wait while the queue is full; light streams only while theirs is (so
        a request does not wait for a bulk sender's megabyte to drain first)."""
        if light:
            while self._first_bytes >= _OUT_LIMIT and not self.closed:
                await self._space_lot.park()
            return
        while self._out_bytes >= _OUT_LIMIT and not self.closed:
            await self._space_lot.park()

    def _enqueue_data(
        self,
        stream_id: int,
        payload: bytes | memoryview,
        flags: int = 0,
        owner: YamuxStream | None = None,
        *,
        heavy: bool = False,
    ) -> None:
        """Queue one Data frame; ``owner``: ``payload`` is a view of that stream's caller's
        buffer, which must not be reused before the writer has sent it; ``heavy``: the
        stream is past LIGHT_STREAM_BYTES (its frames queue after light streams')."""
        queue = self._out if heavy else self._first
        queue.append(pack_header(TYPE_DATA, flags, stream_id, len(payload)))
        queue.append(payload)
        if queue is self._first:
            self._first_bytes += HEADER_SIZE + len(payload)
        if owner is not None:
            self._borrowed[id(payload)] = owner
            owner._borrowed_pending += 1
        self._out_bytes += HEADER_SIZE + len(payload)
        self._writer_lot.unpark()

    def _drop_queued(self, stream_id: int) -> None:
        """A reset stream's Data frames still queued are never sent: the remote drops the
        data of a reset stream, and on a slow uplink they kept the link busy long after (an
        abandoned all-reduce round's chunks, up to the queue's megabyte: 40 s at 200 kbit/s,
        in which the next round could not even find its group). A frame that opens the
        stream (SYN) stays, and so do control frames; what the writer took is on its way."""
        dropped = 0
        for queue in (self._first, self._out):
            kept: deque[bytes | memoryview] = deque()
            removed = 0
            pieces = iter(queue)
            for piece in pieces:
                # a queue holds whole frames: a Data header is followed by its payload
                if len(piece) == HEADER_SIZE and piece[1] == TYPE_DATA:
                    _, _, flags, sid, length = HEADER.unpack(piece)
                    payload = next(pieces) if length else None
                    if sid == stream_id and payload is not None and not flags & FLAG_SYN:
                        removed += HEADER_SIZE + length
                        self._release_borrowed([payload])
                        continue
                    kept.append(piece)
                    if payload is not None:
                        kept.append(payload)
                    continue
                kept.append(piece)
            if removed:
                queue.clear()  # the same deque: the writer holds it
                queue.extend(kept)
                if queue is self._first:
                    self._first_bytes -= removed
                dropped += removed
        if dropped:
            self._out_bytes -= dropped
            self._space_lot.unpark_all()

    def _release_borrowed(self, pieces: list[bytes | memoryview]) -> None:
        """The writer sent these pieces: wake the senders whose buffers are now free."""
        for piece in pieces:
            owner = self._borrowed.pop(id(piece), None)
            if owner is not None:
                owner._borrowed_pending -= 1
                if not owner._borrowed_pending:
                    owner._send_lot.unpark_all()

    def _copy_borrowed(self, owner: YamuxStream) -> None:
        """``owner``'s send was cancelled: its pieces still queued get their own copies (the
        caller may reuse its buffer now). Pieces the writer took are already encrypted: a
        SecureSession seals a whole batch before its first await (see ``_writer``)."""
        for queue in (self._first, self._out):
            for i, piece in enumerate(queue):
                if self._borrowed.get(id(piece)) is owner:
                    queue[i] = bytes(piece)
        # forget them all, including those in the writer's current batch (already sealed or
        # copied): nothing of this send is waited for any more
        for key in [k for k, stream in self._borrowed.items() if stream is owner]:
            del self._borrowed[key]
        owner._borrowed_pending = 0

    def _enqueue_control(
        self, ftype: int, flags: int, stream_id: int, length: int, force: bool = False
    ) -> None:
        if self.closed:
            return
        if self._out_bytes >= _OUT_HARD_LIMIT and not force:
            # The remote makes us produce control frames (pongs, RST, ...) but does not read.
            self._fail("remote does not read what we send (outgoing queue full)")
            return
        header = pack_header(ftype, flags, stream_id, length)
        if stream_id and flags & (FLAG_SYN | FLAG_FIN):
            # in order with the stream's data: in the queue its data goes to
            stream = self._streams.get(stream_id)
            if stream is not None and stream.heavy:
                self._out.append(header)
            else:
                self._first.append(header)
                self._first_bytes += HEADER_SIZE
        else:
            self._urgent.append(header)
        self._out_bytes += HEADER_SIZE
        self._writer_lot.unpark()

    async def _writer(self) -> None:
        first, out, urgent = self._first, self._out, self._urgent
        # A SecureSession takes a list of buffers and encrypts them into one write: then the
        # writer hands over up to a whole outgoing queue at once (fewer where the layer below
        # drains slowly: _tune_batch).
        send_parts = own_method(self.conn, "send_parts")
        max_batch = _OUT_LIMIT if send_parts is not None else _RECV_CHUNK
        self._batch_limit = max_batch
        try:
            while True:
                while not first and not out and not urgent:
                    if self.closed:
                        return
                    await self._writer_lot.park()
                if urgent:
                    frames = b"".join(urgent)
                    urgent.clear()
                    if not first and not out:
                        await self.conn.send_all(frames)
                        self._bytes_written += len(frames)
                        self._out_bytes -= len(frames)
                        self._space_lot.unpark_all()
                        continue
                    # let the control frames lead the next write of data
                    first.appendleft(frames)
                    self._first_bytes += len(frames)
                batch, size = self._take_batch()
                began = trio.current_time()
                if send_parts is not None:
                    # one encrypted write, no joining of payloads; the whole batch (at most
                    # batch_limit + one frame) is sealed before send_parts first awaits, so
                    # views of senders' buffers are never read after a cancelled send
                    await send_parts(batch)
                elif self._borrowed:  # a plain stream may hold on to what it is given
                    borrowed = self._borrowed
                    await self._write_pieces([bytes(p) if id(p) in borrowed else p for p in batch])
                else:
                    await self._write_pieces(batch)
                self._bytes_written += size
                self._tune_batch(size, trio.current_time() - began, max_batch)
                if self._borrowed:
                    self._release_borrowed(batch)
                self._out_bytes -= size
                self._space_lot.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self._shutdown(f"write failed: {e!r}")
        except Exception as e:
            # The security layer raises its own errors (e.g. the remote vanished mid-write).
            logger.debug("yamux %s: writer stopped: %r", self.name, e)
            self._shutdown(f"write failed: {e!r}")

    def _take_batch(self) -> tuple[list[bytes | memoryview], int]:
        """The next write: up to ``_batch_limit`` bytes of frames, light streams' first."""
        first, out = self._first, self._out
        batch: list[bytes | memoryview] = []
        size = 0
        # Never stop between a Data header and its payload (they are in the same queue):
        # control frames put in front on the next round would land inside the data frame.
        after_header = False
        while (first or out) and (size < self._batch_limit or after_header):
            queue = first if first else out
            piece = queue.popleft()
            if queue is first:
                self._first_bytes -= len(piece)
            size += len(piece)
            after_header = not after_header and len(piece) == HEADER_SIZE and piece[1] == TYPE_DATA
            batch.append(piece)
        return batch, size

    def _tune_batch(self, size: int, seconds: float, max_batch: int) -> None:
        """Size the next batches to about ``_BATCH_SECONDS`` at the rate the layer below took
        this one: a frame that a light stream queues meanwhile waits for one batch at most.
        A write too quick to time (the socket's buffer took it) lets batches grow back."""
        if seconds < 0.005 or size < _MIN_BATCH:
            if size >= self._batch_limit:
                self._batch_limit = min(max_batch, 2 * self._batch_limit)
            return
        wanted = int(size / seconds * _BATCH_SECONDS)
        self._batch_limit = max(_MIN_BATCH, min(max_batch, wanted))

    async def _write_pieces(self, pieces: list[bytes | memoryview]) -> None:
        """Plain streams: small pieces (headers, control frames) are joined into one write; a
        large payload is written as it is (copying it into a joined buffer costs more)."""
        small: list[bytes | memoryview] = []
        for piece in pieces:
            if len(piece) >= _COALESCE_LIMIT:
                if small:
                    await self._write_small(small)
                    small = []
                await self.conn.send_all(piece)
            else:
                small.append(piece)
        if small:
            await self._write_small(small)

    async def _write_small(self, pieces: list[bytes | memoryview]) -> None:
        await self.conn.send_all(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    # -- reading -------------------------------------------------------------------------
    async def _reader(self) -> None:
        try:
            await self._read_loop()
        except _Violation as v:
            self._fail(str(v))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self._shutdown(f"connection lost: {e!r}")
        except Exception as e:
            # Errors of the layer below (e.g. a Noise decryption failure) end the session.
            logger.warning("yamux %s: closing connection after transport error: %s", self.name, e)
            self._shutdown(f"transport error: {e}")

    async def _read_loop(self) -> None:
        conn = self.conn
        header = bytearray()
        pending = 0  # payload bytes of the current Data frame still to come
        pending_stream: YamuxStream | None = None
        pending_fin = False
        # A SecureSession lends its bulk receive buffer (a memoryview valid until its next
        # read): payloads are then copied out once, straight into what the streams deliver.
        receive = own_method(conn, "receive_view") or conn.receive_some
        while True:
            # No max_bytes: the layer below may then hand over its whole buffer uncopied
            # (its chunks are bounded by its own read size).
            data = await receive()
            if not data:
                self._shutdown("remote closed the connection")
                return
            self._last_read = trio.current_time()
            self._bytes_read += len(data)
            borrowed = isinstance(data, memoryview)
            n = len(data)
            off = 0
            while off < n:
                if pending:
                    take = min(pending, n - off)
                    stream = pending_stream
                    if stream is not None:
                        stream._deliver(
                            data
                            if (off == 0 and take == n and not borrowed)
                            else data[off : off + take]
                        )
                    off += take
                    pending -= take
                    if pending == 0:
                        if pending_fin and stream is not None:
                            stream._on_remote_fin()
                        pending_stream, pending_fin = None, False
                        if stream is not None and off < n and stream._reader_may_post_sink():
                            await self._let_reader_post_sink(stream)
                            if self.closed:
                                return
                    continue
                if header or n - off < HEADER_SIZE:
                    need = HEADER_SIZE - len(header)
                    header += data[off : off + need]
                    off += min(need, n - off)
                    if len(header) < HEADER_SIZE:
                        continue
                    fields = HEADER.unpack(header)
                    header.clear()
                else:
                    fields = HEADER.unpack_from(data, off)
                    off += HEADER_SIZE
                result = self._on_frame(*fields)
                if result is not None:
                    pending, pending_stream, pending_fin = result
                    if pending == 0:
                        if pending_fin and pending_stream is not None:
                            pending_stream._on_remote_fin()
                        pending_stream, pending_fin = None, False
                if self.closed:
                    return

    async def _let_reader_post_sink(self, stream: YamuxStream) -> None:
        """Give the reader just woken by a whole frame (typically a message header) the
        chance to run before the rest of this read is handed out: if it then waits in
        ``receive_exactly_into``, the payload frames that follow go straight into its buffer
        instead of being buffered and copied a second time. Bounded: trio runs a batch of
        woken tasks in either order, so a few checkpoints, not a wait."""
        for _ in range(_SINK_YIELDS):
            await trio.lowlevel.checkpoint()
            if not stream._reader_may_post_sink():
                return

    def _on_frame(
        self, version: int, ftype: int, flags: int, sid: int, length: int
    ) -> tuple[int, YamuxStream | None, bool] | None:
        """Handle one header. For Data frames returns (payload length, stream, fin)."""
        if version != VERSION:
            raise _Violation(f"unsupported yamux version {version}")
        if flags & ~_KNOWN_FLAGS:
            raise _Violation(f"unknown yamux flags {flags:#x}")
        if ftype == TYPE_DATA or ftype == TYPE_WINDOW_UPDATE:
            if sid == 0:
                raise _Violation("data/window update on stream 0")
            stream = self._stream_for_frame(sid, flags)
            if ftype == TYPE_WINDOW_UPDATE:
                if stream is not None:
                    if length and not flags & FLAG_SYN:
                        self._window_grants += 1  # the remote read data of ours
                    stream._on_window_update(length)
                    self._apply_flags(stream, flags)
                return None
            # Data frame: check the length against the window before anything else.
            if stream is None:
                if length > self.max_stream_window:
                    raise _Violation(f"data frame of {length} bytes for unknown stream {sid}")
                return (length, None, False)
            if length > stream._recv_remaining:
                raise _Violation(
                    f"data frame of {length} bytes exceeds the receive window "
                    f"({stream._recv_remaining} bytes) of stream {sid}"
                )
            stream._recv_remaining -= length
            if length and not stream._read_closed and self._buffered + length > self.max_buffered:
                logger.warning(
                    "yamux %s: connection receive buffer full (%d bytes); resetting stream %d",
                    self.name,
                    self._buffered,
                    sid,
                )
                stream.reset()
                return (length, None, False)
            if flags & FLAG_RST:
                self._apply_flags(stream, flags)
                return (length, None, False)
            return (length, stream, bool(flags & FLAG_FIN))
        if ftype == TYPE_PING:
            if flags & FLAG_SYN:
                self._enqueue_control(TYPE_PING, FLAG_ACK, 0, length)
            elif flags & FLAG_ACK:
                event = self._pings.get(length)
                if event is not None:
                    event.set()
            return None
        if ftype == TYPE_GO_AWAY:
            self.remote_go_away = True
            if length == GO_AWAY_NORMAL:
                logger.debug("yamux %s: remote sent GoAway", self.name)
            else:
                logger.warning("yamux %s: remote sent GoAway with error code %d", self.name, length)
            return None
        raise _Violation(f"unknown yamux frame type {ftype}")

    def _stream_for_frame(self, sid: int, flags: int) -> YamuxStream | None:
        stream = self._streams.get(sid)
        if flags & FLAG_SYN:
            if stream is not None:
                raise _Violation(f"duplicate SYN for stream {sid}")
            if (sid % 2 == 1) == self.is_client:
                raise _Violation(f"remote opened stream {sid} with our id parity")
            if self.remote_go_away:
                return None
            if len(self._streams) >= self.max_streams:
                logger.info(
                    "yamux %s: refusing stream %d: %d streams open (limit)",
                    self.name,
                    sid,
                    self.max_streams,
                )
                self._enqueue_control(TYPE_WINDOW_UPDATE, FLAG_RST, sid, 0)
                return None
            stream = YamuxStream(self, sid, self.max_stream_window)
            try:
                self._accept_send.send_nowait(stream)
            except trio.WouldBlock:
                logger.info("yamux %s: refusing stream %d: accept backlog full", self.name, sid)
                self._enqueue_control(TYPE_WINDOW_UPDATE, FLAG_RST, sid, 0)
                return None
            except trio.ClosedResourceError:
                return None
            self._streams[sid] = stream
            self._acknowledge(stream)
        return stream

    def _acknowledge(self, stream: YamuxStream) -> None:
        """ACK an inbound stream: at once if we grant extra window, else with its first frame.

        Piggybacking the ACK on the first frame the stream sends (typically the protocol echo
        and the RPC response) saves a write per RPC; a stream whose reader waits before
        sending anything sends a bare ACK then (see YamuxStream.receive_some).
        """
        extra = self._initial_grant(stream)
        if extra:
            self._enqueue_control(TYPE_WINDOW_UPDATE, FLAG_ACK, stream.stream_id, extra)
        else:
            stream._ack_pending = True

    def _initial_grant(self, stream: YamuxStream) -> int:
        """Extra window beyond the spec's 256 KiB, granted with SYN/ACK if configured."""
        extra = self.stream_window - INITIAL_WINDOW
        if extra and self._may_grow(extra):
            stream._recv_window = self.stream_window
            stream._recv_remaining += extra
            return extra
        return 0

    def _apply_flags(self, stream: YamuxStream, flags: int) -> None:
        if flags & FLAG_RST:
            stream._mark_reset("reset by remote")
        elif flags & FLAG_FIN:
            stream._on_remote_fin()

    # -- background tasks ----------------------------------------------------------------
    async def _measure_rtt(self) -> None:
        """One ping at start-up gives the RTT that window auto-tuning needs."""
        try:
            await self.ping(timeout=30.0)
        except (P2PTimeoutError, StreamResetError):
            pass

    async def _keepalive(self) -> None:
        assert self.keepalive_interval is not None
        while not self.closed:
            await trio.sleep(self.keepalive_interval)
            received, grants = self.bytes_received, self._window_grants
            try:
                await self.ping(timeout=self.keepalive_timeout)
            except P2PTimeoutError:
                moved = self.bytes_received - received
                if moved >= KEEPALIVE_BUSY_BYTES or self._window_grants > grants:
                    # a late pong while data keeps arriving or the remote keeps reading ours:
                    # a full link (a home uplink behind an all-reduce), not a half-open
                    # connection; closing it failed rounds
                    logger.debug(
                        "yamux %s: keepalive pong late, %d bytes and %d window grants arrived "
                        "meanwhile; keeping it",
                        self.name,
                        moved,
                        self._window_grants - grants,
                    )
                    continue
                logger.warning(
                    "yamux %s: keepalive ping unanswered for %.1fs (%d bytes received "
                    "meanwhile); closing half-open connection",
                    self.name,
                    self.keepalive_timeout,
                    moved,
                )
                self._shutdown("keepalive timeout")
                return
            except StreamResetError:
                return
