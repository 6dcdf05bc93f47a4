"""Streaming DiLoCo's pieces: parameter fragments, and one fragment's round in flight.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the model into fragments whose
outer rounds happen at staggered times, so only one fragment's pseudo-gradient is on the wire
at a time, and overlaps each round with the next inner steps: the outer step of a fragment lands
a few inner steps after its pseudo-gradient was taken. The mode (``diloco.py``) owns the
schedule; this module holds what one round needs to land correctly later.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FragmentRound", "split_fragments"]


def split_fragments(numels: list[int], count: int) -> list[list[int]]:
    """Contiguous groups of parameter indices, ``count`` of them, balanced by element count.

    Contiguous (neighbouring layers together) so a fragment is a slice of the network, as in
    the paper; every fragment holds at least one parameter.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"fragments must be a positive integer, got {count!r}")
    if count > len(numels):
        raise ValueError(
            f"fragments={count} but the model has only {len(numels)} parameter tensors: "
            "use at most that many fragments"
        )
    total = sum(numels)
    groups: list[list[int]] = [[]]
    done = 0
    for i, n in enumerate(numels):
        to_open = count - len(groups)
        share_met = done >= len(groups) * total / count
        if groups[-1] and to_open and (share_met or len(numels) - i <= to_open):
            groups.append([])
        groups[-1].append(i)
        done += n
    return groups


@dataclass
class FragmentRound:
    """A fragment's outer round running in the background while inner steps go on.

    ``start_local``: the fragment's local parameters when its pseudo-gradient was taken (CPU
    float32). When the round lands, the local parameters become the new ``θ`` plus the local
    progress made since then (``p_now - start_local``), so the overlapped inner steps are kept,
    like the delta correction of background averaging.
    """

    epoch: int
    indices: list[int]  # the fragment's parameters (fragment epoch % F)
    averager: Any
    future: concurrent.futures.Future[Any]
    start_local: list[torch.Tensor]
    digest: bytes
    steps_since_start: int = 0
    samples: int = 0  # the samples behind its pseudo-gradient (its weight in the round)
    feedback: Any = None  # error-feedback residuals before the round, restored if it fails

    def close(self) -> None:
        """Abandon the round (if still running) and free its averager. A cancelled step
        finishes its write into the buffers under the averager's lock first: wait for that
        (bounded), so the buffers are ours again when this returns."""
        self.averager.shutdown()
        self.future.cancel()
        try:
            self.future.exception(timeout=10)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            pass
