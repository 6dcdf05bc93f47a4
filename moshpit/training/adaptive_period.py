"""Adaptive averaging period for local SGD, after ADPSGD (Jiang & Agrawal, arXiv 2007.06134).

Peers that train locally drift apart; averaging pulls them together. Early in training the
drift per step is large and peers should average often; as training settles (smaller
gradients, lower learning rate) they can go longer between rounds. ADPSGD's exact period
formula could not be verified (docs/training.md), so this is the rule we implement:

- every round measures the **group spread**, ``sqrt(var) / ||mean||`` with ``var`` the
  group's weighted mean squared distance to its mean; the all-reduce computes it at no extra
  communication and every member gets the same number, so peers that average together decide
  alike (``TrainingStateAverager.last_group_spread``; the local mode falls back to this peer's
  ``||group mean - ours|| / ||ours||`` when a part of the round is missing);
- the first ``calibration_rounds`` rounds, run at the initial period, set the **target**:
  ``tolerance`` x their mean deviation;
- afterwards, whenever ``deviation_ema <= target``, the period grows by ``growth`` (x2 by
  default) up to ``max_period``; it never shrinks, except on :meth:`on_lr_drop` (a learning-rate
  drop changes the step size and so the drift per step: recalibrate from the initial period).

With ``adaptive=False`` the period stays ``initial_period`` (constant-period averaging, CPSGD).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["AdaptivePeriod"]


class AdaptivePeriod:
    def __init__(
        self,
        initial_period: int = 1,
        *,
        adaptive: bool = True,
        max_period: int = 64,
        calibration_rounds: int = 3,
        tolerance: float = 1.0,
        growth: float = 2.0,
        ema: float = 0.5,
    ) -> None:
        if not (isinstance(initial_period, int) and initial_period >= 1):
            raise ValueError(f"initial_period must be an int >= 1, got {initial_period!r}")
        if not (isinstance(max_period, int) and max_period >= initial_period):
            raise ValueError("max_period must be an int >= initial_period")
        if calibration_rounds < 1 or not tolerance > 0 or not growth > 1 or not 0 <= ema < 1:
            raise ValueError(
                "need calibration_rounds >= 1, tolerance > 0, growth > 1, 0 <= ema < 1"
            )
        self.initial_period = initial_period
        self.adaptive = adaptive
        self.max_period = max_period
        self.calibration_rounds = calibration_rounds
        self.tolerance = float(tolerance)
        self.growth = float(growth)
        self.ema = float(ema)
        self.period = initial_period
        self.target: float | None = None
        self.deviation_ema: float | None = None
        self.rounds = 0
        self._calibration: list[float] = []
        self.history: list[int] = [initial_period]

    def update(self, deviation: float | None) -> int:
        """Feed one round's deviation (None: the round averaged nothing); returns the period."""
        if deviation is None or not math.isfinite(deviation) or deviation < 0:
            return self.period
        self.rounds += 1
        if not self.adaptive:
            return self.period
        if self.target is None:
            self._calibration.append(deviation)
            if len(self._calibration) >= self.calibration_rounds:
                mean = sum(self._calibration) / len(self._calibration)
                self.target = self.tolerance * mean
                self.deviation_ema = mean
            return self.period
        assert self.deviation_ema is not None
        self.deviation_ema = self.ema * self.deviation_ema + (1 - self.ema) * deviation
        if self.deviation_ema <= self.target and self.period < self.max_period:
            self.period = min(self.max_period, max(self.period + 1, int(self.period * self.growth)))
            self.history.append(self.period)
        return self.period

    def on_lr_drop(self) -> None:
        """Recalibrate from the initial period (the drift per step changed)."""
        self.period = self.initial_period
        self.target = None
        self.deviation_ema = None
        self._calibration.clear()
        self.history.append(self.period)

    def state_dict(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "target": self.target,
            "deviation_ema": self.deviation_ema,
            "rounds": self.rounds,
            "calibration": list(self._calibration),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.period = int(state["period"])
        self.target = state["target"]
        self.deviation_ema = state["deviation_ema"]
        self.rounds = int(state["rounds"])
        self._calibration = list(state["calibration"])
