"""Zero-copy views between payload bytes and tensors, and compact bit packing.

Payloads are little-endian; every host torch supports today is little-endian, and we refuse
to run elsewhere rather than silently producing garbage on the wire.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator

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


#: Elements per slice when streaming big CPU tensors through small, cache-resident
#: temporaries (1 MiB of float32): avoids allocating (and page-faulting) tensor-sized scratch.
CHUNK = 1 << 18
#: With several intra-op threads every op on a slice is a fork-join; on busy cores each join
#: can wait for a descheduled thread, so multi-threaded runs use fewer, larger slices.
CHUNK_MULTITHREADED = 1 << 22


def slice_elems(device: torch.device) -> int:
    """Slice length for streaming a tensor on ``device`` (CPU only; one slice elsewhere)."""
    if device.type != "cpu":
        return sys.maxsize
    return CHUNK if torch.get_num_threads() == 1 else CHUNK_MULTITHREADED


def scratch_len(n: int, device: torch.device) -> int:
    """Length of a scratch buffer that holds one slice of an ``n``-element tensor."""
    return min(n, slice_elems(device))


def spans(n: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` slices covering ``range(n)`` (slice lengths are multiples of 8)."""
    step = slice_elems(device)
    for start in range(0, n, step):
        yield start, min(n, start + step)


def alloc(nbytes: int) -> torch.Tensor:
    """An uninitialized CPU byte buffer for a payload (no zero-fill pass, unlike bytearray)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def typed(buf: torch.Tensor, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A ``dtype`` view of ``count`` items of a byte buffer at an aligned byte ``offset``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset % itemsize:
        raise AssertionError(f"misaligned payload field at {offset} for {dtype}")
    return buf[offset : offset + count * itemsize].view(dtype)


def payload(buf: torch.Tensor) -> memoryview:
    """The buffer as a zero-copy ``memoryview`` (msgpack packs it as ``bin``)."""
    return memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


# 8 bytes holding 0/1, read as one little-endian int64, times this constant: bits land in
# the top byte in order (byte i -> bit i). Signed wrap-around is harmless here.
_GATHER = 0x0102040810204080
_SPREAD = torch.tensor(
    [sum(((b >> i) & 1) << (8 * i) for i in range(8)) for b in range(256)], dtype=torch.int64
)


def packed_bits_nbytes(nbits: int) -> int:
    return (nbits + 7) // 8


def pack_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a 1-D bool/0-1 tensor into uint8 bytes, least significant bit first."""
    bits = bits.reshape(-1)
    bits = bits.view(torch.uint8) if bits.dtype == torch.bool else bits.to(torch.uint8)
    n = bits.numel()
    nfull = n // 8
    if out is None:
        out = torch.empty(packed_bits_nbytes(n), dtype=torch.uint8, device=bits.device)
    if nfull:
        words = bits[: nfull * 8].view(torch.int64)
        out[:nfull].copy_(((words * _GATHER) >> 56) & 0xFF)
    if n > nfull * 8:
        tail = bits[nfull * 8 :].to(torch.int64)
        shifts = torch.arange(tail.numel(), dtype=torch.int64, device=bits.device)
        out[nfull] = int((tail << shifts).sum())
    return out


def unpack_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits as a uint8 0/1 tensor."""
    nbytes = packed_bits_nbytes(nbits)
    spread = _SPREAD.to(packed.device).index_select(0, packed[:nbytes].to(torch.int32))
    return spread.view(torch.uint8)[:nbits]


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers (< 2**width) into ``width`` bits each, as uint8 bytes.

    On the CPU this goes through numpy's bit packing (a handful of calls, about 10x fewer
    microseconds than the torch version below for the few hundred outlier indices of a
    chunk); elsewhere through :func:`_pack_uint_torch`. Both write the same bytes.
    """
    if values.device.type == "cpu" and 0 < width <= 32 and values.numel():
        import numpy as np

        v = values.reshape(-1).to(torch.int64).numpy()
        bits = ((v[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
        return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))
    return _pack_uint_torch(values, width)


def _pack_uint_torch(values: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`pack_uint` with torch ops (any device).

    Value i occupies bits ``[i*width, (i+1)*width)`` of the little-endian bit stream. Each
    value is shifted into place and split over the (at most 5) bytes it touches; the pieces
    never overlap, so adding them up is the same as OR-ing them. Memory: a few int64 per
    value, independent of ``width``.
    """
    count = values.numel()
    if width == 0 or count == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if not 0 < width <= 32:
        raise CompressionError(f"bit width must be in [0, 32], got {width}")
    device = values.device
    offsets = torch.arange(count, dtype=torch.int64, device=device) * width
    first = offsets >> 3
    shifted = values.to(torch.int64).reshape(-1) << (offsets & 7)  # < 2**39
    out = torch.zeros(packed_bits_nbytes(count * width) + 5, dtype=torch.int64, device=device)
    for j in range(5):
        out.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return out[: packed_bits_nbytes(count * width)].to(torch.uint8)


def unpack_uint(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: ``count`` int64 values of ``width`` bits (numpy on the
    CPU: ``width`` bytes of temporaries per value, at most 32, whatever the message says;
    :func:`_unpack_uint_torch` elsewhere). ``packed`` must hold at least
    ``ceil(count * width / 8)`` bytes (callers check the payload length first)."""
    if packed.device.type == "cpu" and 0 < width <= 32 and count:
        import numpy as np

        nbytes = packed_bits_nbytes(count * width)
        raw = packed[:nbytes].contiguous().numpy()
        bits = np.unpackbits(raw, count=count * width, bitorder="little").reshape(count, width)
        weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
        return torch.from_numpy(bits.astype(np.int64) @ weights)
    return _unpack_uint_torch(packed, count, width)


def _unpack_uint_torch(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """:func:`unpack_uint` with torch ops (any device).

    Reads the (at most 5) bytes holding each value, so memory stays a few int64 per value
    whatever ``width`` an untrusted message declares. ``packed`` must hold at least
    ``ceil(count * width / 8)`` bytes (callers check the payload length first).
    """
    device = packed.device
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=device)
    nbytes = packed_bits_nbytes(count * width)
    padded = torch.zeros(nbytes + 5, dtype=torch.int64, device=device)
    padded[:nbytes] = packed[:nbytes]
    offsets = torch.arange(count, dtype=torch.int64, device=device) * width
    first = offsets >> 3
    word = torch.zeros(count, dtype=torch.int64, device=device)
    for j in range(5):
        word |= padded.index_select(0, first + j) << (8 * j)
    return (word >> (offsets & 7)) & ((1 << width) - 1)
