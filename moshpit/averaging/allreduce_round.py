"""One all-reduce round on this member: its state, and the reducing side of its own part.

:class:`AllReduceRound` is what one :meth:`AllReduceService.run` shares between the
caller's task and the incoming streams the service routes to it (by group id): the
partition, the outputs, who failed and why. The reducing side lives here: a
:class:`~.allreduce_reducer.PartReducer` takes chunks of this member's part from every
sender's stream (:meth:`AllReduceRound.serve`) and from this member directly, and streams
each chunk's result back. The sending side (this member's chunks of the other parts) is
``allreduce_sender.py``; :meth:`AllReduceRound.finish` turns it all into the result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trio

from dht.p2p.errors import MessageTooLargeError, P2PError, ProtocolViolationError
from moshpit.averaging.aggregation import Aggregator
from moshpit.averaging.allreduce_codecs import RoundCodecs
from moshpit.averaging.allreduce_protocol import (
    ERROR_MAX_BYTES,
    Hello,
    ProtocolError,
    all_finite,
    decode_chunk,
    decode_cost,
    max_chunk_message,
    parse_chunk,
    raw_float32_destination,
    receive_with_payload,
    result_msg,
    send_with_payload,
)
from moshpit.averaging.allreduce_reducer import (
    DEFAULT_MAX_WEIGHT_RATIO,
    PROGRESS_BYTES,
    PartReducer,
    SenderFailed,
)
from moshpit.averaging.allreduce_result import AllReduceResult
from moshpit.averaging.group_info import MODE_AUX, MODE_CLIENT, GroupInfo
from moshpit.averaging.pacing import PACE_MIN_LINK_SECONDS, RoundPacing
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
)

if TYPE_CHECKING:
    from dht.p2p import P2PStream, PeerID
    from moshpit.averaging.allreduce import AllReduceService

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT = 2.0  # best-effort goodbye (error message / EOF) to a peer

T = TypeVar("T")


async def first_error(*fns: Callable[[], Awaitable[None]]) -> Exception | None:
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


async def unless_silent(
    fn: Callable[[], Awaitable[T]], moved: Callable[[], int | None], limit: float
) -> T:
    """Run ``fn``; ``trio.TooSlowError`` once a ``limit`` s passes with ``fn`` unfinished and
    fewer than ``PROGRESS_BYTES`` moved on its link (``moved``: bytes so far, None: unknown).
    Over a full home uplink a message can take longer than any fixed limit while data keeps
    moving: that peer is slow, and waited for (the round's own deadline still bounds it); one
    that stopped reading or sending is not, pings and small RPCs notwithstanding."""
    finished = trio.Event()
    returned: list[T] = []

    async def run() -> None:
        try:
            returned.append(await fn())
        finally:
            finished.set()

    async def watch() -> None:
        mark = moved()
        while True:
            with trio.move_on_after(limit):
                await finished.wait()
                return
            now = moved()
            if now is None or mark is None or now - mark < PROGRESS_BYTES:
                raise trio.TooSlowError
            mark = now

    error = await first_error(run, watch)
    if error is not None:
        raise error
    return returned[0]


async def _until_left_out(fn: Callable[[], Awaitable[None]]) -> None:
    """Run a local feeder of the own part; if this member was left out (it stalled past
    sender_timeout, e.g. a starved CPU), stop quietly: its part then stays local."""
    try:
        await fn()
    except SenderFailed as e:
        logger.warning("this member was left out of its own part: %s", e)


async def quietly(aw: Awaitable[Any]) -> None:
    """Await a goodbye (error message, close) to a peer that may already be gone."""
    try:
        await aw
    except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def is_violation(e: BaseException) -> bool:
    """Errors that mean the peer misbehaved (exclude it), as opposed to failed/stalled."""
    return isinstance(e, (ProtocolError, ProtocolViolationError, MessageTooLargeError))


class AllReduceRound:
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
        codecs: RoundCodecs,
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
                service.run_cpu,
                sender_timeout=sender_timeout,
                window=service.window,
                local=me if self.is_sender else None,
                max_weight_ratio=max_weight_ratio,
                moved_from=lambda s: service.host.bytes_received_from(group.members[s]),
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
        ct, decoded = await self.service.run_cpu(
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

    async def serve(self, stream: P2PStream, hello: Hello) -> None:
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

            def cancel_and_unpace(peer: PeerID = peer, pacer: RoundPacing = pacer) -> None:
                scope.cancel()
                pacer.ended(peer, "results")

            reducer.on_fail(s, cancel_and_unpace)
        else:
            reducer.on_fail(s, scope.cancel)
        self._scopes.add(scope)
        try:
            with scope:
                error = await first_error(
                    lambda: self._serve_chunks(stream, s),
                    lambda: self._serve_results(stream, s),
                )
                if error is not None and not isinstance(error, SenderFailed):
                    if isinstance(error, trio.TooSlowError):
                        reason = (
                            f"not reading results ({self.sender_timeout:.3g}s with next to "
                            "nothing sent to it)"
                        )
                    else:
                        reason = f"{type(error).__name__}: {error}"
                    reducer.fail(s, reason, excluded=is_violation(error))
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
            values = await self.service.run_cpu(
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
            await unless_silent(
                functools.partial(send_with_payload, stream, msg),
                functools.partial(self.service.host.bytes_sent_to, stream.remote_peer),
                self.sender_timeout,
            )
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
            values = await self.service.run_cpu(gather, self.tensors, self.layout, a, b, numel=cost)
            await self.reducer.contribute(self.me, k, values)

    async def _local_receiver(self) -> None:
        assert self.reducer is not None
        for _ in self.chunks[self.me]:
            k, msg = await self.reducer.next_result(self.me)
            bounds = self.chunks[self.me][k]
            values = self.reducer.local_result(k)
            self.write(bounds, values)
            self.count_averaged(self.me, bounds, values is not None, msg["n"])
            self.note_missing(self.me, bounds, values is not None, tuple(msg.get("miss", ())))
            self.part_dev[self.me] += msg["dev"]
            self.reducer.mark_sent(self.me, k)
        self.part_ok[self.me] = True

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

    # ---- results of any part (the sending side records its parts' results here too) ----

    def note_missing(
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

    def count_averaged(self, j: int, bounds: tuple[int, int], got: bool, n: int) -> None:
        """Chunk ``bounds`` of part ``j`` counts as averaged if its result contained another
        member's contribution (``n`` counts ours too when our weight is positive)."""
        if got and n - (1 if self.weight > 0 else 0) >= 1:
            self.part_averaged[j] += bounds[1] - bounds[0]

    def write(self, bounds: tuple[int, int], values: torch.Tensor | None) -> None:
        """Put a chunk's result into the outputs (None: keep the local values there)."""
        assert self.outputs is not None and self.tensors is not None and self.layout is not None
        if values is None:  # nobody with positive weight contributed: keep local values
            copy_range(self.tensors, self.outputs, self.layout, *bounds)
        else:
            scatter(values, self.outputs, self.layout, bounds[0])

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
                    await self.service.run_cpu(
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
                if await self.service.run_cpu(all_finite, out, numel=out.numel() // 4):
                    continue
                bad = await self.service.run_cpu(_restore_nonfinite, out, local, numel=out.numel())
                logger.warning(
                    "%d averaged values overflow this member's %s tensor; kept local values there",
                    bad,
                    out.dtype,
                )
                averaged = max(0, averaged - bad)
        return averaged, self.total


def _restore_nonfinite(out: torch.Tensor, local: torch.Tensor) -> int:
    """Put ``local``'s values where ``out`` is NaN/Inf; returns how many there were."""
    bad = ~torch.isfinite(out)
    out[bad] = local.to(out.device)[bad]
    return int(bad.sum())
