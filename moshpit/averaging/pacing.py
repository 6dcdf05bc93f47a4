"""Share a member's uplink among the connections of one all-reduce round.

In a butterfly all-reduce every member sends to every other member at once: its chunks to each
reducer, and its part's results to each sender. Where peers sit behind access links, each
peer's uplink and downlink are both bottlenecks, and TCP alone shares two tiers of them badly:
flows from several uplinks pile into one downlink while other uplinks go idle (measured on
the shaped-link testbed: 76% link use, against 95% for gloo's ring, which has one flow per
link). A member that knows its uplink rate caps each of its connections at a share of that rate,
proportional to the bytes it still has to send there. The connections then finish together,
and no downlink receives much more than its owner's rate, since every member does the same.

The caps are kernel pacing rates on the TCP sockets (``P2PStream.set_max_send_rate``); the
in-memory network cannot pace, so there the pacer does nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable
from typing import Protocol

logger = logging.getLogger(__name__)

CHANGE_TO_APPLY = 0.02  # a cap moves only when its share changes by more than this fraction


class Paceable(Protocol):
    def set_max_send_rate(self, rate: float | None) -> bool: ...


class UplinkPacer:
    """Caps the send rate of each destination's connection at ``rate * left_d / sum(left)``.

    ``left_d`` counts what this member still has to send to destination ``d`` over the flows
    that have a stream attached (a flow that never starts takes no share). Flows are named by
    ``(dest, flow)``; amounts are in any unit proportional to bytes (elements, for a round
    whose codec is the same both ways). :meth:`close` lifts every cap.
    """

    def __init__(self, rate: float) -> None:
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"uplink rate must be a positive number of bytes/s, got {rate!r}")
        self.rate = float(rate)
        self._planned: dict[tuple[int, Hashable], int] = {}
        self._left: dict[tuple[int, Hashable], int] = {}  # attached flows only
        self._streams: dict[int, list[Paceable]] = {}
        self._applied: dict[int, float | None] = {}
        self.closed = False
        self.capped = 0  # how many times a cap was set (for tests and logs)

    def plan(self, dest: int, flow: Hashable, amount: int) -> None:
        """This round will send ``amount`` to ``dest`` over ``flow`` once it is attached."""
        if amount > 0:
            self._planned[(dest, flow)] = amount

    def attach(self, dest: int, flow: Hashable, stream: Paceable) -> None:
        """``flow`` to ``dest`` starts on ``stream`` (its connection gets the destination's cap)."""
        if self.closed:
            return
        amount = self._planned.pop((dest, flow), 0)
        if amount <= 0:
            return
        self._left[(dest, flow)] = amount
        streams = self._streams.setdefault(dest, [])
        if stream not in streams:
            streams.append(stream)
        self._applied.pop(dest, None)  # a new stream (perhaps a new connection) needs its cap
        self._rebalance()

    def sent(self, dest: int, flow: Hashable, amount: int) -> None:
        key = (dest, flow)
        if self.closed or key not in self._left:
            return
        self._left[key] = max(0, self._left[key] - amount)
        self._rebalance()

    def ended(self, dest: int, flow: Hashable) -> None:
        """``flow`` finished or failed: whatever it had left is no longer sent."""
        self._planned.pop((dest, flow), None)
        if self.closed or self._left.pop((dest, flow), None) is None:
            return
        self._rebalance()

    def close(self) -> None:
        """Lift every cap this pacer set (the connections outlive the round)."""
        if self.closed:
            return
        self.closed = True
        for dest, applied in self._applied.items():
            if applied is not None:
                self._apply(dest, None)
        self._left.clear()
        self._streams.clear()

    def _rebalance(self) -> None:
        per_dest: dict[int, int] = {}
        for (dest, _), left in self._left.items():
            per_dest[dest] = per_dest.get(dest, 0) + left
        total = sum(per_dest.values())
        for dest in self._streams:
            left = per_dest.get(dest, 0)
            cap = self.rate * left / total if left > 0 else None
            applied = self._applied.get(dest, -1.0)
            if cap is None or applied is None or applied == -1.0:
                changed = cap != applied
            else:
                changed = abs(cap - applied) > CHANGE_TO_APPLY * applied
            if changed:
                self._apply(dest, cap)

    def _apply(self, dest: int, cap: float | None) -> None:
        self._applied[dest] = cap
        for stream in self._streams.get(dest, ()):
            try:
                if stream.set_max_send_rate(cap) and cap is not None:
                    self.capped += 1
            except OSError as e:  # a closed connection: nothing left to pace on it
                logger.debug("cannot pace the connection to member %d: %s", dest, e)
