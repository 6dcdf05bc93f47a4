"""8-bit quantizers: uniform (one affine range), quantile (learned codebook), blockwise.

All three reject NaN/+-Inf input with NonFiniteInputError: a non-finite value would poison
the range or the codebook of the whole tensor (or block), and under error feedback it would
sit in the residual forever. Statistics are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

from . import _bytes
from .base import (
    Codec,
    CompressedTensor,
    MetaValue,
    check_finite_scalar,
    expect_len,
    float32_flat,
    meta_float,
    meta_int,
)
from .errors import MalformedMessageError, NonFiniteInputError, PayloadValueError

_F32_MAX = float(torch.finfo(torch.float32).max)


def _aminmax(flat: torch.Tensor) -> tuple[float, float]:
    if flat.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(flat)  # one pass, no temporary; NaN/Inf propagate into lo/hi
    return check_finite_scalar(lo, "min"), check_finite_scalar(hi, "max")


def _decoded_on(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move (small, 1-byte) codes to the device first, then widen there."""
    return codes.to(device) if device.type != "cpu" else codes


class Uniform8Bit(Codec):
    """256 evenly spaced levels over ``[lo, hi]``: ``x ~ lo + code * step``.

    By default ``[lo, hi]`` is the tensor's exact min/max, so nothing is clipped. With
    ``clip_sigmas=c`` the range is narrowed to ``mean +- c*std`` (within min/max): finer steps
    for the bulk, clipped outliers (meant for use under error feedback, which resends them).
    """

    codec_id = 4

    def __init__(self, clip_sigmas: float | None = None):
        if clip_sigmas is not None and not clip_sigmas > 0:
            raise ValueError("clip_sigmas must be positive or None")
        self.clip_sigmas = clip_sigmas

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        flat = float32_flat(tensor)
        lo, hi = _aminmax(flat)
        if self.clip_sigmas is not None and flat.numel() > 1:
            std, mean = (float(v) for v in torch.std_mean(flat))
            lo, hi = max(lo, mean - self.clip_sigmas * std), min(hi, mean + self.clip_sigmas * std)
        step = (hi - lo) / 255.0
        if not step > 0 or not math.isfinite(step):  # constant tensor (or a degenerate range)
            step = 1.0
        buf = _bytes.writable(flat.numel())
        if flat.numel():
            q = torch.sub(flat, lo).mul_(1.0 / step).round_().clamp_(0.0, 255.0)
            torch.frombuffer(buf, dtype=torch.uint8).copy_(q)
        return buf, {"lo": lo, "step": step}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        lo = meta_float(ct, "lo")
        step = meta_float(ct, "step", positive=True)
        if abs(lo) + 255.0 * step > _F32_MAX:
            raise MalformedMessageError("uniform range exceeds float32")
        expect_len(ct, ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        lo, step = meta_float(ct, "lo"), meta_float(ct, "step", positive=True)
        codes = _decoded_on(_bytes.view(ct.payload, torch.uint8, ct.numel), device)
        return codes.to(torch.float32).mul_(step).add_(lo)


class Quantile8Bit(Codec):
    """256 levels fitted to the data: a 1-D Lloyd-Max (k-means) codebook from a sample.

    Levels start at the MSE-optimal point density for the sample's histogram (density of
    levels ~ p(x)^(1/3), Panter-Dite) and then move to the centroids of their cells for a
    few Lloyd iterations. Equal-probability (plain quantile) levels would be simpler, but
    their wide outermost bins dominate the error (2-3x worse on Gaussian data). The tensor's min and max are always in the sample. Codes are found
    through a 65536-cell lookup table plus one comparison per element (exact unless a cell
    holds more than ``_EDGES_PER_CELL`` bin edges), much faster than ``torch.bucketize``.
    Payload: 256 float32 levels, then one byte per value.
    """

    codec_id = 5
    _CELLS = 65536
    _EDGES_PER_CELL = 2

    def __init__(self, sample_size: int = 65536, iterations: int = 4, seed: int = 0):
        if sample_size < 256 or iterations < 0:
            raise ValueError("sample_size must be >= 256 and iterations >= 0")
        self.sample_size = sample_size
        self.iterations = iterations
        self._gen = torch.Generator().manual_seed(seed)

    def _codebook(self, flat: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        n = flat.numel()
        if n <= self.sample_size:
            sample = flat
        else:
            idx = torch.randint(n, (self.sample_size,), generator=self._gen).to(flat.device)
            sample = flat[idx]
        sample = torch.cat([sample, sample.new_tensor([lo, hi])])
        levels = _compander_levels(sample, lo, hi)
        for _ in range(self.iterations):
            edges = (levels[1:] + levels[:-1]) * 0.5
            cell = torch.bucketize(sample, edges)
            sums = torch.zeros(256, device=flat.device).index_add_(0, cell, sample)
            counts = torch.bincount(cell, minlength=256).float()
            levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels).sort().values
        return levels

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        flat = float32_flat(tensor)
        n = flat.numel()
        buf = _bytes.writable(256 * 4 + n)
        if n == 0:
            return buf, {}
        lo, hi = _aminmax(flat)
        levels = self._codebook(flat, lo, hi)
        _bytes.write(buf, 0, levels)
        codes = _assign(flat, levels, lo, hi, self._CELLS, self._EDGES_PER_CELL)
        torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=1024).copy_(codes)
        return buf, {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 1024 + ct.numel if ct.numel else 1024)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        if ct.numel == 0:
            return torch.empty(0, device=device)
        levels = _bytes.view(ct.payload, torch.float32, 256).to(device)
        if not bool(torch.isfinite(levels).all()):
            raise PayloadValueError("quantile codebook has non-finite levels")
        codes = _decoded_on(_bytes.view(ct.payload, torch.uint8, ct.numel, 1024), device)
        return levels.index_select(0, codes.to(torch.int32))


def _compander_levels(sample: torch.Tensor, lo: float, hi: float, bins: int = 4096):
    """256 levels spaced so that their density follows the sample density to the power 1/3."""
    hist = torch.histc(sample.cpu(), bins=bins, min=lo, max=hi).to(sample.device)
    cdf = torch.cumsum(hist.pow(1.0 / 3.0), 0)
    cdf = cdf / cdf[-1]
    targets = (torch.arange(256, dtype=torch.float32, device=sample.device) + 0.5) / 256
    pos = torch.searchsorted(cdf, targets).clamp_max(bins - 1)
    prev = torch.where(pos > 0, cdf[(pos - 1).clamp_min(0)], torch.zeros_like(targets))
    frac = ((targets - prev) / (cdf[pos] - prev).clamp_min(1e-12)).clamp(0.0, 1.0)
    return (lo + (pos.float() + frac) * ((hi - lo) / bins)).sort().values


def _assign(
    flat: torch.Tensor, levels: torch.Tensor, lo: float, hi: float, cells: int, per_cell: int
) -> torch.Tensor:
    """Index of the nearest level for every element, vectorized without a binary search.

    ``[lo, hi]`` is cut into ``cells`` equal cells; a table gives the code at each cell's
    left end and the first ``per_cell`` bin edges inside the cell, so each element costs one
    multiply, two gathers and ``per_cell`` comparisons.
    """
    device = flat.device
    edges = (levels[1:] + levels[:-1]) * 0.5  # 255 ascending decision boundaries
    width = (hi - lo) / cells
    if not width > 0:
        return torch.bucketize(flat, edges).to(torch.uint8)
    starts = lo + width * torch.arange(cells, dtype=torch.float64, device=device)
    base = torch.bucketize(starts.float(), edges, right=True)  # code at each cell's left end
    # the j-th edge after the cell start, +inf when it lies beyond the cell
    extra = []
    for j in range(per_cell):
        pos = (base + j).clamp_max(254)
        e = edges[pos]
        inside = ((base + j) <= 254) & (e < (starts + width).float())
        extra.append(torch.where(inside, e, torch.full_like(e, math.inf)))
    cell = torch.sub(flat, lo).mul_(1.0 / width).to(torch.int32).clamp_(0, cells - 1)
    codes = base.to(torch.int16).index_select(0, cell)
    for e in extra:
        codes += (flat >= e.index_select(0, cell)).to(torch.int16)
    return codes.to(torch.uint8)


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

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        flat = float32_flat(tensor)
        n, bs = flat.numel(), self.block_size
        nblocks = -(-n // bs)
        buf = _bytes.writable(4 * nblocks + n)
        full = n // bs
        scales = []
        codes_out = (
            torch.frombuffer(buf, dtype=torch.int8, count=n, offset=4 * nblocks) if n else None
        )
        for start, part in (
            (0, flat[: full * bs].view(full, bs)),
            (full * bs, flat[full * bs :].view(1, -1)),
        ):
            if part.numel() == 0:
                continue
            mn, mx = torch.aminmax(part, dim=1)
            absmax = torch.maximum(mx, mn.neg())
            if not bool(torch.isfinite(absmax).all()):
                raise NonFiniteInputError("Blockwise8Bit input contains NaN or Inf")
            inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
            q = (part * inv.unsqueeze(1)).round_()
            codes_out[start : start + part.numel()].copy_(q.view(-1))
            scales.append(absmax)
        if scales:
            _bytes.write(buf, 0, torch.cat(scales))
        return buf, {"block": bs}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        bs = meta_int(ct, "block", 1, cls.MAX_BLOCK)
        expect_len(ct, 4 * (-(-ct.numel // bs)) + ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        bs = meta_int(ct, "block", 1, cls.MAX_BLOCK)
        n = ct.numel
        nblocks = -(-n // bs)
        absmax = _bytes.view(ct.payload, torch.float32, nblocks).to(device)
        if not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise PayloadValueError("block scales must be finite and non-negative")
        codes = _decoded_on(_bytes.view(ct.payload, torch.int8, n, 4 * nblocks), device)
        out = codes.to(torch.float32)
        full = n // bs
        step = absmax * (1.0 / 127.0)
        out[: full * bs].view(full, bs).mul_(step[:full].unsqueeze(1))
        if n > full * bs:
            out[full * bs :].mul_(step[full])
        return out


__all__ = ["Uniform8Bit", "Quantile8Bit", "Blockwise8Bit"]
