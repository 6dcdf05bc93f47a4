"""``mode="sync"``: one optimizer step per ``target_batch_size`` samples of the whole swarm.

Each ``step()`` adds ``grad * batch_size`` to CPU sums and reports ``(epoch, samples)`` to the
progress tracker (``opt.tracker``). Once the swarm's samples at this epoch reach the target,
the peers of that epoch average their mean gradients weighted by samples (one round
under ``{run_id}.grads.{epoch}``: peers of other epochs never join it), copy the result into
``.grad`` and call the inner optimizer: every member of the round applies the same update to
the same parameters, so they stay bit-identical. Then ``epoch += 1`` and the sums restart.

When is the target reached? The tracker's view lags by up to a refresh plus a publication
period, long enough for every peer to reach the target on its own count (4 peers x 16 samples
and a target of 64 made ~210 samples per step). So each peer *projects* the swarm's count:
the members of its last round began this epoch together with it (the round ended for all at
once), so each holds about our own count times its throughput relative to ours; another
peer at our epoch counts with its last report extrapolated at its throughput. A peer is
thus ready once its own count reaches its throughput's share of the target, and the peers
enter the round together, each with at most one local batch past its share.
``step_samples`` records what each global step held (the members' samples,
shared through the round).

What happens when a round does not go as planned:

- nobody else trains at our epoch or later (a lone peer, or the others fell behind): apply our
  own accumulated gradient and go on alone; peers that come back catch up by loading our state;
- someone is already past our epoch (we missed their round, or we are a late joiner): load the
  newest state from the donors (the peers with a ``checkpoint_dir`` serve theirs after every
  epoch) instead of stepping on stale parameters;
- others are at our epoch but no group formed in time: keep the gradients and keep
  accumulating; the next ``step()`` tries again.

Compression (``compression=``) is any codec or a ``TwoWayCompression`` (error feedback on
both directions, BytePS-Compress), or a ``compression.GraVAC`` controller, which then picks the
top-k factor of the sender side from the compression gain. ``dgc=True`` turns on Deep Gradient
Compression (``moshpit/training/dgc.py``; the inner optimizer must then be momentum-free SGD).
``delay_averaging=True`` runs epoch ``e``'s round in the background while the next batches are
computed and applies its result one step late (see docs/training.md, "sync").
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from compression import GraVAC, NoCompression, TwoWayCompression
from moshpit.averaging.averager import StepResult
from moshpit.training.errors import NoDonorError, StateDownloadError
from moshpit.training.grad_averager import GradientAverager, GradientRound, grads_prefix
from moshpit.training.modes.base import TrainingMode, params_of
from moshpit.training.modes.epoch_rounds import EpochRounds, wait_unless_left_behind
from moshpit.training.modes.options import SyncOptions
from moshpit.training.preemption import critical_section

if TYPE_CHECKING:
    from moshpit.training.optimizer import Optimizer

logger = logging.getLogger(__name__)

SHORT_EPOCHS_AFTER = 4  # epochs measured before judging whether rounds dominate
SHORT_EPOCHS_GOAL = 4.0  # suggest a target with compute >= 4x the round time


class SyncMode(TrainingMode):
    """Synchronous data parallelism over the swarm, with its knobs in ``SyncOptions``: one
    optimizer step per ``target_batch_size`` samples of the whole swarm, on the averaged
    gradient (raw, compressed, or DGC's sparse update)."""

    name = "sync"

    def __init__(self, optimizer: Optimizer, options: SyncOptions) -> None:
        super().__init__(optimizer)
        if optimizer.target_batch_size is None:  # the Optimizer checks this first
            raise ValueError("mode='sync' needs target_batch_size (samples per global step)")
        self.target = int(optimizer.target_batch_size)
        self.refresh_period = (
            float(options.refresh_period)
            if options.refresh_period is not None
            else optimizer.tracker.min_refresh_period
        )
        self.round_timeout = options.round_timeout
        self.delay_averaging = options.delay_averaging
        self.gravac: GraVAC | None = None
        compression = options.compression
        if isinstance(compression, GraVAC):
            self.gravac = compression
            compression = TwoWayCompression(compression.as_codec(), NoCompression())
        self.compression = compression
        self.dgc = None
        if options.dgc:
            from moshpit.training.dgc import DGC

            self.dgc = DGC(**(options.dgc_options or {}))
            if self.dgc.momentum_correction:
                for group in optimizer.inner.param_groups:
                    if group.get("momentum", 0) or group.get("nesterov", False):
                        raise ValueError(
                            "dgc=True keeps the momentum itself (momentum correction): give "
                            "it a momentum-free optimizer, e.g. torch.optim.SGD(params, lr=...), "
                            "and set dgc_options={'momentum': ...}"
                        )
        # a peer that missed one round can only come back by loading state from a donor:
        # without a checkpoint_dir, every peer serves its state from memory
        serve = optimizer.serve_from_memory and options.serve_state
        state_options: dict[str, Any] = {"serve_from_memory": serve}
        every = options.checkpoint_every_epochs
        if every is not None and (optimizer.checkpoint_dir is not None or serve):
            state_options["checkpoint_every_epochs"] = every
        # the state averager only checkpoints, serves and loads: gradients keep peers in sync
        self.state = optimizer.make_state_averager(optimizer.inner, **state_options)
        self.grads = GradientAverager(
            params_of(optimizer.inner),
            dht=optimizer.dht,
            run_id=optimizer.run_id,
            target_group_size=optimizer.target_group_size,
            config=dataclasses.replace(optimizer.averager_config, compression=None),
        )
        self._default_compression = optimizer.averager_config.compression
        self._last_refresh = -float("inf")
        self._next_catch_up = -float("inf")
        self._alone = False  # a round found nobody and the tracker shows nobody at our epoch
        self._pending: GradientRound | None = None  # delayed averaging: the round in flight
        self._dgc_snapshot: dict[str, Any] | None = None
        # counters (for users and tests)
        self.global_steps = 0
        # (seconds of compute before the round, seconds the round took) of recent epochs: a
        # swarm whose rounds cost more than its epochs' compute is told so, once
        self.epoch_times: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)
        self._epoch_began = time.monotonic()
        self._round_began: float | None = None
        self._warned_short_epochs = False
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        self.solo_steps = 0
        self.state_loads = 0
        self.last_result: Any = None
        self.last_group_size = 0
        self.bytes_sent = 0  # gradient payload bytes this peer sent, over all rounds
        # (epoch, samples the global step of that epoch held), for the most recent steps
        self.step_samples: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self.rounds = EpochRounds(str(optimizer.tracker.peer_id), optimizer.target_group_size)

    # ------------------------------------------------------------------ the loop

    def on_state_loaded(self) -> None:
        """New parameters: what we accumulated (and DGC/EF residuals) no longer applies."""
        self.grads.reset()
        if self.dgc is not None:
            self.dgc.reset()
        for spec in (self.compression, self._default_compression):
            if isinstance(spec, TwoWayCompression):
                spec.reset()
        if self.gravac is not None:
            self.gravac.reset()
        self.rounds.alone()
        self.report_progress(0)

    def step(self, batch_size: int) -> None:
        # the batch first: applying a finished delayed round overwrites and clears .grad
        self.grads.accumulate(batch_size)
        self._collect_delayed(wait=False)
        self.report_progress(self.grads.samples)
        view = self._view()
        if view.epoch > self.state.epoch:
            # two or more peers are past us (the tracker's rule): their parameters moved on
            if time.monotonic() >= self._next_catch_up:
                self._catch_up(f"the swarm is at epoch {view.epoch}")
            return
        if not self._ready(view):
            return
        self._global_step(view)

    def poll(self) -> bool:
        """Run the global step if the swarm reached the target, without adding samples.

        For a peer that has contributed its share and waits for the others (instead of
        computing more batches); returns True if the epoch moved on (stepped or caught up).
        """
        epoch = self.state.epoch
        with critical_section():
            self._collect_delayed(wait=False)
            view = self._view()
            if view.epoch > self.state.epoch:
                if time.monotonic() >= self._next_catch_up:
                    self._catch_up(f"the swarm is at epoch {view.epoch}")
            elif self.grads.samples > 0 and self._ready(view):
                self._global_step(view)
        return bool(self.state.epoch != epoch)

    def _ready(self, view: Any) -> bool:
        """Our own count alone, or the swarm's projected to now (module doc), reached the
        target."""
        if self.grads.samples >= self.target:
            return True
        # (a view older than our epoch still projects: its records are extrapolated)
        return view.epoch <= self.state.epoch and self.projected_samples(view) >= self.target

    def projected_samples(self, view: Any, now: float | None = None) -> float:
        """The swarm's samples at our epoch now, projected from ``view`` (module doc;
        ``EpochRounds.projected_samples``)."""
        return self.rounds.projected_samples(
            view, self.state.epoch, self.grads.samples, self.opt.tracker.samples_per_second, now
        )

    def _global_step(self, view: Any) -> None:
        epoch, samples = self.state.epoch, self.grads.samples
        view = self._fresh_view(view)
        same, ahead = self.rounds.others(view, epoch)
        if ahead:
            if time.monotonic() >= self._next_catch_up:
                self._catch_up(f"{len(ahead)} peer(s) are past epoch {epoch}")
            return
        if same:
            self._alone = False
        # alone only once a failed round confirmed it: the view may predate others' reports
        solo = self._alone
        self._collect_delayed(wait=True)
        update = self.grads.local_mean()
        num_peers = max(1, view.num_peers)
        self._dgc_snapshot = None
        if self.dgc is not None:
            if not solo and not self.delay_averaging:  # a failed round must not consume u, v
                self._dgc_snapshot = self.dgc.state_dict()
            update = self.dgc.compress(update, epoch, num_workers=num_peers)
        self.grads.load_buffers(update)
        if solo:
            self._apply(solo=True)
            return
        expected = self.rounds.expected(view, epoch)
        self._round_began = time.monotonic()
        round_ = self.grads.start_round(
            epoch,
            weight=samples,
            timeout=self.round_timeout,
            compression=self._codec(num_peers),
            gather={"peers": expected, "samples": samples},
            # wait for every peer we know at this epoch instead of leaving one behind
            min_group_size=expected,
        )
        if self.delay_averaging:
            # epoch e's round runs while the batches of e + 1 are computed; applied late
            self._pending = round_
            self._advance()
            return
        self._finish_round(round_)

    def _codec(self, num_peers: int) -> Any:
        if self.dgc is not None:
            from moshpit.training.dgc import dgc_compression

            return dgc_compression(self.dgc.core.density, num_peers)
        return self.compression if self.compression is not None else self._default_compression

    def flush(self) -> None:
        """Delayed averaging: wait for the round in flight and apply it (e.g. before eval)."""
        self._collect_delayed(wait=True)

    def _wait_for(self, round_: GradientRound) -> Any:
        """The round's result; a round whose epoch the swarm left before it found its group is
        abandoned."""
        averager = round_.averager
        if not wait_unless_left_behind(
            round_.future, round_.epoch, self.refresh_period, self._view, lambda: averager.in_group
        ):
            round_.cancel()
            reason = "the swarm moved on to a later epoch meanwhile"
            return StepResult(False, grads_prefix(self.opt.run_id, round_.epoch), reason=reason)
        return round_.result()

    def _finish_round(self, round_: GradientRound) -> None:
        started = time.monotonic()
        result = self._wait_for(round_)
        self.note_round(result, waited=time.monotonic() - started)
        self.last_result = result
        self.bytes_sent += result.bytes_sent
        if result.succeeded and result.averaged_fraction >= 1.0 and self.rounds.complete(result):
            self.rounds_succeeded += 1
            self.last_group_size = result.group_size
            self._note_step(round_.epoch, result)
            self._note_epoch_times()
            started = time.monotonic()
            self._apply()
            self.round_seconds["applied"] += time.monotonic() - started
            return
        if result.succeeded and result.averaged_fraction < 1.0:
            # parts kept local values (a reducer failed or its own input was bad): applying
            # them would make the members' parameters differ, so this round counts as failed
            logger.warning(
                "gradient round of epoch %d averaged only %.1f%% of the values (%s); retrying",
                round_.epoch,
                100 * result.averaged_fraction,
                result.reason or ", ".join(f"{p}: {w}" for p, w in result.excluded.items()),
            )
        self.rounds_failed += 1
        view = self._view(force=True)
        same, ahead = self.rounds.others(view, self.state.epoch)
        self.rounds.forget_unseen(view)
        if ahead:
            self._catch_up(f"no round at epoch {round_.epoch} ({result.reason}); others moved on")
        elif not same and not self.rounds.with_us(view, result):
            logger.info("no other peer at epoch %d: training alone", round_.epoch)
            self._alone = True
            self._apply(solo=True)
        else:
            # the others have not reached the target yet or arrived late: the sums are kept
            # (DGC takes back what it selected for this round, so nothing is lost); the time
            # spent waiting is not training time
            self.opt.tracker.mark_idle()
            if self.dgc is not None and self._dgc_snapshot is not None:
                self.dgc.load_state_dict(self._dgc_snapshot)
            logger.info("no gradient round at epoch %d (%s); retrying", round_.epoch, result.reason)
            self.waiting(
                f"its rounds do not hold every peer at the epoch ({result.reason}); waiting "
                f"for {len(self.rounds.awaited(view, self.state.epoch))} other peer(s)"
            )

    def _note_step(self, epoch: int, result: Any) -> None:
        """Record the samples the members put into this epoch's step, and who they were."""
        total = 0
        for claim in result.gathered.values():
            samples = claim.get("samples") if isinstance(claim, dict) else None
            if isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0:
                total += samples
        self.step_samples.append((epoch, total))

    def _apply(self, solo: bool = False) -> None:
        """The buffers hold this epoch's update: step the inner optimizer and move on."""
        self.grads.write_grads()
        self.opt.inner.step()
        self.opt.inner.zero_grad(set_to_none=True)
        if solo:
            self.solo_steps += 1
            self.step_samples.append((self.state.epoch, self.grads.samples))
        self._advance(None if solo else self.last_result)

    def _note_epoch_times(self) -> None:
        """Remember this epoch's compute and round time; say once when rounds dominate."""
        if self._round_began is None:
            return
        now = time.monotonic()
        compute = max(0.0, self._round_began - self._epoch_began)
        self.epoch_times.append((compute, now - self._round_began))
        if self._warned_short_epochs or len(self.epoch_times) < SHORT_EPOCHS_AFTER:
            return
        computes = sorted(c for c, _ in self.epoch_times)
        rounds = sorted(r for _, r in self.epoch_times)
        compute, round_ = computes[len(computes) // 2], rounds[len(rounds) // 2]
        if round_ <= compute:
            return
        self._warned_short_epochs = True
        suggested = int(self.target * SHORT_EPOCHS_GOAL * round_ / max(compute, 1e-3))
        logger.warning(
            "rounds take %.2f s (median of the last %d epochs) while an epoch's compute takes "
            "%.2f s: the swarm averages %.0f%% of the time. Raise target_batch_size (now %d) "
            "to about %d for rounds under a fifth of the time, or set delay_averaging=True to "
            "run each round beside the next epoch's batches",
            round_,
            len(self.epoch_times),
            compute,
            100 * round_ / (round_ + compute),
            self.target,
            suggested,
        )

    def _advance(self, result: Any = None) -> None:
        """Enter the next epoch (``result``: the round we stepped with, None if alone)."""
        self._epoch_began = time.monotonic()
        self._round_began = None
        self.global_steps += 1
        self.state.epoch += 1
        if result is not None and result.succeeded:
            self.rounds.stepped_with(result)
        else:
            self.rounds.alone()
        self.grads.reset()
        self.report_progress(0)
        if self._pending is None:  # delayed: checkpoint once the update is applied
            self.state.maybe_checkpoint()

    def checkpoint_if_due(self) -> None:
        if self._pending is None:  # delayed averaging: not while epoch e's update is missing
            super().checkpoint_if_due()

    def _collect_delayed(self, wait: bool) -> None:
        """Delayed averaging: apply the finished round of the previous epoch (one step late)."""
        round_ = self._pending
        if round_ is None or not (wait or round_.done()):
            return
        self._pending = None
        result = round_.result()
        self.note_round(result)
        self.last_result = result
        self.bytes_sent += result.bytes_sent
        if result.succeeded:
            self.rounds_succeeded += 1
            self.last_group_size = result.group_size
            self._note_step(round_.epoch, result)
            self.rounds.remember(result)
        else:
            # the epoch already moved on: apply our own part rather than lose it
            self.rounds_failed += 1
            logger.warning(
                "delayed round of epoch %d failed (%s): applying the local gradient",
                round_.epoch,
                result.reason,
            )
        self.grads.write_grads()
        self.opt.inner.step()
        self.opt.inner.zero_grad(set_to_none=True)
        self.report_progress(self.grads.samples)  # now at the epoch we entered
        self.state.maybe_checkpoint()

    def report_progress(self, samples: int) -> None:
        """With a delayed round in flight we entered epoch e + 1 but are still in round e:
        report e until it is applied, or peers that have not started round e yet would see
        us ahead and load state instead of joining it."""
        epoch = self.state.epoch - (1 if self._pending is not None else 0)
        self.opt.tracker.report(max(epoch, 0), samples)

    def _catch_up(self, why: str) -> None:
        """Load the swarm's newest state instead of stepping on stale parameters."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        logger.info("epoch %d is behind (%s): loading state from peers", self.state.epoch, why)
        before = self.state.epoch
        tracker = self.opt.tracker
        tracker.set_catching_up(max(tracker.global_progress.epoch, before + 1))
        try:
            self.state.synchronize(again=True)
        except (NoDonorError, StateDownloadError) as e:  # donors gone, slow or failing
            logger.warning("could not load state (%s): keeping ours, looking again later", e)
        finally:
            tracker.set_catching_up(None)
        if self.state.epoch != before:
            self.state_loads += 1
        else:  # no donor serves a newer state yet: look again a little later, not every step
            self._next_catch_up = time.monotonic() + max(1.0, 2 * self.refresh_period)
            self.waiting(f"the swarm moved on ({why}) and no donor served its newer state yet")
        self.on_state_loaded()

    # ------------------------------------------------------------------ state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.dgc is not None:
            state["dgc"] = self.dgc.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dgc is not None and "dgc" in state:
            self.dgc.load_state_dict(state["dgc"])

    def leave_swarm(self, deadline: float) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        super().leave_swarm(deadline)

    def shutdown(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        super().shutdown()


MODE = SyncMode
