"""Choosing a codec per tensor: by size, by role, and online by compression gain (GraVAC)."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ._sorting import sorted_values
from .base import Codec, CompressedTensor, MetaValue, _decode_float
from .errors import CompressionError
from .floating import NoCompression
from .sparse import TopK, _check_finite, density_to_k, dgc_select

logger = logging.getLogger(__name__)


class _Selector(Codec):
    """A codec that delegates each tensor to one of several wire codecs (it has no id)."""

    def _pick(self, tensor: torch.Tensor, **kwargs: Any) -> Codec:
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, **kwargs: Any) -> CompressedTensor:
        return self._pick(tensor, **kwargs).compress(tensor)

    def roundtrip(
        self, tensor: torch.Tensor, **kwargs: Any
    ) -> tuple[CompressedTensor, torch.Tensor]:
        return self._pick(tensor, **kwargs).roundtrip(tensor)

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        raise TypeError(f"{type(self).__name__} delegates; call compress()")

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        raise TypeError("selectors produce their inner codec's messages")

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        raise TypeError("selectors produce their inner codec's messages")


class SizeAdaptive(_Selector):
    """``small`` for tensors with fewer than ``threshold_numel`` elements, else ``large``.

    Tiny tensors (biases, norms) gain nothing from compression but lose accuracy, and codecs
    with a fixed overhead (Quantile8Bit's 1 KiB codebook) would even grow them.
    """

    def __init__(self, small: Codec, large: Codec, threshold_numel: int = 2**16):
        self.small, self.large, self.threshold_numel = small, large, threshold_numel

    def _pick(self, tensor: torch.Tensor, **kwargs: Any) -> Codec:
        return self.small if tensor.numel() < self.threshold_numel else self.large


class RoleAdaptive(_Selector):
    """A codec per tensor role (e.g. ``parameter``, ``gradient``, ``optimizer``).

    ``compress(tensor, role="gradient")``; unknown or missing roles use ``default``.
    """

    def __init__(self, default: Codec, **roles: Codec):
        self.default, self.roles = default, roles

    def _pick(self, tensor: torch.Tensor, role: str | None = None, **kwargs: Any) -> Codec:
        return self.roles.get(role, self.default) if role is not None else self.default


def _energy(t: torch.Tensor) -> float:
    """Squared L2 norm; a float32 reduction (pairwise sums), squared in Python doubles."""
    return float(torch.linalg.vector_norm(t.float())) ** 2 if t.numel() else 0.0


def compression_gain(original: torch.Tensor, compressed: torch.Tensor) -> float:
    """``||C(g)||^2 / ||g||^2`` (GraVAC): 1 for lossless, the kept energy for top-k."""
    total = _energy(original)
    if total == 0.0:
        return 1.0
    return _energy(compressed) / total


def exponential_factors(theta_min: float, theta_max: float) -> list[float]:
    """Candidate compression factors: doubling from ``theta_min``, capped at ``theta_max``."""
    factors = [float(theta_min)]
    while factors[-1] * 2 < theta_max:
        factors.append(factors[-1] * 2)
    if factors[-1] < theta_max:
        factors.append(float(theta_max))
    return factors


class GraVAC:
    """Online choice of the top-k compression factor from the compression gain (GraVAC).

    Per call, with ``g = tensor + residual[key]`` (error feedback): ``g_min`` keeps the top
    ``1/theta_min`` of ``g`` and ``g_c`` keeps the top ``1/theta_c`` of ``g_min`` (multi-level
    top-k: the second level only looks at ``g_min``'s entries). Their gains are tracked as
    EWMAs; the call sends ``g_c`` if its gain is >= ``epsilon``, else ``g_min`` if that is,
    else ``g`` dense (``dense`` codec), and keeps ``g - sent`` as the residual.

    Every ``window`` calls: ``theta_c`` moves up one candidate factor while its gain stays
    >= ``epsilon`` and down one when it drops below; ``theta_min`` moves up when the two gains
    are within ``omega`` (compressing harder loses nothing) and back down, towards the
    configured floor, when its own gain drops below ``epsilon``. Factors move within
    ``factors`` (default: doubling from ``theta_min`` to ``theta_max``).

    Each call counts as one observation; give each call a distinct tensor role through
    ``key`` (the residual's key) and use one controller per group of tensors that should
    share a factor.
    """

    def __init__(
        self,
        theta_min: float = 10.0,
        theta_max: float = 1000.0,
        window: int = 500,
        omega: float = 0.01,
        epsilon: float = 0.9,
        ema: float = 0.9,
        factors: Sequence[float] | None = None,
        dense: Codec | None = None,
        value_dtype: torch.dtype = torch.float16,
        sample_ratio: float = 0.01,
        seed: int | None = None,
    ):
        if not 1 <= theta_min <= theta_max:
            raise ValueError("need 1 <= theta_min <= theta_max")
        if window < 1 or not 0 <= omega < 1 or not 0 < epsilon <= 1 or not 0 <= ema < 1:
            raise ValueError("need window >= 1, 0 <= omega < 1, 0 < epsilon <= 1, 0 <= ema < 1")
        self.factors = sorted(factors) if factors else exponential_factors(theta_min, theta_max)
        if self.factors[0] < 1:
            raise ValueError("compression factors must be >= 1")
        self.window, self.omega, self.epsilon, self.ema = window, omega, epsilon, ema
        self.dense = dense if dense is not None else NoCompression()
        self._topk = TopK(
            density=1.0, sample_ratio=sample_ratio, value_dtype=value_dtype, seed=seed
        )
        self._floor = 0  # index of theta_min in factors
        self._cand = min(1, len(self.factors) - 1)  # index of theta_c
        self.gain_min: float | None = None
        self.gain_c: float | None = None
        self.calls = 0
        self.last_choice: str = "none"
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def theta_min(self) -> float:
        return self.factors[self._floor]

    @property
    def theta_c(self) -> float:
        return self.factors[self._cand]

    def compress(self, tensor: torch.Tensor, key: Hashable = None) -> CompressedTensor:
        """Compress ``tensor`` at the currently best factor, with error feedback."""
        ct, _ = self.compress_with_decoded(tensor, key)
        return ct

    def compress_with_decoded(
        self, tensor: torch.Tensor, key: Hashable = None
    ) -> tuple[CompressedTensor, torch.Tensor]:
        """Like :meth:`compress`, also returning the float32 tensor the receiver decodes."""
        g = tensor.detach().to(torch.float32, copy=True)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != g.shape:
                raise CompressionError(f"GraVAC key {key!r} changed shape; call reset(key)")
            g += residual
        ct, decoded = self.select(g)
        g -= decoded
        self._residuals[key] = g
        return ct, decoded

    def as_codec(self) -> Codec:
        """This controller as a plain :class:`Codec` without residuals of its own.

        For callers that already apply error feedback (``ErrorFeedback``,
        ``TwoWayCompression``, the averager's ``compression=``): they pass in
        gradient + residual, which is exactly the ``g`` GraVAC measures. The controller's
        gains and factors are shared with this object.
        """
        return _GraVACCodec(self)

    def select(self, g: torch.Tensor) -> tuple[CompressedTensor, torch.Tensor]:
        """One GraVAC step on ``g`` (already error-corrected): message and decoded tensor."""
        g = g.detach()
        flat = g.reshape(-1).float()
        _check_finite(flat)
        n = flat.numel()
        idx_min = dgc_select(flat, density_to_k(n, 1.0 / self.theta_min), generator=self._topk._gen)
        k_c = min(idx_min.numel(), density_to_k(n, 1.0 / self.theta_c))
        top_in_min = torch.topk(flat[idx_min].abs(), k_c, sorted=False).indices
        idx_c = sorted_values(idx_min[top_in_min])
        energy = _energy(flat)
        gain_min = _energy(flat[idx_min]) / energy if energy else 1.0
        gain_c = _energy(flat[idx_c]) / energy if energy else 1.0
        self.gain_min = self._ewma(self.gain_min, gain_min)
        self.gain_c = self._ewma(self.gain_c, gain_c)

        if self.gain_c >= self.epsilon:
            self.last_choice = f"topk@{self.theta_c:g}"
            ct = self._topk.compress_selected(g, idx_c)
        elif self.gain_min >= self.epsilon:
            self.last_choice = f"topk@{self.theta_min:g}"
            ct = self._topk.compress_selected(g, idx_min)
        else:
            self.last_choice = "dense"
            ct = self.dense.compress(g)
        decoded = _decode_float(ct, g.device).to(torch.float32)
        self.calls += 1
        if self.calls % self.window == 0:
            self._adapt()
        return ct, decoded

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema * old + (1 - self.ema) * new

    def _adapt(self) -> None:
        assert self.gain_min is not None and self.gain_c is not None
        floor, cand, last = self._floor, self._cand, len(self.factors) - 1
        if self.gain_c >= self.epsilon:
            cand = min(cand + 1, last)
        else:
            cand = max(cand - 1, floor)
        if abs(self.gain_c - self.gain_min) <= self.omega and floor + 1 < cand:
            floor += 1
        elif self.gain_min < self.epsilon and floor > 0:
            floor -= 1
        cand = max(cand, floor)
        if (floor, cand) != (self._floor, self._cand):
            logger.debug(
                "GraVAC: theta_min %g -> %g, theta_c %g -> %g (gains %.3f / %.3f)",
                self.theta_min, self.factors[floor], self.theta_c, self.factors[cand],
                self.gain_min, self.gain_c,
            )  # fmt: skip
            self._floor, self._cand = floor, cand
            # gains of the new factors are unknown: start their averages afresh
            self.gain_min = self.gain_c = None

    def reset(self, key: Hashable | None = None) -> None:
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "floor": self._floor,
            "cand": self._cand,
            "gain_min": self.gain_min,
            "gain_c": self.gain_c,
            "calls": self.calls,
            "residuals": {k: v.cpu().clone() for k, v in self._residuals.items()},
        }

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        floor, cand = int(state["floor"]), int(state["cand"])
        if not 0 <= floor <= cand < len(self.factors):
            raise CompressionError("GraVAC state does not match the candidate factors")
        self._floor, self._cand = floor, cand
        self.gain_min, self.gain_c = state["gain_min"], state["gain_c"]
        self.calls = int(state["calls"])
        self._residuals = {
            k: v.to(device=device or "cpu", dtype=torch.float32, copy=True)
            for k, v in state["residuals"].items()
        }


__all__ = [
    "SizeAdaptive",
    "RoleAdaptive",
    "GraVAC",
    "compression_gain",
    "exponential_factors",
]


class _GraVACCodec(_Selector):
    """A GraVAC controller seen as a codec (see :meth:`GraVAC.as_codec`)."""

    def __init__(self, controller: GraVAC):
        self.controller = controller

    def compress(self, tensor: torch.Tensor, **kwargs: Any) -> CompressedTensor:
        return self.controller.select(tensor)[0]

    def roundtrip(
        self, tensor: torch.Tensor, **kwargs: Any
    ) -> tuple[CompressedTensor, torch.Tensor]:
        return self.controller.select(tensor)
