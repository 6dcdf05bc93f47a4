"""What one averaging step did (:class:`StepResult`): what every caller of ``Averager.step``
reads, apart from the averager's machinery so that the training layer imports it alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepResult"]


@dataclass
class StepResult:
    """What one :meth:`Averager.step` did.

    ``succeeded``: at least one element of this peer's tensors was averaged with at least one
    other peer's contribution (other parts may have kept local values; see
    ``averaged_fraction`` and ``failed``). ``reason`` says why not when it did not: no group
    formed, the round was cancelled, or the group formed but nothing was averaged (e.g. every
    reducer left this peer out because it stalled or its tensors differ from the group's, or
    every other member failed).
    ``averaged_fraction``: the share (0..1) of this peer's elements that were averaged with at
    least one other peer; the rest kept their local values. For an aux peer (no tensors of
    its own): the share of the part it reduced that combined >= 2 peers' contributions.
    ``complete_fraction``: the share of this peer's elements whose result holds every
    contribution; below ``averaged_fraction`` when a part was averaged without someone (a
    peer that died mid-round after delivering to some reducers only), and ``failed`` then
    names who is missing (reducers name the senders their results lack).
    ``gathered`` maps every group member to the metadata it passed as ``gather=``.
    ``group_deviation``: the group's spread before averaging, the sum over parts of
    ``sum_i w_i ||x_i - mean||^2 / sum_i w_i``; the same number for every member (adaptive
    averaging periods use it to decide alike); None unless every part came back.
    """

    succeeded: bool
    group_key: str
    group_id: bytes | None = None
    members: tuple[Any, ...] = ()
    modes: tuple[str, ...] = ()
    gathered: dict[Any, Any] = field(default_factory=dict)
    failed: set[Any] = field(default_factory=set)
    excluded: dict[Any, str] = field(default_factory=dict)
    reason: str | None = None
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    timed_out: bool = False
    next_group_key: str = ""
    averaged_fraction: float = 0.0
    group_deviation: float | None = None
    complete_fraction: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.members)
