"""The adaptive grid's reads of DHT keys around matchmaking: how many peers of our schema
are declared under a key, the look a new or stranded peer takes before it declares and again
part way into the round, and the look ahead at a longer grid (``GroupKeyManager`` decides;
this module reads, and moves the search when it says so). Kept apart from ``averager.py``,
which runs the step."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from dht.p2p import PeerID
from moshpit.averaging.averager_services import CountingBackend
from moshpit.averaging.group_info import GroupInfo
from moshpit.averaging.group_keys import GroupKeyManager
from moshpit.averaging.matchmaking import Matchmaker

logger = logging.getLogger(__name__)
# the longest a step waits, after matchmaking, for its look at the longer grid
PROBE_WAIT_SECONDS = 1.0
# a peer alone part way into a round looks around at these shares of look_after (each
# times 1 to 1 + LOOK_SPREAD): early, so that a move still meets the group it moves to before
# that group starts (min_matchmaking_time in), and again in case the first look was too soon
# (the peers of its key had not formed their group yet)
LOOKS_AROUND = (0.5, 1.0)
LOOK_SPREAD = 0.4


@dataclass(frozen=True)
class KeyReads:
    """What every read of a key needs: the backend, our schema (peers of another schema are
    never grouped with us, so they do not count), who we are, and how long a read may take
    (a read that times out gives no count)."""

    backend: CountingBackend
    schema: bytes | None
    me: PeerID
    read_timeout: float

    async def count(
        self, key: str, out: list[int], *, looking_now: bool, with_us: bool = False
    ) -> None:
        """Distinct peers of our schema declared under ``key``, appended to ``out`` (nothing
        on a timeout). ``looking_now``: only those still looking (a withdrawn declaration of
        a round that ended is kept until it expires, up to ``matchmaking_timeout`` later);
        ``with_us``: and us, as ``CountingBackend.take_count`` counts."""
        with trio.move_on_after(self.read_timeout):
            found = await self.backend.list_candidates(key)
            peers = {
                c.peer
                for c in found
                if (self.schema is None or c.schema == self.schema)
                and (c.looking or not looking_now) and c.peer != self.me
            }  # fmt: skip
            out.append(len(peers) + 1 if with_us else len(peers))

    async def own_and_others(
        self, key: str, others: list[str]
    ) -> tuple[int | None, list[tuple[int, str]]]:
        """The peers looking now under our ``key`` (us included; None if the read timed
        out), and ``(peers looking now, key)`` for each of ``others`` whose read did not:
        all at once."""
        own: list[int] = []
        counts: list[list[int]] = [[] for _ in others]
        async with trio.open_nursery() as reads:
            reads.start_soon(partial(self.count, key, own, looking_now=True, with_us=True))
            for other, count in zip(others, counts, strict=True):
                reads.start_soon(partial(self.count, other, count, looking_now=True))
        found = [(c[0], k) for c, k in zip(counts, others, strict=True) if c]
        return (own[0] if own else None), found


async def follow_the_swarm(
    keys: GroupKeyManager, reads: KeyReads, key: str, longer_key: str, deadline: float
) -> bool:
    """Read our ``key``, ``longer_key`` and ``keys.other_longer_keys()`` before declaring;
    True if ``keys`` moved to a longer one (nobody else under ours, a group's worth under
    it: ``GroupKeyManager.follow_longer_now``). All count the peers looking now: keys change
    every round, so the records a round left under a key name peers that have moved on."""
    own: int | None = None
    found: list[tuple[int, str]] = []
    with trio.move_on_at(deadline):
        own, found = await reads.own_and_others(key, [longer_key, *keys.other_longer_keys()])
    if own is None or not found:
        return False  # the reads timed out: declare under our key as usual
    most, best = max(found)  # the most peers looking: room for us, most likely
    return keys.follow_longer_now(most, own, best)


async def _look_around(
    keys: GroupKeyManager,
    reads: KeyReads,
    key: str,
    longer_key: str | None,
    left_over: Callable[[], bool],
) -> Callable[[], object] | None:
    """Where a peer still alone under ``key`` part way into a round should go, as the call
    that makes ``keys`` take it: a longer key with a group's worth of peers looking
    (``longer_key`` and ``keys.other_longer_keys()``, when given: the swarm grew without
    us), or else a key of our own grid where a group is still looking and has room
    (``keys.sibling_keys()``). None: stay (somebody else is looking under ours, or nothing
    better was read). ``left_over``: whether the ranking of our key's peers left us a
    block of our own (``Matchmaker.left_over``, asked once the read is in), in which case
    the others' count is no reason to stay."""
    longer = [longer_key, *keys.other_longer_keys()] if longer_key is not None else []
    side = keys.sibling_keys()
    if not longer and not side:
        return None
    own, found = await reads.own_and_others(key, longer + side)
    found_longer = [(c, k) for c, k in found if k in longer]
    found_side = [(c, k) for c, k in found if k not in longer]
    logger.debug(
        "alone under %s part way into the round: %s looking there, longer keys %s, others %s",
        key, "?" if own is None else own, found_longer, found_side,
    )  # fmt: skip
    if own is not None and own > 1 and left_over():
        own = 1  # the others fill whole groups without us
    if own is None or own > 1:
        return None
    if found_longer:
        most, best = max(found_longer)
        if keys.would_follow(most, own):
            return partial(keys.follow_longer_now, most, own, best)
    side_key = keys.key_with_room(found_side)
    return partial(keys.move_sideways, side_key) if side_key is not None else None


async def _look_ahead(
    reads: KeyReads, longer: str, look_after: float, searched: trio.Event, out: list[int]
) -> None:
    """The look ahead's read of ``longer``, ``look_after`` seconds in or once the search
    ended (``find_group_on_grid`` says why not at the start)."""
    with trio.move_on_after(look_after):
        await searched.wait()
    await reads.count(longer, out, looking_now=False)


async def _look_around_while_alone(
    keys: GroupKeyManager,
    matchmaker: Matchmaker,
    reads: KeyReads,
    key: str,
    longer_key: str | None,
    look_after: float,
    deadline: float,
    searched: trio.Event,
    moved: list[str],
) -> None:
    """At each of ``LOOKS_AROUND``, while the search under ``key`` goes on and we are alone
    in it: :func:`_look_around`, and if it names a key, end the search (only if that strands
    nobody), move ``keys`` there and append the key to ``moved`` for ``find_group_on_grid``
    to search there."""
    started = trio.current_time()
    for share in LOOKS_AROUND:
        # at a moment of our own: a peer that reads after another moved sees it there
        at = started + look_after * share * random.uniform(1.0, 1.0 + LOOK_SPREAD)
        with trio.move_on_at(at):
            await searched.wait()
        if searched.is_set():
            return
        if not matchmaker.alone:
            continue
        if keys.num_bits == 0 and matchmaker.saw_others_looking:
            return  # a swarm that starts together: everyone sees the others under its key
        move = None
        with trio.move_on_at(deadline):
            move = await _look_around(keys, reads, key, longer_key, lambda: matchmaker.left_over)
        # nobody joined us meanwhile, and we follow nobody: leaving strands nobody
        if move is not None and not searched.is_set() and matchmaker.leave_if_alone():
            move()
            moved.append(keys.key)
            return


async def find_group_on_grid(
    keys: GroupKeyManager,
    matchmaker: Matchmaker,
    reads: KeyReads,
    key: str,
    look_after: float,
    deadline: float,
    gather: Any,
) -> tuple[GroupInfo | None, int, str]:
    """Matchmaking under ``key`` until ``deadline`` with the grid's looks: the group (None:
    none formed), how many peers of our schema declared under the key (us included: the
    grid's evidence) and the key it was sought under last.

    - A new or stranded peer (``keys.probe_before_declaring``) reads before it declares and
      may move to a longer key at once (``follow_the_swarm``).
    - A peer still alone part way in (``LOOKS_AROUND`` shares of ``look_after``; nobody
      joined it, it follows nobody, and nobody else is looking under its key) looks around
      (:func:`_look_around`) and may move for the rest of the round
      (``Matchmaker.leave_if_alone``). To a longer key, if
      its look before declaring found nobody: peers that start a round together read each
      other's keys while their declarations are still being stored, so the first look of a
      peer stepping with the swarm finds nothing. And on a grid, to a key of the same
      length whose group is still looking and has room: where the peer left over on a key
      one peer too full finds the key one peer short (``GroupKeyManager.sibling_keys``).
    - The look ahead (``keys.longer_key``: one round in ``PROBE_EVERY``, and every round
      while alone) waits ``look_after`` seconds, or until the search ended, before it reads:
      read at the round's start, a longer key can hold neither the last round's records
      (expired) nor this round's (not stored yet), and a look that counts 0 moves the next
      one a dimension further on, away from the swarm it missed.
    """
    longer_key = keys.longer_key()
    look_longer = False
    if longer_key is not None and keys.probe_before_declaring:
        if await follow_the_swarm(keys, reads, key, longer_key, deadline):
            key, longer_key = keys.key, None
        else:
            look_longer = True
    # the key length may have changed since the last round (adaptive grid)
    matchmaker.start_when_all_joined = keys.num_bits == 0
    backend = reads.backend
    backend.seen.clear()
    searched = trio.Event()
    longer_count: list[int] = []
    moved: list[str] = []

    async with trio.open_nursery() as probing:
        if longer_key is not None:
            probing.start_soon(_look_ahead, reads, longer_key, look_after, searched, longer_count)
        ahead = longer_key if look_longer else None
        probing.start_soon(
            partial(
                _look_around_while_alone,
                keys,
                matchmaker,
                reads,
                key,
                ahead,
                look_after,
                deadline,
                searched,
                moved,
            )  # fmt: skip
        )
        group = await matchmaker.look_for_group(key, deadline, gather)
        if group is None and moved:
            matchmaker.withdraw_declaration()  # our old key must not read as looking
            key = moved[0]
            matchmaker.start_when_all_joined = False
            backend.seen.clear()
            group = await matchmaker.look_for_group(key, deadline, gather)
        searched.set()
        # evidence only: worth a short wait at most (one round in PROBE_EVERY)
        probing.cancel_scope.deadline = trio.current_time() + PROBE_WAIT_SECONDS
    declared = backend.take_count(key)
    if longer_count:
        keys.observe_longer(longer_count[0], declared)
    return group, declared, key
