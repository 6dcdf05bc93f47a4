"""``TrainingStateAverager``: one peer's training state, averaged in the background.

The state is the optimizer's parameters, its per-parameter statistics (e.g. Adam moments and
step counts), extra tensors (buffers such as BatchNorm statistics) and the epoch.

Averaging never stalls training: a round copies the live tensors into CPU buffers (the
snapshot), averages those buffers with peers on the DHT's thread while the training loop keeps
stepping, and the training thread then adds ``averaged - snapshot`` to its live tensors, so
local progress made during the round is kept. The inner :class:`~moshpit.Averager` only ever
locks the CPU buffers; the live tensors belong to the training thread alone, which is why the
delta is applied from that thread (at the next :meth:`step`, :meth:`apply_pending` or
:meth:`AveragingRound.wait`), never from a background thread.

The same state is what checkpoints store (``store.py``) and what donors serve to joiners
(``sharing.py``): both go through :meth:`_named_state`, whose names and order
(``state_tensors.py``) define the schema a joiner must match. The constructor's own options are
``state_options.StateAveragerOptions``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import shutil
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dht._logging import RateLimitedLogger
from moshpit.averaging.averager import Averager, StepResult
from moshpit.critical import CriticalLock, critical_section
from moshpit.training.errors import (
    CheckpointError,
    CheckpointFormatError,
    NoCheckpointError,
    NoDonorError,
    StateDownloadError,
    StateError,
    StateMismatchError,
)
from moshpit.training.health import NonFiniteStateError, first_non_finite
from moshpit.training.manifest import Manifest, build_manifest, chunk_views
from moshpit.training.memory_donor import MemoryChunks
from moshpit.training.state_options import StateAveragerOptions
from moshpit.training.state_tensors import StateTensors, both_nonnegative, correct_after_round

if TYPE_CHECKING:
    from dht.facade import DHT
    from dht.kademlia.node import DHTNode
    from moshpit.training.dirlock import CheckpointDirLock
    from moshpit.training.sharing import (
        AdvertisedState,
        ChunkSource,
        DownloadResult,
        StateSharing,
    )
    from moshpit.training.store import StateStore

logger = logging.getLogger(__name__)

__all__ = [
    "AveragingRound",
    "StateAveragerOptions",
    "TrainingStateAverager",
    "correct_after_round",
]

T = TypeVar("T")


# a state that keeps going non-finite although it was reloaded each time is not a glitch
MAX_RECOVERIES = 5
RECOVERY_WINDOW = 300.0  # seconds
# Monitoring (moshpit.metrics): every TrainingStateAverager of this process, held weakly (its
# epoch and checkpoint counters are read when scraped), and observers called as
# ``observer("download", state_averager, (error or None, seconds, DownloadResult or None))``
# after each attempt to load the swarm's state. Empty unless metrics are on.
live_state_averagers: weakref.WeakSet[TrainingStateAverager] = weakref.WeakSet()
DownloadAttempt = tuple["Exception | None", float, "DownloadResult | None"]
observers: list[Callable[[str, TrainingStateAverager, DownloadAttempt], object]] = []


class AveragingRound:
    """A background averaging round started by ``TrainingStateAverager.step(wait=False)``."""

    def __init__(
        self, owner: TrainingStateAverager, future: concurrent.futures.Future[StepResult]
    ) -> None:
        self._owner = owner
        self.future = future
        self.applied = False
        self.result: StepResult | None = None

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> StepResult:
        """Wait for the round and apply its result (call from the training thread)."""
        concurrent.futures.wait([self.future], timeout=timeout)
        if not self.future.done():
            raise TimeoutError(f"the averaging round did not finish within {timeout} s")
        self._owner._finish(self)
        assert self.result is not None
        return self.result


class TrainingStateAverager:
    """Averages, checkpoints and shares the training state of ``optimizer`` (see module doc).

    :param dht: a running ``moshpit.DHT``.
    :param optimizer: a ``torch.optim.Optimizer``; its ``param_groups`` are the parameters.
    :param prefix: the run's name; peers with the same prefix train together.
    :param target_group_size: Moshpit group size for averaging rounds.
    :param extra_tensors: more state to keep in sync (e.g. ``model.buffers()``); floating-point
      ones are averaged, the others (e.g. BatchNorm's ``num_batches_tracked``) are only saved
      and loaded.
    :param options: a :class:`~moshpit.training.state_options.StateAveragerOptions` (where to
      checkpoint, how often, what a round averages, whether to catch up with the swarm at
      start). Keyword arguments named like its fields (``checkpoint_dir=``,
      ``keep_checkpoints=``, ...) go on top of it; the other keyword arguments are the inner
      :class:`~moshpit.Averager`'s (timeouts, compression, ``config=``, ...).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        optimizer: torch.optim.Optimizer,
        prefix: str,
        target_group_size: int,
        extra_tensors: Iterable[torch.Tensor] = (),
        options: StateAveragerOptions | None = None,
        **keywords: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
        if not hasattr(dht, "run_coroutine"):
            raise TypeError("dht must be a moshpit.DHT (the synchronous facade)")
        self.options, averager_options = StateAveragerOptions.split(options, keywords)
        self.dht = dht
        self.optimizer = optimizer
        self.prefix = prefix
        self._tensors = StateTensors(optimizer, extra_tensors)
        self.extra_tensors = self._tensors.extras
        self.sync_on_start = self.options.sync_on_start
        self.join_timeout = float(self.options.join_timeout)
        self.checkpoint_every_seconds = self.options.checkpoint_every_seconds
        self.checkpoint_every_epochs = self.options.checkpoint_every_epochs
        self.epoch = 0
        if not self._tensors.params:
            raise ValueError("the optimizer has no parameters")
        self._tensors.create_optimizer_state()
        self._averaged = self._tensors.averaged_names(
            self.options.average_parameters,
            self.options.average_optimizer_statistics,
            self.options.average_extra_tensors,
        )
        if not self._averaged:
            raise ValueError("nothing to average: enable parameters, statistics or extras")
        # one peer per checkpoint directory: a second one fails here, before it joins a round
        # or touches the files
        self._store, self._dir_lock = _open_store(
            self.options.checkpoint_dir, self.options.keep_checkpoints
        )
        try:
            self.averager = self._make_averager(target_group_size, averager_options)
        except BaseException:
            if self._dir_lock is not None:
                self._dir_lock.release()
            raise
        self._pending: AveragingRound | None = None
        self.last_round_deviation: float | None = None  # ||averaged - ours|| / ||ours||
        # sqrt(the group's variance) / ||the group's mean||: the same for every member
        self.last_group_spread: float | None = None
        self._synchronized = not self.sync_on_start
        self._closed = False
        self._init_checkpointing()
        self.recoveries = 0  # times a non-finite state was replaced by a good one
        self._recovered_at: list[float] = []
        self._sharing: StateSharing | None = None
        self._sharing_service: concurrent.futures.Future[Any] | None = None
        # without a checkpoint_dir, the state of the last checkpoint-cadence epoch is served
        # from memory (memory_donor.py): a laggard of a run without disks can still catch up
        self._memory = (
            MemoryChunks() if self._store is None and self.options.serve_from_memory else None
        )
        self.served_epoch: int | None = None  # of the state served from memory
        try:
            self._start_sharing()
            if self._store is not None and self.options.restore_checkpoint:
                self._restore_if_present()
        except BaseException:  # nothing half-open stays behind: round, server, directory lock
            self.shutdown()
            raise
        live_state_averagers.add(self)

    def _make_averager(self, target_group_size: int, averager_options: dict[str, Any]) -> Averager:
        """The inner Averager, on CPU buffers it owns, and the snapshot each round starts from."""
        pin = torch.cuda.is_available() and any(t.is_cuda for t in self._averaged_live())
        self._buffers = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self._averaged_live()
        ]
        self._snapshot = [torch.empty_like(b) for b in self._buffers]
        return Averager(
            self._buffers, dht=self.dht, prefix=self.prefix,
            target_group_size=target_group_size, **averager_options,
        )  # fmt: skip

    def _init_checkpointing(self) -> None:
        """The checkpoint writer thread, and the counters ``moshpit status`` shows."""
        self._last_checkpoint_time = time.monotonic()
        self._last_checkpoint_epoch = 0
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moshpit-ckpt")
        # the checkpoint being written, or the state being hashed to be served from memory
        self._writing: concurrent.futures.Future[Any] | None = None
        # background checkpoints that failed (disk full, read-only, non-finite state): counted,
        # logged at once (one line per reason and minute), shown by `moshpit status`
        self.checkpoint_failures = 0
        self.failing_checkpoints = 0  # failures since the last checkpoint that succeeded
        self.last_checkpoint_error: str | None = None
        self.newest_checkpoint_epoch: int | None = None  # of the newest good checkpoint
        self.last_checkpoint_at: float | None = None  # time.monotonic() it was written at
        self._failure_lock = CriticalLock()
        self._failure_log = RateLimitedLogger(logger, 60.0)

    # ------------------------------------------------------------------ the state's tensors

    def _named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Every state tensor with its stable name: parameters, optimizer state, extras."""
        return self._tensors.named()

    def _metadata(self) -> dict[str, Any]:
        return self._tensors.metadata()

    def _averaged_live(self) -> list[torch.Tensor]:
        state = dict(self._named_state())
        return [state[name] for name in self._averaged]

    def schema(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every state tensor, in manifest order."""
        return self._tensors.schema()

    def schema_digest(self) -> tuple[bytes, str]:
        """``(hash, description)`` of the state's tensor names and shapes (dtypes left out,
        as in averaging). Peers with another hash train another model (or optimizer): they
        can neither average nor share state with this one, so the progress tracker leaves
        them out of the run's view (``ProgressTracker.set_schema``)."""
        from moshpit.training.sharing import state_schema_digest

        schema = self.schema()
        values = sum(math.prod(shape) for _, _, shape in schema)
        digest = state_schema_digest(schema, with_dtypes=False)
        return digest, f"{len(schema)} state tensors, {values} values"

    # ------------------------------------------------------------------ averaging

    def step(
        self, wait: bool = True, weight: float = 1.0, timeout: float | None = None
    ) -> StepResult | AveragingRound:
        """Average the state with a group of peers.

        ``wait=True`` blocks until the round is over and applied; ``wait=False`` returns an
        :class:`AveragingRound` at once, and training goes on: the result is applied at the next
        ``step``/``apply_pending`` once the round is done (or by ``round.wait()``). One round
        runs at a time; calling ``step`` while one is running returns that round.
        """
        self._check_open()
        self.apply_pending()
        if self._pending is not None:
            return self._pending.wait() if wait else self._pending
        future: concurrent.futures.Future[StepResult] = concurrent.futures.Future()
        if not self._synchronized:
            try:
                self._synchronize()
            except StateDownloadError as e:
                # donors exist but failed us: averaging our (maybe fresh) values in now would
                # drag the swarm; skip this round and try to catch up again at the next one
                logger.warning("not averaging until the swarm's state is loaded: %s", e)
                future.set_result(
                    StepResult(
                        False,
                        self.averager.keys.key,
                        reason=f"could not load the swarm's state first: {e}",
                    )
                )
        if not future.done():
            self._take_snapshot()
            future = self.averager.step(weight=weight, timeout=timeout, wait=False)
        handle = AveragingRound(self, future)
        self._pending = handle
        self.maybe_checkpoint()
        return handle.wait() if wait else handle

    @property
    def round_running(self) -> bool:
        """True while a background round started by ``step(wait=False)`` is not applied yet."""
        return self._pending is not None

    def apply_pending(self) -> StepResult | None:
        """If a background round has finished, apply its result now (training thread)."""
        if self._pending is not None and self._pending.done():
            return self._pending.wait()
        return None

    def _take_snapshot(self) -> None:
        live = self._averaged_live()
        # the Averager's lock guards only the CPU buffers; it is free unless a cancelled round
        # is still finishing its write
        with self.averager.get_tensors(), torch.no_grad():
            for buffer, tensor in zip(self._buffers, live, strict=True):
                buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            _sync_devices(live)
            bad = first_non_finite(zip(self._averaged, self._buffers, strict=True))
            if bad is not None:
                raise NonFiniteStateError(
                    f"tensor {bad!r} of the local state holds NaN or Inf: not averaging it "
                    "(recover() reloads a good state)"
                )
            for snapshot, buffer in zip(self._snapshot, self._buffers, strict=True):
                snapshot.copy_(buffer)

    def _finish(self, handle: AveragingRound) -> None:
        """Apply a finished round's ``averaged - snapshot`` to the live tensors (once)."""
        if handle.applied:
            return
        handle.applied = True
        if self._pending is handle:
            self._pending = None
        try:
            handle.result = handle.future.result()
        except concurrent.futures.CancelledError:
            handle.result = StepResult(False, self.averager.keys.key, reason="cancelled")
            return
        if not handle.result.succeeded:
            return  # the buffers still hold the snapshot wherever nothing was averaged
        delta_sq = norm_sq = mean_sq = 0.0
        with critical_section(), self.averager.get_tensors(), torch.no_grad():
            for name, tensor, buffer, snapshot in zip(
                self._averaged, self._averaged_live(), self._buffers, self._snapshot, strict=True
            ):
                mean_sq += float(torch.linalg.vector_norm(buffer, dtype=torch.float64)) ** 2
                # parameters have no domain; a statistic that is non-negative on both sides
                # (Adam's exp_avg_sq, Adagrad's sum, BatchNorm's running_var) must stay so
                nonnegative = not name.startswith("params.") and both_nonnegative(snapshot, tensor)
                if nonnegative:
                    correct_after_round(tensor, buffer, snapshot, nonnegative=True)
                buffer.sub_(snapshot)  # the buffer now holds this round's delta
                if not nonnegative:
                    tensor.add_(buffer.to(tensor.device, non_blocking=tensor.is_cuda))
                delta_sq += float(torch.linalg.vector_norm(buffer, dtype=torch.float64)) ** 2
                norm_sq += float(torch.linalg.vector_norm(snapshot, dtype=torch.float64)) ** 2
        # how far this peer was from its group's mean, relative to its state's size: the
        # divergence signal adaptive averaging periods (ADPSGD) feed on
        self.last_round_deviation = (delta_sq / norm_sq) ** 0.5 if norm_sq > 0 else 0.0
        spread = handle.result.group_deviation
        self.last_group_spread = (
            (spread / mean_sq) ** 0.5 if spread is not None and mean_sq > 0 else None
        )

    # ------------------------------------------------------------------ loading state

    def _adopt(self, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> int:
        manifest.check_fits(self.schema())
        if self._pending is not None:  # a round's delta is relative to the state we replace
            self._pending.future.cancel()
            self._pending.applied = True
            self._pending = None
        self._tensors.write(tensors, dict(manifest.metadata))
        self.epoch = manifest.epoch
        self._synchronized = True
        return self.epoch

    def load_checkpoint(self) -> int:
        """Restore the newest local checkpoint; returns its epoch.

        Raises ``NoCheckpointError`` when there is none, ``CheckpointFormatError`` /
        ``CheckpointCorruptError`` for an unreadable one and ``StateMismatchError`` when it does
        not fit this model; nothing is written into the model unless all of it verified.
        """
        self._check_open()
        if self._store is None:
            raise ValueError("no checkpoint_dir was given")
        from moshpit.training.store import load_newest_intact

        restored = load_newest_intact(self._store, accept=_refuse_non_finite)
        manifest = restored.manifest
        manifest.check_fits(self.schema())
        epoch = self._adopt(manifest, restored.tensors)
        self.newest_checkpoint_epoch = epoch
        self._publish(manifest)
        if restored.passed_over:
            logger.warning(
                "restored the older checkpoint of epoch %d from %s instead of newer ones: %s "
                "(damaged files, if any, were moved to %s)",
                epoch,
                self._store.directory,
                "; ".join(restored.passed_over + restored.notes),
                self._store.damaged_dir,
            )
        elif restored.notes:
            logger.warning(
                "restored the newest intact checkpoint, of epoch %d, from %s; also found: %s "
                "(damaged files, if any, were moved to %s)",
                epoch,
                self._store.directory,
                "; ".join(restored.notes),
                self._store.damaged_dir,
            )
        else:
            logger.info("restored the checkpoint of epoch %d from %s", epoch, self._store.directory)
        return epoch

    def _restore_if_present(self) -> None:
        try:
            self.load_checkpoint()
        except NoCheckpointError:
            return
        except CheckpointFormatError:
            raise  # a newer moshpit wrote it: upgrading is the fix, not starting over
        except CheckpointError as e:  # nothing on disk is usable: the swarm's state is next
            logger.warning("%s; loading the swarm's state instead", e)
            self._synchronized = False
            return
        self._synchronized = not self.sync_on_start  # still catch up if the swarm is ahead

    def load_state_from_peers(self, timeout: float = 60.0) -> int:
        """Download the swarm's newest state from its donors and adopt it; returns its epoch.

        Raises ``NoDonorError`` if nobody serves a state within ``timeout``,
        ``StateMismatchError`` if the swarm's state does not fit this model (before any chunk
        is fetched), ``StateDownloadError`` if every donor failed. The live model is written
        only after the whole state verified.
        """
        self._check_open()
        sharing = self._running_sharing()
        schema = self.schema()

        async def download(_dht: object, _node: object) -> DownloadResult:
            return await sharing.download(schema, timeout=timeout, sink=self._store)

        started = time.monotonic()
        try:
            result = self.dht.run_coroutine(download)
        except Exception as e:
            _notify("download", self, (e, time.monotonic() - started, None))
            raise
        _notify("download", self, (None, time.monotonic() - started, result))
        if result.misbehaving:
            logger.warning(
                "donors that misbehaved while we loaded state: %s",
                ", ".join(f"{peer}: {why}" for peer, why in result.misbehaving.items()),
            )
        epoch = self._adopt(result.manifest, result.tensors)
        if self._store is not None:
            self._publish(result.manifest)  # the sink now holds every chunk: serve it too
        elif self._memory is not None:
            # the verified download, as it is (the donors' own root; no copy, no hashing),
            # after any snapshot still being hashed: the writer runs its jobs in order
            chunks = chunk_views(result.manifest, result.tensors)
            self._writing = self._writer.submit(self._serve_chunks, result.manifest, chunks)
            self._writing.add_done_callback(self._checkpoint_done)
        logger.info("loaded the state of epoch %d from %d donor(s)", epoch, len(result.donors_used))
        return epoch

    def synchronize(self, again: bool = False) -> None:
        """Catch up with the swarm if it is ahead (the first :meth:`step` does this by itself).

        ``again=True`` looks for a newer state even if this peer caught up before (a training
        mode that noticed it fell behind).
        """
        self._check_open()
        if again or not self._synchronized:
            self._synchronize(catching_up=again and self._synchronized)

    def state_is_finite(self) -> bool:
        """True unless a floating-point tensor of the state holds NaN or Inf (one pass)."""
        return first_non_finite(self._named_state()) is None

    def recover(self, why: str) -> int:
        """Replace a state that went non-finite by a good one; returns the epoch loaded.

        The good state is the swarm's newest (from other peers: a joiner-style, verified
        download) or this peer's newest intact, finite checkpoint, whichever is newer, the
        other one if that fails. Logs one WARNING naming the cause and what was loaded.
        Raises :class:`NonFiniteStateError` when there is nothing good to load, or when the
        state keeps going bad (``MAX_RECOVERIES`` times in ``RECOVERY_WINDOW`` s): reloading
        then only hides a learning rate or data problem.
        """
        self._check_open()
        now = time.monotonic()
        self._recovered_at = [t for t in self._recovered_at if now - t < RECOVERY_WINDOW]
        if len(self._recovered_at) >= MAX_RECOVERIES:
            raise NonFiniteStateError(
                f"the state went non-finite {len(self._recovered_at) + 1} times in "
                f"{RECOVERY_WINDOW:.0f} s although a good state was reloaded each time "
                f"({why}): lower the learning rate, or check the data and the loss"
            )
        sources = [self._recover_from_swarm, self._recover_from_checkpoint]
        if self._store is not None and self.newest_checkpoint_epoch is not None:
            try:
                swarm_epoch = max((s.epoch for s in self._find_states()), default=-1)
            except Exception:  # noqa: BLE001 - no lookup: try our checkpoint first
                swarm_epoch = -1
            if swarm_epoch < self.newest_checkpoint_epoch:
                sources.reverse()
        problems = []
        for source in sources:
            try:
                loaded = source()
            except (StateError, TimeoutError) as e:
                problems.append(str(e))
                continue
            if loaded is None:
                continue
            self._recovered_at.append(now)
            self.recoveries += 1
            logger.warning(
                "the state went non-finite (%s): reloaded %s; training goes on", why, loaded
            )
            return self.epoch
        raise NonFiniteStateError(
            f"the state went non-finite ({why}) and no good state could be reloaded ("
            + ("; ".join(problems) or "no donor serves one and no checkpoint_dir was given")
            + "): lower the learning rate, or check the data and the loss"
        )

    def _recover_from_swarm(self) -> str:
        epoch = self.load_state_from_peers(timeout=self.join_timeout)
        return f"the swarm's state of epoch {epoch}"

    def _recover_from_checkpoint(self) -> str | None:
        if self._store is None:
            return None
        epoch = self.load_checkpoint()
        return f"this peer's checkpoint of epoch {epoch}"

    def _find_states(self) -> list[AdvertisedState]:
        """The announced states, of our schema only if any is (another model's states
        under our prefix are never newer than ours in any sense that matters)."""
        from moshpit.training.sharing import state_schema_digest

        sharing = self._running_sharing()
        schema = state_schema_digest(self.schema())

        async def newest(_dht: object, _node: object) -> list[AdvertisedState]:
            return await sharing.find_states(schema)

        found: list[AdvertisedState] = self.dht.run_coroutine(newest)
        return found

    def _synchronize(self, catching_up: bool = False) -> None:
        """Before the first round: catch up with the swarm if it is ahead of us.

        ``catching_up``: a peer that trained already fell behind. If the newest state does
        not fit its model (only another model's states are announced) it keeps its own,
        with a warning, instead of stopping: the newcomer that raises StateMismatchError is
        the one whose model differs from every state announced when it joins."""
        try:
            states = self._find_states()
        except Exception as e:  # noqa: BLE001 - a failed lookup just means "nobody known"
            logger.info("could not look for donors (%s); starting from the local state", e)
            states = []
        if any(state.epoch > self.epoch for state in states):
            try:
                self.load_state_from_peers(timeout=self.join_timeout)
            except NoDonorError as e:  # the donors left between the lookup and the download
                logger.warning("could not catch up with the swarm (%s); keeping our state", e)
            except StateMismatchError as e:
                if not catching_up:
                    raise
                logger.warning("could not catch up with the swarm (%s); keeping our state", e)
        else:
            logger.info(
                "no donor serves a state newer than epoch %d: starting from ours", self.epoch
            )
        self._synchronized = True

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, wait: bool = True) -> concurrent.futures.Future[Manifest]:
        """Write the current state into ``checkpoint_dir`` and serve it to joiners afterwards.

        The snapshot is taken now, on the calling (training) thread; writing happens in a
        background thread. With ``wait=True`` this returns once the checkpoint is committed.
        """
        self._check_open()
        if self._store is None:
            raise ValueError("no checkpoint_dir was given to TrainingStateAverager")
        return self._snapshot_then(self._write_checkpoint, wait)

    def _snapshot_then(
        self,
        job: Callable[[list[tuple[str, torch.Tensor]], int, dict[str, Any]], T],
        wait: bool,
    ) -> concurrent.futures.Future[T]:
        """Copy the state now (training thread), then run ``job`` on the copy in the writer
        thread: a checkpoint, or the state served from memory."""
        named = [(n, t.detach().to("cpu", copy=True)) for n, t in self._named_state()]
        epoch, metadata = self.epoch, self._metadata()
        future = self._writer.submit(job, named, epoch, metadata)
        self._writing = future
        self._last_checkpoint_time = time.monotonic()
        self._last_checkpoint_epoch = epoch
        if wait:
            future.result()
        else:  # nobody waits for it: a failure must still be seen
            future.add_done_callback(self._checkpoint_done)
        return future

    def _write_checkpoint(
        self, named: list[tuple[str, torch.Tensor]], epoch: int, metadata: dict[str, Any]
    ) -> Manifest:
        """Runs in the writer thread. A non-finite state is never written over a good one."""
        from moshpit.training.store import save_state

        bad = first_non_finite(named)
        if bad is not None:
            raise NonFiniteStateError(
                f"not writing the checkpoint of epoch {epoch}: tensor {bad!r} holds NaN or Inf "
                "(the last good checkpoint stays)"
            )
        assert self._store is not None  # save_checkpoint checked
        manifest = save_state(self._store, named, epoch, metadata)
        self.newest_checkpoint_epoch = epoch
        self.last_checkpoint_at = time.monotonic()
        self.failing_checkpoints = 0
        self._publish(manifest)
        logger.info("checkpoint of epoch %d written (%d bytes)", epoch, manifest.total_bytes)
        return manifest

    def _checkpoint_done(self, future: concurrent.futures.Future[Any]) -> None:
        """A background checkpoint ended: count and log a failure at once (rate-limited)."""
        if future.cancelled() or future.exception() is None:
            return
        error = future.exception()
        with self._failure_lock:
            self._failure_log.warning(
                type(error).__name__,
                "background checkpoint failed (%d so far; %s): %s",
                self.checkpoint_failures + 1,
                _free_space(self._store.directory if self._store is not None else None),
                error,
            )
            self.last_checkpoint_error = str(error)
            self.failing_checkpoints += 1
            self.checkpoint_failures += 1  # last: readers see the count once it was logged

    def maybe_checkpoint(self) -> None:
        """Write a checkpoint in the background if one is due (``checkpoint_every_*``); without
        a ``checkpoint_dir``, serve the state from memory instead (``serve_from_memory``)."""
        if self._store is None and self._memory is None:
            return
        due_time = (
            self.checkpoint_every_seconds is not None
            and time.monotonic() - self._last_checkpoint_time >= self.checkpoint_every_seconds
        )
        due_epoch = (
            self.checkpoint_every_epochs is not None
            and self.epoch - self._last_checkpoint_epoch >= self.checkpoint_every_epochs
        )
        if (due_time or due_epoch) and (self._writing is None or self._writing.done()):
            if self._store is not None:
                self.save_checkpoint(wait=False)
            else:
                self.serve_from_memory(wait=False)

    def serve_from_memory(self, wait: bool = True) -> concurrent.futures.Future[Manifest | None]:
        """Serve the current state from memory (a peer without ``checkpoint_dir``).

        Like :meth:`save_checkpoint`, the snapshot is taken now on the calling thread and the
        manifest is built (hashed) in the background. A non-finite state is not served (the
        state served before stays). The future's result is None then.
        """
        self._check_open()
        if self._memory is None:
            raise ValueError(
                "serving from memory needs serve_from_memory=True and no checkpoint_dir"
            )
        return self._snapshot_then(self._serve_snapshot, wait)

    def _serve_snapshot(
        self, named: list[tuple[str, torch.Tensor]], epoch: int, metadata: dict[str, Any]
    ) -> Manifest | None:
        """Runs in the writer thread: hash the snapshot, then serve it instead of the last."""
        bad = first_non_finite(named)
        if bad is not None:
            logger.warning(
                "not serving the state of epoch %d: tensor %r holds NaN or Inf "
                "(the state served before stays)",
                epoch,
                bad,
            )
            return None
        return self._serve_chunks(*build_manifest(named, epoch, metadata))

    def _serve_chunks(self, manifest: Manifest, chunks: dict[bytes, memoryview]) -> Manifest:
        """Runs in the writer thread: serve ``chunks`` from memory in place of the last."""
        if self._publish(manifest, chunks):
            self.served_epoch = manifest.epoch
        return manifest

    # ------------------------------------------------------------------ serving

    def _start_sharing(self) -> None:
        from moshpit.training.sharing import StateSharing

        source: ChunkSource | None = self._store if self._store is not None else self._memory

        async def create(_dht: object, node: DHTNode) -> StateSharing:
            return StateSharing(node, self.prefix, source)

        self._sharing = self.dht.run_coroutine(create)
        self._sharing_service = self.dht.start_service(self._sharing.run)

    def _running_sharing(self) -> StateSharing:
        if self._sharing is None:  # only before the constructor started it
            raise RuntimeError("state sharing is not running yet")
        return self._sharing

    def _publish(self, manifest: Manifest, chunks: dict[bytes, memoryview] | None = None) -> bool:
        """Serve ``manifest``: from the store, or with ``chunks`` from memory. False: not
        served (no sharing, the DHT is down, or nothing to serve it from)."""
        sharing, memory = self._sharing, self._memory
        if sharing is None or not self.dht.is_alive:
            return False
        if self._store is None and (memory is None or chunks is None):
            return False

        async def publish(_dht: object, _node: object) -> None:
            if memory is not None and chunks is not None:
                memory.replace(chunks)  # with publish, on the loop: served together
            sharing.publish(manifest)
            # announce before returning: a joiner that looks right after save_checkpoint()
            # must find this state (the service loop would announce it only "soon")
            await sharing.announce()

        self.dht.run_coroutine(publish)
        return True

    def withdraw(self, timeout: float = 5.0) -> None:
        """Stop serving and withdraw this peer's DHT declarations (state, matchmaking) now."""
        sharing = self._sharing
        if sharing is None or not self.dht.is_alive:
            return

        async def withdraw(_dht: object, _node: object) -> None:
            import trio

            with trio.move_on_after(timeout):
                await sharing.withdraw()

        try:
            self.dht.run_coroutine(withdraw)
        except (RuntimeError, concurrent.futures.CancelledError) as e:
            logger.debug("could not withdraw the state announcement: %s", e)

    # ------------------------------------------------------------------ lifecycle

    def leave_swarm(self, deadline: float = 25.0) -> None:
        """Leave for good within ``deadline`` seconds (what SIGTERM handling calls).

        Waits up to a third of the deadline for a running round whose group has formed (its
        result is useful work, and its members count on us) and abandons it after that; a round
        still looking for a group is abandoned at once. Then writes a checkpoint if a
        ``checkpoint_dir`` was given, withdraws this peer's announcements and shuts down.
        """
        started = time.monotonic()
        if self._pending is not None and not self._pending.done() and not self.averager.in_group:
            # still looking for a group: nobody depends on us yet, and waiting could take the
            # whole matchmaking timeout for a round that may never form
            logger.info("abandoning the running averaging round: it had no group yet")
        elif self._pending is not None:
            try:
                self._pending.wait(timeout=deadline / 3)
            except TimeoutError:
                logger.warning("abandoning the running averaging round to leave in time")
        self.averager.shutdown()  # no new rounds; a running one is cancelled
        if self._pending is not None:
            self._pending.future.cancel()
            self._pending = None
        failed: CheckpointError | None = None
        if self._store is not None:
            try:
                self.save_checkpoint(wait=True)
            except NonFiniteStateError as e:  # not a failure: the good checkpoint stays
                logger.warning("%s", e)
            except (CheckpointError, OSError) as e:
                failed = CheckpointError(
                    f"could not write the last checkpoint into {self._store.directory} ({e}); "
                    + (
                        f"the newest one on disk is of epoch {self.newest_checkpoint_epoch}"
                        if self.newest_checkpoint_epoch is not None
                        else "no checkpoint of this run is on disk"
                    )
                )
        remaining = deadline - (time.monotonic() - started)
        self.withdraw(timeout=max(0.5, min(5.0, remaining / 2)))
        self.shutdown()
        logger.info("left the swarm in %.2f s at epoch %d", time.monotonic() - started, self.epoch)
        if failed is not None:
            raise failed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TrainingStateAverager was shut down")

    def shutdown(self) -> None:
        """Abandon a running round, finish a checkpoint being written, stop serving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.averager.shutdown()
        if self._pending is not None:
            self._pending.future.cancel()
            self._pending = None
        self._writer.shutdown(wait=True)
        if self._sharing_service is not None:
            self._sharing_service.cancel()
            try:
                self._sharing_service.exception(timeout=10)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
                pass
        if self._dir_lock is not None:
            self._dir_lock.release()

    def __enter__(self) -> TrainingStateAverager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _open_store(
    checkpoint_dir: str | Path | None, keep: int
) -> tuple[StateStore | None, CheckpointDirLock | None]:
    """The checkpoint store and the lock that makes this peer its only writer (None, None
    without a directory). A second peer on the same directory fails here."""
    if checkpoint_dir is None:
        return None, None
    from moshpit.training.dirlock import CheckpointDirLock
    from moshpit.training.store import StateStore

    lock = CheckpointDirLock(checkpoint_dir)
    lock.acquire()
    try:
        return StateStore(checkpoint_dir, keep=keep), lock
    except BaseException:
        lock.release()
        raise


def _notify(event: str, source: TrainingStateAverager, detail: DownloadAttempt) -> None:
    for observer in list(observers):
        try:
            observer(event, source, detail)
        except Exception:  # monitoring must never break training
            logger.exception("training-state observer failed")


def _refuse_non_finite(manifest: Manifest, tensors: Sequence[torch.Tensor]) -> str | None:
    """A checkpoint holding NaN/Inf is passed over on restore (an older one may be good)."""
    bad = first_non_finite(
        (spec.name, t) for spec, t in zip(manifest.tensors, tensors, strict=True)
    )
    return None if bad is None else f"tensor {bad!r} holds NaN or Inf"


def _free_space(directory: Path | None) -> str:
    if directory is None:
        return "no checkpoint directory: the state served from memory"
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free in {directory}"
    except OSError as e:
        return f"free space unknown ({e.strerror})"


def _sync_devices(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for non-blocking device-to-host copies issued on the tensors' devices."""
    devices = {t.device for t in tensors if t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
