"""Unsigned varint (LEB128, as in multiformats) encoding with a hard cap on length."""

from __future__ import annotations

MAX_VARINT_BYTES = 9  # multiformats caps unsigned varints at 9 bytes (63 bits)


def encode_uvarint(value: int) -> bytes:
    if value < 0:
        raise ValueError("uvarint cannot encode a negative number")
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_uvarint(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int]:
    """Decode one uvarint at ``offset``; return (value, new_offset).

    Raises ValueError on a truncated, overlong or non-minimal encoding, IndexError-free.
    """
    result = 0
    shift = 0
    for i in range(MAX_VARINT_BYTES):
        pos = offset + i
        if pos >= len(data):
            raise ValueError("truncated uvarint")
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise ValueError("non-minimal uvarint encoding")
            return result, pos + 1
        shift += 7
    raise ValueError(f"uvarint longer than {MAX_VARINT_BYTES} bytes")
