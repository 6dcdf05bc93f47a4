"""How a reducer combines the senders' versions of one chunk of its part.

An :class:`Aggregator` is a strategy; for every chunk the reducer calls :meth:`Aggregator.begin`
and feeds the validated float32 contributions to the returned :class:`ChunkAggregation`:

- :class:`WeightedMean` (default) accumulates in place (one chunk-sized buffer, whatever the
  number of senders): the exact weighted mean, but one sender can move it arbitrarily far.
- :class:`ClippedMean` clips every coordinate to ``[median - tau, median + tau]`` (coordinate-wise
  median of the senders) before the weighted mean; with a minority of bad senders the result stays
  within ``tau`` of the honest senders' range.
- :class:`CenteredClip` (Karimireddy, He, Jaggi 2021) iterates
  ``v += sum_i w_i clip_tau(x_i - v) / sum_i w_i`` from the coordinate-wise median; each
  iteration lets a sender of weight share ``d`` move ``v`` by at most ``d * tau`` (L2 norm over
  the chunk).

The robust ones keep every sender's chunk until the chunk is complete; chunks are bounded
(``chunk_numel`` x senders x chunks in flight), so this is bounded too. Every strategy also
reports the chunk's weighted deviation ``sum_i w_i ||x_i - r||^2 / sum_i w_i`` around its
result ``r``, which adaptive averaging periods (ADPSGD) use.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


class ChunkAggregation(ABC):
    """Combines the contributions to one chunk; not thread-safe (one task feeds it)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.count = 0
        self.total_weight = 0.0

    @abstractmethod
    def add(self, values: torch.Tensor, weight: float) -> None:
        """Add one sender's validated float32 vector of length ``numel`` with weight >= 0."""

    @abstractmethod
    def result(self) -> tuple[torch.Tensor, float] | None:
        """(aggregate, weighted deviation), or None if no contribution had positive weight."""

    def add_cost(self) -> int:
        """Rough work of one :meth:`add` in element-passes (decides thread vs inline)."""
        return 2 * self.numel

    def result_cost(self) -> int:
        """Rough work of :meth:`result` in element-passes."""
        return 2 * self.numel


class Aggregator(ABC):
    """A strategy for combining senders' chunks; stateless, shared by all chunks of a round."""

    @abstractmethod
    def begin(self, numel: int) -> ChunkAggregation: ...


class _MeanChunk(ChunkAggregation):
    def __init__(self, numel: int) -> None:
        super().__init__(numel)
        self.acc: torch.Tensor | None = None  # made by the first add (no zero-fill pass)
        self.sq = 0.0  # sum_i w_i ||x_i||^2, for the deviation without keeping the x_i

    def add(self, values: torch.Tensor, weight: float) -> None:
        self.count += 1
        if weight <= 0:
            return
        if self.acc is None:  # a new buffer: ``values`` may be a read-only view
            self.acc = torch.mul(values, weight)
        else:
            self.acc.add_(values, alpha=weight)
        self.sq += weight * float(torch.dot(values, values))
        self.total_weight += weight

    def result(self) -> tuple[torch.Tensor, float] | None:
        if self.total_weight <= 0 or self.acc is None:
            return None
        mean = self.acc.div_(self.total_weight)
        # sum w||x - m||^2 = sum w||x||^2 - W||m||^2; rounding can make it slightly negative
        deviation = max(0.0, self.sq / self.total_weight - float(torch.dot(mean, mean)))
        return mean, deviation


class WeightedMean(Aggregator):
    """The exact weighted mean, accumulated in place as contributions arrive."""

    def begin(self, numel: int) -> ChunkAggregation:
        return _MeanChunk(numel)


class _StoredChunk(ChunkAggregation):
    """Keeps all contributions; subclasses compute a robust center from them."""

    def __init__(self, numel: int, combine) -> None:
        super().__init__(numel)
        self.values: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.combine = combine

    def add_cost(self) -> int:
        return 0  # keeps a reference

    def result_cost(self) -> int:
        # stack, median (a sort per coordinate), clipping iterations: many passes per sender
        return 16 * self.numel * max(1, len(self.values))

    def add(self, values: torch.Tensor, weight: float) -> None:
        self.count += 1
        if weight <= 0:
            return
        self.values.append(values)
        self.weights.append(weight)
        self.total_weight += weight

    def result(self) -> tuple[torch.Tensor, float] | None:
        if self.total_weight <= 0:
            return None
        xs = torch.stack(self.values)  # [senders, numel]
        ws = torch.tensor(self.weights, dtype=torch.float32)
        self.values.clear()
        center = self.combine(xs, ws)
        deviation = float((ws * (xs - center).pow(2).sum(dim=1)).sum()) / self.total_weight
        return center, deviation


def _check_tau(tau: float) -> float:
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite positive number, got {tau!r}")
    return float(tau)


class ClippedMean(Aggregator):
    """Coordinate-wise: clip to ``median +- tau``, then the weighted mean.

    The median is unweighted (a weight is a claim by the sender, so it must not buy influence over
    the center). Result per coordinate lies in ``[median - tau, median + tau]``.
    """

    def __init__(self, tau: float) -> None:
        self.tau = _check_tau(tau)

    def _combine(self, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        median = xs.median(dim=0).values
        clipped = torch.maximum(torch.minimum(xs, median + self.tau), median - self.tau)
        return (clipped * ws[:, None]).sum(dim=0) / ws.sum()

    def begin(self, numel: int) -> ChunkAggregation:
        return _StoredChunk(numel, self._combine)


class CenteredClip(Aggregator):
    """Iterative clipping around a center (CenteredClip), starting from the coordinate median."""

    def __init__(self, tau: float, iterations: int = 5) -> None:
        self.tau = _check_tau(tau)
        if not (isinstance(iterations, int) and 1 <= iterations <= 1000):
            raise ValueError("iterations must be an int in 1..1000")
        self.iterations = iterations

    def _combine(self, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        v = xs.median(dim=0).values
        share = ws / ws.sum()
        for _ in range(self.iterations):
            diff = xs - v
            norms = diff.norm(dim=1).clamp_min(1e-30)
            scale = torch.clamp(self.tau / norms, max=1.0) * share
            v = v + (diff * scale[:, None]).sum(dim=0)
        return v

    def begin(self, numel: int) -> ChunkAggregation:
        return _StoredChunk(numel, self._combine)
