"""Error feedback and two-way (BytePS-Compress style) compression.

Error feedback keeps, per caller-chosen key, what a lossy codec dropped and adds it to the
next tensor sent under that key::

    corrected = tensor + residual[key]
    sent      = decompress(compress(corrected))
    residual[key] = corrected - sent

so that over any number of steps ``sum(sent) + residual == sum(tensors)`` (up to float32
rounding). With a ``decay`` below 1 the residual is multiplied by it before it meets the next
tensor (``corrected = tensor + decay * residual``), as SparseLoCo does: the residual then acts
as a momentum of what was not sent, and old mass fades instead of landing late; the sum above
then holds only with ``decay == 1``. Residuals are float32 whatever the input dtype, live on
the tensor's device, and are explicit state: :meth:`ErrorFeedback.state_dict` / :meth:`load_state_dict` for
checkpoints, :meth:`reset` after a failed round or a model change.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .base import Codec, CompressedTensor
from .errors import CompressionError


class ErrorFeedback:
    """Wraps any codec (lossy or not) with a per-key residual."""

    def __init__(self, codec: Codec, max_keys: int = 1_000_000, decay: float = 1.0):
        self.codec = codec
        self.max_keys = max_keys
        self.decay = decay
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def decay(self) -> float:
        """β: what share of the residual meets the next tensor (1: all of it)."""
        return self._decay

    @decay.setter
    def decay(self, decay: float) -> None:
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 <= decay <= 1:
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay!r}")
        self._decay = float(decay)

    def compress(self, tensor: torch.Tensor, key: Hashable, **kwargs: Any) -> CompressedTensor:
        """Compress ``tensor + decay * residual[key]`` and keep the new residual.

        Extra keyword arguments go to the codec (e.g. ``seed=`` for RandomK).
        """
        ct, _ = self.compress_with_decoded(tensor, key, **kwargs)
        return ct

    def compress_with_decoded(
        self, tensor: torch.Tensor, key: Hashable, **kwargs: Any
    ) -> tuple[CompressedTensor, torch.Tensor]:
        """Like :meth:`compress`, also returning the float32 tensor the receiver decodes."""
        corrected = tensor.detach().to(torch.float32, copy=True)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != corrected.shape or residual.device != corrected.device:
                raise CompressionError(
                    f"error-feedback key {key!r} was used for shape {tuple(residual.shape)} on "
                    f"{residual.device}, now {tuple(corrected.shape)} on {corrected.device}; "
                    "call reset(key) when a tensor changes"
                )
            if self.decay == 1.0:
                corrected += residual
            else:  # the stored residual stays as it was: a snapshot may still hold it
                corrected.add_(residual, alpha=self.decay)
        elif len(self._residuals) >= self.max_keys:
            raise CompressionError(f"more than max_keys={self.max_keys} error-feedback keys")
        ct, decoded = self.codec.roundtrip(corrected, **kwargs)
        decoded = decoded.to(torch.float32)
        corrected -= decoded  # becomes the new residual (no extra allocation)
        self._residuals[key] = corrected
        return ct, decoded

    def residual(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.get(key)

    def items(self) -> list[tuple[Hashable, torch.Tensor]]:
        """(key, residual) pairs; the residuals themselves, to read, not to modify."""
        return list(self._residuals.items())

    def snapshot(self) -> dict[Hashable, torch.Tensor]:
        """The residuals as they are now, to :meth:`restore` if what is compressed next is
        never delivered (a round that fails after it began sending). No copy: compressing
        and rescaling put new tensors under the keys instead of changing the old ones."""
        return dict(self._residuals)

    def restore(self, snapshot: dict[Hashable, torch.Tensor]) -> None:
        """Back to :meth:`snapshot`'s residuals: messages compressed since then count as
        never sent (their mass is in the caller's next tensor again)."""
        self._residuals = dict(snapshot)

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (e.g. lr_{t-1}/lr_t when the lr changes)."""
        # new tensors, as compressing makes: a snapshot keeps the residuals it saw
        self._residuals = {k: r * factor for k, r in self._residuals.items()}

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key`` (or of every key)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Residuals as CPU tensors (suitable for ``torch.save``)."""
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self._residuals.items()}}

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        """Restore residuals saved by :meth:`state_dict`, onto ``device`` (CPU by default)."""
        residuals = state.get("residuals") if isinstance(state, dict) else None
        if not isinstance(residuals, dict) or len(residuals) > self.max_keys:
            raise CompressionError("error-feedback state must be {'residuals': {key: tensor}}")
        loaded = {}
        for k, v in residuals.items():
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise CompressionError(f"residual for {k!r} is not a float tensor")
            loaded[k] = v.detach().to(device=device or "cpu", dtype=torch.float32, copy=True)
        self._residuals = loaded

    def __len__(self) -> int:
        return len(self._residuals)


class TwoWayCompression:
    """Compression of both directions of a butterfly all-reduce, each with error feedback.

    ``sender`` compresses a peer's own part before it is sent to the reducer; ``reducer``
    compresses the averaged part the reducer sends back (the server side in BytePS-Compress).
    Keys are the caller's, e.g. ``(part_index, chunk_index)``. With ``rescale_by_lr`` the
    sender residuals are multiplied by ``lr_prev / lr_new`` when :meth:`set_lr` sees a change,
    so a residual accumulated under the old learning rate has the same effect under the new.
    """

    def __init__(self, sender_codec: Codec, reducer_codec: Codec, rescale_by_lr: bool = False):
        self.sender = ErrorFeedback(sender_codec)
        self.reducer = ErrorFeedback(reducer_codec)
        self.rescale_by_lr = rescale_by_lr
        self._lr: float | None = None

    def compress_send(self, tensor: torch.Tensor, key: Hashable, **kw: Any) -> CompressedTensor:
        return self.sender.compress(tensor, key, **kw)

    def compress_reduced(self, tensor: torch.Tensor, key: Hashable, **kw: Any) -> CompressedTensor:
        return self.reducer.compress(tensor, key, **kw)

    def set_lr(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        if self.rescale_by_lr and self._lr is not None and lr != self._lr:
            self.sender.rescale(self._lr / lr)
        self._lr = lr

    def reset(self) -> None:
        self.sender.reset()
        self.reducer.reset()

    def snapshot(self) -> tuple[dict[Hashable, torch.Tensor], dict[Hashable, torch.Tensor]]:
        """Both sides' residuals now (see :meth:`ErrorFeedback.snapshot`)."""
        return self.sender.snapshot(), self.reducer.snapshot()

    def restore(
        self, snapshot: tuple[dict[Hashable, torch.Tensor], dict[Hashable, torch.Tensor]]
    ) -> None:
        self.sender.restore(snapshot[0])
        self.reducer.restore(snapshot[1])

    def state_dict(self) -> dict[str, Any]:
        return {
            "sender": self.sender.state_dict(),
            "reducer": self.reducer.state_dict(),
            "lr": self._lr,
        }

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        self.sender.load_state_dict(state["sender"], device)
        self.reducer.load_state_dict(state["reducer"], device)
        lr = state.get("lr")
        self._lr = float(lr) if lr is not None else None
