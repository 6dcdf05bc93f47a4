"""Matchmaking: turn "peers that want to average under the same group key" into one GroupInfo.

Protocol (``/moshpit/matchmaking/1.0.0``, one stream per join attempt, msgpack messages):

1. A peer looking for a group declares itself in the DHT under its group key (dictionary
   value, subkey = its PeerID, value = ``{"x": order, "a": [multiaddrs], "m": mode,
   "s": schema}``, expiring at its matchmaking deadline; ``schema`` hashes the shapes of its
   tensors). ``(order, PeerID)`` totally orders the peers looking under a key: earlier
   arrivals come first.
2. It reads the key and asks the first peer *before it in that order* with the same schema to
   lead it: ``{"prefix", "key", "x": order, "dl": seconds left, "m": mode, "bw",
   "g": gathered, "n": size, "s": schema}``.
   The leader answers ``{"t": "accepted"}``, ``{"t": "redirect", "to": PeerID bytes, "a": addrs}``
   (it is itself following someone: ask them) or ``{"t": "reject", "why": reason}`` (another
   schema is refused first, with a reason starting "tensor schema mismatch"); an accepted
   follower keeps the stream open and later receives ``{"t": "group", "group": GroupInfo}``,
   a redirect (the leader merged into a better group) or a reject (the leader gave up).
3. A leader finalizes as soon as it has ``target_group_size`` members; or (with
   ``start_when_all_joined``, which the averager sets for keys without grid bits) as soon as
   every peer declared under the key (same schema, not banned) follows it, as seen by a
   complete read of the key made after its newest follower joined; or once
   ``min_matchmaking_time`` has passed with at least ``min_group_size`` members; or at the
   earliest deadline of its members if it has enough by then.

Peers of another schema are never asked: a declaration with another schema (or none) is
skipped when the key is read, and a peer that refused us for our schema is not asked again
while it declares the schema it declared then (:class:`SchemaMemory`, kept across rounds and,
in the training modes, across the per-epoch averagers of a run). So a mismatched peer under
the key costs nothing beyond its record in the reads every round does anyway.

No deadlock: requests only ever go from later to earlier peers in the total order (a leader
rejects a request from a peer ordered before itself), a peer that follows someone redirects
requests instead of accepting them, and a leader that finds an earlier leader merges its
whole group into it (join with ``n`` = its group size, then redirect its followers). The
earliest peer under a key never waits on anyone, so every wait chain ends. Client-mode peers
(no inbound connections) declare (so leaders wait for them) but never lead, so they may join
anyone. Every wait has a deadline.

The network and the DHT sit behind :class:`MatchmakingBackend`, so this module is pure trio
logic; :class:`DHTMatchmakingBackend` is the real one (a ``DHTNode`` and its ``Host``).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from moshpit.averaging.errors import AveragingError
from moshpit.averaging.group_info import (
    MAX_ADDR_CHARS,
    MAX_ADDRS_PER_MEMBER,
    MAX_BYTES_PER_VALUE,
    MAX_GROUP_SIZE,
    MODE_AUX,
    MODE_CLIENT,
    MODES,
    GroupInfo,
    GroupInfoError,
    valid_bytes_per_value,
)
from moshpit.netutil import aclose_quietly, is_network_error, short

if TYPE_CHECKING:
    from dht.p2p.host import Host
    from dht.p2p.identity import PeerID

logger = logging.getLogger(__name__)

MATCHMAKING_PROTOCOL = "/moshpit/matchmaking/1.0.0"
MAX_REQUEST_BYTES = 256 * 1024  # join request incl. gathered metadata
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a GroupInfo with everyone's gathered metadata
MAX_GATHER_BYTES = 64 * 1024
MAX_KEY_CHARS = 512
MAX_ADDRS = MAX_ADDRS_PER_MEMBER
MAX_DEADLINE_SECONDS = 24 * 3600.0
# a leader tells each accepted follower (that asked for it) "still here" this often, at most;
# a follower that hears nothing for 3 intervals (at least its request timeout) stops waiting.
# Over a stalled link (a VM paused or powered off, a cable pulled) nothing else arrives, not
# even a close, and the followers of such a leader waited for its group until their deadline
HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 60.0
MAX_CANDIDATES = 1024  # declarations considered per lookup
# a withdrawn declaration expires this long after the declaration it replaces (the later
# expiration is what makes it win over the declaration in every replica and reader); the
# next declaration under the same key must expire later still (see Matchmaker._search)
WITHDRAWN_EXTRA_SECONDS = 0.01
MAX_TRIES = 3  # join attempts per declaration that answered "busy"/timed out/redirected
MAX_SCHEMA_BYTES = 64  # a tensor-schema hash (the averager sends 16 bytes)
MAX_WHY_CHARS = 512  # a reject reason we keep from another peer
RETRY = "retry"  # outcome of a join attempt worth repeating later in the round
# what one join attempt ends with: a group, RETRY, a redirect (peer, its addresses) or None
JoinOutcome = GroupInfo | tuple[Any, tuple[str, ...]] | str | None
BUSY = "busy: asking another leader, retry shortly"
SCHEMA_MISMATCH = "tensor schema mismatch"  # prefix of the reject reason for other tensors
MAX_SCHEMA_MEMORY = 1024  # peers of another schema remembered across rounds (oldest dropped)


class MatchmakingError(AveragingError):
    """A matchmaking message from another peer was malformed."""


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
        self._entries: OrderedDict[Any, tuple[bytes | None, str, bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer: Any) -> bool:
        return peer in self._entries

    def note(self, peer: Any, schema: bytes | None, why: str) -> None:
        """``peer``, declaring ``schema``, cannot average with us (``why``)."""
        old = self._entries.pop(peer, None)
        warned = old is not None and old[0] == schema and old[2]
        self._entries[peer] = (schema, why[:MAX_WHY_CHARS], warned)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def refused(self, peer: Any, schema: bytes | None) -> bool:
        """Did ``peer`` refuse us (or declare another schema) while declaring ``schema``?
        A peer now declaring another schema than then is forgotten (it may fit now)."""
        entry = self._entries.get(peer)
        if entry is None:
            return False
        if entry[0] != schema:
            del self._entries[peer]
            return False
        return True

    def why(self, peer: Any) -> str | None:
        entry = self._entries.get(peer)
        return None if entry is None else entry[1]

    def first_warning(self, peers: Any) -> list[Any]:
        """The ``peers`` whose current conflict was not warned about yet; marks them warned."""
        new = []
        for peer in peers:
            entry = self._entries.get(peer)
            if entry is not None and not entry[2]:
                self._entries[peer] = (entry[0], entry[1], True)
                new.append(peer)
        return new


class MsgStream(Protocol):
    """What matchmaking needs from a stream (``dht.p2p.P2PStream`` satisfies it)."""

    remote_peer: Any

    async def send_msg(self, obj: Any) -> None: ...

    async def receive_msg(self, max_size: int | None = None) -> Any: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Declaration:
    """One peer's "I am looking for a group" record read from the DHT."""

    peer: Any
    order: float
    addrs: tuple[str, ...]
    mode: str
    schema: bytes | None = None  # hash of the declarer's tensor shapes (None: not declared)
    # False: withdrawn, its round's group formed; kept until it expires so that it
    # supersedes the declaration (and still counts for the swarm-size estimate)
    looking: bool = True


class MatchmakingBackend(Protocol):
    """The seam between matchmaking logic and the DHT/network."""

    @property
    def local_peer(self) -> Any: ...

    def own_addrs(self) -> list[str]: ...

    def dht_time(self) -> float: ...

    async def declare(
        self, key: str, order: float, expiration: float, mode: str, **extra: Any
    ) -> bool:
        """Store our declaration; ``extra`` may hold ``schema`` (bytes) when we have one."""
        ...

    def withdraw(
        self, key: str, order: float, expiration: float, mode: str, schema: bytes | None = None
    ) -> None: ...

    async def list_candidates(self, key: str) -> list[Declaration]: ...

    async def open_stream(
        self, peer: Any, addrs: tuple[str, ...], dial_timeout: float
    ) -> MsgStream: ...

    def peer_to_bytes(self, peer: Any) -> bytes: ...

    def peer_from_bytes(self, data: bytes) -> Any: ...

    def decode_group(self, msg: Any) -> GroupInfo: ...

    def register(
        self, prefix: str, handler: Callable[[MsgStream, dict[str, Any]], Awaitable[None]]
    ) -> None: ...

    def unregister(self, prefix: str) -> None: ...


# ---------------------------------------------------------------------------------------------
# validation of untrusted messages


def _finite(x: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise MatchmakingError(f"{name} must be a finite number, got {type(x).__name__}")
    if not lo <= x <= hi:
        raise MatchmakingError(f"{name}={x} out of range [{lo}, {hi}]")
    return float(x)


def _schema(x: Any) -> bytes | None:
    if x is None:
        return None
    if not isinstance(x, bytes) or not 0 < len(x) <= MAX_SCHEMA_BYTES:
        raise MatchmakingError(f"schema must be 1..{MAX_SCHEMA_BYTES} bytes")
    return x


def _addrs(x: Any) -> tuple[str, ...]:
    if not isinstance(x, (list, tuple)) or len(x) > MAX_ADDRS:
        raise MatchmakingError(f"addrs must be a list of at most {MAX_ADDRS} strings")
    if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in x):
        raise MatchmakingError("addrs must be short strings")
    return tuple(x)


@dataclass(frozen=True)
class JoinRequest:
    """A validated request to join a leader's group."""

    key: str
    order: float
    seconds_left: float
    mode: str
    bandwidth: float | None
    gathered: Any
    size: int
    addrs: tuple[str, ...] = ()
    schema: bytes | None = None
    bytes_per_value: float | None = None
    heartbeats: bool = False  # the joiner understands "wait" messages while it follows

    def to_msg(self, prefix: str) -> dict[str, Any]:
        msg = {
            "prefix": prefix,
            "key": self.key,
            "x": self.order,
            "dl": self.seconds_left,
            "m": self.mode,
            "bw": self.bandwidth,
            "g": self.gathered,
            "n": self.size,
            "a": list(self.addrs),
        }
        if self.schema is not None:
            msg["s"] = self.schema
        if self.bytes_per_value is not None:
            msg["bpv"] = self.bytes_per_value
        if self.heartbeats:
            msg["hb"] = True
        return msg

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> JoinRequest:
        try:
            key, mode, bw, size = msg["key"], msg["m"], msg.get("bw"), msg.get("n", 1)
            order = _finite(msg["x"], "order")
            seconds_left = _finite(msg["dl"], "deadline", 0.0, MAX_DEADLINE_SECONDS)
        except KeyError as e:
            raise MatchmakingError(f"join request lacks field {e.args[0]!r}") from None
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise MatchmakingError("join request key must be a short string")
        if mode not in MODES:
            raise MatchmakingError(f"unknown mode {mode!r}")
        if bw is not None:
            bw = _finite(bw, "bandwidth", 0.0)
            if bw <= 0:
                raise MatchmakingError("bandwidth must be positive")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_GROUP_SIZE:
            raise MatchmakingError(f"group size must be an int in 1..{MAX_GROUP_SIZE}")
        bpv = msg.get("bpv")
        if bpv is not None and not valid_bytes_per_value(bpv):
            raise MatchmakingError(
                f"bytes per value must be a number in (0, {MAX_BYTES_PER_VALUE}]"
            )
        heartbeats = msg.get("hb", False)
        if not isinstance(heartbeats, bool):
            raise MatchmakingError("'hb' must be a bool")
        return cls(
            key,
            order,
            seconds_left,
            mode,
            bw,
            msg.get("g"),
            size,
            _addrs(msg.get("a", [])),
            _schema(msg.get("s")),
            None if bpv is None else float(bpv),
            heartbeats,
        )


# ---------------------------------------------------------------------------------------------
# per-round state


@dataclass
class _Member:
    peer: Any
    mode: str
    bandwidth: float | None
    gathered: Any
    deadline: float  # trio time by which this member stops waiting
    addrs: tuple[str, ...] = ()  # where the other members can dial it
    bytes_per_value: float | None = None  # its codec's wire bytes per value, last round


@dataclass
class _Lead:
    """The followers we currently lead and what we will tell them; replaced when we merge away."""

    followers: dict[Any, _Member] = field(default_factory=dict)
    outcome: dict[str, Any] | None = None  # group / redirect / reject
    outcome_event: trio.Event = field(default_factory=trio.Event)

    def conclude(self, outcome: dict[str, Any]) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.outcome_event.set()


@dataclass
class _Round:
    key: str
    order: float
    deadline: float
    started: float
    me: _Member
    lead: _Lead = field(default_factory=_Lead)
    following: Any = None  # peer we are joining right now (None: we lead)
    following_addrs: tuple[str, ...] = ()
    probing: bool = False  # asking someone to lead us (not accepted yet)
    finished: bool = False
    changed: trio.Event = field(default_factory=trio.Event)
    # peers declared under the key at the last read that began after the newest follower
    # joined (None: no such read yet); when all of them follow us we need not wait longer
    declared: frozenset[Any] | None = None
    joins: int = 0  # followers accepted so far (a read that overlaps a join is not trusted)
    # peers that average tensors of another schema: never grouped with, reported if alone
    schema_conflicts: dict[Any, str] = field(default_factory=dict)
    # what each peer declared at the last read of the key (for SchemaMemory entries)
    declared_schemas: dict[Any, bytes | None] = field(default_factory=dict)

    def note_schema_conflict(self, peer: Any, why: str) -> None:
        if len(self.schema_conflicts) < MAX_CANDIDATES:
            self.schema_conflicts[peer] = why[:MAX_WHY_CHARS]

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def followers(self) -> dict[Any, _Member]:
        return self.lead.followers

    @property
    def size(self) -> int:
        return 1 + len(self.lead.followers)


class Matchmaker:
    """Finds a group for one averager (one prefix); one search at a time."""

    def __init__(
        self,
        backend: MatchmakingBackend,
        prefix: str,
        *,
        target_group_size: int,
        min_group_size: int = 2,
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        mode: str = "node",
        bandwidth: float | None = None,
        is_banned: Callable[[Any], bool] = lambda peer: False,
        poll_interval: float | None = None,
        schema: bytes | None = None,
        schema_description: str = "",
        start_when_all_joined: bool = False,
        schema_memory: SchemaMemory | None = None,
    ):
        self._check_config(target_group_size, min_group_size, mode)
        for name, v in (
            ("min_matchmaking_time", min_matchmaking_time),
            ("request_timeout", request_timeout),
        ):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        self.backend = backend
        self.prefix = prefix
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.min_matchmaking_time = min_matchmaking_time
        self.request_timeout = max(request_timeout, 1e-3)
        self.mode = mode
        self.bandwidth = bandwidth
        # what our codec put on the wire per value in the last round (the Averager sets it;
        # with the bandwidths it sizes the group's chunks)
        self.bytes_per_value: float | None = None
        self.is_banned = is_banned
        # peers with another (or no) schema hash are never grouped with us (None: no check)
        self.schema = _schema(schema) if schema is not None else None
        self.schema_description = schema_description[:MAX_WHY_CHARS]
        # {peer: why} for the peers with another tensor schema met in the last round
        self.last_schema_conflicts: dict[Any, str] = {}
        # those peers across rounds: never asked again while they declare the same schema
        self.schema_memory = schema_memory if schema_memory is not None else SchemaMemory()
        # requests sent to peers that then refused us for our schema (tests, diagnostics)
        self.schema_refusals = 0
        # lead as soon as every peer declared under the key follows us (see _everyone_joined)
        self.start_when_all_joined = start_when_all_joined
        self.poll_interval = poll_interval or min(0.25, max(0.02, min_matchmaking_time / 10))
        self._round: _Round | None = None
        # (key, order, expiration, mode) of the last declaration, until withdrawn
        self._declared: tuple[str, float, float, str] | None = None
        # (key, expiration) of the last withdrawal: a new declaration must outlive it
        self._withdrawn: tuple[str, float] | None = None
        self._lock = trio.Lock()
        backend.register(prefix, self.handle_join)

    @staticmethod
    def _check_config(target_group_size: int, min_group_size: int, mode: str) -> None:
        if not all(isinstance(x, int) for x in (target_group_size, min_group_size)) or not (
            1 <= min_group_size <= target_group_size <= MAX_GROUP_SIZE
        ):
            raise ValueError(
                f"need integers 1 <= min_group_size ({min_group_size}) <= target_group_size "
                f"({target_group_size}) <= {MAX_GROUP_SIZE}"
            )
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def close(self) -> None:
        self.backend.unregister(self.prefix)
        if self._round is not None:
            self._round.finished = True
            self._round.lead.conclude({"t": "reject", "why": "peer is shutting down"})

    def withdraw_declaration(self) -> None:
        """Tell the key that we stopped looking (``look_for_group`` does once a group formed).

        A declaration stays in the DHT until the round's matchmaking deadline. The next
        round's peers under the same key would ask us first (earliest order) and get "not
        looking", a round trip and a dial each, while their leaders' time ran out: on WAN
        links back-to-back rounds formed partial groups and left peers alone. Nothing to do
        after a round without a group: its declaration expires at that round's deadline.
        """
        if self._declared is None:
            return
        key, order, expiration, mode = self._declared
        self._declared = None
        if expiration > self.backend.dht_time():
            self._withdrawn = (key, expiration + WITHDRAWN_EXTRA_SECONDS)
            self.backend.withdraw(key, order, expiration, mode, schema=self.schema)

    # ---- ordering ----

    def _before(self, order_a: float, peer_a: Any, order_b: float, peer_b: Any) -> bool:
        """Is (order_a, peer_a) strictly before (order_b, peer_b)?"""
        return (order_a, self.backend.peer_to_bytes(peer_a)) < (
            order_b,
            self.backend.peer_to_bytes(peer_b),
        )

    # ---- the searching side ----

    async def look_for_group(
        self, key: str, deadline: float, gathered: Any = None
    ) -> GroupInfo | None:
        """Find a group under ``key`` before ``deadline`` (trio time); None if none formed."""
        async with self._lock:
            now = trio.current_time()
            me = self.backend.local_peer
            order = self.backend.dht_time()
            rnd = _Round(
                key=key,
                order=order,
                deadline=deadline,
                started=now,
                me=_Member(
                    me,
                    self.mode,
                    self.bandwidth,
                    gathered,
                    deadline,
                    tuple(self.backend.own_addrs()[:MAX_ADDRS]),
                    self.bytes_per_value,
                ),
            )
            self._round = rnd
            self.last_schema_conflicts = {}
            try:
                group = await self._search(rnd)
                if group is not None:
                    self.withdraw_declaration()  # in the background
                return group
            finally:
                rnd.finished = True
                rnd.lead.conclude({"t": "reject", "why": "leader stopped looking"})
                self._round = None
                self.last_schema_conflicts = dict(rnd.schema_conflicts)

    async def _search(self, rnd: _Round) -> GroupInfo | None:
        me = rnd.me.peer
        client = self.mode == MODE_CLIENT
        # client-mode peers declare too (nobody dials them: they are never asked to lead),
        # so that a leader knows they are on the way and waits for them
        expiration = rnd.order + max(0.0, rnd.deadline - trio.current_time())
        if self._withdrawn is not None and self._withdrawn[0] == rnd.key:
            # per subkey the later expiration wins: a round that follows at once under the
            # same key would otherwise read as withdrawn until our withdrawal expires
            expiration = max(expiration, self._withdrawn[1] + WITHDRAWN_EXTRA_SECONDS)
        extra = {} if self.schema is None else {"schema": self.schema}
        self._declared = (rnd.key, rnd.order, expiration, self.mode)
        with trio.move_on_after(self.request_timeout):
            await self.backend.declare(rnd.key, rnd.order, expiration, self.mode, **extra)
        attempts: dict[tuple[Any, float], int] = {}  # declaration -> tries (MAX_TRIES: done)
        next_poll = trio.current_time()
        read_joins = -1  # rnd.joins when the last read of the key began
        while True:
            # taken before this pass: a change (a join) while we read or probe wakes us at once
            changed = rnd.changed
            now = trio.current_time()
            group = self._maybe_finalize(rnd, now)
            if group is not None:
                return group
            if now >= rnd.deadline or rnd.finished:
                logger.debug("matchmaking under %s timed out with %d member(s)", rnd.key, rnd.size)
                return None
            # read the key every poll_interval, and (start_when_all_joined) at once after a
            # follower joined, to see whether anyone else is still on the way
            reread = self.start_when_all_joined and rnd.joins != read_joins
            if (now >= next_poll or reread) and rnd.size < self.target_group_size:
                read_joins = rnd.joins
                candidates = await self._read_declarations(rnd)
                candidates = [
                    c
                    for c in candidates
                    if attempts.get((c.peer, c.order), 0) < MAX_TRIES
                    and (client or self._before(c.order, c.peer, rnd.order, me))
                ]
                candidates.sort(key=lambda c: (c.order, self.backend.peer_to_bytes(c.peer)))
                for cand in candidates[:MAX_CANDIDATES]:
                    if trio.current_time() >= rnd.deadline:
                        break
                    outcome = await self._follow_chain(rnd, cand.peer, cand.addrs)
                    if isinstance(outcome, GroupInfo):
                        return outcome
                    tag = (cand.peer, cand.order)
                    attempts[tag] = attempts.get(tag, 0) + 1 if outcome == RETRY else MAX_TRIES
                next_poll = trio.current_time() + self.poll_interval
            wake = min(next_poll, rnd.deadline, self._finalize_time(rnd))
            with trio.move_on_at(max(wake, trio.current_time())):
                await changed.wait()

    async def _read_declarations(self, rnd: _Round) -> list[Declaration]:
        """Read the key; return the declarations we may ask to lead us (not us, not banned,
        not client-mode, same tensor schema). Updates ``rnd.declared`` when the read is
        trusted (it then also counts client-mode peers: they join us too)."""
        me = rnd.me.peer
        joins_before = rnd.joins
        # followers that declared before joining us: a read that misses one of them (or our
        # own declaration) is incomplete, so it cannot show that nobody else is coming
        expected = {p for p, m in rnd.followers.items() if m.mode != MODE_CLIENT}
        found: list[Declaration] = []
        with trio.move_on_after(self.request_timeout) as cs:
            found = await self.backend.list_candidates(rnd.key)
        logger.debug(
            "under %s (me %s, order %.3f): %d declared: %s",
            rnd.key,
            short(me),
            rnd.order,
            len(found),
            ", ".join(f"{short(c.peer)}@{c.order:.3f}" for c in found[:8]),
        )
        seen = {c.peer for c in found}
        complete = (
            not cs.cancelled_caught
            and any(c.peer == me and c.order == rnd.order for c in found)
            and expected <= seen
        )
        usable = []
        memory = self.schema_memory
        for c in found:
            if c.peer == me or self.is_banned(c.peer):
                continue
            if len(rnd.declared_schemas) < MAX_CANDIDATES:
                rnd.declared_schemas[c.peer] = c.schema
            if self.schema is not None and c.schema != self.schema:
                # the declaration says it all: skipped without a request, every round
                theirs = c.schema.hex()[:12] if c.schema is not None else "none"
                why = (
                    f"{SCHEMA_MISMATCH}: {short(c.peer)} declared schema {theirs}, "
                    f"ours is {self.schema.hex()[:12]}"
                )
                rnd.note_schema_conflict(c.peer, why)
                if not memory.refused(c.peer, c.schema):  # new, or it changed schema
                    memory.note(c.peer, c.schema, why)
                continue
            if memory.refused(c.peer, c.schema):
                # it refused us for our schema while declaring this: do not ask it again
                rnd.note_schema_conflict(c.peer, memory.why(c.peer) or SCHEMA_MISMATCH)
                continue
            usable.append(c)
        if complete and rnd.joins == joins_before:
            # a withdrawn peer counts as one that may still come: on the shared key the
            # peers of the last round come back under the same key, and a leader that
            # started without waiting for them left them alone
            rnd.declared = frozenset(c.peer for c in usable)
        elif rnd.joins == joins_before:
            rnd.declared = None  # untrusted read (timed out or missing records): keep waiting
        # ... but nobody asks a withdrawn peer to lead: it is not looking
        return [c for c in usable if c.looking and c.mode != MODE_CLIENT]

    def _everyone_joined(self, rnd: _Round) -> bool:
        """Every peer declared under our key (by a trusted read after the newest join)
        follows us: nobody else is visible, so (with ``start_when_all_joined``) we do not wait.

        Off by default: on grid keys a leader waits up to min_matchmaking_time for peers that
        have not declared yet, so that its group is the whole grid line (exact averaging).
        The averager turns it on for the single shared key (0 key bits), where groups are
        random subsets anyway and waiting for a target the swarm cannot fill only costs time.
        """
        return (
            self.start_when_all_joined
            and rnd.declared is not None
            and rnd.declared.issubset(rnd.followers)
        )

    def _finalize_time(self, rnd: _Round) -> float:
        """Earliest time at which a group of the current size may proceed (deadline if never)."""
        if not self._can_lead_now(rnd):
            return rnd.deadline
        if self._everyone_joined(rnd):
            return rnd.started
        return min(rnd.started + self.min_matchmaking_time, self._member_deadline(rnd))

    def _can_lead_now(self, rnd: _Round) -> bool:
        if rnd.finished or rnd.following is not None or rnd.lead.outcome is not None:
            return False
        members = [rnd.me, *rnd.followers.values()]
        return (
            len(members) >= self.min_group_size
            and any(m.mode != MODE_AUX for m in members)  # someone has tensors
            and any(m.mode != MODE_CLIENT for m in members)  # someone can reduce
        )

    @staticmethod
    def _member_deadline(rnd: _Round) -> float:
        return min([rnd.deadline] + [m.deadline for m in rnd.followers.values()])

    def _maybe_finalize(self, rnd: _Round, now: float) -> GroupInfo | None:
        if not self._can_lead_now(rnd):
            return None
        members = [rnd.me, *rnd.followers.values()]
        if len(members) < self.target_group_size and now < self._finalize_time(rnd):
            return None
        group = GroupInfo(
            group_id=os.urandom(16),
            members=tuple(m.peer for m in members),
            modes=tuple(m.mode for m in members),
            bandwidths=tuple(m.bandwidth for m in members),
            gathered=tuple(m.gathered for m in members),
            addrs=tuple(m.addrs for m in members),
            bytes_per_value=tuple(m.bytes_per_value for m in members),
        )
        logger.debug(
            "leading group %s under %s: %d members", group.group_id.hex()[:8], rnd.key, group.size
        )
        rnd.finished = True
        rnd.lead.conclude({"t": "group", "group": group.to_msg()})
        return group

    async def _follow_chain(self, rnd: _Round, peer: Any, addrs: tuple[str, ...]) -> Any:
        """Join ``peer``, following redirects (each one strictly earlier in the order).

        Returns a GroupInfo, :data:`RETRY` (the candidate may still lead later: it was busy or
        following someone) or None (it will not take us this round).
        """
        retry = False
        for _ in range(MAX_GROUP_SIZE):
            result = await self._try_join(rnd, peer, addrs)
            if isinstance(result, GroupInfo):
                return result
            if result == RETRY:
                return RETRY
            if not isinstance(result, tuple):
                return RETRY if retry else None
            retry = True  # the candidate follows someone; it may lead again if that fails
            peer, addrs = result
            # (a redirect target accepted a leader of our schema: it is skipped only if it
            # refused us while declaring what it declares now)
            if (
                peer == rnd.me.peer
                or self.is_banned(peer)
                or (
                    peer in rnd.declared_schemas
                    and self.schema_memory.refused(peer, rnd.declared_schemas[peer])
                )
                or trio.current_time() >= rnd.deadline
            ):
                break
        return RETRY if retry else None

    async def _try_join(self, rnd: _Round, peer: Any, addrs: tuple[str, ...]) -> JoinOutcome:
        """One join attempt. Returns a GroupInfo, None (failed), :data:`RETRY` or
        ``(peer, addrs)`` to try next."""
        remaining = rnd.deadline - trio.current_time()
        if remaining <= 0:
            return None
        request = JoinRequest(
            key=rnd.key,
            order=rnd.order,
            seconds_left=remaining,
            mode=self.mode,
            bandwidth=self.bandwidth,
            gathered=rnd.me.gathered,
            size=rnd.size,
            addrs=rnd.me.addrs,
            schema=self.schema,
            bytes_per_value=rnd.me.bytes_per_value,
            heartbeats=True,
        )
        rnd.probing = True
        stream = None
        try:
            with trio.move_on_after(min(self.request_timeout, remaining)) as cs:
                stream = await self.backend.open_stream(
                    peer, addrs, dial_timeout=self.request_timeout
                )
                await stream.send_msg(request.to_msg(self.prefix))
                reply = await stream.receive_msg(max_size=MAX_RESPONSE_BYTES)
            if cs.cancelled_caught:
                logger.debug("join request to %s timed out", peer)
                return RETRY
            why = reply.get("why") if isinstance(reply, Mapping) else None
            if isinstance(why, str) and why.startswith(SCHEMA_MISMATCH):
                why = f"{short(peer)} refused us: {why}"
                rnd.note_schema_conflict(peer, why)
                # remembered with what it declares: not asked again while that stays the same
                self.schema_memory.note(peer, rnd.declared_schemas.get(peer), why)
                self.schema_refusals += 1
            outcome = self._parse_reply(reply)
            if outcome[0] != "accepted":
                return outcome[1]
            rnd.following, rnd.following_addrs = peer, addrs
            # accepted: our own followers go where we go; we start a fresh lead if this fails
            if rnd.followers:
                rnd.lead.conclude(
                    {"t": "redirect", "to": self.backend.peer_to_bytes(peer), "a": list(addrs)}
                )
                rnd.lead = _Lead()
            # wait for the leader's decision until a little after our own deadline; a leader
            # that promised heartbeats and goes quiet is gone (its group never comes)
            silence = self._silence_limit(reply)
            with trio.move_on_at(rnd.deadline + self.request_timeout):
                while True:
                    with trio.move_on_after(silence) as quiet:
                        reply = await stream.receive_msg(max_size=MAX_RESPONSE_BYTES)
                    if quiet.cancelled_caught:
                        logger.debug("leader %s silent for %.1fs: looking on", peer, silence)
                        return None
                    if isinstance(reply, Mapping) and reply.get("t") == "wait":
                        continue
                    kind, value = self._parse_reply(reply, accepted_ok=False)
                    return value  # a group, a redirect target or None
            logger.debug("leader %s did not send a group in time", peer)
            return None
        except (MatchmakingError, GroupInfoError) as e:
            logger.warning("bad matchmaking reply from %s: %s", peer, e)
            return None
        except Exception as e:  # network failures: try someone else
            if not is_network_error(e):
                raise
            logger.debug("join request to %s failed: %r", peer, e)
            return None
        finally:
            rnd.probing = False
            rnd.following, rnd.following_addrs = None, ()
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    try:
                        await stream.aclose()
                    except Exception as e:
                        if not is_network_error(e):
                            raise

    def _silence_limit(self, accepted: Mapping[str, Any]) -> float:
        """How long a follower waits for a word from its leader (inf: it sends none)."""
        interval = accepted.get("hb")
        if interval is None:
            return math.inf  # a leader without heartbeats: wait for the group as before
        try:
            interval = _finite(interval, "heartbeat interval", 1e-3, MAX_HEARTBEAT_SECONDS)
        except MatchmakingError as e:
            raise MatchmakingError(f"bad 'accepted' reply: {e}") from None
        return max(3 * interval, self.request_timeout)

    def _parse_reply(self, reply: Any, accepted_ok: bool = True) -> tuple[str, JoinOutcome]:
        if not isinstance(reply, Mapping):
            raise MatchmakingError("matchmaking reply must be a map")
        kind = reply.get("t")
        if kind == "accepted" and accepted_ok:
            return "accepted", None
        if kind == "reject":
            why = reply.get("why")
            logger.debug("join rejected: %s", why if isinstance(why, str) else "?")
            return "reject", RETRY if why == BUSY else None
        if kind == "redirect":
            to = reply.get("to")
            if not isinstance(to, bytes) or len(to) > 128:
                raise MatchmakingError("redirect target must be PeerID bytes")
            try:
                target = self.backend.peer_from_bytes(to)
            except Exception as e:
                raise MatchmakingError(f"redirect target is not a PeerID: {e}") from e
            return "redirect", (target, _addrs(reply.get("a", [])))
        if kind == "group":
            group = self.backend.decode_group(reply.get("group"))
            me = self.backend.local_peer
            group.index_of(me)  # raises GroupInfoError if we are not in it
            return "group", group
        raise MatchmakingError(f"unexpected matchmaking reply type {kind!r}")

    # ---- the leading side ----

    async def handle_join(self, stream: MsgStream, msg: dict[str, Any]) -> None:
        """Serve one join request (the dispatcher already read ``msg`` from ``stream``)."""
        peer = stream.remote_peer
        try:
            request = JoinRequest.from_msg(msg)
        except MatchmakingError as e:
            logger.info("malformed join request from %s: %s", peer, e)
            await stream.send_msg({"t": "reject", "why": f"malformed request: {e}"})
            return
        if request.gathered is not None and _packed_size(request.gathered) > MAX_GATHER_BYTES:
            await stream.send_msg({"t": "reject", "why": "gathered metadata too large"})
            return
        rnd = self._round
        why = self._refusal(rnd, peer, request)
        if why == "redirect" and rnd is not None:
            await stream.send_msg(
                {
                    "t": "redirect",
                    "to": self.backend.peer_to_bytes(rnd.following),
                    "a": list(rnd.following_addrs),
                }
            )
            return
        if why is not None or rnd is None:  # (_refusal says why whenever there is no round)
            await stream.send_msg({"t": "reject", "why": why or "not looking for a group"})
            return
        member = _Member(
            peer,
            request.mode,
            request.bandwidth,
            request.gathered,
            trio.current_time() + request.seconds_left,
            request.addrs,
            request.bytes_per_value,
        )
        rnd.lead.followers[peer] = member
        rnd.joins += 1
        rnd.declared = None  # someone else may be on the way: read the key again first
        rnd.notify()
        await self._serve_follower(stream, rnd, member, request.heartbeats)

    async def _serve_follower(
        self, stream: MsgStream, rnd: _Round, member: _Member, heartbeats: bool
    ) -> None:
        """Hold an accepted follower's stream until the group forms (then send it the group),
        the follower leaves, or its deadline passes; heartbeats tell it we are still here."""
        lead, peer = rnd.lead, member.peer
        interval = min(HEARTBEAT_SECONDS, self.request_timeout / 3)
        try:
            accepted: dict[str, Any] = {"t": "accepted"}
            if heartbeats:
                accepted["hb"] = interval
            await stream.send_msg(accepted)
            async with trio.open_nursery() as nursery:
                if heartbeats:

                    async def heartbeat() -> None:
                        while lead.outcome is None:
                            with trio.move_on_after(interval):
                                await lead.outcome_event.wait()
                            if lead.outcome is not None:
                                return
                            # shielded: a message cut in half would garble the group message
                            # after it; a send that cannot finish means the follower is gone
                            with trio.CancelScope(shield=True):
                                with trio.move_on_after(self.request_timeout) as stalled:
                                    await stream.send_msg({"t": "wait"})
                            if stalled.cancelled_caught:
                                lead.followers.pop(peer, None)
                                rnd.notify()
                                nursery.cancel_scope.cancel()
                                return

                    nursery.start_soon(heartbeat)

                async def watch_follower() -> None:
                    # any message or EOF from an accepted follower means it left
                    try:
                        await stream.receive_msg(max_size=1024)
                    except Exception as e:
                        if not is_network_error(e):
                            raise
                    if lead.outcome is None:
                        lead.followers.pop(peer, None)
                        rnd.notify()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_follower)
                with trio.move_on_at(member.deadline + self.request_timeout):
                    await lead.outcome_event.wait()
                nursery.cancel_scope.cancel()
            if lead.outcome is not None and peer in lead.followers:
                with trio.move_on_after(self.request_timeout):
                    await stream.send_msg(lead.outcome)
        except Exception as e:
            if not is_network_error(e):
                raise
            logger.debug("lost follower %s: %r", peer, e)
        finally:
            if lead.outcome is None:
                lead.followers.pop(peer, None)
                rnd.notify()

    def _refusal(self, rnd: _Round | None, peer: Any, request: JoinRequest) -> str | None:
        """Why we cannot accept ``peer`` now ("redirect": ask whom we follow), or None."""
        if self.schema is not None and request.schema != self.schema:
            # checked first: it is final whatever we are doing, and the joiner must learn it
            theirs = request.schema.hex()[:12] if request.schema is not None else "none"
            why = (
                f"{SCHEMA_MISMATCH}: you sent schema {theirs}, ours is {self.schema.hex()[:12]}"
                f" ({self.schema_description or 'different tensors'}); peers average only"
                " tensors of identical shapes"
            )
            if rnd is not None and not rnd.finished:
                rnd.note_schema_conflict(peer, why)
                if not self.schema_memory.refused(peer, request.schema):
                    self.schema_memory.note(peer, request.schema, why)
            return why
        if rnd is None or rnd.finished:
            return "not looking for a group"
        if request.key != rnd.key:
            return "looking under a different key"
        if self.mode == MODE_CLIENT:
            return "client-mode peers do not lead groups"
        if rnd.following is not None:
            return "redirect"
        if rnd.probing:
            return BUSY
        if self.is_banned(peer):
            return "you failed recent rounds"
        if peer in rnd.followers or peer == rnd.me.peer:
            return "already a member"
        if request.mode != MODE_CLIENT and not self._before(
            rnd.order, rnd.me.peer, request.order, peer
        ):
            return "you are before me in the order; I will ask you"
        if rnd.size + request.size > self.target_group_size:
            return "group is full"
        return None


def _packed_size(obj: Any) -> int:
    import msgpack

    try:
        return len(msgpack.packb(obj, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return MAX_GATHER_BYTES + 1


# ---------------------------------------------------------------------------------------------
# serving: one stream handler per Host, dispatching by prefix


class MatchmakingDispatcher:
    """Reads the first message of an incoming matchmaking stream and hands it to the averager
    registered under its prefix, so several averagers can share one Host."""

    def __init__(self, first_message_timeout: float = 10.0):
        self.handlers: dict[str, Callable[[MsgStream, dict[str, Any]], Awaitable[None]]] = {}
        self.first_message_timeout = first_message_timeout

    async def handle_stream(self, stream: MsgStream) -> None:
        try:
            msg = None
            with trio.move_on_after(self.first_message_timeout):
                msg = await stream.receive_msg(max_size=MAX_REQUEST_BYTES)
            if msg is None:
                logger.info(
                    "matchmaking stream from %s sent no request in time", stream.remote_peer
                )
                return
            prefix = msg.get("prefix") if isinstance(msg, Mapping) else None
            handler = self.handlers.get(prefix) if isinstance(prefix, str) else None
            if handler is None:
                why = (
                    "malformed request"
                    if not isinstance(prefix, str)
                    else "no averager under this prefix"
                )
                await stream.send_msg({"t": "reject", "why": why})
                return
            await handler(stream, msg)
        except Exception as e:
            if not is_network_error(e):
                raise
            logger.debug("matchmaking stream from %s failed: %r", stream.remote_peer, e)
        finally:
            await aclose_quietly(stream)


_dispatchers: weakref.WeakKeyDictionary[Any, MatchmakingDispatcher] = weakref.WeakKeyDictionary()


def dispatcher_for_host(host: Any) -> MatchmakingDispatcher:
    """The Host's matchmaking dispatcher, registering the stream handler on first use."""
    dispatcher = _dispatchers.get(host)
    if dispatcher is None:
        dispatcher = _dispatchers[host] = MatchmakingDispatcher()
        host.set_stream_handler(MATCHMAKING_PROTOCOL, dispatcher.handle_stream)
    return dispatcher


class DHTMatchmakingBackend:
    """The real backend: declarations in a ``DHTNode``, join streams over its ``Host``."""

    # reads and declarations use the peers that answered within this many seconds: one peer
    # that stalls (no answer, no refusal) would otherwise hold every read and store of the
    # key for the DHT's RPC timeout, as long as the matchmaker gives them, and its whole line
    # would see nobody (not even itself) for the round
    dht_patience = 1.5

    def __init__(self, node: Any):
        from dht.p2p.identity import PeerID

        self._PeerID = PeerID
        self.node = node
        if node.host is None:
            raise ValueError("the DHT node has no Host (a loopback-fabric node cannot average)")
        self.host: Host = node.host
        self.dispatcher = dispatcher_for_host(self.host)

    @property
    def local_peer(self) -> Any:
        return self.host.peer_id

    def own_addrs(self) -> list[str]:
        visible = getattr(self.node, "get_visible_maddrs", None)
        addrs = visible() if visible is not None else []
        addrs = addrs or self.host.listen_addrs
        return [str(a) for a in addrs if len(str(a)) <= MAX_ADDR_CHARS][:MAX_ADDRS]

    def dht_time(self) -> float:
        from dht.kademlia.clock import get_dht_time

        return get_dht_time()

    async def declare(
        self,
        key: str,
        order: float,
        expiration: float,
        mode: str,
        schema: bytes | None = None,
    ) -> bool:
        value: dict[str, Any] = {"x": order, "a": self.own_addrs(), "m": mode}
        if schema is not None:
            value["s"] = schema
        subkey = self.local_peer.to_base58()
        return bool(
            await self.node.store(key, value, expiration, subkey, patience=self.dht_patience)
        )

    def withdraw(
        self, key: str, order: float, expiration: float, mode: str, schema: bytes | None = None
    ) -> None:
        # per subkey the record that expires last wins, so the withdrawal outlives the
        # declaration by a moment; stored in the background: the all-reduce does not wait
        value: dict[str, Any] = {"x": order, "a": [], "m": mode, "w": True}
        if schema is not None:
            value["s"] = schema
        timeout = max(1.0, expiration - self.dht_time())
        self.node.store_in_background(
            key, value, expiration + WITHDRAWN_EXTRA_SECONDS, self.local_peer.to_base58(),
            timeout=timeout,
        )  # fmt: skip

    async def list_candidates(self, key: str) -> list[Declaration]:
        found = await self.node.get(key, latest=True, patience=self.dht_patience)
        if found is None or not isinstance(found.value, Mapping):
            return []
        out = []
        for subkey, item in list(found.value.items())[:MAX_CANDIDATES]:
            try:
                peer = self._PeerID.from_base58(subkey)
                value = item.value
                if not isinstance(value, Mapping) or value.get("m") not in MODES:
                    raise MatchmakingError("declaration must be a map with a valid mode")
                withdrawn = value.get("w", False)
                if not isinstance(withdrawn, bool):
                    raise MatchmakingError("declaration's 'w' must be a bool")
                out.append(
                    Declaration(
                        peer,
                        _finite(value.get("x"), "order"),
                        _addrs(value.get("a", [])),
                        value["m"],
                        _schema(value.get("s")),
                        looking=not withdrawn,
                    )
                )
            except Exception as e:  # a bad record from someone: ignore it, keep the rest
                logger.debug("ignoring bad declaration %r under %s: %s", subkey, key, e)
        return out

    async def open_stream(
        self, peer: Any, addrs: tuple[str, ...], dial_timeout: float
    ) -> MsgStream:
        if addrs and not self.host.is_connected(peer):
            from dht.p2p.multiaddr import Multiaddr

            parsed = []
            for a in addrs:
                try:
                    parsed.append(Multiaddr(a).without_peer_id())
                except ValueError:
                    continue
            if parsed:
                self.host.peerstore.add_addrs(peer, parsed)
        return await self.host.new_stream(peer, MATCHMAKING_PROTOCOL, timeout=dial_timeout)

    def peer_to_bytes(self, peer: PeerID) -> bytes:
        return peer.to_bytes()

    def peer_from_bytes(self, data: bytes) -> Any:
        return self._PeerID.from_bytes(data)

    def decode_group(self, msg: Any) -> GroupInfo:
        return GroupInfo.from_msg(msg)

    def register(
        self, prefix: str, handler: Callable[[MsgStream, dict[str, Any]], Awaitable[None]]
    ) -> None:
        if prefix in self.dispatcher.handlers:
            raise ValueError(f"an averager with prefix {prefix!r} already runs on this host")
        self.dispatcher.handlers[prefix] = handler

    def unregister(self, prefix: str) -> None:
        self.dispatcher.handlers.pop(prefix, None)
