"""DCUtR messages (libp2p specs, relay/DCUtR.md): a strict protobuf codec.

Wire format (uvarint-length-prefixed protobuf, proto2)::

    HolePunch { required Type type = 1; repeated bytes ObsAddrs = 2; }
    Type: CONNECT = 100, SYNC = 300

Every message comes from the network: at most :data:`MAX_MESSAGE_SIZE` bytes and
:data:`MAX_ADDRS` addresses, ``type`` is required and must be CONNECT or SYNC, addresses that
do not parse are skipped and counted, unknown fields are ignored. ``dcutr.py`` re-exports
everything here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from ._proto import (
    WIRE_LEN,
    WIRE_VARINT,
    ProtobufDecodeError,
    encode_bytes_field,
    encode_varint_field,
    iter_fields,
)
from .errors import MultiaddrError, ProtocolViolationError
from .multiaddr import Multiaddr
from .varint import encode_uvarint

MAX_MESSAGE_SIZE = 4096  # a message with 16 addresses is a few hundred bytes
MAX_ADDRS = 16  # ObsAddrs entries in one message; more is a malformed message


class HolePunchType(IntEnum):
    CONNECT = 100
    SYNC = 300


class DCUtRMessageError(ProtocolViolationError):
    """A HolePunch message is malformed, over a cap, of an unknown type or out of order."""


@dataclass(frozen=True)
class HolePunch:
    """One message. ``skipped`` counts addresses that did not parse (kinds we do not
    support, or junk); they are not kept and not part of equality."""

    type: HolePunchType
    addrs: tuple[Multiaddr, ...] = ()
    skipped: int = field(default=0, compare=False)


def encode_hole_punch(msg: HolePunch) -> bytes:
    """A ``HolePunch`` body (no length prefix). ValueError over the caps (our own bug)."""
    if len(msg.addrs) > MAX_ADDRS:
        raise ValueError(f"at most {MAX_ADDRS} addresses in a HolePunch, got {len(msg.addrs)}")
    body = encode_varint_field(1, int(msg.type))
    body += b"".join(encode_bytes_field(2, addr.to_bytes()) for addr in msg.addrs)
    if len(body) > MAX_MESSAGE_SIZE:
        raise ValueError(f"HolePunch of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    return body


def frame(body: bytes) -> bytes:
    """``body`` with its uvarint length prefix, as it goes on the stream."""
    return encode_uvarint(len(body)) + body


def decode_hole_punch(body: bytes | bytearray | memoryview) -> HolePunch:
    """Parse a ``HolePunch`` body; DCUtRMessageError if it is malformed or over a cap.

    ``type`` is required (proto2) and must be CONNECT or SYNC; addresses that do not parse as
    multiaddrs are skipped (counted in ``skipped``); unknown fields are ignored."""
    if len(body) > MAX_MESSAGE_SIZE:
        raise DCUtRMessageError(f"HolePunch of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    kind: int | None = None
    raw_addrs: list[bytes] = []
    try:
        for number, wire, value in iter_fields(bytes(body)):
            if number == 1:
                if wire != WIRE_VARINT:
                    raise DCUtRMessageError(f"HolePunch.type has wire type {wire}, not varint")
                assert isinstance(value, int)
                kind = value  # protobuf: the last occurrence of a scalar wins
            elif number == 2:
                if wire != WIRE_LEN:
                    raise DCUtRMessageError(f"HolePunch.ObsAddrs has wire type {wire}, not bytes")
                assert isinstance(value, bytes)
                raw_addrs.append(value)
                if len(raw_addrs) > MAX_ADDRS:
                    raise DCUtRMessageError(f"HolePunch lists more than {MAX_ADDRS} addresses")
    except ProtobufDecodeError as e:
        raise DCUtRMessageError(f"malformed HolePunch: {e}") from None
    if kind is None:
        raise DCUtRMessageError("HolePunch without its required type")
    if kind not in (HolePunchType.CONNECT, HolePunchType.SYNC):
        raise DCUtRMessageError(f"unknown HolePunch type {kind}")
    addrs: list[Multiaddr] = []
    skipped = 0
    for raw in raw_addrs:
        try:
            addrs.append(Multiaddr.from_bytes(raw))
        except MultiaddrError:
            skipped += 1  # quic, websocket... or junk: nothing we would dial
    return HolePunch(HolePunchType(kind), tuple(addrs), skipped)


__all__ = [
    "MAX_ADDRS",
    "MAX_MESSAGE_SIZE",
    "DCUtRMessageError",
    "HolePunch",
    "HolePunchType",
    "decode_hole_punch",
    "encode_hole_punch",
    "frame",
]
