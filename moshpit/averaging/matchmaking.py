"""Matchmaking: turn "peers that want to average under the same group key" into one GroupInfo.

Protocol (``/moshpit/matchmaking/1.0.0``, one stream per join attempt, msgpack messages):

1. A peer looking for a group declares itself in the DHT under its group key (dictionary
   value, subkey = its PeerID, value = ``{"x": order, "a": [multiaddrs], "m": mode,
   "s": schema}``, expiring at its matchmaking deadline; ``schema`` hashes the shapes of its
   tensors). ``(order, PeerID)`` totally orders the peers looking under a key: earlier
   arrivals come first.
2. It reads the key and asks the first peer *before it in that order* with the same schema to
   lead it. On a crowded key (more looking peers than ``target_group_size``) the peers are
   ranked into blocks of one group each, arrivals within 0.25 s shuffled anew every round: a
   block's earliest arrival leads and asks nobody, the others ask it first
   (``matchmaking_blocks.py``). The request: ``{"prefix", "key", "x": order,
   "dl": seconds left, "m": mode, "bw", "g": gathered, "n": size, "s": schema,
   "min": the smallest group it runs in}``.
   The leader answers ``{"t": "accepted"}``, ``{"t": "redirect", "to": PeerID bytes, "a": addrs}``
   (it is itself following someone: ask them) or ``{"t": "reject", "why": reason}`` (another
   schema is refused first, with a reason starting "tensor schema mismatch"); an accepted
   follower keeps the stream open and later receives ``{"t": "group", "group": GroupInfo}``,
   a redirect (the leader merged into a better group) or a reject (the leader gave up).
3. A leader finalizes as soon as it has ``target_group_size`` members; or (with
   ``start_when_all_joined``, which the averager sets for keys without grid bits) as soon as
   every peer declared under the key (same schema, not banned; on a crowded key: every
   peer of its block) follows it, as seen by a complete read of the key made after its
   newest follower joined; or once
   ``min_matchmaking_time`` has passed with at least ``min_group_size`` members; or at the
   earliest deadline of its members if it has enough by then. "Enough" is the largest
   ``min_group_size`` of any member (up to the target): a follower's minimum binds the group
   as much as the leader's, and a group that cannot reach it does not run.

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

Where it lives: this module is the searching side (declare, read the key, ask a leader,
follow it) and the public names; the leading side (accept joiners, finalize the group) is in
``matchmaking_leader.py``, the messages and their validation in ``matchmaking_messages.py``,
the round's state and :class:`SchemaMemory` in ``matchmaking_state.py``, the backends and the
per-Host stream dispatcher in ``matchmaking_backend.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from moshpit.averaging.group_info import (
    MAX_GROUP_SIZE,
    MODE_CLIENT,
    MODES,
    GroupInfo,
    GroupInfoError,
)
from moshpit.averaging.matchmaking_backend import (
    DHTMatchmakingBackend,
    MatchmakingBackend,
    MatchmakingDispatcher,
    MsgStream,
    dispatcher_for_host,
)
from moshpit.averaging.matchmaking_blocks import Block, block_of, rank
from moshpit.averaging.matchmaking_leader import LeaderSide
from moshpit.averaging.matchmaking_messages import (
    BUSY,
    BUSY_NOW,
    MATCHMAKING_PROTOCOL,
    MAX_ADDRS,
    MAX_GATHER_BYTES,
    MAX_HEARTBEAT_SECONDS,
    MAX_RESPONSE_BYTES,
    MAX_WHY_CHARS,
    RETRY,
    SCHEMA_MISMATCH,
    WITHDRAWN_EXTRA_SECONDS,
    Declaration,
    JoinOutcome,
    JoinRequest,
    MatchmakingError,
    check_addrs,
    check_finite,
    check_schema,
)
from moshpit.averaging.matchmaking_state import (
    MAX_CANDIDATES,
    Lead,
    MatchmakingRound,
    Member,
    SchemaMemory,
)
from moshpit.netutil import is_network_error, short

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

__all__ = [  # the public names, wherever they live
    "MATCHMAKING_PROTOCOL",
    "MAX_CANDIDATES",
    "MAX_GATHER_BYTES",
    "DHTMatchmakingBackend",
    "Declaration",
    "JoinRequest",
    "Matchmaker",
    "MatchmakingBackend",
    "MatchmakingDispatcher",
    "MatchmakingError",
    "MsgStream",
    "SchemaMemory",
    "dispatcher_for_host",
]

logger = logging.getLogger(__name__)

MAX_TRIES = 3  # join attempts per declaration that timed out or redirected
# "busy" answers per declaration. Busy is a round trip, not a timeout, and it ends when the
# candidate's own request does: two late arrivals on a key whose group had formed used to
# give up on each other after 3 (the earlier one was asking the finished peers one by one),
# and both stayed alone for the whole window (the full stack at 256 peers, a peer back from
# a cut). 24 polls: 6 s of the candidate asking others at the default 0.25-s poll.
MAX_BUSY = 24
# a candidate redirected us to a leader we saw go silent: it will notice too, not a try spent
ORPHANED = "orphaned"


class Matchmaker(LeaderSide):
    """Finds a group for one averager (one prefix); one search at a time.

    The searching side is here; the leading side (serving join requests, finalizing the
    group) is inherited from :class:`~moshpit.averaging.matchmaking_leader.LeaderSide`.
    """

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
        is_banned: Callable[[PeerID], bool] = lambda peer: False,
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
        # the send rate our recent rounds reached (the Averager sets it while no bandwidth is
        # stated; it sizes the group's time allowance)
        self.measured_uplink: float | None = None
        self.is_banned = is_banned
        # peers with another (or no) schema hash are never grouped with us (None: no check)
        self.schema = check_schema(schema) if schema is not None else None
        self.schema_description = schema_description[:MAX_WHY_CHARS]
        # {peer: why} for the peers with another tensor schema met in the last round
        self.last_schema_conflicts: dict[PeerID, str] = {}
        # those peers across rounds: never asked again while they declare the same schema
        self.schema_memory = schema_memory if schema_memory is not None else SchemaMemory()
        # requests sent to peers that then refused us for our schema (tests, diagnostics)
        self.schema_refusals = 0
        # lead as soon as every peer declared under the key follows us (see _everyone_joined)
        self.start_when_all_joined = start_when_all_joined
        self.poll_interval = poll_interval or min(0.25, max(0.02, min_matchmaking_time / 10))
        self._round: MatchmakingRound | None = None
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

    @property
    def alone(self) -> bool:
        """A search is under way, nobody has joined us, and we are not joining anyone."""
        rnd = self._round
        return (
            rnd is not None
            and not rnd.finished
            and not rnd.followers
            and not rnd.probing
            and rnd.following is None
        )

    @property
    def saw_others_looking(self) -> bool:
        """Whether a read of the key during the search under way showed another peer
        looking (a peer that did has no reason to leave it for another key)."""
        rnd = self._round
        return rnd is not None and bool(rnd.seen_looking - {rnd.me.peer})

    @property
    def left_over(self) -> bool:
        """Whether the ranking of the key's looking peers left us a block of our own: the
        others fill whole groups, and nobody is coming to us but a late arrival. A read of
        the key can still show them looking for a while after their group formed (their
        withdrawals are DHT stores: 2-3 s on the simulated WAN)."""
        rnd = self._round
        return (
            rnd is not None
            and rnd.block is not None
            and rnd.block.members == frozenset((rnd.me.peer,))
        )

    def leave_if_alone(self) -> bool:
        """End the search under way (``look_for_group`` returns None at once) if nobody has
        joined us and we are not joining anyone; False (nothing changes) otherwise. For a
        peer that finds the swarm under another key part way into a round: its declaration
        here is then withdrawn by the caller, and it looks for a group there."""
        rnd = self._round
        if rnd is None or not self.alone:
            return False
        rnd.finished = True
        rnd.notify()
        return True

    # ---- the searching side ----

    async def look_for_group(
        self, key: str, deadline: float, gathered: Any = None
    ) -> GroupInfo | None:
        """Find a group under ``key`` before ``deadline`` (trio time); None if none formed."""
        async with self._lock:
            now = trio.current_time()
            me = self.backend.local_peer
            order = self.backend.dht_time()
            rnd = MatchmakingRound(
                key=key,
                order=order,
                deadline=deadline,
                started=now,
                me=Member(
                    me,
                    self.mode,
                    self.bandwidth,
                    gathered,
                    deadline,
                    tuple(self.backend.own_addrs()[:MAX_ADDRS]),
                    self.bytes_per_value,
                    self.measured_uplink,
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

    async def _search(self, rnd: MatchmakingRound) -> GroupInfo | None:
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
        attempts: dict[tuple[PeerID, float], int] = {}  # declaration -> tries (MAX_TRIES: done)
        busy: dict[tuple[PeerID, float], int] = {}  # declaration -> "busy" answers (MAX_BUSY)
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
                candidates = self._in_block_order(rnd, candidates, now)
                for cand in candidates[:MAX_CANDIDATES]:
                    if trio.current_time() >= rnd.deadline or rnd.finished:
                        break
                    outcome = await self._follow_chain(rnd, cand.peer, cand.addrs)
                    if isinstance(outcome, GroupInfo):
                        return outcome
                    tag = (cand.peer, cand.order)
                    if outcome == BUSY_NOW:
                        busy[tag] = busy.get(tag, 0) + 1
                        if busy[tag] >= MAX_BUSY:
                            attempts[tag] = MAX_TRIES
                            rnd.passed_over.add(cand.peer)
                    elif outcome != ORPHANED:
                        attempts[tag] = attempts.get(tag, 0) + 1 if outcome == RETRY else MAX_TRIES
                        if attempts[tag] >= MAX_TRIES:
                            rnd.passed_over.add(cand.peer)
                next_poll = trio.current_time() + self.poll_interval
            wake = min(next_poll, rnd.deadline, self._finalize_time(rnd))
            with trio.move_on_at(max(wake, trio.current_time())):
                await changed.wait()

    def _in_block_order(
        self, rnd: MatchmakingRound, candidates: list[Declaration], now: float
    ) -> list[Declaration]:
        """Whom to ask, in turn: on a crowded key our block's leader first, then every
        earlier peer (earliest first); a block leader asks nobody while its block may still
        come (see ``matchmaking_blocks.py``)."""
        # a peer that went silent on us is asked last: another try costs a request's time
        candidates = sorted(
            candidates, key=lambda c: (c.peer in rnd.silent, self._arrival(c.order, c.peer))
        )
        if rnd.block is not None and not rnd.block_settled:
            return []  # read again at the next poll: the view of the key is still growing
        leader = self._block_leader(rnd)
        if leader is None:
            return candidates
        if leader == rnd.me.peer:
            if rnd.leading_since is None:
                rnd.leading_since = now  # the first leader, or the next one after it went silent
            # a leader nobody joined within a request's time is a leader only in its own
            # read of the key: it looks for a group as before
            if rnd.followers or now < rnd.leading_since + self.request_timeout:
                return []
            return candidates
        return sorted(candidates, key=lambda c: c.peer != leader)

    @staticmethod
    def _block_leader(rnd: MatchmakingRound) -> PeerID | None:
        """Who leads our block (None: no blocks, or nobody left in ours to lead it)."""
        if rnd.block is None:
            return None
        return rnd.block.leader(passed_over=rnd.gone | rnd.passed_over | rnd.silent)

    async def _read_declarations(self, rnd: MatchmakingRound) -> list[Declaration]:
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
        rnd.block = self._block(rnd, usable)
        if complete and rnd.joins == joins_before:
            # a withdrawn peer counts as one that may still come: on the shared key the
            # peers of the last round come back under the same key, and a leader that
            # started without waiting for them left them alone
            coming = frozenset(c.peer for c in usable)
            if rnd.block is not None and self._block_leader(rnd) == me:
                # a block leader waits for its block only: the withdrawn peers of a crowded
                # key are mostly this round's other blocks, and a late arrival (or a peer
                # back from its last round) ranks after us and starts a block of its own
                coming = rnd.block.members - rnd.passed_over - rnd.gone - rnd.silent - {me}
            rnd.declared = coming
        elif rnd.joins == joins_before:
            rnd.declared = None  # untrusted read (timed out or missing records): keep waiting
        # ... but nobody asks a withdrawn peer to lead: it is not looking
        return [c for c in usable if c.looking and c.mode != MODE_CLIENT]

    def _block(self, rnd: MatchmakingRound, usable: list[Declaration]) -> Block[PeerID] | None:
        """Our block of the looking peers in ``usable`` (None: they all fit in one group).

        Kept from the read that showed the most looking peers: once groups form, their
        members withdraw and a later read shows fewer, which would cut other blocks."""
        looking = [(c.order, c.peer, c.mode) for c in usable if c.looking]
        looking.append((rnd.order, rnd.me.peer, self.mode))
        # a read that shows a peer no read showed before may show more still: declarations
        # made at once reach the key's nodes one by one, and blocks cut from a partial view
        # put a peer under another leader than its neighbours' views do (the full stack,
        # 128 peers on one key, first rounds: 21-31 peers alone, groups of 2-9)
        seen = {peer for _, peer, _ in looking}
        rnd.block_settled = seen <= rnd.seen_looking
        if len(rnd.seen_looking) < 4 * MAX_CANDIDATES:  # bounded: a key churning without end
            rnd.seen_looking |= seen
        else:
            rnd.block_settled = True
        if rnd.block is not None and len(looking) < rnd.block.basis:
            return rnd.block
        if len(looking) <= self.target_group_size:
            return None  # everyone fits: no ranking to compute
        as_bytes = {peer: self.backend.peer_to_bytes(peer) for _, peer, _ in looking}
        looking.sort(key=lambda entry: rank(entry[0], as_bytes[entry[1]]))
        arrival = {peer: (order, as_bytes[peer]) for order, peer, _ in looking}
        ranked = [(peer, mode) for _, peer, mode in looking]
        return block_of(ranked, rnd.me.peer, self.target_group_size, lead_order=arrival.__getitem__)

    async def _follow_chain(
        self, rnd: MatchmakingRound, peer: PeerID, addrs: tuple[str, ...]
    ) -> GroupInfo | str | None:
        """Join ``peer``, following redirects (each one strictly earlier in the order).

        Returns a GroupInfo, :data:`RETRY` (the candidate may still lead later: it timed out
        or follows someone), :data:`BUSY_NOW` (it is asking a leader itself right now),
        :data:`ORPHANED` (it follows a leader we lost: ask again, it will notice) or None (it
        will not take us this round).
        """
        retry = False
        for _ in range(MAX_GROUP_SIZE):
            result = await self._try_join(rnd, peer, addrs)
            if isinstance(result, GroupInfo):
                return result
            if result in (RETRY, BUSY_NOW):
                return result
            if not isinstance(result, tuple):
                return RETRY if retry else None
            retry = True  # the candidate follows someone; it may lead again if that fails
            peer, addrs = result
            # (a redirect target accepted a leader of our schema: it is skipped only if it
            # refused us while declaring what it declares now)
            if peer in rnd.gone:
                # a leader we lost: its other followers redirect to it until they notice
                # (within a heartbeat of us), then lead or follow again: not a try spent
                return ORPHANED
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

    async def _try_join(
        self, rnd: MatchmakingRound, peer: PeerID, addrs: tuple[str, ...]
    ) -> JoinOutcome:
        """One join attempt. Returns a GroupInfo, None (failed), :data:`RETRY` or
        ``(peer, addrs)`` to try next."""
        remaining = rnd.deadline - trio.current_time()
        if remaining <= 0:
            return None
        request = self._join_request(rnd, remaining)
        rnd.probing = True
        stream = None
        outcome: JoinOutcome = None
        try:
            with trio.move_on_after(min(self.request_timeout, remaining)) as cs:
                stream = await self.backend.open_stream(
                    peer, addrs, dial_timeout=self.request_timeout
                )
                await stream.send_msg(request.to_msg(self.prefix))
                reply = await stream.receive_msg(max_size=MAX_RESPONSE_BYTES)
            if cs.cancelled_caught:
                logger.debug("join request to %s timed out", peer)
                self._went_silent(rnd, peer)
                return RETRY
            self._note_schema_refusal(rnd, peer, reply)
            kind, outcome = self._parse_reply(reply)
            if kind != "accepted":
                return outcome
            self._follow(rnd, peer, addrs)
            outcome = await self._await_group(rnd, stream, peer, self._silence_limit(reply))
            return outcome
        except (MatchmakingError, GroupInfoError) as e:
            logger.warning("bad matchmaking reply from %s: %s", peer, e)
            return None
        except Exception as e:  # network failures: try someone else
            if not is_network_error(e):
                raise
            logger.debug("join request to %s failed: %r", peer, e)
            return None
        finally:
            if rnd.following is not None and outcome is None:
                # the leader we followed is gone (silent, gave up, or its stream broke), and
                # the others it led look on with us: a lead we take now waits for them
                rnd.orphaned = trio.current_time()
                rnd.gone.add(rnd.following)
            rnd.probing = False
            rnd.following, rnd.following_addrs = None, ()
            if stream is not None:
                await _close_join_stream(stream)

    def _went_silent(self, rnd: MatchmakingRound, peer: PeerID) -> None:
        """``peer`` did not answer within a request's time. If it led our block, the block's
        next peer leads now: its other members timed out on the same silent peer at about the
        same time, and kept on it for ``MAX_TRIES`` requests they spent the round asking the
        peers of other blocks, whose groups had formed (the full stack, 64 peers on the shared
        key, one block's leader cut: 7-21 peers alone or in pairs). A lead we take now waits a
        request's time for them, as after a leader that accepted us went away."""
        if peer == self._block_leader(rnd):
            rnd.orphaned = trio.current_time()
        rnd.silent.add(peer)
        rnd.notify()

    def _join_request(self, rnd: MatchmakingRound, remaining: float) -> JoinRequest:
        """What we tell a leader about ourselves (and the followers we bring along)."""
        return JoinRequest(
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
            measured_uplink=rnd.me.measured_uplink,
            # a leader merging away brings its followers' minimums along
            min_group_size=self._group_minimum(rnd),
        )

    def _note_schema_refusal(self, rnd: MatchmakingRound, peer: PeerID, reply: Any) -> None:
        """A leader that refused us for our tensor schema is remembered with what it declares:
        not asked again while that stays the same."""
        why = reply.get("why") if isinstance(reply, Mapping) else None
        if isinstance(why, str) and why.startswith(SCHEMA_MISMATCH):
            why = f"{short(peer)} refused us: {why}"
            rnd.note_schema_conflict(peer, why)
            self.schema_memory.note(peer, rnd.declared_schemas.get(peer), why)
            self.schema_refusals += 1

    def _follow(self, rnd: MatchmakingRound, peer: PeerID, addrs: tuple[str, ...]) -> None:
        """``peer`` accepted us: our own followers go where we go; we start a fresh lead in
        case this fails."""
        rnd.following, rnd.following_addrs = peer, addrs
        if rnd.followers:
            rnd.lead.conclude(
                {"t": "redirect", "to": self.backend.peer_to_bytes(peer), "a": list(addrs)}
            )
            rnd.lead = Lead()

    async def _await_group(
        self, rnd: MatchmakingRound, stream: MsgStream, peer: PeerID, silence: float
    ) -> JoinOutcome:
        """Wait for the leader's decision until a little after our own deadline; a leader
        that promised heartbeats and is quiet for ``silence`` seconds is gone (its group never
        comes). Returns a group, a redirect target or None."""
        with trio.move_on_at(rnd.deadline + self.request_timeout):
            while True:
                with trio.move_on_after(silence) as quiet:
                    reply = await stream.receive_msg(max_size=MAX_RESPONSE_BYTES)
                if quiet.cancelled_caught:
                    logger.debug("leader %s silent for %.1fs: looking on", peer, silence)
                    return None
                if isinstance(reply, Mapping) and reply.get("t") == "wait":
                    continue
                _, value = self._parse_reply(reply, accepted_ok=False)
                return value
        logger.debug("leader %s did not send a group in time", peer)
        return None

    def _silence_limit(self, accepted: Mapping[str, Any]) -> float:
        """How long a follower waits for a word from its leader (inf: it sends none)."""
        interval = accepted.get("hb")
        if interval is None:
            return math.inf  # a leader without heartbeats: wait for the group as before
        try:
            interval = check_finite(interval, "heartbeat interval", 1e-3, MAX_HEARTBEAT_SECONDS)
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
            return "reject", BUSY_NOW if why == BUSY else None
        if kind == "redirect":
            to = reply.get("to")
            if not isinstance(to, bytes) or len(to) > 128:
                raise MatchmakingError("redirect target must be PeerID bytes")
            try:
                target = self.backend.peer_from_bytes(to)
            except Exception as e:
                raise MatchmakingError(f"redirect target is not a PeerID: {e}") from e
            return "redirect", (target, check_addrs(reply.get("a", [])))
        if kind == "group":
            group = self.backend.decode_group(reply.get("group"))
            me = self.backend.local_peer
            group.index_of(me)  # raises GroupInfoError if we are not in it
            return "group", group
        raise MatchmakingError(f"unexpected matchmaking reply type {kind!r}")


async def _close_join_stream(stream: MsgStream) -> None:
    """Close a join stream, even while our search is being cancelled (bounded)."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.aclose()
        except Exception as e:
            if not is_network_error(e):
                raise
