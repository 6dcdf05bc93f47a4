"""Zero-copy views between payload bytes and tensors, and compact bit packing.

Payloads are little-endian; every host torch supports today is little-endian, and we refuse
to run elsewhere rather than silently producing garbage on the wire.
"""

from __future__ import annotations

import sys
import warnings

import torch

from .errors import CompressionError, PayloadSizeError

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("compression payloads are little-endian; big-endian hosts are unsupported")

Buffer = bytes | bytearray | memoryview


def view(buf: Buffer, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A tensor viewing ``count`` items of ``buf`` starting at byte ``offset`` (no copy).

    The view may be read-only (``bytes``); callers must not write into it, only read it into
    a fresh tensor. The length check happens here so a short buffer never reaches torch.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset + count * itemsize > len(buf):
        raise PayloadSizeError(
            f"payload too short: need {offset + count * itemsize} bytes, have {len(buf)}"
        )
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # bytes are read-only; we never write through this view (documented above).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def writable(nbytes: int) -> bytearray:
    """A fresh payload buffer that torch can write into directly (saves one copy)."""
    return bytearray(nbytes)


def write(buf: bytearray, offset: int, tensor: torch.Tensor) -> int:
    """Copy ``tensor`` (any device) into ``buf`` at ``offset``; returns the offset after it."""
    n = tensor.numel()
    if n:
        dst = torch.frombuffer(buf, dtype=tensor.dtype, count=n, offset=offset)
        dst.copy_(tensor.reshape(-1))
    return offset + n * tensor.element_size()


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def packed_bits_nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool/0-1 tensor into uint8, least significant bit first."""
    bits = bits.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    groups = bits.view(-1, 8)
    out = groups[:, 0].clone()
    for i in range(1, 8):  # 8 vectorized passes over n/8 bytes, not a loop over elements
        out |= groups[:, i] << i
    return out


def unpack_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits as a uint8 0/1 tensor."""
    shifts = _SHIFTS.to(packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:nbits]


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers (< 2**width) into ``width`` bits each, as uint8 bytes."""
    if width == 0 or values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if not 0 < width <= 32:
        raise CompressionError(f"bit width must be in [0, 32], got {width}")
    shifts = torch.arange(width, dtype=torch.int64, device=values.device)
    bits = (values.to(torch.int64).reshape(-1, 1) >> shifts) & 1
    return pack_bits(bits.reshape(-1))


def unpack_uint(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: ``count`` int64 values of ``width`` bits."""
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=packed.device)
    bits = unpack_bits(packed, count * width).to(torch.int64).view(count, width)
    shifts = torch.arange(width, dtype=torch.int64, device=packed.device)
    return (bits << shifts).sum(dim=1)
