"""The joiner's download plan: which state to fetch, and which chunk to ask which holder for.

Everything here is decided from explicit inputs (the announced records, the holders and what
they hold, the time now, how much a relay lets through), so that it can be tested without a
network; ``sharing.py`` runs it over streams.

* **Which state.** The newest epoch among those some peer announces complete; the root
  announced by the most donors breaks ties (:func:`advertised_states`). States of another
  schema are passed over unasked, unless no state of ours is announced
  (:func:`records_of_schema`).
* **Which chunks, from whom** (:meth:`DownloadPlan.pick`). Rarest first: a complete donor is
  asked first for the chunks the fewest partial holders (other joiners) hold or are fetching,
  so donors spend their upload on what the swarm cannot pass on. Equal share: one request
  carries at most an equal share of the unrequested bytes among all workers, so the last
  chunks are spread over every holder instead of queueing behind one. Endgame: once every
  missing chunk is requested, an idle holder may ask again for a chunk whose request is
  overdue (twice the typical request time; the first verified answer wins), so one slow peer
  cannot hold up the end.
* **Holders that fail.** A holder that fails :data:`MAX_FAILURES` times in a row is dropped
  for a while (:func:`note_failure`), one that says it is busy is asked again after a growing
  wait (:func:`note_busy`); chunks it was asked for go back to the unrequested ones when its
  request ends (:meth:`DownloadPlan.release`).
* **Relays.** A connection through a circuit relay carries a bounded number of bytes.
  A holder reached only through one is asked only while what is left of the download fits
  its limit with :data:`RELAY_HEADROOM` to spare, or when no complete holder reached
  otherwise is left (:func:`relay_alternatives`); manifests are asked for first from the
  donors reached best (:func:`path_rank`).
"""

from __future__ import annotations

import builtins
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from moshpit.training.sharing_protocol import REQUEST_BYTES, Record

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

__all__ = [
    "BUSY_BACKOFF",
    "MAX_FAILURES",
    "RELAY_HEADROOM",
    "AdvertisedState",
    "DownloadPlan",
    "Holder",
    "Peer",
    "advertised_states",
    "fits",
    "note_answer",
    "note_busy",
    "note_failure",
    "path_rank",
    "records_of_schema",
    "relay_alternatives",
]

MAX_FAILURES = 3  # consecutive failed calls before a peer is dropped from this download
BUSY_BACKOFF = (0.05, 2.0)  # first and largest wait after a "busy" answer, seconds
# what a relayed connection carries besides the state's chunks: the manifest's framing, the
# answers' msgpack/yamux/Noise framing, DHT and other RPCs sharing the connection
RELAY_HEADROOM = 32 * 1024

# a PeerID in the network (and so to the type checker); any hashable, orderable stand-in in
# tests, as nothing here looks inside it
Peer: TypeAlias = "PeerID"


# ---------------------------------------------------------------------------------------------
# which state


@dataclass(frozen=True)
class AdvertisedState:
    """One state announced in the DHT: its root, epoch, size and who serves it."""

    root: bytes
    epoch: int
    bytes: int
    donors: list[Peer]  # peers announcing the whole state (complete=True)
    partial: list[Peer] = field(default_factory=list)  # joiners holding part of it
    # state_schema_digest as announced (None: not announced); ``builtins.``: ``bytes`` above
    # is a field here
    schema: builtins.bytes | None = None


def advertised_states(records: Sequence[Record]) -> list[AdvertisedState]:
    """The states some peer announces complete, newest epoch first, then most donors (then
    by root, so that every joiner ranks them alike)."""
    groups: dict[tuple[bytes, int, int, bytes | None], tuple[list[Peer], list[Peer]]] = {}
    for r in records:
        key = (r.root, r.epoch, r.nbytes, r.schema)
        donors, partial = groups.setdefault(key, ([], []))
        (donors if r.complete else partial).append(r.peer)
    states = [
        AdvertisedState(root, epoch, nbytes, sorted(donors), sorted(partial), schema)
        for (root, epoch, nbytes, schema), (donors, partial) in groups.items()
        if donors
    ]
    states.sort(key=lambda s: (-s.epoch, -len(s.donors), s.root))
    return states


def records_of_schema(records: list[Record], schema: bytes | None) -> list[Record]:
    """``records`` without those announcing another schema than ``schema`` (another model
    under our prefix), unless that leaves no complete one: then all of them, so that the
    newest manifest is fetched and StateMismatchError names the difference."""
    if schema is None:
        return records
    ours = [r for r in records if r.schema is None or r.schema == schema]
    return ours if any(r.complete for r in ours) else records


# ---------------------------------------------------------------------------------------------
# holders and the plan


@dataclass
class Holder:
    """A peer we may fetch chunks from during one download."""

    peer: Peer
    complete: bool
    have: set[int] = field(default_factory=set)  # for partial holders: indices they hold
    missing: set[int] = field(default_factory=set)  # indices they said they do not hold
    asked: set[int] = field(default_factory=set)  # indices requested from it, under way
    pending: set[int] = field(default_factory=set)  # partial holder: indices it is fetching
    in_flight: int = 0
    in_flight_bytes: int = 0
    failures: int = 0
    busy_until: float = 0.0
    busy_wait: float = BUSY_BACKOFF[0]
    gone: bool = False  # dropped (dead, banned): its workers exit
    retry_at: float = 0.0  # a dropped (failing) peer may be tried again from then on
    workers: int = 0
    relay_note: str = ""  # what we last logged about reaching it only through a relay


class DownloadPlan:
    """Which chunks of one state are still needed, who holds them, and which are asked for.

    Chunk ``i`` is the ``i``-th distinct chunk of the manifest (``sizes[i]`` bytes).
    ``order`` is the order chunks are asked for on ties (a random one by default, so that
    joiners start at different chunks and can swap them)."""

    def __init__(self, sizes: Sequence[int], order: Sequence[int] | None = None) -> None:
        self.sizes = list(sizes)
        self.remaining: set[int] = set(range(len(self.sizes)))
        self.in_flight: dict[int, int] = {}  # chunk -> requests for it under way (1, or 2)
        self.verifying: set[int] = set()  # arrived, hash being checked
        self.requested_at: dict[int, float] = {}  # chunk -> when its first request went out
        self.typical = math.inf  # moving average of how long a request takes, seconds
        self.holders: dict[Peer, Holder] = {}
        if order is None:
            self.order = list(range(len(self.sizes)))
            random.shuffle(self.order)
        else:
            self.order = list(order)
        self.bytes_by_peer: dict[Peer, int] = {}

    def bytes_left(self) -> int:
        """What fetching the rest moves: the chunks, and the digests that ask for them (the
        other way, but some relays spend one budget on both directions)."""
        return sum(self.sizes[i] for i in self.remaining) + REQUEST_BYTES * len(self.remaining)

    def holds(self, h: Holder, i: int) -> bool:
        return (h.complete or i in h.have) and i not in h.missing

    def admit(self, peer: Peer, complete: bool, now: float) -> tuple[Holder, bool]:
        """The holder for an announcement of ``peer``, and whether it is a new one: a peer
        seen for the first time, or dropped and due for another try. A partial holder that
        now announces the whole state is treated as complete from then on."""
        h = self.holders.get(peer)
        if h is None or (h.gone and now >= h.retry_at):
            h = self.holders[peer] = Holder(peer, complete)
            return h, True
        if complete and not h.complete:
            h.complete = True
            h.missing.clear()
        return h, False

    def update_have(self, h: Holder, have: set[int], pending: set[int] | None) -> bool:
        """Take a partial holder's ``have`` (and ``pending``) chunks; False (nothing changed)
        for a complete holder, which holds everything whatever it says."""
        if h.complete:
            return False
        h.have = have
        h.missing.difference_update(h.have)
        if pending is not None:
            h.pending = pending - h.have
        return True

    def pick(self, h: Holder, batch_bytes: int, max_count: int, now: float) -> list[int]:
        """Chunks for ``h`` to send next, marked as requested (module doc: rarest first, an
        equal share, the endgame). Empty when ``h`` has nothing we may ask it for now."""
        unrequested = [i for i in self.order if i in self.remaining and i not in self.in_flight]
        candidates = [i for i in unrequested if self.holds(h, i)]
        if candidates:
            self._rarest_first(h, candidates)
            workers = max(1, sum(x.workers for x in self.holders.values() if not x.gone))
            share = sum(self.sizes[i] for i in unrequested) // workers
            limit = min(batch_bytes, share)
        else:
            candidates = self._overdue(h, now)
            limit = 0  # one chunk
        batch: list[int] = []
        total = 0
        for i in candidates:
            if batch and (total + self.sizes[i] > limit or len(batch) >= max_count):
                break
            batch.append(i)
            total += self.sizes[i]
        for i in batch:
            self.in_flight[i] = self.in_flight.get(i, 0) + 1
            self.requested_at.setdefault(i, now)
        h.asked.update(batch)
        return batch

    def _rarest_first(self, h: Holder, candidates: list[int]) -> None:
        """Sort a complete holder's ``candidates`` so that chunks other joiners hold or are
        fetching come last: those the swarm will spread anyway."""
        partial = [p for p in self.holders.values() if not p.complete and not p.gone]
        if h.complete and partial:
            rarity = {
                i: sum(1 for p in partial if i in p.have or i in p.pending) for i in candidates
            }
            candidates.sort(key=rarity.__getitem__)  # stable: random order on ties

    def _overdue(self, h: Holder, now: float) -> list[int]:
        """The endgame: chunks asked of one other holder, overdue, that ``h`` could send."""
        overdue = now - 2 * self.typical
        return [
            i
            for i in self.order
            if self.in_flight.get(i) == 1
            and self.requested_at.get(i, math.inf) < overdue
            and i not in h.asked
            and i not in self.verifying
            and self.holds(h, i)
        ]

    def took(self, seconds: float) -> None:
        """A request was answered after ``seconds``: update the typical request time."""
        self.typical = seconds if self.typical == math.inf else 0.8 * self.typical + 0.2 * seconds

    def release(self, h: Holder, indices: Sequence[int]) -> None:
        """A request to ``h`` for ``indices`` ended (answered or not): those not received
        are free to be asked for again."""
        for i in indices:
            left = self.in_flight.get(i, 0) - 1
            if left > 0:
                self.in_flight[i] = left
            else:
                self.in_flight.pop(i, None)
                self.requested_at.pop(i, None)
        h.asked.difference_update(indices)

    def received(self, i: int, peer: Peer) -> None:
        """Chunk ``i`` arrived from ``peer`` and verified."""
        self.remaining.discard(i)
        self.bytes_by_peer[peer] = self.bytes_by_peer.get(peer, 0) + self.sizes[i]


# ---------------------------------------------------------------------------------------------
# a holder's failures and busy answers


def note_failure(h: Holder, now: float, drop_for: float) -> float | None:
    """A network failure with ``h`` (no misbehaviour: a dead peer, a relay's cut): after
    :data:`MAX_FAILURES` in a row it is dropped (``h.gone``) until ``now + drop_for``, and
    None is returned; before that, how long its worker should pause before trying again."""
    h.failures += 1
    if h.failures >= MAX_FAILURES:
        h.gone = True
        h.retry_at = now + drop_for
        return None
    return min(0.1 * 2.0**h.failures, 2.0)


def note_busy(h: Holder, now: float, jitter: float) -> None:
    """``h`` answered busy: wait before asking again, twice as long as last time (up to
    :data:`BUSY_BACKOFF`'s bound); ``jitter`` in [0, 1) spreads joiners' retries."""
    h.busy_until = now + h.busy_wait * (0.5 + jitter)
    h.busy_wait = min(h.busy_wait * 2, BUSY_BACKOFF[1])


def note_answer(h: Holder) -> None:
    """``h`` answered a request: its failure count and busy backoff start over."""
    h.failures = 0
    h.busy_wait = BUSY_BACKOFF[0]


# ---------------------------------------------------------------------------------------------
# relays


def fits(bytes_left: int, room: int | None) -> bool:
    """Does a transfer of ``bytes_left`` fit one connection that may carry ``room`` bytes
    (None or 0: no limit)?"""
    return not room or bytes_left + RELAY_HEADROOM <= room


def path_rank(connected: bool, relayed_only: bool, addrs: Sequence[str]) -> int:
    """How well a donor is reached, best first: 0 connected directly now; 1 not connected,
    a direct address announced; 2 reached only through a relay (connected that way, or
    announcing circuit addresses only)."""
    if connected:
        return 2 if relayed_only else 0
    return 1 if any("/p2p-circuit" not in a for a in addrs) else 2


def relay_alternatives(
    plan: DownloadPlan, h: Holder, room_of: Callable[[Peer], int | None]
) -> list[Holder] | None:
    """None if ``h`` may be asked for chunks, as far as relays go: what is left fits the
    connection to it (``room_of(peer)``: None unless reached only through a relay, then the
    bytes one connection carries). Otherwise the complete holders, still there, whose
    connection it fits: ``h`` is asked only if there are none."""
    if fits(plan.bytes_left(), room_of(h.peer)):
        return None
    return [
        o
        for o in plan.holders.values()
        if o is not h and o.complete and not o.gone and fits(plan.bytes_left(), room_of(o.peer))
    ]
