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

    def store(self, key_id: int, record: DHTRecord, now: float) -> tuple[bool, str | None]:
        """Store a validated record. Returns (accepted, reason-if-refused).

        A record that loses to a newer one is not an error: (False, "outdated").
        """
        reason = self.check_limits(record, now)
        if reason is not None:
            return False, reason
        entry = self._entries.get(key_id)
        if entry is not None and entry.key != record.key:
            return False, "key ID collision"  # practically impossible with SHA-256
        freed_records, freed_bytes = 0, 0
        if entry is not None:
            if record.subkey is None:
                if record.expiration_time <= entry.latest_expiration():
                    return False, "outdated: a record with a later expiration is stored"
                freed_records = 1 if entry.plain is not None else len(entry.subkeys)
                freed_bytes = (
                    entry.plain.size
                    if entry.plain is not None
                    else sum(r.size for r in entry.subkeys.values())
                )
            elif entry.plain is not None:
                if record.expiration_time <= entry.plain.expiration_time:
                    return False, "outdated: a plain value with a later expiration is stored"
                freed_records, freed_bytes = 1, entry.plain.size
            else:
                old = entry.subkeys.get(record.subkey)
                if old is not None:
                    if record.expiration_time <= old.expiration_time:
                        return False, "outdated: this subkey has a later expiration"
                    freed_records, freed_bytes = 1, old.size
                elif len(entry.subkeys) >= self.limits.max_subkeys_per_key:
                    self.prune(now)
                    if len(entry.subkeys) >= self.limits.max_subkeys_per_key:
                        return (
                            False,
                            f"too many subkeys for one key (max {self.limits.max_subkeys_per_key})",
                        )
        reason = self._check_capacity(1 - freed_records, record.size - freed_bytes, now)
        if reason is not None:
            return False, reason
        self._put(key_id, record)
        return True, None

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

    def _put(self, key_id: int, record: DHTRecord) -> None:
        entry = self._entries.get(key_id)
        if entry is None:
            entry = self._entries[key_id] = _Entry(record.key)
        if record.subkey is None:
            self._drop_all(entry)
            entry.plain = record
        else:
            if entry.plain is not None:
                self._account(-1, -entry.plain.size)
                entry.plain = None
            old = entry.subkeys.get(record.subkey)
            if old is not None:
                self._account(-1, -old.size)
            entry.subkeys[record.subkey] = record
        self._account(1, record.size)
        heapq.heappush(self._heap, (record.expiration_time, key_id, record.subkey))
        if len(self._heap) > 4 * max(self.num_records, 1024):
            self._rebuild_heap()

    def _drop_all(self, entry: _Entry) -> None:
        if entry.plain is not None:
            self._account(-1, -entry.plain.size)
            entry.plain = None
        for old in entry.subkeys.values():
            self._account(-1, -old.size)
        entry.subkeys.clear()

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
                    self._account(-1, -current.size)
                    dropped += 1
            else:
                current = entry.subkeys.get(subkey)
                if current is not None and current.expiration_time == expiration:
                    del entry.subkeys[subkey]
                    self._account(-1, -current.size)
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
