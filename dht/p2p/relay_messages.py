"""Circuit relay v2 messages (libp2p specs, relay/circuit-v2.md): a strict protobuf codec.

Both sub-protocols exchange uvarint-length-prefixed protobuf messages: ``HopMessage`` on
``/libp2p/circuit/relay/0.2.0/hop`` (a peer and its relay: RESERVE, CONNECT, STATUS) and
``StopMessage`` on ``/libp2p/circuit/relay/0.2.0/stop`` (the relay and the target: CONNECT,
STATUS). Field numbers::

    HopMessage  {1 type, 2 peer: Peer, 3 reservation: Reservation, 4 limit: Limit, 5 status}
    StopMessage {1 type, 2 peer: Peer, 3 limit: Limit, 4 status}
    Peer        {1 id (PeerID bytes), 2 addrs (repeated binary multiaddrs)}
    Reservation {1 expire (UNIX seconds), 2 addrs (repeated), 3 voucher (signed envelope)}
    Limit       {1 duration (seconds, uint32), 2 data (bytes per direction, uint64)}

Every message comes from the network: sizes and counts are capped, a required field that is
missing (but ``type``: absent means 0, as proto3 decoders read it) or has the wrong wire
type is a ``RelayMessageError``, unknown fields are skipped
(forward compatibility), addresses we cannot parse are dropped rather than failing the whole
message. An unknown ``type`` or ``status`` value is kept as an int for the caller to refuse.
:func:`receive_frame` and :func:`send_quietly` move one message over a stream, for both
sides of the relay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import trio

from ._proto import (
    WIRE_LEN,
    WIRE_VARINT,
    ProtobufDecodeError,
    encode_bytes_field,
    encode_varint_field,
    iter_fields,
)
from .errors import IdentityError, MultiaddrError, P2PError, P2PTimeoutError, ProtocolViolationError
from .identity import PeerID
from .multiaddr import Multiaddr
from .varint import encode_uvarint

if TYPE_CHECKING:
    from .stream import P2PStream

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
MAX_MESSAGE_SIZE = 4096  # every legitimate message is a few hundred bytes
MAX_ADDRS = 16  # addresses kept from one Peer or Reservation; the rest are ignored
MAX_VOUCHER_SIZE = 2048
MAX_UINT32 = (1 << 32) - 1
MAX_UINT64 = (1 << 64) - 1
STREAM_ERRORS = (P2PError, trio.BrokenResourceError, trio.ClosedResourceError)


class HopType(IntEnum):
    RESERVE = 0
    CONNECT = 1
    STATUS = 2


class StopType(IntEnum):
    CONNECT = 0
    STATUS = 1


class Status(IntEnum):
    OK = 100
    RESERVATION_REFUSED = 200
    RESOURCE_LIMIT_EXCEEDED = 201
    PERMISSION_DENIED = 202
    CONNECTION_FAILED = 203
    NO_RESERVATION = 204
    MALFORMED_MESSAGE = 400
    UNEXPECTED_MESSAGE = 401


def status_name(status: int | None) -> str:
    """``"NO_RESERVATION"`` for 204, ``"status 999"`` for a code we do not know."""
    if status is None:
        return "no status"
    try:
        return Status(status).name
    except ValueError:
        return f"status {status}"


class RelayMessageError(ProtocolViolationError):
    """A relay message is not well-formed protobuf of the expected shape."""


@dataclass(frozen=True)
class Limit:
    """What a relay allows one relayed connection: ``duration`` seconds and ``data`` bytes in
    each direction; 0 means unlimited (as on the wire)."""

    duration: int = 0
    data: int = 0

    @property
    def unlimited(self) -> bool:
        return self.duration == 0 and self.data == 0


@dataclass
class PeerInfo:
    id: PeerID
    addrs: list[Multiaddr] = field(default_factory=list)


@dataclass
class ReservationInfo:
    expire: int = 0  # UNIX seconds (UTC); 0: the relay did not say
    addrs: list[Multiaddr] = field(default_factory=list)
    voucher: bytes | None = None


@dataclass
class HopMessage:
    type: int
    peer: PeerInfo | None = None
    reservation: ReservationInfo | None = None
    limit: Limit | None = None
    status: int | None = None


@dataclass
class StopMessage:
    type: int
    peer: PeerInfo | None = None
    limit: Limit | None = None
    status: int | None = None


# -- encoding ---------------------------------------------------------------------------------


def _encode_peer(peer: PeerInfo) -> bytes:
    out = encode_bytes_field(1, peer.id.to_bytes())
    for addr in peer.addrs[:MAX_ADDRS]:
        out += encode_bytes_field(2, addr.to_bytes())
    return out


def _encode_limit(limit: Limit) -> bytes:
    out = b""
    if limit.duration:
        out += encode_varint_field(1, min(limit.duration, MAX_UINT32))
    if limit.data:
        out += encode_varint_field(2, min(limit.data, MAX_UINT64))
    return out


def _encode_reservation(rsvp: ReservationInfo) -> bytes:
    out = encode_varint_field(1, rsvp.expire)
    for addr in rsvp.addrs[:MAX_ADDRS]:
        out += encode_bytes_field(2, addr.to_bytes())
    if rsvp.voucher is not None:
        out += encode_bytes_field(3, rsvp.voucher)
    return out


def _frame(body: bytes) -> bytes:
    if len(body) > MAX_MESSAGE_SIZE:  # a bug on our side, not a remote's
        raise ValueError(f"relay message of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    return encode_uvarint(len(body)) + body


def encode_hop(msg: HopMessage) -> bytes:
    """The message with its uvarint length prefix, ready to send."""
    out = encode_varint_field(1, int(msg.type))
    if msg.peer is not None:
        out += encode_bytes_field(2, _encode_peer(msg.peer))
    if msg.reservation is not None:
        out += encode_bytes_field(3, _encode_reservation(msg.reservation))
    if msg.limit is not None and not msg.limit.unlimited:
        out += encode_bytes_field(4, _encode_limit(msg.limit))
    if msg.status is not None:
        out += encode_varint_field(5, int(msg.status))
    return _frame(out)


def encode_stop(msg: StopMessage) -> bytes:
    """The message with its uvarint length prefix, ready to send."""
    out = encode_varint_field(1, int(msg.type))
    if msg.peer is not None:
        out += encode_bytes_field(2, _encode_peer(msg.peer))
    if msg.limit is not None and not msg.limit.unlimited:
        out += encode_bytes_field(3, _encode_limit(msg.limit))
    if msg.status is not None:
        out += encode_varint_field(4, int(msg.status))
    return _frame(out)


# -- decoding ---------------------------------------------------------------------------------


def _fields(data: bytes, what: str) -> list[tuple[int, int, int | bytes]]:
    try:
        return list(iter_fields(data))
    except ProtobufDecodeError as e:
        raise RelayMessageError(f"malformed {what}: {e}") from None


def _expect(wire: int, want: int, number: int, what: str) -> None:
    if wire != want:
        raise RelayMessageError(f"{what} field {number} has wire type {wire}, expected {want}")


def _addr(value: bytes) -> Multiaddr | None:
    try:
        return Multiaddr.from_bytes(value)
    except MultiaddrError:
        return None  # a transport we do not speak (quic, websocket...): not an error


def _decode_peer(data: bytes) -> PeerInfo:
    peer_id: PeerID | None = None
    addrs: list[Multiaddr] = []
    for number, wire, value in _fields(data, "Peer"):
        if number == 1:
            _expect(wire, WIRE_LEN, number, "Peer")
            assert isinstance(value, bytes)
            try:
                peer_id = PeerID.from_bytes(value)
            except IdentityError as e:
                raise RelayMessageError(f"Peer.id is not a valid PeerID: {e}") from None
        elif number == 2:
            _expect(wire, WIRE_LEN, number, "Peer")
            assert isinstance(value, bytes)
            if len(addrs) < MAX_ADDRS and (addr := _addr(value)) is not None:
                addrs.append(addr)
    if peer_id is None:
        raise RelayMessageError("Peer without its required id")
    return PeerInfo(peer_id, addrs)


def _decode_limit(data: bytes) -> Limit:
    duration = volume = 0
    for number, wire, value in _fields(data, "Limit"):
        if number in (1, 2):
            _expect(wire, WIRE_VARINT, number, "Limit")
            assert isinstance(value, int)
            if number == 1:
                if value > MAX_UINT32:
                    raise RelayMessageError(f"Limit.duration {value} is not a uint32")
                duration = value
            else:
                if value > MAX_UINT64:
                    raise RelayMessageError(f"Limit.data {value} is not a uint64")
                volume = value
    return Limit(duration, volume)


def _decode_reservation(data: bytes) -> ReservationInfo:
    rsvp = ReservationInfo()
    for number, wire, value in _fields(data, "Reservation"):
        if number == 1:
            _expect(wire, WIRE_VARINT, number, "Reservation")
            assert isinstance(value, int)
            if value > MAX_UINT64:
                raise RelayMessageError(f"Reservation.expire {value} is not a uint64")
            rsvp.expire = value
        elif number == 2:
            _expect(wire, WIRE_LEN, number, "Reservation")
            assert isinstance(value, bytes)
            if len(rsvp.addrs) < MAX_ADDRS and (addr := _addr(value)) is not None:
                rsvp.addrs.append(addr)
        elif number == 3:
            _expect(wire, WIRE_LEN, number, "Reservation")
            assert isinstance(value, bytes)
            if len(value) > MAX_VOUCHER_SIZE:
                raise RelayMessageError(f"Reservation.voucher of {len(value)} bytes is too large")
            rsvp.voucher = value
    return rsvp


def _decode_status(value: int | bytes, wire: int, number: int, what: str) -> int:
    _expect(wire, WIRE_VARINT, number, what)
    assert isinstance(value, int)
    if value > MAX_UINT32:
        raise RelayMessageError(f"{what}.status {value} is out of range")
    return value


def _decode_type(fields: list[tuple[int, int, int | bytes]], what: str) -> int:
    types = [(wire, value) for number, wire, value in fields if number == 1]
    if not types:
        return 0  # proto3 senders may omit a zero enum (go-libp2p reads it as 0 as well)
    wire, value = types[-1]  # protobuf: the last occurrence of a scalar wins
    _expect(wire, WIRE_VARINT, 1, what)
    assert isinstance(value, int)
    if value > MAX_UINT32:
        raise RelayMessageError(f"{what}.type {value} is out of range")
    return value


def decode_hop(body: bytes) -> HopMessage:
    """Parse a HopMessage body (without its length prefix); RelayMessageError if malformed."""
    if len(body) > MAX_MESSAGE_SIZE:
        raise RelayMessageError(f"HopMessage of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    fields = _fields(body, "HopMessage")
    msg = HopMessage(_decode_type(fields, "HopMessage"))
    for number, wire, value in fields:
        if number in (2, 3, 4):
            _expect(wire, WIRE_LEN, number, "HopMessage")
            assert isinstance(value, bytes)
            if number == 2:
                msg.peer = _decode_peer(value)
            elif number == 3:
                msg.reservation = _decode_reservation(value)
            else:
                msg.limit = _decode_limit(value)
        elif number == 5:
            msg.status = _decode_status(value, wire, number, "HopMessage")
    return msg


def decode_stop(body: bytes) -> StopMessage:
    """Parse a StopMessage body (without its length prefix); RelayMessageError if malformed."""
    if len(body) > MAX_MESSAGE_SIZE:
        raise RelayMessageError(f"StopMessage of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    fields = _fields(body, "StopMessage")
    msg = StopMessage(_decode_type(fields, "StopMessage"))
    for number, wire, value in fields:
        if number in (2, 3):
            _expect(wire, WIRE_LEN, number, "StopMessage")
            assert isinstance(value, bytes)
            if number == 2:
                msg.peer = _decode_peer(value)
            else:
                msg.limit = _decode_limit(value)
        elif number == 4:
            msg.status = _decode_status(value, wire, number, "StopMessage")
    return msg


# -- one message over a stream --------------------------------------------------------------


async def send_quietly(stream: P2PStream, frame: bytes, timeout: float) -> None:  # noqa: ASYNC109
    """Best effort: a status for a peer that may already be gone."""
    with trio.move_on_after(timeout):
        try:
            await stream.send_all(frame)
        except STREAM_ERRORS:
            pass


async def receive_frame(stream: P2PStream, timeout: float, what: str) -> bytes:  # noqa: ASYNC109
    """One length-prefixed relay message (at most MAX_MESSAGE_SIZE bytes) within ``timeout``."""
    with trio.move_on_after(timeout):
        return await stream.receive_frame(MAX_MESSAGE_SIZE)
    raise P2PTimeoutError(f"no {what} within {timeout:.1f}s")


__all__ = [
    "HOP_PROTOCOL",
    "MAX_MESSAGE_SIZE",
    "STOP_PROTOCOL",
    "STREAM_ERRORS",
    "HopMessage",
    "HopType",
    "Limit",
    "PeerInfo",
    "RelayMessageError",
    "ReservationInfo",
    "Status",
    "StopMessage",
    "StopType",
    "decode_hop",
    "decode_stop",
    "encode_hop",
    "encode_stop",
    "receive_frame",
    "send_quietly",
    "status_name",
]
