"""Splitting a list of tensors into one contiguous part per reducing member, and back.

The tensors are treated as one flat float32 vector (the concatenation of their flattened
values, in order) without ever materialising that vector: :func:`gather` returns any range of
it as float32 (a view when the range lies in one float32 tensor, else a small copy), and :func:`scatter` writes a float32 range back into output
tensors of the original dtypes. So a round needs one output copy of the tensors, not three.

Part sizes come only from :class:`GroupInfo`, so every member computes the same split.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from moshpit.averaging.group_info import GroupInfo, GroupInfoError

ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class TensorLayout:
    """Shapes, dtypes and flat offsets of a tensor list (the flat vector's index space)."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # offsets[i] = flat index of tensor i's first element; len = n + 1

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> TensorLayout:
        offsets = [0]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if t.dtype not in ALLOWED_DTYPES:
                raise ValueError(
                    f"tensor {i} has dtype {t.dtype}; only floating tensors can be averaged"
                )
            offsets.append(offsets[-1] + t.numel())
        return cls(
            shapes=tuple(t.shape for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            offsets=tuple(offsets),
        )

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def _pieces(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """Yield (tensor index, start within tensor, end within tensor, flat start) covering [start, end)."""
        if not 0 <= start <= end <= self.numel:
            raise IndexError(f"range [{start}, {end}) outside a flat vector of {self.numel}")
        i = bisect.bisect_right(self.offsets, start) - 1
        pos = start
        while pos < end:
            t_end = self.offsets[i + 1]
            if t_end > pos:  # skips empty tensors
                stop = min(end, t_end)
                yield i, pos - self.offsets[i], stop - self.offsets[i], pos
                pos = stop
            i += 1


def single_view(
    tensors: Sequence[torch.Tensor], layout: TensorLayout, start: int, end: int
) -> torch.Tensor | None:
    """A view of flat range [start, end) if it lies inside one contiguous float32 CPU tensor."""
    pieces = list(layout._pieces(start, end))
    if len(pieces) != 1:
        return None
    i, lo, hi, _ = pieces[0]
    t = tensors[i]
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        return None
    view: torch.Tensor = t.detach().view(-1)[lo:hi]
    return view


def gather_copies(
    tensors: Sequence[torch.Tensor], layout: TensorLayout, start: int, end: int
) -> bool:
    """Whether :func:`gather` of this range copies (False: it returns a view, no work)."""
    return end > start and single_view(tensors, layout, start, end) is None


def gather(
    tensors: Sequence[torch.Tensor], layout: TensorLayout, start: int, end: int
) -> torch.Tensor:
    """Flat elements [start, end) of ``tensors`` as one float32 CPU tensor, to be read only.

    A view of the caller's tensor when the range lies inside one contiguous float32 CPU tensor
    (the common case: no copy), else a new tensor. Callers must never write into the result.
    """
    view = single_view(tensors, layout, start, end) if end > start else None
    if view is not None:
        return view
    out = torch.empty(end - start, dtype=torch.float32)
    for i, lo, hi, flat in layout._pieces(start, end):
        src = tensors[i].detach().reshape(-1)[lo:hi]
        out[flat - start : flat - start + hi - lo].copy_(src)
    return out


def scatter(
    values: torch.Tensor, outputs: Sequence[torch.Tensor], layout: TensorLayout, start: int
) -> None:
    """Write the float32 vector ``values`` into flat range [start, start + len) of ``outputs``.

    ``outputs`` must be contiguous (as made by :func:`empty_like_all`); values are cast to
    each output's dtype and device.
    """
    end = start + values.numel()
    for i, lo, hi, flat in layout._pieces(start, end):
        outputs[i].view(-1)[lo:hi].copy_(values[flat - start : flat - start + hi - lo])


def copy_range(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    layout: TensorLayout,
    start: int,
    end: int,
) -> None:
    """dst[start:end] = src[start:end] in flat coordinates (local values for a failed part)."""
    for i, lo, hi, _ in layout._pieces(start, end):
        dst[i].view(-1)[lo:hi].copy_(src[i].detach().reshape(-1)[lo:hi])


def empty_like_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous output tensors with the inputs' shapes, dtypes and devices."""
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]


def part_sizes(group: GroupInfo, total: int) -> list[int]:
    """Number of flat elements each member reduces (0 for client-mode members).

    A reducer's time is dominated by receiving and returning its part from every sender, so
    part sizes proportional to bandwidth equalise the reducers' times (minimising the slowest).
    Unknown bandwidths count as the mean of the known ones; all unknown -> equal parts. Sizes
    are integers summing to ``total``, rounded by largest remainder with ties to the lower index.
    """
    if total < 0:
        raise ValueError("total must be >= 0")
    reducers = group.reducer_indices
    if not reducers:
        raise GroupInfoError("the group has no member that can reduce (all are clients)")
    given = [group.bandwidths[i] for i in reducers]
    known = [b for b in given if b is not None]
    fill = sum(known) / len(known) if known else 1.0
    shares = [float(b) if b is not None else fill for b in given]
    norm = sum(shares)
    exact = [total * s / norm for s in shares]
    sizes = [int(x) for x in exact]
    remainder = total - sum(sizes)
    by_fraction = sorted(range(len(reducers)), key=lambda j: (-(exact[j] - sizes[j]), j))
    for j in by_fraction[:remainder]:
        sizes[j] += 1
    out = [0] * group.size
    for j, idx in enumerate(reducers):
        out[idx] = sizes[j]
    return out


def part_bounds(group: GroupInfo, total: int) -> list[tuple[int, int]]:
    """Flat [start, end) of each member's part, in group order (empty for clients)."""
    bounds, pos = [], 0
    for size in part_sizes(group, total):
        bounds.append((pos, pos + size))
        pos += size
    return bounds


MIN_CHUNK_NUMEL = 1 << 14  # 64 KiB of float32: smaller chunks cost more in per-message overhead
# Chunks per (sender, reducer) pair on vectors too small for full-size chunks: more chunks
# pipeline better on slow links (a shorter fill and drain), fewer cost less per-message CPU
# (sampling, message, decode setup per chunk; 16 made 8-bit rounds slower than gloo at 1 Gbit/s).
CHUNKS_PER_PEER = 8
# Where the members' stated links take a while to carry a round, more chunks per pair: the
# pipeline's fill and drain each take about one chunk per sender pair, L/c of a round whose
# transfers take L seconds with c chunks per pair, while every chunk costs each member
# ~2(s-1) messages of CPU at PER_MESSAGE_SECONDS each (measured: ~0.5 ms per extra message).
# L/c + 2(s-1)*p*c is smallest at c = sqrt(L / (2(s-1)p)); never fewer than CHUNKS_PER_PEER.
# Example, 4 x 4M values at 100 Mbit/s: uncompressed (L ~2 s) 26 per pair, 8-bit (0.5 s) 13,
# top-k 8. The benchmark behind it (bench_wan.py, against gloo and fixed 8 or 24 per pair) is
# in CHANGELOG.md.
PER_MESSAGE_SECONDS = 0.5e-3
MAX_CHUNKS_PER_PEER = 32


def chunks_per_pair(link_seconds: float | None, num_senders: int) -> int:
    """How many chunks each (sender, reducer) pair should carry (see PER_MESSAGE_SECONDS)."""
    if link_seconds is None or not math.isfinite(link_seconds) or link_seconds <= 0:
        return CHUNKS_PER_PEER
    best = math.sqrt(link_seconds / (2 * max(1, num_senders - 1) * PER_MESSAGE_SECONDS))
    return max(CHUNKS_PER_PEER, min(MAX_CHUNKS_PER_PEER, round(best)))


def chunk_numel_for(
    total: int, num_senders: int, max_chunk_numel: int, *, link_seconds: float | None = None
) -> int:
    """Chunk size for a round: ``max_chunk_numel`` for big vectors, smaller for small ones,
    and smaller still where ``link_seconds`` (:func:`round_link_seconds`) says the round's
    transfers are long (:func:`chunks_per_pair`).

    Small vectors would otherwise be one chunk per part (no pipelining, and the chunks in
    flight would be several times the vector). Deterministic in its arguments, which every
    member knows (the link estimate comes from the group's GroupInfo), so all members chunk
    every part identically.
    """
    per_pair = chunks_per_pair(link_seconds, num_senders)
    wanted = -(-total // (per_pair * max(1, num_senders - 1)))
    return max(1, min(max_chunk_numel, max(MIN_CHUNK_NUMEL, wanted)))


def round_link_seconds(
    group: GroupInfo,
    total: int,
    *,
    unknown_bytes_per_value: float | None = None,
    measured: bool = False,
) -> float | None:
    """About how long a round of ``total`` values keeps the group's slowest stated link busy.

    Each member sends about ``2 (s-1)/s`` of the vector (chunks out, results back) for ``s``
    senders, at the densest codec any member reported (``bytes_per_value``) over the smallest
    bandwidth any member stated. None where nobody stated a bandwidth, or nobody reported a
    density and ``unknown_bytes_per_value`` (what to assume then) is None: the caller then
    assumes nothing about the links. With ``measured``, a member that stated no bandwidth
    counts with the rate its recent rounds reached (``GroupInfo.measured_uplinks``): a
    lower bound, right for a time allowance, but not for chunk sizes or pacing, where the
    CPU-bound rate of a fast link would pass for a slow link.
    """
    seen = group.measured_uplinks if measured and group.measured_uplinks else group.bandwidths
    known = (b if b is not None else m for b, m in zip(group.bandwidths, seen, strict=True))
    rates = [float(rate) for rate in known if rate is not None]
    densities = [float(b) for b in group.bytes_per_value if b is not None]
    if not densities and unknown_bytes_per_value is not None:
        densities = [unknown_bytes_per_value]
    senders = len(group.sender_indices)
    if not rates or not densities or senders < 2:
        return None
    sent = 2 * total * (senders - 1) / senders * max(densities)
    return sent / min(rates)


def chunk_bounds(start: int, end: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Split [start, end) into consecutive chunks of at most ``chunk_numel`` elements."""
    if chunk_numel <= 0:
        raise ValueError("chunk_numel must be positive")
    return [(s, min(s + chunk_numel, end)) for s in range(start, end, chunk_numel)]
