"""Minimal protobuf (proto2/proto3 wire format) codec for the few tiny messages libp2p needs.

libp2p only needs two message shapes here (the crypto ``PublicKey`` and Noise's
``NoiseHandshakePayload``), both made of varint and length-delimited fields. A full protobuf
dependency is not worth it for that; this module encodes those two wire types and decodes
them strictly (bounded sizes, no groups, no fixed32/64 surprises).
"""

from __future__ import annotations

from collections.abc import Iterator

from .varint import decode_uvarint, encode_uvarint

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5


class ProtobufDecodeError(ValueError):
    """The bytes are not a well-formed protobuf message of the expected shape."""


def encode_varint_field(field: int, value: int) -> bytes:
    return encode_uvarint(field << 3 | WIRE_VARINT) + encode_uvarint(value)


def encode_bytes_field(field: int, value: bytes) -> bytes:
    return encode_uvarint(field << 3 | WIRE_LEN) + encode_uvarint(len(value)) + bytes(value)


def iter_fields(data: bytes | bytearray | memoryview) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field_number, wire_type, value)`` for every field of a message.

    Varints come out as ``int``, length-delimited fields as ``bytes``; fixed-width fields are
    skipped over (yielded as raw bytes) so unknown fields of those types do not break parsing.
    """
    data = memoryview(data)
    pos = 0
    end = len(data)
    while pos < end:
        try:
            key, pos = decode_uvarint(data, pos)
        except ValueError as e:
            raise ProtobufDecodeError(f"bad field key at offset {pos}: {e}") from None
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ProtobufDecodeError(f"field number 0 at offset {pos}")
        if wire == WIRE_VARINT:
            try:
                value, pos = decode_uvarint(data, pos)
            except ValueError as e:
                raise ProtobufDecodeError(f"bad varint in field {field}: {e}") from None
            yield field, wire, value
        elif wire == WIRE_LEN:
            try:
                length, pos = decode_uvarint(data, pos)
            except ValueError as e:
                raise ProtobufDecodeError(f"bad length of field {field}: {e}") from None
            if pos + length > end:
                raise ProtobufDecodeError(
                    f"field {field} claims {length} bytes but only {end - pos} remain"
                )
            yield field, wire, bytes(data[pos : pos + length])
            pos += length
        elif wire in (WIRE_I64, WIRE_I32):
            size = 8 if wire == WIRE_I64 else 4
            if pos + size > end:
                raise ProtobufDecodeError(f"truncated fixed-width field {field}")
            yield field, wire, bytes(data[pos : pos + size])
            pos += size
        else:
            raise ProtobufDecodeError(f"unsupported wire type {wire} for field {field}")
