"""How a reducer combines the senders' versions of one chunk of its part.

An :class:`Aggregator` is a strategy; for every chunk the reducer calls :meth:`Aggregator.begin`
and feeds the validated float32 contributions to the returned :class:`ChunkAggregation`:

- :class:`WeightedMean` (default) accumulates in place (one chunk-sized buffer, whatever the
  number of senders): the exact weighted mean, but one sender can move it arbitrarily far.
- :class:`ClippedMean` clips every coordinate to ``[median - tau, median + tau]`` (coordinate-wise
  median of the senders) before the weighted mean; with a minority of bad senders the result stays
  within ``tau`` of the honest senders' range.
- :class:`TrimmedMean` drops, per coordinate, the ``trim`` fraction of the largest and of the
  smallest values and averages the rest; :class:`Median` takes the coordinate-wise median.
  Both ignore the senders' weights (a weight is an unverified claim: a member declaring
  weight 1e9 would otherwise own the result), except that weight 0 contributes nothing.
- :class:`CenteredClip` (Karimireddy, He, Jaggi 2021) iterates
  ``v += sum_i w_i clip_tau(x_i - v) / sum_i w_i`` from the coordinate-wise median; each
  iteration lets a sender of weight share ``d`` move ``v`` by at most ``d * tau`` (L2 norm over
  the chunk).

The robust ones keep every sender's chunk until the chunk is complete; chunks are bounded
(``chunk_numel`` x senders x chunks in flight), so this is bounded too. Every strategy also
reports the chunk's weighted deviation ``sum_i w_i ||x_i - r||^2 / sum_i w_i`` around its
result ``r``, which adaptive averaging periods (ADPSGD) use.

Overflow: finite float32 inputs must never produce an Inf deviation (receivers would reject
an honest reducer's result). Squared norms are taken in float32 and redone in float64 when
they overflow (rare: only for values above ~1e17), and the robust strategies compute in
float64. The weighted sum itself cannot overflow when the weights sum to at most 1, which
the reducer guarantees by passing normalised weights (see ``allreduce_reducer``); a result
can still be non-finite after the cast back to float32 in corner cases (values near the
float32 maximum, or a ``tau`` that pushes the center out of range), so the reducer checks
every result before it is sent or written.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from moshpit.averaging.errors import AveragingError


class NonFiniteContribution(AveragingError, ValueError):
    """A contribution holds NaN or +-Inf; :meth:`ChunkAggregation.add` changed nothing."""


class ChunkAggregation(ABC):
    """Combines the contributions to one chunk; not thread-safe (one task feeds it).

    ``add`` is also the reducer's NaN/Inf check of received chunks (the weighted mean gets it
    for free from the squared norm it computes anyway, saving a pass over every chunk).
    """

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.count = 0
        self.contributors = 0  # contributions with positive weight (the result's "n")
        self.total_weight = 0.0

    @abstractmethod
    def add(self, values: torch.Tensor, weight: float) -> None:
        """Add one sender's float32 vector of length ``numel`` with weight >= 0; raises
        :class:`NonFiniteContribution` (and adds nothing) if it holds NaN or +-Inf."""

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


def _check_finite(values: torch.Tensor) -> None:
    if values.numel() and not math.isfinite(float(values.sum())):  # fast path: see all_finite
        lo, hi = torch.aminmax(values)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            raise NonFiniteContribution("chunk contains NaN or Inf")


def squared_norm(values: torch.Tensor) -> float:
    """``||values||^2`` as a Python float that is finite for every finite float32 input.

    The float32 dot product overflows once the sum of squares passes ~3.4e38 (elements of
    ~1e17 suffice); only then is it recomputed in float64 (max ~1e93 for 2^24 elements of
    float32's maximum), so the common case keeps the fast float32 kernel.
    """
    sq = float(torch.dot(values, values))
    if math.isfinite(sq):
        return sq
    return float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2


class _MeanChunk(ChunkAggregation):
    def __init__(self, numel: int) -> None:
        super().__init__(numel)
        self.acc: torch.Tensor | None = None  # made by the first add (no zero-fill pass)
        self.sq = 0.0  # sum_i w_i ||x_i||^2, for the deviation without keeping the x_i

    def add(self, values: torch.Tensor, weight: float) -> None:
        if weight <= 0:
            _check_finite(values)
            self.count += 1
            return
        # ||x||^2 is NaN/Inf exactly when x holds NaN/Inf (squared_norm redoes an overflow in
        # float64): the finiteness check of the chunk, before anything is added
        sq = squared_norm(values)
        if not math.isfinite(sq):
            raise NonFiniteContribution("chunk contains NaN or Inf")
        self.count += 1
        if self.acc is None:  # a new buffer: ``values`` may be a read-only view
            self.acc = torch.mul(values, weight)
        else:
            self.acc.add_(values, alpha=weight)
        self.sq += weight * sq
        self.total_weight += weight
        self.contributors += 1

    def result(self) -> tuple[torch.Tensor, float] | None:
        if self.total_weight <= 0 or self.acc is None:
            return None
        mean = self.acc.div_(self.total_weight)
        # sum w||x - m||^2 = sum w||x||^2 - W||m||^2; rounding can make it slightly negative
        deviation = max(0.0, self.sq / self.total_weight - squared_norm(mean))
        return mean, deviation


class WeightedMean(Aggregator):
    """The exact weighted mean, accumulated in place as contributions arrive."""

    def begin(self, numel: int) -> ChunkAggregation:
        return _MeanChunk(numel)


class _StoredChunk(ChunkAggregation):
    """Keeps all contributions; subclasses compute a robust center from them."""

    def __init__(
        self, numel: int, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__(numel)
        self.values: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.combine = combine

    def add_cost(self) -> int:
        return self.numel // 4  # the NaN/Inf check; keeps a reference

    def result_cost(self) -> int:
        # stack, median (a sort per coordinate), clipping iterations: many passes per sender
        return 16 * self.numel * max(1, len(self.values))

    def add(self, values: torch.Tensor, weight: float) -> None:
        _check_finite(values)
        self.count += 1
        if weight <= 0:
            return
        self.values.append(values)
        self.weights.append(weight)
        self.total_weight += weight
        self.contributors += 1

    def result(self) -> tuple[torch.Tensor, float] | None:
        if self.total_weight <= 0:
            return None
        # float64: differences of finite float32 values (up to 2 x 3.4e38) and their squares
        # overflow float32, which would turn a finite center into NaN or the deviation into Inf
        xs = torch.stack(self.values).to(torch.float64)  # [senders, numel]
        ws = torch.tensor(self.weights, dtype=torch.float64)
        self.values.clear()
        center = self.combine(xs, ws)
        deviation = float((ws * (xs - center).pow(2).sum(dim=1)).sum()) / self.total_weight
        return center.to(torch.float32), deviation


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


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean: per coordinate, the ``floor(trim * n)`` largest and as
    many smallest of the ``n`` contributions are dropped and the rest averaged, unweighted.

    With ``b`` bad senders and ``b <= floor(trim * n)``, every result lies within the honest
    senders' range on each coordinate. Costs a sort per coordinate over the senders.
    """

    def __init__(self, trim: float = 0.2) -> None:
        if not (isinstance(trim, (int, float)) and 0 <= trim < 0.5):
            raise ValueError(f"trim must be a fraction in [0, 0.5), got {trim!r}")
        self.trim = float(trim)

    def _combine(self, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        del ws  # unweighted on purpose (module doc)
        n = xs.shape[0]
        cut = min(int(self.trim * n), (n - 1) // 2)
        if cut == 0:
            return xs.mean(dim=0)
        ordered = xs.sort(dim=0).values
        return ordered[cut : n - cut].mean(dim=0)

    def begin(self, numel: int) -> ChunkAggregation:
        return _StoredChunk(numel, self._combine)


class Median(Aggregator):
    """Coordinate-wise median (the mean of the two middle values for an even count),
    unweighted: one bad sender among three or more cannot move it outside the honest range."""

    def _combine(self, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        del ws
        n = xs.shape[0]
        ordered = xs.sort(dim=0).values
        if n % 2:
            return ordered[n // 2]
        return (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def begin(self, numel: int) -> ChunkAggregation:
        return _StoredChunk(numel, self._combine)


AGGREGATIONS = ("mean", "trimmed_mean", "median")


def make_aggregator(spec: str | Aggregator | None) -> Aggregator | None:
    """``Averager(aggregation=...)``: a name of :data:`AGGREGATIONS` or an :class:`Aggregator`
    (e.g. ``TrimmedMean(0.3)``, ``CenteredClip(tau)``); None or "mean" is the weighted mean."""
    if spec is None or spec == "mean":
        return None
    if isinstance(spec, Aggregator):
        return spec
    if spec == "trimmed_mean":
        return TrimmedMean()
    if spec == "median":
        return Median()
    raise ValueError(
        f"aggregation must be one of {', '.join(map(repr, AGGREGATIONS))} or an Aggregator "
        f"(TrimmedMean, Median, ClippedMean, CenteredClip), got {spec!r}"
    )
