"""Messages of the state-sharing protocol, and strict validation of everything received.

Donors announce a state in the DHT under ``{prefix}.state``, subkey ``[owner:<PeerID>]`` (the
DHT only accepts it with that peer's signature), as the record
``{"root", "epoch", "bytes", "complete", "addrs", "s"}``: ``root`` is the SHA-256 of the
state's manifest, ``complete`` is False for a joiner announcing the part it already holds,
``s`` is :func:`state_schema_digest` of the state's tensors.

Wire: :data:`STATE_PROTOCOL`, framed msgpack requests and answers, one after the other on a
stream (a requester may keep its stream to a peer for many requests)::

    {"prefix", "op": "manifest", "root"}    -> {"manifest": bytes | None}
    {"prefix", "op": "have", "root"}        -> {"have": bitmap | None[, "pending": bitmap]}
    {"prefix", "op": "chunks", "digests"}   -> {"chunks": [bytes | None, ...]} | {"busy": True}
    a request refused                       -> {"error": reason}

Bit ``i`` of a bitmap is the ``i``-th distinct chunk of the manifest, in manifest order;
``pending`` marks the chunks a joiner is fetching right now. A ``chunks`` answer is a prefix
of the request (at least one chunk; None = not held); ``busy`` means every upload slot of the
donor is taken.

Records, requests and answers all come from peers and are untrusted: the parsers here raise
:class:`BadRequest` (a request we refuse with an error reply) or :class:`BadReply` (an answer
that gets its sender banned), each with a reason naming what was wrong. This module does no
I/O; ``sharing.py`` moves these messages over streams.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moshpit.training.errors import ManifestError
from moshpit.training.manifest import DIGEST_BYTES, Manifest

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

__all__ = [
    "KEEP_STREAM_SECONDS",
    "MAX_ADDRS",
    "MAX_ADDR_CHARS",
    "MAX_DIGESTS_PER_REQUEST",
    "MAX_ERROR_CHARS",
    "MAX_PREFIX_CHARS",
    "MAX_RECORDS",
    "MAX_RECORD_NUMBER",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "REQUEST_BYTES",
    "REUSE_STREAM_SECONDS",
    "STATE_PROTOCOL",
    "BadReply",
    "BadRequest",
    "ChunksAnswer",
    "ChunksRequest",
    "HaveRequest",
    "ManifestRequest",
    "Record",
    "Request",
    "ServedState",
    "announcement",
    "answer_length",
    "bitmap",
    "busy_reply",
    "check_digest",
    "chunks_reply",
    "chunks_request",
    "error_reply",
    "from_bitmap",
    "have_reply",
    "have_request",
    "manifest_reply",
    "manifest_request",
    "parse_record",
    "parse_request",
    "read_chunks_reply",
    "read_have_reply",
    "read_manifest_reply",
    "refusal",
    "request_prefix",
    "state_schema_digest",
]

STATE_PROTOCOL = "/moshpit/state/1.0.0"
MAX_RECORDS = 1024  # state records read per lookup
MAX_ADDRS = 8
MAX_ADDR_CHARS = 256
MAX_DIGESTS_PER_REQUEST = 1024
MAX_PREFIX_CHARS = 256
MAX_REQUEST_BYTES = 64 * 1024
MAX_ERROR_CHARS = 512
MAX_RESPONSE_BYTES = 16 << 20  # a batch of chunks (batch_bytes, at least one chunk <= 8 MiB)
MAX_RECORD_NUMBER = 1 << 53  # epochs and byte counts above this are not plausible
REQUEST_BYTES = DIGEST_BYTES + 2  # one digest in a chunk request (msgpack bin header)
KEEP_STREAM_SECONDS = 30.0  # a server keeps an idle request stream open this long
REUSE_STREAM_SECONDS = 10.0  # a requester reuses a stream idle at most this long (< the above)
# \Z, not $: "$" also matches before a final newline, a second spelling of the subkey
_OWNER_SUBKEY = re.compile(r"^\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]\Z")


class BadRequest(ValueError):
    """A request we refuse with an error reply (the stream and the peer stay fine)."""


class BadReply(ValueError):
    """An answer no honest donor sends; ``str(e)`` says what its sender did."""


# ---------------------------------------------------------------------------------------------
# announcement records


@dataclass
class Record:
    """One peer's announcement, as parsed from the DHT."""

    peer: PeerID  # the record's owner, from its subkey
    root: bytes
    epoch: int
    nbytes: int
    complete: bool
    addrs: tuple[str, ...]
    schema: bytes | None = None


def state_schema_digest(
    schema: Sequence[tuple[str, str, Sequence[int]]], with_dtypes: bool = True
) -> bytes:
    """A hash of a state's ``(name, dtype, shape)`` list (what ``Manifest.check_fits``
    compares): equal digests, the state fits. ``with_dtypes=False`` hashes names and shapes
    only: the model's identity, which peers of different dtypes share (they average in
    float32) and which progress records carry."""
    import msgpack

    tag = b"moshpit.state-schema.v1" if with_dtypes else b"moshpit.model-schema.v1"
    entries = [
        [str(name), *([str(dtype)] if with_dtypes else []), [int(x) for x in shape]]
        for name, dtype, shape in schema
    ]
    return hashlib.sha256(tag + msgpack.packb(entries)).digest()[:DIGEST_BYTES]


def announcement(manifest: Manifest, complete: bool, addrs: Sequence[object]) -> dict[str, Any]:
    """The record announcing ``manifest``; addresses too long for a record are left out."""
    fitting = [str(a) for a in addrs if len(str(a)) <= MAX_ADDR_CHARS]
    return {
        "root": manifest.root,
        "epoch": manifest.epoch,
        "bytes": manifest.total_bytes,
        "complete": complete,
        "addrs": fitting[:MAX_ADDRS],
        "s": state_schema_digest(manifest.schema()),
    }


def check_digest(value: Any, what: str) -> bytes:
    """``value`` if it is a digest (BadRequest naming ``what`` otherwise)."""
    if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
        raise BadRequest(f"{what} must be {DIGEST_BYTES} bytes")
    return value


def _record_number(value: dict[Any, Any], name: str) -> int:
    number = value.get(name)
    if isinstance(number, bool) or not isinstance(number, int):
        raise ValueError(f"{name} must be an integer")
    if not 0 <= number < MAX_RECORD_NUMBER:
        raise ValueError(f"{name} out of range")
    return number


def parse_record(subkey: Any, value: Any, peer_from_base58: Callable[[str], PeerID]) -> Record:
    """One DHT entry under ``{prefix}.state`` as a :class:`Record` (ValueError if invalid;
    ``peer_from_base58`` may raise its own error for a subkey that names no valid peer)."""
    match = _OWNER_SUBKEY.match(subkey) if isinstance(subkey, str) else None
    if match is None:
        raise ValueError("subkey is not [owner:<PeerID>]")
    peer = peer_from_base58(match.group(1))
    if not isinstance(value, dict):
        raise ValueError("record must be a map")
    root = check_digest(value.get("root"), "root")
    epoch, nbytes = _record_number(value, "epoch"), _record_number(value, "bytes")
    complete = value.get("complete")
    if not isinstance(complete, bool):
        raise ValueError("complete must be a bool")
    raw_addrs = value.get("addrs", [])
    if not isinstance(raw_addrs, list):
        raise ValueError("addrs must be a list")
    addrs = tuple(
        a for a in raw_addrs[:MAX_ADDRS] if isinstance(a, str) and len(a) <= MAX_ADDR_CHARS
    )
    schema = value.get("s")
    if schema is not None:
        schema = check_digest(schema, "schema")
    return Record(peer, root, epoch, nbytes, complete, addrs, schema)


# ---------------------------------------------------------------------------------------------
# bitmaps


def bitmap(flags: Sequence[bool]) -> bytes:
    """Bit ``i`` set where ``flags[i]`` is true, least significant bit first."""
    out = bytearray((len(flags) + 7) // 8)
    for i, held in enumerate(flags):
        if held:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def from_bitmap(data: bytes, n: int) -> set[int]:
    """The indices below ``n`` whose bit is set (``data`` holds at least ``n`` bits)."""
    return {i for i in range(n) if data[i >> 3] >> (i & 7) & 1}


# ---------------------------------------------------------------------------------------------
# requests: what a requester sends, and the server's strict reading of them


@dataclass(frozen=True)
class ManifestRequest:
    root: bytes


@dataclass(frozen=True)
class HaveRequest:
    root: bytes


@dataclass(frozen=True)
class ChunksRequest:
    digests: list[bytes]


Request = ManifestRequest | HaveRequest | ChunksRequest


def manifest_request(prefix: str, root: bytes) -> dict[str, Any]:
    return {"prefix": prefix, "op": "manifest", "root": root}


def have_request(prefix: str, root: bytes) -> dict[str, Any]:
    return {"prefix": prefix, "op": "have", "root": root}


def chunks_request(prefix: str, digests: list[bytes]) -> dict[str, Any]:
    return {"prefix": prefix, "op": "chunks", "digests": digests}


def request_prefix(request: Any) -> str:
    """The prefix a request is for: read first, since it picks who answers the rest."""
    if not isinstance(request, dict):
        raise BadRequest("state request must be a map")
    prefix = request.get("prefix")
    if not isinstance(prefix, str):
        raise BadRequest("state request needs a string 'prefix'")
    return prefix


def parse_request(request: dict[str, Any]) -> Request:
    """The operation of a request whose prefix :func:`request_prefix` accepted."""
    op = request.get("op")
    if op == "manifest":
        return ManifestRequest(check_digest(request.get("root"), "root"))
    if op == "have":
        return HaveRequest(check_digest(request.get("root"), "root"))
    if op == "chunks":
        digests = request.get("digests")
        if not isinstance(digests, list) or not 0 < len(digests) <= MAX_DIGESTS_PER_REQUEST:
            raise BadRequest(f"'digests' must be a list of 1..{MAX_DIGESTS_PER_REQUEST}")
        return ChunksRequest([check_digest(d, "each digest") for d in digests])
    raise BadRequest(f"unknown state op {str(op)[:64]!r}")


# ---------------------------------------------------------------------------------------------
# answers: what a server sends, and the requester's strict reading of them


@dataclass
class ServedState:
    """A state as a server answers requests for it: the manifest, its bytes, and each
    distinct chunk's digest -> its index (bit in a bitmap) and size."""

    manifest: Manifest
    packed: bytes
    index: dict[bytes, int]
    sizes: dict[bytes, int]

    @classmethod
    def of(cls, manifest: Manifest) -> ServedState:
        sizes = manifest.chunk_refs()
        index = {d: i for i, d in enumerate(sizes)}
        return cls(manifest, manifest.to_bytes(), index, sizes)


def manifest_reply(packed: bytes | None) -> dict[str, Any]:
    return {"manifest": packed}


def have_reply(have: bytes | None, pending: bytes | None = None) -> dict[str, Any]:
    return {"have": have} if pending is None else {"have": have, "pending": pending}


def chunks_reply(chunks: list[bytes | None]) -> dict[str, Any]:
    return {"chunks": chunks}


def busy_reply() -> dict[str, Any]:
    return {"busy": True}


def error_reply(reason: str) -> dict[str, Any]:
    return {"error": reason[:MAX_ERROR_CHARS]}


def answer_length(chunks: Sequence[bytes | None], batch_bytes: int) -> int:
    """How many of ``chunks`` (in request order) one answer carries: as many as fit in
    ``batch_bytes``, and at least one, so that a chunk bigger than that still moves."""
    total = 0
    for count, data in enumerate(chunks):
        size = len(data) if data is not None else 0
        if count and total + size > batch_bytes:
            return count
        total += size
    return len(chunks)


def refusal(reply: Any) -> str | None:
    """The reason of an error reply (shortened), or None for any other answer."""
    error = reply.get("error") if isinstance(reply, dict) else None
    return error[:MAX_ERROR_CHARS] if isinstance(error, str) else None


def read_manifest_reply(reply: Any, root: bytes) -> Manifest | None:
    """The manifest a donor sent for ``root``; None when it says it no longer serves it.

    BadReply for anything else: the root is signed by the donor, so bytes that do not hash to
    it, or a signed root over bytes that are no manifest, are the donor's fault."""
    packed = reply.get("manifest") if isinstance(reply, dict) else None
    if packed is None and isinstance(reply, dict) and "manifest" in reply:
        return None
    if not isinstance(packed, bytes) or hashlib.sha256(packed).digest() != root:
        raise BadReply("sent a manifest that does not hash to its signed root")
    try:
        return Manifest.from_bytes(packed)
    except ManifestError as e:
        raise BadReply(f"announced an invalid manifest: {e}") from None


@dataclass(frozen=True)
class ChunksAnswer:
    """A valid answer to a chunk request: busy, or one entry per chunk answered (None: the
    peer does not hold it), a prefix of what was asked."""

    busy: bool
    chunks: list[bytes | None]


def read_chunks_reply(reply: Any, wanted: Sequence[tuple[bytes, int]]) -> ChunksAnswer:
    """Check an answer to a request for ``wanted`` ((digest, size) per chunk, in order): each
    chunk must have the size its digest was announced with (its hash is checked later,
    off the event loop). BadReply names what was wrong."""
    if not isinstance(reply, dict):
        raise BadReply("sent a malformed chunk response")
    if reply.get("busy") is True:
        return ChunksAnswer(True, [])
    chunks = reply.get("chunks")
    if not isinstance(chunks, list) or not 0 < len(chunks) <= len(wanted):
        raise BadReply("sent a malformed chunk response")
    for (digest, size), data in zip(wanted, chunks, strict=False):
        if data is not None and (not isinstance(data, bytes) or len(data) != size):
            raise BadReply(f"sent chunk {digest.hex()[:16]} with the wrong size")
    return ChunksAnswer(False, chunks)


def read_have_reply(reply: Any, n: int) -> tuple[set[int], set[int] | None] | None:
    """A partial holder's ``have`` bitmap for a state of ``n`` chunks and its ``pending`` one
    (None if absent or malformed); None if the ``have`` bitmap is absent or malformed."""
    have = reply.get("have") if isinstance(reply, dict) else None
    if not isinstance(have, bytes) or len(have) != (n + 7) // 8:
        return None
    pending = reply.get("pending")
    valid_pending = isinstance(pending, bytes) and len(pending) == len(have)
    return from_bitmap(have, n), from_bitmap(pending, n) if valid_pending else None
