"""What every training mode provides to ``moshpit.Optimizer``."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from dht._logging import RateLimitedLogger
from dht.kademlia.clock import get_dht_time
from moshpit.training.health import first_non_finite

if TYPE_CHECKING:
    from moshpit.training.optimizer import Optimizer
    from moshpit.training.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)

FRESH_VIEW = 0.1  # s: an older view is read again before an epoch's round starts from it
# an epoch that has waited this long (failed rounds, no donor) says why, once a minute
WAIT_WARNING_AFTER = 30.0


class TrainingMode:
    """One way of training with the swarm. ``Optimizer.step()`` calls :meth:`step` after the
    user's ``backward()`` (gradients checked finite), inside a preemption critical section.

    Subclasses set ``self.state`` (a TrainingStateAverager: what is checkpointed and served to
    joiners) in ``__init__``, using ``optimizer.make_state_averager(...)``.
    """

    name = "base"
    state: TrainingStateAverager  # set by every subclass's __init__

    def __init__(self, optimizer: Optimizer) -> None:
        self.opt = optimizer
        self.refresh_period = 0.5  # modes that read the swarm's progress set their own
        self._last_refresh = -float("inf")
        # where rounds spend time, summed over rounds: the training thread's wait for a round
        # to finish ("waited"), and inside the rounds matchmaking and all-reduce (from each
        # StepResult), then applying the result to the model ("applied")
        self.round_seconds = {"waited": 0.0, "matchmaking": 0.0, "allreduce": 0.0, "applied": 0.0}
        self._waiting_since: tuple[int, float] | None = None  # (epoch, first wait in it)
        self._wait_log = RateLimitedLogger(logger, 60.0)

    def waiting(self, why: str) -> None:
        """The epoch did not move this time (a round without everyone, no donor for the
        swarm's newer state). Once that has lasted ``WAIT_WARNING_AFTER`` s, say why in a
        WARNING, at most once a minute: a swarm that stops must not stop silently."""
        epoch, now = self.state.epoch, time.monotonic()
        if self._waiting_since is None or self._waiting_since[0] != epoch:
            self._waiting_since = (epoch, now)
        lasted = now - self._waiting_since[1]
        if lasted >= WAIT_WARNING_AFTER:
            self._wait_log.warning(
                "waiting", "epoch %d has not moved for %.0f s: %s", epoch, lasted, why
            )

    def note_round(self, result: Any, waited: float = 0.0) -> None:
        """Add one round's times to :attr:`round_seconds`."""
        times = self.round_seconds
        times["waited"] += waited
        times["matchmaking"] += float(getattr(result, "matchmaking_seconds", 0.0) or 0.0)
        times["allreduce"] += float(getattr(result, "allreduce_seconds", 0.0) or 0.0)

    def on_start(self) -> None:
        """Before the first step: catch up with the swarm (load state if it is ahead)."""
        self.state.synchronize()
        self.on_state_loaded()

    def on_state_loaded(self) -> None:
        """After the state was replaced by a checkpoint or a donor's (reset local buffers)."""

    def non_finite_state(self) -> str | None:
        """The name of a state tensor holding NaN/Inf (None: all finite)."""
        return first_non_finite(self.state._named_state())

    def recover(self, why: str) -> None:
        """Reload a good state after this peer's went non-finite (see TrainingStateAverager)."""
        self.state.recover(why)
        self.on_state_loaded()

    def step(self, batch_size: int) -> None:
        raise NotImplementedError

    def checkpoint_if_due(self) -> None:
        """After every step: write the checkpoint that is due, if the state is whole now.

        Modes also check at each epoch change, but a checkpoint due while the previous one
        was still being written is skipped there; if the epoch then stops moving (the swarm
        waits for peers that must load this very state), nothing would ever write it, and
        the peers behind would wait for a donor of it forever."""
        self.state.maybe_checkpoint()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.inner.zero_grad(set_to_none=set_to_none)

    def _view(self, force: bool = False) -> Any:
        """The swarm's progress, read from the DHT at most every ``refresh_period`` s."""
        now = time.monotonic()
        if force or now - self._last_refresh >= self.refresh_period:
            self._last_refresh = now
            try:
                return self.opt.tracker.refresh(timeout=self.opt.tracker.request_timeout * 2)
            except Exception as e:  # noqa: BLE001 - a failed read: use the last view
                logger.debug("progress refresh failed (%r); using the last view", e)
        return self.opt.tracker.global_progress

    def _fresh_view(self, view: Any) -> Any:
        """``view``, read again if older than ``FRESH_VIEW`` s: who an epoch's round must
        hold comes from it (one DHT read per epoch; a stale or partial view lets a group
        start without a peer)."""
        if get_dht_time() - view.time > FRESH_VIEW:
            return self._view(force=True)
        return view

    def report_progress(self, samples: int) -> None:
        self.opt.tracker.report(self.state.epoch, samples)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def leave_swarm(self, deadline: float) -> None:
        self.state.leave_swarm(deadline)

    def shutdown(self) -> None:
        state = getattr(self, "state", None)  # None: the subclass's __init__ failed first
        if state is not None:
            state.shutdown()


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
