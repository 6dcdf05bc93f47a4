"""8-bit quantizers: uniform (one affine range), quantile (fitted codebook), blockwise.

All three reject NaN/+-Inf input with NonFiniteInputError: a non-finite value would poison
the range or the codebook of the whole tensor (or block), and under error feedback it would
sit in the residual forever. Arithmetic is float32 whatever the input dtype.

Big CPU tensors are processed in slices of ``_bytes.slice_elems()`` elements through small reused
temporaries, so an encode or decode touches the tensor about once instead of allocating
and page-faulting several tensor-sized intermediates.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np
import torch

from . import _bytes
from ._sorting import sorted_values
from .base import (
    Codec,
    CompressedTensor,
    MetaValue,
    check_finite_scalar,
    expect_len,
    meta_float,
    meta_int,
)
from .errors import MalformedMessageError, NonFiniteInputError, PayloadValueError
from .indices import pack_indices, sample_runs, sparse_nonzero, unpack_indices

_F32_MAX = float(torch.finfo(torch.float32).max)


def _aminmax(flat: torch.Tensor) -> tuple[float, float]:
    if flat.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(flat)  # one pass, no temporary; NaN/Inf propagate into lo/hi
    return check_finite_scalar(lo, "min"), check_finite_scalar(hi, "max")


class _F32Slices:
    """float32 slices of a flat tensor: views when it already is float32, else converted
    into one reused scratch buffer."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self.scratch = None
        if flat.dtype != torch.float32:
            size = _bytes.scratch_len(flat.numel(), flat.device)
            self.scratch = torch.empty(size, device=flat.device)

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        part = self.flat[start:stop]
        if self.scratch is None:
            return part
        return self.scratch[: stop - start].copy_(part)


# Per-thread scratch buffers, reused across calls. A fresh 1 MiB temporary costs a page fault
# per page on first touch (glibc hands large blocks back to the OS), which was 40% of an
# 8-bit encode of a 1 MiB chunk. Only slices up to _bytes.CHUNK elements are kept (<= 1 MiB
# per buffer, a few buffers per thread); bigger ones (multi-threaded torch) are allocated
# per call, where the work per allocation is larger anyway.
_POOL = threading.local()


def _not_equal(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.ne(a, b, out=out)``; on the CPU through numpy, 3.5x faster here for float32
    into bool (same result: a view of the same memory)."""
    if a.device.type == "cpu":
        np.not_equal(a.numpy(), b.numpy(), out=out.numpy())
        return out
    return torch.ne(a, b, out=out)


def _scratch(
    n: int, device: torch.device, dtype: torch.dtype = torch.float32, slot: int = 0
) -> torch.Tensor:
    """A temporary for one slice of an ``n``-element tensor; valid until this thread asks
    again for the same ``(dtype, slot)`` (callers that need two of a dtype use two slots)."""
    size = _bytes.scratch_len(n, device)
    if device.type != "cpu" or size > _bytes.CHUNK:
        return torch.empty(size, dtype=dtype, device=device)
    pool = getattr(_POOL, "buffers", None)
    if pool is None:
        pool = _POOL.buffers = {}
    buf = pool.get((dtype, slot))
    if buf is None or buf.numel() < size:
        buf = pool[(dtype, slot)] = torch.empty(max(size, 1), dtype=dtype)
    return buf[:size]


def _store(dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> None:
    """Cast ``src`` into the host payload slice ``dst``; on accelerators cast first, so only
    the narrow codes cross to the host."""
    dst.copy_(src if src.device.type == "cpu" else src.to(dtype))


def _codes_on(
    ct: CompressedTensor, dtype: torch.dtype, offset: int, device: torch.device
) -> torch.Tensor:
    """The 1-byte codes of a payload, moved (still narrow) to ``device``."""
    codes = _bytes.view(ct.payload, dtype, ct.numel, offset)
    return codes.to(device) if device.type != "cpu" else codes


class Uniform8Bit(Codec):
    """256 evenly spaced levels over ``[lo, hi]``: ``x ~ lo + code * step``, plus outliers.

    ``range_sigmas=c`` (default 4) narrows the range to ``median +- c*sigma`` (within
    min/max), which gives a finer step for the bulk of the data; sigma = IQR / 1.349 from a
    sample of 16384 values, robust to the very outliers the range is meant to exclude (a
    plain std is inflated by them). Values more than half a step outside
    the range are *outliers*: with ``outliers=True`` (default) they travel exactly, as
    float32 values with bit-packed index gaps (as in TopK), so nothing is clipped; with
    ``outliers=False`` they are clipped to the range (for use under error feedback). If more
    than 1/256 of the values would be outliers (heavy tails), the tensor is encoded over its
    exact min/max instead, so a message never exceeds 8.25 bits/value. ``range_sigmas=None`` always uses the exact min/max.

    On Gaussian data 4 sigma leaves ~1 value in 16000 outside: +0.004 bits/value, and a
    relative error of ~0.009 instead of ~0.012 for the min/max range of 16M values.
    Payload: one uint8 code per value; with outliers, padding to a multiple of 4 bytes, the
    float32 outlier values and their packed index gaps.
    """

    codec_id = 4
    #: each outlier costs 32 + (at most 32) bits: 1/256 keeps a message <= 8.25 bits/value
    MAX_OUTLIER_FRACTION = 1 / 256

    def __init__(self, range_sigmas: float | None = 4.0, outliers: bool = True, seed: int = 0):
        if range_sigmas is not None and not range_sigmas > 0:
            raise ValueError("range_sigmas must be positive or None")
        self.range_sigmas = range_sigmas
        self.outliers = outliers
        self._gen = torch.Generator().manual_seed(seed)

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        lo, hi = _aminmax(flat)
        if self.range_sigmas is not None and n > 1:
            sample = flat if n <= 16384 else sample_runs(flat, 16384, self._gen)
            ordered = sorted_values(sample.float())
            m = ordered.numel() - 1
            q25, median, q75 = (float(ordered[round(m * q)]) for q in (0.25, 0.5, 0.75))
            sigma = (q75 - q25) / 1.349  # = std for Gaussian data
            r_lo = max(lo, median - self.range_sigmas * sigma)
            r_hi = min(hi, median + self.range_sigmas * sigma)
            if r_lo > lo or r_hi < hi:
                cap = int(n * self.MAX_OUTLIER_FRACTION) if self.outliers else None
                encoded = _encode_uniform(flat, r_lo, r_hi, clip=True, max_outliers=cap)
                if encoded is not None:
                    return encoded
        encoded = _encode_uniform(flat, lo, hi, clip=False, max_outliers=None)
        assert encoded is not None  # without an outlier cap nothing is refused
        return encoded

    @staticmethod
    def _layout(ct: CompressedTensor) -> tuple[int, int, int]:
        """(outlier count, gap width, byte offset of the outlier values)."""
        m = meta_int(ct, "m", 0, ct.numel)
        width = meta_int(ct, "width", 0, 32)
        return m, width, ct.numel + (-ct.numel) % 4

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        lo = meta_float(ct, "lo")
        step = meta_float(ct, "step", positive=True)
        if abs(lo) + 255.0 * step > _F32_MAX:
            raise MalformedMessageError("uniform range exceeds float32")
        m, width, values_at = cls._layout(ct)
        if m == 0:
            expect_len(ct, ct.numel)
        else:
            expect_len(ct, values_at + 4 * m + _bytes.packed_bits_nbytes(m * width))

    @classmethod
    def outlier_indices(cls, ct: CompressedTensor) -> torch.Tensor:
        m, width, values_at = cls._layout(ct)
        return unpack_indices(ct, m, width, values_at + 4 * m)

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        cls.outlier_indices(ct)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        out = torch.empty(ct.numel, device=device)
        cls._decode_to(ct, out)
        return out

    @classmethod
    def decode_into(cls, ct: CompressedTensor, out: torch.Tensor) -> None:
        if out.dtype == torch.float32:
            cls._decode_to(ct, out)  # straight into the destination: no temporary
        else:
            super().decode_into(ct, out)

    @classmethod
    def _decode_to(cls, ct: CompressedTensor, out: torch.Tensor) -> None:
        device = out.device
        lo, step = meta_float(ct, "lo"), meta_float(ct, "step", positive=True)
        codes = _codes_on(ct, torch.uint8, 0, device)
        lo_t = torch.tensor(lo, device=device)
        for start, stop in _bytes.spans(ct.numel, device):
            torch.add(lo_t, codes[start:stop], alpha=step, out=out[start:stop])
        m, _, values_at = cls._layout(ct)
        if m:
            values = _bytes.view(ct.payload, torch.float32, m, values_at).to(device)
            out[cls.outlier_indices(ct).to(device)] = values


# Largest value that still truncates to code 255; anything above it (x beyond hi + step/2,
# up to float rounding) is an outlier, which is harmless: outliers travel exactly.
_TOP = 255.999


def _encode_uniform(
    flat: torch.Tensor, lo: float, hi: float, clip: bool, max_outliers: int | None
) -> tuple[torch.Tensor, dict[str, MetaValue]] | None:
    """Codes over ``[lo, hi]``; collects outliers when ``max_outliers`` is given (None if
    there are more than that), else clips when ``clip``."""
    n = flat.numel()
    step = (hi - lo) / 255.0
    # a constant tensor, a degenerate range, or one so narrow (hi - lo < 255 * 2**-128, about
    # 7.5e-37) that 1 / step overflows float32: every value then decodes to lo, off by < hi - lo
    if not step > 0 or not math.isfinite(step) or not 1.0 / step <= _F32_MAX:
        step = 1.0
    inv = 1.0 / step
    collect = max_outliers is not None
    cap = max_outliers or 0
    pad = (-n) % 4
    # room for the worst accepted case (float32 value + 32-bit gap per outlier); pages never
    # written are never touched, and the payload is a prefix of this buffer
    buf = _bytes.alloc(n + (pad + 8 * cap if collect else 0))
    codes = buf[:n]
    found: list[torch.Tensor] = []
    count = 0
    if n:
        slices, tmp = _F32Slices(flat), _scratch(n, flat.device)
        inside, hit = _scratch(n, flat.device, slot=1), _scratch(n, flat.device, torch.bool)
        # code = trunc(x * inv + (0.5 - lo * inv)): rounding folded into the offset.
        # A large offset would cost precision in float32, so then subtract lo first.
        fused = abs(lo) * inv < 2**15
        offset = torch.tensor(0.5 - lo * inv, device=flat.device)
        for start, stop in _bytes.spans(n, flat.device):
            m = stop - start
            x, t = slices(start, stop), tmp[:m]
            if fused:
                torch.add(offset, x, alpha=inv, out=t)
            else:
                torch.sub(x, lo, out=t).mul_(inv).add_(0.5)
            if collect:  # more than (about) half a step outside [lo, hi]
                c = torch.clamp(t, 0.0, _TOP, out=inside[:m])
                hits = sparse_nonzero(_not_equal(t, c, hit[:m]))
                t = c
                if hits.numel():
                    count += hits.numel()
                    if count > cap:
                        return None
                    found.append(hits.add_(start))
            elif clip:
                t.clamp_(0.0, _TOP)
            _store(codes[start:stop], t, torch.uint8)  # truncation, in range by design
    meta: dict[str, MetaValue] = {"lo": lo, "step": step, "m": count, "width": 0}
    if not count:
        return codes, meta
    idx = torch.cat(found) if len(found) > 1 else found[0]
    packed, width = pack_indices(idx)
    values_at = n + pad
    buf[n:values_at].zero_()  # the padding: never send uninitialized memory
    _bytes.typed(buf, torch.float32, count, values_at).copy_(flat[idx])
    gaps_at = values_at + 4 * count
    buf[gaps_at : gaps_at + packed.numel()].copy_(packed)
    meta["width"] = width
    return buf[: gaps_at + packed.numel()], meta


class Quantile8Bit(Codec):
    """256 levels fitted to the data: a 1-D Lloyd-Max (k-means) codebook from a sample.

    Levels follow the MSE-optimal point density for the sample (density of levels ~
    p(x)^(1/3), Panter-Dite), estimated from the spacings of the sorted sample; optional
    Lloyd iterations then move them to the centroids of their cells (off by default: on a
    65536-value sample they overfit the sample and do not help). Equal-probability (plain
    quantile) levels would be simpler, but their wide outermost bins dominate the error
    (3-4x worse on Gaussian data). The tensor's min and max are always in the sample.

    Codes come from a 65536-cell lookup table plus ``_EDGES_PER_CELL`` comparisons per
    element (exact up to float rounding at cell borders unless a cell holds more bin edges
    than that), much faster than ``torch.bucketize``'s binary search.
    Payload: 256 float32 levels, then one byte per value.
    """

    codec_id = 5
    _CELLS = 65536
    _EDGES_PER_CELL = 1

    def __init__(self, sample_size: int = 65536, iterations: int = 0, seed: int = 0):
        if sample_size < 256 or iterations < 0:
            raise ValueError("sample_size must be >= 256 and iterations >= 0")
        self.sample_size = sample_size
        self.iterations = iterations
        self._gen = torch.Generator().manual_seed(seed)

    def _codebook(self, flat: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        n = flat.numel()
        if n <= self.sample_size:
            sample = flat.float()
        else:
            idx = torch.randint(n, (self.sample_size,), generator=self._gen).to(flat.device)
            sample = flat[idx].float()
        sample = torch.cat([sample, sample.new_tensor([lo, hi])])
        levels = _compander_levels(sample)
        for _ in range(self.iterations):
            edges = (levels[1:] + levels[:-1]) * 0.5
            cell = torch.bucketize(sample, edges)
            sums = torch.zeros(256, device=flat.device).index_add_(0, cell, sample)
            counts = torch.bincount(cell, minlength=256).float()
            levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels).sort().values
        return levels

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        buf = _bytes.alloc(1024 + n)
        if n == 0:
            _bytes.typed(buf, torch.float32, 256).zero_()
            return buf, {}
        lo, hi = _aminmax(flat)
        levels = self._codebook(flat, lo, hi)
        _bytes.typed(buf, torch.float32, 256).copy_(levels)
        codes = (
            buf[1024:] if flat.device.type == "cpu" else torch.empty_like(flat, dtype=torch.uint8)
        )
        _assign(flat, levels, lo, hi, codes, self._CELLS, self._EDGES_PER_CELL)
        if flat.device.type != "cpu":
            buf[1024:].copy_(codes)  # only the 1-byte codes cross to the host
        return buf, {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 1024 + ct.numel)

    @classmethod
    def levels(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        levels = _bytes.view(ct.payload, torch.float32, 256).to(device)
        if not bool(torch.isfinite(levels).all()):
            raise PayloadValueError("quantile codebook has non-finite levels")
        return levels

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        cls.levels(ct, torch.device("cpu"))

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        levels = cls.levels(ct, device)
        out = torch.empty(ct.numel, device=device)
        if ct.numel == 0:
            return out
        codes = _codes_on(ct, torch.uint8, 1024, device)
        idx = _scratch(ct.numel, device, torch.int32)
        for start, stop in _bytes.spans(ct.numel, device):
            i = idx[: stop - start].copy_(codes[start:stop])
            torch.index_select(levels, 0, i, out=out[start:stop])
        return out


def _compander_levels(sample: torch.Tensor, group: int = 4) -> torch.Tensor:
    """256 levels whose density follows the sample density to the power 1/3 (Panter-Dite).

    The density is estimated from spacings of the sorted sample (every ``group``-th order
    statistic encloses the same probability mass), so it adapts to any scale and to heavy
    tails, where a fixed-width histogram would put nearly all data into one bin.
    """
    s = sorted_values(sample.double())
    q = s[::group]
    if q[-1] != s[-1]:
        q = torch.cat([q, s[-1:]])
    # equal mass per interval => density ~ 1/width; level density ~ p^(1/3) => the number of
    # levels in an interval ~ width * width^(-1/3) = width^(2/3)
    weight = torch.cumsum((q[1:] - q[:-1]).pow(2.0 / 3.0), 0)
    if q.numel() < 2 or not float(weight[-1]) > 0:
        return torch.full((256,), float(s[0]), device=sample.device)
    cum = torch.cat([weight.new_zeros(1), weight / weight[-1]])
    targets = (torch.arange(256, dtype=torch.float64, device=sample.device) + 0.5) / 256
    pos = torch.searchsorted(cum, targets).clamp(1, cum.numel() - 1)
    lo_w, hi_w = cum[pos - 1], cum[pos]
    frac = ((targets - lo_w) / (hi_w - lo_w).clamp_min(1e-300)).clamp(0.0, 1.0)
    levels = q[pos - 1] + frac * (q[pos] - q[pos - 1])
    return sorted_values(levels.float())


def _assign(
    flat: torch.Tensor,
    levels: torch.Tensor,
    lo: float,
    hi: float,
    out: torch.Tensor,
    cells: int,
    per_cell: int,
) -> None:
    """Write the index of the nearest level of every element into the uint8 tensor ``out``.

    ``[lo, hi]`` is cut into ``cells`` equal cells; tables give the code at each cell's
    left end and the first ``per_cell`` bin edges inside the cell, so each element costs one
    multiply-add, ``1 + per_cell`` gathers and ``per_cell`` comparisons, no binary search.
    """
    device = flat.device
    edges = (levels[1:] + levels[:-1]) * 0.5  # 255 ascending decision boundaries
    n = flat.numel()
    width = (hi - lo) / cells
    if not width > 0 or n < 4 * cells:  # small input: building the tables would cost more
        out.copy_(torch.bucketize(flat.float(), edges))
        return
    starts = lo + width * torch.arange(cells, dtype=torch.float64, device=device)
    base = torch.bucketize(starts.float(), edges, right=True)  # code at each cell's left end
    ends = (starts + width).float()
    tables = []  # the j-th edge after each cell start, +inf when it lies beyond the cell
    for j in range(per_cell):
        e = edges[(base + j).clamp_max(254)]
        inside = ((base + j) <= 254) & (e < ends)
        tables.append(torch.where(inside, e, torch.full_like(e, math.inf)))
    base = base.to(torch.uint8)
    slices = _F32Slices(flat)
    tmp, cell = _scratch(n, device), _scratch(n, device, torch.int32)
    hit = _scratch(n, device, torch.bool)
    offset = torch.tensor(-lo / width, device=device)
    for start, stop in _bytes.spans(n, device):
        m = stop - start
        x, t, c, h, o = slices(start, stop), tmp[:m], cell[:m], hit[:m], out[start:stop]
        torch.add(offset, x, alpha=1.0 / width, out=t)
        c.copy_(t).clamp_(0, cells - 1)
        torch.index_select(base, 0, c, out=o)
        for table in tables:
            torch.index_select(table, 0, c, out=t)
            torch.ge(x, t, out=h)
            o.add_(h)


class Blockwise8Bit(Codec):
    """Symmetric int8 per block of ``block_size`` values, each block with a float32 absmax.

    ``x ~ code * absmax_block / 127``. Outliers only cost precision inside their own block,
    so the error is far below one global range. Payload: float32 absmax per block (ceil(n /
    block_size) of them), then one int8 per value: 8 + 32/block_size bits per value.
    """

    codec_id = 6
    MAX_BLOCK = 1 << 20

    def __init__(self, block_size: int = 128):
        if not 1 <= block_size <= self.MAX_BLOCK:
            raise ValueError(f"block_size must be in [1, {self.MAX_BLOCK}]")
        self.block_size = block_size

    def _blocks(self, n: int, device: torch.device) -> Iterator[tuple[int, int, int]]:
        """(first element, element count, block count) per slice of whole blocks + tail."""
        bs = self.block_size
        full = n // bs
        per = max(1, min(_bytes.slice_elems(device), max(full, 1) * bs) // bs)
        for b in range(0, full, per):
            nb = min(per, full - b)
            yield b * bs, nb * bs, nb
        if n > full * bs:
            yield full * bs, n - full * bs, 1

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n, bs = flat.numel(), self.block_size
        nblocks = -(-n // bs)
        buf = _bytes.alloc(4 * nblocks + n)
        scales = torch.empty(nblocks, device=flat.device)
        codes = _bytes.typed(buf, torch.int8, n, 4 * nblocks)
        tmp = _scratch(max(n, 1), flat.device)
        if flat.dtype != torch.float32:
            flat = flat.float()  # rare path: half-precision inputs
        block = 0
        for start, count, nb in self._blocks(n, flat.device):
            part = flat[start : start + count].view(nb, -1)
            mn, mx = torch.aminmax(part, dim=1)
            absmax = torch.maximum(mx, mn.neg(), out=scales[block : block + nb])
            inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
            t = torch.mul(part, inv.unsqueeze(1), out=tmp[:count].view(nb, -1)).round_()
            _store(codes[start : start + count], t.view(-1), torch.int8)
            block += nb
        if n and not bool(torch.isfinite(scales).all()):
            raise NonFiniteInputError("Blockwise8Bit input contains NaN or Inf")
        _bytes.typed(buf, torch.float32, nblocks).copy_(scales)
        return buf, {"block": bs}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        bs = meta_int(ct, "block", 1, cls.MAX_BLOCK)
        expect_len(ct, 4 * (-(-ct.numel // bs)) + ct.numel)

    @classmethod
    def scales(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        nblocks = -(-ct.numel // meta_int(ct, "block", 1, cls.MAX_BLOCK))
        absmax = _bytes.view(ct.payload, torch.float32, nblocks).to(device)
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise PayloadValueError("block scales must be finite and non-negative")
        return absmax

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        cls.scales(ct, torch.device("cpu"))

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        bs = meta_int(ct, "block", 1, cls.MAX_BLOCK)
        n = ct.numel
        nblocks = -(-n // bs)
        absmax = cls.scales(ct, device)
        codes = _codes_on(ct, torch.int8, 4 * nblocks, device)
        out = torch.empty(n, device=device)
        block = 0
        for start, count, nb in cls(bs)._blocks(n, device):
            dst = out[start : start + count].view(nb, -1)
            scale = absmax[block : block + nb].unsqueeze(1)
            # (code * absmax) / 127 rather than code * (absmax / 127): the extreme codes
            # +-127 then decode to exactly +-absmax (constants round-trip bit-exactly)
            torch.mul(codes[start : start + count].view(nb, -1), scale, out=dst).div_(127.0)
            block += nb
        return out


__all__ = ["Uniform8Bit", "Quantile8Bit", "Blockwise8Bit"]


class Blockwise4Bit(Codec):
    """Symmetric 4-bit codes per block of ``block_size`` values, each block with a float32 absmax.

    ``x ~ code * absmax_block / 7`` with ``code`` in -7..7, stored as ``code + 7`` in one nibble,
    two values per byte (the first in the low nibble). Meant for what error feedback corrects
    over rounds (DiLoCo's pseudo-gradients): one round's error is up to absmax / 14 per value.
    Payload: float32 absmax per block, then ceil(n / 2) bytes: 4 + 32/block_size bits per value.
    """

    codec_id = 10
    MAX_BLOCK = 1 << 20
    LEVELS = 7  # codes -7..7: symmetric, so 0 and +-absmax are exact

    def __init__(self, block_size: int = 64):
        if not 1 <= block_size <= self.MAX_BLOCK:
            raise ValueError(f"block_size must be in [1, {self.MAX_BLOCK}]")
        self.block_size = block_size

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n, bs = flat.numel(), self.block_size
        nblocks = -(-n // bs)
        buf = _bytes.alloc(4 * nblocks + (n + 1) // 2)
        # one float32 working copy, worked on in place: the last block padded with zeros,
        # plus one element so an odd count always has a zero code to pair with
        work = torch.zeros(nblocks * bs + 1, device=flat.device)
        work[:n] = flat
        blocks = work[: nblocks * bs].view(nblocks, bs)
        mn, mx = torch.aminmax(blocks, dim=1) if n else (work[:0], work[:0])
        absmax = torch.maximum(mx, mn.neg())
        if n and not bool(torch.isfinite(absmax).all()):
            raise NonFiniteInputError("Blockwise4Bit input contains NaN or Inf")
        inv = torch.where(absmax > 0, self.LEVELS / absmax, torch.zeros_like(absmax))
        blocks.mul_(inv.unsqueeze(1)).round_().clamp_(-self.LEVELS, self.LEVELS)
        work.add_(self.LEVELS)  # codes -7..7 -> nibbles 0..14; padding becomes code 0
        nibbles = work[: n + n % 2].to(torch.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        _bytes.typed(buf, torch.float32, nblocks).copy_(absmax.cpu())
        _bytes.typed(buf, torch.uint8, packed.numel(), 4 * nblocks).copy_(packed.cpu())
        return buf, {"block": bs}

    @classmethod
    def _nblocks(cls, ct: CompressedTensor) -> int:
        return -(-ct.numel // meta_int(ct, "block", 1, cls.MAX_BLOCK))

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 4 * cls._nblocks(ct) + (ct.numel + 1) // 2)

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        nblocks = cls._nblocks(ct)
        absmax = _bytes.view(ct.payload, torch.float32, nblocks)
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise PayloadValueError("block scales must be finite and non-negative")
        packed = _bytes.view(ct.payload, torch.uint8, (ct.numel + 1) // 2, 4 * nblocks)
        if bool(((packed & 0xF) > 2 * cls.LEVELS).any() | ((packed >> 4) > 2 * cls.LEVELS).any()):
            raise PayloadValueError(f"4-bit codes must be in 0..{2 * cls.LEVELS}")

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        cls.check_content(ct)
        bs = meta_int(ct, "block", 1, cls.MAX_BLOCK)
        n, nblocks = ct.numel, cls._nblocks(ct)
        absmax = _bytes.view(ct.payload, torch.float32, nblocks).to(device)
        packed = _bytes.view(ct.payload, torch.uint8, (n + 1) // 2, 4 * nblocks).to(device)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:n]
        signed = torch.zeros(nblocks * bs, device=device)
        signed[:n] = codes.to(torch.float32) - cls.LEVELS
        signed = signed.view(nblocks, bs)
        scale = absmax.unsqueeze(1)
        out = signed * scale / cls.LEVELS
        # the extreme codes are exactly +-absmax (7 * a / 7 is not always a in float32)
        out = torch.where(signed == cls.LEVELS, scale, out)
        out = torch.where(signed == -cls.LEVELS, -scale, out)
        return out.view(-1)[:n]


__all__ += ["Blockwise4Bit"]
