"""Coming back from an empty routing table.

Every RPC that gets no answer drops its peer from the routing table. In a small swarm that can
drop them all: a process paused for a few seconds (SIGSTOP, a suspended laptop, a VM frozen by
its host) wakes to find every RPC it had in flight timed out, and a swarm of four is three
contacts, far below the outage guard's streak (routing.OutageGuard). The others dropped the
sleeper meanwhile, so nobody calls anyone again. Worse, a server with an empty table is the
nearest node to every key: its stores "succeed" locally and its reads find only its own
records, so it carries on alone, believing it is the whole DHT (the chaos test's peer that
trained alone 15 epochs behind the swarm for the rest of the run).

So once the table is empty, the node tries its way back: the contacts it dropped (newest
first, their bans ignored: with every contact gone it cannot tell their fault from its own)
and its initial peers. The first answer is followed by Kademlia's join (a self-lookup, then
the far buckets), and the bans of the dropped contacts are lifted. Failed tries back off from
2 s to a minute, so a node whose whole swarm is gone costs next to nothing.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia.join import try_initial_peers_once
from dht.kademlia.routing import Contact

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode

logger = logging.getLogger(__name__)

REJOIN_RETRY_FIRST = 2.0  # seconds before a second try; doubling up to the next
REJOIN_RETRY_MAX = 60.0
MAX_DROPPED = 32  # contacts remembered to rejoin through (the newest)
PINGS_PER_TRY = 8  # dropped contacts pinged at once per try


class Rejoin:
    """A node's way back after its routing table emptied (module doc)."""

    def __init__(self, node: DHTNode) -> None:
        self.node = node
        self.initial_peers: list[Any] = []
        self.dropped: OrderedDict[Hashable, Contact] = OrderedDict()
        self.attempts = 0  # tries made (for tests and monitoring)
        self.rejoined = 0  # tries that brought the node back
        self._emptied = trio.Event()

    def dropped_contact(self, contact: Contact | None) -> None:
        """``contact`` left the table for not answering: remember it; wake the loop if it
        was the last one."""
        if contact is not None:
            self.dropped.pop(contact.peer_id, None)
            self.dropped[contact.peer_id] = contact
            while len(self.dropped) > MAX_DROPPED:
                self.dropped.popitem(last=False)
        if len(self.node.routing_table) == 0:
            self._emptied.set()

    async def run(self) -> None:
        """Wait for the table to empty, then try to rejoin until it is not empty."""
        while True:
            await self._emptied.wait()
            self._emptied = trio.Event()
            delay = REJOIN_RETRY_FIRST
            while len(self.node.routing_table) == 0 and (self.dropped or self.initial_peers):
                if await self.try_once():
                    break
                await trio.sleep(delay * random.uniform(0.75, 1.25))
                delay = min(2 * delay, REJOIN_RETRY_MAX)

    async def try_once(self) -> bool:
        """Ping the dropped contacts, then the initial peers; on an answer, join again."""
        node = self.node
        self.attempts += 1
        answered: list[Any] = []

        async def ping(peer_id: Any, addrs: Any = ()) -> bool:
            if await node.ping(peer_id, addrs, even_if_banned=True):
                answered.append(peer_id)
                return True
            return False

        async with trio.open_nursery() as nursery:
            for contact in list(self.dropped.values())[-PINGS_PER_TRY:]:
                node.network.remember_addrs(contact.peer_id, contact.addrs)
                nursery.start_soon(ping, contact.peer_id, contact.addrs)
        if not answered and self.initial_peers:
            await try_initial_peers_once(node.network, ping, self.initial_peers, node.rpc_timeout)
        if not answered:
            return False
        for peer_id in self.dropped:  # with every contact gone, their bans were guesses
            node.blacklist.register_success(peer_id)
        self.dropped.clear()
        await node.join_neighbourhood()
        self.rejoined += 1
        logger.info(
            "every DHT contact had stopped answering (this process paused, or its links "
            "were down); rejoined through %d peer(s): %d contacts",
            len(answered),
            len(node.routing_table),
        )
        return True
