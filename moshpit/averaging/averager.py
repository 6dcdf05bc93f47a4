"""``moshpit.Averager``: average a list of tensors with whoever averages under the same prefix.

One :meth:`Averager.step` = matchmaking through the DHT (``matchmaking.py``) under this peer's
Moshpit group key (``group_keys.py``), then a butterfly all-reduce inside the group
(``allreduce.py``), then the averaged values are written into the caller's tensors and the
group key moves on. Every phase has a finite timeout; failures are reported in the
:class:`StepResult`, and peers that fail repeatedly are avoided for a while.

Two ways to drive it:

- synchronous code passes a ``dht.DHT`` facade; the averager then lives on the DHT's trio
  thread and shares its Host (``step()`` submits work there through ``dht.run_coroutine``);
- trio code passes a ``DHTNode`` and awaits :meth:`Averager.astep` on the node's loop.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, overload

import msgpack
import torch
import trio

from dht.kademlia.node import DHTNode
from moshpit.averaging.aggregation import make_aggregator
from moshpit.averaging.allreduce import AllReduceResult, AllReduceService
from moshpit.averaging.allreduce_protocol import MAX_WEIGHT
from moshpit.averaging.averager_services import AllReduceServices
from moshpit.averaging.averager_services import CountingBackend as _CountingBackend
from moshpit.averaging.config import AveragerConfig
from moshpit.averaging.errors import AveragingError
from moshpit.averaging.grid_reads import KeyReads, find_group_on_grid
from moshpit.averaging.group_info import MODE_AUX, MODE_CLIENT, MODE_NODE, GroupInfo
from moshpit.averaging.group_keys import GroupKeyManager
from moshpit.averaging.matchmaking import MAX_GATHER_BYTES, Matchmaker, SchemaMemory
from moshpit.averaging.partition import CHUNKS_PER_PEER, empty_like_all, round_link_seconds
from moshpit.averaging.step_result import StepResult
from moshpit.averaging.uplink_meter import UplinkMeter
from moshpit.critical import critical_section

if TYPE_CHECKING:
    from dht.facade import DHT
    from dht.p2p.host import Host
    from dht.p2p.identity import PeerID

logger = logging.getLogger(__name__)
HARD_STEP_SLACK = 30.0  # s past a step's bound before it is abandoned (a safety net)
# The all-reduce gets allreduce_timeout plus this many times what the group's slowest stated
# link needs to carry the round: a fixed timeout failed every round of a model whose bytes
# take longer than it on a home uplink (100M values at 4 bits in a group of 4 on 10 Mbit/s:
# ~67 s against the 60-s default), however well the links were stated.
LINK_TIME_FACTOR = 2.0
# ... but the link time counts for at most this many allreduce_timeouts: the rates come from
# the members (stated or measured), and one that claims a few bytes/s must not hold every
# round it joins for hours (a round that needs more: raise allreduce_timeout)
MAX_LINK_TIMEOUTS = 16.0

__all__ = ["Averager", "AveragerLockError", "StepResult", "tensor_schema"]

LOCK_POLL_SECONDS = (
    0.05  # how often a waiting step re-checks cancellation while the user holds the lock
)
WRITE_INLINE_NUMEL = 1 << 15  # smaller results are copied on the loop, larger ones in a thread
SCHEMA_VERSION = b"moshpit.tensor-schema.v1"
# A peer reachable only through a relay reduces only if a whole round fits one relayed
# connection: its tensors as uncompressed float32 (no part is larger) plus this much for the
# connection's handshake, matchmaking and DHT messages.
RELAY_CONTROL_HEADROOM = 32 * 1024
# Monitoring hooks (moshpit.metrics adds one): called as ``observer(event, averager, detail)``
# on the DHT's thread, with event "step" (detail: the StepResult of a finished step) or "ban"
# (detail: the peer now avoided). Empty unless metrics are on; an observer must be quick.
observers: list[Callable[[str, Any, Any], None]] = []


def _notify(event: str, averager: Any, detail: Any) -> None:
    for observer in list(observers):
        try:
            observer(event, averager, detail)
        except Exception:  # monitoring must never break a round
            logger.exception("averaging observer failed")


class AveragerLockError(AveragingError, RuntimeError):
    """A call would wait for the tensor lock that this same thread holds (a certain deadlock),
    or would block the DHT's event loop, which the running step needs to finish."""


def tensor_schema(tensors: Iterable[torch.Tensor]) -> tuple[bytes, str]:
    """(16-byte hash, short description) of the tensors' count and shapes, in order.

    Peers average only with peers of the same schema: the all-reduce lines up the flattened
    tensors position by position, so other shapes would mix unrelated values (or fail on a
    different total size). Dtypes and devices are left out on purpose: every peer averages
    in float32, so a bfloat16 GPU peer and a float32 CPU peer of the same model can average.
    """
    shapes = [list(t.shape) for t in tensors]
    digest = hashlib.sha256(SCHEMA_VERSION + msgpack.packb(shapes)).digest()[:16]
    numel = sum(math.prod(s) for s in shapes)
    return digest, f"{len(shapes)} tensors, {numel} values"


_allreduce_services = AllReduceServices()


class Averager:
    """Averages ``tensors`` in place with peers that use the same ``prefix`` (Moshpit All-Reduce).

    :param tensors: the tensors to average (e.g. ``model.parameters()``); they are updated in
      place after every successful round, under the lock that :meth:`get_tensors` holds.
    :param dht: a ``dht.DHT`` (sync facade) or a ``DHTNode`` (trio code; use :meth:`astep`).
    :param prefix: peers with the same prefix average together; several averagers with
      different prefixes may share one DHT/Host.
    :param target_group_size: the group size matchmaking aims for (the grid side ``M``).
    :param config: an :class:`~moshpit.AveragerConfig` holding the options below; options
      given as keyword arguments go on top of it. Either way they are checked at once.
    :param schema_memory: where this averager remembers the peers of another tensor schema
      (a ``moshpit.averaging.matchmaking.SchemaMemory``): they are never asked to
      group with us again while they declare the same schema, and their conflict is logged
      once. Averagers that take turns under one run (the training modes' per-epoch rounds)
      share one; default: a fresh one.
    :param uplink_meter: the send rates of this peer's recent rounds (an
      ``moshpit.averaging.uplink_meter.UplinkMeter``), shared with its groups while no
      ``bandwidth`` is stated; share one between averagers that take turns, as above.

    Options (fields of ``config``, or keyword arguments):

    - ``min_group_size``: a group smaller than this never runs (default 2).
    - ``min_matchmaking_time``: after this long a leader proceeds with the members it has
      (>= ``min_group_size``); a full group proceeds at once.
    - ``request_timeout``: limit for each matchmaking request/DHT operation.
    - ``allreduce_timeout``: limit for the all-reduce phase.
    - ``compression``: a ``compression`` codec or ``TwoWayCompression`` (default: none).
    - ``bandwidth``: this peer's uplink in bytes/s (e.g. ``100e6 / 8`` for 100 Mbit/s). It
      sizes this peer's part of each all-reduce, and, unless ``pace_uplink=False``, caps the
      round's connections so that together they send at most this fast, each at a share that
      lets them finish together (see ``pacing.py``; over shaped 100 Mbit/s links it raised
      link use from 71-82% to 88-92%). An overestimate leaves the sharing to TCP; an
      underestimate slows every round to the stated rate.
    - ``pace_uplink``: set False to use ``bandwidth`` only for part sizes (and chunk sizes:
      with the members' codec densities it tells how long a round keeps the links busy).
    - ``client_mode``: this peer cannot accept connections: it never leads or reduces.
      Also chosen per round when the DHT node acts as a client (its role follows AutoNAT),
      and when peers reach this one only through a relay whose per-connection byte limit
      (``node.relay_limit``) is below twice (some relays spend one budget on both
      directions) the whole tensors' float32 size plus ``RELAY_CONTROL_HEADROOM``: no
      reducer's part is larger than the whole tensors, so such a peer is never picked to
      reduce more than its relay carries (an auxiliary peer then sits the round out).
      Leading only takes small matchmaking messages, so a relayed peer whose tensors fit
      still leads and reduces.
    - ``auxiliary``: this peer helps reduce but contributes nothing (weight 0).
    - ``initial_group_bits``: the starting key bits (a string of 0/1; its length is the number
      of bits kept forever). Default: random bits, ``(d-1)*ceil(log2 M)`` of them for a
      ``d``-dimensional grid sized from ``expected_num_peers``. Without either, the grid
      adapts: it starts with one shared key (random groups) and gains or loses dimensions
      as the number of peers seen under the key shows the swarm's size (``group_keys.py``).
    - ``matchmaking_timeout``: how long a step looks for a group before giving up (default
      ``max(2 * min_matchmaking_time, min_matchmaking_time + request_timeout)``).
    - ``aggregation``: how the reducer of a part combines the members' contributions:
      ``"mean"`` (default: the weighted mean; exact, but one member can move it arbitrarily),
      ``"trimmed_mean"`` (drops the top and bottom 20% per coordinate), ``"median"``, or an
      ``Aggregator`` from ``moshpit.averaging.aggregation`` (``TrimmedMean(trim)``,
      ``Median()``, ``ClippedMean(tau)``, ``CenteredClip(tau)``). The robust ones ignore the
      members' weights and keep every contribution of a chunk in memory until it is complete
      (docs/averaging.md, "Robust aggregation", says what they guarantee and what not).
    - ``ban_after_failures``: a peer that failed this many consecutive rounds with us is
      not grouped with for ``ban_seconds``.
    - ``ban_seconds``: how long such a peer stays out of our groups.
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        dht: DHT | DHTNode,
        prefix: str,
        target_group_size: int,
        *,
        config: AveragerConfig | None = None,
        start: bool = True,
        schema_memory: SchemaMemory | None = None,
        uplink_meter: UplinkMeter | None = None,
        **options: Any,
    ):
        self._tensors = _checked_tensors(tensors)
        # the knobs (the keyword arguments above), checked in one place
        self.config = config = AveragerConfig.build(config, **options)
        self.prefix = prefix
        self.target_group_size = target_group_size
        self.min_group_size = config.min_group_size
        self.min_matchmaking_time = float(config.min_matchmaking_time)
        self.request_timeout = float(config.request_timeout)
        self.allreduce_timeout = float(config.allreduce_timeout)
        self.matchmaking_timeout = config.effective_matchmaking_timeout
        self.compression = config.compression
        self.bandwidth = config.bandwidth
        self.pace_uplink = bool(config.pace_uplink)
        self.uplink_meter = uplink_meter or UplinkMeter()  # read while no bandwidth is stated
        self.aggregation = make_aggregator(config.aggregation)
        self.mode = (
            MODE_CLIENT if config.client_mode else MODE_AUX if config.auxiliary else MODE_NODE
        )
        self.sender_timeout = config.sender_timeout
        self.reducer_timeout = config.reducer_timeout
        # True while a step's group has formed (its all-reduce is on): read from other threads
        # by a peer that leaves, which waits for such a round but not for one still matchmaking
        self.in_group = False
        self.ban_after_failures = config.ban_after_failures
        self.ban_seconds = config.ban_seconds
        self.keys = GroupKeyManager(
            prefix,
            target_group_size,
            config.initial_group_bits,
            expected_num_peers=config.expected_num_peers,
        )
        self._numel = sum(t.numel() for t in self._tensors)
        # hash of the tensors' shapes: matchmaking never groups peers whose schemas differ
        self.schema, self.schema_description = tensor_schema(self._tensors)
        self._out: list[torch.Tensor] | None = None  # all-reduce output, reused across rounds
        self._lock = threading.Lock()  # guards the tensors (user threads and the trio thread)
        self._lock_owner: int | None = None  # thread id inside get_tensors() (re-entry check)
        self._loop_thread: int | None = None  # the thread running the DHT's trio loop
        self._failures: dict[PeerID, int] = {}
        self._banned_until: dict[PeerID, float] = {}
        # peers of another tensor schema, across rounds (and averagers sharing the memory)
        self._schema_memory = schema_memory if schema_memory is not None else SchemaMemory()
        self._step_scopes: set[trio.CancelScope] = set()
        self._step_lock: trio.Lock | None = None
        self._mm_backend: _CountingBackend | None = None
        self._facade: DHT | None = None
        self._node: DHTNode | None = None
        self._host: Host | None = None
        self.matchmaker: Matchmaker | None = None
        self._allreduce: AllReduceService | None = None
        self._started = False
        self._closed = False
        # called with the GroupInfo between matchmaking and all-reduce (tests, demo --kill)
        self._before_allreduce: Callable[[GroupInfo], Awaitable[None]] | None = None
        if isinstance(dht, DHTNode):
            self._node = dht
        else:  # the sync facade
            self._facade = dht
        # validate matchmaking parameters now, with a clear error, before any I/O
        Matchmaker._check_config(target_group_size, self.min_group_size, self.mode)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Attach to the DHT's Host (register the matchmaking and all-reduce handlers)."""
        if self._started:
            return
        if self._facade is not None:

            async def attach(_dht: DHT, node: DHTNode) -> None:
                self._attach(node)

            self._facade.run_coroutine(attach)
        else:
            assert self._node is not None  # the constructor holds a node or a facade
            self._attach(self._node)

    def _attach(self, node: DHTNode) -> None:
        """Runs on the DHT's trio thread."""
        self._node = node
        self._host = node.host
        self._loop_thread = threading.get_ident()
        if self._host is None:
            raise ValueError("the DHT node has no Host (a loopback-fabric node cannot average)")
        explicit = getattr(node, "client_mode_setting", True) is not None
        if getattr(node, "client_mode", False) and explicit and self.mode == MODE_NODE:
            # a client-mode DHT peer cannot accept connections, so it cannot lead or reduce
            # (a role chosen from reachability may change: _round_mode follows it per round)
            logger.info("the DHT runs in client mode: averaging in client mode too")
            self.mode = MODE_CLIENT
        self._step_lock = trio.Lock()
        self._mm_backend = _CountingBackend(node, self.schema)
        self.matchmaker = Matchmaker(
            self._mm_backend,
            self.prefix,
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            mode=self.mode,
            bandwidth=self.bandwidth,
            is_banned=self._is_banned,
            schema=self.schema,
            schema_description=self.schema_description,
            # one shared key (no grid bits): lead as soon as everyone declared has joined
            start_when_all_joined=self.keys.num_bits == 0,
            schema_memory=self._schema_memory,
        )
        if self.bandwidth is None:  # what the rounds before this averager measured
            self.matchmaker.measured_uplink = self.uplink_meter.rate
        self._allreduce = _allreduce_services.acquire(self._host)
        self._started = True

    def shutdown(self) -> None:
        """Cancel the running step (others finish via their timeouts) and detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        if self._facade is not None and not _in_trio():

            async def detach(_dht: DHT, _node: DHTNode) -> None:
                self._detach()

            try:
                self._facade.run_coroutine(detach)
            except (RuntimeError, concurrent.futures.CancelledError):
                pass  # the DHT is already shut down: its loop (and our tasks) are gone
        else:
            self._detach()

    def _detach(self) -> None:
        for scope in list(self._step_scopes):
            scope.cancel()
        if self.matchmaker is not None:
            self.matchmaker.close()
        if self._host is not None and self._allreduce is not None:
            _allreduce_services.release(self._host)
            self._allreduce = None
        self._out = None  # free the output buffer (a cancelled round keeps its own reference)

    async def aclose(self) -> None:
        """Async :meth:`shutdown` for trio code (same effect)."""
        self.shutdown()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> Averager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ tensors

    @contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """Lock the averaged tensors and yield them (read or modify in place inside the block).

        A running step holds this lock while it averages, so this waits for the round. Do not
        call ``step()`` inside the block: the step needs this lock (it raises
        :class:`AveragerLockError` at once instead of deadlocking). Not re-entrant. The block
        is a critical section (``moshpit.critical``): a SIGTERM arriving inside is handled
        after it, since leaving (a last checkpoint) takes this lock too.
        """
        with critical_section(), self._locked_tensors() as tensors:
            yield tensors

    @contextmanager
    def _locked_tensors(self) -> Iterator[list[torch.Tensor]]:
        me = threading.get_ident()
        if self._lock_owner == me:
            raise AveragerLockError(
                "get_tensors() is already held by this thread (the lock is not re-entrant)"
            )
        if me == self._loop_thread:
            # on the DHT's event loop: waiting would stop the very step that holds the lock
            if not self._lock.acquire(blocking=False):
                raise AveragerLockError(
                    "get_tensors() on the DHT's event loop while a step averages the tensors "
                    "would block the loop that step runs on; await the step first"
                )
        else:
            self._lock.acquire()
        self._lock_owner = me
        try:
            yield self._tensors
        finally:
            self._lock_owner = None
            self._lock.release()

    def _check_not_holding_lock(self) -> None:
        if self._lock_owner == threading.get_ident():
            raise AveragerLockError(
                "step() called inside `with averager.get_tensors():` on the same thread: the "
                "step needs that lock to write the averaged values and would wait forever. "
                "Call step() after the `with` block."
            )

    async def _acquire_lock(self, deadline: float) -> bool:
        """Take the tensor lock by ``deadline`` (trio time) without blocking the event loop.

        Returns False at the deadline. Never raises between taking the lock and returning,
        so a caller that gets True always releases it.
        """
        while not self._lock.acquire(blocking=False):
            left = deadline - trio.current_time()
            if left <= 0:
                return False
            wait = min(LOCK_POLL_SECONDS, left)
            if await trio.to_thread.run_sync(self._lock.acquire, True, wait):
                return True
        return True

    # ------------------------------------------------------------------ failures

    def _is_banned(self, peer: PeerID) -> bool:
        until = self._banned_until.get(peer)
        if until is None:
            return False
        if trio.current_time() >= until:
            del self._banned_until[peer]
            return False
        return True

    def _record_round(self, members: Iterable[PeerID], failed: set[PeerID], me: PeerID) -> None:
        for peer in members:
            if peer == me:
                continue
            if peer in failed:
                count = self._failures.get(peer, 0) + 1
                self._failures[peer] = count
                if count >= self.ban_after_failures:
                    logger.info(
                        "avoiding %s for %.0fs after %d failed rounds",
                        peer,
                        self.ban_seconds,
                        count,
                    )
                    self._banned_until[peer] = trio.current_time() + self.ban_seconds
                    self._failures.pop(peer, None)
                    if observers:
                        _notify("ban", self, peer)
            else:
                self._failures.pop(peer, None)
        if len(self._failures) > 4096:  # bounded: forget the oldest entries
            for peer in list(self._failures)[:1024]:
                del self._failures[peer]

    # ------------------------------------------------------------------ stepping

    @overload
    def step(
        self,
        weight: float = ...,
        gather: Any = ...,
        timeout: float | None = ...,
        wait: Literal[True] = ...,
    ) -> StepResult: ...

    @overload
    def step(
        self,
        weight: float = ...,
        gather: Any = ...,
        timeout: float | None = ...,
        *,
        wait: Literal[False],
    ) -> concurrent.futures.Future[StepResult]: ...

    def step(
        self,
        weight: float = 1.0,
        gather: Any = None,
        timeout: float | None = None,
        wait: bool = True,
    ) -> StepResult | concurrent.futures.Future[StepResult]:
        """Average once (sync API). With ``wait=False`` returns a ``concurrent.futures.Future``.

        Only for averagers built on a ``DHT`` facade; trio code awaits :meth:`astep`.
        ``timeout`` bounds the whole step, including waiting for the tensor lock; when it
        runs out the result has ``succeeded=False, timed_out=True`` and a ``reason`` (no
        exception). Raises :class:`AveragerLockError` at once when called with ``wait=True``
        inside ``with averager.get_tensors():`` on the same thread, or on the DHT's own thread.
        """
        if self._facade is None:
            raise RuntimeError("this averager runs on a DHTNode: use `await averager.astep(...)`")
        if not self._started:
            raise RuntimeError("the averager is not started (start=False): call .start() first")
        if wait:
            self._check_not_holding_lock()
            if threading.get_ident() == self._loop_thread:
                raise AveragerLockError(
                    "step() on the DHT's own thread would block the loop the step runs on; "
                    "use `await averager.astep(...)` there"
                )

        async def run(_dht: DHT, _node: DHTNode) -> StepResult:
            return await self.astep(weight=weight, gather=gather, timeout=timeout)

        future: concurrent.futures.Future[StepResult]
        future = self._facade.run_coroutine(run, return_future=True)
        return future.result() if wait else future

    async def astep(
        self,
        weight: float = 1.0,
        gather: Any = None,
        timeout: float | None = None,  # noqa: ASYNC109 - same API as step(); enforced inside
    ) -> StepResult:
        """Average once (async API, on the DHT node's trio loop); see :meth:`step`."""
        result = await self._astep(weight, gather, timeout)
        if observers:
            _notify("step", self, result)
        return result

    async def _astep(self, weight: float, gather: Any, timeout: float | None) -> StepResult:  # noqa: ASYNC109
        self._check_not_holding_lock()  # `with get_tensors(): await astep()` on the loop
        if self._closed:
            raise RuntimeError("the averager was shut down")
        if not self._started:
            raise RuntimeError("the averager is not started (start=False): call .start() first")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT)
        ):
            raise ValueError(f"weight must be a number in [0, {MAX_WEIGHT:g}], got {weight!r}")
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if gather is not None:
            try:
                size = len(msgpack.packb(gather, use_bin_type=True))
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"gather must be msgpack-serializable: {e}") from e
            if size > MAX_GATHER_BYTES:
                raise ValueError(f"gather is {size} bytes packed; the limit is {MAX_GATHER_BYTES}")
        assert self._step_lock is not None and self.matchmaker is not None
        key = self.keys.key
        started = trio.current_time()
        end = started + timeout if timeout is not None else math.inf
        with trio.CancelScope() as scope:
            self._step_scopes.add(scope)
            try:
                acquired = False
                with trio.move_on_at(end):  # another step of this averager may be running
                    await self._step_lock.acquire()
                    acquired = True
                if not acquired:
                    return StepResult(
                        False,
                        key,
                        reason=f"timed out after {timeout:g}s waiting for this averager's "
                        "previous step to finish",
                        timed_out=True,
                        next_group_key=key,
                    )
                try:
                    # Every phase has its own timeout; this outer bound is the safety net that
                    # keeps a step without ``timeout`` from ever waiting forever.
                    # counted from now: waiting for a previous step (above) is bounded apart
                    now = trio.current_time()
                    hard_end = min(end, now + self._hard_step_bound()) + HARD_STEP_SLACK
                    with trio.move_on_at(hard_end) as hard_scope:
                        try:  # _step extends hard_scope for slow links
                            return await self._step(
                                key, float(weight), gather, started, end, hard_scope
                            )
                        finally:
                            self.in_group = False
                    hard_end = hard_scope.deadline
                    logger.error(
                        "averaging step under %s ran past %.0fs although each of its phases "
                        "has a timeout; abandoned (please report this with the log above)",
                        key,
                        hard_end - now,
                    )
                    return StepResult(
                        False,
                        key,
                        reason=f"step abandoned after {hard_end - now:.0f}s",
                        timed_out=True,
                        next_group_key=key,
                    )
                finally:
                    self._step_lock.release()
            finally:
                self._step_scopes.discard(scope)
        return StepResult(
            False, key, reason="cancelled: the averager was shut down", next_group_key=key
        )

    def _hard_step_bound(self) -> float:
        """The longest a step without ``timeout`` should take: its phases' timeouts. A step
        is abandoned ``HARD_STEP_SLACK`` seconds after this (or after its own ``timeout``),
        whatever it waits for; the phases' own timeouts should always end it before."""
        return self.matchmaking_timeout + self.allreduce_timeout + 4 * self.request_timeout

    def allreduce_budget(self, group: GroupInfo) -> float:
        """Seconds the all-reduce with ``group`` may take: ``allreduce_timeout`` plus
        ``LINK_TIME_FACTOR`` times the round's time on the slowest link a member stated, or
        else measured (``uplink_meter.py``).

        Every member computes the same from the GroupInfo (bandwidths, codec densities) and
        the shared schema, so they give up together. Before any member reported its codec's
        density, the widest dtype's size counts (an upper bound for every codec).
        """
        return self.allreduce_timeout + LINK_TIME_FACTOR * self._link_seconds(group)

    def _allreduce_end(self, group: GroupInfo, end: float, hard_scope: trio.CancelScope) -> float:
        """When the all-reduce with ``group`` must end (trio time): its budget from now, within
        the step's ``end``; the step's safety net, which counted only ``allreduce_timeout``,
        moves as far past it as past a plain all-reduce."""
        now = trio.current_time()
        allreduce_end = now + min(self.allreduce_budget(group), max(end - now, 1e-3))
        hard = min(allreduce_end + 4 * self.request_timeout, end) + HARD_STEP_SLACK
        hard_scope.deadline = max(hard_scope.deadline, hard)
        return allreduce_end

    def _stall_limits(self, group: GroupInfo) -> tuple[float, float]:
        """(sender_timeout, reducer_timeout): as configured, or 1/3 and 2/3 of
        ``allreduce_timeout`` plus twice a chunk's time on the slowest stated (or measured)
        link (a round has at least ``CHUNKS_PER_PEER`` per sender pair). Not shares of the
        whole budget: a member that stopped sending would then hold a slow-link round for
        most of it."""
        chunk = LINK_TIME_FACTOR * self._link_seconds(group) / CHUNKS_PER_PEER
        return (
            self.sender_timeout or self.allreduce_timeout / 3 + chunk,
            self.reducer_timeout or 2 * self.allreduce_timeout / 3 + chunk,
        )

    def _link_seconds(self, group: GroupInfo) -> float:
        """``round_link_seconds`` for our tensors over the stated or measured rates (0 where
        no member stated or measured one), at most ``MAX_LINK_TIMEOUTS`` timeouts."""
        widest = max((t.element_size() for t in self._tensors), default=4)
        link = round_link_seconds(
            group, self._numel, unknown_bytes_per_value=float(widest), measured=True
        )
        return min(link, MAX_LINK_TIMEOUTS * self.allreduce_timeout) if link is not None else 0.0

    def _attached(self) -> tuple[Matchmaker, _CountingBackend, AllReduceService, Host]:
        """The parts :meth:`start` attached (a step before it is a bug in the caller)."""
        mm, backend, allreduce = self.matchmaker, self._mm_backend, self._allreduce
        if mm is None or backend is None or allreduce is None or self._host is None:
            raise RuntimeError("the averager is not started: call .start() first")
        return mm, backend, allreduce, self._host

    async def _step(
        self,
        key: str,
        weight: float,
        gather: Any,
        started: float,
        end: float,
        hard_scope: trio.CancelScope,
    ) -> StepResult:
        """One round; ``end`` (trio time, may be inf) bounds everything including the lock;
        ``hard_scope`` is the step's safety net, moved later where slow links need it."""
        matchmaking_deadline = min(started + self.matchmaking_timeout, end)
        mode, why = self._round_mode()
        if mode is None:
            return StepResult(False, key, reason=why, next_group_key=key)
        group, declared, key = await self._find_group(key, mode, why, matchmaking_deadline, gather)
        matchmaking_seconds = trio.current_time() - started
        if group is None:
            next_key = self.keys.update_without_group(declared)
            reason = self._alone_reason(key, matchmaking_deadline - started)
            return StepResult(
                False,
                key,
                reason=reason,
                matchmaking_seconds=matchmaking_seconds,
                timed_out=True,
                next_group_key=next_key,
            )
        if self._before_allreduce is not None:  # test/demo hook (e.g. die mid-round)
            await self._before_allreduce(group)
        # waiting for the tensor lock counts against the all-reduce's time (and the step's)
        allreduce_end = self._allreduce_end(group, end, hard_scope)
        me = self._attached()[3].peer_id
        if not await self._acquire_lock(allreduce_end):
            next_key = self.keys.update_after_round(group.group_id, group.members, me, declared)
            reason = (
                "timed out waiting for the tensor lock (another thread held "
                "averager.get_tensors() for the whole step); the group averaged without us"
            )
            logger.warning("averaging step under %s: %s", key, reason)
            return StepResult(
                False,
                key,
                group_id=group.group_id,
                members=group.members,
                modes=group.modes,
                reason=reason,
                matchmaking_seconds=matchmaking_seconds,
                timed_out=True,
                next_group_key=next_key,
            )
        try:
            result = await self._run_allreduce(group, weight, allreduce_end)
        finally:
            self._lock.release()
        failed = result.failed_peers
        self._record_round(group.members, failed, me)
        next_key = self.keys.update_after_round(group.group_id, group.members, me, declared)
        return StepResult(
            succeeded=result.averaged_numel > 0,
            reason=result.why_not_averaged(),
            averaged_fraction=result.averaged_fraction,
            complete_fraction=result.complete_fraction,
            group_key=key,
            group_id=group.group_id,
            members=group.members,
            modes=group.modes,
            gathered=dict(zip(group.members, group.gathered, strict=True))
            if group.gathered
            else {},
            failed=set(failed),
            excluded=dict(result.excluded),
            matchmaking_seconds=matchmaking_seconds,
            allreduce_seconds=result.seconds,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            timed_out=result.timed_out,
            next_group_key=next_key,
            group_deviation=result.deviation,
        )

    async def _find_group(
        self, key: str, mode: str, why: str, deadline: float, gather: Any
    ) -> tuple[GroupInfo | None, int, str]:
        """Matchmaking under ``key`` until ``deadline``: the group (None: none formed), how
        many peers of our schema declared there (the grid's evidence), and the key (a new or
        lonely peer may move to a longer one: ``grid_reads.find_group_on_grid``)."""
        matchmaker, backend, _, host = self._attached()
        if mode != matchmaker.mode:
            logger.info("averaging in %s mode%s", mode, f": {why}" if why else "")
            matchmaker.mode = mode
        reads = KeyReads(backend, self.schema, host.peer_id, self.request_timeout)
        look_after = min(self.request_timeout, self.min_matchmaking_time / 2)
        group, declared, key = await find_group_on_grid(
            self.keys, matchmaker, reads, key, look_after, deadline, gather
        )
        self.in_group = group is not None
        conflicts = matchmaker.last_schema_conflicts
        if conflicts and group is not None:
            # logged once at INFO, then at DEBUG: the peer stays under the key round after
            # round, and nothing new is learned (alone, _alone_reason says it as a WARNING)
            (logger.info if self._schema_memory.first_warning(conflicts) else logger.debug)(
                "%d peer(s) under %s average tensors of another schema (not grouped with)",
                len(conflicts),
                key,
            )
        return group, declared, key

    def _alone_reason(self, key: str, waited: float) -> str:
        """Why no group formed under ``key``; a schema conflict is logged (WARNING once)."""
        reason = f"no group of >= {self.min_group_size} formed under {key} within {waited:.3g}s"
        conflicts = self._attached()[0].last_schema_conflicts
        if conflicts:
            reason += (
                f"; {len(conflicts)} peer(s) there average tensors of another schema, so "
                f"they are never grouped with this peer ({self.schema_description}, "
                f"schema {self.schema.hex()[:12]}): {next(iter(conflicts.values()))}. "
                "Check that every peer under this prefix averages the same model"
            )
            first_time = bool(self._schema_memory.first_warning(conflicts))
            (logger.warning if first_time else logger.debug)(
                "averaging step under %s: %s", key, reason
            )
        return reason

    async def _run_allreduce(self, group: GroupInfo, weight: float, end: float) -> AllReduceResult:
        """All-reduce with ``group`` until ``end`` and write the average into our tensors
        (the caller holds the tensor lock)."""
        matchmaker, _, allreduce, host = self._attached()
        sender_timeout, reducer_timeout = self._stall_limits(group)
        sent_before = _bytes_sent_to(host, group.members)
        result = await allreduce.run(
            group,
            self._tensors,
            weight=0.0 if self.mode == MODE_AUX else weight,
            compression=self.compression,
            timeout=max(end - trio.current_time(), 1e-3),
            sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout,
            numel=self._numel,
            out=self._out_buffers(),
            uplink_rate=self.bandwidth if self.pace_uplink else None,
            aggregation=self.aggregation,
        )
        if result.wire_bytes_per_value is not None:
            # the next groups learn how dense our codec is (it sizes their chunks)
            matchmaker.bytes_per_value = result.wire_bytes_per_value
        if self.bandwidth is None:  # and how fast our uplink carried it (their allowance)
            sent_after = _bytes_sent_to(host, group.members)
            sent = sum(max(0, n - sent_before.get(p, 0)) for p, n in sent_after.items())
            self.uplink_meter.observe(
                sent, result.seconds, timed_out=result.timed_out, lost=bool(result.failed_peers)
            )
            matchmaker.measured_uplink = self.uplink_meter.rate
        if result.averaged is not None:
            await self._write(result.averaged)
        return result

    def _round_mode(self) -> tuple[str | None, str]:
        """This round's mode and why it differs from ``self.mode`` (None: sit it out).

        The DHT node's role may change while it runs (``client_mode`` unset: AutoNAT's
        verdict and the relays decide). A node-mode peer averages as a client while the
        node acts as a client, or while peers reach it only through a relay that could not
        carry a reducer's traffic (see ``client_mode`` in the class docstring)."""
        if self.mode == MODE_CLIENT:
            return MODE_CLIENT, ""
        node = self._node
        if self.mode == MODE_NODE and getattr(node, "client_mode", False):
            return MODE_CLIENT, "the DHT node acts as a client (peers cannot connect to it)"
        limit = getattr(node, "relay_limit", None)
        # both directions: the spec limits each direction, but py-libp2p's relays (and maybe
        # others) spend one budget on the two together, and a reducer both sends and receives
        need = 2 * (self._numel * 4 + RELAY_CONTROL_HEADROOM)
        if limit is not None and limit.data and limit.data < need:
            why = (
                f"peers reach this one only through a relay that passes {limit.data} bytes "
                f"per connection, less than reducing these tensors may take ({need} bytes)"
            )
            if self.mode == MODE_AUX:
                return None, f"an auxiliary peer must reduce, but {why}"
            return MODE_CLIENT, why
        return self.mode, ""

    def _out_buffers(self) -> list[torch.Tensor] | None:
        """Output tensors the all-reduce writes into, kept across rounds (None for aux).

        Reusing them costs 1x the tensor bytes between rounds but saves first-touch page
        faults on a fresh output every round (~7x the cost of the copy itself on CPU).
        """
        if self.mode == MODE_AUX:
            return None
        if self._out is None:
            self._out = empty_like_all(self._tensors)
        return self._out

    async def _write(self, averaged: list[torch.Tensor]) -> None:
        """Copy the round's result into the caller's tensors (caller holds the lock)."""

        def copy() -> None:
            with torch.no_grad():
                for dst, src in zip(self._tensors, averaged, strict=True):
                    dst.copy_(src)

        if self._numel >= WRITE_INLINE_NUMEL:
            await trio.to_thread.run_sync(copy)
        else:
            copy()


def _in_trio() -> bool:
    """True on a thread running a trio loop (e.g. shutdown() called from the DHT's thread)."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _checked_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors to average, as a list; a clear error for what cannot be averaged."""
    checked = list(tensors)
    if not checked:
        raise ValueError("Averager needs at least one tensor")
    if any(not isinstance(t, torch.Tensor) for t in checked):
        raise TypeError("tensors must be torch.Tensor objects")
    if any(not t.is_floating_point() for t in checked):
        raise TypeError("only floating-point tensors can be averaged")
    return checked


def _bytes_sent_to(host: Host, peers: Iterable[PeerID]) -> dict[PeerID, int]:
    """Bytes sent so far over our live connections to each of ``peers`` (the uplink meter's
    reading: what a round moved, whole messages or not)."""
    counts = {peer: host.bytes_sent_to(peer) for peer in peers}
    return {peer: n for peer, n in counts.items() if n is not None}
