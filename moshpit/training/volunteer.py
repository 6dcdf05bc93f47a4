"""The loop a volunteer runs: train with the swarm until told to stop, reporting as it goes.

``moshpit train`` is this loop plus a command line (joining, checkpoints, a live table); a
script of your own can run it too. It keeps the loop's own rules in one place: a failed state
download is a warning, not the end (the next round tries again); the pace can be capped
(``max_rate``: a shared machine stays responsive); progress is reported every
``report_every`` seconds with the samples/s of this peer's own count. Preemption
(:class:`~moshpit.training.preemption.Preempted`) and a state that cannot be trained on
(non-finite with nothing good to reload, another model's state) end it by raising.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from moshpit.training.errors import NoDonorError, StateDownloadError

__all__ = ["LoopLimits", "LoopProgress", "RateCap", "run_volunteer_loop"]

LOSS_EMA = 0.9  # weight of the older losses in the reported moving average
# seconds of samples a capped loop may make up after a stall (an averaging round, a state
# download): a cap is a cap, not an average to be reached over the whole run
RATE_SLACK = 0.1


class RateCap:
    """Paces a loop to at most ``rate`` samples per second.

    Paced against the loop's start alone, a loop that stalled (an averaging round, a state
    download) then ran uncapped until it had caught up: a peer capped at 800 samples/s made
    bursts of its full speed after every round, and published ~1900 samples/s (its samples/s
    leaves the stalls out, as it should; the bursts stayed in). Here a stall moves the
    baseline on, so that at most ``slack`` seconds' worth is made up."""

    def __init__(
        self, rate: float, slack: float = RATE_SLACK, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not rate > 0 or not slack >= 0:
            raise ValueError(f"rate must be > 0 and slack >= 0, got {rate!r} and {slack!r}")
        self.rate, self.slack, self._clock = rate, slack, clock
        self._since = clock()  # when the samples counted would have started at the cap

    def pause(self, samples: int) -> float:
        """Seconds to wait before going on, ``samples`` (cumulative) made so far."""
        now = self._clock()
        due = self._since + samples / self.rate
        behind = now - due
        if behind > self.slack:  # a stall: do not make it up
            self._since += behind - self.slack
        return max(0.0, due - now)


@dataclass(frozen=True)
class LoopLimits:
    """When the loop stops and how fast it may go (0: no limit)."""

    max_steps: int = 0
    duration: float = 0.0
    max_rate: float = 0.0  # samples per second
    report_every: float = 1.0

    def done(self, steps: int, seconds: float) -> bool:
        return bool(
            (self.max_steps and steps >= self.max_steps)
            or (self.duration and seconds >= self.duration)
        )


@dataclass
class LoopProgress:
    """What the loop has done so far (a report, and its result)."""

    steps: int = 0
    samples: int = 0
    loss: float | None = None  # moving average of the step losses
    started: float = field(default_factory=time.monotonic)

    def samples_per_second(self, now: float) -> float:
        return self.samples / max(now - self.started, 1e-9)


def run_volunteer_loop(
    opt: Any,
    model: torch.nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    limits: LoopLimits,
    *,
    report: Callable[[LoopProgress], None],
    warn: Callable[[str], None],
    stop: threading.Event | None = None,
    progress: LoopProgress | None = None,
) -> LoopProgress:
    """Train ``model`` with ``opt`` (a ``moshpit.Optimizer``) on ``batches`` until ``limits``
    or ``stop`` say so; ``report`` gets the progress every ``limits.report_every`` seconds
    and at the end, ``warn`` one line per recoverable problem. ``progress`` (filled in as it
    goes) lets a caller read the counts after the loop ended by raising (a preemption)."""
    progress = LoopProgress() if progress is None else progress
    # -inf, not 0: monotonic time starts near 0 at boot, and on a machine up for less than
    # report_every seconds the first step's report was skipped
    last_report = -math.inf
    stop = threading.Event() if stop is None else stop
    cap = RateCap(limits.max_rate) if limits.max_rate else None
    while not stop.is_set():
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        value = loss.item()
        try:
            opt.step(loss=value)
        except (NoDonorError, StateDownloadError) as e:
            # joining or catching up failed this time (donors left or were too slow): keep
            # our state and train on; the next averaging round tries to catch up again
            warn(f"could not load the swarm's state ({e}); training on, will retry")
        opt.zero_grad()
        progress.steps += 1
        progress.samples += batch_size
        old = progress.loss
        progress.loss = value if old is None else LOSS_EMA * old + (1 - LOSS_EMA) * value
        now = time.monotonic()
        done = limits.done(progress.steps, now - progress.started)
        if done or now - last_report >= limits.report_every:
            last_report = now
            report(progress)
        if done:
            break
        if cap is not None:
            ahead = cap.pause(progress.samples)
            if ahead > 0:
                stop.wait(min(ahead, 1.0))  # a stop cuts the pause short
    return progress
