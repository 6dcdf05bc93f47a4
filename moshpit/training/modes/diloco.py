"""``mode="diloco"``: H inner steps, then one outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (Douillard et al., arXiv 2311.08105). Every peer holds the shared parameters ``θ`` (CPU
float32 copies) and the outer optimizer's momentum; both live in the mode's
TrainingStateAverager (built over the outer optimizer), so checkpoints and joiners get exactly
them. The inner optimizer (the one the user passed, AdamW in the paper) and its statistics stay
local.

One outer round, after ``inner_steps`` local steps:

1. ``Δ = θ - θ_local`` (the pseudo-gradient) into CPU buffers;
2. ``Δ`` is averaged (weighted by the samples each peer processed this round) with the peers
   of the same outer epoch: each epoch has its own averaging prefix ``{run_id}.outer.{epoch}``,
   so a peer that missed rounds never mixes a stale ``Δ`` into the others' round;
   ``compression=`` compresses it on the wire (``"fp16"``, ``"8bit"``, ``"4bit"``, ``"topk"``
   with error feedback on both directions, any codec / ``TwoWayCompression``, or a ``compression.GraVAC``
   controller that picks the top-k factor from the compression gain);
3. ``θ.grad = mean Δ``, outer step (SGD, ``outer_lr`` 0.7, ``outer_momentum`` 0.9, Nesterov:
   the paper's defaults), and ``θ`` is copied into the model. Every member of the round gets the
   same mean ``Δ`` (each reducer uses the decoded value it sends), so peers that started the
   round from the same ``θ`` and momentum end it bit-identical.

When a round does not go as planned:

- someone is past our epoch (we missed rounds, or joined late): load ``θ`` + momentum from the
  donors (every peer serves its state after every outer step, from its ``checkpoint_dir`` or
  else from memory) and restart the inner loop from it, instead of applying a stale
  pseudo-gradient; while no donor serves the newer epoch, keep training and look again, and
  only after ``load_state_timeout`` apply our own ``Δ`` alone;
- nobody else trains at our epoch (a lone peer): after a round that found nobody, apply our own
  ``Δ`` and go on alone;
- others are at our epoch but no group formed in time: keep training and retry the round at
  the next ``step()``.

The epoch counts outer steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from compression import (
    Blockwise4Bit,
    Codec,
    ErrorFeedback,
    Float16,
    GraVAC,
    TopK,
    TopK2Bit,
    TwoWayCompression,
    Uniform8Bit,
)
from moshpit.averaging.allreduce_protocol import MAX_WEIGHT
from moshpit.averaging.averager import Averager, StepResult
from moshpit.averaging.matchmaking import SchemaMemory
from moshpit.averaging.uplink_meter import UplinkMeter
from moshpit.training.errors import NoDonorError, StateDownloadError
from moshpit.training.health import first_non_finite
from moshpit.training.modes.base import TrainingMode, params_of
from moshpit.training.modes.epoch_rounds import (
    RECENT_STEPS,
    EpochRounds,
    wait_unless_left_behind,
)
from moshpit.training.modes.options import DiLoCoOptions
from moshpit.training.modes.streaming import FragmentRound, split_fragments

if TYPE_CHECKING:
    from moshpit.training.optimizer import Optimizer

logger = logging.getLogger(__name__)

__all__ = ["DiLoCoMode", "outer_prefix"]

COMPRESSION_NAMES = ("none", "fp16", "8bit", "4bit", "topk", "sparse2bit")
DEFAULT_INNER_STEPS = 500


def outer_prefix(run_id: str, epoch: int) -> str:
    """The averaging prefix of outer epoch ``epoch`` (one key space per epoch)."""
    return f"{run_id}.outer.{int(epoch)}"


class _RegroupingFeedback(ErrorFeedback):
    """Error feedback whose keys (flat ranges of the all-reduce) may change shape.

    The butterfly all-reduce keys residuals by ``(part, chunk)``; when the group's size changes
    the ranges move and a residual no longer fits its key. It is dropped (logged) instead of
    failing the round: what it held is lost once, the invariant holds again from there on.
    """

    # streaming DiLoCo: the fragment whose round compresses now. Its keys are flat ranges of
    # the fragment's own tensors, so two fragments' ranges coincide and would share (and
    # mix) residuals; keys are stored as (scope, key) to keep each fragment's apart.
    scope = 0

    def residual(self, key: Any) -> torch.Tensor | None:
        return super().residual((self.scope, key))

    def compress_with_decoded(self, tensor: torch.Tensor, key: Any, **kwargs: Any) -> Any:
        residual = self.residual(key)
        if residual is not None and (
            residual.shape != tensor.shape or residual.device != tensor.device
        ):
            logger.debug("error-feedback key %r changed shape (new group): residual dropped", key)
            self.reset((self.scope, key))
        return super().compress_with_decoded(tensor, (self.scope, key), **kwargs)

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | str | None = None
    ) -> None:
        """As saved, with a checkpoint from before fragment scopes (keys ``(start, end)``
        instead of ``(scope, (start, end))``) read as scope 0: their residuals still meet the
        ranges they were kept for, instead of never matching again."""
        residuals = state.get("residuals") if isinstance(state, dict) else None
        if isinstance(residuals, dict):
            state = {**state, "residuals": {_scoped(k): v for k, v in residuals.items()}}
        super().load_state_dict(state, device)


def _scoped(key: Any) -> Any:
    """``(start, end)`` (unscoped, an older checkpoint's) -> ``(0, (start, end))``."""
    if isinstance(key, tuple) and len(key) == 2 and not isinstance(key[1], tuple):
        return (0, key)
    return key


def _regrouping_sides(spec: TwoWayCompression) -> None:
    """A user's own TwoWayCompression gets what the named ones have (in place, residuals
    kept): keys scoped per streaming fragment, residuals dropped when a group's size moves
    the ranges instead of failing the round."""
    for side in ("sender", "reducer"):
        feedback = getattr(spec, side)
        if type(feedback) is ErrorFeedback:
            scoped = _RegroupingFeedback(feedback.codec, feedback.max_keys, feedback.decay)
            # the same tensors, on their devices, under scope 0 (no copy through the CPU)
            scoped.restore({_scoped(k): r for k, r in feedback.snapshot().items()})
            setattr(spec, side, scoped)


def _two_way(sender: Codec, reducer: Codec) -> TwoWayCompression:
    spec = TwoWayCompression(sender, reducer)
    spec.sender = _RegroupingFeedback(sender)
    spec.reducer = _RegroupingFeedback(reducer)
    return spec


def make_compression(
    compression: Any,
    topk_density: float,
    reducer_density: float | None = None,
    error_decay: float = 1.0,
) -> tuple[Any, GraVAC | None]:
    """(what the averager gets, the GraVAC controller if any) for the ``compression=`` knob;
    the sparse codecs' reducers keep ``reducer_density`` (default ``topk_density``), and the
    members' own error feedback decays by ``error_decay`` a round (SparseLoCo's beta)."""
    spec, gravac = _compression(compression, topk_density, reducer_density)
    if error_decay != 1.0:
        if not isinstance(spec, TwoWayCompression):
            raise ValueError(
                f"error_feedback_decay={error_decay!r} needs a compression with error "
                f"feedback ('8bit', '4bit', 'topk', 'sparse2bit', a TwoWayCompression or a "
                f"GraVAC), not {compression!r}"
            )
        spec.sender.decay = error_decay  # checked there
    return spec, gravac


def _compression(
    compression: Any, topk_density: float, reducer_density: float | None
) -> tuple[Any, GraVAC | None]:
    if compression is None or compression == "none":
        return None, None
    if isinstance(compression, str):
        if compression == "fp16":
            return Float16(), None
        if compression == "8bit":
            return _two_way(Uniform8Bit(outliers=False), Uniform8Bit(outliers=False)), None
        if compression == "4bit":
            return _two_way(Blockwise4Bit(), Blockwise4Bit()), None
        if compression in ("topk", "sparse2bit"):
            if not 0 < topk_density <= 1:
                raise ValueError(f"topk_density must be in (0, 1], got {topk_density!r}")
            back = topk_density if reducer_density is None else reducer_density
            if not 0 < back <= 1:
                raise ValueError(f"reducer_density must be in (0, 1], got {back!r}")
            if compression == "sparse2bit":  # top-k of every 4096 values, 2 bits each
                return _two_way(TopK2Bit(topk_density), TopK2Bit(back)), None
            return _two_way(TopK(topk_density), TopK(back)), None
        raise ValueError(
            f"compression must be one of {', '.join(map(repr, COMPRESSION_NAMES))}, a codec, a "
            f"TwoWayCompression or a GraVAC controller; got {compression!r}"
        )
    if isinstance(compression, GraVAC):
        # the same controller on both directions: the factor follows the gain of what is sent
        adaptive = compression.as_codec()
        return _two_way(adaptive, adaptive), compression
    if isinstance(compression, TwoWayCompression):
        _regrouping_sides(compression)
        return compression, None
    if isinstance(compression, Codec):
        return compression, None
    raise TypeError(
        f"compression must be a name, a codec, a TwoWayCompression or a GraVAC controller, "
        f"not {type(compression).__name__}"
    )


class DiLoCoMode(TrainingMode):
    """DiLoCo with its knobs in ``DiLoCoOptions``: ``inner_steps`` (H, default 500) or the
    Optimizer's ``target_batch_size`` (swarm-wide epochs), the outer Nesterov step, the
    pseudo-gradient's codec, and streaming DiLoCo when ``fragments`` or ``overlap_steps`` is
    set (see ``streaming.py``; an epoch is then one fragment's round)."""

    name = "diloco"

    def __init__(self, optimizer: Optimizer, options: DiLoCoOptions) -> None:
        super().__init__(optimizer)
        # swarm-wide epochs: an outer step per target_batch_size samples of the whole swarm
        self.target: int | None = optimizer.target_batch_size
        if self.target is not None and options.inner_steps is not None:
            raise ValueError(
                "mode='diloco' takes target_batch_size (an outer step whenever the whole "
                "swarm processed that many samples; peers of any speed) or inner_steps (an "
                "outer step after that many inner steps of every peer), not both"
            )
        inner_steps = options.inner_steps or DEFAULT_INNER_STEPS
        self.inner_steps = inner_steps
        self.round_timeout = options.round_timeout
        self.refresh_period = (
            float(options.refresh_period)
            if options.refresh_period is not None
            else optimizer.tracker.min_refresh_period
        )
        knobs = (options.topk_density, options.reducer_density, options.error_feedback_decay)
        self.compression, self.gravac = make_compression(options.compression, *knobs)
        self.local_error_feedback = options.local_error_feedback
        self.params = params_of(optimizer.inner)
        self.fragments = split_fragments([p.numel() for p in self.params], options.fragments)
        overlap_steps = self.overlap_steps = options.overlap_steps
        # streaming: one fragment's round every inner_steps / fragments steps, in the background
        self.streaming = len(self.fragments) > 1 or overlap_steps > 0
        self.period = max(1, inner_steps // len(self.fragments)) if self.streaming else inner_steps
        # swarm-wide: a (fragment's) round every round_target samples of the swarm, always in
        # the background (a peer that is ready early trains on while the slower ones arrive)
        self.swarm_wide = self.target is not None
        self.round_target = (
            max(1, self.target // len(self.fragments)) if self.target is not None else 0
        )
        self.in_flight: FragmentRound | None = None
        # θ: the shared parameters, float32 on the CPU whatever the model's device and dtype
        self.theta = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.outer = torch.optim.SGD(
            self.theta,
            lr=float(options.outer_lr),
            momentum=float(options.outer_momentum),
            nesterov=bool(options.nesterov and options.outer_momentum > 0),
        )
        state_options: dict[str, Any] = {"average_optimizer_statistics": False}
        if optimizer.serves_state and options.checkpoint_every_epochs is not None:
            state_options["checkpoint_every_epochs"] = options.checkpoint_every_epochs
        # checkpoints, serves and loads θ + momentum; its own averaging is never used (the
        # pseudo-gradient is averaged by the per-epoch averager below)
        self.state = optimizer.make_state_averager(self.outer, **state_options)
        self.averager_config = dataclasses.replace(optimizer.averager_config, compression=None)
        # peers of another tensor schema, shared by the per-epoch averagers (asked once)
        self.schema_memory = SchemaMemory()
        # our codec's wire bytes per value in the last round, for the next epoch's averager:
        # its GroupInfo then says how long the links need instead of assuming float32
        self.codec_density: float | None = None
        self.uplink_meter = UplinkMeter()  # every epoch's averager reads and adds to it
        if self.compression is None:
            self.compression = optimizer.averager_config.compression
        self.deltas = [torch.zeros_like(t) for t in self.theta]
        self.local_steps = 0  # inner steps since the round's θ
        self.samples = 0
        self._alone = False
        self.rounds = EpochRounds(str(optimizer.tracker.peer_id), optimizer.target_group_size)
        self._last_refresh = -float("inf")
        self._behind_since: float | None = None  # no donor served the newer state yet
        self._next_catch_up = -float("inf")
        # counters (for users, tests and benchmarks)
        self.outer_steps = 0
        self.rounds_succeeded = 0
        self.rounds_failed = 0
        self.solo_steps = 0
        self.state_loads = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.theta_mismatches = 0  # rounds whose members did not all start from our θ
        self.blocked_steps = 0  # inner steps that waited for a round or a state download
        self.overlapped_steps = 0  # streaming: inner steps taken while a round was in flight
        self.last_result: StepResult | None = None

    # ------------------------------------------------------------------ start and state

    def on_start(self) -> None:
        if self.state.epoch == 0:
            # a fresh run: the model as the user left it is θ (they may have loaded weights
            # after building the optimizer); a restored checkpoint or a donor's state wins
            self._theta_from_model()
        super().on_start()

    def _theta_from_model(self) -> None:
        with torch.no_grad():
            for theta, p in zip(self.theta, self.params, strict=True):
                theta.copy_(p.detach().to("cpu", torch.float32))

    def on_state_loaded(self) -> None:
        """θ was replaced: the inner loop restarts from it (residuals refer to the old one)."""
        self._drop_in_flight()
        self._model_from_theta()
        self.local_steps = 0
        self.samples = 0
        spec = self.compression
        if isinstance(spec, TwoWayCompression):
            spec.reset()
        if self.gravac is not None:
            self.gravac.reset()
        self.rounds.alone()
        self.report_progress(0)

    def _inner_state(self) -> list[tuple[str, torch.Tensor]]:
        """The local model's parameters and the inner optimizer's tensors (not shared)."""
        named = [(f"model.{i}", p) for i, p in enumerate(self.params)]
        for i, p in enumerate(self.params):
            for key, value in self.opt.inner.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    named.append((f"inner.{i}.{key}", value))
        return named

    def non_finite_state(self) -> str | None:
        return first_non_finite([*self.state._named_state(), *self._inner_state()])

    def recover(self, why: str) -> None:
        """θ and the outer momentum went bad: reload them like a joiner. Only the inner loop
        went bad: restart it from θ. Either way a parameter whose inner optimizer state holds
        NaN/Inf gets a fresh one (it is local: nobody serves it)."""
        if first_non_finite(self.state._named_state()) is not None:
            self.state.recover(why)
        else:
            logger.warning(
                "the inner model went non-finite (%s): restarted the inner loop from θ of "
                "outer epoch %d",
                why,
                self.state.epoch,
            )
        for p in self.params:
            state = self.opt.inner.state.get(p)
            if state and first_non_finite(
                (k, v) for k, v in state.items() if isinstance(v, torch.Tensor)
            ):
                state.clear()  # the optimizer initialises it again at its next step
        self.on_state_loaded()

    def _model_from_theta(self) -> None:
        with torch.no_grad():
            for p, theta in zip(self.params, self.theta, strict=True):
                p.copy_(theta.to(device=p.device, dtype=p.dtype))

    # ------------------------------------------------------------------ the loop

    def step(self, batch_size: int) -> None:
        self.opt.inner.step()
        self.local_steps += 1
        self.samples += batch_size
        self.report_progress(self.samples)
        if self.swarm_wide:
            self._swarm_step()
        elif self.streaming:
            self._stream_step()
        elif self.local_steps >= self.inner_steps:
            self._outer_round()

    def report_progress(self, samples: int) -> None:
        """While a swarm-wide round is in flight we are still at its epoch: report the samples
        behind its Δ too, so that a slower peer's projection of the epoch still counts them
        (it has not joined the round yet and must not think the swarm went backwards)."""
        rnd = self.in_flight
        if self.swarm_wide and rnd is not None:
            samples += rnd.samples
        self.opt.tracker.report(self.state.epoch, samples)

    def _may_start_round(self, view: Any, epoch: int) -> bool:
        """False when peers are past ``epoch`` (then load their state instead, at most every
        refresh period); a peer at our epoch means we are not alone any more."""
        same, ahead = self.rounds.others(view, epoch)
        if ahead:
            if time.monotonic() >= self._next_catch_up:
                self._catch_up(f"{len(ahead)} peer(s) are past epoch {epoch}")
            return False
        if same:
            self._alone = False
        return True

    def _outer_round(self) -> None:
        epoch = self.state.epoch
        view = self._fresh_view(self._view())
        if not self._may_start_round(view, epoch):
            return
        self._load_deltas()
        if self._alone:
            self._apply(solo=True)
            return
        self.blocked_steps += 1
        started = time.monotonic()
        feedback = self._feedback_snapshot()
        result = self._average(epoch, self.rounds.expected(view, epoch))
        self.note_round(result, waited=time.monotonic() - started)
        self.last_result = result
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        if result.succeeded and _whole(result, epoch) and self.rounds.complete(result):
            self.rounds_succeeded += 1
            started = time.monotonic()
            self._apply(result=result)
            self.round_seconds["applied"] += time.monotonic() - started
            return
        self.rounds_failed += 1
        self._feedback_restore(feedback)
        view = self._view(force=True)
        same, ahead = self.rounds.others(view, epoch)
        self.rounds.forget_unseen(view)
        if ahead:
            self._catch_up(f"no round at epoch {epoch} ({result.reason}); others moved on")
        elif not same and not self.rounds.with_us(view, result):
            logger.info("no other peer at outer epoch %d: training alone", epoch)
            self._alone = True
            self._apply(solo=True)
        else:  # the others are still in their inner steps: keep going, retry next step
            self.opt.tracker.mark_idle()  # the wait was not training time
            logger.info("no outer round at epoch %d (%s); retrying", epoch, result.reason)
            self.waiting(f"its outer rounds do not hold every peer at the epoch ({result.reason})")

    def _feedback_snapshot(self, fragment: int = 0) -> Any:
        """Point the error feedback at ``fragment``'s residuals (streaming; 0 otherwise) and
        return them as they are before the round (None without error feedback)."""
        spec = self.compression
        if not isinstance(spec, TwoWayCompression):
            return None
        for side in (spec.sender, spec.reducer):
            if isinstance(side, _RegroupingFeedback):
                side.scope = fragment
        return spec.snapshot()

    def _feedback_restore(self, snapshot: Any) -> None:
        """A failed round: what it compressed was never applied, and its Δ is taken again
        (or applied alone, uncompressed). Keeping the residuals it left would count that Δ
        twice: once in them, once in the next Δ; with top-k (1-2% sent) almost all of it."""
        if snapshot is not None and isinstance(self.compression, TwoWayCompression):
            self.compression.restore(snapshot)

    def _keep_unsent_local(self, indices: list[int], fragment: int) -> None:
        """``local_error_feedback``: move this peer's sender residuals of the round just
        applied (keys: flat ranges of ``indices``' parameters) out of the codec and subtract
        them from those parameters. The next Δ = θ - θ_local then carries them, so the codec
        must not add them again."""
        spec = self.compression
        if not self.local_error_feedback or not isinstance(spec, TwoWayCompression):
            return
        sizes = [self.params[i].numel() for i in indices]
        unsent = torch.zeros(sum(sizes))
        scoped = isinstance(spec.sender, _RegroupingFeedback)
        for key, residual in spec.sender.items():
            # ours are (fragment, (start, end)); a caller's own codec's are (start, end)
            scope, (start, end) = cast(
                tuple[int, tuple[int, int]], key if scoped else (fragment, key)
            )
            if scope != fragment:
                continue
            unsent[start:end] += residual.reshape(-1).to("cpu", torch.float32)
            spec.sender.reset(key)
        with torch.no_grad():
            for i, part in zip(indices, torch.split(unsent, sizes), strict=True):
                p = self.params[i]
                p.sub_(part.view_as(p).to(device=p.device, dtype=p.dtype))

    def _load_deltas(self) -> None:
        """``Δ = θ - θ_local`` into the buffers the round averages."""
        with torch.no_grad():
            for delta, theta, p in zip(self.deltas, self.theta, self.params, strict=True):
                delta.copy_(theta)
                delta.sub_(p.detach().to("cpu", torch.float32))

    def _start_round(
        self,
        epoch: int,
        expected: int,
        tensors: list[torch.Tensor],
        weight: int,
        slowest_step: float = 0.0,
    ) -> tuple[Averager, concurrent.futures.Future[StepResult], bytes]:
        """Start averaging ``tensors`` with the peers of outer epoch ``epoch`` (background);
        the group waits for the ``expected`` peers this one knows at the epoch (see
        ``epoch_rounds.py``), for at least ``slowest_step`` seconds more than usual (the
        longest step among them: the last may reach the round only when its step ends).
        ``weight``: the samples behind the pseudo-gradient."""
        config = self.averager_config
        options: dict[str, Any] = {
            "compression": self.compression,
            "min_group_size": max(config.min_group_size, min(expected, self.opt.target_group_size)),
        }
        if slowest_step > 0:
            window = config.effective_matchmaking_timeout
            options["matchmaking_timeout"] = window + RECENT_STEPS * slowest_step
        averager = Averager(
            tensors,
            dht=self.opt.dht,
            prefix=outer_prefix(self.opt.run_id, epoch),
            target_group_size=self.opt.target_group_size,
            schema_memory=self.schema_memory,
            uplink_meter=self.uplink_meter,
            config=dataclasses.replace(config, **options),
        )
        if averager.matchmaker is not None and self.codec_density is not None:
            averager.matchmaker.bytes_per_value = self.codec_density
        digest = self._theta_digest()
        try:
            future = averager.step(
                weight=float(min(max(weight, 1), MAX_WEIGHT)),
                gather={"theta": digest, "peers": expected, "samples": int(weight)},
                timeout=self.round_timeout,
                wait=False,
            )
        except BaseException:
            averager.shutdown()
            raise
        return averager, future, digest

    def _average(self, epoch: int, expected: int) -> StepResult:
        """Average Δ with the peers of this outer epoch, waiting for the round; abandoned when
        the swarm moves past the epoch before the round found its group."""
        averager, future, digest = self._start_round(epoch, expected, self.deltas, self.samples)
        try:
            if not wait_unless_left_behind(
                future, epoch, self.refresh_period, self._view, lambda: averager.in_group
            ):
                future.cancel()
                return StepResult(
                    False, averager.keys.key, reason="the swarm moved on to a later epoch"
                )
            try:
                result = future.result()
            except concurrent.futures.CancelledError:
                return StepResult(False, averager.keys.key, reason="cancelled")
        finally:
            self._shut_down(averager)
        self._check_thetas(result, digest, epoch)
        return result

    def _shut_down(self, averager: Averager) -> None:
        """Shut a round's averager down, keeping what it learned of our codec's density."""
        if averager.matchmaker is not None and averager.matchmaker.bytes_per_value is not None:
            self.codec_density = averager.matchmaker.bytes_per_value
        averager.shutdown()

    def _check_thetas(self, result: StepResult, digest: bytes, epoch: int) -> None:
        thetas = [g.get("theta") if isinstance(g, dict) else None for g in result.gathered.values()]
        if result.succeeded and any(t != digest for t in thetas):
            # the mean Δ is applied to different θ: the peers will never share one model
            self.theta_mismatches += 1
            logger.warning(
                "outer round %d: %d of %d members started from another θ than ours; start "
                "every peer from the same initial weights (same seed), or let newcomers join "
                "after the first outer step (they then load θ from donors)",
                epoch,
                sum(t != digest for t in thetas),
                len(thetas),
            )

    def _theta_digest(self) -> bytes:
        """16 bytes that differ when θ differs (compared across the round's members)."""
        h = hashlib.blake2b(digest_size=16)
        for theta in self.theta:
            h.update(theta.numpy().tobytes())
        return h.digest()

    def _apply(self, solo: bool = False, result: Any = None) -> None:
        """Outer step with the buffers' (mean) Δ, then restart the inner loop from the new θ."""
        for theta, delta in zip(self.theta, self.deltas, strict=True):
            theta.grad = delta
        self.outer.step()
        for theta in self.theta:
            theta.grad = None
        self._model_from_theta()
        if result is not None:
            self._keep_unsent_local(list(range(len(self.params))), 0)
        self.outer_steps += 1
        if solo:
            self.solo_steps += 1
        self.local_steps = 0
        self.samples = 0
        self.state.epoch += 1
        if result is not None:
            self.rounds.stepped_with(result)
        else:
            self.rounds.alone()
        self.report_progress(0)
        self.state.maybe_checkpoint()

    # ------------------------------------------------------------------ streaming

    def _stream_step(self) -> None:
        """Streaming: land the round in flight once it is done and ``overlap_steps`` inner
        steps went by, or start the next fragment's round every ``period`` steps. Nothing
        here waits for the network: a round not done yet is looked at again next step."""
        rnd = self.in_flight
        if rnd is not None:
            rnd.steps_since_start += 1
            self.overlapped_steps += 1
            if not rnd.future.done():
                # not abandoned when the view shows peers past its epoch: the members of a
                # round finish it at slightly different times, and the early ones move on
                # first; a round that cannot form ends by its own timeouts
                return
            if rnd.steps_since_start >= self.overlap_steps:
                self._land(rnd)
            return
        if self.local_steps >= self.period:
            self._start_fragment_round()

    def _swarm_step(self) -> None:
        """Swarm-wide epochs: once the swarm's samples at our epoch (projected from the
        tracker's view, as in ``sync``) reach the round's target, start the round in the
        background and keep training; land it when it is done. A fast peer reaches its share
        of the target as early as a slow one reaches its own, so the peers arrive together
        and nobody parks waiting for another's inner steps."""
        rnd = self.in_flight
        if rnd is not None:
            rnd.steps_since_start += 1
            self.overlapped_steps += 1
            if rnd.future.done():
                self._land(rnd)
            return
        epoch = self.state.epoch
        view = self._view()
        if view.epoch > epoch:
            if time.monotonic() >= self._next_catch_up:
                self._catch_up(f"the swarm is at outer epoch {view.epoch}")
            return
        if self.samples < self.round_target and (
            self.rounds.projected_samples(
                view, epoch, self.samples, self.opt.tracker.samples_per_second
            )
            < self.round_target
        ):
            return
        self._start_fragment_round(self._fresh_view(view))

    def _start_fragment_round(self, view: Any = None) -> None:
        epoch = self.state.epoch
        if view is None:
            view = self.opt.tracker.global_progress  # cached: no network wait in a step
        if not self._may_start_round(view, epoch):
            return
        indices = self.fragments[epoch % len(self.fragments)]
        start_local = [self.params[i].detach().to("cpu", torch.float32, copy=True) for i in indices]
        with torch.no_grad():
            for i, local in zip(indices, start_local, strict=True):
                torch.sub(self.theta[i], local, out=self.deltas[i])
        self.local_steps = 0
        if self._alone:
            self._apply_fragment(epoch, indices, start_local, solo=True)
            self.samples = 0
            return
        slowest = self.rounds.slowest_step(view, epoch) if self.swarm_wide else 0.0
        feedback = self._feedback_snapshot(epoch % len(self.fragments))
        averager, future, digest = self._start_round(
            epoch,
            self.rounds.expected(view, epoch),
            [self.deltas[i] for i in indices],
            self.samples,
            slowest,
        )
        self.in_flight = FragmentRound(
            epoch,
            indices,
            averager,
            future,
            start_local,
            digest,
            samples=self.samples,
            feedback=feedback,
        )
        self.samples = 0

    def _land(self, rnd: FragmentRound) -> None:
        """The round is done: apply its mean Δ to the fragment's θ, or decide what next."""
        self.in_flight = None
        try:
            result = rnd.future.result()
        except concurrent.futures.CancelledError:
            result = StepResult(False, rnd.averager.keys.key, reason="the swarm moved on")
        except Exception as e:  # noqa: BLE001 - a failed round is retried like a missed one
            result = StepResult(False, rnd.averager.keys.key, reason=repr(e))
        finally:
            self._shut_down(rnd.averager)
        self.note_round(result)
        self.last_result = result
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self._check_thetas(result, rnd.digest, rnd.epoch)
        if result.succeeded and _whole(result, rnd.epoch) and self.rounds.complete(result):
            self.rounds_succeeded += 1
            started = time.monotonic()
            self._apply_fragment(rnd.epoch, rnd.indices, rnd.start_local, result=result)
            self.round_seconds["applied"] += time.monotonic() - started
            return
        self.rounds_failed += 1
        self._feedback_restore(rnd.feedback)
        view = self.opt.tracker.global_progress
        same, ahead = self.rounds.others(view, rnd.epoch)
        self.rounds.forget_unseen(view)
        if ahead:
            self._catch_up(f"no round at epoch {rnd.epoch} ({result.reason}); others moved on")
        elif not same and not self.rounds.with_us(view, result):
            logger.info("no other peer at outer epoch %d: training alone", rnd.epoch)
            self._alone = True
            self._apply_fragment(rnd.epoch, rnd.indices, rnd.start_local, solo=True)
        else:  # the others are still in their inner steps: start again at the next step
            logger.info("no outer round at epoch %d (%s); retrying", rnd.epoch, result.reason)
            self.waiting(f"its outer rounds do not hold every peer at the epoch ({result.reason})")
            self.local_steps = self.period
            self.samples += rnd.samples  # its Δ is taken again from θ: so is its weight

    def _apply_fragment(
        self,
        epoch: int,
        indices: list[int],
        start_local: list[torch.Tensor],
        *,
        solo: bool = False,
        result: StepResult | None = None,
    ) -> None:
        """Outer step on one fragment's θ with the (mean) Δ in its buffers; its local
        parameters become the new θ plus the progress made since Δ was taken."""
        with torch.no_grad():
            for i, local in zip(indices, start_local, strict=True):
                if solo:  # our own Δ (a failed round may have left the buffers half-averaged)
                    torch.sub(self.theta[i], local, out=self.deltas[i])
                self.theta[i].grad = self.deltas[i]
            self.outer.step()  # parameters without .grad (other fragments) are left alone
            for i, local in zip(indices, start_local, strict=True):
                self.theta[i].grad = None
                p = self.params[i]
                merged = p.detach().to("cpu", torch.float32) - local  # the progress since Δ
                p.copy_(merged.add_(self.theta[i]))  # copy_ casts to p's device and dtype
        if result is not None:
            self._keep_unsent_local(indices, epoch % len(self.fragments))
        self.outer_steps += 1
        if solo:
            self.solo_steps += 1
        self.state.epoch = epoch + 1
        if result is not None:
            self.rounds.stepped_with(result)
        else:
            self.rounds.alone()
        self.report_progress(self.samples)
        self.state.maybe_checkpoint()

    def _drop_in_flight(self) -> None:
        if self.in_flight is not None:
            self.in_flight.close()
            self.in_flight = None

    def leave_swarm(self, deadline: float) -> None:
        self._drop_in_flight()
        super().leave_swarm(deadline)

    def shutdown(self) -> None:
        self._drop_in_flight()
        super().shutdown()

    def _catch_up(self, why: str) -> None:
        """Adopt the swarm's θ and momentum instead of applying a stale pseudo-gradient."""
        before = self.state.epoch
        self.blocked_steps += 1  # a state download: this step waits for it
        logger.info("outer epoch %d is behind (%s): loading state from peers", before, why)
        tracker = self.opt.tracker
        tracker.set_catching_up(max(tracker.global_progress.epoch, before + 1))
        try:
            self.state.synchronize(again=True)
        except (NoDonorError, StateDownloadError) as e:  # donors gone or failing: retry later
            logger.warning("could not load state (%s)", e)
        finally:
            tracker.set_catching_up(None)
        if self.state.epoch != before:
            self.state_loads += 1
            self._behind_since = None
            self.on_state_loaded()
            return
        # the donors may not have published the new epoch yet: keep training, look again
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since < self.opt.load_state_timeout:
            self._next_catch_up = now + self.refresh_period
            self.waiting(f"the swarm moved on ({why}) and no donor served its newer state yet")
            return
        # nobody serves a newer state (serve_from_memory off everywhere?): do not stall forever
        self._behind_since = None
        logger.warning(
            "no donor served the swarm's newer state within %.0f s: applying our own "
            "pseudo-gradient alone; leave serve_from_memory on (or give peers a "
            "checkpoint_dir) so that laggards can catch up",
            self.opt.load_state_timeout,
        )
        if self.streaming:
            indices = self.fragments[self.state.epoch % len(self.fragments)]
            local = [self.params[i].detach().to("cpu", torch.float32, copy=True) for i in indices]
            self._apply_fragment(self.state.epoch, indices, local, solo=True)
            return
        self._load_deltas()
        self._apply(solo=True)

    # ------------------------------------------------------------------ state_dict

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "theta": [t.clone() for t in self.theta],
            "outer": self.outer.state_dict(),
            "local_steps": self.local_steps,
            "samples": self.samples,
        }
        if isinstance(self.compression, TwoWayCompression):
            state["compression"] = self.compression.state_dict()
        if self.gravac is not None:
            state["gravac"] = self.gravac.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theta = state.get("theta")
        if theta is not None:
            if len(theta) != len(self.theta) or any(
                a.shape != b.shape for a, b in zip(theta, self.theta, strict=True)
            ):
                raise ValueError("this state_dict's θ does not fit the model's parameters")
            with torch.no_grad():
                for mine, saved in zip(self.theta, theta, strict=True):
                    mine.copy_(saved)
        if "outer" in state:
            self.outer.load_state_dict(state["outer"])
        self.local_steps = int(state.get("local_steps", 0))
        self.samples = int(state.get("samples", 0))
        if isinstance(self.compression, TwoWayCompression) and "compression" in state:
            self.compression.load_state_dict(state["compression"])
        if self.gravac is not None and "gravac" in state:
            self.gravac.load_state_dict(state["gravac"])


MODE = DiLoCoMode


def _whole(result: StepResult, epoch: int) -> bool:
    """Did the round average all of our pseudo-gradient? A part whose reducer failed keeps
    each member's own values: applied, it would leave every member on another θ for good
    (on the 200 kbit/s race, a round that ran out of time had averaged 17% for one member,
    which stepped with it while the others retried). Not applied, the round is retried, as
    a partial gradient round of ``sync`` is."""
    if result.averaged_fraction >= 1.0:
        return True
    logger.warning(
        "outer round %d averaged only %.0f%% of the pseudo-gradient (%s): not applied, or θ "
        "would differ between peers; retrying",
        epoch,
        100 * result.averaged_fraction,
        result.reason or "parts kept local values",
    )
    return False
