"""``ProgressTracker``: the swarm's training progress, without a coordinator.

Every peer publishes one small record under ``{prefix}.progress`` in the DHT (subkey
``[owner:<PeerID>]``, so only that peer can write it): its epoch, the samples it accumulated
toward that epoch, its throughput and when it last reported. Every reader aggregates those
records into a :class:`GlobalProgress`: the global epoch, the samples toward the target batch,
the live peers and the time to the next global step. Records are untrusted: see
:func:`aggregate` for the rule that keeps one lying peer from moving the swarm, and
docs/training-state.md ("Progress") for the rationale.

A record also carries the hash of the peer's model schema (``"s"``: the names and shapes of
its training state, see :meth:`ProgressTracker.set_schema`). A peer of another schema trains
another model under the same run name: it can neither average nor share state with us, so a
reader that knows its own schema leaves it out of everything (epoch, samples, peers) and only
lists it in :attr:`GlobalProgress.other_schemas`. Otherwise the training modes would wait for
it in every round (it never joins one) and count its samples toward our batch.

A record may also carry a display ``name`` its volunteer chose (at most
:data:`MAX_NAME_CHARS` printable characters; see :func:`check_name`) and whether the peer is a
DHT ``client`` (not reachable: behind a NAT) or a server, for dashboards (``moshpit
dashboard``). Both are cosmetic: a malformed name is dropped, never the record.

This module is the tracker: the loop that publishes our record and reads everyone's. The
record and its validation (:mod:`moshpit.training.progress_record`) and the aggregation rule
(:mod:`moshpit.training.progress_aggregate`) are modules of their own, pure logic, re-exported
here. Torch-free on purpose: ``moshpit status`` uses :func:`aggregate` on a bootstrap-sized VM.

Two ways to drive it, as with the averager:

- a ``dht.DHT`` facade: the publishing loop runs as a service on the DHT's trio thread;
  :meth:`ProgressTracker.report` only records numbers and wakes that loop;
- a ``DHTNode`` (trio code): ``async with ProgressTracker(node, prefix) as tracker:`` runs the
  loop in a nursery of its own (or ``await nursery.start(tracker.run)``); without either,
  :meth:`ProgressTracker.arefresh` publishes pending changes itself before it reads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from typing import TYPE_CHECKING, Any, cast

import trio

from dht.kademlia.clock import get_dht_time
from moshpit.critical import CriticalLock, critical_section

# the record and the rule live in their own modules (read without this loop by `moshpit
# status` and the dashboard); their names stay importable from here
from moshpit.training.progress_aggregate import aggregate, median_without
from moshpit.training.progress_record import (
    MAX_CHECKPOINT_FAILURES,
    MAX_EPOCH,
    MAX_IGNORED_REASONS,
    MAX_LOSS,
    MAX_NAME_CHARS,
    MAX_RECORDS,
    MAX_SAMPLES,
    MAX_SAMPLES_PER_SECOND,
    MAX_SCHEMA_BYTES,
    MAX_STEP_SECONDS,
    GlobalProgress,
    PeerProgress,
    check_name,
    encode_progress_record,
    is_int,
    owner_subkey,
    parse_progress_record,
    parse_progress_records,
    peer_of_subkey,
    progress_key,
    valid_name,
)

if TYPE_CHECKING:
    from dht.facade import DHT

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_CHECKPOINT_FAILURES",
    "MAX_EPOCH",
    "MAX_IGNORED_REASONS",
    "MAX_LOSS",
    "MAX_NAME_CHARS",
    "MAX_RECORDS",
    "MAX_SAMPLES",
    "MAX_SAMPLES_PER_SECOND",
    "MAX_SCHEMA_BYTES",
    "MAX_STEP_SECONDS",
    "RATE_WINDOW",
    "GlobalProgress",
    "PeerProgress",
    "ProgressTracker",
    "aggregate",
    "check_name",
    "median_without",
    "owner_subkey",
    "parse_progress_record",
    "parse_progress_records",
    "peer_of_subkey",
    "progress_key",
    "valid_name",
]

# samples/s averages the reports of about this many seconds of training (exponential weights by
# time, not by report: a peer reporting 600 steps/s would otherwise be judged on its last 16 ms,
# and a GC pause or a scheduler tick swung its published rate from 2k to 60k samples/s)
RATE_WINDOW = 5.0


class ProgressTracker:
    """Publishes this peer's progress in the DHT and aggregates everyone's (module docstring).

    :param dht: a ``dht.DHT`` facade (sync) or a ``DHTNode`` (trio: use the ``a*`` methods).
    :param prefix: the run's name; the record lives under ``{prefix}.progress``.
    :param target_batch_size: samples the swarm accumulates per global step (for ``eta``).
    :param ttl: lifetime of a published record; a peer that stops republishing (dead) drops
        out after at most this long. Records are republished every ``ttl / 3``.
    :param min_refresh_period: the fewest seconds between two publications (rate limit on
        reports) and between two reads of the DHT.
    :param max_refresh_period: the most seconds between two reads of the DHT.
    :param name: a display name for dashboards (``moshpit dashboard``), published with the
        record: 1..32 printable characters (see :func:`check_name`), or None.
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        *,
        target_batch_size: int | None = None,
        ttl: float = 30.0,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 5.0,
        start: bool = True,
        max_throughput_ratio: float = 10.0,
        throughput_tolerance: float = 1.5,
        max_clock_skew: float = 15.0,
        request_timeout: float | None = None,
        name: str | None = None,
    ):
        _check_options(
            prefix,
            target_batch_size,
            ttl,
            min_refresh_period,
            max_refresh_period,
            max_throughput_ratio,
            throughput_tolerance,
        )
        self.prefix = prefix
        self.key = progress_key(prefix)
        self.target_batch_size = target_batch_size
        self.ttl = float(ttl)
        self.min_refresh_period = float(min_refresh_period)
        self.max_refresh_period = float(max_refresh_period)
        self.max_throughput_ratio = float(max_throughput_ratio)
        self.throughput_tolerance = float(throughput_tolerance)
        self.max_clock_skew = float(max_clock_skew)
        # readers drop records that claim to live much longer than a republished one would
        self.max_lifetime = 10 * self.ttl
        # a reader notices a new epoch up to one refresh late: that much slack in the clamp
        self.clamp_slack = 2 * self.max_refresh_period
        self.request_timeout = (
            float(request_timeout) if request_timeout is not None else max(1.0, min(10.0, ttl / 3))
        )
        self._facade: Any = dht if hasattr(dht, "run_coroutine") else None
        self._node: Any = None if self._facade is not None else dht

        # local state: written by the user's thread, read by trio; a CriticalLock because leaving
        # on SIGTERM (withdraw) takes it too, maybe while the training thread holds it
        self._lock = CriticalLock()
        self._epoch: int | None = None
        self._samples = 0
        self._report_time = 0.0
        self._ewma_samples = 0.0
        self._ewma_seconds = 0.0
        self._ewma_reports = 0.0  # the reports behind those sums: seconds per step
        self._catching_up: int | None = None  # the epoch whose state we are loading
        self._epoch_since: float | None = None  # when we entered our epoch (DHT time)
        self._epoch_seconds: float | None = None  # our recent seconds per epoch
        self._reports = 0
        self._version = 0  # bumped by every report that changed what we would publish
        self._published_version = -1
        # the latest expiration any store of ours carried, acknowledged or not: a store that
        # no replica acknowledged (timed out) may still have landed, and a withdrawal must beat it
        self._last_expiration = -math.inf
        self._withdrawn = False
        self._read_soon = False
        self._discard_next = False
        self._epoch_started_at: dict[int, float] = {}
        self._global = GlobalProgress(0, 0, target_batch_size, 0, 0.0, None, [], {}, 0.0)
        # health, published with the next record (a change of it alone does not force one)
        self._loss: float | None = None
        self._finite = True
        self._checkpoint_failures = 0
        # hash of this peer's model schema (set_schema); records of other schemas are not ours
        self._schema: bytes | None = None
        self._schema_description = ""
        self._warned_schemas: set[str] = set()  # other schemas already warned about (bounded)
        self._name = check_name(name)
        self._init_loop()
        if start and self._facade is not None:
            self.start()

    def _init_loop(self) -> None:
        """The background loop's handles: set by :meth:`run` (trio) or :meth:`start` (facade)."""
        self._token: trio.lowlevel.TrioToken | None = None
        self._wakeup: trio.Event | None = None
        self._wake_pending = False
        self._publish_lock: trio.Lock | None = None
        self._scope: trio.CancelScope | None = None
        self._service: concurrent.futures.Future[None] | None = None
        self._running = False
        self._closed = False

    # ------------------------------------------------------------------ local state

    @property
    def peer_id(self) -> Any:
        return self._facade.peer_id if self._facade is not None else self._node.peer_id

    def report(self, epoch: int, samples: int) -> None:
        """Record this peer's epoch and the samples accumulated toward it (non-blocking).

        The background loop publishes the change soon (at most once per
        ``min_refresh_period``). samples/s is an average over recent reports.
        """
        if not is_int(epoch, 0, MAX_EPOCH):
            raise ValueError(f"epoch must be an int in [0, 2**53), got {epoch!r}")
        if not is_int(samples, 0, MAX_SAMPLES):
            raise ValueError(f"samples must be an int in [0, 2**53), got {samples!r}")
        if self._closed:
            raise RuntimeError("the progress tracker was shut down")
        now = get_dht_time()
        with self._lock:
            # the first report: read the swarm at once, so that the view holds this peer
            # from its first steps (a lone peer saw "0 peers" until the next periodic read)
            self._read_soon = self._read_soon or self._epoch is None
            if self._epoch is None or epoch != self._epoch:
                # a new epoch: the time since the last report went to averaging/loading,
                # not to producing these samples, so it does not enter samples/s
                if self._epoch is not None and epoch > self._epoch:
                    self._epoch_started_at.setdefault(epoch, now)  # we saw it begin
                    self._note_epoch_change(epoch - self._epoch, now)
                else:
                    self._epoch_since = now
            elif (self._samples == 0 and self._reports == 1) or self._discard_next:
                # the first interval ever: a trainer reports 0 when it starts, right after
                # computing its first batch, so this interval holds no compute time (it made
                # the first estimate thousands of samples/s); or the caller said so
                pass
            elif samples >= self._samples and now > self._report_time:
                elapsed = now - self._report_time
                kept = math.exp(-elapsed / RATE_WINDOW)
                self._ewma_samples = kept * self._ewma_samples + (samples - self._samples)
                self._ewma_seconds = kept * self._ewma_seconds + elapsed
                self._ewma_reports = kept * self._ewma_reports + 1.0
            changed = self._withdrawn or epoch != self._epoch or samples != self._samples
            self._discard_next = False
            self._epoch, self._samples, self._report_time = epoch, samples, now
            self._reports += 1
            self._withdrawn = False
            if changed:
                self._version += 1
        if changed:
            self._wake()

    def _note_epoch_change(self, epochs: int, now: float) -> None:
        """Seconds per epoch, averaged over the last few epochs (the caller holds the lock)."""
        if self._epoch_since is not None:
            took = (now - self._epoch_since) / epochs
            previous = self._epoch_seconds
            self._epoch_seconds = took if previous is None else 0.7 * previous + 0.3 * took
        self._epoch_since = now

    def discard_next_interval(self) -> None:
        """The samples of the next report were made before now (the batch a training loop
        computed before its first ``step()``, which reports 0 first): count them toward the
        epoch, not toward samples/s. Otherwise that interval holds no compute time, and 8
        samples in a millisecond read as 10,000 samples/s for the next seconds."""
        with self._lock:
            self._discard_next = True

    def mark_idle(self) -> None:
        """The time since the last report was not spent producing samples (waiting for a
        round, loading state): leave it out of samples/s."""
        with self._lock:
            self._report_time = get_dht_time()

    def report_health(
        self,
        *,
        loss: float | None = None,
        finite: bool | None = None,
        checkpoint_failures: int | None = None,
    ) -> None:
        """Record this peer's recent loss, whether its state is finite, and how many of its
        checkpoints failed in a row; they travel with the next published record. A change of
        ``finite`` or of the failure count publishes soon, a new loss only with the next
        record (every ``min_refresh_period`` while training)."""
        with self._lock:
            urgent = False
            if loss is not None:
                self._loss = float(loss)
            if finite is not None and finite != self._finite:
                self._finite, urgent = bool(finite), True
            if checkpoint_failures is not None and checkpoint_failures != self._checkpoint_failures:
                self._checkpoint_failures, urgent = int(checkpoint_failures), True
            if urgent:
                self._version += 1
        if urgent:
            self._wake()

    @property
    def schema(self) -> bytes | None:
        return self._schema

    def set_schema(self, schema: bytes | None, description: str = "") -> None:
        """Publish ``schema`` (a hash of this peer's model: its state's tensor names and
        shapes) with our record, and leave peers of another schema out of the view: they
        train another model under the same run name (``moshpit.Optimizer`` sets it)."""
        if schema is not None and not (
            isinstance(schema, bytes) and 0 < len(schema) <= MAX_SCHEMA_BYTES
        ):
            raise ValueError(f"schema must be 1..{MAX_SCHEMA_BYTES} bytes, got {schema!r}")
        with self._lock:
            if schema != self._schema:
                self._schema = schema
                self._schema_description = str(description)
                self._version += 1

    @property
    def name(self) -> str | None:
        return self._name

    def set_catching_up(self, epoch: int | None) -> None:
        """Publish (at once) that this peer is loading the state of ``epoch`` (None: it is
        not): the peers at that epoch then wait for it for a while, instead of moving on
        while it downloads and leaving it behind again (see ``epoch_rounds``)."""
        if epoch is not None and not is_int(epoch, 0, MAX_EPOCH):
            raise ValueError(f"epoch must be an int in [0, 2**53), got {epoch!r}")
        with self._lock:
            changed = epoch != self._catching_up
            if changed:
                self._catching_up = epoch
                self._version += 1
        if changed:
            self._wake()

    def set_name(self, name: str | None) -> None:
        """Publish ``name`` (or none) as this peer's display name with the next record."""
        name = check_name(name)
        with self._lock:
            changed = name != self._name
            if changed:
                self._name = name
                self._version += 1
        if changed:
            self._wake()

    @property
    def samples_per_second(self) -> float:
        with self._lock:
            return self._ewma_samples / self._ewma_seconds if self._ewma_seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float | None:
        """Seconds between this peer's reports while training (one per step); None before
        two reports."""
        with self._lock:
            return self._ewma_seconds / self._ewma_reports if self._ewma_reports > 0 else None

    def local_progress(self) -> PeerProgress | None:
        """What this peer publishes (None before the first report)."""
        sps = self.samples_per_second
        step = self.step_seconds
        with self._lock:
            if self._epoch is None or self._withdrawn:
                return None
            loss = self._loss
            finite = self._finite and (loss is None or math.isfinite(loss))
            return PeerProgress(
                str(self.peer_id),
                self._epoch,
                self._samples,
                sps,
                self._report_time,
                loss if loss is not None and math.isfinite(loss) else None,
                finite,
                self._checkpoint_failures,
                self._schema,
                self._name,
                step_seconds=step,
                epoch_since=self._epoch_since,
                epoch_seconds=self._epoch_seconds,
                catching_up=self._catching_up,
            )

    @property
    def global_progress(self) -> GlobalProgress:
        """The last aggregated view (no network access)."""
        with self._lock:
            return self._global

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background loop on the DHT facade's thread (trio code: ``async with``)."""
        if self._running or self._closed:
            return
        if self._facade is None:
            raise RuntimeError(
                "a tracker on a DHTNode runs its loop in a nursery: use `async with tracker:` "
                "or `await nursery.start(tracker.run)`"
            )
        self._running = True
        self._service = self._facade.start_service(self._service_main)

    async def _service_main(self) -> None:
        await self.run()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The background loop: publish on change and every ttl/3, read every refresh period.

        Runs until cancelled (``shutdown``/leaving ``async with``); network errors are logged
        and retried on the next period, never raised.
        """
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._running = True
        next_read = trio.current_time()
        last_publish = -math.inf
        with trio.CancelScope() as scope:
            self._scope = scope
            task_status.started()
            while not self._closed:
                now = trio.current_time()
                with self._lock:
                    pending = self._epoch is not None and not self._withdrawn
                    dirty = pending and self._version != self._published_version
                if pending and (
                    (dirty and now >= last_publish + self.min_refresh_period)
                    or now >= last_publish + self.ttl / 3
                ):
                    last_publish = now
                    await self._guarded(self._apublish)
                with self._lock:
                    read_soon, self._read_soon = self._read_soon, False
                if now >= next_read or read_soon:
                    await self._guarded(self._aread)
                    next_read = trio.current_time() + self._read_period()
                deadline = next_read
                if pending:
                    deadline = min(deadline, last_publish + self.ttl / 3)
                    with self._lock:
                        if self._version != self._published_version:
                            deadline = min(deadline, last_publish + self.min_refresh_period)
                with trio.move_on_at(deadline):
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                self._wake_pending = False
        self._scope = None

    def _read_period(self) -> float:
        eta = self._global.eta_seconds
        period = self.max_refresh_period if eta is None else min(self.max_refresh_period, eta / 2)
        return max(self.min_refresh_period, period)

    async def _guarded(self, fn: Any) -> None:
        with trio.move_on_after(self.request_timeout) as scope:
            try:
                await fn()
            except Exception as e:  # noqa: BLE001 - the loop must survive network trouble
                logger.warning("progress tracker (%s): %s failed: %r", self.prefix, fn.__name__, e)
        if scope.cancelled_caught:
            logger.info("progress tracker (%s): %s timed out", self.prefix, fn.__name__)

    def _wake(self) -> None:
        """Wake the background loop from any thread (cheap; coalesced)."""
        token, event = self._token, self._wakeup
        if token is None or event is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            with critical_section():  # trio's entry lock is held in there (moshpit.critical)
                token.run_sync_soon(
                    lambda: self._wakeup.set() if self._wakeup is not None else None
                )
        except trio.RunFinishedError:
            pass

    async def __aenter__(self) -> ProgressTracker:
        if self._facade is not None:
            self.start()
            return self
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        await nursery.start(self.run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        if self._facade is not None:
            self.shutdown()
            return None
        try:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.request_timeout):
                    await self.awithdraw()
        finally:
            self._closed = True
            if self._scope is not None:
                self._scope.cancel()
            result = await self._nursery_cm.__aexit__(*exc_info)
        return result

    def __enter__(self) -> ProgressTracker:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the background loop and withdraw our record (sync facade). Idempotent."""
        if self._closed:
            return
        if self._facade is None:
            self._closed = True
            if self._scope is not None:
                self._scope.cancel()
            return
        if _in_trio():  # on the DHT's own thread: waiting for the loop would deadlock
            logger.info("progress tracker (%s): shut down from trio, not withdrawn", self.prefix)
        else:
            try:
                self.withdraw()
            except (RuntimeError, concurrent.futures.CancelledError, TimeoutError) as e:
                logger.info("progress tracker (%s): could not withdraw: %r", self.prefix, e)
        self._closed = True
        if self._service is not None:
            self._service.cancel()

    # ------------------------------------------------------------------ DHT I/O

    def _call(self, async_fn: Any, timeout: float | None) -> Any:
        if self._facade is None:
            raise RuntimeError("this tracker runs on a DHTNode: await the a* methods")
        if _in_trio():
            raise RuntimeError("this blocks on the DHT's loop: from trio code await the a* methods")

        async def run(_dht: Any, _node: Any) -> Any:
            return await async_fn()

        future = self._facade.run_coroutine(run, return_future=True)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the DHT did not answer within {timeout}s") from None

    def _get_node(self) -> Any:
        if self._facade is not None:
            return self._facade.node
        return self._node

    async def _apublish(self) -> None:
        """Store our record now (signed by the DHT because of the owner subkey)."""
        if self._publish_lock is None:
            self._publish_lock = trio.Lock()
        async with self._publish_lock:
            with self._lock:
                version = self._version
            mine = self.local_progress()
            if mine is None:
                return
            now = get_dht_time()
            node = self._get_node()
            value = encode_progress_record(mine, getattr(node, "client_mode", None))
            expiration = max(now + self.ttl, self._last_expiration + 1e-3)
            self._last_expiration = expiration
            stored = await node.store(
                self.key, value, expiration, subkey=owner_subkey(node.peer_id)
            )
            if stored:
                with self._lock:
                    if not self._withdrawn:
                        self._published_version = version
            else:
                logger.info("progress tracker (%s): no replica accepted our record", self.prefix)

    async def _aread(self) -> GlobalProgress:
        node = self._get_node()
        found = await node.get(self.key, latest=True)
        now = get_dht_time()
        records, ignored = parse_progress_records(
            found, now=now, max_clock_skew=self.max_clock_skew, max_lifetime=self.max_lifetime
        )
        own = self.local_progress()
        with self._lock:
            started = dict(self._epoch_started_at)
        view = aggregate(
            records,
            now=now,
            own=own,
            target_batch_size=self.target_batch_size,
            epoch_started_at=started,
            max_throughput_ratio=self.max_throughput_ratio,
            throughput_tolerance=self.throughput_tolerance,
            clamp_slack=self.clamp_slack,
            ignored=ignored,
            schema=self._schema,
        )
        self._warn_other_schemas(view)
        with self._lock:
            previous = self._global
            # we saw the swarm enter this epoch only if we already knew an earlier one
            if view.epoch > previous.epoch and previous.num_peers > 0:
                self._epoch_started_at.setdefault(view.epoch, now)
            for old in [e for e in self._epoch_started_at if e < view.epoch - 1]:
                del self._epoch_started_at[old]
            self._global = view
        return view

    def _warn_other_schemas(self, view: GlobalProgress) -> None:
        """One WARNING per other schema seen (not per read: the peer stays for hours)."""
        new = {s for s in view.other_schemas.values() if s not in self._warned_schemas}
        if not new or self._schema is None or len(self._warned_schemas) >= MAX_IGNORED_REASONS:
            return
        self._warned_schemas |= new
        peers = [p for p, s in view.other_schemas.items() if s in new]
        logger.warning(
            "%d peer(s) of run %r train a model of another shape (schema %s; ours is %s%s): "
            "they are left out of this peer's progress and rounds, and cannot average or "
            "share state with it. Check that every peer of the run trains the same model "
            "(e.g. %s)",
            len(peers),
            self.prefix,
            ", ".join(sorted(new)),
            self._schema.hex()[:12],
            f", {self._schema_description}" if self._schema_description else "",
            peers[0][-6:],
        )

    async def arefresh(self) -> GlobalProgress:
        """Publish a pending change, then read and aggregate the swarm's records now."""
        with self._lock:
            dirty = (
                self._epoch is not None
                and not self._withdrawn
                and self._version != self._published_version
            )
        if dirty and not self._running:
            await self._apublish()
        return await self._aread()

    def refresh(self, timeout: float | None = None) -> GlobalProgress:
        """Read the swarm's progress now (sync facade); TimeoutError after ``timeout``."""
        return cast(GlobalProgress, self._call(self.arefresh, timeout))

    async def awithdraw(self) -> None:
        """Replace our record with a tombstone now: readers drop us at once."""
        with self._lock:
            self._withdrawn = True  # no publish starts after this
        if self._publish_lock is None:
            self._publish_lock = trio.Lock()
        # under the publish lock: a publish in flight when we were called has finished, so
        # its record (even one stored without an acknowledgement) is known and overwritten
        async with self._publish_lock:
            if self._last_expiration == -math.inf:
                return  # nothing of ours was ever sent
            node = self._get_node()
            expiration = max(self._last_expiration, get_dht_time()) + 1.0
            await node.store(self.key, None, expiration, subkey=owner_subkey(node.peer_id))
            self._last_expiration = expiration

    def withdraw(self, timeout: float | None = None) -> None:
        """Sync :meth:`awithdraw`. A later :meth:`report` publishes again."""
        self._call(self.awithdraw, timeout if timeout is not None else self.request_timeout)


def _in_trio() -> bool:
    """True on a thread that runs a trio loop (where blocking on the DHT would deadlock)."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _check_options(
    prefix: str,
    target_batch_size: int | None,
    ttl: float,
    min_refresh_period: float,
    max_refresh_period: float,
    max_throughput_ratio: float,
    throughput_tolerance: float,
) -> None:
    """``ValueError`` for options no tracker can run with (before it touches the DHT)."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    if target_batch_size is not None and not is_int(target_batch_size, 1, MAX_SAMPLES):
        raise ValueError(f"target_batch_size must be a positive int, got {target_batch_size!r}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    if not (0 < min_refresh_period <= max_refresh_period and math.isfinite(max_refresh_period)):
        raise ValueError(
            "need 0 < min_refresh_period <= max_refresh_period (finite), got "
            f"{min_refresh_period!r}, {max_refresh_period!r}"
        )
    if not (max_throughput_ratio >= 1 and throughput_tolerance >= 1):
        raise ValueError("max_throughput_ratio and throughput_tolerance must be >= 1")
