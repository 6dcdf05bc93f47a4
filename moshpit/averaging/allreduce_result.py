"""What one member got out of an all-reduce round (:class:`AllReduceResult`).

Kept apart from ``allreduce.py`` (the round itself): it is what the averager and the training
modes read, and it holds no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dht.p2p import PeerID

__all__ = ["AllReduceResult"]


@dataclass
class AllReduceResult:
    """What one member got out of a round.

    ``failed_senders``: members left out of *this* member's part (stalled, disconnected).
    ``failed_reducers``: members whose part this member did not get back (it kept local values).
    ``excluded``: members left out for bad input / protocol violations, with the reason (as a
    sender to our part, or as a reducer that returned garbage).
    ``deviation``: sum over parts of ``sum_i w_i ||x_i - mean||^2 / sum_i w_i`` (the spread of
    the group before averaging, for adaptive averaging periods); ``None`` if a part is missing.
    ``bytes_sent``/``bytes_received``: compressed tensor payload bytes (framing not counted).
    ``failure_reasons``: why each failed sender/reducer failed (for logs).
    ``left_out_by``: reducers that left *this* member's contribution out of their part, with
    the reason they sent (we stalled, or they refused what we sent, e.g. a different flat
    size); their parts kept our local values. They are not counted as failed: the fault
    was (most likely) ours.
    ``averaged_numel`` / ``numel``: how many of this member's elements ended up averaged with
    at least one other member's contribution (chunks whose result had another contributor
    with positive weight, in parts that completed), out of how many. For an aux member (no
    tensors of its own) both count its own part: elements reduced from >= 2 contributions.
    ``missing_contributors``: members whose contribution a part's reducer left out of a
    result we received (it names them in the result), with the parts; they are in
    ``failed_peers`` even when they failed nowhere else in our view. ``complete_numel``:
    our elements whose result lacked no contribution (a subset of ``averaged_numel``).
    """

    averaged: list[torch.Tensor] | None
    failed_senders: set[PeerID] = field(default_factory=set)
    failed_reducers: set[PeerID] = field(default_factory=set)
    excluded: dict[PeerID, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    deviation: float | None = None
    timed_out: bool = False
    failure_reasons: dict[PeerID, str] = field(default_factory=dict)
    left_out_by: dict[PeerID, str] = field(default_factory=dict)
    averaged_numel: int = 0
    numel: int = 0
    numel_sent: int = 0  # values in the chunks and results behind bytes_sent
    missing_contributors: dict[PeerID, str] = field(default_factory=dict)
    complete_numel: int = 0

    @property
    def wire_bytes_per_value(self) -> float | None:
        """Payload bytes this member's codecs sent per value (None if it sent nothing)."""
        return self.bytes_sent / self.numel_sent if self.numel_sent else None

    @property
    def failed_peers(self) -> set[PeerID]:
        """Everyone who failed this round in any role, or whose contribution is missing from
        any part of our result (to avoid repeat offenders)."""
        return (
            self.failed_senders
            | self.failed_reducers
            | set(self.excluded)
            | set(self.missing_contributors)
        )

    @property
    def complete_fraction(self) -> float:
        """Share (0..1) of this member's elements whose result holds every contribution."""
        return self.complete_numel / self.numel if self.numel else 0.0

    @property
    def averaged_fraction(self) -> float:
        """Share (0..1) of this member's elements averaged with at least one other member."""
        return self.averaged_numel / self.numel if self.numel else 0.0

    def why_not_averaged(self) -> str | None:
        """Why nothing was averaged (None if something was), for ``StepResult.reason``."""
        if self.averaged_numel > 0:
            return None
        if self.numel == 0:
            return "nothing to average: 0 elements"
        if self.left_out_by:
            reasons = sorted(set(self.left_out_by.values()))
            return (
                f"this peer was left out by {len(self.left_out_by)} reducer(s): "
                + "; ".join(reasons[:3])
                + ("; ..." if len(reasons) > 3 else "")
            )[:1000]
        if self.timed_out:
            return "the all-reduce timed out before anything was averaged with another peer"
        details = sorted(f"{peer}: {why}" for peer, why in self.failure_reasons.items())
        for peer, why in sorted(self.excluded.items(), key=lambda item: str(item[0])):
            details.append(f"{peer}: excluded: {why}")
        return (
            "nothing was averaged with another peer"
            + (": " if details else "")
            + "; ".join(details[:3])
            + ("; ..." if len(details) > 3 else "")
        )[:1000]
