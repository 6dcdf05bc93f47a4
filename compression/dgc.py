"""Deep Gradient Compression helpers: density warm-up and momentum correction with masking.

DGC (Lin et al., 2018) sends only the largest accumulated gradient entries. To stay close
to dense momentum SGD it accumulates the *velocity* rather than the gradient (momentum
correction), zeroes the velocity of entries it sent (factor masking, so stale momentum does
not push them again), clips gradients locally before accumulation, and warms up the density.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from .base import CompressedTensor, _decode_float
from .errors import CompressionError
from .sparse import TopK, _check_finite, density_to_k


def dgc_density_schedule(
    epoch: float,
    final_density: float = 0.001,
    warmup_epochs: int = 4,
    initial_density: float = 0.25,
) -> float:
    """Exponential warm-up: 25% -> 6.25% -> 1.56% -> 0.4% -> 0.1% for the defaults.

    Epoch ``e < warmup_epochs`` uses ``initial * (final/initial) ** (floor(e)/warmup_epochs)``.
    """
    if not 0 < final_density <= initial_density <= 1:
        raise ValueError("need 0 < final_density <= initial_density <= 1")
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return final_density
    stage = math.floor(max(epoch, 0.0))
    return float(initial_density * (final_density / initial_density) ** (stage / warmup_epochs))


class DGCMomentum:
    """Per-tensor DGC state: velocity ``u`` and accumulation ``v``, keyed by the caller.

    ``compress(grad, key)``::

        g <- clip(grad)                 # local clipping to clip_norm / sqrt(num_workers)
        u <- momentum * u + g           # momentum correction
        v <- v + u
        idx <- about density * n largest |v| (DGC sampled threshold)
        send v[idx]; v[idx] -= sent; u[idx] <- 0 (if masking)

    Invariant: sum of everything decoded + current v == sum of every u pushed into v.
    With density 1 and masking off it is exactly dense momentum SGD (each step sends u).
    The caller applies the (averaged) sparse update with its learning rate and no further
    momentum.
    """

    def __init__(
        self,
        momentum: float = 0.9,
        density: float = 0.001,
        clip_norm: float | None = None,
        num_workers: int = 1,
        masking: bool = True,
        value_dtype: torch.dtype = torch.float32,
        sample_ratio: float = 0.01,
        seed: int | None = None,
    ):
        if not 0 <= momentum < 1 or num_workers < 1:
            raise ValueError("need 0 <= momentum < 1 and num_workers >= 1")
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.num_workers = num_workers
        self.masking = masking
        self._codec = TopK(density, sample_ratio, value_dtype, seed=seed)
        self._u: dict[Hashable, torch.Tensor] = {}
        self._v: dict[Hashable, torch.Tensor] = {}

    @property
    def density(self) -> float:
        return self._codec.density

    def set_density(self, density: float) -> None:
        """Change the density (e.g. from :func:`dgc_density_schedule` each epoch)."""
        if not 0 < density <= 1:
            raise ValueError("density must be in (0, 1]")
        self._codec.density = density

    def compress(self, grad: torch.Tensor, key: Hashable) -> CompressedTensor:
        g = grad.detach().to(torch.float32, copy=True).view(-1)
        _check_finite(g)
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(self.num_workers)
            norm = float(torch.linalg.vector_norm(g))
            if norm > limit:
                g.mul_(limit / norm)
        u, v = self._u.get(key), self._v.get(key)
        if u is None or v is None:
            u, v = torch.zeros_like(g), torch.zeros_like(g)
            self._u[key], self._v[key] = u, v
        elif u.shape != g.shape:
            raise CompressionError(f"DGC key {key!r} changed shape; call reset(key)")
        u.mul_(self.momentum).add_(g)
        v.add_(u)
        k = density_to_k(v.numel(), self.density)
        idx = self._codec.select(v, k)
        ct = self._codec.compress_selected(v.view(grad.shape), idx)
        sent = _decode_float(ct, v.device).view(-1)
        v[idx] -= sent[idx]  # exactly what was not sent (rounding of fp16 values) stays in v
        if self.masking:
            u[idx] = 0.0
        return ct

    def velocity(self, key: Hashable) -> torch.Tensor | None:
        return self._u.get(key)

    def accumulation(self, key: Hashable) -> torch.Tensor | None:
        return self._v.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        if key is None:
            self._u.clear()
            self._v.clear()
        else:
            self._u.pop(key, None)
            self._v.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "u": {k: t.cpu().clone() for k, t in self._u.items()},
            "v": {k: t.cpu().clone() for k, t in self._v.items()},
            "density": self.density,
        }

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        if set(state.get("u", {})) != set(state.get("v", {})):
            raise CompressionError("DGC state: u and v must have the same keys")
        to = {"device": device or "cpu", "dtype": torch.float32, "copy": True}
        self._u = {k: t.to(**to) for k, t in state["u"].items()}
        self._v = {k: t.to(**to) for k, t in state["v"].items()}
        self.set_density(float(state["density"]))
