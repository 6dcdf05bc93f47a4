"""``mode="local"``: local SGD with background parameter averaging every H steps.

Each ``step()`` applies the inner optimizer at once (no waiting for anyone). Every H local steps
a round averages the state (parameters, optimizer statistics, buffers) in the background:
``TrainingStateAverager.step(wait=False)`` snapshots the state, averages the snapshot while
training goes on, and the delta is applied at a later ``step()`` (local progress kept). H adapts
as in ADPSGD (``moshpit/training/adaptive_period.py``): short early, longer as peers stop
drifting apart.

The period decision is part of the shared state: the period, the calibrated target and the
deviation average travel in an int64 extra tensor of the TrainingStateAverager (saved, served,
never averaged), so a joiner or a restarted peer goes on at the swarm's period instead of
averaging every step again.

``compression=`` compresses the averaged state on the wire: ``"fp16"``, ``"8bit"`` or any
codec. Sparsifiers (top-k, GraVAC) are refused: the rounds average parameter *values*, and a
top-k of the values would average the largest weights and drop the rest.

The epoch counts completed averaging rounds (progress is reported in local samples).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from compression import Codec, Float16, GraVAC, TopK, TwoWayCompression, Uniform8Bit
from moshpit.training.adaptive_period import AdaptivePeriod
from moshpit.training.modes.base import TrainingMode
from moshpit.training.modes.options import LocalOptions

if TYPE_CHECKING:
    from moshpit.training.optimizer import Optimizer

logger = logging.getLogger(__name__)

_NO_VALUE = float("nan")  # "not calibrated yet" in the shared period tensor


def local_compression(compression: Any) -> Any:
    """The averager's codec for ``compression=`` (None, "fp16", "8bit" or a dense codec)."""
    if compression is None or compression == "none":
        return None
    if compression == "fp16":
        return Float16()
    if compression == "8bit":
        return Uniform8Bit()
    if isinstance(compression, (GraVAC, TwoWayCompression, TopK)) or compression == "topk":
        raise ValueError(
            "mode='local' averages parameter values, which top-k/GraVAC would sparsify (only "
            "the largest weights would be averaged): use compression='fp16' or '8bit', or "
            "mode='diloco', whose pseudo-gradients compress well with top-k"
        )
    if isinstance(compression, Codec):
        return compression
    raise ValueError(f"compression must be None, 'fp16', '8bit' or a codec; got {compression!r}")


class LocalMode(TrainingMode):
    """Local steps with parameters averaged in the background every H steps, H adapting over
    training; its knobs are in ``LocalOptions``."""

    name = "local"

    def __init__(self, optimizer: Optimizer, options: LocalOptions) -> None:
        super().__init__(optimizer)
        self.period = AdaptivePeriod(
            options.average_every,
            adaptive=options.adaptive_period,
            max_period=max(options.max_period, options.average_every),
            calibration_rounds=options.calibration_rounds,
            tolerance=options.period_tolerance,
            growth=options.period_growth,
        )
        self.wait_for_rounds = options.wait_for_rounds
        self.round_timeout = options.round_timeout
        # [period, rounds, target, deviation_ema]; floats stored as their int64 bit patterns
        self._shared_period = torch.zeros(4, dtype=torch.int64)
        self._pack_period()
        state_options: dict[str, Any] = {
            "extra_tensors": [*optimizer.extra_tensors, self._shared_period],
        }
        codec = local_compression(options.compression)
        if codec is not None:
            state_options["compression"] = codec
        if optimizer.serves_state and options.checkpoint_every_epochs is not None:
            state_options["checkpoint_every_epochs"] = options.checkpoint_every_epochs
        self.state = optimizer.make_state_averager(optimizer.inner, **state_options)
        self.local_steps = 0  # since the last round started
        self.samples = 0  # since the last round started
        self.rounds_started = 0
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        # why the last few rounds failed (a failed round keeps the local values: training goes
        # on, but a run where many fail averages less often than its period says)
        self.failure_reasons: collections.deque[str] = collections.deque(maxlen=16)
        self.bytes_sent = 0
        self._last_lr = self._lr()

    # ------------------------------------------------------------------ the shared period

    def _pack_period(self) -> None:
        p = self.period
        values = torch.tensor(
            [
                float(p.period),
                float(p.rounds),
                _NO_VALUE if p.target is None else float(p.target),
                _NO_VALUE if p.deviation_ema is None else float(p.deviation_ema),
            ],
            dtype=torch.float64,
        )
        self._shared_period.copy_(values.view(torch.int64))

    def _unpack_period(self) -> None:
        """Adopt the period a loaded state carries (validated: it came from the network)."""
        period, rounds, target, ema = self._shared_period.view(torch.float64).tolist()
        p = self.period
        if not (math.isfinite(period) and period == int(period)) or not (
            p.initial_period <= period <= p.max_period
        ):
            logger.warning("the loaded state's averaging period %r is invalid: ignored", period)
            return
        if not p.adaptive:
            return  # a constant period is this peer's own choice
        calibrated = math.isfinite(target) and target >= 0 and math.isfinite(ema) and ema >= 0
        p.period = int(period)
        p.rounds = int(rounds) if math.isfinite(rounds) and rounds >= 0 else 0
        p.target = target if calibrated else None
        p.deviation_ema = ema if calibrated else None
        p._calibration.clear()
        if p.history[-1] != p.period:
            p.history.append(p.period)

    def on_state_loaded(self) -> None:
        self._unpack_period()
        self.local_steps = 0
        self.samples = 0

    # ------------------------------------------------------------------ the loop

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
            self._pack_period()
        self._last_lr = lr
        self.report_progress(self.samples)
        if self.local_steps >= self.period.period and not self.state.round_running:
            self.rounds_started += 1
            self.local_steps = 0
            self.samples = 0
            started = time.monotonic()
            handle = self.state.step(wait=self.wait_for_rounds, timeout=self.round_timeout)
            if self.wait_for_rounds:
                self.round_seconds["waited"] += time.monotonic() - started
                self._account(handle)

    def _collect(self) -> None:
        """Apply a finished background round and let its deviation steer the period."""
        started = time.monotonic()
        result = self.state.apply_pending()
        if result is not None:
            self.round_seconds["applied"] += time.monotonic() - started
            self._account(result)

    def _account(self, result: Any) -> None:
        self.note_round(result)
        self.bytes_sent += result.bytes_sent
        if result.succeeded:
            self.rounds_succeeded += 1
            self.state.epoch += 1
            # the group's spread is the same number for every member, so peers that average
            # together take the same period decisions; our own deviation when it is unknown
            spread = self.state.last_group_spread
            self.period.update(spread if spread is not None else self.state.last_round_deviation)
            self._pack_period()
        else:
            self.rounds_failed += 1
            self.failure_reasons.append(result.reason)
            logger.info(
                "averaging round %d failed, local values kept: %s",
                self.rounds_started,
                result.reason,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"period": self.period.state_dict(), "local_steps": self.local_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "period" in state:
            self.period.load_state_dict(state["period"])
            self._pack_period()
        self.local_steps = int(state.get("local_steps", 0))

    def leave_swarm(self, deadline: float) -> None:
        self._collect()  # a finished round's result belongs in the last checkpoint
        self._pack_period()
        super().leave_swarm(deadline)


MODE = LocalMode
