"""The leading side of matchmaking: accept joiners, and decide when our group is final.

A peer leads the followers that joined it (:meth:`LeaderSide.handle_join`, served for every
incoming join stream while it searches) until its group is final (:meth:`LeaderSide._maybe_finalize`,
called by the searching side in ``matchmaking.py``) or until it follows someone itself and
hands its followers on. Both sides share the round's state (``matchmaking_state.py``);
:class:`~moshpit.averaging.matchmaking.Matchmaker` is this class plus the searching side.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from moshpit.averaging.group_info import MODE_AUX, MODE_CLIENT, GroupInfo
from moshpit.averaging.matchmaking_backend import MatchmakingBackend, MsgStream
from moshpit.averaging.matchmaking_messages import (
    BUSY,
    HEARTBEAT_SECONDS,
    MAX_GATHER_BYTES,
    SCHEMA_MISMATCH,
    JoinRequest,
    MatchmakingError,
    packed_size,
)
from moshpit.averaging.matchmaking_state import (
    MatchmakingRound,
    Member,
    SchemaMemory,
)
from moshpit.netutil import is_network_error

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

logger = logging.getLogger(__name__)


class LeaderSide:
    """The half of a :class:`~moshpit.averaging.matchmaking.Matchmaker` that leads a group.

    The attributes below are the matchmaker's settings and state (set in its constructor).
    """

    backend: MatchmakingBackend
    target_group_size: int
    min_group_size: int
    min_matchmaking_time: float
    request_timeout: float
    mode: str
    is_banned: Callable[[PeerID], bool]
    schema: bytes | None
    schema_description: str
    schema_memory: SchemaMemory
    start_when_all_joined: bool
    _round: MatchmakingRound | None

    # ---- ordering ----

    def _arrival(self, order: float, peer: PeerID) -> tuple[float, bytes]:
        """A declaration's place in the arrival order, which requests follow."""
        return (order, self.backend.peer_to_bytes(peer))

    def _before(self, order_a: float, peer_a: PeerID, order_b: float, peer_b: PeerID) -> bool:
        """Is (order_a, peer_a) strictly before (order_b, peer_b)?"""
        return self._arrival(order_a, peer_a) < self._arrival(order_b, peer_b)

    # ---- accepting joiners ----

    async def handle_join(self, stream: MsgStream, msg: dict[str, Any]) -> None:
        """Serve one join request (the dispatcher already read ``msg`` from ``stream``)."""
        peer = stream.remote_peer
        try:
            request = JoinRequest.from_msg(msg)
        except MatchmakingError as e:
            logger.info("malformed join request from %s: %s", peer, e)
            await stream.send_msg({"t": "reject", "why": f"malformed request: {e}"})
            return
        if request.gathered is not None and packed_size(request.gathered) > MAX_GATHER_BYTES:
            await stream.send_msg({"t": "reject", "why": "gathered metadata too large"})
            return
        rnd = self._round
        why = self._refusal(rnd, peer, request)
        if why == "redirect" and rnd is not None and rnd.following is not None:
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
        member = Member(
            peer,
            request.mode,
            request.bandwidth,
            request.gathered,
            trio.current_time() + request.seconds_left,
            request.addrs,
            request.bytes_per_value,
            request.measured_uplink,
            request.min_group_size,
        )
        rnd.lead.followers[peer] = member
        rnd.joins += 1
        rnd.declared = None  # someone else may be on the way: read the key again first
        rnd.notify()
        await self._serve_follower(stream, rnd, member, request.heartbeats)

    async def _serve_follower(
        self, stream: MsgStream, rnd: MatchmakingRound, member: Member, heartbeats: bool
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

    def _refusal(
        self, rnd: MatchmakingRound | None, peer: PeerID, request: JoinRequest
    ) -> str | None:
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

    # ---- when the group is final ----

    def _everyone_joined(self, rnd: MatchmakingRound) -> bool:
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

    def _finalize_time(self, rnd: MatchmakingRound) -> float:
        """Earliest time at which a group of the current size may proceed (deadline if never)."""
        if not self._can_lead_now(rnd):
            return rnd.deadline
        if self._everyone_joined(rnd):
            return rnd.started
        start = rnd.started + self.min_matchmaking_time
        if rnd.orphaned is not None:
            # our leader went away and its other followers are looking on too, each noticing
            # at its own heartbeat: past min_matchmaking_time the first of them to join us
            # would start a group of two, and the rest split into pairs or stay alone (the
            # full stack, a line of 16 whose leader was cut: groups of 2, 2, 2 and one alone).
            # Give them one request's time to find us
            start = max(start, rnd.orphaned + self.request_timeout)
        return min(start, self._member_deadline(rnd))

    def _can_lead_now(self, rnd: MatchmakingRound) -> bool:
        if rnd.finished or rnd.following is not None or rnd.lead.outcome is not None:
            return False
        members = [rnd.me, *rnd.followers.values()]
        return (
            len(members) >= self._group_minimum(rnd)
            and any(m.mode != MODE_AUX for m in members)  # someone has tensors
            and any(m.mode != MODE_CLIENT for m in members)  # someone can reduce
        )

    def _group_minimum(self, rnd: MatchmakingRound) -> int:
        """The smallest group every member accepts: a follower's ``min_group_size`` binds the
        group as much as ours. A training peer sets it to the peers it knows at its epoch, and
        a leader whose view lags (a peer it has not seen yet) would otherwise start a pair the
        moment the two of them are all it can see, a round the follower then rejects as
        incomplete. Capped at the target size, which always finalizes."""
        wanted = max([self.min_group_size, *(m.min_group_size for m in rnd.followers.values())])
        return min(wanted, self.target_group_size)

    @staticmethod
    def _member_deadline(rnd: MatchmakingRound) -> float:
        return min([rnd.deadline] + [m.deadline for m in rnd.followers.values()])

    def _maybe_finalize(self, rnd: MatchmakingRound, now: float) -> GroupInfo | None:
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
            measured_uplinks=_measured_uplinks(members),
        )
        logger.debug(
            "leading group %s under %s: %d members", group.group_id.hex()[:8], rnd.key, group.size
        )
        rnd.finished = True
        rnd.lead.conclude({"t": "group", "group": group.to_msg()})
        return group


def _measured_uplinks(members: list[Member]) -> tuple[float | None, ...]:
    """The members' measured uplinks for the GroupInfo; empty while nobody measured one."""
    rates = tuple(m.measured_uplink for m in members)
    return rates if any(r is not None for r in rates) else ()
