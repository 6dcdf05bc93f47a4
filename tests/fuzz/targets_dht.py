"""Fuzz targets of the Kademlia DHT's messages (``/moshpit/dht/1.0.0``, msgpack).

Requests and responses are parsed with ``dht.kademlia.protocol`` (``DHTProtocolError`` for
anything malformed); records are checked by the owner-signature validator and merged the way
a reader merges replicas (neither may raise); values are decoded with ``ids.deserialize``.
``dht_rpc`` goes further: a real ``DHTNode`` serves the fuzzed requests, and its answers must
parse with the same parsers its peers use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
from hypothesis import strategies as st

from dht.kademlia.clock import dht_clock
from dht.kademlia.errors import DHTProtocolError
from dht.kademlia.ids import (
    MAX_ID,
    deserialize,
    id_from_bytes,
    id_to_bytes,
    key_id_of,
    serialize,
)
from dht.kademlia.loopback import LoopbackFabric
from dht.kademlia.merge import merge_records, unique_live_records
from dht.kademlia.node import DHTNode
from dht.kademlia.protocol import (
    MAX_PEERS_PER_RESULT,
    FindRequest,
    PingRequest,
    StoreRequest,
    encode_entries,
    parse_find_response,
    parse_ping_response,
    parse_record,
    parse_request,
    parse_store_response,
    sender_info,
)
from dht.kademlia.records import DHTRecord, ValueWithExpiration
from dht.kademlia.storage import LocalStorage
from dht.kademlia.validation import OwnerSignatureValidator, default_validators
from dht.p2p.errors import ProtocolViolationError
from dht.p2p.identity import PeerID
from dht.p2p.messages import unpack_body

from ._harness import MSGPACK_VALUES, Target, body, register, run_trio, same, tweaked
from .targets_p2p import ALICE, BOB, PEERS, SEED_ADDRS

NOW = 1_700_000_000.0  # DHT time of every check (records in the corpus never expire)
ADDRS = [a.to_bytes() for a in SEED_ADDRS[:2]]


def _record(key: Any, value: Any, subkey: Any = None, owner: Any = None) -> DHTRecord:
    record = DHTRecord(
        serialize(key), None if subkey is None else serialize(subkey), serialize(value), NOW + 600
    )
    return OwnerSignatureValidator(owner).sign(record) if owner is not None else record


def _records() -> list[DHTRecord]:
    owned = f"[owner:{ALICE.peer_id}]"
    return [
        _record("plain", {"x": 1.5}),
        _record("dict", [1, 2], subkey="a"),
        _record(f"state{owned}", b"v", owner=ALICE),
        _record("progress", {"epoch": 2}, subkey=owned, owner=ALICE),
        _record("forged", "v", subkey=f"[owner:{BOB.peer_id}]"),  # unsigned: rejected
    ]


def _request(op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, "from": sender_info(ADDRS, False), **fields}


def _requests() -> dict[str, dict[str, Any]]:
    return {
        "ping": _request("ping"),
        "ping-client": {"op": "ping", "from": sender_info([], True)},
        "store": _request("store", records=[r.to_wire() for r in _records()]),
        "find": _request(
            "find", keys=[id_to_bytes(key_id_of(k)) for k in ("plain", "dict")], count=5
        ),
    }


REQUESTS = st.sampled_from(list(_requests().values()))

# ---------------------------------------------------------------------------------------------
# requests


def check_dht_request(data: bytes) -> None:
    try:
        request = parse_request(unpack_body(data))
    except (ProtocolViolationError, DHTProtocolError):
        return
    assert all(isinstance(a, bytes) for a in request.sender.addrs)
    if isinstance(request, StoreRequest):
        for record in request.records:
            assert parse_record(record.to_wire()) == record
    elif isinstance(request, FindRequest):
        assert 0 <= request.count <= MAX_PEERS_PER_RESULT
        assert all(0 <= k < MAX_ID for k in request.key_ids)
    else:
        assert isinstance(request, PingRequest)


register(
    Target(
        "dht_request",
        "dht",
        check_dht_request,
        seeds=lambda: {name: body(msg) for name, msg in _requests().items()},
        valid=lambda: tweaked(REQUESTS),
    )
)


async def _serve(requests: list[Any]) -> None:
    with dht_clock(lambda: NOW):
        fabric = LoopbackFabric(PeerID.from_bytes)
        node = DHTNode(fabric.network(ALICE.peer_id), identity=ALICE)
        for raw in requests:
            try:
                response = await node._handle_rpc(BOB.peer_id, raw)
            except DHTProtocolError:
                continue
            # what a peer receives: the answer parses with the parser its node uses
            answer = unpack_body(body(response))
            op = raw.get("op")
            if op == "ping":
                parse_ping_response(answer)
            elif op == "store":
                results = parse_store_response(answer, len(raw["records"]))
                assert all(isinstance(ok, bool) for ok, _ in results)
            else:
                for result in parse_find_response(answer, len(raw["keys"]), PeerID.from_bytes):
                    _merge_entries(b"key", result.entries or [])


def check_dht_rpc(data: bytes) -> None:
    """A list of requests (or one) served in turn by one node: a store, then finds of it."""
    try:
        obj = unpack_body(data)
    except ProtocolViolationError:
        return
    requests = obj[:8] if isinstance(obj, list) else [obj]
    run_trio(_serve, requests)


register(
    Target(
        "dht_rpc",
        "dht",
        check_dht_rpc,
        seeds=lambda: {
            **{name: body(msg) for name, msg in _requests().items()},
            "store-then-find": body([_requests()["store"], _requests()["find"]]),
        },
        valid=lambda: tweaked(st.lists(REQUESTS, min_size=1, max_size=3)),
    )
)

# ---------------------------------------------------------------------------------------------
# responses


def _expected(obj: Any) -> int:
    """How many results the asker expects: as many as sent here (else the count check is all
    a fuzzed response would ever meet)."""
    results = obj.get("results") if isinstance(obj, Mapping) else None
    return len(results) if isinstance(results, list) else 1


def check_dht_ping_response(data: bytes) -> None:
    try:
        info = parse_ping_response(unpack_body(data))
    except (ProtocolViolationError, DHTProtocolError):
        return
    assert isinstance(info.client, bool) and all(isinstance(a, bytes) for a in info.addrs)


register(
    Target(
        "dht_ping_response",
        "dht",
        check_dht_ping_response,
        seeds=lambda: {"ping": body({"from": sender_info(ADDRS, False)})},
        valid=lambda: tweaked(st.just({"from": sender_info(ADDRS, False)})),
    )
)

STORE_RESPONSE = {"results": [[True, None], [False, "record already expired"]]}


def check_dht_store_response(data: bytes) -> None:
    try:
        obj = unpack_body(data)
        results = parse_store_response(obj, _expected(obj))
    except (ProtocolViolationError, DHTProtocolError):
        return
    for ok, reason in results:
        assert isinstance(ok, bool) and (reason is None or isinstance(reason, str))


register(
    Target(
        "dht_store_response",
        "dht",
        check_dht_store_response,
        seeds=lambda: {"two": body(STORE_RESPONSE)},
        valid=lambda: tweaked(st.just(STORE_RESPONSE)),
    )
)


def _merge_entries(key: bytes, entries: list[Any]) -> None:
    """What a reader does with the entries of several replicas: must never raise."""
    records = unique_live_records(key, [entries], NOW, 64 * 1024)
    chain = default_validators()
    value, latest = merge_records(r for r in records if chain.validate(r) is None)
    assert value is None or isinstance(value, ValueWithExpiration)


def _find_response() -> dict[str, Any]:
    entries = encode_entries({r.subkey: r for r in _records()[1:4]})
    peers = [[p.to_bytes(), ADDRS] for p in PEERS]
    return {"results": [[entries, peers], [None, []]]}


def check_dht_find_response(data: bytes) -> None:
    try:
        obj = unpack_body(data)
        results = parse_find_response(obj, _expected(obj), PeerID.from_bytes)
    except (ProtocolViolationError, DHTProtocolError):
        return
    for result in results:
        assert all(isinstance(p, PeerID) for p, _ in result.peers)
        _merge_entries(serialize("key"), result.entries or [])


register(
    Target(
        "dht_find_response",
        "dht",
        check_dht_find_response,
        seeds=lambda: {"values-and-peers": body(_find_response())},
        valid=lambda: tweaked(st.just(_find_response())),
    )
)

# ---------------------------------------------------------------------------------------------
# records and values


def check_dht_record(data: bytes) -> None:
    try:
        record = parse_record(unpack_body(data))
    except (ProtocolViolationError, DHTProtocolError):
        return
    reason = OwnerSignatureValidator().validate(record)
    assert reason is None or isinstance(reason, str)
    assert reason == default_validators().validate(record)
    storage = LocalStorage()
    limits = storage.check_limits(record, NOW)
    if limits is None and reason is None:
        accepted, why = storage.store(id_from_bytes(record.key), record, NOW, origin=BOB.peer_id)
        assert isinstance(accepted, bool) and (why is None or isinstance(why, str))
    merge_records([record])


register(
    Target(
        "dht_record",
        "dht",
        check_dht_record,
        seeds=lambda: {f"record{i}": body(r.to_wire()) for i, r in enumerate(_records())},
        valid=lambda: tweaked(st.sampled_from([r.to_wire() for r in _records()])),
    )
)


def check_dht_value(data: bytes) -> None:
    """``ids.deserialize``: keys, subkeys and values of records (a reader skips what fails)."""
    try:
        value = deserialize(data)
    except (ValueError, TypeError, msgpack.UnpackException):
        return
    assert same(deserialize(serialize(value)), value)


register(
    Target(
        "dht_value",
        "dht",
        check_dht_value,
        seeds=lambda: {f"value{i}": r.value for i, r in enumerate(_records())},
        valid=lambda: MSGPACK_VALUES.map(serialize),
    )
)
