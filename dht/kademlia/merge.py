"""Combining what several replicas returned for one key into the value a reader sees.

Same rules as storage: per subkey the newest record wins; a plain value wins over a dictionary
only if it expires after every subkey (subkeys older than the best plain value are dropped).
Records here are already validated; undecodable ones from the network are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dht.kademlia.ids import deserialize
from dht.kademlia.records import DHTRecord, ValueWithExpiration

Entry = tuple[bytes | None, bytes, float, bytes | None]  # (subkey, value, expiration, signature)


def unique_live_records(
    key: bytes, entry_lists: Iterable[Iterable[Entry]], now: float, max_record_bytes: int
) -> list[DHTRecord]:
    """Records from all replicas, without duplicates, expired or oversized ones."""
    unique: dict[Entry, DHTRecord] = {}
    for entries in entry_lists:
        for entry in entries:
            subkey, value, expiration, signature = entry
            if expiration > now and entry not in unique:
                record = DHTRecord(key, subkey, value, expiration, signature)
                if record.size <= max_record_bytes:
                    unique[entry] = record
    return list(unique.values())


def _decoded(record: DHTRecord) -> tuple[Any, Any] | None:
    """(subkey, value) decoded from msgpack, or None if undecodable or the subkey is unhashable."""
    try:
        name = None if record.subkey is None else deserialize(record.subkey)
        hash(name)
        return name, deserialize(record.value)
    except Exception:  # noqa: BLE001 - undecodable bytes from the network
        return None


def merge_records(records: Iterable[DHTRecord]) -> tuple[ValueWithExpiration[Any] | None, Any]:
    """The reader's view of validated records: (value, newest plain record or subkey dict)."""
    best_plain: tuple[DHTRecord, Any] | None = None
    subkeys: dict[Any, tuple[DHTRecord, Any]] = {}
    for record in records:
        decoded = _decoded(record)
        if decoded is None:
            continue
        name, value = decoded
        if record.subkey is None:
            if best_plain is None or record.expiration_time > best_plain[0].expiration_time:
                best_plain = (record, value)
        else:
            known = subkeys.get(name)
            if known is None or record.expiration_time > known[0].expiration_time:
                subkeys[name] = (record, value)
    if best_plain is not None:
        plain_expiration = best_plain[0].expiration_time
        subkeys = {n: rv for n, rv in subkeys.items() if rv[0].expiration_time > plain_expiration}
        if not subkeys:
            return ValueWithExpiration(best_plain[1], plain_expiration), best_plain[0]
    if not subkeys:
        return None, None
    merged = {n: ValueWithExpiration(v, r.expiration_time) for n, (r, v) in subkeys.items()}
    return ValueWithExpiration(merged, max(v.expiration_time for v in merged.values())), merged
