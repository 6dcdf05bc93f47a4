"""What a peer's training state is, tensor by tensor, and how values are written back into it.

The state is the optimizer's parameters, its per-parameter statistics (e.g. Adam moments and
step counts) and extra tensors (buffers such as BatchNorm statistics). Their names and order
(:meth:`StateTensors.named`) are the schema checkpoints store and joiners must match, so they
live here, apart from ``state_averager.py``'s rounds, checkpoints and sharing: this module does
no I/O and knows no peer. How an averaged round is applied to tensors that moved on meanwhile
(:func:`correct_after_round`) is here for the same reason: it is arithmetic on the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from moshpit.critical import critical_section
from moshpit.training.manifest import dtype_name

__all__ = ["StateTensors", "both_nonnegative", "correct_after_round"]

# param_groups entries that are plain numbers/strings/bools travel in the state's metadata
_SCALAR_TYPES = (int, float, str, bool, type(None))


class StateTensors:
    """The live tensors of ``optimizer``'s state plus ``extras``, by their stable names."""

    def __init__(self, optimizer: torch.optim.Optimizer, extras: Iterable[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = [
            p for group in optimizer.param_groups for p in group["params"]
        ]
        self.extras = list(extras)

    def create_optimizer_state(self) -> None:
        """Create lazily-initialised optimizer state (e.g. Adam moments) without changing params.

        Every peer must list the same tensors before its first real step, or a joiner's schema
        would not match a donor's. A zero-gradient step creates them; parameters, gradients and
        counters are put back afterwards.
        """
        if all(p in self.optimizer.state and self.optimizer.state[p] for p in self.params):
            return
        saved = [(p.detach().clone(), p.grad) for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            for p, (data, grad) in zip(self.params, saved, strict=True):
                p.copy_(data)
                p.grad = grad
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() == 0 and key == "step":
                        value.zero_()
                    elif key == "step" and isinstance(value, (int, float)):
                        self.optimizer.state[p][key] = type(value)(0)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """Every state tensor with its stable name: parameters, optimizer state, extras."""
        named = [(f"params.{i}", p) for i, p in enumerate(self.params)]
        for i, p in enumerate(self.params):
            for key in sorted(self.optimizer.state.get(p, {})):
                value = self.optimizer.state[p][key]
                if isinstance(value, torch.Tensor):
                    named.append((f"optimizer.{i}.{key}", value))
        named += [(f"extra.{i}", t) for i, t in enumerate(self.extras)]
        return named

    def averaged_names(self, params: bool, stats: bool, extras: bool) -> list[str]:
        """The names of the tensors a round averages: floating-point ones of the kinds asked
        for; of the optimizer's, only per-parameter statistics (a scalar ``step`` stays local)."""
        names = []
        shapes = {f"params.{i}": p.shape for i, p in enumerate(self.params)}
        for name, tensor in self.named():
            if not tensor.is_floating_point():
                continue
            kind = name.split(".", 1)[0]
            if kind == "params" and params:
                names.append(name)
            elif kind == "optimizer" and stats:
                index = name.split(".")[1]
                if tensor.shape == shapes[f"params.{index}"] and tensor.dim() > 0:
                    names.append(name)
            elif kind == "extra" and extras:
                names.append(name)
        return names

    def schema(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every state tensor, in manifest order."""
        return [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.named()]

    def metadata(self) -> dict[str, Any]:
        """The optimizer's scalar hyper-parameters and counters, saved with the tensors."""
        groups = []
        for group in self.optimizer.param_groups:
            groups.append(
                {k: v for k, v in group.items() if k != "params" and isinstance(v, _SCALAR_TYPES)}
            )
        scalars = {}
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, _SCALAR_TYPES):
                    scalars[f"{i}.{key}"] = value
        return {"param_groups": groups, "optimizer_scalars": scalars}

    def write(self, tensors: Sequence[torch.Tensor], metadata: dict[str, Any]) -> None:
        """Copy a verified state into the live tensors and optimizer hyper-parameters."""
        with critical_section(), torch.no_grad():
            for (_, live), value in zip(self.named(), tensors, strict=True):
                live.copy_(value.to(live.device))
        groups = metadata.get("param_groups") if isinstance(metadata, dict) else None
        if isinstance(groups, list) and len(groups) == len(self.optimizer.param_groups):
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                if isinstance(saved, dict):
                    for key, value in saved.items():
                        if key in group and key != "params" and isinstance(value, _SCALAR_TYPES):
                            group[key] = value
        scalars = metadata.get("optimizer_scalars") if isinstance(metadata, dict) else None
        if isinstance(scalars, dict):
            for name, value in scalars.items():
                index, _, key = str(name).partition(".")
                if index.isdigit() and int(index) < len(self.params):
                    state = self.optimizer.state.get(self.params[int(index)])
                    if state is not None and key in state and isinstance(value, _SCALAR_TYPES):
                        state[key] = value


def correct_after_round(
    live: torch.Tensor, averaged: torch.Tensor, snapshot: torch.Tensor, *, nonnegative: bool
) -> torch.Tensor:
    """Apply a finished round to ``live`` in place: the round turned ``snapshot`` into
    ``averaged`` while ``live`` moved on from ``snapshot`` (local steps during the round).

    Signed state (parameters, first moments): ``live += averaged - snapshot``, which keeps
    the local progress exactly. A non-negative statistic cannot take that rule: while the
    round is in flight its live value decays (Adam's ``exp_avg_sq`` shrinks by ``beta2`` per
    step), and once it is below ``snapshot - averaged`` the sum is negative and ``sqrt`` turns
    the next step into NaN. So where the live value fell below the snapshot, the round's
    change is scaled by that same decay: ``live * averaged / snapshot`` (what the average
    would be had it decayed alongside); where it grew, the plain delta. Both are >= 0 and at
    most ``max(live + averaged, averaged)``, and they agree where ``live == snapshot``. A
    negative average (only a misbehaving peer sends one) counts as zero.
    """
    averaged = averaged.to(live.device, non_blocking=live.is_cuda)
    snapshot = snapshot.to(live.device, non_blocking=live.is_cuda)
    if not nonnegative:
        return live.add_(averaged - snapshot)
    averaged = averaged.clamp_min(0)
    decayed = live < snapshot  # implies snapshot > 0: the ratio below is in [0, 1)
    scaled = (live / snapshot).mul_(averaged)
    shifted = (live + averaged).sub_(snapshot)
    return live.copy_(torch.where(decayed, scaled, shifted))


def both_nonnegative(snapshot: torch.Tensor, live: torch.Tensor) -> bool:
    """Both sides of a statistic hold no negative value (its domain, as far as we can tell:
    user optimizers name their statistics as they like)."""
    if snapshot.numel() == 0:
        return False
    return bool(snapshot.min() >= 0) and bool(live.min() >= 0)
