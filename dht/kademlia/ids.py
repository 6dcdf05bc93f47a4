"""256-bit Kademlia identifiers and the XOR metric.

IDs are plain Python ints in ``[0, 2**256)``: node ID = SHA-256 of the PeerID's multihash bytes,
key ID = SHA-256 of the msgpack encoding of the key. Plain ints keep XOR and sorting fast in
simulations with thousands of nodes.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Protocol

import msgpack

ID_BITS = 256
ID_BYTES = ID_BITS // 8
MAX_ID = 1 << ID_BITS


def serialize(obj: Any) -> bytes:
    """Canonical msgpack encoding used for keys, subkeys and values."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"DHT keys and values must be msgpack-serializable: {e}") from e


def deserialize(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def id_from_bytes(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


class PeerKey(Protocol):
    """What the DHT needs of a peer's ID (``dht.p2p.PeerID`` is one): hashable, with bytes."""

    def __hash__(self) -> int: ...

    def to_bytes(self) -> bytes: ...


def node_id_of(peer_id: PeerKey) -> int:
    """Node ID of a peer: SHA-256 of its PeerID bytes."""
    return id_from_bytes(peer_id.to_bytes())


def key_id_of(key: Any) -> int:
    """Key ID of any msgpack-serializable key."""
    return id_from_bytes(serialize(key))


def id_to_bytes(value: int) -> bytes:
    return value.to_bytes(ID_BYTES, "big")


def random_id(lower: int = 0, upper: int = MAX_ID) -> int:
    """Uniform random ID in ``[lower, upper)`` (used to refresh a bucket's range)."""
    return lower + secrets.randbelow(upper - lower)


def distance(a: int, b: int) -> int:
    return a ^ b
