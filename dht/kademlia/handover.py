"""Hand-over: give stored records to the peers that routing changes made their replicas.

When a peer joins near a key (or one of a key's replicas leaves), the records stored here
should reach the peers that are now among the key's ``num_replicas`` nearest, without waiting
for the origin's next republish. :class:`Handover` remembers which contacts came or went,
batches those changes, computes which records go where (a pure function of the routing table
and the store, bounded in CPU) and sends them with batched store RPCs. Apart from the node
because it is a background job of its own with its own state and cost bounds.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.protocol import MAX_RECORDS_PER_STORE
from dht.kademlia.records import DHTRecord
from dht.kademlia.routing import Contact

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode

logger = logging.getLogger(__name__)

HANDOVER_MAX_PENDING = 4096  # routing changes remembered between hand-over passes
HANDOVER_PARALLEL_RPCS = 8


@dataclass
class MaintenanceStats:
    """Counters of the background work that keeps records alive (read by tests/benchmarks)."""

    republish_passes: int = 0
    republished_records: int = 0
    superseded_records: int = 0  # dropped from the republish set: a newer record won
    handover_passes: int = 0
    handover_rpcs: int = 0
    handover_records: int = 0


class Handover:
    """The hand-over of one node's stored records (``DHTNode(handover=True)``, servers only)."""

    def __init__(self, node: DHTNode) -> None:
        self.node = node
        # peer -> (was it a contact before the first change since the last hand-over pass)
        self.changes: dict[Any, tuple[bool, Contact]] = {}
        self.changed = trio.Event()

    def on_routing_change(self, added: Contact | None, removed: Contact | None) -> None:
        """Remember which contacts came or went; the hand-over pass compares before and after."""
        contact = added if added is not None else removed
        assert contact is not None
        if contact.peer_id not in self.changes:
            if len(self.changes) >= HANDOVER_MAX_PENDING:
                logger.debug("hand-over backlog full; not tracking %s", contact.peer_id)
                return
            self.changes[contact.peer_id] = (removed is not None, contact)
        self.changed.set()

    async def run(self, nursery: trio.Nursery) -> None:
        """Batch routing changes for ``handover_delay`` seconds, then hand records over.

        A pass over a large store costs CPU (a few microseconds per key and change), so the
        next batch waits at least ten times as long as the last pass took: at most ~10 % of
        a core goes to hand-over however fast the routing table changes.
        """
        cost = 0.0
        while True:
            await self.changed.wait()
            await trio.sleep(max(self.node.handover_delay, 10 * cost))
            self.changed = trio.Event()
            changes, self.changes = self.changes, {}
            if len(self.node.storage):
                started = time.perf_counter()
                plan = await self.plan(changes)
                cost = time.perf_counter() - started
                if plan:
                    nursery.start_soon(self.send, plan)

    async def plan(self, changes: dict[Any, tuple[bool, Contact]]) -> dict[Any, list[DHTRecord]]:
        """Which stored records go to which peers: to each peer that routing changes made one
        of a key's ``num_replicas`` nearest (as far as this node knows), i.e. newly met peers
        closer than the furthest known replica, and the next peer in line when one left.

        For every key the old and new replica sets are computed over the same pool (the
        contacts plus this node, with departed contacts added back for the old set); keys
        whose nearest ``num_replicas`` members are all closer than every changed peer are
        skipped after two bisections, so a pass costs O(keys x changes) plus the few keys
        near a change."""
        node = self.node
        table = {c.peer_id: c for c in node.routing_table}
        changed: dict[int, tuple[bool, Contact]] = {}  # node ID -> (joined the pool, contact)
        for peer_id, (was_in, contact) in changes.items():
            now_in = peer_id in table
            if was_in != now_in:
                changed[contact.node_id] = (now_in, contact)
        if not changed:
            return {}
        members: dict[int, Contact | None] = {c.node_id: c for c in table.values()}
        for node_id, (joined, contact) in changed.items():
            if not joined:
                members[node_id] = contact
        members[node.node_id] = None
        ids = sorted(members)
        joined_ids = {i for i, (joined, _) in changed.items() if joined}
        left_ids = {i for i, (joined, _) in changed.items() if not joined}
        replicas, needed = node.num_replicas, node.num_replicas + len(changed)

        def window(key_id: int, bits: int) -> tuple[int, int]:
            lower = (key_id >> bits) << bits
            return bisect.bisect_left(ids, lower), bisect.bisect_left(ids, lower + (1 << bits))

        now = get_dht_time()
        plan: dict[Any, list[DHTRecord]] = {}
        for count, key_id in enumerate(node.storage.key_ids()):
            if count % 256 == 255:
                await trio.lowlevel.checkpoint()
            bits = min((i ^ key_id).bit_length() for i in changed)
            # members at XOR distance < 2**(bits-1) are closer than every changed peer
            start, stop = window(key_id, max(bits - 1, 0))
            if bits > 0 and stop - start >= replicas:
                continue
            while stop - start < needed and bits < 256:
                bits += 1
                start, stop = window(key_id, bits)
            nearest = sorted(ids[start:stop], key=lambda i: i ^ key_id)
            before = [i for i in nearest if i not in joined_ids][:replicas]
            after = [i for i in nearest if i not in left_ids][:replicas]
            targets = set(after) - set(before) - {node.node_id}
            if not targets:
                continue
            stored = node.storage.get(key_id, now)
            records = [stored] if isinstance(stored, DHTRecord) else list((stored or {}).values())
            for target in targets:
                member = members[target]
                assert member is not None
                plan.setdefault(member.peer_id, []).extend(records)
        return plan

    async def send(self, plan: dict[Any, list[DHTRecord]]) -> None:
        """One batched store RPC per peer (at most 4 x MAX_RECORDS_PER_STORE records each)."""
        stats = self.node.maintenance
        stats.handover_passes += 1
        limiter = trio.CapacityLimiter(HANDOVER_PARALLEL_RPCS)

        async def send(peer_id: Any, records: list[DHTRecord]) -> None:
            async with limiter:
                for start in range(
                    0, min(len(records), 4 * MAX_RECORDS_PER_STORE), MAX_RECORDS_PER_STORE
                ):
                    chunk = records[start : start + MAX_RECORDS_PER_STORE]
                    stats.handover_rpcs += 1
                    stats.handover_records += len(chunk)
                    await self.node._store_rpc(peer_id, chunk)

        async with trio.open_nursery() as nursery:
            for peer_id, records in plan.items():
                nursery.start_soon(send, peer_id, records)
