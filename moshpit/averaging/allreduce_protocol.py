"""Messages of the all-reduce stream protocol, and strict validation of everything received.

One stream per (sender, reducer) pair, opened by the sender (see docs/allreduce.md)::

    sender -> reducer   {"t": "hello", "v": 3, "gid": bytes, "part": int, "total": int,
                         "chunk": int, "w": float}
    sender -> reducer   {"t": "chunk", "k": int, "ct": CompressedTensor msg, "len": int}
                        + ``len`` raw payload bytes                                k = 0, 1, ...
    reducer -> sender   {"t": "result", "k": int, "ct": CompressedTensor msg | None, "dev": float,
                         "n": int, "len": int} + ``len`` raw payload bytes
    either way          {"t": "error", "reason": str[, "left_out": True]}        then the stream ends

In chunk and result messages the compressed tensor's ``payload`` is empty: the payload follows
the message as ``len`` raw bytes (protocol version 3), so that a receiver reads it straight
into its destination (a chunk buffer, or for uncompressed float32 results the caller's output
tensor) instead of through msgpack and its intermediate copies.

``ct = None`` in a result means "keep your local values for this chunk" (no contributor had
positive weight, or the aggregate was not finite). ``n`` is the number of contributions with
positive weight in the result (so a receiver knows whether anyone else's values were in it).
``left_out`` in an error from a reducer means "your contribution was left out of my part"
(you stalled, or sent something invalid: the reason says which), as opposed to the reducer
failing on its own. Every parser here raises :class:`ProtocolError` with a reason that names
what was wrong; the caller turns it into an exclusion of that peer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compression import (
    CompressedTensor,
    CompressionError,
    NoCompression,
    decompress,
    decompress_into,
)
from dht.p2p.errors import MessageTooLargeError
from moshpit.averaging.errors import AveragingError

if TYPE_CHECKING:
    from dht.p2p import P2PStream

# 2: results carry "n", errors may carry "left_out"; 3: chunk/result payloads follow as raw bytes
PROTOCOL_VERSION = 3
MAX_SENDERS = 1 << 16  # bound on a result's "n" (a group is far smaller)
MAX_WEIGHT = 1e9  # a sender's weight is its own claim; cap it so it cannot dwarf everyone
MAX_REASON_CHARS = 500
HELLO_MAX_BYTES = 512
ERROR_MAX_BYTES = 1024
# Largest encoding of a chunk: a sparse codec sending every element as (value, int64 index).
MAX_BYTES_PER_ELEMENT = 12
MESSAGE_OVERHEAD = 4096
HEADER_MAX_BYTES = MESSAGE_OVERHEAD  # a chunk or result message without its payload
RAW_CODEC_ID = NoCompression.codec_id

# Received payloads are immutable ``bytes``; float32 chunks are read through a view of them
# (never written), so torch's warning about non-writable buffers does not apply. torch
# issues it once per process: trigger it here, silenced (imports run before any worker
# thread of ours, so the non-thread-safe catch_warnings is fine here).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(4), dtype=torch.float32)


class ProtocolError(AveragingError):
    """A peer sent something invalid; ``str(e)`` is the reason recorded in the result."""


class RemoteAbort(AveragingError):
    """The other side ended our exchange with an error message (its reason is the text).

    ``left_out``: the reducer says it left our contribution out of its part (we stalled or
    sent something it refused), rather than failing itself.
    """

    def __init__(self, reason: str, left_out: bool = False) -> None:
        super().__init__(reason)
        self.left_out = left_out


def max_chunk_message(numel: int) -> int:
    """Cap on one framed chunk/result message for a chunk of ``numel`` elements."""
    return numel * MAX_BYTES_PER_ELEMENT + MESSAGE_OVERHEAD


@dataclass(frozen=True)
class Hello:
    group_id: bytes
    part: int
    total: int
    chunk: int
    weight: float


def hello_msg(group_id: bytes, part: int, total: int, chunk: int, weight: float) -> dict[str, Any]:
    return {
        "t": "hello",
        "v": PROTOCOL_VERSION,
        "gid": group_id,
        "part": part,
        "total": total,
        "chunk": chunk,
        "w": weight,
    }


def _field(msg: Any, kind: str, fields: set[str]) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a {kind!r} message (map), got {type(msg).__name__}")
    t = msg.get("t")
    if t == "error" and kind != "error":
        reason = msg.get("reason")
        raise RemoteAbort(
            reason[:MAX_REASON_CHARS] if isinstance(reason, str) else "unspecified error",
            left_out=msg.get("left_out") is True,
        )
    if t != kind:
        raise ProtocolError(f"expected a {kind!r} message, got type {str(t)[:40]!r}")
    if set(msg) != fields:
        raise ProtocolError(
            f"{kind!r} message has fields {sorted(map(str, msg))}, expected {sorted(fields)}"
        )
    return msg


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an int in [{lo}, {hi}], got {str(value)[:40]}")
    return value


def _float(value: Any, what: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise ProtocolError(
            f"{what} must be a finite number in [{lo}, {hi}], got {str(value)[:40]}"
        )
    return float(value)


def hello_group_id(msg: Any) -> bytes | None:
    """The group id of a hello, if it has a plausible one (to route even an invalid hello)."""
    gid = msg.get("gid") if isinstance(msg, dict) else None
    return gid if isinstance(gid, bytes) and 0 < len(gid) <= 64 else None


def parse_hello(msg: Any) -> Hello:
    m = _field(msg, "hello", {"t", "v", "gid", "part", "total", "chunk", "w"})
    if m["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {str(m['v'])[:20]} (we speak {PROTOCOL_VERSION})"
        )
    gid = m["gid"]
    if not isinstance(gid, bytes) or not 0 < len(gid) <= 64:
        raise ProtocolError("group id must be 1..64 bytes")
    return Hello(
        group_id=gid,
        part=_int(m["part"], "part", 0, 1 << 16),
        total=_int(m["total"], "total", 0, 1 << 62),
        chunk=_int(m["chunk"], "chunk", 1, 1 << 24),
        weight=_float(m["w"], "weight", 0.0, MAX_WEIGHT),
    )


def chunk_msg(k: int, ct: CompressedTensor) -> dict[str, Any]:
    return {"t": "chunk", "k": k, "ct": ct.to_msg()}


def result_msg(
    k: int,
    ct: CompressedTensor | None,
    deviation: float,
    contributors: int,
    missing: tuple[int, ...] = (),
) -> dict[str, Any]:
    """``missing``: the senders (member indices) whose contribution this chunk lacks; sent
    only when there are some, so a complete round's messages are unchanged."""
    msg = {
        "t": "result",
        "k": k,
        "ct": None if ct is None else ct.to_msg(),
        "dev": deviation,
        "n": contributors,
    }
    if missing and ct is not None:
        msg["miss"] = list(missing)
    return msg


def split_payload(msg: dict[str, Any]) -> tuple[dict[str, Any], bytes | bytearray | memoryview]:
    """The wire form of a chunk or result message: the message with an empty payload and the
    payload's length in ``"len"``, and the payload to send right after it (``msg`` is not
    modified: one result message goes to several senders)."""
    ct = msg["ct"]
    if ct is None:
        return {**msg, "len": 0}, b""
    payload = ct["payload"]
    return {**msg, "ct": {**ct, "payload": b""}, "len": memoryview(payload).nbytes}, payload


async def send_with_payload(stream: P2PStream, msg: dict[str, Any]) -> None:
    """Send a chunk or result message: the message, then its payload as raw bytes."""
    header, payload = split_payload(msg)
    await stream.send_msg(header)
    if header["len"]:
        await stream.send_all(payload)


# Where a received payload goes: (the message's unvalidated "ct" map, payload length) -> a
# writable flat byte buffer of exactly that length, or None for a new bytearray.
Destination = Callable[[dict[str, Any], int], memoryview | None]


async def receive_with_payload(
    stream: P2PStream, max_payload: int, destination: Destination | None = None
) -> Any:
    """Receive a chunk or result message and its raw payload, and put the payload back into
    ``msg["ct"]["payload"]`` (so the parsers below see one message, as before).

    Anything else (an error message, a malformed message) is returned as it came for the
    parsers to reject. The announced length is checked against ``max_payload`` before a byte
    of the payload is read (MessageTooLargeError); the payload is read into ``destination``'s
    buffer when it offers one (no intermediate copy), else into a new bytearray.
    """
    msg = await stream.receive_msg(max_size=HEADER_MAX_BYTES)
    if not isinstance(msg, dict) or msg.get("t") not in ("chunk", "result"):
        return msg
    n = msg.pop("len", None)
    if type(n) is not int or n < 0:
        raise ProtocolError(f"{msg.get('t')!r} message lacks a valid payload length 'len'")
    if n > max_payload:
        raise MessageTooLargeError(
            f"announced payload of {n} bytes exceeds the cap of {max_payload} for this chunk"
        )
    ct = msg.get("ct")
    if not isinstance(ct, dict) or "payload" not in ct:
        if n:
            raise ProtocolError("a payload length without a compressed tensor")
        return msg
    if ct["payload"] != b"":
        raise ProtocolError("the payload must follow the message, not be inside it")
    view = destination(ct, n) if destination is not None and n else None
    if view is None:
        buf = bytearray(n)
        await stream.receive_exactly_into(memoryview(buf))
        ct["payload"] = buf
    else:
        if view.nbytes != n:  # a bug of the destination, not of the peer
            raise RuntimeError(f"destination of {view.nbytes} bytes for a {n}-byte payload")
        await stream.receive_exactly_into(view)
        ct["payload"] = view
    return msg


def raw_float32_destination(numel: int, target: torch.Tensor | None = None) -> Destination:
    """A :data:`Destination` that reads an uncompressed float32 payload of ``numel`` elements
    into ``target`` (a contiguous float32 CPU tensor of that size; a new one if None) and any
    other payload elsewhere."""

    def choose(ct: dict[str, Any], n: int) -> memoryview | None:
        if ct.get("codec") != RAW_CODEC_ID or ct.get("dtype") != "float32" or n != 4 * numel:
            return None
        into = torch.empty(numel, dtype=torch.float32) if target is None else target
        return memoryview(into.view(torch.uint8).numpy())  # type: ignore[arg-type]

    return choose


def error_msg(reason: str, *, left_out: bool = False) -> dict[str, Any]:
    msg: dict[str, Any] = {"t": "error", "reason": reason[:MAX_REASON_CHARS]}
    if left_out:
        msg["left_out"] = True
    return msg


def _parse_ct(raw: Any, numel: int) -> CompressedTensor:
    try:
        ct = CompressedTensor.from_msg(raw, max_numel=numel)
    except CompressionError as e:
        raise ProtocolError(f"bad compressed tensor: {e}") from e
    if ct.numel != numel:
        raise ProtocolError(f"chunk has {ct.numel} elements, expected {numel}")
    return ct


def parse_chunk(msg: Any, k: int, numel: int) -> CompressedTensor:
    """Validate chunk ``k`` of ``numel`` elements (structure only; decode with :func:`decode_chunk`)."""
    m = _field(msg, "chunk", {"t", "k", "ct"})
    if m["k"] != k or type(m["k"]) is not int:
        raise ProtocolError(f"expected chunk {k}, got chunk {str(m['k'])[:20]}")
    return _parse_ct(m["ct"], numel)


@dataclass(frozen=True)
class Result:
    ct: CompressedTensor | None  # None: keep local values for this chunk
    deviation: float
    contributors: int
    missing: tuple[int, ...] = ()  # senders (member indices) this chunk lacks


RESULT_FIELDS = {"t", "k", "ct", "dev", "n"}


def parse_result(msg: Any, k: int, numel: int, members: int = MAX_SENDERS) -> Result:
    """Validate a result message; ``members``: the group's size (bounds ``miss``)."""
    fields = RESULT_FIELDS | {"miss"} if isinstance(msg, dict) and "miss" in msg else RESULT_FIELDS
    m = _field(msg, "result", fields)
    if m["k"] != k or type(m["k"]) is not int:
        raise ProtocolError(f"expected result {k}, got result {str(m['k'])[:20]}")
    dev = _float(m["dev"], "deviation", 0.0, math.inf)
    n = _int(m["n"], "contributors", 0, MAX_SENDERS)
    ct = None if m["ct"] is None else _parse_ct(m["ct"], numel)
    if (ct is None) != (n == 0):
        raise ProtocolError(f"result with {n} contributors must {'not ' if n else ''}be empty")
    missing: tuple[int, ...] = ()
    if "miss" in m:
        raw = m["miss"]
        if ct is None or not isinstance(raw, list) or not 0 < len(raw) <= members:
            raise ProtocolError("result 'miss' must be a non-empty list of member indices")
        missing = tuple(_int(i, "missing sender", 0, members - 1) for i in raw)
        if len(set(missing)) != len(missing):
            raise ProtocolError("result 'miss' lists a member twice")
    return Result(ct, dev, n, missing)


def decode_chunk(ct: CompressedTensor, numel: int, *, check_finite: bool = True) -> torch.Tensor:
    """Decompress a validated chunk into a flat float32 tensor; reject NaN/Inf.

    ``check_finite=False`` leaves the NaN/Inf check to the caller (a reducer's aggregation
    gets it from a pass it makes anyway). Uncompressed float32 is a read-only view of the
    payload (cheap: one read pass for the NaN/Inf check); other codecs decode into a new tensor (CPU-heavy for big chunks: call it
    in a worker thread, see :func:`decode_cost`).
    """
    if is_raw_float32(ct):
        if len(ct.payload) != 4 * numel:
            raise ProtocolError(f"float32 payload of {len(ct.payload)} bytes for {numel} elements")
        # read-only view of the received bytes: no copy (callers only read chunks)
        values = (
            torch.frombuffer(ct.payload, dtype=torch.float32, count=numel)
            if numel
            else torch.empty(0)
        )
    else:
        try:
            values = decompress(ct)
        except CompressionError as e:
            raise ProtocolError(f"cannot decode chunk: {e}") from e
        values = values.reshape(-1).to(torch.float32)
    if values.numel() != numel:
        raise ProtocolError(f"chunk decoded to {values.numel()} elements, expected {numel}")
    if check_finite and not all_finite(values):
        raise ProtocolError("chunk contains NaN or Inf")
    return values


def decode_chunk_into(ct: CompressedTensor, target: torch.Tensor) -> None:
    """Decode a validated chunk into ``target`` (a flat float32 tensor of its size) and reject
    NaN/Inf (ProtocolError; ``target`` then holds garbage the caller must undo).

    An uncompressed float32 payload that was received into ``target`` itself costs only the
    check; half precision is one widening copy; other codecs decode through a temporary.
    """
    payload = ct.payload
    in_place = (
        is_raw_float32(ct)
        and target.numel() > 0
        and torch.frombuffer(payload, dtype=torch.uint8).data_ptr() == target.data_ptr()
    )
    if not in_place:
        try:
            decompress_into(ct, target)
        except CompressionError as e:
            raise ProtocolError(f"cannot decode chunk: {e}") from e
    if not all_finite(target):
        raise ProtocolError("chunk contains NaN or Inf")


def decode_into_cost(ct: CompressedTensor) -> int:
    """Rough work of :func:`decode_chunk_into` in element-passes."""
    return ct.numel // 4 if is_raw_float32(ct) else 3 * ct.numel


def all_finite(values: torch.Tensor) -> bool:
    """True if ``values`` holds no NaN and no +-Inf.

    One read-only pass: a sum is NaN or +-Inf whenever an element is, so a finite sum proves
    every element finite. Only a non-finite sum (a NaN/Inf, or finite values whose sum
    overflows, e.g. many near 1e38) needs the exact check: min and max, which propagate NaN
    and are +-Inf when any element is. ``torch.sum`` runs at 3-5x the speed of
    ``torch.aminmax`` here (2.4 vs 8.4 ms for 16M floats, 8 vs 51 us for a 1 MiB chunk);
    ``torch.isfinite(x).all()`` writes a bool tensor of the same length first (slower still).
    """
    if values.numel() == 0:
        return True
    flat = values.reshape(-1)
    if math.isfinite(float(flat.sum())):
        return True
    lo, hi = torch.aminmax(flat)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def is_raw_float32(ct: CompressedTensor) -> bool:
    """Uncompressed float32: the payload is the values themselves."""
    return ct.codec_id == RAW_CODEC_ID and ct.dtype == "float32"


def decode_cost(ct: CompressedTensor, *, check_finite: bool = True) -> int:
    """Rough work of :func:`decode_chunk` in element-passes: a view plus one vectorised
    read-only pass (aminmax, several times faster than a copy) for uncompressed float32,
    a decode into a new tensor plus the check for other codecs."""
    if is_raw_float32(ct):
        return ct.numel // 4 if check_finite else 0
    return 3 * ct.numel


def raw_float32(values: torch.Tensor) -> CompressedTensor:
    """The :class:`NoCompression` message for a contiguous float32 CPU tensor, without a copy.

    The payload aliases ``values``: it must stay unmodified until the message is sent (true
    for the caller's tensors during a round and for finalized chunk results).
    """
    flat = values.reshape(-1)
    payload = memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return CompressedTensor(RAW_CODEC_ID, "float32", (flat.numel(),), payload, {})
