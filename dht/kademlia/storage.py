"""Local record storage of one DHT node: expiration, dictionary values, hard limits.

Semantics (per key):
- a plain value is replaced only by one with a later expiration;
- a dictionary value holds ``subkey -> record``, each expiring on its own; its expiration is
  the latest of its subkeys'; a subkey write replaces a plain value only if it expires later,
  and a plain write replaces a whole dictionary only if it expires after every subkey;
- expired records are never returned; they are pruned lazily through an expiration heap.

Limits are enforced before anything is stored, and refusals carry a reason.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from dht.kademlia.records import DHTRecord


@dataclass(frozen=True)
class StorageLimits:
    """Hard caps of one node's storage. Over-limit stores are refused with a reason."""

    max_record_bytes: int = 64 * 1024  # key + subkey + value + signature
    max_records: int = 100_000
    max_total_bytes: int = 64 * 1024 * 1024
    max_subkeys_per_key: int = 4096
    max_expiration_horizon: float = 7 * 24 * 3600.0  # how far in the future a record may expire
    max_origin_fraction: float = 0.25  # share of the record/byte limits one sending peer may use


@dataclass
class _Entry:
    key: bytes
    plain: DHTRecord | None = None
    subkeys: dict[bytes, DHTRecord] = field(default_factory=dict)

    def latest_expiration(self) -> float:
        if self.plain is not None:
            return self.plain.expiration_time
        return max((r.expiration_time for r in self.subkeys.values()), default=float("-inf"))


class LocalStorage:
    """In-memory records indexed by key ID, with byte and record accounting."""

    def __init__(self, limits: StorageLimits | None = None):
        self.limits = limits or StorageLimits()
        self._entries: dict[int, _Entry] = {}
        self._heap: list[tuple[float, int, bytes | None]] = []
        self._origin_of: dict[tuple[int, bytes | None], Hashable] = {}  # record -> sending peer
        self._usage: dict[Hashable, tuple[int, int]] = {}  # sending peer -> (records, bytes)
        self.num_records = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return self.num_records

    def check_limits(self, record: DHTRecord, now: float) -> str | None:
        """Reason why ``record`` can never be stored here, or None (capacity checked later)."""
        if record.size > self.limits.max_record_bytes:
            return f"record too large: {record.size} > {self.limits.max_record_bytes} bytes"
        if not record.expiration_time > now:
            return "record already expired"
        if record.expiration_time > now + self.limits.max_expiration_horizon:
            return f"expiration more than {self.limits.max_expiration_horizon:.0f}s in the future"
        return None

    def store(
        self, key_id: int, record: DHTRecord, now: float, origin: Hashable | None = None
    ) -> tuple[bool, str | None]:
        """Store a validated record. Returns (accepted, reason-if-refused).

        ``origin`` is the peer that sent it (None for this node's own writes); each origin may
        hold at most ``max_origin_fraction`` of the record and byte limits, so one flooding
        peer cannot take all the space. A record that loses to a newer one is not an error:
        (False, "outdated: ...").
        """
        reason = self.check_limits(record, now)
        if reason is not None:
            return False, reason
        entry = self._entries.get(key_id)
        if entry is not None and entry.key != record.key:
            return False, "key ID collision"  # practically impossible with SHA-256
        if self.holds(key_id, record):
            return True, None  # a republished or handed-over copy of what we have: a no-op
        replaced: list[DHTRecord] = []
        if entry is not None:
            if record.subkey is None:
                if record.expiration_time <= entry.latest_expiration():
                    return False, "outdated: a record with a later expiration is stored"
                replaced = (
                    [entry.plain] if entry.plain is not None else list(entry.subkeys.values())
                )
            elif entry.plain is not None:
                if record.expiration_time <= entry.plain.expiration_time:
                    return False, "outdated: a plain value with a later expiration is stored"
                replaced = [entry.plain]
            else:
                old = entry.subkeys.get(record.subkey)
                if old is not None:
                    if record.expiration_time <= old.expiration_time:
                        return False, "outdated: this subkey has a later expiration"
                    replaced = [old]
                elif len(entry.subkeys) >= self.limits.max_subkeys_per_key:
                    self.prune(now)
                    if len(entry.subkeys) >= self.limits.max_subkeys_per_key:
                        limit = self.limits.max_subkeys_per_key
                        return False, f"too many subkeys for one key (max {limit})"
        if origin is not None:
            reason = self._check_origin_quota(key_id, origin, record, replaced)
            if reason is not None:
                return False, reason
        freed_bytes = sum(r.size for r in replaced)
        reason = self._check_capacity(1 - len(replaced), record.size - freed_bytes, now)
        if reason is not None:
            return False, reason
        self._put(key_id, record, origin)
        return True, None

    def holds(self, key_id: int, record: DHTRecord) -> bool:
        """True if exactly this record (value, expiration and signature) is stored.

        Republishing and hand-over resend records replicas usually have already; those are
        accepted as no-ops (and need no second signature check), while "outdated" keeps
        meaning that a different, newer record superseded the sender's.
        """
        entry = self._entries.get(key_id)
        if entry is None:
            return False
        if record.subkey is None:
            return entry.plain == record
        return entry.subkeys.get(record.subkey) == record

    def _check_origin_quota(
        self, key_id: int, origin: Hashable, record: DHTRecord, replaced: list[DHTRecord]
    ) -> str | None:
        used_records, used_bytes = self._usage.get(origin, (0, 0))
        for old in replaced:  # replacing one's own records frees one's own quota
            if self._origin_of.get((key_id, old.subkey)) == origin:
                used_records, used_bytes = used_records - 1, used_bytes - old.size
        max_records = max(1, int(self.limits.max_records * self.limits.max_origin_fraction))
        max_bytes = max(1, int(self.limits.max_total_bytes * self.limits.max_origin_fraction))
        if used_records + 1 > max_records or used_bytes + record.size > max_bytes:
            return f"per-peer quota exceeded ({used_records} records, {used_bytes} bytes from this peer)"
        return None

    def _check_capacity(self, extra_records: int, extra_bytes: int, now: float) -> str | None:
        for attempt in range(2):
            over_records = self.num_records + extra_records > self.limits.max_records
            over_bytes = self.num_bytes + extra_bytes > self.limits.max_total_bytes
            if not (over_records or over_bytes):
                return None
            if attempt == 0:
                self.prune(now)
        if over_records:
            return f"storage full: {self.num_records} records (max {self.limits.max_records})"
        return f"storage full: {self.num_bytes} bytes (max {self.limits.max_total_bytes})"

    def _put(self, key_id: int, record: DHTRecord, origin: Hashable | None) -> None:
        entry = self._entries.get(key_id)
        if entry is None:
            entry = self._entries[key_id] = _Entry(record.key)
        if record.subkey is None:
            self._drop_all(key_id, entry)
            entry.plain = record
        else:
            if entry.plain is not None:
                self._forget(key_id, entry.plain)
                entry.plain = None
            old = entry.subkeys.get(record.subkey)
            if old is not None:
                self._forget(key_id, old)
            entry.subkeys[record.subkey] = record
        self._account(1, record.size)
        if origin is not None:
            self._origin_of[(key_id, record.subkey)] = origin
            used_records, used_bytes = self._usage.get(origin, (0, 0))
            self._usage[origin] = (used_records + 1, used_bytes + record.size)
        heapq.heappush(self._heap, (record.expiration_time, key_id, record.subkey))
        if len(self._heap) > 4 * max(self.num_records, 1024):
            self._rebuild_heap()

    def _drop_all(self, key_id: int, entry: _Entry) -> None:
        if entry.plain is not None:
            self._forget(key_id, entry.plain)
            entry.plain = None
        for old in entry.subkeys.values():
            self._forget(key_id, old)
        entry.subkeys.clear()

    def _forget(self, key_id: int, record: DHTRecord) -> None:
        """Un-account a record that is being removed (totals and its origin's usage)."""
        self._account(-1, -record.size)
        origin = self._origin_of.pop((key_id, record.subkey), None)
        if origin is not None:
            used_records, used_bytes = self._usage[origin]
            if used_records <= 1:
                del self._usage[origin]
            else:
                self._usage[origin] = (used_records - 1, used_bytes - record.size)

    def _account(self, records: int, size: int) -> None:
        self.num_records += records
        self.num_bytes += size

    def prune(self, now: float) -> int:
        """Drop every record that expired at or before ``now``; returns how many."""
        dropped = 0
        while self._heap and self._heap[0][0] <= now:
            expiration, key_id, subkey = heapq.heappop(self._heap)
            entry = self._entries.get(key_id)
            if entry is None:
                continue
            if subkey is None:
                current = entry.plain
                if current is not None and current.expiration_time == expiration:
                    entry.plain = None
                    self._forget(key_id, current)
                    dropped += 1
            else:
                current = entry.subkeys.get(subkey)
                if current is not None and current.expiration_time == expiration:
                    del entry.subkeys[subkey]
                    self._forget(key_id, current)
                    dropped += 1
            if entry.plain is None and not entry.subkeys:
                del self._entries[key_id]
        return dropped

    def _rebuild_heap(self) -> None:
        """Drop stale heap items (records replaced before expiring) so the heap stays bounded."""
        self._heap = [
            (r.expiration_time, key_id, r.subkey)
            for key_id, entry in self._entries.items()
            for r in ([entry.plain] if entry.plain is not None else entry.subkeys.values())
        ]
        heapq.heapify(self._heap)

    def get(self, key_id: int, now: float) -> DHTRecord | dict[bytes, DHTRecord] | None:
        """The live plain record, the live subkey records (a dict), or None."""
        entry = self._entries.get(key_id)
        if entry is None:
            return None
        if entry.plain is not None:
            return entry.plain if entry.plain.expiration_time > now else None
        live = {s: r for s, r in entry.subkeys.items() if r.expiration_time > now}
        return live or None

    def key_ids(self) -> list[int]:
        return list(self._entries)


@dataclass
class _Owned:
    record: DHTRecord
    last_published: float


class OwnedRecords:
    """Records this node stored as their origin, which it republishes until they expire.

    Bounded in count and bytes: past a limit the entry stored longest ago is forgotten (it is
    not deleted from the DHT, it is only no longer republished). Keyed by (key ID, subkey):
    a newer write of the same key/subkey replaces the older one.
    """

    def __init__(self, max_records: int = 10_000, max_bytes: int = 16 * 1024 * 1024):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[int, bytes | None], _Owned] = OrderedDict()
        self.num_bytes = 0
        self.evicted = 0  # forgotten because of the limits (tests and logs read it)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: tuple[int, bytes | None]) -> bool:
        return name in self._items

    def get(self, name: tuple[int, bytes | None]) -> DHTRecord | None:
        item = self._items.get(name)
        return None if item is None else item.record

    def add(self, key_id: int, record: DHTRecord, now: float) -> None:
        """Remember ``record`` (published at ``now``); an older one of the same name is replaced,
        a newer one is kept."""
        name = (key_id, record.subkey)
        old = self._items.get(name)
        if old is not None:
            if old.record.expiration_time > record.expiration_time:
                return
            self._remove(name)
        if record.size > self.max_bytes:
            self.evicted += 1
            return
        self._items[name] = _Owned(record, now)
        self.num_bytes += record.size
        if len(self._items) > self.max_records or self.num_bytes > self.max_bytes:
            self.prune(now)
        while len(self._items) > self.max_records or self.num_bytes > self.max_bytes:
            self._remove(next(iter(self._items)))
            self.evicted += 1

    def discard(self, key_id: int, record: DHTRecord) -> bool:
        """Forget ``record`` if it is still the one remembered under its name (withdrawn or
        superseded); returns whether it was."""
        name = (key_id, record.subkey)
        item = self._items.get(name)
        if item is None or item.record != record:
            return False
        self._remove(name)
        return True

    def _remove(self, name: tuple[int, bytes | None]) -> None:
        item = self._items.pop(name)
        self.num_bytes -= item.record.size

    def prune(self, now: float) -> int:
        expired = [n for n, item in self._items.items() if item.record.expiration_time <= now]
        for name in expired:
            self._remove(name)
        return len(expired)

    def due(self, now: float, min_age: float, min_ttl: float) -> list[tuple[int, DHTRecord]]:
        """Records last published ``min_age`` or more ago that live at least ``min_ttl`` longer;
        expired ones are dropped. Marks the returned ones as published at ``now``."""
        self.prune(now)
        due = []
        for (key_id, _), item in self._items.items():
            if now - item.last_published >= min_age and item.record.expiration_time > now + min_ttl:
                item.last_published = now
                due.append((key_id, item.record))
        return due
