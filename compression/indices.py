"""Index sets: sampling positions of a big tensor, and sorted unique indices on the wire.

On the wire an index set is the bit-packed gaps between consecutive indices: at density 1e-3
gaps need ~10-14 bits instead of 32 (int32) or 64 (int64). Decoding yields strictly
increasing indices by construction, so only the last one needs a range check.
"""

from __future__ import annotations

import torch

from . import _bytes
from .base import CompressedTensor
from .errors import PayloadValueError


def pack_indices(indices: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sorted unique indices -> (bit-packed gaps as uint8, bits per gap)."""
    if indices.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=indices.device), 0
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1
    width = int(gaps.max()).bit_length()
    return _bytes.pack_uint(gaps, width), width


def unpack_indices(ct: CompressedTensor, count: int, width: int, offset: int) -> torch.Tensor:
    """The ``count`` indices packed at byte ``offset`` of ``ct.payload``, as CPU int64.

    Raises PayloadValueError if any index is outside ``range(ct.numel)``; callers have
    checked the payload length against ``count`` and ``width`` already.
    """
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    nbytes = _bytes.packed_bits_nbytes(count * width)
    packed = _bytes.view(ct.payload, torch.uint8, nbytes, offset)
    gaps = _bytes.unpack_uint(packed, count, width)
    indices = torch.cumsum(gaps + 1, 0) - 1  # strictly increasing: unique by design
    last = int(indices[-1])
    if last >= ct.numel:
        raise PayloadValueError(f"index {last} out of range for {ct.numel} values")
    return indices


_RUN = 64


def sample_runs(values: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    """About ``m`` entries of a flat tensor: runs of 64 consecutive values at uniformly
    random offsets.

    Runs cost one cache miss per 16 values instead of one per value (random single-element
    gathers from a large tensor dominated TopK's selection time), while still covering the
    whole tensor.
    """
    n = values.numel()
    if n < 16 * _RUN:
        return values[torch.randint(n, (m,), generator=generator).to(values.device)]
    starts = torch.randint(n - _RUN + 1, (max(1, m // _RUN), 1), generator=generator)
    idx = (starts + torch.arange(_RUN)).view(-1)
    return values[idx.to(values.device)]


def sparse_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Sorted int64 positions of the True entries of a contiguous 1-D bool tensor.

    Same result as ``torch.nonzero(mask).squeeze(1)``, faster when hits are rare: the mask is
    scanned as int64 words (8 flags each), and only words with a hit are expanded.
    """
    n = mask.numel()
    n8 = n // 8
    if n8 == 0 or mask.storage_offset() % 8:
        return torch.nonzero(mask).squeeze(1)
    words = mask[: n8 * 8].view(torch.uint8).view(torch.int64)
    hot = torch.nonzero(words).squeeze(1)
    if hot.numel() > n8 // 8:  # not sparse after all: the plain scan is cheaper
        return torch.nonzero(mask).squeeze(1)
    local = torch.nonzero(mask[: n8 * 8].view(n8, 8)[hot])
    found = hot[local[:, 0]] * 8 + local[:, 1]
    if n > n8 * 8:
        tail = torch.nonzero(mask[n8 * 8 :]).squeeze(1) + n8 * 8
        found = torch.cat([found, tail])
    return found
