"""Butterfly all-reduce inside one group, over ``/moshpit/averaging/1.0.0`` streams.

Public API (stable; see docs/allreduce.md for the wire protocol and failure semantics)::

    service = AllReduceService(host)          # one per Host; registers the stream handler
    result = await service.run(
        group,                                # GroupInfo, identical on every member
        tensors,                              # this member's tensors (aux: None, or a shape template)
        weight=1.0,                           # this member's weight in the weighted mean
        compression=None,                     # TwoWayCompression | Codec | None
        timeout=30.0,                         # the round never takes longer than this
        sender_timeout=None,                  # reducer side: a sender stalled this long is left out
        reducer_timeout=None,                 # sender side: a reducer stalled this long is given up
        aggregation=None,                     # Aggregator (default: streaming WeightedMean)
        numel=None,                           # aux member without tensors: the flat size
        out=None,                             # optional output tensors to reuse across rounds
    )
    result.averaged                           # new tensors, same shapes/dtypes (None for aux)
    result.failed_senders, result.failed_reducers, result.excluded   # who failed, and why
    result.left_out_by                        # reducers that refused *our* contribution, and why
    result.averaged_fraction                  # share of our elements averaged with someone else

``run`` never raises because of other peers: stalls, disconnects and bad input become entries in
the result, and parts that could not be averaged keep this member's local values. It raises
``ValueError``/``TypeError``/``GroupInfoError`` for bad local arguments and propagates
cancellation. The caller's tensors are only read, never written, but they are read while the
round runs (no snapshot copy), so the caller must not modify them until ``run`` returns.

How a round runs on member ``me`` (part ``j`` = flat range reduced by member ``j``):

- for every other reducer ``j``: open a stream, send ``hello``, then part ``j`` chunk by chunk
  (compressed with sender-side error feedback), at most ``window`` chunks ahead of the results
  received; results are written into the output as they arrive (pipelined);
- for its own part: a :class:`PartReducer` takes chunks from incoming streams (routed here by
  group id) and from this member directly, aggregates each chunk once every sender delivered
  it, compresses it once (reducer-side error feedback) and streams it back to every sender.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import trio

from compression import Codec, CompressedTensor, NoCompression, TwoWayCompression
from dht.p2p.errors import (
    DialRefusedError,
    MessageTooLargeError,
    P2PError,
    ProtocolViolationError,
    StreamClosedError,
)
from moshpit.averaging.aggregation import Aggregator, WeightedMean
from moshpit.averaging.allreduce_protocol import (
    ERROR_MAX_BYTES,
    HELLO_MAX_BYTES,
    MAX_WEIGHT,
    ProtocolError,
    RemoteAbort,
    Result,
    all_finite,
    chunk_msg,
    decode_chunk,
    decode_chunk_into,
    decode_cost,
    decode_into_cost,
    error_msg,
    hello_group_id,
    hello_msg,
    max_chunk_message,
    parse_chunk,
    parse_hello,
    parse_result,
    raw_float32,
    raw_float32_destination,
    receive_with_payload,
    result_msg,
    send_with_payload,
)
from moshpit.averaging.allreduce_reducer import (
    DEFAULT_MAX_WEIGHT_RATIO,
    PartReducer,
    SenderFailed,
)
from moshpit.averaging.allreduce_result import AllReduceResult as AllReduceResult  # re-exported
from moshpit.averaging.group_info import MODE_AUX, MODE_CLIENT, GroupInfo, GroupInfoError
from moshpit.averaging.pacing import PACE_MIN_LINK_SECONDS, RoundPacing, UplinkPacer
from moshpit.averaging.partition import (
    TensorLayout,
    chunk_bounds,
    chunk_numel_for,
    copy_range,
    empty_like_all,
    gather,
    gather_copies,
    part_bounds,
    round_link_seconds,
    scatter,
    single_view,
)

if TYPE_CHECKING:
    from dht.p2p import Host, P2PStream, PeerID

logger = logging.getLogger(__name__)

ALLREDUCE_PROTOCOL = "/moshpit/averaging/1.0.0"
DEFAULT_CHUNK_NUMEL = 1 << 18  # 1 MiB of float32 per chunk message
DEFAULT_WINDOW = 4  # chunks a sender may be ahead of the results it received
# CPU work is estimated in element-passes (one read or write pass over one float32 element);
# below this (~2-4 ms of memory-bound work) it runs inline on the event loop, because a
# worker-thread hand-off (wake-up + GIL ping-pong) costs more than it saves: with the
# threshold at 2**20 passes, compressing and decoding 1 MiB chunks in threads cost 8-bit
# 17-25% more CPU and wall time than inline, even with one peer per core (docs/allreduce.md).
# Every per-chunk step of the default 1 MiB chunks stays inline; whole-tensor passes (the
# NaN check of the local tensors, the final copy) still go to a thread.
THREAD_MIN_NUMEL = 1 << 22
CODEC_PASSES = 4  # rough passes of a codec's compress (cast/scale/pack) per element
MAX_PENDING_STREAMS = 256  # incoming streams waiting for their round to start
CLOSE_TIMEOUT = 2.0  # best-effort goodbye (error message / EOF) to a peer


class _Codecs:
    """The two directions of compression for one round (error-feedback keys = flat ranges)."""

    def __init__(self, compression: TwoWayCompression | Codec | None) -> None:
        if compression is None:
            compression = NoCompression()
        if not isinstance(compression, (TwoWayCompression, Codec)):
            raise TypeError(
                f"compression must be a TwoWayCompression, Codec or None, not {type(compression).__name__}"
            )
        self.spec = compression
        # Uncompressed float32 needs no codec call: the payload is a view of the values
        self.raw = type(compression) is NoCompression
        # Codecs and error-feedback state are not promised to be thread-safe (RNG state, the
        # residual dict), and chunks are compressed in several worker threads at once.
        self._lock = threading.Lock()

    def cost(self, numel: int) -> int:
        """Rough work of compressing ``numel`` elements in element-passes (0: a view)."""
        return 0 if self.raw else CODEC_PASSES * numel

    def reduced_cost(self, numel: int) -> int:
        """Rough work of :meth:`reduced`: the codec's, plus one copy of the payload."""
        return self.cost(numel) + numel

    def send(self, values: torch.Tensor, key: tuple[int, int]) -> CompressedTensor:
        """Compress a chunk to send; ``values`` must stay unmodified until it is sent."""
        if self.raw and values.dtype == torch.float32 and values.device.type == "cpu":
            return raw_float32(values)
        with self._lock:
            if isinstance(self.spec, TwoWayCompression):
                return self.spec.compress_send(values, key)
            return self.spec.compress(values)

    def reduced(
        self, values: torch.Tensor, key: tuple[int, int]
    ) -> tuple[CompressedTensor, torch.Tensor]:
        """The result message of a reduced chunk and the float32 values receivers decode.

        The payload is made immutable ``bytes`` once: the same result goes to every sender, and
        the transport copies a mutable buffer (memoryview) on every send but sends ``bytes``
        as they are, so this is one copy instead of one per remote sender.
        """
        if self.raw:  # lossless: receivers decode exactly ``values`` (float32 from the aggregator)
            ct, decoded = raw_float32(values), values
        else:
            with self._lock:
                if isinstance(self.spec, TwoWayCompression):
                    ct, decoded = self.spec.reducer.compress_with_decoded(values, key)
                else:
                    ct, decoded = self.spec.roundtrip(values)
            decoded = decoded.reshape(-1).to(torch.float32)
        if not isinstance(ct.payload, bytes):
            ct = dataclasses.replace(ct, payload=bytes(ct.payload))
        return ct, decoded


async def _first_error(*fns: Callable[[], Awaitable[None]]) -> Exception | None:
    """Run ``fns`` concurrently; on the first Exception cancel the others and return it."""
    error: Exception | None = None
    async with trio.open_nursery() as nursery:

        async def guarded(fn: Callable[[], Awaitable[None]]) -> None:
            nonlocal error
            try:
                await fn()
            except Exception as e:
                if error is None:
                    error = e
                nursery.cancel_scope.cancel()

        for fn in fns:
            nursery.start_soon(guarded, fn)
    return error


async def _until_left_out(fn: Callable[[], Awaitable[None]]) -> None:
    """Run a local feeder of the own part; if this member was left out (it stalled past
    sender_timeout, e.g. a starved CPU), stop quietly: its part then stays local."""
    try:
        await fn()
    except SenderFailed as e:
        logger.warning("this member was left out of its own part: %s", e)


class _RoundEnded(Exception):
    """Placeholder error of an exchange cut short by the end of the round."""


async def _quietly(aw: Awaitable[Any]) -> None:
    """Await a goodbye (error message, close) to a peer that may already be gone."""
    try:
        await aw
    except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _is_violation(e: BaseException) -> bool:
    """Errors that mean the peer misbehaved (exclude it), as opposed to failed/stalled."""
    return isinstance(e, (ProtocolError, ProtocolViolationError, MessageTooLargeError))


class _Round:
    """One run() on this member: shared by the caller's task and the incoming stream handlers."""

    def __init__(
        self,
        service: AllReduceService,
        group: GroupInfo,
        me: int,
        tensors: Sequence[torch.Tensor] | None,
        layout_numel: int,
        layout: TensorLayout | None,
        weight: float,
        codecs: _Codecs,
        aggregator: Aggregator,
        sender_timeout: float,
        reducer_timeout: float,
        out: list[torch.Tensor] | None = None,
        max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
        uplink_rate: float | None = None,
    ) -> None:
        self.service = service
        self.group = group
        self.me = me
        self.tensors = tensors
        self.layout = layout
        self.total = layout_numel
        self.weight = weight
        self.codecs = codecs
        self.sender_timeout = sender_timeout
        self.reducer_timeout = reducer_timeout
        self.is_sender = group.modes[me] != MODE_AUX
        self.bounds = part_bounds(group, layout_numel)
        self.link_seconds = round_link_seconds(group, layout_numel)
        self.chunk_numel = chunk_numel_for(
            layout_numel,
            len(group.sender_indices),
            service.chunk_numel,
            link_seconds=self.link_seconds,
        )
        self.chunks = [chunk_bounds(a, b, self.chunk_numel) for a, b in self.bounds]
        self.outputs = (
            (out if out is not None else empty_like_all(tensors))
            if self.is_sender and tensors is not None
            else None
        )
        self.part_ok = [False] * group.size
        self.part_dev = [0.0] * group.size
        self.part_averaged = [0] * group.size  # elements averaged with someone else, per part
        self.part_complete = [0] * group.size  # elements whose result lacks no contribution
        self.missing: dict[int, set[int]] = {}  # sender -> parts whose results lack it
        self.failed_reducers: dict[int, str] = {}
        self.bad_reducers: dict[int, str] = {}
        self.left_out_by: dict[int, str] = {}
        self.bytes_sent = 0
        self.numel_sent = 0
        self.bytes_received = 0
        self._connected: set[int] = set()
        self._scopes: set[trio.CancelScope] = set()
        self.closed = False
        self.reducer: PartReducer | None = None
        if group.modes[me] != MODE_CLIENT and self.chunks[me]:
            self.reducer = PartReducer(
                list(group.sender_indices),
                self.chunks[me],
                aggregator,
                self._finalize,
                service._run_cpu,
                sender_timeout=sender_timeout,
                window=service.window,
                local=me if self.is_sender else None,
                max_weight_ratio=max_weight_ratio,
            )
        self.pacer = self._plan_pacing(uplink_rate)

    def _plan_pacing(self, uplink_rate: float | None) -> RoundPacing | None:
        """What this member sends to each other member: its chunks of their parts, and its
        own part's results (elements stand in for bytes: both ways use similar codecs)."""
        if uplink_rate is None:
            return None
        if self.link_seconds is not None and self.link_seconds < PACE_MIN_LINK_SECONDS:
            return None  # the codecs, not the links, bound this round: pacing only costs CPU
        pacer = self.service.pacer.round(self.group.group_id, uplink_rate)
        own = self.bounds[self.me][1] - self.bounds[self.me][0]
        for j, peer in enumerate(self.group.members):
            if j == self.me:
                continue
            if self.is_sender and self.chunks[j]:
                pacer.plan(peer, "chunks", self.bounds[j][1] - self.bounds[j][0])
            if self.reducer is not None and self.group.modes[j] != MODE_AUX:
                pacer.plan(peer, "results", own)
                # a sender that never connects gives its share back when the reducer drops it
                self.reducer.on_fail(j, functools.partial(pacer.ended, peer, "results"))
        return pacer

    # ---- reducer side ----

    async def _finalize(
        self,
        k: int,
        values: torch.Tensor | None,
        dev: float,
        contributors: int,
        missing: tuple[int, ...] = (),
    ) -> tuple[Any, torch.Tensor | None]:
        """Compress chunk ``k``'s (finite) aggregate once for every receiver; a codec whose
        output is not finite (a value out of its range) yields "keep local values" instead."""
        if values is None:
            return result_msg(k, None, 0.0, 0), None
        ct, decoded = await self.service._run_cpu(
            self.codecs.reduced,
            values,
            self.chunks[self.me][k],
            numel=self.codecs.reduced_cost(values.numel()),
        )
        if decoded is not values and not all_finite(decoded):
            logger.warning("chunk %d: the compressed result is not finite; not sending it", k)
            return result_msg(k, None, 0.0, 0), None
        return result_msg(k, ct, dev, contributors, missing), decoded

    def left_out(self, peer: PeerID) -> bool:
        """True if our part's reducer has left ``peer`` out (to say so when refusing it)."""
        if self.reducer is None or peer not in self.group.members:
            return False
        s = self.group.members.index(peer)
        return s in self.reducer.failed or s in self.reducer.excluded

    def exclude_peer(self, peer: PeerID, reason: str) -> None:
        """Leave a member that sent an invalid hello out of this member's part."""
        if self.reducer is not None and peer in self.group.members:
            self.reducer.fail(self.group.members.index(peer), reason, excluded=True)

    def waits_for(self, peer: PeerID) -> bool:
        """True if this member's part still waits for ``peer``'s first stream."""
        if self.reducer is None or self.closed or peer not in self.group.members:
            return False
        s = self.group.members.index(peer)
        return s != self.me and s not in self._connected and s in self.reducer.active

    def sender_gone(self, peer: PeerID, reason: str) -> bool:
        """The transport says ``peer`` is gone (its stream to us broke before its hello, or
        it refused a connection): leave it out of this member's part now, not when
        ``sender_timeout`` runs out. Only a sender that has not connected for this part: one
        that did has its own stream, whose end reports it. True if it was left out now."""
        if not self.waits_for(peer):
            return False
        assert self.reducer is not None
        s = self.group.members.index(peer)
        logger.info("sender %s is gone (%s); left out of part %d at once", peer, reason, self.me)
        self.reducer.fail(s, f"gone: {reason}")
        return True

    async def serve(self, stream: P2PStream, hello: Any) -> None:
        """Serve a remote sender's stream for this member's part."""
        group, reducer = self.group, self.reducer
        peer = stream.remote_peer
        if peer not in group.members:
            raise ProtocolError("not a member of this group")
        s = group.members.index(peer)
        if group.modes[s] == MODE_AUX:
            raise ProtocolError("an aux member contributes no tensors")
        if reducer is None or hello.part != self.me:
            reason = f"sent part {hello.part} to the reducer of part {self.me} (partition mismatch)"
            if reducer is not None:
                reducer.fail(s, reason, excluded=True)
            raise ProtocolError(reason)
        if self.closed:
            raise SenderFailed("the round has ended")
        if s in self._connected:
            reducer.fail(s, "opened a second stream for the same part", excluded=True)
            raise ProtocolError("duplicate stream for this part")
        self._connected.add(s)
        if hello.total != self.total or hello.chunk != self.chunk_numel:
            if hello.total != self.total:
                reason = f"flat size {hello.total} != ours {self.total} (different tensors)"
            else:
                reason = f"chunk size {hello.chunk} != ours {self.chunk_numel} (different chunk_numel settings)"
            reducer.fail(s, reason, excluded=True)
            raise ProtocolError(reason)
        reducer.declare(s, hello.weight)
        scope = trio.CancelScope()
        pacer = self.pacer
        if pacer is not None:
            pacer.attach(peer, "results", stream)

            def cancel_and_unpace(peer: Any = peer, pacer: RoundPacing = pacer) -> None:
                scope.cancel()
                pacer.ended(peer, "results")

            reducer.on_fail(s, cancel_and_unpace)
        else:
            reducer.on_fail(s, scope.cancel)
        self._scopes.add(scope)
        try:
            with scope:
                error = await _first_error(
                    lambda: self._serve_chunks(stream, s),
                    lambda: self._serve_results(stream, s),
                )
                if error is not None and not isinstance(error, SenderFailed):
                    if isinstance(error, trio.TooSlowError):
                        reason = f"not reading results for {self.sender_timeout:.3g}s"
                    else:
                        reason = f"{type(error).__name__}: {error}"
                    reducer.fail(s, reason, excluded=_is_violation(error))
        finally:
            self._scopes.discard(scope)
            if pacer is not None:
                pacer.ended(peer, "results")
        if s not in reducer.active:
            raise SenderFailed(reducer._reason(s))
        if self.closed:
            raise SenderFailed("the round ended before the exchange completed")
        await stream.aclose()

    async def _serve_chunks(self, stream: P2PStream, s: int) -> None:
        assert self.reducer is not None
        for k, (a, b) in enumerate(self.chunks[self.me]):
            await self.reducer.wait_turn(s, k)
            msg = await receive_with_payload(
                stream, max_chunk_message(b - a), raw_float32_destination(b - a)
            )
            ct = parse_chunk(msg, k, b - a)
            # NaN/Inf: checked by the aggregation (the reducer excludes the sender)
            values = await self.service._run_cpu(
                functools.partial(decode_chunk, check_finite=False),
                ct,
                b - a,
                numel=decode_cost(ct, check_finite=False),
            )
            self.bytes_received += ct.nbytes
            await self.reducer.contribute(s, k, values)

    async def _serve_results(self, stream: P2PStream, s: int) -> None:
        assert self.reducer is not None
        for _ in self.chunks[self.me]:
            k, msg = await self.reducer.next_result(s)
            with trio.fail_after(self.sender_timeout):
                await send_with_payload(stream, msg)
            lo, hi = self.chunks[self.me][k]
            if self.pacer is not None:
                self.pacer.sent(stream.remote_peer, "results", hi - lo)
            if msg["ct"] is not None:
                self.bytes_sent += len(msg["ct"]["payload"])
                self.numel_sent += hi - lo
            if k == len(self.chunks[self.me]) - 1:
                await self._await_goodbye(stream, s)
            self.reducer.mark_sent(s, k)

    async def _await_goodbye(self, stream: P2PStream, s: int) -> None:
        """After the last result, wait (bounded) for the sender to close its side, so this
        round does not end, and perhaps the process exit, while our results are in flight.
        Best effort: the results were sent, so nothing here counts as a failure."""
        with trio.move_on_after(self.sender_timeout):
            try:
                msg = await stream.receive_msg(max_size=ERROR_MAX_BYTES)
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
                return  # EOF (the expected goodbye) or the connection is gone
            logger.info(
                "sender %s: unexpected message after the last result: %.100r",
                stream.remote_peer,
                msg,
            )

    async def _local_sender(self) -> None:
        """This member's own contribution to its own part: no network, no compression."""
        assert self.reducer is not None and self.tensors is not None and self.layout is not None
        for k, (a, b) in enumerate(self.chunks[self.me]):
            await self.reducer.wait_turn(self.me, k)
            cost = b - a if gather_copies(self.tensors, self.layout, a, b) else 0
            values = await self.service._run_cpu(
                gather, self.tensors, self.layout, a, b, numel=cost
            )
            await self.reducer.contribute(self.me, k, values)

    async def _local_receiver(self) -> None:
        assert self.reducer is not None
        for _ in self.chunks[self.me]:
            k, msg = await self.reducer.next_result(self.me)
            bounds = self.chunks[self.me][k]
            values = self.reducer.local_result(k)
            self._write(bounds, values)
            self._count_averaged(self.me, bounds, values is not None, msg["n"])
            self._note_missing(self.me, bounds, values is not None, tuple(msg.get("miss", ())))
            self.part_dev[self.me] += msg["dev"]
            self.reducer.mark_sent(self.me, k)
        self.part_ok[self.me] = True

    def _note_missing(
        self, j: int, bounds: tuple[int, int], got: bool, missing: tuple[int, ...]
    ) -> None:
        """A result of part ``j`` that lacks some senders' contributions names them (``miss``):
        remember who, and count the chunk as complete only when it lacks nobody."""
        if not got:
            return
        if not missing:
            self.part_complete[j] += bounds[1] - bounds[0]
            return
        for s in missing:
            if s != self.me:
                self.missing.setdefault(s, set()).add(j)

    def _count_averaged(self, j: int, bounds: tuple[int, int], got: bool, n: int) -> None:
        """Chunk ``bounds`` of part ``j`` counts as averaged if its result contained another
        member's contribution (``n`` counts ours too when our weight is positive)."""
        if got and n - (1 if self.weight > 0 else 0) >= 1:
            self.part_averaged[j] += bounds[1] - bounds[0]

    async def run_own_part(self) -> None:
        assert self.reducer is not None
        if self.is_sender:
            self.reducer.declare(self.me, self.weight)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.reducer.run)
            if self.is_sender:
                nursery.start_soon(_until_left_out, self._local_sender)
                nursery.start_soon(_until_left_out, self._local_receiver)
        await self.reducer.wait_all_sent()

    # ---- sender side ----

    def _write(self, bounds: tuple[int, int], values: torch.Tensor | None) -> None:
        assert self.outputs is not None and self.tensors is not None and self.layout is not None
        if values is None:  # nobody with positive weight contributed: keep local values
            copy_range(self.tensors, self.outputs, self.layout, *bounds)
        else:
            scatter(values, self.outputs, self.layout, bounds[0])

    async def exchange(self, j: int) -> None:
        """Send part ``j`` to its reducer and receive the averaged part back."""
        peer = self.group.members[j]
        try:
            stream = await self.service.host.new_stream(
                peer, self.service.protocol, timeout=self.reducer_timeout
            )
        except (P2PError, OSError, trio.TooSlowError) as e:
            self.failed_reducers[j] = f"cannot open stream: {type(e).__name__}: {e}"
            logger.info("part %d: cannot reach reducer %s: %s", j, peer, e)
            if isinstance(e, DialRefusedError) or (
                isinstance(e, StreamClosedError) and not self.service.host.is_connected(peer)
            ):
                # its host answered and nothing listens (the member is not running), or the
                # connection broke under the new stream: it sends nothing either. A dial
                # timeout says less (a peer behind NAT may still reach us): not here
                self.sender_gone(peer, f"{type(e).__name__}: {e}")
            return
        error: BaseException | None = _RoundEnded("round ended")
        if self.pacer is not None:
            self.pacer.attach(peer, "chunks", stream)
        try:
            error = await _first_error(lambda: self._exchange_part(stream, j))
        finally:
            if self.pacer is not None:
                self.pacer.ended(peer, "chunks")
            if error is None:
                self.part_ok[j] = True
                with trio.move_on_after(CLOSE_TIMEOUT) as cs:
                    cs.shield = True
                    await _quietly(stream.aclose())
            else:
                await self._give_up(stream, j, error)
                if isinstance(error, StreamClosedError) and not self.service.host.is_connected(
                    peer
                ):
                    # our stream to it broke with its connection: it is not sending either
                    self.sender_gone(peer, f"{type(error).__name__}: {error}")

    async def _exchange_part(self, stream: P2PStream, j: int) -> None:
        with trio.fail_after(self.reducer_timeout):
            await stream.send_msg(
                hello_msg(self.group.group_id, j, self.total, self.chunk_numel, self.weight)
            )
        received = [0]
        progress = [trio.Event()]
        error = await _first_error(
            lambda: self._send_chunks(stream, j, received, progress),
            lambda: self._receive_results(stream, j, received, progress),
        )
        if error is not None:
            raise error

    async def _send_chunks(
        self, stream: P2PStream, j: int, received: list[int], progress: list[trio.Event]
    ) -> None:
        tensors, layout = self.tensors, self.layout
        assert tensors is not None and layout is not None  # senders always have tensors
        for k, (a, b) in enumerate(self.chunks[j]):
            while k >= received[0] + self.service.window:
                await progress[0].wait()

            def compress(a: int = a, b: int = b) -> CompressedTensor:
                return self.codecs.send(gather(tensors, layout, a, b), (a, b))

            cost = self.codecs.cost(b - a)
            if gather_copies(tensors, layout, a, b):
                cost += b - a
            ct = await self.service._run_cpu(compress, numel=cost)
            with trio.fail_after(self.reducer_timeout):
                await send_with_payload(stream, chunk_msg(k, ct))
            if self.pacer is not None:
                self.pacer.sent(stream.remote_peer, "chunks", b - a)
            self.bytes_sent += ct.nbytes
            self.numel_sent += b - a

    async def _receive_results(
        self, stream: P2PStream, j: int, received: list[int], progress: list[trio.Event]
    ) -> None:
        assert self.outputs is not None and self.layout is not None
        for k, (a, b) in enumerate(self.chunks[j]):
            # Where the range lies in one float32 output tensor, the result is decoded straight
            # into it (uncompressed float32: even received into it). A result rejected after
            # that leaves garbage there, which ``finish`` replaces with the local values, as
            # for every part that did not complete.
            target = single_view(self.outputs, self.layout, a, b)
            with trio.fail_after(self.reducer_timeout):
                msg = await receive_with_payload(
                    stream, max_chunk_message(b - a), raw_float32_destination(b - a, target)
                )
            res: Result = parse_result(msg, k, b - a, self.group.size)
            if res.ct is None:
                self._write((a, b), None)
            elif target is not None:
                await self.service._run_cpu(
                    decode_chunk_into, res.ct, target, numel=decode_into_cost(res.ct)
                )
            else:
                values = await self.service._run_cpu(
                    decode_chunk, res.ct, b - a, numel=decode_cost(res.ct)
                )
                self._write((a, b), values)
            if res.ct is not None:
                self.bytes_received += res.ct.nbytes
            self._count_averaged(j, (a, b), res.ct is not None, res.contributors)
            self._note_missing(j, (a, b), res.ct is not None, res.missing)
            self.part_dev[j] += res.deviation
            received[0] = k + 1
            progress[0].set()
            progress[0] = trio.Event()

    async def _give_up(self, stream: P2PStream, j: int, error: BaseException) -> None:
        """Part ``j`` failed: record why, tell the reducer if it was its fault, drop the stream."""
        if isinstance(error, _RoundEnded):
            reason = "round ended before the part was complete"
        elif isinstance(error, trio.TooSlowError):
            reason = f"stalled: nothing for {self.reducer_timeout:.3g}s"
        elif isinstance(error, RemoteAbort):
            reason = f"reducer ended the exchange: {error}"
        else:
            reason = f"{type(error).__name__}: {error}"
        if isinstance(error, RemoteAbort) and error.left_out:
            # the reducer refused *our* contribution: not its failure (warned about in finish)
            self.left_out_by[j] = str(error)
        else:
            self.failed_reducers[j] = reason
        logger.info("part %d (reducer %s) failed: %s", j, self.group.members[j], reason)
        with trio.move_on_after(CLOSE_TIMEOUT) as cs:
            cs.shield = True
            if _is_violation(error):
                self.bad_reducers[j] = reason
                await _quietly(stream.send_msg(error_msg(reason)))
            await _quietly(stream.aclose())

    # ---- end of round ----

    def close(self) -> None:
        self.closed = True
        for scope in list(self._scopes):
            scope.cancel()
        if self.pacer is not None:
            self.pacer.close()

    async def finish(self, seconds: float, timed_out: bool) -> AllReduceResult:
        group, reducer = self.group, self.reducer
        if self.outputs is not None:
            for j, (a, b) in enumerate(self.bounds):
                if a < b and not self.part_ok[j]:  # keep local values for a part we did not get
                    await self.service._run_cpu(
                        copy_range, self.tensors, self.outputs, self.layout, a, b, numel=b - a
                    )
        reasons: dict[PeerID, str] = {}
        excluded: dict[PeerID, str] = {}
        if reducer is not None:
            for s, reason in reducer.failed.items():
                reasons[group.members[s]] = f"as sender: {reason}"
            for s, reason in reducer.excluded.items():
                excluded[group.members[s]] = reason
            if not reducer.all_sent():
                for s in reducer.active:
                    reasons[group.members[s]] = "as sender: round ended before its exchange"
        reasons.pop(group.members[self.me], None)
        failed_senders = set(reasons)
        for j, reason in self.failed_reducers.items():
            if j != self.me:
                peer = group.members[j]
                reasons[peer] = (
                    f"{reasons[peer]}; as reducer: {reason}"
                    if peer in reasons
                    else f"as reducer: {reason}"
                )
        for j, reason in self.bad_reducers.items():
            excluded[group.members[j]] = f"as reducer: {reason}"
        failed_reducers = {group.members[j] for j in self.failed_reducers if j != self.me}
        left_out_by = {group.members[j]: why for j, why in self.left_out_by.items()}
        if left_out_by:
            logger.warning(
                "all-reduce round %s: %d of %d reducers left this member's contribution out "
                "(their parts keep local values): %s",
                group.group_id.hex()[:8],
                len(left_out_by),
                sum(1 for j, c in enumerate(self.chunks) if c and j != self.me),
                "; ".join(f"{peer}: {why}" for peer, why in left_out_by.items())[:2000],
            )
        averaged_numel, numel = await self._averaged_numel()
        missing = {
            group.members[s]: "contribution missing from the result of part(s) "
            + ", ".join(f"part {j}" for j in sorted(parts))
            for s, parts in self.missing.items()
            if group.members[s] not in excluded
        }
        complete = sum(n for j, n in enumerate(self.part_complete) if self.part_ok[j])
        complete_numel = min(complete, averaged_numel) if self.is_sender else 0
        parts_needed = [j for j, c in enumerate(self.chunks) if c]
        deviation = (
            sum(self.part_dev[j] for j in parts_needed)
            if self.is_sender and all(self.part_ok[j] for j in parts_needed)
            else None
        )
        return AllReduceResult(
            averaged=self.outputs,
            failed_senders=failed_senders,
            failed_reducers=failed_reducers,
            excluded=excluded,
            bytes_sent=self.bytes_sent,
            numel_sent=self.numel_sent,
            bytes_received=self.bytes_received,
            seconds=seconds,
            deviation=deviation,
            timed_out=timed_out,
            failure_reasons=reasons,
            left_out_by=left_out_by,
            averaged_numel=averaged_numel,
            numel=numel,
            missing_contributors=missing,
            complete_numel=complete_numel,
        )

    async def _averaged_numel(self) -> tuple[int, int]:
        """(elements averaged with someone else, total elements) of this member; see
        :class:`AllReduceResult`. Also the last guard of the caller's tensors: a finite float32
        result can still overflow an output of a narrower dtype (float16 holds at most 65504);
        such elements get the local values back and do not count as averaged."""
        if not self.is_sender:
            if self.reducer is None:
                return 0, 0
            a, b = self.bounds[self.me]
            done = sum(
                hi - lo
                for k, (lo, hi) in enumerate(self.chunks[self.me])
                if k < self.reducer.next_emit and self.reducer.contributors_of[k] >= 2
            )
            return done, b - a
        averaged = sum(n for j, n in enumerate(self.part_averaged) if self.part_ok[j])
        if self.outputs is not None and self.tensors is not None:
            for out, local in zip(self.outputs, self.tensors, strict=True):
                if out.dtype in (torch.float32, torch.float64):
                    continue  # holds every finite float32 result exactly
                if await self.service._run_cpu(all_finite, out, numel=out.numel() // 4):
                    continue
                bad = await self.service._run_cpu(_restore_nonfinite, out, local, numel=out.numel())
                logger.warning(
                    "%d averaged values overflow this member's %s tensor; kept local values there",
                    bad,
                    out.dtype,
                )
                averaged = max(0, averaged - bad)
        return averaged, self.total


class AllReduceService:
    """Runs all-reduce rounds for one Host and routes incoming streams to them by group id.

    ``accept_timeout``: how long an incoming stream may wait for its hello and for the local
    round with that group id to start (peers finish matchmaking at slightly different times).
    ``register=False`` leaves registering :meth:`handle_stream` to the caller (e.g. to share
    the protocol with another handler). ``max_weight_ratio``: this member's reducer clips a
    sender's weight to this many times the (lower) median declared weight of its part (see
    ``allreduce_reducer``); every member should use the same value.
    """

    def __init__(
        self,
        host: Host,
        *,
        protocol: str = ALLREDUCE_PROTOCOL,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        window: int = DEFAULT_WINDOW,
        accept_timeout: float = 5.0,
        max_threads: int | None = None,
        register: bool = True,
        max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
    ) -> None:
        if not (math.isfinite(max_weight_ratio) and max_weight_ratio >= 1):
            raise ValueError(
                f"max_weight_ratio must be a finite number >= 1, got {max_weight_ratio!r}"
            )
        if not 1 <= chunk_numel <= 1 << 24:
            raise ValueError("chunk_numel must be in [1, 2**24]")
        if not 1 <= window <= 64:
            raise ValueError("window must be in [1, 64]")
        self.host = host
        self.protocol = protocol
        self.chunk_numel = chunk_numel
        self.window = window
        self.accept_timeout = accept_timeout
        self.max_weight_ratio = float(max_weight_ratio)
        self._limiter = trio.CapacityLimiter(max_threads or max(1, min(4, os.cpu_count() or 1)))
        self._rounds: dict[bytes, _Round] = {}
        self.pacer = UplinkPacer()  # shared by concurrent rounds: caps belong to connections
        self._round_added = trio.Event()
        self._pending_streams = 0
        self._registered = register
        if register:
            host.set_stream_handler(protocol, self.handle_stream)
        # a member whose last connection closes mid-round sends nothing more: its stream (if
        # any) breaks by itself; one that had not connected yet is left out here, at once
        self._observer = (_ignore_peer, self._on_disconnect)
        host.add_connection_observer(*self._observer)

    def _on_disconnect(self, peer: PeerID) -> None:
        for round_ in list(self._rounds.values()):
            round_.sender_gone(peer, "its last connection to us closed")

    def close(self) -> None:
        """Stop serving the protocol (if this service registered it) and end running rounds."""
        if self._registered:
            self.host.set_stream_handler(self.protocol, None)
            self._registered = False
        self.host.remove_connection_observer(*self._observer)
        for round_ in self._rounds.values():
            round_.close()

    def _learn_addrs(self, group: GroupInfo, me: int) -> None:
        """Add the members' addresses from the GroupInfo to the peerstore (we must dial them)."""
        for j, member_addrs in enumerate(group.addrs):
            if j != me and member_addrs:
                try:
                    self.host.peerstore.add_addrs(group.members[j], member_addrs)
                except ValueError as e:  # MultiaddrError or an address naming another peer
                    logger.info("ignoring bad addresses of member %s: %s", group.members[j], e)

    async def _run_cpu(self, fn: Callable[..., Any], *args: Any, numel: int) -> Any:
        """Run CPU work inline when small, in a worker thread (bounded) when large.

        ``numel``: the estimated work in element-passes (see ``THREAD_MIN_NUMEL``).
        """
        if numel >= THREAD_MIN_NUMEL:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        return fn(*args)

    async def _find_round(self, group_id: bytes, deadline: float) -> _Round | None:
        with trio.move_on_at(deadline):
            while group_id not in self._rounds:
                await self._round_added.wait()
        return self._rounds.get(group_id)

    async def handle_stream(self, stream: P2PStream) -> None:
        """Serve one incoming stream: read hello, find the round, feed its reducer."""
        peer = stream.remote_peer
        if self._pending_streams >= MAX_PENDING_STREAMS:
            logger.warning("too many pending all-reduce streams; refusing one from %s", peer)
            await self._refuse(stream, "busy: too many pending streams")
            return
        self._pending_streams += 1
        round_ = msg = None
        try:
            deadline = trio.current_time() + self.accept_timeout
            with trio.move_on_at(deadline):
                msg = await stream.receive_msg(max_size=HELLO_MAX_BYTES)
            gid = hello_group_id(msg)
            if gid is not None:
                round_ = await self._find_round(gid, deadline)
            hello = parse_hello(msg)
        except (ProtocolError, P2PError, RemoteAbort) as e:
            logger.info("bad all-reduce hello from %s: %s", peer, e)
            if isinstance(e, StreamClosedError):
                # the stream ended before its hello (reset: the peer died, or closed): it
                # brings no chunks, and its reducer must not wait sender_timeout for them
                self._sender_gone(peer, round_, f"stream ended before its hello: {e}")
            elif round_ is not None:
                round_.exclude_peer(peer, f"bad hello: {e}")
            await self._refuse(
                stream, str(e), left_out=round_ is not None and round_.left_out(peer)
            )
            return
        finally:
            self._pending_streams -= 1
        if round_ is None:
            logger.info(
                "all-reduce stream from %s: no hello or unknown group within %.3gs",
                peer,
                self.accept_timeout,
            )
            await self._refuse(stream, "unknown group (or no hello in time)")
            return
        try:
            await round_.serve(stream, hello)
        except (ProtocolError, SenderFailed) as e:
            logger.info("all-reduce sender %s left out: %s", peer, e)
            await self._refuse(stream, str(e), left_out=round_.left_out(peer))
        except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            logger.info("all-reduce stream from %s broke: %s", peer, e)
            await self._refuse(stream, str(e), left_out=round_.left_out(peer))

    def _sender_gone(self, peer: PeerID, round_: _Round | None, reason: str) -> None:
        """Tell the round ``peer``'s broken stream was for that it brings nothing. Without
        its hello the group is unknown: the round still waiting for ``peer``'s stream, if
        there is one such round, or all of them once no connection to ``peer`` is left (it
        is gone for every round)."""
        if round_ is not None:
            round_.sender_gone(peer, reason)
            return
        candidates = [r for r in self._rounds.values() if r.waits_for(peer)]
        if len(candidates) == 1 or not self.host.is_connected(peer):
            for r in candidates:
                r.sender_gone(peer, reason)

    async def _refuse(self, stream: P2PStream, reason: str, left_out: bool = False) -> None:
        """Best effort: tell the peer why (and whether we left its contribution out of our
        part, so that it learns it was excluded), then drop the stream."""
        with trio.move_on_after(CLOSE_TIMEOUT) as cs:
            cs.shield = True
            await _quietly(stream.send_msg(error_msg(reason, left_out=left_out)))
            await _quietly(stream.aclose())

    async def run(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor] | None,
        *,
        weight: float = 1.0,
        compression: TwoWayCompression | Codec | None = None,
        timeout: float = 30.0,  # noqa: ASYNC109 - the documented API; enforced with move_on_after
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        aggregation: Aggregator | None = None,
        numel: int | None = None,
        out: Sequence[torch.Tensor] | None = None,
        uplink_rate: float | None = None,
    ) -> AllReduceResult:
        """Average ``tensors`` with the rest of ``group``; see the module docstring.

        ``out``: contiguous tensors shaped like ``tensors`` (same dtypes and devices, no memory
        shared with them) to write the result into, returned as ``result.averaged``. A caller
        that averages repeatedly passes the same ones every round: fresh output memory costs
        a page fault per 4 KiB on first write, about 7x the copy itself on CPU.

        ``uplink_rate``: this member's uplink in bytes/s. When given, the round caps each of
        its connections at a share of it, proportional to what is left to send there (see
        ``pacing.py``), so that on access links no peer's downlink is flooded while another
        uplink idles. ``None`` (the default) leaves the sharing to TCP.
        """
        started = trio.current_time()
        me = group.index_of(self.host.peer_id)
        aux = group.modes[me] == MODE_AUX
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError("timeout must be a finite positive number of seconds")
        sender_timeout = timeout / 3 if sender_timeout is None else sender_timeout
        reducer_timeout = 2 * timeout / 3 if reducer_timeout is None else reducer_timeout
        if not (sender_timeout > 0 and reducer_timeout > 0):
            raise ValueError("sender_timeout and reducer_timeout must be positive")
        if not aux and not (isinstance(weight, (int, float)) and 0 <= weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be a number in [0, {MAX_WEIGHT}], got {weight!r}")
        layout = None
        if tensors is not None:
            tensors = [t.detach().contiguous() for t in tensors]
            layout = TensorLayout.from_tensors(tensors)
            if not aux and not await self._run_cpu(_all_finite, tensors, numel=layout.numel):
                raise ValueError("local tensors contain NaN or Inf; refusing to average them")
            total = layout.numel
            if out is not None and not aux:
                _check_out(tensors, out)
        elif aux and numel is not None and numel >= 0:
            total = numel
        else:
            raise ValueError("tensors are required (an aux member may pass numel= instead)")
        if uplink_rate is not None and (
            isinstance(uplink_rate, bool)
            or not isinstance(uplink_rate, (int, float))
            or not (math.isfinite(uplink_rate) and uplink_rate > 0)
        ):
            raise ValueError(
                f"uplink_rate must be a positive number of bytes/s, got {uplink_rate!r}"
            )
        if group.group_id in self._rounds:
            raise GroupInfoError("a round with this group id is already running on this host")
        self._learn_addrs(group, me)
        round_ = _Round(
            self, group, me, None if aux else tensors, total, layout, 0.0 if aux else float(weight),
            _Codecs(compression), aggregation or WeightedMean(), sender_timeout, reducer_timeout,
            None if out is None else list(out), self.max_weight_ratio, uplink_rate,
        )  # fmt: skip
        self._rounds[group.group_id] = round_
        self._round_added.set()
        self._round_added = trio.Event()
        try:
            with trio.move_on_after(timeout) as deadline_scope:
                async with trio.open_nursery() as nursery:
                    if round_.reducer is not None:
                        nursery.start_soon(round_.run_own_part)
                    if round_.is_sender:
                        for j in range(group.size):
                            if j != me and round_.chunks[j]:
                                nursery.start_soon(round_.exchange, j)
        finally:
            round_.close()
            del self._rounds[group.group_id]
        timed_out = deadline_scope.cancelled_caught
        if timed_out:
            logger.warning(
                "all-reduce round %s timed out after %.3gs", group.group_id.hex()[:8], timeout
            )
        return await round_.finish(trio.current_time() - started, timed_out)


def _ignore_peer(peer: PeerID) -> None:
    """A connection observer's half that has nothing to do."""


def _check_out(tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    """``out`` must be writable output tensors matching ``tensors`` and not aliasing them."""
    if len(out) != len(tensors):
        raise ValueError(f"out has {len(out)} tensors, expected {len(tensors)}")
    for i, (t, o) in enumerate(zip(tensors, out, strict=True)):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"out[{i}] is a {type(o).__name__}, not a torch.Tensor")
        if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device:
            raise ValueError(
                f"out[{i}] is {o.dtype} {tuple(o.shape)} on {o.device}, expected "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if not o.is_contiguous():
            raise ValueError(f"out[{i}] must be contiguous")
    inputs = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    outputs = [o.untyped_storage().data_ptr() for o in out if o.numel()]
    if len(set(outputs)) != len(outputs) or inputs & set(outputs):
        raise ValueError("out tensors must not share memory with each other or with the inputs")


def _restore_nonfinite(out: torch.Tensor, local: torch.Tensor) -> int:
    """Put ``local``'s values where ``out`` is NaN/Inf; returns how many there were."""
    bad = ~torch.isfinite(out)
    out[bad] = local.to(out.device)[bad]
    return int(bad.sum())


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True if no element is NaN or +-Inf (see :func:`all_finite`)."""
    return all(all_finite(t) for t in tensors)
