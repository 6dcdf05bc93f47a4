"""Gradient accumulation and per-epoch gradient averaging for ``mode="sync"``.

A peer adds ``grad * batch_size`` into float32 CPU sums after every local step (so the sums do
not depend on how the samples were split into batches) and counts the samples. When the swarm
reaches its target batch the peer turns its sums into a local mean gradient (sum / samples) and
averages that with the peers of the same epoch, weighted by samples: the weighted mean of the
local means is the global mean gradient ``sum of all grad*batch / all samples``.

Peers of different epochs never average together: each epoch's round uses its own averaging
prefix ``{run_id}.grads.{epoch}``, so a peer still at epoch ``e`` (or a peer that sends
gradients for another epoch) never finds a group under ``e + 1``'s key. Shapes are protected
by the averager's schema hash, NaN/Inf values and absurd weights by the all-reduce (see
docs/allreduce.md: excluded contributions, ``max_weight_ratio``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from moshpit.averaging.allreduce_protocol import MAX_WEIGHT
from moshpit.averaging.averager import Averager, StepResult
from moshpit.averaging.config import AveragerConfig
from moshpit.averaging.matchmaking import SchemaMemory
from moshpit.averaging.uplink_meter import UplinkMeter

if TYPE_CHECKING:
    from dht.facade import DHT

logger = logging.getLogger(__name__)

__all__ = ["GradientAverager", "GradientRound", "grads_prefix"]


def grads_prefix(run_id: str, epoch: int) -> str:
    """The averaging prefix of epoch ``epoch``'s gradient round (one key space per epoch)."""
    return f"{run_id}.grads.{int(epoch)}"


class GradientRound:
    """One epoch's gradient round running in the background (``start_round``)."""

    def __init__(
        self, epoch: int, averager: Averager, future: concurrent.futures.Future[StepResult]
    ):
        self.epoch = epoch
        self.averager = averager
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> StepResult:
        """Wait for the round, detach its averager and return what it did."""
        try:
            try:
                result: StepResult = self.future.result(timeout=timeout)
            except concurrent.futures.CancelledError:
                result = StepResult(False, self.averager.keys.key, reason="cancelled")
        finally:
            self.averager.shutdown()
        return result

    def cancel(self) -> None:
        self.averager.shutdown()
        self.future.cancel()
        try:  # a cancelled step finishes its write under the averager's lock first
            self.future.exception(timeout=10)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            pass


class GradientAverager:
    """Float32 CPU gradient sums for ``params`` plus the buffers one epoch's round averages.

    :param params: the parameters whose ``.grad`` is accumulated (order = schema order).
    :param dht: a running ``moshpit.DHT``.
    :param run_id: the run's name; rounds use ``grads_prefix(run_id, epoch)``.
    :param target_group_size: Moshpit group size.
    :param config: for each round's :class:`~moshpit.Averager` (an ``AveragerConfig``);
      ``averager_options`` (timeouts, ``compression=`` a codec or ``TwoWayCompression``, ...)
      go on top of it.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        dht: DHT,
        run_id: str,
        target_group_size: int,
        config: AveragerConfig | None = None,
        **averager_options: Any,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("no parameters to accumulate gradients for")
        self.dht = dht
        self.run_id = run_id
        self.target_group_size = target_group_size
        self.averager_config = AveragerConfig.build(config, **averager_options)
        self.sums = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        # what a round averages in place (local mean, or DGC's sparse update); a round's
        # averager is the only writer while it runs
        self.buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        self.samples = 0
        self.batches = 0
        # failure counts and bans outlive the per-epoch averagers: a peer that sent NaN or
        # stalled in two rounds is not grouped with for ``ban_seconds``, whatever the epoch.
        # Both are only touched on the DHT's trio thread (by the averagers).
        self._failures: dict[Any, int] = {}
        self._banned_until: dict[Any, float] = {}
        # likewise the peers of another tensor schema: not asked again, warned about once
        self.schema_memory = SchemaMemory()
        self.uplink_meter = UplinkMeter()  # every epoch's averager reads and adds to it

    def accumulate(self, batch_size: int) -> None:
        """Add ``grad * batch_size`` of every parameter (a missing grad counts as zero)."""
        with torch.no_grad():
            for p, total in zip(self.params, self.sums, strict=True):
                if p.grad is not None:
                    total.add_(p.grad.detach().to("cpu", torch.float32), alpha=float(batch_size))
        self.samples += int(batch_size)
        self.batches += 1

    def local_mean(self) -> list[torch.Tensor]:
        """This peer's mean gradient over the samples accumulated since the last reset."""
        scale = 1.0 / self.samples if self.samples else 0.0
        return [total * scale for total in self.sums]

    def reset(self) -> None:
        for total in self.sums:
            total.zero_()
        self.samples = 0
        self.batches = 0

    def load_buffers(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put what the next round averages into the buffers (no round may be running)."""
        with torch.no_grad():
            for buffer, value in zip(self.buffers, tensors, strict=True):
                buffer.copy_(value)

    def start_round(
        self,
        epoch: int,
        weight: float,
        timeout: float | None = None,
        compression: Any = None,
        gather: Any = None,
        min_group_size: int | None = None,
    ) -> GradientRound:
        """Average the buffers with this epoch's peers, weighted by ``weight`` (samples).

        Returns at once; the buffers hold the group's weighted mean once the round succeeded
        and keep this peer's values wherever nothing was averaged. ``min_group_size``: the
        group does not start before this many peers joined it (the peers this one knows at
        the epoch: a group that starts without one of them leaves it behind), capped at the
        group size.
        """
        config = self.averager_config
        options: dict[str, Any] = {}
        if compression is not None:
            options["compression"] = compression
        if min_group_size is not None:
            floor = config.min_group_size
            options["min_group_size"] = max(floor, min(min_group_size, self.target_group_size))
        averager = Averager(
            self.buffers,
            dht=self.dht,
            prefix=grads_prefix(self.run_id, epoch),
            target_group_size=self.target_group_size,
            schema_memory=self.schema_memory,
            uplink_meter=self.uplink_meter,
            config=dataclasses.replace(config, **options),
        )
        averager._failures = self._failures
        averager._banned_until = self._banned_until
        weight = float(min(max(weight, 0.0), MAX_WEIGHT))
        future = averager.step(weight=weight, gather=gather, timeout=timeout, wait=False)
        return GradientRound(epoch, averager, future)

    def write_grads(self, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Copy ``tensors`` (default: the buffers) into the parameters' ``.grad``."""
        tensors = self.buffers if tensors is None else tensors
        with torch.no_grad():
            for p, value in zip(self.params, tensors, strict=True):
                grad = value.to(device=p.device, dtype=p.dtype)
                if p.grad is None:
                    p.grad = grad.clone() if grad is value else grad
                else:
                    p.grad.copy_(grad)
