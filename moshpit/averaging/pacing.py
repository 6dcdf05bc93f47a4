"""Share a member's uplink among the connections of its all-reduce rounds.

In a butterfly all-reduce every member sends to every other member at once: its chunks to each
reducer, and its part's results to each sender. Where peers sit behind access links, each
peer's uplink and downlink are both bottlenecks, and TCP alone shares two tiers of them badly:
flows from several uplinks pile into one downlink while other uplinks go idle (measured on
the shaped-link testbed: 71-82% link use, against 89-95% for gloo's ring, which has one flow
per link). A member that knows its uplink rate caps each of its connections at a share of that
rate, proportional to the bytes it still has to send there. The connections then finish
together, and no downlink receives much more than its owner's rate, since every member does
the same.

The caps are kernel pacing rates on the TCP sockets (``P2PStream.set_max_send_rate``); the
in-memory network cannot pace, so there the pacer does nothing. A cap belongs to a
connection, and rounds of several averagers on one Host may share connections, so one pacer
serves every round of an ``AllReduceService``: shares are computed over all their flows.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Protocol

CHANGE_TO_APPLY = 0.02  # a cap moves only when its share changes by more than this fraction
# A round whose bytes keep the slowest stated link busy for less than this (``partition.
# round_link_seconds``) is bound by the codecs' CPU, and pacing only adds to it: paced sockets
# fill more often, and every partial write and wait costs event-loop time. 4 x 4M at 1 Gbit/s
# on 2 shared cores, time / gloo's, TCP -> paced: float16 (0.1 s on the link) 0.56-0.61x ->
# 0.64-0.71x, 8-bit (0.05 s) 0.65-0.72x -> 0.71-0.77x; uncompressed (0.2 s) 1.09-1.20x ->
# 1.08-1.15x, and every dense codec at 100 Mbit/s (>= 0.5 s) gains.
PACE_MIN_LINK_SECONDS = 0.15


class Paceable(Protocol):
    def set_max_send_rate(self, rate: float | None) -> bool: ...


FlowKey = tuple[Hashable, Hashable, Hashable]  # (round, destination peer, flow name)
_NEVER = object()  # a destination whose connection was never given a cap


class UplinkPacer:
    """Caps each destination's connection at ``rate * left_d / sum(left)``.

    ``left_d`` counts what this member still has to send to destination ``d`` over the flows
    that have a stream attached (a flow that never starts takes no share), summed over every
    round in progress; ``rate`` is the largest rate those rounds stated. Amounts are in any
    unit proportional to bytes (elements, for rounds whose codec is the same both ways).
    Rounds use it through :meth:`round`.
    """

    def __init__(self) -> None:
        self._rates: dict[Hashable, float] = {}
        self._planned: dict[FlowKey, int] = {}
        self._left: dict[FlowKey, int] = {}  # attached flows only
        self._streams: dict[tuple[Hashable, Hashable], list[Paceable]] = {}  # (round, dest)
        self._applied: dict[Hashable, float | None] = {}  # dest -> its cap now
        self.capped = 0  # how many times a cap was set (for tests and logs)

    def round(self, key: Hashable, rate: float) -> RoundPacing:
        """Start pacing a round's flows at ``rate`` bytes/s (finish with ``RoundPacing.close``)."""
        valid = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        if not (valid and math.isfinite(rate) and rate > 0):
            raise ValueError(f"uplink rate must be a positive number of bytes/s, got {rate!r}")
        if key in self._rates:
            raise ValueError(f"round {key!r} is already paced")
        self._rates[key] = float(rate)
        return RoundPacing(self, key)

    @property
    def rate(self) -> float | None:
        return max(self._rates.values()) if self._rates else None

    def _plan(self, key: FlowKey, amount: int) -> None:
        if amount > 0 and key[0] in self._rates:
            self._planned[key] = amount

    def _attach(self, key: FlowKey, stream: Paceable) -> None:
        amount = self._planned.pop(key, 0)
        if amount <= 0:
            return
        self._left[key] = amount
        streams = self._streams.setdefault((key[0], key[1]), [])
        if stream not in streams:
            streams.append(stream)
            self._applied.pop(key[1], None)  # perhaps a new connection: it needs its cap
        self._rebalance()

    def _sent(self, key: FlowKey, amount: int) -> None:
        if key in self._left:
            self._left[key] = max(0, self._left[key] - amount)
            self._rebalance()

    def _ended(self, key: FlowKey) -> None:
        self._planned.pop(key, None)
        if self._left.pop(key, None) is not None:
            self._rebalance()

    def _close(self, round_key: Hashable) -> None:
        if self._rates.pop(round_key, None) is None:
            return
        for table in (self._planned, self._left):
            for key in [k for k in table if k[0] == round_key]:
                del table[key]
        # lift the round's own connections first: another round may share them, and then
        # gets its cap back from the rebalance below
        for rk, dest in [k for k in self._streams if k[0] == round_key]:
            for stream in self._streams.pop((rk, dest)):
                self._set(stream, None)
            self._applied.pop(dest, None)
        self._rebalance()

    def _rebalance(self) -> None:
        rate = self.rate
        per_dest: dict[Hashable, int] = {}
        for (_, dest, _), left in self._left.items():
            per_dest[dest] = per_dest.get(dest, 0) + left
        total = sum(per_dest.values())
        for dest in {d for _, d in self._streams}:
            left = per_dest.get(dest, 0)
            cap = rate * left / total if left > 0 and rate is not None else None
            applied = self._applied.get(dest, _NEVER)
            if not isinstance(applied, float) or cap is None:  # never set, or no cap
                changed = cap is not applied
            else:
                changed = abs(cap - applied) > CHANGE_TO_APPLY * applied
            if changed:
                self._applied[dest] = cap
                for (_, d), streams in self._streams.items():
                    for stream in streams if d == dest else ():
                        self._set(stream, cap)

    def _set(self, stream: Paceable, cap: float | None) -> None:
        # a closed connection reports False (the transport swallows the socket's error)
        if stream.set_max_send_rate(cap) and cap is not None:
            self.capped += 1


class RoundPacing:
    """One round's flows in an :class:`UplinkPacer` (destinations are peer ids)."""

    def __init__(self, pacer: UplinkPacer, key: Hashable) -> None:
        self.pacer = pacer
        self.key = key
        self.closed = False

    def plan(self, dest: Hashable, flow: Hashable, amount: int) -> None:
        """This round will send ``amount`` to ``dest`` over ``flow`` once it is attached."""
        if not self.closed:
            self.pacer._plan((self.key, dest, flow), amount)

    def attach(self, dest: Hashable, flow: Hashable, stream: Paceable) -> None:
        """``flow`` to ``dest`` starts on ``stream`` (its connection gets the destination's cap)."""
        if not self.closed:
            self.pacer._attach((self.key, dest, flow), stream)

    def sent(self, dest: Hashable, flow: Hashable, amount: int) -> None:
        if not self.closed:
            self.pacer._sent((self.key, dest, flow), amount)

    def ended(self, dest: Hashable, flow: Hashable) -> None:
        """``flow`` finished or failed: whatever it had left is no longer sent."""
        if not self.closed:
            self.pacer._ended((self.key, dest, flow))

    def close(self) -> None:
        """The round is over: its flows go, and so do its caps (the connections outlive it)."""
        if not self.closed:
            self.closed = True
            self.pacer._close(self.key)
