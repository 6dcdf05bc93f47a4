"""Wire format of ``/moshpit/dht/1.0.0`` and strict parsing of untrusted messages.

Every request is a msgpack map ``{"op": ..., "from": {"addrs": [...], "client": bool}, ...}``:

- ``ping``  -> ``{"from": <responder info>}``
- ``store`` ``{"records": [[key, subkey|None, value, expiration, signature|None], ...]}``
  -> ``{"results": [[accepted: bool, reason: str|None], ...]}`` (one per record, same order)
- ``find``  ``{"keys": [key_id (32 bytes), ...], "count": k}``
  -> ``{"results": [[entries|None, [[peer_id_bytes, [addr_bytes, ...]], ...]], ...]}`` where
  ``entries`` is ``[[subkey|None, value, expiration, signature|None], ...]`` (a plain value is
  one entry with subkey None). Entries carry no key: the asker knows it and validates with it.

Keys, subkeys and values travel as msgpack-encoded ``bin`` so signatures cover exact bytes.
Malformed input raises :class:`DHTProtocolError`, which the host turns into an error reply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dht.kademlia.errors import DHTProtocolError
from dht.kademlia.ids import ID_BYTES
from dht.kademlia.records import DHTRecord

PROTOCOL_ID = "/moshpit/dht/1.0.0"

MAX_RECORDS_PER_STORE = 1024
MAX_KEYS_PER_FIND = 128
MAX_PEERS_PER_RESULT = 64
MAX_ADDRS_PER_PEER = 16
MAX_ADDR_BYTES = 512
MAX_PEER_ID_BYTES = 128
MAX_FIELD_BYTES = 1024 * 1024  # any single bin field; storage limits are stricter
MAX_ENTRIES_PER_VALUE = 4096
MAX_REASON_CHARS = 512


@dataclass(frozen=True)
class SenderInfo:
    addrs: tuple[bytes, ...]
    client: bool


@dataclass(frozen=True)
class PingRequest:
    sender: SenderInfo


@dataclass(frozen=True)
class StoreRequest:
    sender: SenderInfo
    records: list[DHTRecord]


@dataclass(frozen=True)
class FindRequest:
    sender: SenderInfo
    key_ids: list[int]
    count: int
    # False: the asker wants the nearest peers only (a store's lookup), not the stored values
    values: bool = True


Entry = tuple[bytes | None, bytes, float, bytes | None]  # (subkey, value, expiration, signature)
WirePeer = tuple[Any, tuple[bytes, ...]]  # (PeerID, addrs) as a find reply names a peer
PeerT = TypeVar("PeerT")


@dataclass(frozen=True)
class FindResult(Generic[PeerT]):
    """One key's answer to ``find``: the value entries stored there (None: no value) and
    peers nearer to the key: ``WirePeer`` pairs as parsed, ``routing.Contact`` objects once
    the node has vetted their addresses (what lookups see)."""

    entries: list[Entry] | None
    peers: list[PeerT]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise DHTProtocolError(f"malformed DHT message: {what}")


def _bin(obj: Any, what: str, max_len: int = MAX_FIELD_BYTES) -> bytes:
    _expect(isinstance(obj, bytes), f"{what} must be bytes")
    _expect(len(obj) <= max_len, f"{what} longer than {max_len} bytes")
    checked: bytes = obj
    return checked


def _optional_bin(obj: Any, what: str, max_len: int = MAX_FIELD_BYTES) -> bytes | None:
    return None if obj is None else _bin(obj, what, max_len)


def _float(obj: Any, what: str) -> float:
    _expect(isinstance(obj, (int, float)) and not isinstance(obj, bool), f"{what} must be a number")
    value = float(obj)
    _expect(math.isfinite(value), f"{what} must be finite")
    return value


def _list(obj: Any, what: str, max_len: int) -> list[Any]:
    _expect(isinstance(obj, (list, tuple)), f"{what} must be a list")
    _expect(len(obj) <= max_len, f"{what} has more than {max_len} items")
    return list(obj)


def sender_info(addrs: Sequence[bytes], client: bool) -> dict[str, Any]:
    return {"addrs": [] if client else list(addrs), "client": bool(client)}


def parse_sender(obj: Any) -> SenderInfo:
    _expect(isinstance(obj, dict), "'from' must be a map")
    client = obj.get("client", False)
    _expect(isinstance(client, bool), "'from.client' must be a bool")
    addrs = _list(obj.get("addrs", []), "'from.addrs'", MAX_ADDRS_PER_PEER)
    return SenderInfo(tuple(_bin(a, "address", MAX_ADDR_BYTES) for a in addrs), client)


def parse_record(obj: Any) -> DHTRecord:
    fields = _list(obj, "record", 5)
    _expect(len(fields) == 5, "record must have 5 fields")
    key, subkey, value, expiration, signature = fields
    return DHTRecord(
        key=_bin(key, "key"),
        subkey=_optional_bin(subkey, "subkey"),
        value=_bin(value, "value"),
        expiration_time=_float(expiration, "expiration"),
        signature=_optional_bin(signature, "signature", 1024),
    )


def parse_request(obj: Any) -> PingRequest | StoreRequest | FindRequest:
    _expect(isinstance(obj, dict), "request must be a map")
    op = obj.get("op")
    sender = parse_sender(obj.get("from", {}))
    if op == "ping":
        return PingRequest(sender)
    if op == "store":
        records = _list(obj.get("records"), "'records'", MAX_RECORDS_PER_STORE)
        return StoreRequest(sender, [parse_record(r) for r in records])
    if op == "find":
        keys = _list(obj.get("keys"), "'keys'", MAX_KEYS_PER_FIND)
        key_ids = []
        for key in keys:
            _expect(
                isinstance(key, bytes) and len(key) == ID_BYTES, f"key IDs must be {ID_BYTES} bytes"
            )
            key_ids.append(int.from_bytes(key, "big"))
        count = obj.get("count", 20)
        _expect(isinstance(count, int) and not isinstance(count, bool), "'count' must be an int")
        values = obj.get("values", True)
        _expect(isinstance(values, bool), "'values' must be a bool")
        return FindRequest(sender, key_ids, max(0, min(count, MAX_PEERS_PER_RESULT)), values)
    raise DHTProtocolError(f"unknown DHT operation {op!r}")


def parse_store_response(obj: Any, expected: int) -> list[tuple[bool, str | None]]:
    _expect(isinstance(obj, dict), "response must be a map")
    results = _list(obj.get("results"), "'results'", MAX_RECORDS_PER_STORE)
    _expect(len(results) == expected, "store response has the wrong number of results")
    parsed = []
    for item in results:
        fields = _list(item, "store result", 2)
        _expect(
            len(fields) == 2 and isinstance(fields[0], bool), "store result must be [bool, reason]"
        )
        reason = fields[1]
        _expect(reason is None or isinstance(reason, str), "store reason must be a string")
        parsed.append((fields[0], reason[:MAX_REASON_CHARS] if reason else None))
    return parsed


def parse_ping_response(obj: Any) -> SenderInfo:
    _expect(isinstance(obj, dict), "response must be a map")
    return parse_sender(obj.get("from", {}))


def parse_entries(obj: Any) -> list[Entry]:
    entries: list[Entry] = []
    for item in _list(obj, "value entries", MAX_ENTRIES_PER_VALUE):
        fields = _list(item, "value entry", 4)
        _expect(len(fields) == 4, "value entry must have 4 fields")
        entries.append(
            (
                _optional_bin(fields[0], "subkey"),
                _bin(fields[1], "value"),
                _float(fields[2], "expiration"),
                _optional_bin(fields[3], "signature", 1024),
            )
        )
    return entries


def parse_find_response(
    obj: Any, expected: int, peer_from_bytes: Callable[[bytes], Any]
) -> list[FindResult[WirePeer]]:
    _expect(isinstance(obj, dict), "response must be a map")
    results = _list(obj.get("results"), "'results'", MAX_KEYS_PER_FIND)
    _expect(len(results) == expected, "find response has the wrong number of results")
    parsed = []
    for item in results:
        fields = _list(item, "find result", 2)
        _expect(len(fields) == 2, "find result must be [entries, peers]")
        entries = None if fields[0] is None else parse_entries(fields[0])
        peers: list[WirePeer] = []
        for peer_item in _list(fields[1], "peers", MAX_PEERS_PER_RESULT):
            pair = _list(peer_item, "peer", 2)
            _expect(len(pair) == 2, "peer must be [peer_id, addrs]")
            raw_id = _bin(pair[0], "peer ID", MAX_PEER_ID_BYTES)
            try:
                peer_id = peer_from_bytes(raw_id)
            except Exception as e:  # noqa: BLE001 - any decoding failure is a protocol error
                raise DHTProtocolError(f"malformed DHT message: bad peer ID ({e})") from e
            addrs = _list(pair[1], "peer addrs", MAX_ADDRS_PER_PEER)
            peers.append((peer_id, tuple(_bin(a, "address", MAX_ADDR_BYTES) for a in addrs)))
        parsed.append(FindResult(entries, peers))
    return parsed


MAX_VALUE_RESPONSE_BYTES = 8 * 1024 * 1024  # value entries per find reply, shared by its keys


def encode_entries(
    stored: DHTRecord | dict[bytes, DHTRecord] | None, max_bytes: int = MAX_VALUE_RESPONSE_BYTES
) -> list[list[Any]] | None:
    """Entries of a stored value for a find reply, capped in count and bytes (latest first),
    so a huge dictionary value cannot exceed the transport's message size limit."""
    if stored is None:
        return None
    if isinstance(stored, DHTRecord):
        records = [stored]
    else:
        records = sorted(stored.values(), key=lambda r: r.expiration_time, reverse=True)
    entries: list[list[Any]] = []
    total = 0
    for r in records[:MAX_ENTRIES_PER_VALUE]:
        total += r.size
        if total > max_bytes and entries:
            break
        entries.append([r.subkey, r.value, r.expiration_time, r.signature])
    return entries
