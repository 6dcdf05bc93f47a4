"""What every training mode provides to ``moshpit.Optimizer``."""

from __future__ import annotations

from typing import Any

import torch


class TrainingMode:
    """One way of training with the swarm. ``Optimizer.step()`` calls :meth:`step` after the
    user's ``backward()`` (gradients checked finite), inside a preemption critical section.

    Subclasses set ``self.state`` (a TrainingStateAverager: what is checkpointed and served to
    joiners) in ``__init__``, using ``optimizer.make_state_averager(...)``.
    """

    name = "base"

    def __init__(self, optimizer: Any) -> None:
        self.opt = optimizer
        self.state: Any = None

    def on_start(self) -> None:
        """Before the first step: catch up with the swarm (load state if it is ahead)."""
        self.state.synchronize()
        self.on_state_loaded()

    def on_state_loaded(self) -> None:
        """After the state was replaced by a checkpoint or a donor's (reset local buffers)."""

    def step(self, batch_size: int) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.inner.zero_grad(set_to_none=set_to_none)

    def report_progress(self, samples: int) -> None:
        self.opt.tracker.report(self.state.epoch, samples)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def leave_swarm(self, deadline: float) -> None:
        self.state.leave_swarm(deadline)

    def shutdown(self) -> None:
        if self.state is not None:
            self.state.shutdown()


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
