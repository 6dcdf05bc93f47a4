"""Iterative Kademlia lookup: beam search over candidates with ``alpha`` requests in flight.

Candidates are kept in a heap by XOR distance to the target. Workers repeatedly query the
nearest unqueried candidate, merge the peers it returns, and stop once no unqueried candidate
is closer than the ``beam_size``-th nearest peer that answered (and nothing is in flight), i.e.
the ``beam_size`` nearest reachable peers have all been asked. A caller may stop early once a
response satisfies it (e.g. a value was found).

Requests in flight count toward the beam for ``patience`` seconds: a candidate further than
the ``beam_size``-th nearest of the answered *and pending* peers is not asked while those are
still likely to answer. Without that, the last ``alpha - 1`` requests of almost every lookup
went to peers the result could not use (7 finds instead of 5 for a 5-peer beam in a small
swarm, ~15 % of a store's RPCs); a pending peer that fails, or stays silent past
``patience``, frees its place at once, so a dead peer delays a lookup by ``patience`` at most.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

import trio

from dht.kademlia.protocol import FindResult
from dht.kademlia.routing import Contact

FindFn = Callable[[Contact], Awaitable[FindResult[Contact] | None]]


@dataclass
class LookupResult:
    nearest: list[Contact]  # peers that answered, nearest first (at most beam_size)
    responses: list[tuple[Contact, FindResult[Contact]]] = field(default_factory=list)
    hops: int = 0  # sequential RPCs needed to reach the nearest peer found
    rounds: int = 0  # deepest RPC chain issued
    messages: int = 0
    stopped_early: bool = False


class Lookup:
    def __init__(
        self,
        target_id: int,
        initial: list[Contact],
        find: FindFn,
        *,
        beam_size: int,
        alpha: int,
        exclude: Hashable | None = None,
        is_banned: Callable[[Hashable], bool] = lambda _: False,
        stop_when: Callable[[FindResult[Contact]], bool] | None = None,
        max_messages: int = 1000,
        patience: float = 0.5,
    ):
        self.target_id = target_id
        self.find = find
        self.beam_size = max(1, beam_size)
        self.alpha = max(1, alpha)
        self.exclude = exclude
        self.is_banned = is_banned
        self.stop_when = stop_when
        self.max_messages = max_messages
        self.patience = patience
        self._pending: dict[Hashable, tuple[int, float]] = {}  # in flight: (distance, sent at)
        self._counter = itertools.count()
        self._heap: list[tuple[int, int, Hashable]] = []
        self._known: dict[Hashable, tuple[Contact, int]] = {}  # peer -> (contact, depth)
        self._queried: set[Hashable] = set()
        self._responded: list[tuple[int, int, Hashable]] = []  # sorted by distance
        self._in_flight = 0
        self._changed = trio.Event()
        self.result = LookupResult(nearest=[])
        for contact in initial:
            self._add(contact, 1)

    def _add(self, contact: Contact, depth: int) -> None:
        if contact.peer_id == self.exclude or contact.peer_id in self._known:
            return
        if self.is_banned(contact.peer_id):
            return
        self._known[contact.peer_id] = (contact, depth)
        heapq.heappush(
            self._heap, (contact.node_id ^ self.target_id, next(self._counter), contact.peer_id)
        )

    def _beam_bound(self) -> float:
        """Distance of the beam_size-th nearest peer that answered or is pending (recently)."""
        now = trio.current_time()
        pending = [d for d, sent in self._pending.values() if now - sent < self.patience]
        if len(self._responded) + len(pending) < self.beam_size:
            return float("inf")
        answered = (item[0] for item in self._responded[: self.beam_size])
        return heapq.nsmallest(self.beam_size, itertools.chain(answered, pending))[-1]

    def _next_candidate(self) -> tuple[Contact, int] | None:
        if self.result.messages >= self.max_messages:
            return None
        bound = self._beam_bound() if self._heap else float("inf")
        while self._heap:
            dist = self._heap[0][0]
            if dist > bound:
                return None
            _, _, peer = heapq.heappop(self._heap)
            if peer in self._queried:
                continue
            self._queried.add(peer)
            return self._known[peer]
        return None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self) -> LookupResult:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.alpha):
                nursery.start_soon(self._worker)
        return self.snapshot()

    def snapshot(self) -> LookupResult:
        """The result so far (also valid after the lookup was cut short by a timeout)."""
        self.result.nearest = [
            self._known[peer][0] for _, _, peer in self._responded[: self.beam_size]
        ]
        if self._responded:
            self.result.hops = self._known[self._responded[0][2]][1]
        return self.result

    async def _worker(self) -> None:
        while True:
            picked = self._next_candidate()
            if picked is None:
                if self._in_flight == 0:
                    self._notify()
                    return
                with trio.move_on_after(self.patience):  # a silent pending peer loses its place
                    await self._changed.wait()
                continue
            contact, depth = picked
            self._in_flight += 1
            self._pending[contact.peer_id] = (
                contact.node_id ^ self.target_id,
                trio.current_time(),
            )
            self.result.messages += 1
            self.result.rounds = max(self.result.rounds, depth)
            try:
                response = await self.find(contact)
                if response is not None:
                    self._on_response(contact, depth, response)
            finally:
                self._in_flight -= 1
                self._pending.pop(contact.peer_id, None)
                self._notify()

    def _on_response(self, contact: Contact, depth: int, response: FindResult[Contact]) -> None:
        item = (contact.node_id ^ self.target_id, next(self._counter), contact.peer_id)
        bisect.insort(self._responded, item)
        self.result.responses.append((contact, response))
        for peer in response.peers:  # the node converted them to Contacts
            self._add(peer, depth + 1)
        if self.stop_when is not None and self.stop_when(response):
            self.result.stopped_early = True
            self._nursery.cancel_scope.cancel()
