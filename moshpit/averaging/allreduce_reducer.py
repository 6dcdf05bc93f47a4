"""The reducing side of one part: collect chunk k from every sender, aggregate, publish result k.

Chunks are finalized strictly in order. Chunk k is finalized once every sender that is still
active has contributed it, or when ``sender_timeout`` has passed since chunk k became the next
one to finalize and none of the senders still missing is moving data: a sender from which at
least ``PROGRESS_BYTES`` arrived in the last ``sender_timeout`` (``moved_from``: bytes
received from it so far, where the transport counts them) is slow, not stalled, and waited
for another ``sender_timeout``. On a full home uplink a chunk can take longer than any fixed
limit, and leaving its sender out cost the whole group that part of its average; the round's
own deadline still bounds the wait, and keepalive pings or a few DHT RPCs do not count as
data. Senders left out are marked failed for the rest of the part (per-chunk semantics: a
failed sender stays in the chunks it completed before failing).
A sender may be at most ``window`` chunks ahead of the results it has been sent, so memory is
bounded by ``window x senders`` chunks whatever the peers do.

Weights. Every sender declares its weight (in its hello; the local member directly) before
its first chunk. A weight is the sender's own claim, so once every sender still in the part has
declared (or failed), the weights are fixed for the part: a weight above ``max_weight_ratio``
times the median of the positive declared weights (the lower median, so that a minority
claiming huge weights cannot raise it) is clipped to that bound, and all weights are divided
by their sum. Chunks that arrive before the weights are fixed wait (at most ``window`` per
sender, references only). Normalised weights sum to at most 1, so the float32 weighted sum of
finite float32 values stays within their range: one sender's huge weight can neither
overflow the mean nor buy more than ``max_weight_ratio`` x a typical member's influence.

Results. Every chunk's result is checked before anyone sees it: a non-finite aggregate (only
possible in corner cases, see ``aggregation``) is not sent; the chunk's result is then
"keep your local values" (``None``) and a warning is logged. Each result carries ``n``, the
number of contributions with positive weight in it, so that receivers know whether they
averaged with anybody else.

This class knows nothing about streams: the service feeds it decoded chunks and forwards its
results; the local member feeds its own chunks directly.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from moshpit.averaging.aggregation import Aggregator, NonFiniteContribution
from moshpit.averaging.allreduce_protocol import all_finite
from moshpit.averaging.errors import AveragingError

logger = logging.getLogger(__name__)

# bytes a peer must move on its link within a stall limit to count as slow rather than
# stalled: round data, not the keepalive's pings or a few DHT RPCs (tens to hundreds of bytes)
PROGRESS_BYTES = 32 * 1024

DEFAULT_MAX_WEIGHT_RATIO = 100.0

# (chunk index, values, deviation, contributors, missing senders) -> (wire message, local
# float32 result);
# compresses in a worker thread; returns a None result if the compressed values are not finite
# (chunk, its aggregate or None, deviation, contributors, senders missing from it) -> (the
# result message, the local result)
Finalizer = Callable[
    [int, torch.Tensor | None, float, int, tuple[int, ...]],
    Awaitable[tuple[Any, torch.Tensor | None]],
]


def weight_cap(declared: dict[int, float], max_ratio: float) -> float:
    """``max_ratio`` x the lower median of the positive declared weights (0 if none)."""
    positive = sorted(w for w in declared.values() if w > 0)
    return max_ratio * positive[(len(positive) - 1) // 2] if positive else 0.0


def effective_weights(declared: dict[int, float], max_ratio: float) -> dict[int, float]:
    """Clip every weight to :func:`weight_cap`, then divide by the sum (all zero if none is
    positive). Deterministic in the declared weights, so every reducer that saw the same
    declarations uses the same weights."""
    cap = weight_cap(declared, max_ratio)
    clipped = {s: min(w, cap) for s, w in declared.items()}
    total = math.fsum(clipped.values())
    return {s: (w / total if total > 0 else 0.0) for s, w in clipped.items()}


class SenderFailed(AveragingError):
    """This sender was left out of the part (its reason is the text)."""


class PartReducer:
    def __init__(
        self,
        senders: list[int],
        chunks: list[tuple[int, int]],
        aggregator: Aggregator,
        finalize: Finalizer,
        run_cpu: Callable[..., Awaitable[Any]],
        *,
        sender_timeout: float,
        window: int,
        local: int | None,
        max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
        moved_from: Callable[[int], int | None] | None = None,
    ) -> None:
        self.chunks = chunks
        # sender -> bytes received from it so far (None: unknown, no connection)
        self._moved_from = moved_from
        self.aggregator = aggregator
        self._finalize_fn = finalize
        self._run_cpu = run_cpu
        self.sender_timeout = sender_timeout
        self.window = window
        self.local = local  # this member's own sender index, if it contributes to this part
        self.max_weight_ratio = max_weight_ratio
        self.declared: dict[int, float] = {}  # raw weights as claimed by the senders
        self.weights: dict[int, float] | None = None  # normalised, once every sender declared
        self._deferred: list[tuple[int, int, torch.Tensor]] = []  # (sender, k, values)
        self.nonfinite_chunks = 0  # results withheld because the aggregate was not finite
        self.contributors_of = [0] * len(chunks)  # "n" of every finalized chunk
        self.senders = tuple(senders)
        self.active: set[int] = set(senders)
        self._added: list[set[int]] = [set() for _ in chunks]  # aggregated into chunk k
        self.failed: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.next_emit = 0  # chunks [0, next_emit) are finalized
        self._contributed: list[set[int]] = [set() for _ in chunks]
        self._pending: dict[int, Any] = {}  # chunk index -> ChunkAggregation
        self._results: dict[int, Any] = {}  # chunk index -> wire message (pruned when all sent)
        self._local_results: dict[int, torch.Tensor | None] = {}
        self._consumed: dict[int, int] = {s: 0 for s in senders}  # results handed to each sender
        self._lock = trio.Lock()  # guards aggregation state; a ChunkAggregation is not thread-safe
        self._closed = 0  # chunks below this index accept no more contributions
        self._changed = trio.Event()
        self._on_fail: dict[int, Callable[[], None]] = {}

    # ---- state changes ----

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def fail(self, sender: int, reason: str, *, excluded: bool = False) -> None:
        """Leave ``sender`` out of every chunk not finalized yet."""
        if sender not in self.active:
            return
        self.active.discard(sender)
        (self.excluded if excluded else self.failed)[sender] = reason
        if sender == self.local:
            self._local_results.clear()  # nobody will collect them
        self._maybe_fix_weights()
        callback = self._on_fail.pop(sender, None)
        if callback is not None:
            callback()
        self._notify()

    def declare(self, sender: int, weight: float) -> None:
        """Record ``sender``'s claimed weight (before its first chunk; validated by the caller)."""
        if sender in self.active and sender not in self.declared and self.weights is None:
            self.declared[sender] = weight
            self._maybe_fix_weights()

    def _maybe_fix_weights(self, force: bool = False) -> None:
        if self.weights is None and (force or self.active <= self.declared.keys()):
            self.weights = effective_weights(self.declared, self.max_weight_ratio)
            cap = weight_cap(self.declared, self.max_weight_ratio)
            clipped = sorted(s for s, w in self.declared.items() if w > cap)
            if clipped:
                logger.info(
                    "weights of senders %s clipped to %g (%g x the median weight)",
                    clipped, cap, self.max_weight_ratio,
                )  # fmt: skip

    def on_fail(self, sender: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once if ``sender`` fails (e.g. to cancel its stream task)."""
        self._on_fail[sender] = callback

    @property
    def done(self) -> bool:
        return self.next_emit >= len(self.chunks)

    # ---- the sender-facing side ----

    async def wait_turn(self, sender: int, k: int) -> None:
        """Block until ``sender`` may contribute chunk ``k`` (flow control)."""
        while sender in self.active and k >= self._consumed[sender] + self.window:
            await self._changed.wait()
        if sender not in self.active:
            raise SenderFailed(self._reason(sender))

    async def contribute(self, sender: int, k: int, values: torch.Tensor) -> None:
        """Add ``sender``'s validated float32 chunk ``k`` (read-only until the chunk is
        finalized); raises SenderFailed if it was left out."""
        async with self._lock:
            if sender not in self.active:
                raise SenderFailed(self._reason(sender))
            if k < self._closed or sender in self._contributed[k]:  # a bug of the caller
                raise RuntimeError(f"chunk {k} from sender {sender} is late or duplicate")
            if sender not in self.declared:
                raise RuntimeError(f"sender {sender} contributed before declaring its weight")
            self._contributed[k].add(sender)
            if self.weights is None:
                self._deferred.append((sender, k, values))
            else:
                await self._add_deferred()
                await self._add(sender, k, values)
        self._notify()
        if sender not in self.active:  # its chunk (or a deferred one) was refused just now
            raise SenderFailed(self._reason(sender))

    async def _add(self, sender: int, k: int, values: torch.Tensor) -> None:
        """Aggregate one contribution with its normalised weight (caller holds the lock).

        The aggregation is where received chunks are checked for NaN/Inf: a sender whose
        chunk holds any is excluded (from this chunk on) and nothing of it is added.
        """
        assert self.weights is not None
        if sender not in self.active:
            return  # excluded while this (deferred) chunk waited
        agg = self._pending.get(k)
        if agg is None:
            agg = self._pending[k] = self.aggregator.begin(values.numel())
        weight = self.weights.get(sender, 0.0)
        try:
            await self._run_cpu(agg.add, values, weight, numel=agg.add_cost())
        except NonFiniteContribution as e:
            logger.info("sender %d sent NaN/Inf in chunk %d; excluded", sender, k)
            self.fail(sender, str(e), excluded=True)
        else:
            self._added[k].add(sender)

    def missing(self, k: int) -> tuple[int, ...]:
        """The senders whose contribution chunk ``k`` lacks: every sender but those that were
        added to it and those that declared weight 0 (they never contribute)."""
        return tuple(
            s for s in self.senders if s not in self._added[k] and self.declared.get(s, 1.0) > 0
        )

    async def _add_deferred(self) -> None:
        while self._deferred:
            sender, k, values = self._deferred.pop(0)
            await self._add(sender, k, values)

    async def next_result(self, sender: int) -> tuple[int, Any]:
        """The next (chunk index, wire message) to send to ``sender``; raises SenderFailed."""
        k = self._consumed[sender]
        while sender in self.active and k not in self._results:
            await self._changed.wait()
        if sender not in self.active:
            raise SenderFailed(self._reason(sender))
        return k, self._results[k]

    def mark_sent(self, sender: int, k: int) -> None:
        self._consumed[sender] = k + 1
        self._prune()
        self._notify()

    def local_result(self, k: int) -> torch.Tensor | None:
        """The float32 result of chunk ``k`` as every receiver decodes it (None = keep local)."""
        return self._local_results.pop(k)

    async def wait_finalized(self, k: int) -> None:
        while self.next_emit <= k:
            await self._changed.wait()

    def _reason(self, sender: int) -> str:
        return self.excluded.get(sender) or self.failed.get(sender) or "left out"

    def _prune(self) -> None:
        lowest = min((self._consumed[s] for s in self.active), default=self.next_emit)
        for k in [k for k in self._results if k < lowest]:
            del self._results[k]

    def all_sent(self) -> bool:
        return self.done and all(self._consumed[s] >= len(self.chunks) for s in self.active)

    # ---- the finalizing loop (runs in the round's nursery) ----

    async def _wait_for_chunk(self, k: int) -> None:
        """Until every active sender contributed chunk ``k``, or ``sender_timeout`` passed
        with none of those missing moving data (module doc)."""
        moved = self._moved_from or (lambda _s: None)
        marks = {s: moved(s) for s in self.senders}
        deadline = trio.current_time() + self.sender_timeout
        while True:
            with trio.move_on_at(deadline):
                while not self.active <= self._contributed[k]:
                    await self._changed.wait()
                return
            busy = False
            for s in self.active - self._contributed[k]:
                now, before = moved(s), marks[s]
                busy |= now is not None and before is not None and now - before >= PROGRESS_BYTES
                marks[s] = now
            if not busy:
                return
            deadline += self.sender_timeout

    async def run(self) -> None:
        """Finalize every chunk in order; returns when all are finalized."""
        for k in range(len(self.chunks)):
            await self._wait_for_chunk(k)
            async with self._lock:  # nobody adds to chunk k while we decide who is in it
                for s in sorted(self.active - self._contributed[k]):
                    logger.info(
                        "sender %d stalled on chunk %d; left out of the rest of the part", s, k
                    )
                    self.fail(
                        s, f"stalled: chunk {k} not received within {self.sender_timeout:.3g}s"
                    )
                # every sender still active has contributed chunk k, so it has declared
                self._maybe_fix_weights(force=True)
                await self._add_deferred()
                agg = self._pending.pop(k, None)
                self._closed = k + 1
                res = (
                    None
                    if agg is None
                    else await self._run_cpu(agg.result, numel=agg.result_cost())
                )
            values, dev = (None, 0.0) if res is None else res
            n = 0 if agg is None else agg.contributors
            if values is not None and not all_finite(values):
                self.nonfinite_chunks += 1
                logger.warning(
                    "chunk %d aggregated to NaN/Inf from %d contributions; not sending it "
                    "(everyone keeps local values for it)", k, n,
                )  # fmt: skip
                values, dev, n = None, 0.0, 0
            if not math.isfinite(dev):  # cannot happen for finite float32 inputs; saturate
                dev = sys.float_info.max
            msg, local = await self._finalize_fn(k, values, dev, n, self.missing(k))
            self.contributors_of[k] = msg["n"]  # 0 if the finalizer withheld the result
            self._results[k] = msg
            if self.local is not None and self.local in self.active:
                self._local_results[k] = local
            self.next_emit = k + 1
            self._prune()
            self._notify()

    async def wait_all_sent(self) -> None:
        while not self.all_sent():
            await self._changed.wait()
