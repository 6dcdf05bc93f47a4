"""Deep Gradient Compression for ``mode="sync"`` (Lin et al., 2018), on top of
``compression.DGCMomentum``.

Per global step each peer turns its local mean gradient into a sparse update:

- local gradient clipping to ``clip_norm / sqrt(N)`` (N = peers in the swarm), per tensor;
- momentum correction: the velocity ``u = m*u + g`` is accumulated (``v += u``), not the raw
  gradient, so the momentum lives here and the inner optimizer must be plain SGD
  (``momentum=0``): it applies the averaged sparse update with its learning rate;
- momentum factor masking: the velocity of the entries just sent is zeroed;
- warm-up: the density follows ``dgc_density_schedule`` (25% -> 6.25% -> 1.56% -> 0.4% ->
  0.1% over the first ``warmup_epochs`` epochs for the defaults). An "epoch" here is a pass
  over the training data, ``steps_per_epoch`` global steps (default 1: one global step).

The sparse updates are then averaged (weighted by samples) like dense gradients; the
averager's own codec (``TopK`` at the same density with sender- and reducer-side error
feedback, see :func:`dgc_compression`) keeps what crosses the network sparse.

``momentum_correction=False`` is the ablation "Gradient Dropping": the raw gradient is
accumulated (``m = 0`` here) and the inner optimizer's momentum acts on the sparse update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compression import DGCMomentum, NoCompression, TopK, TwoWayCompression, dgc_density_schedule
from compression.base import _decode_float

__all__ = ["DGC", "dgc_compression"]


class DGC:
    """The per-peer DGC state of a list of tensors (keys = their positions)."""

    def __init__(
        self,
        *,
        momentum: float = 0.9,
        final_density: float = 0.001,
        initial_density: float = 0.25,
        warmup_epochs: int = 4,
        steps_per_epoch: int = 1,
        clip_norm: float | None = None,
        masking: bool = True,
        momentum_correction: bool = True,
        value_dtype: torch.dtype = torch.float32,
        seed: int | None = None,
    ) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch!r}")
        dgc_density_schedule(0, final_density, warmup_epochs, initial_density)  # validates
        self.final_density = final_density
        self.initial_density = initial_density
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.momentum_correction = momentum_correction
        self.momentum = momentum if momentum_correction else 0.0
        self.core = DGCMomentum(
            momentum=self.momentum,
            density=initial_density,
            clip_norm=clip_norm,
            masking=masking,
            value_dtype=value_dtype,
            seed=seed,
        )
        self.values_sent = 0  # entries this peer selected, over all steps
        self.values_total = 0  # entries it would have sent dense

    def density(self, step: int) -> float:
        """The density of global step ``step`` (warm-up by data epochs)."""
        return dgc_density_schedule(
            step / self.steps_per_epoch,
            self.final_density,
            self.warmup_epochs,
            self.initial_density,
        )

    def compress(
        self, grads: Sequence[torch.Tensor], step: int, num_workers: int = 1
    ) -> list[torch.Tensor]:
        """The dense-shaped sparse updates of ``grads`` (zeros where nothing was sent)."""
        self.core.set_density(self.density(step))
        self.core.num_workers = max(1, int(num_workers))
        out = []
        for i, grad in enumerate(grads):
            ct = self.core.compress(grad, key=i)
            update = _decode_float(ct, torch.device("cpu")).to(torch.float32).view(grad.shape)
            self.values_sent += int(torch.count_nonzero(update))
            self.values_total += update.numel()
            out.append(update)
        return out

    def reset(self) -> None:
        """Forget velocities and accumulations (after the model was replaced)."""
        self.core.reset()

    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state)


def dgc_compression(density: float, group_size: int) -> TwoWayCompression:
    """The averager's codec for DGC updates: top-k both ways, each with error feedback.

    Senders keep ``density`` of their part (their sparse update has about that many
    non-zeros; what a chunk boundary cuts off stays in the sender's residual); reducers send
    back at most the union of the group's entries (``density * group_size``), the rest stays
    in the reducer's residual (BytePS-Compress's two-way error feedback).
    """
    density = min(1.0, max(density, 1e-6))
    reduced = min(1.0, density * max(1, group_size))
    if density >= 1.0:
        return TwoWayCompression(NoCompression(), NoCompression())
    return TwoWayCompression(
        TopK(density, value_dtype=torch.float32, exact=True),
        TopK(reduced, value_dtype=torch.float32, exact=True),
    )
