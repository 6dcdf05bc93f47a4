"""``mode="local"``: local SGD with background parameter averaging every H steps.

Each ``step()`` applies the inner optimizer at once (no waiting for anyone). Every H local steps
a round averages the state (parameters, optimizer statistics, buffers) in the background:
``TrainingStateAverager.step(wait=False)`` snapshots the state, averages the snapshot while
training goes on, and the delta is applied at a later ``step()`` (local progress kept). H adapts
as in ADPSGD (``moshpit/training/adaptive_period.py``): short early, longer as peers stop
drifting apart.

The epoch counts completed averaging rounds (progress is reported in local samples).
"""

from __future__ import annotations

from typing import Any

from moshpit.training.adaptive_period import AdaptivePeriod
from moshpit.training.modes.base import TrainingMode


class LocalMode(TrainingMode):
    """Knobs: ``average_every`` (initial H, default 4), ``adaptive_period`` (default True),
    ``max_period`` (64), ``calibration_rounds`` (3), ``period_tolerance`` (1.0),
    ``period_growth`` (2.0), ``wait_for_rounds`` (False: averaging never stalls training)."""

    name = "local"

    def __init__(
        self,
        optimizer: Any,
        *,
        average_every: int = 4,
        adaptive_period: bool = True,
        max_period: int = 64,
        calibration_rounds: int = 3,
        period_tolerance: float = 1.0,
        period_growth: float = 2.0,
        wait_for_rounds: bool = False,
        round_timeout: float | None = None,
    ) -> None:
        super().__init__(optimizer)
        self.period = AdaptivePeriod(
            average_every,
            adaptive=adaptive_period,
            max_period=max(max_period, average_every),
            calibration_rounds=calibration_rounds,
            tolerance=period_tolerance,
            growth=period_growth,
        )
        self.wait_for_rounds = wait_for_rounds
        self.round_timeout = round_timeout
        self.state = optimizer.make_state_averager(optimizer.inner)
        self.local_steps = 0  # since the last round started
        self.samples = 0  # since the last round started
        self.rounds_started = 0
        self.rounds_succeeded = 0
        self.bytes_sent = 0
        self._last_lr = self._lr()

    def _lr(self) -> float | None:
        groups = self.opt.inner.param_groups
        return groups[0].get("lr") if groups else None

    def step(self, batch_size: int) -> None:
        self._collect()
        self.opt.inner.step()
        self.local_steps += 1
        self.samples += batch_size
        lr = self._lr()
        if lr is not None and self._last_lr is not None and lr < self._last_lr:
            self.period.on_lr_drop()
        self._last_lr = lr
        self.report_progress(self.samples)
        if self.local_steps >= self.period.period and not self.state.round_running:
            self.rounds_started += 1
            self.local_steps = 0
            self.samples = 0
            handle = self.state.step(wait=self.wait_for_rounds, timeout=self.round_timeout)
            if self.wait_for_rounds:
                self._account(handle)

    def _collect(self) -> None:
        """Apply a finished background round and let its deviation steer the period."""
        result = self.state.apply_pending()
        if result is not None:
            self._account(result)

    def _account(self, result: Any) -> None:
        self.bytes_sent += result.bytes_sent
        if result.succeeded:
            self.rounds_succeeded += 1
            self.state.epoch += 1
            # the group's spread is the same number for every member, so peers that average
            # together take the same period decisions; our own deviation when it is unknown
            spread = self.state.last_group_spread
            self.period.update(spread if spread is not None else self.state.last_round_deviation)

    def state_dict(self) -> dict[str, Any]:
        return {"period": self.period.state_dict(), "local_steps": self.local_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "period" in state:
            self.period.load_state_dict(state["period"])
        self.local_steps = int(state.get("local_steps", 0))


MODE = LocalMode
