"""Serving other peers: the node's answers to incoming ``ping``, ``store`` and ``find`` RPCs.

Everything here reads untrusted input: requests are parsed by ``protocol.parse_request``
(malformed ones raise :class:`DHTProtocolError`, which becomes an error reply), stored records
are checked against the storage limits and validated (signatures in a worker thread when
there are many) before they are kept. Apart from the node's own outgoing calls so that what a
remote peer can make this node do is in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dht.kademlia.clock import get_dht_time
from dht.kademlia.errors import DHTProtocolError
from dht.kademlia.ids import id_from_bytes, node_id_of
from dht.kademlia.protocol import (
    MAX_VALUE_RESPONSE_BYTES,
    FindRequest,
    PingRequest,
    StoreRequest,
    encode_entries,
    parse_request,
    sender_info,
)
from dht.kademlia.records import DHTRecord
from dht.kademlia.routing import Contact

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode


async def handle_rpc(node: DHTNode, peer_id: Any, raw_request: Any) -> dict[str, Any]:
    """Serve one DHT RPC. Malformed requests raise DHTProtocolError (an error reply)."""
    request = parse_request(raw_request)
    if peer_id != node.peer_id:
        node.reachable()  # a peer reached us: our links work
    sender_addrs = request.sender.addrs
    if not request.sender.client and sender_addrs and peer_id != node.peer_id:
        sender_addrs = node.network.usable_addrs(sender_addrs, peer_id)
    if not request.sender.client and sender_addrs and peer_id != node.peer_id:
        if node.network.remember_addrs(peer_id, sender_addrs):
            node.blacklist.register_success(peer_id)  # alive, and reachable anew
        node._seen_alive(Contact(peer_id, node_id_of(peer_id), sender_addrs))
    if isinstance(request, PingRequest):
        node.requests_served["ping"] += 1
        return {"from": sender_info(node._own_addrs(), node.client_mode)}
    if isinstance(request, StoreRequest):
        node.requests_served["store"] += 1
        results = await store_incoming(node, request.records, peer_id)
        return {"results": [list(result) for result in results]}
    if isinstance(request, FindRequest):
        node.requests_served["find"] += 1
        return {"results": find_results(node, request, peer_id)}
    raise DHTProtocolError(f"unsupported request {type(request).__name__}")


def find_results(node: DHTNode, request: FindRequest, peer_id: Any) -> list[list[Any]]:
    """Per key: the value entries stored here (if any, and if asked for) and the nearest
    contacts we know."""
    now = get_dht_time()
    results: list[list[Any]] = []
    for key_id in request.key_ids:
        wanted = request.values and not node.client_mode
        stored = node.storage.get(key_id, now) if wanted else None
        nearest = node.routing_table.nearest(key_id, request.count, exclude=peer_id)
        peers = [[c.peer_id.to_bytes(), list(c.addrs)] for c in nearest]
        budget = MAX_VALUE_RESPONSE_BYTES // len(request.key_ids)
        results.append([encode_entries(stored, budget), peers])
    return results


async def store_incoming(
    node: DHTNode, records: list[DHTRecord], sender: Any
) -> list[tuple[bool, str | None]]:
    """Check, validate and keep records another peer asks this node to store."""
    if node.client_mode:
        return [(False, "client-mode peers do not store records for others")] * len(records)
    now = get_dht_time()
    results: list[tuple[bool, str | None]] = [(False, None)] * len(records)
    pending = []
    for i, record in enumerate(records):
        reason = node.storage.check_limits(record, now)
        if reason is not None:
            results[i] = (False, reason)
        elif node.storage.holds(id_from_bytes(record.key), record):
            results[i] = (True, None)  # republished/handed-over copy: verified when stored
        else:
            pending.append(i)
    reasons = await node._validate_many([records[i] for i in pending])
    now = get_dht_time()
    for i, reason in zip(pending, reasons, strict=True):
        if reason is not None:
            results[i] = (False, reason)
        else:
            key_id = id_from_bytes(records[i].key)
            results[i] = node.storage.store(key_id, records[i], now, origin=sender)
    return results
