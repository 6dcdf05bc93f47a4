"""Shared lookups: concurrent callers of one target wait on one iterative lookup.

Many tasks of a node look up the same key at once (a matchmaking round, a ``get_many``); each
lookup costs ``alpha``-parallel RPCs over several hops, so identical lookups run once and
every caller receives its result (or, with ``patience``, what it has found so far). While
several lookups run, their ``find`` RPCs to one peer are batched (``batching.FindBatcher``);
at most ``max_parallel_lookups`` run at a time. The iteration itself is ``traverse.Lookup``;
this is the node's bookkeeping around it, apart from the node so its state sits in one place.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.protocol import FindResult
from dht.kademlia.routing import Contact
from dht.kademlia.traverse import Lookup, LookupResult

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode


@dataclass(frozen=True)
class LookupStats:
    hops: int
    rounds: int
    messages: int


class _SharedSearch:
    """One lookup that concurrent callers for the same target wait on together."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: LookupResult | None = None
        self.lookup: Lookup | None = None  # set once it runs: impatient callers read it early


def has_plain_value(result: FindResult[Contact]) -> bool:
    """A replica answered with a plain (not dictionary) value: a first-value lookup is done."""
    return result.entries is not None and any(entry[0] is None for entry in result.entries)


class SharedLookups:
    """The lookups of one node, shared between callers of the same target and mode."""

    def __init__(self, node: DHTNode, max_parallel_lookups: int) -> None:
        self.node = node
        self.running: dict[tuple[int, str], _SharedSearch] = {}
        self.limiter = trio.CapacityLimiter(max_parallel_lookups)
        self.stats: deque[LookupStats] = deque(maxlen=100_000)

    async def lookup(
        self, target_id: int, beam_size: int, mode: str, patience: float | None = None
    ) -> LookupResult:
        """Run (or join) the lookup of ``target_id``; concurrent identical lookups share one.

        ``mode``: "nearest", "first-value" (stop at the first plain value) or "all-values".
        ``patience``: return the responses so far after this many seconds; the lookup itself
        goes on for the callers that wait for all of it.
        """
        tag = (target_id, f"{mode}:{beam_size}")
        search = self.running.get(tag)
        if search is None:
            search = self.running[tag] = _SharedSearch()
            nursery = self.node._nursery
            assert nursery is not None, "the node is not running"
            nursery.start_soon(self._run, tag, search, target_id, beam_size, mode)
        with trio.move_on_after(math.inf if patience is None else patience):
            await search.done.wait()
        if search.result is not None:
            return search.result
        if search.lookup is None:  # not started yet: nobody answered
            return LookupResult(nearest=[])
        return search.lookup.snapshot()

    async def _run(
        self, tag: tuple[int, str], search: _SharedSearch, target_id: int, beam_size: int, mode: str
    ) -> None:
        node = self.node
        stop_when = has_plain_value if mode == "first-value" else None

        values = mode != "nearest"  # a lookup for peers only: replies without the entries

        async def find(contact: Contact) -> FindResult[Contact] | None:
            assert node._nursery is not None
            count = max(2 * beam_size, node.alpha)
            if len(self.running) > 1:  # other lookups are running: share RPCs with them
                return await node._finds.find(node._nursery, contact, target_id, count, values)
            # a lone lookup calls directly: no extra scheduling tick, and cancellable
            results = await node._find_rpc(contact, [target_id], count, values)
            return results[0] if results else None

        initial = node.routing_table.nearest(target_id, max(beam_size, node.bucket_size))
        lookup = Lookup(
            target_id,
            initial,
            find,
            beam_size=beam_size,
            alpha=node.alpha,
            exclude=node.peer_id,
            is_banned=lambda peer: node.blacklist.is_banned(peer, get_dht_time()),
            stop_when=stop_when,
        )
        search.lookup = lookup
        try:
            async with self.limiter:
                with trio.move_on_after(node.lookup_timeout):
                    await lookup.run()
        finally:
            search.result = lookup.snapshot()
            self.running.pop(tag, None)
            search.done.set()
        self.stats.append(
            LookupStats(lookup.result.hops, lookup.result.rounds, lookup.result.messages)
        )
