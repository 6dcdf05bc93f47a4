"""A simulated volunteer run: N peers training a tiny model under preemptions, virtual time.

Each peer trains a small MLP on sklearn's digits (the loss is real), taking
``base_step_seconds / speed`` virtual seconds per step with ``speed`` drawn log-uniformly
from 1x-8x (a heterogeneous fleet). With failures on, a peer lives an exponential time
(mean ``--lifetime``), is preempted without notice (its host vanishes from the network, as a
killed VM does), stays away an exponential time (mean ``--downtime``) and comes back as a fresh
process: a new DHT node and identity, an empty disk, so it loads the run's state from donors
first. The same run without failures is the baseline, in the same invocation.

What runs for real, all on one trio loop on ``dht.p2p.MemoryNetwork`` (the heterogeneous links
of ``benchmarks.sim_swarm.WanNetwork``) under ``trio.testing.MockClock(autojump_threshold=0)``
with ``dht_clock(trio_clock)``, production defaults unless a flag says otherwise:

- ``DHTNode`` + ``Host`` (Kademlia, Noise, yamux) per peer;
- ``moshpit.averaging.Averager`` (``astep``): Moshpit matchmaking and butterfly all-reduce;
- ``moshpit.training.sharing.StateSharing``: signed state records, manifest and chunk RPCs,
  hash verification, bans; donors serve checkpoints from a real
  ``moshpit.training.store.StateStore`` written by ``save_state`` once per epoch, when
  ``TrainingStateAverager.maybe_checkpoint`` would (local: as the next round starts;
  diloco: right after the outer step);
- ``moshpit.training.progress.ProgressTracker``: progress records and their aggregation;
- the modes' decision code: ``AdaptivePeriod`` and ``LocalMode``'s shared-period packing,
  ``correct_after_round`` (``mode="local"``); ``EpochRounds``, ``outer_prefix`` and the outer
  Nesterov step on θ (``mode="diloco"``).

What cannot run under the virtual clock, and is simulated around: ``moshpit.Optimizer``, its
modes' ``step()`` and ``TrainingStateAverager``. They are synchronous: the training thread
blocks on ``concurrent.futures`` (``dht.run_coroutine``, ``future.result()``, a checkpoint
writer thread) and measures time with ``time.monotonic``; on one trio loop a blocking wait
would deadlock, and an autojumping clock does not wait for threads. :class:`SimPeer` is their
async transcription with the same sequence and the same numbers: a background averaging round
every H steps applied as ``averaged - snapshot`` (local); H inner steps, then a per-epoch
round that waits for the peers the view shows at the epoch, catch-up by loading state, solo
steps when alone (diloco); a joiner looks for a newer state before its first step. Not
transcribed: non-finite recovery, preemption notices (peers die abruptly here), streaming
DiLoCo, compression. Also simulated: the compute (a ``trio.sleep`` of the step's virtual
time; the gradient itself is computed at once), and the disk (``StateStore(durable=False)``
in a temporary directory: no fsync, which a simulation does not need to survive a power cut).
Threads are kept out: ``StateSharing(thread_min_bytes=inf)`` and a model far below the
averager's ``THREAD_MIN_NUMEL``/``WRITE_INLINE_NUMEL`` (see ``sim_swarm.py``).

Wasted compute: the virtual compute seconds a preempted peer had not contributed yet (local:
steps after the snapshot of its last successful round; diloco: inner steps since its last
outer step). Discarded compute (diloco): inner steps a laggard drops when it loads a newer θ
instead of applying a stale pseudo-gradient. One JSON object per line: ``{"kind": "tick", ...}`` per ``--tick`` virtual
seconds (swarm size, mean held-out loss of the live peers), and ``{"kind": "result", ...}``
with the failure run's numbers, the baseline's, and their ratios.

    nice -n 10 python benchmarks/sim_training.py --peers 16 --mode local --minutes 15
    nice -n 10 python benchmarks/sim_training.py --peers 16 --mode diloco --minutes 30 \
        --plot diloco.png

Cost grows faster than the swarm (measured, ``mode="local"``, before ``open_swarm`` raised
the garbage collector's thresholds): ~0.3-0.4 CPU s per peer and virtual minute at 16 peers,
~0.55 at 32, ~1.2 at 64, ~1.9 at 128. Not profiled at those sizes; candidates are full
garbage collections walking the whole swarm's heap and every peer reading every progress
record every few seconds (quadratic in the swarm).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sim_swarm import JOIN_CONCURRENCY, WanNetwork, peak_rss_bytes  # noqa: E402
from dht.kademlia.clock import dht_clock, get_dht_time, trio_clock  # noqa: E402
from dht.kademlia.simulation import Swarm, open_swarm  # noqa: E402
from moshpit.averaging.allreduce_protocol import MAX_WEIGHT  # noqa: E402
from moshpit.averaging.averager import Averager, StepResult  # noqa: E402
from moshpit.averaging.config import (  # noqa: E402
    DEFAULT_MIN_MATCHMAKING_TIME,
    DEFAULT_REQUEST_TIMEOUT,
    default_matchmaking_timeout,
)
from moshpit.averaging.matchmaking import SchemaMemory  # noqa: E402
from moshpit.training.adaptive_period import AdaptivePeriod  # noqa: E402
from moshpit.training.errors import (  # noqa: E402
    NoDonorError,
    StateDownloadError,
    StateMismatchError,
)
from moshpit.training.manifest import dtype_name  # noqa: E402
from moshpit.training.modes.base import FRESH_VIEW  # noqa: E402
from moshpit.training.modes.diloco import outer_prefix  # noqa: E402
from moshpit.training.modes.epoch_rounds import RECENT_STEPS, EpochRounds  # noqa: E402
from moshpit.training.modes.local import LocalMode  # noqa: E402
from moshpit.training.progress import ProgressTracker  # noqa: E402
from moshpit.training.sharing import StateSharing, state_schema_digest  # noqa: E402
from moshpit.training.state_averager import correct_after_round  # noqa: E402
from moshpit.training.store import StateStore, save_state  # noqa: E402

logger = logging.getLogger(__name__)

RUN_ID = "sim-run"
# tmpfs when there is one: every store makes 256 chunk directories, slow to remove on a disk
SCRATCH = "/dev/shm" if Path("/dev/shm").is_dir() else None
MODES = ("local", "diloco")


@dataclass
class SimConfig:
    peers: int = 16
    mode: str = "local"
    minutes: float = 10.0
    lifetime: float = 1800.0  # mean virtual s a peer lives
    downtime: float = 300.0  # mean virtual s a preempted peer stays away
    failures: bool = True
    seed: int = 0
    base_step_seconds: float = 30.0  # a 1x machine's step; an 8x one takes 1/8 of it
    speeds: tuple[float, float] = (1.0, 8.0)
    peer_speeds: tuple[float, ...] = ()  # if given: peer i's speed is peer_speeds[i % len]
    batch_size: int = 32
    hidden: int = 32
    lr: float = 0.2
    average_every: int = 4  # local: the initial H
    inner_steps: int = 20  # diloco: H (lockstep)
    target_batch_size: int | None = None  # diloco: swarm-wide epochs of S samples (not H)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    target_group_size: int = 16  # moshpit.Optimizer's default
    load_state_timeout: float = 30.0  # moshpit.Optimizer's default
    progress_ttl: float = 30.0  # moshpit.Optimizer's default
    tick: float = 60.0  # virtual s between timeline rows
    keep_published: bool = False  # keep every published state's tensors (tests compare them)


# ---------------------------------------------------------------------------- the task


@dataclass
class Task:
    """sklearn's digits, split once: peers sample training batches, the loss is held out."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @classmethod
    @functools.lru_cache(maxsize=4)
    def load(cls, seed: int) -> Task:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.int64)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        test, train = order[:300], order[300:]
        return cls(x[train], y[train], x[test], y[test])


def make_model(hidden: int, seed: int) -> torch.nn.Module:
    """Every peer starts from the same weights (one seed), as the training guide asks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
    )


def held_out_loss(model: torch.nn.Module, task: Task) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(task.x_test), task.y_test))


# ---------------------------------------------------------------------------- bookkeeping


@dataclass
class Download:
    slot: int
    reason: str  # "join": a (returning) peer's first look; "catch-up": a laggard's
    started: float  # virtual s
    seconds: float
    epoch: int | None  # of the state loaded (None: failed)
    root: bytes | None
    swarm_epoch: int  # the highest epoch any live peer had when the download started
    tensors: list[torch.Tensor] | None = None  # as downloaded (keep_published only)
    adopted: list[torch.Tensor] | None = None  # the peer's state right after adopting them
    error: str | None = None


@dataclass
class Stats:
    compute_seconds: float = 0.0  # virtual compute seconds spent by all peers
    alive_seconds: float = 0.0  # virtual seconds the peers were alive (utilisation's base)
    wasted_seconds: float = 0.0  # ... lost by preemptions
    discarded_seconds: float = 0.0  # ... discarded by a catch-up (diloco: stale inner steps)
    samples: int = 0
    wasted_samples: int = 0
    discarded_samples: int = 0
    steps: int = 0
    preemptions: int = 0
    returns: int = 0
    rounds_ok: int = 0
    rounds_failed: int = 0
    solo_steps: int = 0
    theta_mismatches: int = 0
    # diloco: every applied round's θ, (epoch applied at, group id, slot, θ digest)
    applied: list[tuple[int, bytes | None, int, bytes]] = field(default_factory=list)
    failure_reasons: dict[str, int] = field(default_factory=dict)
    downloads: list[Download] = field(default_factory=list)
    published: dict[bytes, tuple[int, list[torch.Tensor] | None]] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def failed_round(self, result: StepResult) -> None:
        """Count a failed round under (the start of) its reason."""
        self.rounds_failed += 1
        reason = str(result.reason)[:60]
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1

    def check_thetas(self, result: StepResult, digest: bytes) -> None:
        """``DiLoCoMode._check_thetas``: a member that started from another θ is counted."""
        gathered = result.gathered.values()
        thetas = [g.get("theta") if isinstance(g, dict) else None for g in gathered]
        if result.succeeded and any(t != digest for t in thetas):
            self.theta_mismatches += 1


@dataclass
class SimRound:
    """``FragmentRound`` with one fragment: a swarm-wide outer round running as a task in the
    peer's nursery while its inner steps go on."""

    epoch: int
    averager: Averager
    start_local: list[torch.Tensor]  # the local parameters when Δ was taken
    digest: bytes
    samples: int  # the samples behind Δ (its weight)
    compute: float  # the uncommitted compute seconds behind Δ (committed when it lands)
    compute_samples: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    result: StepResult | None = None
    done: bool = False


# ---------------------------------------------------------------------------- one peer


class SimPeer:
    """One incarnation of a volunteer: the async transcription of ``moshpit.Optimizer`` in
    ``mode`` with a ``checkpoint_dir`` (module doc says what is transcribed and why)."""

    def __init__(
        self, sim: Simulation, slot: int, node: Any, speed: float, directory: Path
    ) -> None:
        cfg = sim.cfg
        self.sim, self.cfg, self.slot, self.node, self.speed = sim, cfg, slot, node, speed
        self.rng = random.Random(cfg.seed * 7919 + slot * 104729 + sim.stats.returns)
        self.model = make_model(cfg.hidden, cfg.seed)
        self.params = list(self.model.parameters())
        self.inner = torch.optim.SGD(self.params, lr=cfg.lr)
        self.epoch = 0
        self.local_steps = 0
        self.samples = 0  # since the epoch's round started (what progress reports)
        self.uncommitted = 0.0  # compute seconds not yet in the swarm's state
        self.uncommitted_samples = 0  # ... and their samples
        self.downloading = False
        self.store = StateStore(directory, durable=False)
        # thread_min_bytes=inf: store reads and hashing stay on the loop (module doc)
        self.sharing = StateSharing(node, RUN_ID, self.store, thread_min_bytes=math.inf)
        self.swarm_wide = cfg.mode == "diloco" and cfg.target_batch_size is not None
        self.tracker = ProgressTracker(
            node, RUN_ID, target_batch_size=cfg.target_batch_size, ttl=cfg.progress_ttl
        )
        self.refresh_period = self.tracker.min_refresh_period
        self._last_refresh = -math.inf
        if cfg.mode == "local":
            self.period = AdaptivePeriod(cfg.average_every, max_period=64)
            self._shared_period = torch.zeros(4, dtype=torch.int64)
            LocalMode._pack_period(self)  # type: ignore[arg-type]  # the same packing code
            self.buffers = [torch.empty_like(p) for p in self.params]
            self.snapshot = [torch.empty_like(p) for p in self.params]
            self.averager = Averager(
                self.buffers, dht=node, prefix=RUN_ID, target_group_size=cfg.target_group_size
            )
            self.round: StepResult | None = None
            self.round_running = False
            self.round_compute = 0.0  # uncommitted compute the running round's snapshot holds
            self.round_samples = 0
            self.checkpointed_epoch = 0
        else:
            self.theta = [p.detach().clone() for p in self.params]
            self.outer = torch.optim.SGD(
                self.theta, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True
            )
            # StateTensors.create_optimizer_state: a zero-gradient step creates the
            # momentum buffers, so a joiner's schema matches a donor's before any outer step
            for t in self.theta:
                t.grad = torch.zeros_like(t)
            self.outer.step()
            for t in self.theta:
                t.grad = None
            self.deltas = [torch.zeros_like(t) for t in self.theta]
            self.schema_memory = SchemaMemory()
            self.rounds = EpochRounds(str(node.peer_id), cfg.target_group_size)
            self.alone = False
            self.behind_since: float | None = None
            self.next_catch_up = -math.inf
            self.round_target = cfg.target_batch_size or 0  # swarm-wide: one fragment
            self.in_flight: SimRound | None = None
        self.tracker.set_schema(*self.schema_digest())

    # ------------------------------------------------------------------ the shared state

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Names and order as ``TrainingStateAverager._named_state`` gives them."""
        if self.cfg.mode == "local":  # SGD without momentum: no optimizer tensors
            named = [(f"params.{i}", p) for i, p in enumerate(self.params)]
            return [*named, ("extra.0", self._shared_period)]
        named = [(f"params.{i}", t) for i, t in enumerate(self.theta)]
        for i, t in enumerate(self.theta):
            named.append((f"optimizer.{i}.momentum_buffer", self.outer.state[t]["momentum_buffer"]))
        return named

    def schema(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.named_state()]

    def schema_digest(self) -> tuple[bytes, str]:
        schema = self.schema()
        values = sum(math.prod(shape) for _, _, shape in schema)
        digest = state_schema_digest(schema, with_dtypes=False)
        return digest, f"{len(schema)} state tensors, {values} values"

    async def checkpoint(self) -> None:
        """Write, publish and announce the state (``checkpoint_every_epochs=1``)."""
        named = [(n, t.detach().clone()) for n, t in self.named_state()]
        manifest = save_state(self.store, named, self.epoch)
        kept = [t for _, t in named] if self.cfg.keep_published else None
        self.sim.stats.published.setdefault(manifest.root, (manifest.epoch, kept))
        self.sharing.publish(manifest)
        await self.sharing.announce()

    async def synchronize(self, reason: str = "catch-up") -> None:
        """``TrainingStateAverager._synchronize``: load the swarm's state if it is newer."""
        try:
            states = await self.sharing.find_states(state_schema_digest(self.schema()))
        except Exception as e:  # noqa: BLE001 - a failed lookup means "nobody known"
            logger.info("could not look for donors (%s)", e)
            states = []
        if any(s.epoch > self.epoch for s in states):
            await self.load_state(reason)

    async def load_state(self, reason: str) -> bool:
        """``load_state_from_peers``: download, verify, adopt, serve; False if it failed."""
        stats, started = self.sim.stats, trio.current_time()
        record = Download(self.slot, reason, started, 0.0, None, None, self.sim.swarm_epoch())
        self.downloading = True
        # a download cut short (cancelled: the peer died, or the run ended) is not counted
        try:
            result = await self.sharing.download(
                self.schema(), timeout=self.cfg.load_state_timeout, sink=self.store
            )
        except (NoDonorError, StateDownloadError, StateMismatchError) as e:
            record.error = str(e)
            record.seconds = trio.current_time() - started
            stats.downloads.append(record)
            return False
        finally:
            self.downloading = False
        record.seconds = trio.current_time() - started
        stats.downloads.append(record)
        record.epoch, record.root = result.manifest.epoch, result.manifest.root
        if self.cfg.keep_published:
            record.tensors = [t.clone() for t in result.tensors]
        result.manifest.check_fits(self.schema())
        with torch.no_grad():
            for (_, live), value in zip(self.named_state(), result.tensors, strict=True):
                live.copy_(value)
        self.epoch = result.manifest.epoch
        if self.cfg.keep_published:
            record.adopted = [t.detach().clone() for _, t in self.named_state()]
        self.sharing.publish(result.manifest)  # the sink holds every chunk now: serve it
        await self.sharing.announce()
        self.on_state_loaded()
        return True

    def on_state_loaded(self) -> None:
        if self.cfg.mode == "local":
            LocalMode._unpack_period(self)  # type: ignore[arg-type]
        else:
            self.drop_in_flight()
            with torch.no_grad():
                for p, t in zip(self.params, self.theta, strict=True):
                    p.copy_(t)
            self.rounds.alone()
        self.sim.stats.discarded_seconds += self.uncommitted
        self.sim.stats.discarded_samples += self.uncommitted_samples
        self.uncommitted, self.uncommitted_samples = 0.0, 0
        self.local_steps = 0
        self.samples = 0
        self.tracker.report(self.epoch, 0)

    # ------------------------------------------------------------------ the loop

    async def run(self, lifetime: float) -> None:
        """Train until ``lifetime`` virtual seconds are over, then die without notice."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sharing.run)
            await nursery.start(self.tracker.run)
            self.nursery = nursery
            with trio.move_on_after(lifetime):
                await self.synchronize("join")
                self.tracker.report(self.epoch, 0)
                while True:
                    await self.step()
            self.die()
            nursery.cancel_scope.cancel()

    def die(self) -> None:
        self.sim.stats.wasted_seconds += self.uncommitted
        self.sim.stats.wasted_samples += self.uncommitted_samples
        self.sim.stats.preemptions += 1
        self.sim.swarm.kill(self.node)  # the host vanishes first: nothing is withdrawn
        if self.cfg.mode == "local":
            self.averager.shutdown()
        else:
            self.drop_in_flight()

    async def step(self) -> None:
        """One local step: the compute (virtual time), the real gradient, then the mode."""
        seconds = self.cfg.base_step_seconds / self.speed
        await trio.sleep(seconds)
        task, bs = self.sim.task, self.cfg.batch_size
        idx = torch.tensor([self.rng.randrange(len(task.x_train)) for _ in range(bs)])
        self.inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(task.x_train[idx]), task.y_train[idx])
        loss.backward()
        stats = self.sim.stats
        stats.compute_seconds += seconds
        stats.samples += bs
        stats.steps += 1
        self.uncommitted += seconds
        self.uncommitted_samples += bs
        if self.cfg.mode == "local":
            await self.local_step(bs)
        else:
            await self.diloco_step(bs)

    # ------------------------------------------------------------------ mode="local"

    async def local_step(self, batch_size: int) -> None:
        await self.collect()
        self.inner.step()
        self.local_steps += 1
        self.samples += batch_size
        self.tracker.report(self.epoch, self.samples)
        if self.local_steps >= self.period.period and not self.round_running:
            self.local_steps = 0
            self.samples = 0
            with torch.no_grad():
                for b, s, p in zip(self.buffers, self.snapshot, self.params, strict=True):
                    b.copy_(p)
                    s.copy_(p)
            self.round_compute = self.uncommitted
            self.round_samples = self.uncommitted_samples
            self.round_running = True
            self.nursery.start_soon(self._local_round)
            # TrainingStateAverager.step: maybe_checkpoint() right after starting the round
            if self.epoch > self.checkpointed_epoch:
                self.checkpointed_epoch = self.epoch
                await self.checkpoint()

    async def _local_round(self) -> None:
        self.round = await self.averager.astep()

    async def collect(self) -> None:
        """``apply_pending`` + ``LocalMode._account``: apply a finished round."""
        if not self.round_running or self.round is None:
            return
        result, self.round, self.round_running = self.round, None, False
        stats = self.sim.stats
        if not result.succeeded:
            stats.failed_round(result)
            return
        delta_sq = norm_sq = mean_sq = 0.0
        with torch.no_grad():
            for p, b, s in zip(self.params, self.buffers, self.snapshot, strict=True):
                mean_sq += float(torch.linalg.vector_norm(b, dtype=torch.float64)) ** 2
                correct_after_round(p, b, s, nonnegative=False)
                delta_sq += float(torch.linalg.vector_norm(b - s, dtype=torch.float64)) ** 2
                norm_sq += float(torch.linalg.vector_norm(s, dtype=torch.float64)) ** 2
        stats.rounds_ok += 1
        self.uncommitted -= self.round_compute  # the snapshot's steps are in the swarm now
        self.uncommitted_samples -= self.round_samples
        self.epoch += 1
        spread = result.group_deviation
        if spread is not None and mean_sq > 0:
            self.period.update((spread / mean_sq) ** 0.5)
        else:
            self.period.update((delta_sq / norm_sq) ** 0.5 if norm_sq > 0 else 0.0)
        LocalMode._pack_period(self)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ mode="diloco"

    async def view(self, force: bool = False) -> Any:
        """``TrainingMode._view`` on virtual time."""
        now = trio.current_time()
        if force or now - self._last_refresh >= self.refresh_period:
            self._last_refresh = now
            with trio.move_on_after(self.tracker.request_timeout * 2):
                try:
                    return await self.tracker.arefresh()
                except Exception as e:  # noqa: BLE001 - a failed read: use the last view
                    logger.debug("progress refresh failed: %r", e)
        return self.tracker.global_progress

    async def diloco_step(self, batch_size: int) -> None:
        if self.swarm_wide:
            await self.swarm_step(batch_size)
            return
        self.inner.step()
        self.local_steps += 1
        self.samples += batch_size
        self.tracker.report(self.epoch, self.samples)
        if self.local_steps >= self.cfg.inner_steps:
            await self.outer_round()

    async def may_start_round(self, view: Any, epoch: int) -> bool:
        """``DiLoCoMode._may_start_round``: False when peers are past ``epoch`` (then catch up,
        at most every refresh period); a peer at our epoch means we are not alone any more."""
        same, ahead = self.rounds.others(view, epoch)
        if ahead:
            if trio.current_time() >= self.next_catch_up:
                await self.catch_up()
            return False
        if same:
            self.alone = False
        return True

    async def outer_round(self) -> None:
        """``DiLoCoMode._outer_round``."""
        epoch, stats = self.epoch, self.sim.stats
        view = await self.view()
        if get_dht_time() - view.time > FRESH_VIEW:
            view = await self.view(force=True)
        if not await self.may_start_round(view, epoch):
            return
        with torch.no_grad():
            for d, t, p in zip(self.deltas, self.theta, self.params, strict=True):
                torch.sub(t, p, out=d)
        if self.alone:
            self.apply(None)
            return
        result = await self.average(epoch, self.rounds.expected(view, epoch))
        stats.check_thetas(result, self._theta_digest)
        if result.succeeded and self.rounds.complete(result):
            stats.rounds_ok += 1
            self.apply(result)
            await self.checkpoint()
            return
        stats.failed_round(result)
        view = await self.view(force=True)
        same, ahead = self.rounds.others(view, epoch)
        self.rounds.forget_unseen(view)
        if ahead:
            await self.catch_up()
        elif not same and not self.rounds.with_us_last_round(view):
            self.alone = True
            self.apply(None)
            await self.checkpoint()
        else:
            self.tracker.mark_idle()

    # ------------------------------------------------------------------ swarm-wide epochs

    def report_progress(self, samples: int) -> None:
        """``DiLoCoMode.report_progress``: a round in flight adds the samples behind its Δ."""
        if self.in_flight is not None:
            samples += self.in_flight.samples
        self.tracker.report(self.epoch, samples)

    async def swarm_step(self, batch_size: int) -> None:
        """``DiLoCoMode.step`` + ``_swarm_step`` (``target_batch_size``): start the epoch's
        round once our samples, or the swarm's projected from the view, reach the target;
        while it is in flight keep stepping, and land it at the first step after it ended."""
        self.inner.step()
        self.local_steps += 1
        self.samples += batch_size
        self.report_progress(self.samples)
        rnd = self.in_flight
        if rnd is not None:
            if rnd.done:
                await self.land(rnd)
            return
        epoch = self.epoch
        view = await self.view()
        if view.epoch > epoch:
            if trio.current_time() >= self.next_catch_up:
                await self.catch_up()
            return
        if (
            self.samples < self.round_target
            and self.rounds.projected_samples(
                view, epoch, self.samples, self.tracker.samples_per_second
            )
            < self.round_target
        ):
            return
        if get_dht_time() - view.time > FRESH_VIEW:  # _fresh_view
            view = await self.view(force=True)
        await self.start_round(view)

    async def start_round(self, view: Any) -> None:
        """``_start_fragment_round`` + ``_start_round``: Δ = θ - the local parameters now,
        averaged in the background with the peers of the epoch; the matchmaking window is
        widened by ``RECENT_STEPS`` times the slowest awaited peer's step."""
        epoch = self.epoch
        if not await self.may_start_round(view, epoch):
            return
        start_local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for d, t, local in zip(self.deltas, self.theta, start_local, strict=True):
                torch.sub(t, local, out=d)
        self.local_steps = 0
        if self.alone:
            self.apply_merged(epoch, start_local, None)
            self.samples = 0
            self.uncommitted, self.uncommitted_samples = 0.0, 0
            await self.checkpoint()
            return
        slowest = self.rounds.slowest_step(view, epoch)
        expected = self.rounds.expected(view, epoch)
        options: dict[str, Any] = {}
        if slowest > 0:
            window = default_matchmaking_timeout(
                DEFAULT_MIN_MATCHMAKING_TIME, DEFAULT_REQUEST_TIMEOUT
            )
            options["matchmaking_timeout"] = window + RECENT_STEPS * slowest
        tgs = self.cfg.target_group_size
        averager = Averager(
            self.deltas,
            dht=self.node,
            prefix=outer_prefix(RUN_ID, epoch),
            target_group_size=tgs,
            schema_memory=self.schema_memory,
            min_group_size=max(2, min(expected, tgs)),
            **options,
        )
        rnd = SimRound(
            epoch,
            averager,
            start_local,
            self.theta_digest(),
            self.samples,
            self.uncommitted,
            self.uncommitted_samples,
        )
        self.in_flight = rnd
        self.samples = 0
        gather = {"theta": rnd.digest, "peers": expected, "samples": int(rnd.samples)}
        self.nursery.start_soon(self._round, rnd, gather)

    async def _round(self, rnd: SimRound, gather: dict[str, Any]) -> None:
        """The averager's step in the background (the real one runs on the DHT's thread)."""
        with rnd.scope:
            rnd.result = await rnd.averager.astep(
                weight=float(min(max(rnd.samples, 1), MAX_WEIGHT)), gather=gather
            )
        rnd.done = True

    def drop_in_flight(self) -> None:
        """``_drop_in_flight``: abandon the round in flight, if any."""
        rnd, self.in_flight = self.in_flight, None
        if rnd is not None:
            rnd.scope.cancel()
            rnd.averager.shutdown()

    async def land(self, rnd: SimRound) -> None:
        """``DiLoCoMode._land``: apply the round's mean Δ, or decide what next."""
        self.in_flight = None
        rnd.averager.shutdown()
        stats = self.sim.stats
        result = rnd.result
        if result is None:  # cancelled
            result = StepResult(False, rnd.averager.keys.key, reason="the swarm moved on")
        stats.check_thetas(result, rnd.digest)
        if result.succeeded and self.rounds.complete(result):
            stats.rounds_ok += 1
            self.commit(rnd)
            self.apply_merged(rnd.epoch, rnd.start_local, result)
            await self.checkpoint()
            return
        stats.failed_round(result)
        view = self.tracker.global_progress  # cached, as _land reads it
        same, ahead = self.rounds.others(view, rnd.epoch)
        self.rounds.forget_unseen(view)
        if ahead:
            await self.catch_up()
        elif not same and not self.rounds.with_us_last_round(view):
            self.alone = True
            self.commit(rnd)
            self.apply_merged(rnd.epoch, rnd.start_local, None)
            await self.checkpoint()
        else:  # retried at the next step, its Δ taken again from θ: so is its weight
            self.samples += rnd.samples

    def commit(self, rnd: SimRound) -> None:
        """The compute behind the round's Δ is in the swarm's state now."""
        self.uncommitted -= rnd.compute
        self.uncommitted_samples -= rnd.compute_samples

    def apply_merged(
        self, epoch: int, start_local: list[torch.Tensor], result: StepResult | None
    ) -> None:
        """``DiLoCoMode._apply_fragment`` (one fragment): outer step on θ with the (mean) Δ;
        the local parameters become the new θ plus the progress made since Δ was taken."""
        with torch.no_grad():
            for t, d, local in zip(self.theta, self.deltas, start_local, strict=True):
                if result is None:  # our own Δ (a failed round may have left it half-averaged)
                    torch.sub(t, local, out=d)
                t.grad = d
            self.outer.step()
            for p, t, local in zip(self.params, self.theta, start_local, strict=True):
                t.grad = None
                p.copy_(p - local + t)
        self.epoch = epoch + 1
        if result is None:
            self.sim.stats.solo_steps += 1
            self.rounds.alone()
        else:
            self.rounds.stepped_with(result)
            self.sim.stats.applied.append(
                (self.epoch, result.group_id, self.slot, self.theta_digest())
            )
        self.report_progress(self.samples)

    def theta_digest(self) -> bytes:
        """``DiLoCoMode._theta_digest``."""
        h = hashlib.blake2b(digest_size=16)
        for t in self.theta:
            h.update(t.numpy().tobytes())
        return h.digest()

    async def average(self, epoch: int, expected: int) -> StepResult:
        """``_start_round`` + ``_average``: a per-epoch averager, abandoned when the swarm's
        view shows a later epoch (``wait_unless_left_behind``)."""
        h = hashlib.blake2b(digest_size=16)
        for t in self.theta:
            h.update(t.numpy().tobytes())
        self._theta_digest = h.digest()
        averager = Averager(
            self.deltas,
            dht=self.node,
            prefix=outer_prefix(RUN_ID, epoch),
            target_group_size=self.cfg.target_group_size,
            schema_memory=self.schema_memory,
            min_group_size=max(2, min(expected, self.cfg.target_group_size)),
        )
        box: list[StepResult] = []
        done = trio.Event()

        async def run() -> None:
            box.append(
                await averager.astep(
                    weight=float(min(max(self.samples, 1), MAX_WEIGHT)),
                    gather={"theta": self._theta_digest, "peers": expected},
                )
            )
            done.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                while not done.is_set():
                    with trio.move_on_after(self.refresh_period):
                        await done.wait()
                    if not done.is_set() and (await self.view()).epoch > epoch:
                        nursery.cancel_scope.cancel()
        finally:
            averager.shutdown()
        if not box:
            return StepResult(False, averager.keys.key, reason="the swarm moved on")
        return box[0]

    def apply(self, result: StepResult | None) -> None:
        """``DiLoCoMode._apply``: outer step with the (mean) Δ, inner loop restarts from θ."""
        for t, d in zip(self.theta, self.deltas, strict=True):
            t.grad = d
        self.outer.step()
        for t in self.theta:
            t.grad = None
        with torch.no_grad():
            for p, t in zip(self.params, self.theta, strict=True):
                p.copy_(t)
        if result is None:
            self.sim.stats.solo_steps += 1
            self.rounds.alone()
        else:
            self.rounds.stepped_with(result)
            self.sim.stats.applied.append(
                (self.epoch + 1, result.group_id, self.slot, self.theta_digest())
            )
        self.uncommitted, self.uncommitted_samples = 0.0, 0
        self.local_steps = 0
        self.samples = 0
        self.epoch += 1
        self.tracker.report(self.epoch, 0)

    async def catch_up(self) -> None:
        """``DiLoCoMode._catch_up``: adopt the swarm's θ instead of a stale Δ."""
        before = self.epoch
        if not self.swarm_wide:  # lockstep as transcribed before 'cu' (module doc)
            await self.synchronize()
        else:
            tracker = self.tracker
            tracker.set_catching_up(max(tracker.global_progress.epoch, before + 1))
            try:
                await self.synchronize()
            finally:
                tracker.set_catching_up(None)
        if self.epoch != before:
            self.behind_since = None
            return
        now = trio.current_time()
        if self.behind_since is None:
            self.behind_since = now
        if now - self.behind_since < self.cfg.load_state_timeout:
            self.next_catch_up = now + self.refresh_period
            return
        self.behind_since = None
        with torch.no_grad():
            for d, t, p in zip(self.deltas, self.theta, self.params, strict=True):
                torch.sub(t, p, out=d)
        self.apply(None)
        await self.checkpoint()


# ---------------------------------------------------------------------------- the swarm


class Simulation:
    def __init__(self, cfg: SimConfig, swarm: Swarm, root: Path) -> None:
        self.cfg, self.swarm, self.root = cfg, swarm, root
        self.task = Task.load(cfg.seed)
        self.stats = Stats()
        self.live: dict[int, SimPeer] = {}
        self.rng = random.Random(cfg.seed)
        low, high = (math.log(s) for s in cfg.speeds)
        self.speed = [math.exp(self.rng.uniform(low, high)) for _ in range(cfg.peers)]
        if cfg.peer_speeds:
            self.speed = [cfg.peer_speeds[i % len(cfg.peer_speeds)] for i in range(cfg.peers)]
        self._dirs = 0
        self.t0 = 0.0  # virtual time at which training started

    def swarm_epoch(self) -> int:
        return max((p.epoch for p in self.live.values()), default=0)

    def mean_loss(self) -> float | None:
        losses = [held_out_loss(p.model, self.task) for p in self.live.values()]
        return sum(losses) / len(losses) if losses else None

    async def slot(self, i: int, node: Any) -> None:
        """Peer ``i``'s life: train until preempted, stay away, come back fresh, repeat."""
        cfg, rng = self.cfg, random.Random(self.cfg.seed * 1_000_003 + i)
        while True:
            if node is None:
                node = await self.rejoin(i, rng)
                self.stats.returns += 1
            self._dirs += 1
            directory = self.root / f"peer{self._dirs}"
            peer = SimPeer(self, i, node, self.speed[i], directory)
            lifetime = rng.expovariate(1 / cfg.lifetime) if cfg.failures else math.inf
            self.live[i] = peer
            born = trio.current_time()
            try:
                await peer.run(lifetime)
            finally:
                self.live.pop(i, None)
                self.stats.alive_seconds += trio.current_time() - born
            shutil.rmtree(directory, ignore_errors=True)  # a preempted VM's disk is gone
            node = None
            await trio.sleep(rng.expovariate(1 / cfg.downtime))

    async def rejoin(self, i: int, rng: random.Random) -> Any:
        """A fresh DHT node, joined through a few live peers (a volunteer's client knows
        several); if all of them left during the bootstrap, it tries again."""
        while True:
            alive = self.swarm.alive()
            try:
                return await self.swarm.add(rng.sample(alive, min(3, len(alive))))
            except Exception as e:  # noqa: BLE001 - BootstrapError and the dial errors
                logger.info("peer %d could not join (%s); trying again", i, e)
                await trio.sleep(10.0)

    def tick_row(self, run: str) -> dict[str, Any]:
        s = self.stats
        loss = self.mean_loss()
        return {
            "kind": "tick",
            "run": run,
            "t": round(trio.current_time() - self.t0, 1),
            "alive": len(self.live),
            "downloading": sum(p.downloading for p in self.live.values()),
            "loss": None if loss is None else round(loss, 4),
            "max_epoch": self.swarm_epoch(),
            "samples": s.samples,
            "preemptions": s.preemptions,
            "downloads": len(s.downloads),
        }


async def simulate(cfg: SimConfig, run: str = "run", emit: Any = None) -> dict[str, Any]:
    """One run, inside ``trio.run`` with an autojumping MockClock; returns its summary."""
    w0, c0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(1)
    net = WanNetwork(cfg.seed)
    with (
        dht_clock(trio_clock),
        tempfile.TemporaryDirectory(prefix="sim-training-", dir=SCRATCH) as tmp,
    ):
        async with open_swarm(1, memory_network=net, seed=cfg.seed) as swarm:
            while len(swarm.nodes) < cfg.peers:  # as sim_swarm.open_sim forms its swarm
                batch = min(JOIN_CONCURRENCY, cfg.peers - len(swarm.nodes))
                async with trio.open_nursery() as nursery:
                    for _ in range(batch):
                        nursery.start_soon(swarm.add)
            setup_wall = time.perf_counter() - w0
            sim = Simulation(cfg, swarm, Path(tmp))
            sim.t0 = trio.current_time()
            loss0 = held_out_loss(make_model(cfg.hidden, cfg.seed), sim.task)
            async with trio.open_nursery() as nursery:
                for i, node in enumerate(list(swarm.nodes)):
                    nursery.start_soon(sim.slot, i, node)
                for _ in range(max(1, round(cfg.minutes * 60 / cfg.tick))):
                    await trio.sleep(cfg.tick)
                    row = sim.tick_row(run)
                    sim.stats.timeline.append(row)
                    if emit is not None:
                        emit(row)
                final_loss = sim.mean_loss()
                nursery.cancel_scope.cancel()
            virtual = trio.current_time() - sim.t0
    s, wall, cpu = sim.stats, time.perf_counter() - w0, time.process_time() - c0
    ok = [d for d in s.downloads if d.epoch is not None]
    return {
        "run": run,
        "mode": cfg.mode,
        "target_batch_size": cfg.target_batch_size,
        "inner_steps": None if cfg.target_batch_size else cfg.inner_steps,
        "peers": cfg.peers,
        "failures": cfg.failures,
        "virtual_s": round(virtual, 1),
        "samples_per_s": round(s.samples / virtual, 2),
        "useful_samples_per_s": round((s.samples - s.wasted_samples) / virtual, 2),
        "utilisation": round(s.compute_seconds / max(s.alive_seconds, 1e-9), 4),
        "wasted_fraction": round(s.wasted_seconds / max(s.compute_seconds, 1e-9), 4),
        "discarded_fraction": round(s.discarded_seconds / max(s.compute_seconds, 1e-9), 4),
        "preemptions": s.preemptions,
        "returns": s.returns,
        "state_downloads": len(ok),
        "state_downloads_join": sum(d.reason == "join" for d in ok),
        "state_downloads_failed": len(s.downloads) - len(ok),
        "download_s_mean": round(sum(d.seconds for d in ok) / len(ok), 2) if ok else None,
        "download_s_max": round(max(d.seconds for d in ok), 2) if ok else None,
        "rounds_ok": s.rounds_ok,
        "rounds_failed": s.rounds_failed,
        "solo_steps": s.solo_steps,
        "theta_mismatches": s.theta_mismatches,
        "theta_splits": theta_splits(s),
        "round_failures": dict(sorted(s.failure_reasons.items(), key=lambda kv: -kv[1])[:4]),
        "initial_loss": round(loss0, 4),
        "final_loss": None if final_loss is None else round(final_loss, 4),
        "max_epoch": max((r["max_epoch"] for r in s.timeline), default=0),
        "setup_wall_s": round(setup_wall, 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "cpu_s_per_peer": round(cpu / cfg.peers, 3),
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
        "peak_rss_mb_per_peer": round(peak_rss_bytes() / 2**20 / cfg.peers, 2),
        "_stats": s,
    }


def theta_splits(stats: Stats) -> int:
    """Epochs whose applied rounds left more than one θ (groups that drifted apart)."""
    by_epoch: dict[int, set[bytes]] = {}
    for epoch, _, _, digest in stats.applied:
        by_epoch.setdefault(epoch, set()).add(digest)
    return sum(len(d) > 1 for d in by_epoch.values())


def run_sim(cfg: SimConfig, run: str = "run", emit: Any = None) -> dict[str, Any]:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(simulate, cfg, run, emit, clock=clock)


def plot(path: str, results: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for r in results:
        rows = r["_stats"].timeline
        minutes = [row["t"] / 60 for row in rows]
        label = "preemptions" if r["failures"] else "no failures"
        top.plot(minutes, [row["alive"] for row in rows], label=label)
        bottom.plot(minutes, [row["loss"] for row in rows], label=label)
    top.set_ylabel("live peers")
    bottom.set_ylabel("held-out loss (mean of live peers)")
    bottom.set_xlabel("virtual minutes")
    bottom.set_yscale("log")
    top.legend()
    top.set_title(f"mode={results[0]['mode']}, {results[0]['peers']} peers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--mode", choices=MODES, default="local")
    p.add_argument("--minutes", type=float, default=60.0, help="virtual minutes")
    p.add_argument("--lifetime", type=float, default=1800.0, help="mean virtual s alive")
    p.add_argument("--downtime", type=float, default=300.0, help="mean virtual s away")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-failures", action="store_true", help="only the no-failure run")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-failure run")
    p.add_argument("--step-seconds", type=float, default=30.0, help="a 1x machine's step")
    p.add_argument("--inner-steps", type=int, default=None, help="diloco: H (default 20)")
    p.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="diloco: swarm-wide epochs, an outer step per S samples of the swarm (not H)",
    )
    p.add_argument("--group-size", type=int, default=16, help="target_group_size")
    p.add_argument("--tick", type=float, default=60.0, help="virtual s between tick rows")
    p.add_argument("--plot", type=str, default=None, help="PNG of swarm size and loss")
    args = p.parse_args(argv)
    if args.target_batch_size is not None:
        if args.mode != "diloco":
            p.error("--target-batch-size is for --mode diloco")
        if args.inner_steps is not None:
            p.error("--target-batch-size (swarm-wide) or --inner-steps (lockstep), not both")
        if args.target_batch_size < 1:
            p.error("--target-batch-size must be positive")
    logging.basicConfig(level=logging.ERROR)
    base = dict(
        peers=args.peers,
        mode=args.mode,
        minutes=args.minutes,
        lifetime=args.lifetime,
        downtime=args.downtime,
        seed=args.seed,
        base_step_seconds=args.step_seconds,
        inner_steps=20 if args.inner_steps is None else args.inner_steps,
        target_batch_size=args.target_batch_size,
        target_group_size=args.group_size,
        tick=args.tick,
    )

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    results = []
    if not args.no_failures:
        results.append(run_sim(SimConfig(**base, failures=True), "preemptions", emit))
    if args.no_failures or not args.no_baseline:
        results.append(run_sim(SimConfig(**base, failures=False), "no_failures", emit))
    summary: dict[str, Any] = {"kind": "result"}
    for r in results:
        summary[r["run"]] = {k: v for k, v in r.items() if not k.startswith("_")}
    if len(results) == 2:
        a, b = results
        summary["ratios"] = {
            "samples_per_s": round(a["samples_per_s"] / b["samples_per_s"], 3),
            "useful_samples_per_s": round(a["useful_samples_per_s"] / b["samples_per_s"], 3),
            "final_loss": round(a["final_loss"] / b["final_loss"], 3)
            if a["final_loss"] and b["final_loss"]
            else None,
        }
    print(json.dumps(summary), flush=True)
    if args.plot:
        plot(args.plot, results)


if __name__ == "__main__":
    main()
