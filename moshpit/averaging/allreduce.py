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

Where it lives: this module is the service (the stream handler that routes incoming streams
to their round, and :meth:`AllReduceService.run`); the round's state and its reducing side are
``allreduce_round.py``, the sending side ``allreduce_sender.py``, the codecs of a round
``allreduce_codecs.py``; the messages are ``allreduce_protocol.py``, the reducer's scheduling
``allreduce_reducer.py``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trio

from compression import Codec, TwoWayCompression
from dht.p2p.errors import P2PError, StreamClosedError
from moshpit.averaging.aggregation import Aggregator, WeightedMean
from moshpit.averaging.allreduce_codecs import RoundCodecs
from moshpit.averaging.allreduce_protocol import (
    HELLO_MAX_BYTES,
    MAX_WEIGHT,
    ProtocolError,
    RemoteAbort,
    all_finite,
    error_msg,
    hello_group_id,
    parse_hello,
)
from moshpit.averaging.allreduce_reducer import DEFAULT_MAX_WEIGHT_RATIO, SenderFailed
from moshpit.averaging.allreduce_result import AllReduceResult as AllReduceResult  # re-exported
from moshpit.averaging.allreduce_round import CLOSE_TIMEOUT, AllReduceRound, quietly
from moshpit.averaging.allreduce_sender import PartExchange
from moshpit.averaging.group_info import MODE_AUX, GroupInfo, GroupInfoError
from moshpit.averaging.pacing import UplinkPacer
from moshpit.averaging.partition import TensorLayout

if TYPE_CHECKING:
    from dht.p2p import Host, P2PStream, PeerID

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

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
MAX_PENDING_STREAMS = 256  # incoming streams waiting for their round to start


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
        self._rounds: dict[bytes, AllReduceRound] = {}
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

    async def run_cpu(self, fn: Callable[..., _T], *args: Any, numel: int) -> _T:
        """Run CPU work inline when small, in a worker thread (bounded) when large.

        ``numel``: the estimated work in element-passes (see ``THREAD_MIN_NUMEL``).
        """
        if numel >= THREAD_MIN_NUMEL:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        return fn(*args)

    async def _find_round(self, group_id: bytes, deadline: float) -> AllReduceRound | None:
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
        wait = self._hello_wait()
        try:
            deadline = trio.current_time() + wait
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
                "all-reduce stream from %s: no hello or unknown group within %.3gs", peer, wait
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

    def _hello_wait(self) -> float:
        """How long an incoming stream may take to bring its hello (and its round to start):
        ``accept_timeout``, or while rounds run the longest of their sender stall limits. The
        hello is a sender's first message, and over a saturated home uplink it took longer
        than ``accept_timeout`` (1 Mbit/s, 4 peers), which cost the round that sender."""
        return max([self.accept_timeout, *(r.sender_timeout for r in self._rounds.values())])

    def _sender_gone(self, peer: PeerID, round_: AllReduceRound | None, reason: str) -> None:
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
            await quietly(stream.send_msg(error_msg(reason, left_out=left_out)))
            await quietly(stream.aclose())

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
        sender_timeout, reducer_timeout = _timeouts(timeout, sender_timeout, reducer_timeout)
        if not aux and not (isinstance(weight, (int, float)) and 0 <= weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be a number in [0, {MAX_WEIGHT}], got {weight!r}")
        tensors, layout, total = await self._local_tensors(tensors, aux, numel, out)
        _check_uplink_rate(uplink_rate)
        if group.group_id in self._rounds:
            raise GroupInfoError("a round with this group id is already running on this host")
        self._learn_addrs(group, me)
        round_ = AllReduceRound(
            self, group, me, None if aux else tensors, total, layout, 0.0 if aux else float(weight),
            RoundCodecs(compression), aggregation or WeightedMean(), sender_timeout, reducer_timeout,
            None if out is None else list(out), self.max_weight_ratio, uplink_rate,
        )  # fmt: skip
        timed_out = await self._drive(round_, timeout)
        return await round_.finish(trio.current_time() - started, timed_out)

    async def _local_tensors(
        self,
        tensors: Sequence[torch.Tensor] | None,
        aux: bool,
        numel: int | None,
        out: Sequence[torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor] | None, TensorLayout | None, int]:
        """The caller's tensors as contiguous ones, their layout and flat size (checked)."""
        if tensors is not None:
            tensors = [t.detach().contiguous() for t in tensors]
            layout = TensorLayout.from_tensors(tensors)
            if not aux and not await self.run_cpu(_all_finite, tensors, numel=layout.numel):
                raise ValueError("local tensors contain NaN or Inf; refusing to average them")
            if out is not None and not aux:
                _check_out(tensors, out)
            return tensors, layout, layout.numel
        if aux and numel is not None and numel >= 0:
            return None, None, numel
        raise ValueError("tensors are required (an aux member may pass numel= instead)")

    async def _drive(self, round_: AllReduceRound, seconds: float) -> bool:
        """Run the round's own part and its exchanges until done or for ``seconds``; True if it
        timed out. The round takes incoming streams (by group id) while it runs."""
        group, me = round_.group, round_.me
        self._rounds[group.group_id] = round_
        self._round_added.set()
        self._round_added = trio.Event()
        try:
            with trio.move_on_after(seconds) as deadline_scope:
                async with trio.open_nursery() as nursery:
                    if round_.reducer is not None:
                        nursery.start_soon(round_.run_own_part)
                    if round_.is_sender:
                        for j in range(group.size):
                            if j != me and round_.chunks[j]:
                                nursery.start_soon(PartExchange(round_, j).run)
        finally:
            round_.close()
            del self._rounds[group.group_id]
        if deadline_scope.cancelled_caught:
            logger.warning(
                "all-reduce round %s timed out after %.3gs", group.group_id.hex()[:8], seconds
            )
        return deadline_scope.cancelled_caught


def _timeouts(
    timeout: float,
    sender_timeout: float | None,
    reducer_timeout: float | None,
) -> tuple[float, float]:
    """The round's sender and reducer timeouts (by default a third and two thirds of it)."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError("timeout must be a finite positive number of seconds")
    sender_timeout = timeout / 3 if sender_timeout is None else sender_timeout
    reducer_timeout = 2 * timeout / 3 if reducer_timeout is None else reducer_timeout
    if not (sender_timeout > 0 and reducer_timeout > 0):
        raise ValueError("sender_timeout and reducer_timeout must be positive")
    return sender_timeout, reducer_timeout


def _check_uplink_rate(uplink_rate: float | None) -> None:
    if uplink_rate is not None and (
        isinstance(uplink_rate, bool)
        or not isinstance(uplink_rate, (int, float))
        or not (math.isfinite(uplink_rate) and uplink_rate > 0)
    ):
        raise ValueError(f"uplink_rate must be a positive number of bytes/s, got {uplink_rate!r}")


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


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True if no element is NaN or +-Inf (see :func:`all_finite`)."""
    return all(all_finite(t) for t in tensors)
