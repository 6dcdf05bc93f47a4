"""Is a training state healthy? NaN/Inf checks shared by checkpoints, rounds and downloads.

A peer whose state went non-finite must not spread it: not into a round, not into a
checkpoint, not to a joiner. The checks here are what every such path calls. They cost one
pass over the tensors and one host sync per device (not one per tensor), so a GPU model is
not stalled once per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moshpit.training.errors import StateError

__all__ = ["NonFiniteStateError", "first_non_finite"]


class NonFiniteStateError(StateError, ArithmeticError):
    """A training state holds NaN or Inf: it is neither averaged, checkpointed nor served.

    The message names the first such tensor; ``moshpit.Optimizer`` answers it by reloading
    a good state (the swarm's, or this peer's last good checkpoint).
    """


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf; None if all are finite."""
    names: list[str] = []
    flags: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        flags.setdefault(tensor.device, []).append((len(names), torch.isfinite(tensor).all()))
        names.append(name)
    bad: list[int] = []
    for per_device in flags.values():
        ok = torch.stack([flag for _, flag in per_device]).cpu()  # one sync per device
        bad += [index for (index, _), good in zip(per_device, ok.tolist(), strict=True) if not good]
    return names[min(bad)] if bad else None
