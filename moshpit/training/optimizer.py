"""``moshpit.Optimizer``: a plain PyTorch loop that trains with the swarm.

The user's loop changes in one place (the optimizer)::

    opt = moshpit.Optimizer(optimizer=torch.optim.Adam(model.parameters()), dht=dht,
                            run_id="my-run", batch_size_per_step=32, target_batch_size=4096)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

What ``step()`` does depends on the mode (``moshpit/training/modes/``):

- ``sync``: accumulate gradients until the swarm has processed ``target_batch_size`` samples,
  then average them (weighted by samples) and apply one identical optimizer step everywhere;
- ``local``: local steps, with background parameter averaging every H steps, H adapted as in
  ADPSGD;
- ``diloco``: H inner steps, then an outer Nesterov step on the averaged pseudo-gradient.

Common to every mode: a :class:`~moshpit.training.progress.ProgressTracker` under ``run_id``, a
:class:`~moshpit.training.state_averager.TrainingStateAverager` that checkpoints the state,
serves it to joiners and loads it when this peer is new or behind, and a gradient check that
keeps a diverged peer (NaN/Inf gradients) from publishing anything.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dht._logging import RateLimitedLogger
from moshpit.averaging.config import AveragerConfig
from moshpit.training.health import NonFiniteStateError
from moshpit.training.modes.options import ModeOptions, options_for
from moshpit.training.preemption import critical_section

if TYPE_CHECKING:
    from dht.facade import DHT
    from moshpit.training.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)

LOSS_EMA = 0.9  # weight kept by the older losses in the loss this peer publishes

__all__ = ["MODES", "Optimizer"]

MODES = ("sync", "local", "diloco")
# every Optimizer of this process, held weakly: monitoring (moshpit.metrics) reads its
# counters (local_steps, samples_processed, the tracker's samples/s) from here when scraped
live_optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def _check_arguments(
    optimizer: Any,
    dht: Any,
    run_id: Any,
    batch_size_per_step: Any,
    target_batch_size: Any,
    mode: str,
) -> None:
    """Fail on what the user got wrong before anything starts, with what to write instead."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (e.g. torch.optim.Adam(model."
            f"parameters())), got {type(optimizer).__name__}"
        )
    if not hasattr(dht, "run_coroutine"):
        raise TypeError("dht must be a running moshpit.DHT")
    if not isinstance(run_id, str) or not run_id or any(c in run_id for c in " \n["):
        raise ValueError(f"run_id must be a non-empty name without spaces, got {run_id!r}")
    _check_positive_int("batch_size_per_step", batch_size_per_step)
    if target_batch_size is not None:
        _check_positive_int("target_batch_size", target_batch_size)
        if target_batch_size < batch_size_per_step:
            raise ValueError(
                f"target_batch_size ({target_batch_size}) is smaller than "
                f"batch_size_per_step ({batch_size_per_step}): the swarm's batch must hold "
                "at least one local batch"
            )
    if mode == "sync" and target_batch_size is None:
        raise ValueError("mode='sync' needs target_batch_size (samples per global step)")


class Optimizer:
    """Wraps ``optimizer`` so that ``step()`` trains with every peer of ``run_id``.

    :param optimizer: the local ``torch.optim.Optimizer`` (the inner optimizer in ``diloco``).
    :param dht: a running ``moshpit.DHT``.
    :param run_id: the run's name: peers with the same ``run_id`` train one model together.
    :param batch_size_per_step: samples this peer processes per ``step()`` (override per call
      with ``step(batch_size=...)``).
    :param target_batch_size: ``sync``: samples the whole swarm accumulates per optimizer step
      (must be >= ``batch_size_per_step``).
    :param mode: ``"local"``, ``"sync"`` or ``"diloco"``, or a mode with its knobs
      (``moshpit.DiLoCoOptions(inner_steps=50)``, ``SyncOptions``, ``LocalOptions``). Unset:
      ``"local"`` (the mode that never waits for the network: where to start), or ``"sync"``
      when ``target_batch_size`` is given, whose meaning is sync's (as before ``local`` became
      the default).
    :param checkpoint_dir: where checkpoints go (and what this peer serves to joiners); a
      restarted peer given the same directory resumes from its newest intact checkpoint.
    :param checkpoint_every_seconds: also write a checkpoint this often (None: at the mode's
      epochs only, see ``checkpoint_every_epochs`` below).
    :param serve_from_memory: without a ``checkpoint_dir``, serve the state of those epochs
      from memory (one CPU copy of it), so that a peer that fell behind can load it from the
      others; False: a peer without a ``checkpoint_dir`` serves nothing (a laggard then waits
      ``load_state_timeout`` and steps alone).
    :param extra_tensors: more state to keep in sync (e.g. ``model.buffers()``).
    :param target_group_size: Moshpit group size of every averaging round.
    :param averager_options: more options for the averagers (timeouts, bandwidth, ...): an
      :class:`~moshpit.AveragerConfig` or a dict of its field names, checked here.
    :param load_state_timeout: how long a newcomer waits for donors before training alone.
    :param progress_ttl: seconds a peer's progress record lives in the DHT: a peer that dies
      stops counting toward the swarm's epoch and batch after at most this long.
    :param name: this peer's display name on the run's dashboard (``moshpit dashboard``),
      published with its progress: at most 32 printable characters, or None (the default).
    :param mode_options: the mode's own knobs as keyword arguments (on top of a ``mode``
      given as options): the fields of ``SyncOptions``, ``LocalOptions`` or
      ``DiLoCoOptions`` (``moshpit.training.modes.options``), e.g. ``inner_steps=50``.
      An unknown one is a ``TypeError`` naming the ones the mode takes. The
      [training guide](training.md) explains each.
    """

    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        dht: DHT,
        run_id: str,
        batch_size_per_step: int,
        target_batch_size: int | None = None,
        mode: str | ModeOptions | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every_seconds: float | None = None,
        serve_from_memory: bool = True,
        extra_tensors: Iterable[torch.Tensor] = (),
        target_group_size: int = 16,
        averager_options: AveragerConfig | Mapping[str, Any] | None = None,
        load_state_timeout: float = 30.0,
        progress_ttl: float = 30.0,
        name: str | None = None,
        **mode_options: Any,
    ) -> None:
        if mode is None:
            mode = "sync" if target_batch_size is not None else "local"
        # the mode's knobs, checked before anything starts (a typo is a TypeError here)
        options = options_for(mode, **mode_options)
        mode = options.mode
        _check_arguments(optimizer, dht, run_id, batch_size_per_step, target_batch_size, mode)
        self.inner = optimizer
        self.dht = dht
        self.run_id = run_id
        self.batch_size_per_step = batch_size_per_step
        self.target_batch_size = target_batch_size
        self.mode_name = mode
        self.mode_options = options
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self.serve_from_memory = serve_from_memory
        self.extra_tensors = list(extra_tensors)
        self.target_group_size = target_group_size
        self.averager_config = AveragerConfig.build(averager_options)
        self.load_state_timeout = float(load_state_timeout)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.skipped_steps = 0  # local steps dropped for non-finite gradients
        self.local_steps = 0  # step() calls whose batch went into training (counters for
        self.samples_processed = 0  # users and benchmarks: what happened, not what was asked)
        self.loss: float | None = None  # moving average of the losses step() was given
        self._log = RateLimitedLogger(logger, 10.0)  # one line per reason and 10 s, with counts
        self._closed = False
        self._started = False

        from moshpit.training.modes import make_mode
        from moshpit.training.progress import ProgressTracker

        self.tracker = ProgressTracker(
            dht, run_id, target_batch_size=target_batch_size, ttl=progress_ttl, name=name
        )
        try:
            self.mode = make_mode(options, self)
        except BaseException:
            self.tracker.shutdown()
            raise
        # peers of the run with another model are left out of the progress view: no mode
        # waits for them in a round or counts their samples toward the target batch
        self.tracker.set_schema(*self.mode.state.schema_digest())
        live_optimizers.add(self)

    # ------------------------------------------------------------------ the shared state

    def make_state_averager(
        self, optimizer: torch.optim.Optimizer, **options: Any
    ) -> TrainingStateAverager:
        """A TrainingStateAverager for ``optimizer`` with this Optimizer's common settings."""
        from moshpit.training.state_averager import TrainingStateAverager

        settings: dict[str, Any] = dict(
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every_seconds=self.checkpoint_every_seconds,
            serve_from_memory=self.serve_from_memory,
            join_timeout=self.load_state_timeout,
            config=self.averager_config,
            extra_tensors=self.extra_tensors,
        )
        settings.update(options)  # a mode's own (local mode adds its period to extra_tensors)
        return TrainingStateAverager(
            dht=self.dht,
            optimizer=optimizer,
            prefix=self.run_id,
            target_group_size=self.target_group_size,
            **settings,
        )

    @property
    def serves_state(self) -> bool:
        """Whether this peer serves its state to joiners and laggards: from its
        ``checkpoint_dir``, or without one from memory (``serve_from_memory``)."""
        return self.checkpoint_dir is not None or self.serve_from_memory

    @property
    def state(self) -> TrainingStateAverager:
        """The mode's TrainingStateAverager (what checkpoints and joiners see)."""
        return self.mode.state

    @property
    def epoch(self) -> int:
        """The global step number this peer is at."""
        return int(self.mode.state.epoch)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    # ------------------------------------------------------------------ the loop

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        loss: Any = None,
    ) -> Any:
        """One local step: see the module docstring for what each mode does with it.

        ``loss`` (or what ``closure`` returns): this step's loss, a number or a 0-d tensor;
        optional. Its moving average is published with this peer's progress, so that
        ``moshpit status`` shows the swarm's loss and flags a peer whose loss is NaN.

        A peer whose parameters or optimizer state went NaN/Inf reloads a good state (the
        swarm's, or its own last good checkpoint) with one WARNING and goes on; it raises
        :class:`~moshpit.training.health.NonFiniteStateError` only when there is none, or when
        the state keeps going bad.
        """
        if self._closed:
            raise RuntimeError("this moshpit.Optimizer was shut down")
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch_size = self.batch_size_per_step if batch_size is None else batch_size
        _check_positive_int("batch_size", batch_size)
        if not self._started:
            self._started = True
            self.mode.on_start()
            # this first batch was computed before the start (which reported 0 samples)
            self.tracker.discard_next_interval()
        if loss is not None:
            self._note_loss(loss)
        if not self._gradients_finite():
            bad = self.mode.non_finite_state()
            if bad is not None:  # the gradients are NaN because the state is
                self._recover(f"tensor {bad!r} of the state held NaN or Inf")
            else:
                self.skipped_steps += 1
                self._log.warning(
                    "gradients",
                    "non-finite gradients at epoch %d: the step is dropped and nothing is sent "
                    "(%d dropped so far). The parameters are finite, so this batch or the loss "
                    "made them: check the data and the loss function, or lower the learning "
                    "rate if the loss was growing",
                    self.epoch,
                    self.skipped_steps,
                )
            self.zero_grad()
            return loss
        with critical_section():
            try:
                self.mode.step(batch_size)
                self.mode.checkpoint_if_due()
            except NonFiniteStateError as e:  # a round or checkpoint found the state bad
                self._recover(str(e))
            self.local_steps += 1
            self.samples_processed += batch_size
        self.tracker.report_health(checkpoint_failures=self.mode.state.failing_checkpoints)
        return loss

    def _note_loss(self, loss: Any) -> None:
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if not math.isfinite(value):
            self.tracker.report_health(finite=False)
            return
        self.loss = value if self.loss is None else LOSS_EMA * self.loss + (1 - LOSS_EMA) * value
        self.tracker.report_health(loss=self.loss, finite=True)

    def _recover(self, why: str) -> None:
        """Replace a non-finite state by a good one (see :meth:`step`)."""
        with critical_section():
            self.mode.recover(why)
        self.loss = None  # the losses so far belong to the state that went bad
        self.tracker.report_health(finite=True)

    def _gradients_finite(self) -> bool:
        """One host sync per step (a per-parameter ``bool()`` would stall a GPU once each)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return True
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(torch.isfinite(g).all())
        return all(bool(torch.stack(flags).all()) for flags in by_device.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mode.zero_grad(set_to_none)

    def load_state_from_peers(self, timeout: float | None = None) -> int:
        """Adopt the swarm's newest state now; returns its epoch (see TrainingStateAverager)."""
        epoch = self.mode.state.load_state_from_peers(
            timeout=self.load_state_timeout if timeout is None else timeout
        )
        self.mode.on_state_loaded()
        return int(epoch)

    # ------------------------------------------------------------------ state_dict

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "inner": self.inner.state_dict(),
            "mode": self.mode_name,
            "mode_state": self.mode.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode_name:
            raise ValueError(
                f"this state_dict was saved in mode {state.get('mode')!r}, not {self.mode_name!r}"
            )
        self.inner.load_state_dict(state["inner"])
        self.mode.load_state_dict(state.get("mode_state", {}))
        self.mode.state.epoch = int(state["epoch"])

    # ------------------------------------------------------------------ lifecycle

    def leave_swarm(self, deadline: float = 25.0) -> None:
        """Leave within ``deadline`` s (what ``moshpit.handle_preemption`` calls)."""
        if self._closed:
            return
        try:
            self.mode.leave_swarm(deadline)  # raises CheckpointError if the last save failed
        finally:  # ... after which the records are still withdrawn and everything shut down
            try:
                self.tracker.withdraw()
            except (RuntimeError, TimeoutError) as e:
                logger.info("could not withdraw the progress record: %s", e)
            self.shutdown()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.mode.shutdown()
        finally:
            self.tracker.shutdown()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
