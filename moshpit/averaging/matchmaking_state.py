"""Matchmaking's state: the peers of another tensor schema (kept across rounds), and one round.

Pure data and bookkeeping, no I/O: the searching side (``matchmaking.py``) and the leading
side (``matchmaking_leader.py``) of a :class:`~moshpit.averaging.matchmaking.Matchmaker` share
one :class:`MatchmakingRound` while a search runs; :class:`SchemaMemory` outlives rounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from moshpit.averaging.matchmaking_blocks import Block
from moshpit.averaging.matchmaking_messages import MAX_WHY_CHARS

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

MAX_CANDIDATES = 1024  # declarations considered per lookup
MAX_SCHEMA_MEMORY = 1024  # peers of another schema remembered across rounds (oldest dropped)


class SchemaMemory:
    """Peers known to average tensors of another schema, remembered across rounds.

    An entry is ``peer -> (schema it declared, why, warned)``: ``schema`` is what the peer's
    declaration carried when we learned of the conflict (None: no declaration seen, e.g. a
    refusal from a redirect target). :meth:`refused` answers "do not ask this peer": true only
    while the peer still declares that same schema, so a peer that re-declares with another
    schema (restarted with the right model) is asked again, and its old entry is dropped.
    ``warned`` lets the averager log a conflict once instead of every round. Bounded: at most
    ``capacity`` peers, the least recently noted dropped first. Touched only on the trio thread.
    """

    def __init__(self, capacity: int = MAX_SCHEMA_MEMORY):
        self.capacity = max(1, int(capacity))
        self._entries: OrderedDict[PeerID, tuple[bytes | None, str, bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer: PeerID) -> bool:
        return peer in self._entries

    def note(self, peer: PeerID, schema: bytes | None, why: str) -> None:
        """``peer``, declaring ``schema``, cannot average with us (``why``)."""
        old = self._entries.pop(peer, None)
        warned = old is not None and old[0] == schema and old[2]
        self._entries[peer] = (schema, why[:MAX_WHY_CHARS], warned)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def refused(self, peer: PeerID, schema: bytes | None) -> bool:
        """Did ``peer`` refuse us (or declare another schema) while declaring ``schema``?
        A peer now declaring another schema than then is forgotten (it may fit now)."""
        entry = self._entries.get(peer)
        if entry is None:
            return False
        if entry[0] != schema:
            del self._entries[peer]
            return False
        return True

    def why(self, peer: PeerID) -> str | None:
        entry = self._entries.get(peer)
        return None if entry is None else entry[1]

    def first_warning(self, peers: Iterable[PeerID]) -> list[PeerID]:
        """The ``peers`` whose current conflict was not warned about yet; marks them warned."""
        new = []
        for peer in peers:
            entry = self._entries.get(peer)
            if entry is not None and not entry[2]:
                self._entries[peer] = (entry[0], entry[1], True)
                new.append(peer)
        return new


# ---------------------------------------------------------------------------------------------
# per-round state


@dataclass
class Member:
    """One member of a group in the making (us, or a follower)."""

    peer: PeerID
    mode: str
    bandwidth: float | None
    gathered: Any
    deadline: float  # trio time by which this member stops waiting
    addrs: tuple[str, ...] = ()  # where the other members can dial it
    bytes_per_value: float | None = None  # its codec's wire bytes per value, last round
    measured_uplink: float | None = None  # bytes/s its recent rounds sent (GroupInfo)
    min_group_size: int = 1  # the smallest group it runs in (its own, or its merged group's)


@dataclass
class Lead:
    """The followers we currently lead and what we will tell them; replaced when we merge away."""

    followers: dict[PeerID, Member] = field(default_factory=dict)
    outcome: dict[str, Any] | None = None  # group / redirect / reject
    outcome_event: trio.Event = field(default_factory=trio.Event)

    def conclude(self, outcome: dict[str, Any]) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.outcome_event.set()


@dataclass
class MatchmakingRound:
    """One :meth:`Matchmaker.look_for_group`: what we declared, whom we follow or lead."""

    key: str
    order: float
    deadline: float
    started: float
    me: Member
    lead: Lead = field(default_factory=Lead)
    following: PeerID | None = None  # peer we are joining right now (None: we lead)
    orphaned: float | None = None  # when a leader that had accepted us went away (trio time)
    gone: set[PeerID] = field(default_factory=set)  # such leaders: not asked again this round
    following_addrs: tuple[str, ...] = ()
    probing: bool = False  # asking someone to lead us (not accepted yet)
    finished: bool = False
    changed: trio.Event = field(default_factory=trio.Event)
    # peers declared under the key at the last read that began after the newest follower
    # joined (None: no such read yet); when all of them follow us we need not wait longer
    declared: frozenset[PeerID] | None = None
    joins: int = 0  # followers accepted so far (a read that overlaps a join is not trusted)
    # our block of the key (None: everyone fits in one group), and the peers we stopped
    # asking this round (they would not take us, or were unreachable): none of them leads it
    block: Block[PeerID] | None = None
    passed_over: set[PeerID] = field(default_factory=set)
    # peers whose answer to a join request did not come within ``request_timeout`` (a machine
    # gone quiet: stalled links, no reset): asked again only after everyone else, and none of
    # them leads our block (see ``Matchmaker._in_block_order``)
    silent: set[PeerID] = field(default_factory=set)
    leading_since: float | None = None  # when our reads first made us our block's leader
    block_settled: bool = False  # the last read showed no looking peer not seen before
    seen_looking: set[PeerID] = field(default_factory=set)  # every looking peer read so far
    # peers that average tensors of another schema: never grouped with, reported if alone
    schema_conflicts: dict[PeerID, str] = field(default_factory=dict)
    # what each peer declared at the last read of the key (for SchemaMemory entries)
    declared_schemas: dict[PeerID, bytes | None] = field(default_factory=dict)

    def note_schema_conflict(self, peer: PeerID, why: str) -> None:
        if len(self.schema_conflicts) < MAX_CANDIDATES:
            self.schema_conflicts[peer] = why[:MAX_WHY_CHARS]

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def followers(self) -> dict[PeerID, Member]:
        return self.lead.followers

    @property
    def size(self) -> int:
        return 1 + len(self.lead.followers)
