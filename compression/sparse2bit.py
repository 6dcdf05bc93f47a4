"""TopK2Bit: the largest ``density`` fraction of every chunk, each kept value in 2 bits.

For pseudo-gradients over home uplinks (SparseLoCo-style: chunked top-k, 2-bit values, error
feedback). The flat tensor is cut into chunks of ``chunk`` values (the last one may be
shorter); every chunk keeps its ``k`` entries of largest magnitude (a short last chunk keeps
proportionally fewer, at least one) and sends, for each, one of four values: ``+-lo`` or
``+-hi``, two float32 magnitudes per chunk.

Why sign plus one of two magnitudes, fitted per chunk: the kept entries are a chunk's largest,
so they are never near zero and a level at 0 (as in a symmetric 4-level grid) would waste a
code; their magnitudes span ``[t, max]`` for the chunk's k-th magnitude ``t``, and the two
magnitudes that minimize the squared error of that set (exact 1-D 2-means on the sorted
magnitudes: the best split of a sorted list, each side replaced by its mean) adapt to both
flat and heavy-tailed chunks. A chunk's largest value alone in its group comes back exactly.
The second float per chunk costs 32/chunk bits per value (0.008 at 4096).

Indices travel as the gaps between the sorted positions inside each chunk (the first from the
chunk's start), bit-packed at the width of the largest gap; that width is at most
log2(chunk) (what plain within-chunk offsets would need) and ~2-3 bits less at densities of
1-3%. Where a bitmap of the whole tensor (1 bit per value) is smaller (densities above ~15%),
that is sent instead. Either way duplicate or unsorted positions cannot be expressed: a gap
adds at least 1, a bitmap marks a position once. What can be wrong in a payload, positions
past the end of their chunk, a bitmap chunk with the wrong count, non-finite, negative or
swapped magnitudes, is a :class:`PayloadValueError` naming the chunk.

Payload (little-endian): ``(lo, hi)`` float32 per chunk; 2-bit codes, four per byte, first in
the low bits (bit 0: negative, bit 1: ``hi``), in ascending position order; then the packed
gaps (``width`` bits each, one per kept value) or the bitmap (``ceil(n / 8)`` bytes, least
significant bit first). Meta: ``chunk``, ``k``, ``width``, ``bitmap`` (0 or 1).
"""

from __future__ import annotations

import torch

from . import _bytes
from .base import Codec, CompressedTensor, MetaValue, expect_len, meta_int
from .errors import MalformedMessageError, PayloadValueError
from .sparse import _check_finite


def tail_count(k: int, chunk: int, tail: int) -> int:
    """Entries a last chunk of ``tail`` (< ``chunk``) values keeps: ``k`` pro rata, rounded
    up, so a non-empty chunk keeps at least one (0 for an empty tail)."""
    return 0 if tail <= 0 else min(tail, -(-k * tail // chunk))


def _layout(n: int, chunk: int, k: int) -> tuple[int, int, int, int]:
    """(full chunks, tail length, tail count, kept values) of an ``n``-value tensor."""
    nfull, tail = divmod(n, chunk)
    kt = tail_count(k, chunk, tail)
    return nfull, tail, kt, nfull * k + kt


def _two_means(mags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of descending magnitudes: (lo, hi, count in the hi group) minimizing the
    squared error of replacing each magnitude by its group's mean.

    For sorted data the optimal 2-level quantizer splits the list once; the split maximizes
    ``S_hi^2 / j + S_lo^2 / (k - j)`` (the total sum of squares minus the SSE), computed for
    every ``j`` from prefix sums (float64: exact enough for thousands of values).
    """
    rows, k = mags.shape
    a = mags.to(torch.float64)
    prefix = a.cumsum(1)
    total = prefix[:, -1:]
    j = torch.arange(1, k + 1, dtype=torch.float64, device=a.device)
    rest = (k - j).clamp_min(1.0)
    low = total - prefix
    gain = prefix.square() / j + torch.where(j < k, low.square() / rest, 0.0)
    best = gain.argmax(1, keepdim=True)  # first maximum: deterministic
    nhi = best + 1
    hi = prefix.gather(1, best) / nhi
    nlo = k - nhi
    lo = torch.where(nlo > 0, low.gather(1, best) / nlo.clamp_min(1), hi)
    hi32, lo32 = hi.float(), lo.float()
    # mean of the smaller magnitudes <= mean of the larger; rounding must not swap them
    return torch.minimum(lo32, hi32).squeeze(1), hi32.squeeze(1), nhi.squeeze(1)


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a (rows, length) float32 block: ((rows, 2) lo/hi scales, (rows, k) uint8 codes,
    (rows, k) ascending int64 offsets of the kept entries)."""
    top = torch.topk(rows.abs(), k, dim=1, sorted=True)  # descending magnitudes
    lo, hi, nhi = _two_means(top.values)
    rank = torch.arange(k, device=rows.device)
    is_hi = rank.unsqueeze(0) < nhi.unsqueeze(1)
    offsets, order = top.indices.sort(dim=1)  # codes travel in position order
    is_hi = is_hi.gather(1, order)
    negative = rows.gather(1, offsets) < 0
    codes = negative.to(torch.uint8) | (is_hi.to(torch.uint8) << 1)
    return torch.stack([lo, hi], dim=1), codes, offsets


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (uint8 0..3) -> bytes, four per byte, the first in the low bits."""
    m = codes.numel()
    padded = torch.zeros(-(-m // 4) * 4, dtype=torch.uint8, device=codes.device)
    padded[:m] = codes
    q = padded.view(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def _unpack2(packed: torch.Tensor, m: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).view(-1)[:m]


class TopK2Bit(Codec):
    """Top ``density`` of every ``chunk`` values, as sign + one of two per-chunk magnitudes.

    ``k = max(1, round(density * chunk))`` per full chunk; the last, shorter chunk keeps
    ``ceil(k * length / chunk)``. About ``density * (2 + gap bits) + 64 / chunk`` bits per
    value: 0.13 at density 0.01 and 4096-value chunks (docs/compression.md). Meant to run
    under error feedback, which carries what a round did not send into the next.
    """

    codec_id = 11
    MAX_CHUNK = 1 << 20

    def __init__(self, density: float = 0.02, chunk: int = 4096):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if not 1 <= chunk <= self.MAX_CHUNK or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two in [1, {self.MAX_CHUNK}], got {chunk}")
        self.density = density
        self.chunk = chunk
        self.k = min(chunk, max(1, round(density * chunk)))

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        _check_finite(flat)  # also refuses float64 beyond the float32 range
        if flat.dtype != torch.float32:
            flat = flat.float()
        n, c, k = flat.numel(), self.chunk, self.k
        nfull, tail, kt, m = _layout(n, c, k)
        nchunks = nfull + (tail > 0)
        device = flat.device
        scales = torch.empty(nchunks, 2, device=device)
        codes = torch.empty(m, dtype=torch.uint8, device=device)
        offsets = torch.empty(m, dtype=torch.int64, device=device)
        per = max(1, _bytes.slice_elems(device) // c)  # rows per slice: bounded temporaries
        # (first row, rows, first kept value, kept per row) of each slice, then the tail
        blocks = [(r, min(per, nfull - r), r * k, k) for r in range(0, nfull, per)]
        if kt:
            blocks.append((nfull, 1, nfull * k, kt))
        for row, count, first, kept in blocks:
            length = c if row < nfull else tail
            s, q, o = _select(flat[row * c : row * c + count * length].view(count, length), kept)
            scales[row : row + count] = s
            codes[first : first + count * kept] = q.view(-1)
            offsets[first : first + count * kept] = o.view(-1)
        # gaps inside each chunk: the first from the chunk's start; chunk j's kept values
        # start at j * k (the tail's too, as it keeps at most k)
        prev = torch.zeros(m, dtype=torch.int64, device=device)
        if m:
            prev[1:] = offsets[:-1] + 1
            prev[::k] = 0
        gaps = offsets - prev
        width = int(gaps.max()).bit_length() if m else 0
        gap_bytes = _bytes.packed_bits_nbytes(m * width)
        bitmap = _bytes.packed_bits_nbytes(n) < gap_bytes
        index_bytes = _bytes.packed_bits_nbytes(n) if bitmap else gap_bytes
        code_bytes = -(-m // 4)
        buf = _bytes.alloc(8 * nchunks + code_bytes + index_bytes)
        _bytes.typed(buf, torch.float32, 2 * nchunks).copy_(scales.view(-1))
        buf[8 * nchunks : 8 * nchunks + code_bytes].copy_(_pack2(codes))
        at = 8 * nchunks + code_bytes
        if bitmap:
            chunk_of = torch.arange(m, device=device) // k
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            mask[chunk_of * c + offsets] = True
            buf[at:].copy_(_bytes.pack_bits(mask))
            width = 0
        elif gap_bytes:
            buf[at:].copy_(_bytes.pack_uint(gaps, width))
        return buf, {"chunk": c, "k": k, "width": width, "bitmap": int(bitmap)}

    @staticmethod
    def _meta(ct: CompressedTensor) -> tuple[int, int, int, int]:
        """(chunk, k, width, bitmap), validated."""
        c = meta_int(ct, "chunk", 1, TopK2Bit.MAX_CHUNK)
        if c & (c - 1):
            raise MalformedMessageError(f"meta['chunk']={c} must be a power of two")
        k = meta_int(ct, "k", 1, c)
        width = meta_int(ct, "width", 0, (c - 1).bit_length())
        bitmap = meta_int(ct, "bitmap", 0, 1)
        if bitmap and width:
            raise MalformedMessageError("a bitmap message has no gap width (meta['width'] 0)")
        return c, k, width, bitmap

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        c, k, width, bitmap = cls._meta(ct)
        n = ct.numel
        nfull, tail, _, m = _layout(n, c, k)
        index_bytes = _bytes.packed_bits_nbytes(n if bitmap else m * width)
        expect_len(ct, 8 * (nfull + (tail > 0)) + -(-m // 4) + index_bytes)

    @classmethod
    def parse(cls, ct: CompressedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ascending int64 positions, uint8 codes, (chunks, 2) float32 lo/hi) of a validated
        message, on the CPU. Raises PayloadValueError for content the encoder never produces;
        ``from_msg`` and every decode call it, so a locally built message is checked too."""
        c, k, width, bitmap = cls._meta(ct)
        n = ct.numel
        nfull, tail, kt, m = _layout(n, c, k)
        nchunks = nfull + (tail > 0)
        scales = _bytes.view(ct.payload, torch.float32, 2 * nchunks).view(nchunks, 2)
        bad = ~(torch.isfinite(scales).all(1) & (scales[:, 0] >= 0) & (scales[:, 0] <= scales[:, 1]))
        if nchunks and bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            lo, hi = (float(v) for v in scales[i])
            raise PayloadValueError(
                f"chunk {i}: magnitudes lo={lo!r}, hi={hi!r} must be finite with 0 <= lo <= hi"
            )
        code_bytes = -(-m // 4)
        packed = _bytes.view(ct.payload, torch.uint8, code_bytes, 8 * nchunks)
        codes = _unpack2(packed, m)
        at = 8 * nchunks + code_bytes
        if bitmap:
            positions = cls._from_bitmap(ct, at, c, k, nfull, tail, kt)
        else:
            positions = cls._from_gaps(ct, at, c, k, width, nfull, tail, kt)
        return positions, codes, scales

    @staticmethod
    def _from_gaps(ct, at, c, k, width, nfull, tail, kt) -> torch.Tensor:
        m = nfull * k + kt
        packed = _bytes.view(ct.payload, torch.uint8, _bytes.packed_bits_nbytes(m * width), at)
        gaps = _bytes.unpack_uint(packed, m, width) if width else torch.zeros(m, dtype=torch.int64)
        full = (gaps[: nfull * k].view(nfull, k) + 1).cumsum(1) - 1  # strictly increasing
        if nfull and bool((full[:, -1] >= c).any()):
            i = int((full[:, -1] >= c).nonzero()[0, 0])
            raise PayloadValueError(
                f"chunk {i}: position {int(full[i, -1])} past the chunk's {c} values "
                f"(index {i * c + int(full[i, -1])} out of range)"
            )
        last = (gaps[nfull * k :] + 1).cumsum(0) - 1
        if kt and int(last[-1]) >= tail:
            raise PayloadValueError(
                f"chunk {nfull}: position {int(last[-1])} past the last chunk's {tail} values "
                f"(index {nfull * c + int(last[-1])} out of range for {ct.numel})"
            )
        starts = torch.arange(nfull, dtype=torch.int64).unsqueeze(1) * c
        return torch.cat([(full + starts).view(-1), last + nfull * c])

    @staticmethod
    def _from_bitmap(ct, at, c, k, nfull, tail, kt) -> torch.Tensor:
        n = ct.numel
        packed = _bytes.view(ct.payload, torch.uint8, _bytes.packed_bits_nbytes(n), at)
        bits = _bytes.unpack_bits(packed, n)
        counts = bits[: nfull * c].view(nfull, c).sum(1, dtype=torch.int64)
        if nfull and bool((counts != k).any()):
            i = int((counts != k).nonzero()[0, 0])
            raise PayloadValueError(f"chunk {i} marks {int(counts[i])} positions, expected {k}")
        got = int(bits[nfull * c :].sum(dtype=torch.int64))
        if got != kt:
            raise PayloadValueError(f"chunk {nfull} marks {got} positions, expected {kt}")
        return bits.nonzero().squeeze(1)

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        cls.parse(ct)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        positions, codes, scales = cls.parse(ct)
        out = torch.zeros(ct.numel, device=device)
        if positions.numel():
            c = ct.meta["chunk"]
            level = scales.reshape(-1)[(positions // c) * 2 + (codes >> 1).to(torch.int64)]
            values = torch.where((codes & 1).bool(), -level, level)
            out[positions.to(device)] = values.to(device)
        return out


__all__ = ["TopK2Bit", "tail_count"]
