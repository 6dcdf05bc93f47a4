"""The sending side of an all-reduce round: this member's exchange with the reducer of one part.

For every other member ``j`` that reduces a part, a :class:`PartExchange` opens a stream to
it, sends ``hello``, then part ``j`` chunk by chunk (compressed with sender-side error
feedback), at most ``window`` chunks ahead of the results received, and writes the results
into the round's outputs as they arrive (pipelined). Everything it learns (bytes, what was
averaged, who failed and why) goes into the shared :class:`~.allreduce_round.AllReduceRound`;
the reducing side of the round is there too.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import trio

from compression import CompressedTensor
from dht.p2p.dcutr import BULK_DIRECT_WAIT
from dht.p2p.errors import DialRefusedError, P2PError, StreamClosedError
from moshpit.averaging.allreduce_protocol import (
    RemoteAbort,
    Result,
    chunk_msg,
    decode_chunk,
    decode_chunk_into,
    decode_cost,
    decode_into_cost,
    error_msg,
    hello_msg,
    max_chunk_message,
    parse_result,
    raw_float32_destination,
    receive_with_payload,
    send_with_payload,
)
from moshpit.averaging.allreduce_round import (
    CLOSE_TIMEOUT,
    first_error,
    is_violation,
    quietly,
    unless_silent,
)
from moshpit.averaging.partition import gather, gather_copies, single_view

if TYPE_CHECKING:
    from dht.p2p import P2PStream
    from moshpit.averaging.allreduce_round import AllReduceRound

logger = logging.getLogger(__name__)


class _RoundEnded(Exception):
    """Placeholder error of an exchange cut short by the end of the round."""


class PartExchange:
    """Send part ``j`` to its reducer and receive the averaged part back (one per round and j)."""

    def __init__(self, round_: AllReduceRound, j: int) -> None:
        self.round = round_
        self.j = j
        self.received = 0  # results received so far: chunks may run ``window`` ahead of it
        self.progress = trio.Event()  # set (and replaced) whenever a result arrives

    async def run(self) -> None:
        r, j = self.round, self.j
        peer = r.group.members[j]
        host = r.service.host
        try:
            stream = await host.new_stream(
                peer,
                r.service.protocol,
                timeout=r.reducer_timeout,
                # the round's first contact with a member behind a NAT often is what
                # starts the punch: wait for it, within a quarter of sender_timeout
                direct_wait=min(BULK_DIRECT_WAIT, r.sender_timeout / 4),
            )
        except (P2PError, OSError, trio.TooSlowError) as e:
            r.failed_reducers[j] = f"cannot open stream: {type(e).__name__}: {e}"
            logger.info("part %d: cannot reach reducer %s: %s", j, peer, e)
            if isinstance(e, DialRefusedError) or (
                isinstance(e, StreamClosedError) and not host.is_connected(peer)
            ):
                # its host answered and nothing listens (the member is not running), or the
                # connection broke under the new stream: it sends nothing either. A dial
                # timeout says less (a peer behind NAT may still reach us): not here
                r.sender_gone(peer, f"{type(e).__name__}: {e}")
            return
        error: BaseException | None = _RoundEnded("round ended")
        if r.pacer is not None:
            r.pacer.attach(peer, "chunks", stream)
        try:
            error = await first_error(lambda: self._exchange(stream))
        finally:
            if r.pacer is not None:
                r.pacer.ended(peer, "chunks")
            if error is None:
                r.part_ok[j] = True
                with trio.move_on_after(CLOSE_TIMEOUT) as cs:
                    cs.shield = True
                    await quietly(stream.aclose())
            else:
                await self._give_up(stream, error)
                if isinstance(error, StreamClosedError) and not host.is_connected(peer):
                    # our stream to it broke with its connection: it is not sending either
                    r.sender_gone(peer, f"{type(error).__name__}: {error}")

    async def _exchange(self, stream: P2PStream) -> None:
        r = self.round
        with trio.fail_after(r.reducer_timeout):
            await stream.send_msg(
                hello_msg(r.group.group_id, self.j, r.total, r.chunk_numel, r.weight)
            )
        error = await first_error(
            lambda: self._send_chunks(stream),
            lambda: self._receive_results(stream),
        )
        if error is not None:
            raise error

    async def _send_chunks(self, stream: P2PStream) -> None:
        r = self.round
        tensors, layout = r.tensors, r.layout
        assert tensors is not None and layout is not None  # senders always have tensors
        for k, (a, b) in enumerate(r.chunks[self.j]):
            while k >= self.received + r.service.window:
                await self.progress.wait()

            def compress(a: int = a, b: int = b) -> CompressedTensor:
                return r.codecs.send(gather(tensors, layout, a, b), (a, b))

            cost = r.codecs.cost(b - a)
            if gather_copies(tensors, layout, a, b):
                cost += b - a
            ct = await r.service.run_cpu(compress, numel=cost)
            await unless_silent(
                functools.partial(send_with_payload, stream, chunk_msg(k, ct)),
                functools.partial(r.service.host.bytes_sent_to, stream.remote_peer),
                r.reducer_timeout,
            )
            if r.pacer is not None:
                r.pacer.sent(stream.remote_peer, "chunks", b - a)
            r.bytes_sent += ct.nbytes
            r.numel_sent += b - a

    async def _receive_results(self, stream: P2PStream) -> None:
        r, j = self.round, self.j
        assert r.outputs is not None and r.layout is not None
        for k, (a, b) in enumerate(r.chunks[j]):
            # Where the range lies in one float32 output tensor, the result is decoded straight
            # into it (uncompressed float32: even received into it). A result rejected after
            # that leaves garbage there, which ``finish`` replaces with the local values, as
            # for every part that did not complete.
            target = single_view(r.outputs, r.layout, a, b)
            msg = await unless_silent(
                functools.partial(
                    receive_with_payload,
                    stream,
                    max_chunk_message(b - a),
                    raw_float32_destination(b - a, target),
                ),
                functools.partial(r.service.host.bytes_received_from, stream.remote_peer),
                r.reducer_timeout,
            )
            res: Result = parse_result(msg, k, b - a, r.group.size)
            if res.ct is None:
                r.write((a, b), None)
            elif target is not None:
                await r.service.run_cpu(
                    decode_chunk_into, res.ct, target, numel=decode_into_cost(res.ct)
                )
            else:
                values = await r.service.run_cpu(
                    decode_chunk, res.ct, b - a, numel=decode_cost(res.ct)
                )
                r.write((a, b), values)
            if res.ct is not None:
                r.bytes_received += res.ct.nbytes
            r.count_averaged(j, (a, b), res.ct is not None, res.contributors)
            r.note_missing(j, (a, b), res.ct is not None, res.missing)
            r.part_dev[j] += res.deviation
            self.received = k + 1
            self.progress.set()
            self.progress = trio.Event()

    async def _give_up(self, stream: P2PStream, error: BaseException) -> None:
        """The part failed: record why, tell the reducer if it was its fault, drop the stream."""
        r, j = self.round, self.j
        if isinstance(error, _RoundEnded):
            reason = "round ended before the part was complete"
        elif isinstance(error, trio.TooSlowError):
            reason = f"stalled: next to nothing to or from it for {r.reducer_timeout:.3g}s"
        elif isinstance(error, RemoteAbort):
            reason = f"reducer ended the exchange: {error}"
        else:
            reason = f"{type(error).__name__}: {error}"
        if isinstance(error, RemoteAbort) and error.left_out:
            # the reducer refused *our* contribution: not its failure (warned about in finish)
            r.left_out_by[j] = str(error)
        else:
            r.failed_reducers[j] = reason
        logger.info("part %d (reducer %s) failed: %s", j, r.group.members[j], reason)
        if not is_violation(error):
            # nothing of this part is wanted any more: a reset drops our chunks still queued,
            # which a close would send first (on a slow uplink, the next round's time)
            stream.reset()
            return
        r.bad_reducers[j] = reason
        with trio.move_on_after(CLOSE_TIMEOUT) as cs:
            cs.shield = True
            await quietly(stream.send_msg(error_msg(reason)))
            await quietly(stream.aclose())
