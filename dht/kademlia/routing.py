"""Kademlia routing table (k-buckets with replacement caches) and a backoff blacklist.

Buckets cover contiguous ID ranges; only the bucket containing our own ID splits, so the table
keeps ~k contacts per distance scale. Within a bucket contacts are ordered least-recently-seen
first. When a full bucket cannot split, the newcomer waits in the bucket's replacement cache
and the caller is told which oldest contact to ping: if that ping fails the oldest is evicted
and the freshest replacement promoted (live, long-lived contacts are preferred, as in the paper).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from dht.kademlia.ids import MAX_ID, PeerKey


@dataclass
class Contact:
    """A peer we can route to: its PeerID, node ID and the addresses it announced."""

    peer_id: PeerKey
    node_id: int
    addrs: tuple[bytes, ...] = ()
    last_seen: float = float("-inf")


@dataclass
class KBucket:
    lower: int
    upper: int  # exclusive
    size: int
    contacts: OrderedDict[Hashable, Contact] = field(default_factory=OrderedDict)
    replacements: OrderedDict[Hashable, Contact] = field(default_factory=OrderedDict)
    last_updated: float = 0.0

    def covers(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def add_replacement(self, contact: Contact) -> None:
        self.replacements.pop(contact.peer_id, None)
        self.replacements[contact.peer_id] = contact
        while len(self.replacements) > self.size:
            self.replacements.popitem(last=False)

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.lower + self.upper) // 2
        left = KBucket(self.lower, middle, self.size, last_updated=self.last_updated)
        right = KBucket(middle, self.upper, self.size, last_updated=self.last_updated)
        for source, attr in ((self.contacts, "contacts"), (self.replacements, "replacements")):
            for pid, contact in source.items():
                target = left if left.covers(contact.node_id) else right
                getattr(target, attr)[pid] = contact
        return left, right


class RoutingTable:
    """k-buckets around ``node_id``. Not thread-safe; used from one trio loop."""

    def __init__(
        self,
        node_id: int,
        bucket_size: int = 20,
        on_split: Callable[[KBucket], None] | None = None,
        recheck_after: float = 60.0,
    ):
        self.node_id = node_id
        self.bucket_size = bucket_size
        self.recheck_after = recheck_after  # contacts seen more recently are not pinged again
        self.buckets: list[KBucket] = [KBucket(0, MAX_ID, bucket_size)]
        self._by_peer: dict[Hashable, Contact] = {}
        self._by_node: dict[int, Contact] = {}
        self._ids: list[int] = []  # node IDs of all contacts, sorted (for nearest())
        # called with (added, None) / (None, removed) whenever the set of contacts changes
        # (the node hands records to peers that became replicas of its keys)
        self.on_change: Callable[[Contact | None, Contact | None], None] | None = None
        # called with the far half of every split: a bucket that may hold few of the peers in
        # its range, as they were met before it existed (the node refreshes it)
        self.on_split = on_split

    def __len__(self) -> int:
        return len(self._by_peer)

    def __contains__(self, peer_id: Hashable) -> bool:
        return peer_id in self._by_peer

    def __iter__(self) -> Iterator[Contact]:
        return iter(list(self._by_peer.values()))

    def get(self, peer_id: Hashable) -> Contact | None:
        return self._by_peer.get(peer_id)

    def bucket_index(self, node_id: int) -> int:
        lo, hi = 0, len(self.buckets) - 1
        while lo < hi:  # buckets are sorted and contiguous: binary search
            mid = (lo + hi) // 2
            if node_id < self.buckets[mid].upper:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def add_or_update(self, contact: Contact, now: float) -> Contact | None:
        """Record that ``contact`` was seen alive.

        Returns the bucket's least-recently-seen contact if the bucket is full and that contact
        was not seen within ``recheck_after`` seconds (the caller should ping it and call
        :meth:`remove` if it is dead), else None.
        """
        if contact.node_id == self.node_id:
            return None
        contact.last_seen = now
        while True:
            index = self.bucket_index(contact.node_id)
            bucket = self.buckets[index]
            if contact.peer_id in bucket.contacts:
                bucket.contacts.move_to_end(contact.peer_id)
                known = bucket.contacts[contact.peer_id]
                known.last_seen = now
                if contact.addrs:
                    known.addrs = contact.addrs
                bucket.last_updated = now
                return None
            if len(bucket.contacts) < bucket.size:
                bucket.contacts[contact.peer_id] = contact
                bucket.replacements.pop(contact.peer_id, None)
                self._index(contact)
                bucket.last_updated = now
                if self.on_change is not None:
                    self.on_change(contact, None)
                return None
            if bucket.covers(self.node_id) and bucket.upper - bucket.lower > 1:
                halves = bucket.split()
                self.buckets[index : index + 1] = halves
                if self.on_split is not None:
                    self.on_split(halves[1] if halves[0].covers(self.node_id) else halves[0])
                continue
            bucket.add_replacement(contact)
            oldest = next(iter(bucket.contacts.values()))
            return oldest if now - oldest.last_seen >= self.recheck_after else None

    def remove(self, peer_id: Hashable) -> Contact | None:
        """Drop a contact (dead or misbehaving) and promote the freshest replacement, if any."""
        contact = self._by_peer.pop(peer_id, None)
        if contact is not None:
            del self._by_node[contact.node_id]
            del self._ids[bisect.bisect_left(self._ids, contact.node_id)]
        if contact is None:
            for bucket in self.buckets:
                bucket.replacements.pop(peer_id, None)
            return None
        bucket = self.buckets[self.bucket_index(contact.node_id)]
        del bucket.contacts[peer_id]
        bucket.replacements.pop(peer_id, None)
        if bucket.replacements:
            _, promoted = bucket.replacements.popitem(last=True)
            bucket.contacts[promoted.peer_id] = promoted
            bucket.contacts.move_to_end(promoted.peer_id, last=False)  # not yet seen alive
            self._index(promoted)
            if self.on_change is not None:
                self.on_change(promoted, None)
        if self.on_change is not None:
            self.on_change(None, contact)
        return contact

    def _index(self, contact: Contact) -> None:
        self._by_peer[contact.peer_id] = contact
        self._by_node[contact.node_id] = contact
        bisect.insort(self._ids, contact.node_id)

    def nearest(self, target_id: int, count: int, exclude: Hashable | None = None) -> list[Contact]:
        """The ``count`` contacts closest to ``target_id`` by XOR distance.

        Every ID sharing the target's top ``256 - j`` bits is closer to it than every ID that
        does not, and such IDs form one range of the sorted ID list. So the nearest contacts
        lie in the smallest such range holding enough of them, found by bisection: this is
        called for every find request served and every lookup, and scanning the whole table
        each time was the simulations' largest single cost.
        """
        ids = self._ids
        need = count + (exclude is not None and exclude in self._by_peer)
        if count <= 0 or not ids:
            return []
        if len(ids) <= need:
            window = ids
        else:
            low, high = 0, 256
            while low < high:
                bits = (low + high) // 2
                lower = (target_id >> bits) << bits
                inside = bisect.bisect_left(ids, lower + (1 << bits)) - bisect.bisect_left(
                    ids, lower
                )
                if inside >= need:
                    high = bits
                else:
                    low = bits + 1
            lower = (target_id >> low) << low
            window = ids[
                bisect.bisect_left(ids, lower) : bisect.bisect_left(ids, lower + (1 << low))
            ]
        by_node = self._by_node
        found = [by_node[i] for i in heapq.nsmallest(need, window, key=lambda i: i ^ target_id)]
        return [c for c in found if c.peer_id != exclude][:count]

    def stale_buckets(self, now: float, period: float) -> list[KBucket]:
        return [b for b in self.buckets if now - b.last_updated >= period]


class Blacklist:
    """Peers that failed to answer, banned for exponentially growing periods (capped, bounded)."""

    def __init__(
        self, base_delay: float = 5.0, max_delay: float = 300.0, max_entries: int = 10_000
    ):
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.max_entries = max_entries
        self._banned: OrderedDict[Hashable, tuple[float, int]] = (
            OrderedDict()
        )  # peer -> (until, failures)

    def __len__(self) -> int:
        return len(self._banned)

    def register_failure(self, peer_id: Hashable, now: float) -> float:
        """Ban ``peer_id``; returns the ban duration."""
        _, failures = self._banned.pop(peer_id, (0.0, 0))
        delay: float = min(self.base_delay * (2**failures), self.max_delay)
        self._banned[peer_id] = (now + delay, failures + 1)
        while len(self._banned) > self.max_entries:
            self._banned.popitem(last=False)
        return delay

    def register_success(self, peer_id: Hashable) -> None:
        self._banned.pop(peer_id, None)

    def is_banned(self, peer_id: Hashable, now: float) -> bool:
        entry = self._banned.get(peer_id)
        return entry is not None and entry[0] > now


OUTAGE_PEERS = 8  # distinct peers failing in a row, none answering between: our outage


class BusyPeers:
    """Peers that left RPCs unanswered while their connection kept delivering bytes: a full
    link (an all-reduce on a slow uplink), not a dead peer. Up to ``misses`` such RPCs in a
    row are not held against a peer; past that (a DHT that never answers again) it is treated
    like a silent one. At most ``max_peers`` are remembered (all forgotten beyond)."""

    def __init__(self, misses: int = 4, max_peers: int = 4096) -> None:
        self.misses = misses
        self.max_peers = max_peers
        self._in_a_row: dict[Hashable, int] = {}

    def tolerate(self, peer_id: Hashable, busy: bool) -> bool:
        """An RPC to ``peer_id`` got no answer (``busy``: its connection delivered meanwhile):
        True while that is forgiven, False when it counts as a failure."""
        count = self._in_a_row.pop(peer_id, 0)
        if not busy or count >= self.misses:
            return False
        if len(self._in_a_row) >= self.max_peers:
            self._in_a_row.clear()
        self._in_a_row[peer_id] = count + 1
        return True

    def answered(self, peer_id: Hashable) -> None:
        self._in_a_row.pop(peer_id, None)


class OutageGuard:
    """Tells a dead peer from a dead link of our own, and takes back what the latter cost.

    Every RPC that gets no answer bans the peer it went to and drops it from the routing
    table. When our own links are down, every RPC fails, and the node would come back with an
    empty table and the whole swarm banned (in the 256-peer simulation, peers back from a cut
    stayed alone for rounds). Peers failing in a row with no answer from anyone between them
    are recorded here; from ``threshold`` of them on we stop blaming peers (``suspected``),
    and the first answer afterwards (to an RPC of ours, or an RPC to us) hands back the
    streak's peers, to be unbanned and put back. A shorter streak is the peers' own fault: an
    answer only forgets it. With peers failing independently at a rate of 20%, 8 in a row
    without an answer between happen about 3 times in a million.
    """

    def __init__(self, threshold: int = OUTAGE_PEERS, capacity: int = 256):
        self.threshold = threshold
        self.capacity = capacity
        self._streak: OrderedDict[Hashable, Contact | None] = OrderedDict()

    @property
    def suspected(self) -> bool:
        return len(self._streak) >= self.threshold

    def failed(self, peer_id: Hashable, contact: Contact | None) -> None:
        """``peer_id`` did not answer (``contact``: its routing entry, which was dropped)."""
        self._streak[peer_id] = contact
        self._streak.move_to_end(peer_id)
        while len(self._streak) > self.capacity:
            self._streak.popitem(last=False)

    def recovered(self) -> list[tuple[Hashable, Contact | None]]:
        """Someone answered: the streak's peers if it was an outage of ours, else nothing."""
        if not self._streak:
            return []
        streak = list(self._streak.items()) if self.suspected else []
        self._streak.clear()
        return streak
