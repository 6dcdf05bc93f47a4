"""Who must be in an epoch's round: the rules ``sync`` and ``diloco`` share.

Both modes run one averaging round per epoch under that epoch's own prefix, and every member
must leave it with the same result: a round that starts without a peer which is at (or on
its way to) the epoch leaves that peer behind, and two groups under one key would each apply
their own mean and split the swarm. So a round waits for the peers this one knows at the
epoch (``expected``: the matchmaking floor), every member declares how many it knows
(``gather``), and a group smaller than any member's count is not applied (``complete``).

What a peer knows comes from the progress tracker's view, which lags by a refresh and can be
partial (a DHT read that missed a record), plus the members of its last round: they stepped
with it and are at its epoch even while the view still shows them behind, or not at all.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dht.kademlia.clock import get_dht_time

if TYPE_CHECKING:
    from moshpit.training.progress_record import PeerProgress

logger = logging.getLogger(__name__)

__all__ = ["RECENT_REPORT", "EpochRounds", "reported_recently", "wait_unless_left_behind"]

RECENT_REPORT = 5.0  # s: a peer at our epoch that reported this recently is waited for
# ... or within this many of its own step times (a peer with 30 s steps reports every 30 s)
RECENT_STEPS = 2.5
BEHIND_PATIENCE = 30.0  # s a round waits for peers an epoch behind (see _worth_waiting)
MAX_RATE_RATIO = 10.0  # a peer's throughput counts at most this x the swarm's median
MAX_EXTRAPOLATION = 10.0  # s a peer's last report is projected forward at most
STEP_RESOLVE_GRACE = 1.0  # s between an averager step's end and its future's result, at most


def reported_recently(peer: PeerProgress, now: float) -> bool:
    """Did ``peer`` report within ``RECENT_REPORT`` s, or within ``RECENT_STEPS`` of its own
    step times (long steps: it is still computing, not gone)?"""
    step = float(peer.step_seconds or 0.0)
    return bool(now - peer.time < max(RECENT_REPORT, RECENT_STEPS * step))


class EpochRounds:
    """The round membership rules of one peer (module doc)."""

    def __init__(self, peer_id: str, target_group_size: int) -> None:
        self.me = peer_id
        self.target_group_size = target_group_size
        self.last_members: frozenset[str] = frozenset()  # of our last round (not us)
        self.epoch_started = get_dht_time()  # DHT time at which we entered our epoch

    # ------------------------------------------------------------------ reading the view

    def others(self, view: Any, epoch: int) -> tuple[list[Any], list[Any]]:
        """(peers at ``epoch``, peers past it), from the view's records, without us."""
        others = [p for p in view.peers if p.peer_id != self.me]
        same = [p for p in others if p.epoch == epoch]
        ahead = [p for p in others if p.epoch > epoch]
        return same, ahead

    @staticmethod
    def contributing(same: list[Any], now: float | None = None) -> list[Any]:
        """Peers at our epoch that reported samples for it, or reported at all in the last
        ``RECENT_REPORT`` s: those a round must wait for. A peer that just reached the epoch
        (or just started) is on its way; one that reached it and then stopped stepping
        (paused, or busy elsewhere) keeps reporting 0 from long ago and is not waited for,
        or every round of the others would be rejected as a possible split, forever. It
        catches up by loading state later."""
        now = get_dht_time() if now is None else now
        return [p for p in same if p.samples > 0 or reported_recently(p, now)]

    def near(self, view: Any, epoch: int) -> list[Any]:
        """Peers the view shows one epoch behind us (without us): most likely on their way."""
        return [p for p in view.peers if p.peer_id != self.me and p.epoch == epoch - 1]

    def expected(self, view: Any, epoch: int, now: float | None = None) -> int:
        """How many peers (us included) this epoch's round must hold (see ``awaited``)."""
        return len(self.awaited(view, epoch, now)) + 1

    def awaited(self, view: Any, epoch: int, now: float | None = None) -> set[str]:
        """The other peers this epoch's round must hold: the peers at our epoch
        that are stepping, those one epoch behind in the view that reported recently (on
        their way, for a while: see ``_worth_waiting``), those loading the state of this epoch
        (for as long: a laggard that downloads while the swarm moves on arrives behind again,
        and on a slow link never catches up), and the members of our last round
        unless the view shows them ahead, or behind or idle with a report older than
        ``RECENT_REPORT`` s (paused: waiting for them would stall every round)."""
        now = get_dht_time() if now is None else now
        same, _ = self.others(view, epoch)
        peers = {p.peer_id for p in self.contributing(same, now)}
        peers |= {p.peer_id for p in self.near(view, epoch) if self._worth_waiting(p, now)}
        # peers loading the state of this very epoch: they report nothing while they download
        patient = now - self.epoch_started < BEHIND_PATIENCE
        peers |= {p.peer_id for p in view.peers if p.catching_up == epoch and patient}
        shown = {p.peer_id: p for p in view.peers}
        for member in self.last_members:
            p = shown.get(member)
            if (
                p is None
                or (p.epoch == epoch and (reported_recently(p, now) or p.samples > 0))
                or (p.epoch < epoch and self._worth_waiting(p, now))
            ):
                peers.add(member)
        peers.discard(self.me)
        return peers

    def _worth_waiting(self, peer: PeerProgress, now: float) -> bool:
        """A peer behind our epoch that reported recently is on its way (it steps into our
        epoch, or loads our state), but only for ``BEHIND_PATIENCE`` s (plus its step time)
        after we entered the epoch: one that cannot load our state must not hold every round
        of ours forever (a chaos run sat 90 s so). Past that, our rounds go on without it and
        it catches up by loading a later state."""
        patience = BEHIND_PATIENCE + RECENT_STEPS * (peer.step_seconds or 0.0)
        return reported_recently(peer, now) and now - self.epoch_started < patience

    def slowest_step(self, view: Any, epoch: int, now: float | None = None) -> float:
        """The longest step time among the peers this epoch's round waits for (0 when none
        says): a round must wait that long for the last of them to reach it."""
        awaited = self.awaited(view, epoch, now)
        return max((p.step_seconds or 0.0 for p in view.peers if p.peer_id in awaited), default=0.0)

    def projected_samples(
        self, view: Any, epoch: int, own: int, own_rate: float, now: float | None = None
    ) -> float:
        """The swarm's samples at ``epoch`` now, projected from ``view``.

        The tracker's view lags by a refresh and a publication, long enough for every peer
        to reach a small target on its own count. A member of our last round began this
        epoch when we did (the round ended for all at once), so it holds about our own count
        times its speed relative to ours (or its report, if that is higher): each peer is
        then ready once its own count reaches its throughput's share of the target, whatever
        the view's lag, and the peers enter the round together. Another peer at the epoch
        counts with its report extrapolated at its throughput, for at most
        ``MAX_EXTRAPOLATION`` s (a peer that stopped stepping is not counted forever). A
        throughput counts at most ``MAX_RATE_RATIO`` x the median, so a liar cannot start
        rounds early at will.
        """
        now = get_dht_time() if now is None else now
        me = self.me
        # members of our last round, unless the view shows one paused or ahead
        members = self.last_members & self.awaited(view, epoch, now)
        rates = sorted(
            r
            for r in [own_rate, *(p.samples_per_second for p in view.peers if p.peer_id != me)]
            if r > 0
        )
        cap = MAX_RATE_RATIO * rates[len(rates) // 2] if rates else 0.0

        def relative(rate: float) -> float:  # its speed / ours (1 while either is unknown)
            return min(rate, cap) / own_rate if rate > 0 and own_rate > 0 else 1.0

        total = float(own)
        unseen = set(members)
        for p in view.peers:
            unseen.discard(p.peer_id)
            if p.peer_id == me or p.epoch > epoch:
                continue
            reported = p.samples if p.epoch == epoch else 0
            if p.peer_id in members:
                total += max(reported, own * relative(p.samples_per_second))
            elif p.epoch == epoch:
                rate = min(p.samples_per_second, cap)
                total += reported + rate * min(MAX_EXTRAPOLATION, max(0.0, now - p.time))
        # members of our last round that this (partial) read of the DHT missed
        return total + len(unseen) * own

    def with_us_last_round(self, view: Any) -> bool:
        """Does the view still list a member of our last round (its report of this epoch may
        not have reached the view yet: it is not gone, we are not alone)?"""
        return any(p.peer_id in self.last_members for p in view.peers)

    def with_us(self, view: Any, failed: Any) -> bool:
        """After the round ``failed`` (a StepResult): are we not alone at this epoch? Yes if
        the view lists a member of our last round, or if ``failed`` itself held another
        member: its key is this epoch's, so they were here a moment ago. Over a saturated
        home uplink the view's DHT reads time out and come back empty, and a round that ran
        out of time (the link is slow, nobody left) sent all four peers of the 200 kbit/s
        race off alone at once. One retry, not more: a retry that finds no group either
        goes on alone (keeping the others counted for a while instead made the peers of
        that race retry, blocked, for most of their time while the failed round's bytes
        drained from the links: 4.18 bits per byte against 3.81 in 180 s)."""
        return self.with_us_last_round(view) or any(str(m) != self.me for m in failed.members)

    # ------------------------------------------------------------------ after a round

    def complete(self, result: Any) -> bool:
        """Did the group hold every peer its members knew at this epoch (up to the group size)?

        Each member declared how many peers it knows (``gather["peers"]``); all members get
        the same declarations, so they all take the same decision here.
        """
        claims = [
            value["peers"]
            for value in result.gathered.values()
            if isinstance(value, dict)
            and isinstance(value.get("peers"), int)
            and not isinstance(value.get("peers"), bool)
        ]
        expected = min(self.target_group_size, max(claims, default=0))
        if result.group_size >= expected:
            return True
        logger.warning(
            "the round held %d of the %d peers its members see at this epoch: not applied "
            "(another group may have formed); retrying",
            result.group_size,
            expected,
        )
        return False

    def stepped_with(self, result: Any) -> None:
        """A round was applied: its members enter the next epoch with us, now."""
        self.remember(result)
        self.epoch_started = get_dht_time()

    def remember(self, result: Any) -> None:
        """The members of our latest round (delayed averaging learns them one epoch late),
        less those that failed in it or were excluded for bad input: waiting for them in the
        next round would let one misbehaving peer stall every round until it times out."""
        dropped = {str(p) for p in (*result.failed, *result.excluded)}
        self.last_members = frozenset(str(m) for m in result.members) - dropped - {self.me}

    def alone(self) -> None:
        """We stepped without a round (alone, or after loading state)."""
        self.last_members = frozenset()
        self.epoch_started = get_dht_time()

    def forget_unseen(self, view: Any) -> None:
        """A round failed: stop waiting for last-round members a fresh view does not show
        (they may be gone; a partial read costs one round that starts without them)."""
        self.last_members &= {p.peer_id for p in view.peers}


def wait_unless_left_behind(
    future: concurrent.futures.Future[Any],
    epoch: int,
    period: float,
    view: Callable[[], Any],
    in_group: Callable[[], bool],
) -> bool:
    """Wait for a round of ``epoch``; False as soon as the swarm's view shows a later epoch
    while the round has no group (the peers it waits for have moved on: it can only time
    out, while the caller should load their state). ``view`` is read at most every
    ``period`` s.

    A round whose group formed (``in_group``) is waited for: on a slow link its members
    finish seconds apart, and the later epoch the view shows is most likely that of the
    members done first; the round's own timeouts bound it. Abandoning it there left the
    last members behind the very round they were in (a 1-Mbit/s race lost two of four peers
    so, who then stepped alone on θ the others never had)."""
    while not future.done():
        concurrent.futures.wait([future], timeout=period)
        if future.done() or in_group():
            continue
        if view().epoch > epoch:
            # the step clears in_group a moment before its future resolves: a round that
            # just ended is taken, not abandoned
            concurrent.futures.wait([future], timeout=STEP_RESOLVE_GRACE)
            return future.done()
    return True
