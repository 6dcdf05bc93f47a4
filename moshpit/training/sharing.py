"""Joining a run: donors announce signed state records, joiners download hash-verified chunks.

A **donor** serves a frozen, committed state (a checkpoint in its :class:`StateStore`), never
the live tensors, so serving never blocks training. It announces ``{root, epoch, bytes,
complete, addrs, s}`` under ``{prefix}.state`` with the owner-signed subkey
``[owner:<PeerID>]`` (the DHT only accepts it with the donor's signature) and re-announces it
every ``announce_ttl / 3`` seconds. ``s`` hashes the state's tensor names, dtypes and shapes
(:func:`state_schema_digest`): a joiner passes over states of another model without asking
for their manifests, as long as some state of its own schema is announced (when none is, it
fetches the newest manifest anyway, so that ``StateMismatchError`` names the difference).

A **joiner** reads those records, picks the newest epoch (the root announced by the most
donors breaks ties), fetches the manifest from a donor and accepts it only if its SHA-256 is
the signed root (and, once every chunk is in, only if no tensor holds NaN or Inf: otherwise
every peer announcing that root is banned and the next newest state is fetched); then it fetches chunks in parallel from every peer that holds them, a bounded
number of requests in flight per peer. Every chunk is checked against its digest; a peer that
sends a bad chunk is banned for ``ban_seconds`` and the chunk is fetched elsewhere; a peer that
fails (died, timed out) has its chunks re-queued. Verified chunks go to ``sink`` (the joiner's
store) so a restarted joiner skips them. While downloading, a joiner announces itself as a
partial holder (``complete=False``) and serves the chunks it already holds (swarming): other
joiners poll its ``have`` bitmap and fetch from it like from a donor, and ask complete donors
first for the chunks fewest joiners hold or are fetching (rarest first).

**Relays.** A donor behind a NAT may be reachable only through a circuit relay, whose every
connection carries a bounded number of bytes (``RelayLimits.circuit_data``, 128 KiB by the
spec): a state bigger than that would be cut off mid-transfer. So a joiner asks donors it
reaches directly (or over a hole-punched connection) first, for the manifest as for chunks,
and fetches from a donor it reaches only through a relay when what is left to fetch (and the
requests for it: some relays count both directions in one budget) fits the relay's limit with
:data:`RELAY_HEADROOM` to spare, or when no complete holder it reaches otherwise is left. A relay cutting a transfer is a network failure like any other (the chunks
go back to the queue and other holders serve them; no ban), and a relayed donor that gets
hole-punched meanwhile counts as direct from then on.

Wire: :data:`STATE_PROTOCOL`, one stream handler per Host dispatching by prefix; framed msgpack
requests and answers, one after the other on a stream (a joiner's worker keeps its stream to a
peer, so the yamux window grows; a malformed request gets ``{"error": reason}``):

* ``{"prefix", "op": "manifest", "root"}`` -> ``{"manifest": bytes | None}``
* ``{"prefix", "op": "have", "root"}`` -> ``{"have": bitmap | None, "pending": bitmap}`` (bit
  ``i`` = the ``i``-th distinct chunk of the manifest, in manifest order; ``pending``: chunks a
  joiner is fetching right now)
* ``{"prefix", "op": "chunks", "digests": [...]}`` -> ``{"chunks": [bytes | None, ...]}`` (a
  prefix of the request up to ``batch_bytes``; None = not held) or ``{"busy": True}`` when the
  donor already runs ``max_concurrent_uploads`` uploads.

Everything that arrives is validated: records, responses and requests are untrusted.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import trio

from moshpit.training.errors import (
    ManifestError,
    NoDonorError,
    StateDownloadError,
)
from moshpit.training.health import first_non_finite
from moshpit.training.manifest import DIGEST_BYTES, Manifest, tensor_from_chunks

__all__ = [
    "STATE_PROTOCOL",
    "AdvertisedState",
    "DownloadResult",
    "StateSharing",
    "state_schema_digest",
]

logger = logging.getLogger(__name__)

STATE_PROTOCOL = "/moshpit/state/1.0.0"
MAX_RECORDS = 1024  # state records read per lookup
MAX_ADDRS = 8
MAX_ADDR_CHARS = 256
MAX_DIGESTS_PER_REQUEST = 1024
MAX_PREFIX_CHARS = 256
MAX_REQUEST_BYTES = 64 * 1024
MAX_ERROR_CHARS = 512
MAX_RESPONSE_BYTES = 16 << 20  # a batch of chunks (batch_bytes, at least one chunk <= 8 MiB)
MAX_RECORD_NUMBER = 1 << 53  # epochs and byte counts above this are not plausible
MAX_FAILURES = 3  # consecutive failed calls before a peer is dropped from this download
BUSY_BACKOFF = (0.05, 2.0)  # first and largest wait after a "busy" answer, seconds
SENDING_AT_ONCE = 2  # answers being transmitted at once (more wait their turn)
# what a relayed connection carries besides the state's chunks: the manifest's framing, the
# answers' msgpack/yamux/Noise framing, DHT and other RPCs sharing the connection
RELAY_HEADROOM = 32 * 1024
REQUEST_BYTES = DIGEST_BYTES + 2  # one digest in a chunk request (msgpack bin header)
KEEP_STREAM_SECONDS = 30.0  # a server keeps an idle request stream open this long
REUSE_STREAM_SECONDS = 10.0  # a requester reuses a stream idle at most this long (< the above)
# \Z, not $: "$" also matches before a final newline, a second spelling of the subkey
_OWNER_SUBKEY = re.compile(r"^\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]\Z")

T = TypeVar("T")


@dataclass(frozen=True)
class AdvertisedState:
    """One state announced in the DHT: its root, epoch, size and who serves it."""

    root: bytes
    epoch: int
    bytes: int
    donors: list[Any]  # PeerIDs announcing the whole state (complete=True)
    partial: list[Any] = field(default_factory=list)  # joiners holding part of it
    schema: bytes | None = None  # state_schema_digest as announced (None: not announced)


@dataclass
class DownloadResult:
    manifest: Manifest
    tensors: list[torch.Tensor]  # in manifest order
    donors_used: list[Any]  # peers that sent at least one verified chunk
    misbehaving: dict[Any, str]  # peer -> what it did (bad chunk, bad manifest, ...)
    chunks_from_sink: int = 0  # chunks the sink already held (a restarted joiner)
    bytes_by_peer: dict[Any, int] = field(default_factory=dict)
    donors_announcing: list[Any] = field(default_factory=list)  # every holder of this root


@dataclass
class _Record:
    peer: Any
    root: bytes
    epoch: int
    nbytes: int
    complete: bool
    addrs: tuple[str, ...]
    schema: bytes | None = None


def state_schema_digest(
    schema: Sequence[tuple[str, str, Sequence[int]]], with_dtypes: bool = True
) -> bytes:
    """A hash of a state's ``(name, dtype, shape)`` list (what ``Manifest.check_fits``
    compares): equal digests, the state fits. ``with_dtypes=False`` hashes names and shapes
    only: the model's identity, which peers of different dtypes share (they average in
    float32) and which progress records carry."""
    import msgpack

    tag = b"moshpit.state-schema.v1" if with_dtypes else b"moshpit.model-schema.v1"
    entries = [
        [str(name), *([str(dtype)] if with_dtypes else []), [int(x) for x in shape]]
        for name, dtype, shape in schema
    ]
    return hashlib.sha256(tag + msgpack.packb(entries)).digest()[:DIGEST_BYTES]


@dataclass
class _Served:
    """A state this peer serves: the manifest, its bytes, and chunk digest -> index."""

    manifest: Manifest
    packed: bytes
    index: dict[bytes, int]
    sizes: dict[bytes, int]

    @classmethod
    def of(cls, manifest: Manifest) -> _Served:
        sizes = manifest.chunk_refs()
        index = {d: i for i, d in enumerate(sizes)}
        return cls(manifest, manifest.to_bytes(), index, sizes)


# ---------------------------------------------------------------------------------------------
# one RPC handler per Host, dispatching by prefix


class _StateService:
    """Reads one request per stream and hands it to the StateSharing of its prefix. A stream
    handler rather than unary RPC, so an upload slot is held until the answer is sent."""

    def __init__(self, request_timeout: float) -> None:
        self.handlers: dict[str, StateSharing] = {}
        self.request_timeout = request_timeout

    async def handle_stream(self, stream: Any) -> None:
        """Answer requests one after the other until the requester closes the stream or sends
        nothing for ``request_timeout`` (a joiner's worker keeps one stream per peer, so its
        yamux window grows instead of starting at 256 KiB for every batch)."""
        from dht.p2p.errors import StreamClosedError, StreamResetError

        wait = self.request_timeout  # for the first request; then as long as a requester idles
        try:
            while True:
                request = None
                with trio.move_on_after(wait):
                    try:
                        request = await stream.receive_msg(max_size=MAX_REQUEST_BYTES)
                    except StreamResetError:
                        raise
                    except StreamClosedError:
                        return  # the requester is done
                if request is None:
                    logger.debug("state stream from %s: no request in time", stream.remote_peer)
                    return
                try:
                    sharing = self._route(request)
                    if wait != KEEP_STREAM_SECONDS:
                        sharing.stats["streams"] += 1
                    wait = KEEP_STREAM_SECONDS
                    await sharing._serve(stream, request)
                except _BadRequest as e:
                    wait = KEEP_STREAM_SECONDS
                    logger.info("bad state request from %s: %s", _short(stream.remote_peer), e)
                    with trio.move_on_after(self.request_timeout):
                        await stream.send_msg({"error": str(e)[:MAX_ERROR_CHARS]})
        except Exception as e:
            if not _is_network_error(e):
                raise
            logger.debug("state stream from %s failed: %r", _short(stream.remote_peer), e)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await stream.aclose()
                except Exception as e:
                    if not _is_network_error(e):
                        raise

    def _route(self, request: Any) -> StateSharing:
        if not isinstance(request, dict):
            raise _BadRequest("state request must be a map")
        prefix = request.get("prefix")
        if not isinstance(prefix, str):
            raise _BadRequest("state request needs a string 'prefix'")
        sharing = self.handlers.get(prefix)
        if sharing is None:
            raise _BadRequest("no state is served under this prefix here")
        return sharing


class _IdleTimeout(trio.abc.ReceiveStream):
    """Receives from ``stream``, failing with P2PTimeoutError when no byte comes for
    ``idle`` seconds once the answer started (before that, it may queue behind our other
    answers from the same peer; the caller's overall deadline bounds that wait)."""

    def __init__(self, stream: Any, idle: float) -> None:
        self.stream = stream
        self.idle = idle
        self.started = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        from dht.p2p.errors import P2PTimeoutError

        if not self.started:
            data = await self.stream.receive_some(max_bytes)
            self.started = True
            return data
        with trio.move_on_after(self.idle):
            return await self.stream.receive_some(max_bytes)
        raise P2PTimeoutError(
            f"no data for {self.idle:.1f}s from {_short(self.stream.remote_peer)}"
        )

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Channel:
    """A requester's stream to one peer, reused for request after request."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.idle: _IdleTimeout | None = None
        self.reader: Any = None
        self.last_used = 0.0

    def open(self, stream: Any, idle: float) -> None:
        from dht.p2p.messages import MessageReader

        self.stream = stream
        self.idle = _IdleTimeout(stream, idle)
        self.reader = MessageReader(self.idle)

    async def exchange(self, request: dict[str, Any], last: bool) -> Any:
        assert self.stream is not None and self.idle is not None
        await self.stream.send_msg(request)
        if last:
            await self.stream.send_eof()
        self.idle.started = False
        return await self.reader.receive_msg(MAX_RESPONSE_BYTES)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.reset()
        self.stream = None

    async def aclose(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await stream.aclose()


class _BadRequest(ValueError):
    """A request we refuse with an error reply (the stream and the peer stay fine)."""


_services: weakref.WeakKeyDictionary[Any, _StateService] = weakref.WeakKeyDictionary()


def _service_for(host: Any, request_timeout: float) -> _StateService:
    service = _services.get(host)
    if service is None:
        service = _services[host] = _StateService(request_timeout)
        host.set_stream_handler(STATE_PROTOCOL, service.handle_stream)
    return service


# ---------------------------------------------------------------------------------------------
# validation helpers (everything here reads untrusted input)


def _digest(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
        raise _BadRequest(f"{what} must be {DIGEST_BYTES} bytes")
    return value


def _parse_record(subkey: Any, value: Any, peer_from_base58: Callable[[str], Any]) -> _Record:
    match = _OWNER_SUBKEY.match(subkey) if isinstance(subkey, str) else None
    if match is None:
        raise ValueError("subkey is not [owner:<PeerID>]")
    peer = peer_from_base58(match.group(1))
    if not isinstance(value, dict):
        raise ValueError("record must be a map")
    root = _digest(value.get("root"), "root")
    epoch, nbytes, complete = value.get("epoch"), value.get("bytes"), value.get("complete")
    for name, number in (("epoch", epoch), ("bytes", nbytes)):
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(f"{name} must be an integer")
        if not 0 <= number < MAX_RECORD_NUMBER:
            raise ValueError(f"{name} out of range")
    if not isinstance(complete, bool):
        raise ValueError("complete must be a bool")
    raw_addrs = value.get("addrs", [])
    if not isinstance(raw_addrs, list):
        raise ValueError("addrs must be a list")
    addrs = tuple(
        a for a in raw_addrs[:MAX_ADDRS] if isinstance(a, str) and len(a) <= MAX_ADDR_CHARS
    )
    schema = value.get("s")
    if schema is not None:
        schema = _digest(schema, "schema")
    return _Record(peer, root, epoch, nbytes, complete, addrs, schema)


def _is_network_error(e: BaseException) -> bool:
    from dht.p2p.errors import P2PError

    return isinstance(e, (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError))


def _short(peer: Any) -> str:
    short = getattr(peer, "short", None)
    return short() if callable(short) else str(peer)[:12]


def _bitmap(indices: Sequence[bool]) -> bytes:
    out = bytearray((len(indices) + 7) // 8)
    for i, held in enumerate(indices):
        if held:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _from_bitmap(bitmap: bytes, n: int) -> set[int]:
    return {i for i in range(n) if bitmap[i >> 3] >> (i & 7) & 1}


# ---------------------------------------------------------------------------------------------
# the joiner's view of one download


@dataclass
class _Holder:
    """A peer we may fetch chunks from during one download."""

    peer: Any
    complete: bool
    have: set[int] = field(default_factory=set)  # for partial holders: indices they hold
    missing: set[int] = field(default_factory=set)  # indices they said they do not hold
    asked: set[int] = field(default_factory=set)  # indices requested from it, under way
    pending: set[int] = field(default_factory=set)  # partial holder: indices it is fetching
    in_flight: int = 0
    in_flight_bytes: int = 0
    failures: int = 0
    busy_until: float = 0.0
    busy_wait: float = BUSY_BACKOFF[0]
    gone: bool = False  # dropped (dead, banned): its workers exit
    retry_at: float = 0.0  # a dropped (failing) peer may be tried again from then on
    workers: int = 0
    relay_note: str = ""  # what we last logged about reaching it only through a relay


class _Download:
    def __init__(self, manifest: Manifest, served: _Served) -> None:
        self.manifest = manifest
        self.served = served
        refs = manifest.chunk_refs()
        self.digests = list(refs)
        self.sizes = list(refs.values())
        self.data: list[bytes | None] = [None] * len(self.digests)
        self.remaining: set[int] = set(range(len(self.digests)))
        self.in_flight: dict[int, int] = {}  # chunk -> requests for it under way (1, or 2)
        self.verifying: set[int] = set()  # arrived, hash being checked
        self.requested_at: dict[int, float] = {}  # chunk -> when its first request went out
        self.typical = math.inf  # moving average of how long a request takes, seconds
        self.holders: dict[Any, _Holder] = {}
        self.order = list(range(len(self.digests)))
        random.shuffle(self.order)  # joiners start at different chunks, so they can swap
        self.changed = trio.Event()
        self.done = trio.Event()
        self.bytes_by_peer: dict[Any, int] = {}

    def bytes_left(self) -> int:
        """What fetching the rest moves: the chunks, and the digests that ask for them (the
        other way, but some relays spend one budget on both directions)."""
        return sum(self.sizes[i] for i in self.remaining) + REQUEST_BYTES * len(self.remaining)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def holds(self, h: _Holder, i: int) -> bool:
        return (h.complete or i in h.have) and i not in h.missing

    def pick(self, h: _Holder, batch_bytes: int, max_count: int) -> list[int]:
        """Chunks for ``h`` to send next.

        Rarest first (fewest partial holders), so complete donors spend their upload on what
        other joiners cannot give us. A batch is at most an equal share of the unrequested
        bytes among all workers, so the last chunks are spread over every holder instead of
        queueing behind one. Endgame: once every missing chunk is requested, an idle holder
        may ask again for one whose request is overdue (twice the typical request time; the
        first verified answer wins), so one slow peer cannot hold up the end."""
        unrequested = [i for i in self.order if i in self.remaining and i not in self.in_flight]
        candidates = [i for i in unrequested if self.holds(h, i)]
        if candidates:
            partial = [p for p in self.holders.values() if not p.complete and not p.gone]
            if h.complete and partial:
                # chunks other joiners hold or are fetching count as less rare, so donors are
                # asked for what nobody has yet, and the swarm spreads the rest
                rarity = {
                    i: sum(1 for p in partial if i in p.have or i in p.pending) for i in candidates
                }
                candidates.sort(key=rarity.__getitem__)  # stable: random order on ties
            workers = max(1, sum(x.workers for x in self.holders.values() if not x.gone))
            share = sum(self.sizes[i] for i in unrequested) // workers
            limit = min(batch_bytes, share)
        else:
            overdue = trio.current_time() - 2 * self.typical
            candidates = [
                i
                for i in self.order
                if self.in_flight.get(i) == 1
                and self.requested_at.get(i, math.inf) < overdue
                and i not in h.asked
                and i not in self.verifying
                and self.holds(h, i)
            ]
            limit = 0  # one chunk
        batch, total = [], 0
        for i in candidates:
            if batch and (total + self.sizes[i] > limit or len(batch) >= max_count):
                break
            batch.append(i)
            total += self.sizes[i]
        now = trio.current_time()
        for i in batch:
            self.in_flight[i] = self.in_flight.get(i, 0) + 1
            self.requested_at.setdefault(i, now)
        h.asked.update(batch)
        return batch

    def took(self, seconds: float) -> None:
        """A request was answered after ``seconds``: update the typical request time."""
        self.typical = seconds if self.typical == math.inf else 0.8 * self.typical + 0.2 * seconds

    def release(self, h: _Holder, indices: Sequence[int]) -> None:
        for i in indices:
            left = self.in_flight.get(i, 0) - 1
            if left > 0:
                self.in_flight[i] = left
            else:
                self.in_flight.pop(i, None)
                self.requested_at.pop(i, None)
        h.asked.difference_update(indices)
        self.notify()


# ---------------------------------------------------------------------------------------------


class StateSharing:
    """Serves this peer's committed state and downloads the swarm's newest one (module doc).

    Runs on the DHT node's trio loop. ``store`` (a :class:`StateStore`, or None for a peer
    that never serves) must hold every chunk of each manifest passed to :meth:`publish`.
    """

    def __init__(
        self,
        node: Any,
        prefix: str,
        store: Any,
        *,
        announce_ttl: float = 60.0,
        max_concurrent_uploads: int = 8,
        max_in_flight_per_donor: int = 4,
        ban_seconds: float = 60.0,
        request_timeout: float = 10.0,
        batch_bytes: int = 4 << 20,
        refresh_interval: float = 1.0,
        thread_min_bytes: int = 1 << 16,
        min_rate: float = 64 * 1024,
    ) -> None:
        if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_CHARS:
            raise ValueError(f"prefix must be a string of 1..{MAX_PREFIX_CHARS} characters")
        if max_concurrent_uploads < 1 or max_in_flight_per_donor < 1:
            raise ValueError("max_concurrent_uploads and max_in_flight_per_donor must be >= 1")
        if not announce_ttl > 0 or not request_timeout > 0 or not refresh_interval > 0:
            raise ValueError("announce_ttl, request_timeout and refresh_interval must be > 0")
        from dht.p2p.identity import PeerID

        self._PeerID = PeerID
        self.node = node
        self.host = node.host
        self.prefix = prefix
        self.store = store
        self.key = f"{prefix}.state"
        self.announce_ttl = announce_ttl
        self.max_concurrent_uploads = max_concurrent_uploads
        self.max_in_flight_per_donor = max_in_flight_per_donor
        self.ban_seconds = ban_seconds
        self.request_timeout = request_timeout
        self.batch_bytes = batch_bytes
        self.refresh_interval = refresh_interval
        self.min_rate = min_rate  # bytes/s below which a transfer counts as stalled
        # CPU work on at least this many bytes (hashing, store reads) goes to a worker thread;
        # tests under an autojumping MockClock set it to infinity (a thread would let the
        # clock jump over timeouts)
        self.thread_min_bytes = thread_min_bytes
        self.subkey = f"[owner:{node.peer_id.to_base58()}]"
        self._published: _Served | None = None
        self._downloading: _Download | None = None
        self._uploads = 0
        self._senders = trio.Semaphore(SENDING_AT_ONCE)
        self._banned: dict[Any, float] = {}
        self._wake = trio.Event()
        self._last_expiration = 0.0
        self._withdrawn = False
        self._retract_partial = False
        self.stats = {
            "requests": 0,
            "streams": 0,
            "chunks_served": 0,
            "bytes_served": 0,
            "busy": 0,
        }

    # ------------------------------------------------------------------ serving side

    async def run(self) -> None:
        """Serve and keep the announcement fresh until cancelled; then withdraw."""
        service = _service_for(self.host, self.request_timeout)
        if self.prefix in service.handlers:
            raise ValueError(f"state for prefix {self.prefix!r} is already served on this host")
        service.handlers[self.prefix] = self
        try:
            while True:
                if self._downloading is None:
                    if not self._withdrawn and self._published is not None:
                        await self._announce_current()
                    elif self._retract_partial:
                        await self._store_record(None)  # no longer a partial holder
                    self._retract_partial = False
                with trio.move_on_after(self.announce_ttl / 3):
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            if service.handlers.get(self.prefix) is self:
                del service.handlers[self.prefix]
            with trio.CancelScope(shield=True), trio.move_on_after(min(5.0, self.request_timeout)):
                await self._store_record(None)

    def publish(self, manifest: Manifest) -> None:
        """Serve this committed state (replacing the previous one) and announce it soon."""
        if self.store is None:
            raise ValueError("cannot publish a state without a store to serve its chunks from")
        self._published = _Served.of(manifest)
        self._withdrawn = False
        self._wake.set()

    async def withdraw(self) -> None:
        """Stop serving and tombstone our announcement now."""
        self._published = None
        self._withdrawn = True
        await self._store_record(None)

    async def announce(self) -> None:
        """Announce the published state now (``publish`` only wakes the service loop)."""
        await self._announce_current()

    async def _announce_current(self) -> None:
        served = self._published
        if served is not None:
            await self._store_record(self._record_value(served.manifest, complete=True))

    def _record_value(self, manifest: Manifest, complete: bool) -> dict[str, Any]:
        addrs = []
        visible = getattr(self.node, "get_visible_maddrs", None)
        for a in (visible() if visible is not None else []) or self.host.listen_addrs:
            if len(str(a)) <= MAX_ADDR_CHARS:
                addrs.append(str(a))
        return {
            "root": manifest.root,
            "epoch": manifest.epoch,
            "bytes": manifest.total_bytes,
            "complete": complete,
            "addrs": addrs[:MAX_ADDRS],
            "s": state_schema_digest(manifest.schema()),
        }

    async def _store_record(self, value: dict[str, Any] | None) -> bool:
        """Store our record (None = tombstone), each with a later expiration than the last."""
        from dht.kademlia.clock import get_dht_time

        expiration = max(get_dht_time() + self.announce_ttl, self._last_expiration + 1e-3)
        self._last_expiration = expiration
        with trio.move_on_after(self.request_timeout):
            try:
                return bool(await self.node.store(self.key, value, expiration, subkey=self.subkey))
            except Exception as e:  # noqa: BLE001 - a failed announce is retried next time
                logger.info("could not store the state record under %s: %s", self.key, e)
        return False

    async def _serve(self, stream: Any, request: dict) -> None:
        """Answer one request; a chunk upload holds one of ``max_concurrent_uploads`` slots
        until its answer is sent (bounded by ``request_timeout``)."""
        self.stats["requests"] += 1
        op = request.get("op")
        if op == "manifest":
            served = self._served_by_root(_digest(request.get("root"), "root"))
            reply: dict[str, Any] = {"manifest": served.packed if served is not None else None}
        elif op == "have":
            root = _digest(request.get("root"), "root")
            dl = self._downloading
            if dl is not None and dl.manifest.root == root:
                reply = self._have_and_pending(dl)
            else:
                reply = {"have": self._have(root)}
        elif op == "chunks":
            digests = request.get("digests")
            if not isinstance(digests, list) or not 0 < len(digests) <= MAX_DIGESTS_PER_REQUEST:
                raise _BadRequest(f"'digests' must be a list of 1..{MAX_DIGESTS_PER_REQUEST}")
            wanted = [_digest(d, "each digest") for d in digests]
            if self._uploads >= self.max_concurrent_uploads:
                self.stats["busy"] += 1
                reply = {"busy": True}
            else:
                self._uploads += 1
                try:
                    chunks = await self._read_chunks(wanted)
                    nbytes = sum(len(c) for c in chunks if c is not None)
                    # answers go out a few at a time, not all interleaved: each finishes
                    # sooner, so joiners can pass its chunks on sooner (the queue is bounded
                    # by max_concurrent_uploads, the wait by the transfer time of all of it)
                    with trio.move_on_after(self._transfer_time(nbytes * self._uploads)):
                        async with self._senders:
                            await stream.send_msg({"chunks": chunks})
                finally:
                    self._uploads -= 1
                return
        else:
            raise _BadRequest(f"unknown state op {str(op)[:64]!r}")
        with trio.move_on_after(self.request_timeout):
            await stream.send_msg(reply)

    @staticmethod
    def _have_and_pending(dl: _Download) -> dict[str, bytes]:
        return {
            "have": _bitmap([d is not None for d in dl.data]),
            "pending": _bitmap([i in dl.in_flight for i in range(len(dl.data))]),
        }

    def _have(self, root: bytes) -> bytes | None:
        dl = self._downloading
        if dl is not None and dl.manifest.root == root:
            return _bitmap([d is not None for d in dl.data])
        published = self._published
        if published is not None and published.manifest.root == root:
            return _bitmap([True] * len(published.index))
        return None

    def _transfer_time(self, nbytes: int) -> float:
        """How long moving ``nbytes`` may take at worst: ``request_timeout`` + bytes at
        ``min_rate`` (a slow link is fine; a peer trickling bytes is cut off)."""
        return self.request_timeout + nbytes / self.min_rate

    async def _request(
        self,
        peer: Any,
        request: dict[str, Any],
        expect_bytes: int = 0,
        channel: _Channel | None = None,
    ) -> Any:
        """One request/answer exchange (P2PError/OSError on failure): on ``channel``'s
        stream, kept open between requests, or else on a stream of its own.

        The answer may take :meth:`_transfer_time` in all, but must keep moving: no byte for
        ``request_timeout`` fails it (several answers share one slow link, so a fixed total
        timeout would fail the later ones on a link that works)."""
        from dht.p2p.errors import P2PTimeoutError, RemoteError

        own = channel is None
        channel = _Channel() if channel is None else channel
        with trio.move_on_after(self._transfer_time(expect_bytes)):
            now = trio.current_time()
            if channel.stream is not None and now - channel.last_used > REUSE_STREAM_SECONDS:
                channel.close()  # the server may be about to drop it: start afresh
            if channel.stream is None:
                # lazy: the protocol's answer comes with the reply (which may queue behind
                # others), so it gets the same time as the reply
                stream = await self.host.new_stream(
                    peer, STATE_PROTOCOL, timeout=self._transfer_time(expect_bytes), lazy=True
                )
                channel.open(stream, self.request_timeout)
            try:
                reply = await channel.exchange(request, last=own)
            except BaseException:
                channel.close()
                raise
            channel.last_used = trio.current_time()
            if own:
                await channel.aclose()
            if isinstance(reply, dict) and isinstance(reply.get("error"), str):
                raise RemoteError(f"{_short(peer)} refused: {reply['error'][:MAX_ERROR_CHARS]}")
            return reply
        raise P2PTimeoutError(f"state request to {_short(peer)} timed out")

    def _served_by_root(self, root: bytes) -> _Served | None:
        for served in (self._published, self._downloading and self._downloading.served):
            if served is not None and served.manifest.root == root:
                return served
        return None

    async def _read_chunks(self, wanted: list[bytes]) -> list[bytes | None]:
        """Up to ``batch_bytes`` of the requested chunks (at least one), None where not held."""
        published, dl = self._published, self._downloading
        out: list[bytes | None] = []
        from_store: list[tuple[int, bytes]] = []
        for digest in wanted:
            if dl is not None and (i := dl.served.index.get(digest)) is not None:
                data = dl.data[i]
                if data is not None:
                    out.append(data)
                    continue
            if published is not None and digest in published.index:
                from_store.append((len(out), digest))
            out.append(None)
        if from_store:
            store = self.store

            def read() -> list[bytes | None]:
                return [store.read_chunk(d) for _, d in from_store]

            nbytes = sum(published.sizes[d] for _, d in from_store)
            found = await self._offload(read, nbytes=nbytes)
            for (pos, _), data in zip(from_store, found, strict=True):
                out[pos] = data
        # cut the answer at batch_bytes (one chunk at least), keeping the request's order
        cut, total = 0, 0
        for cut, data in enumerate(out):  # noqa: B007 - cut is used after the loop
            size = len(data) if data is not None else 0
            if cut and total + size > self.batch_bytes:
                break
            total += size
        else:
            cut = len(out)
        answer = out[:cut]
        served = [d for d in answer if d is not None]
        self.stats["chunks_served"] += len(served)
        self.stats["bytes_served"] += sum(len(d) for d in served)
        return answer

    async def _offload(self, fn: Callable[[], T], *, nbytes: int) -> T:
        if nbytes >= self.thread_min_bytes:
            return await trio.to_thread.run_sync(fn)
        return fn()

    def progress(self) -> dict[Any, int] | None:
        """Verified bytes received per peer in the download under way (None if none runs)."""
        dl = self._downloading
        return dict(dl.bytes_by_peer) if dl is not None else None

    # ------------------------------------------------------------------ finding states

    async def _read_records(self) -> list[_Record]:
        found = None
        with trio.move_on_after(self.request_timeout):
            try:
                found = await self.node.get(self.key, latest=True)
            except Exception as e:  # noqa: BLE001 - a failed lookup reads as "nobody yet"
                logger.info("could not read %s from the DHT: %s", self.key, e)
        if found is None or not isinstance(found.value, dict):
            return []
        records = []
        for subkey, item in list(found.value.items())[:MAX_RECORDS]:
            value = getattr(item, "value", None)
            if value is None:
                continue  # a tombstone: that peer withdrew
            try:
                record = _parse_record(subkey, value, self._PeerID.from_base58)
            except Exception as e:  # noqa: BLE001 - one bad record must not hide the rest
                logger.debug("ignoring a bad state record %r under %s: %s", subkey, self.key, e)
                continue
            if record.peer != self.node.peer_id:
                records.append(record)
        return records

    @staticmethod
    def _group(records: list[_Record]) -> list[AdvertisedState]:
        groups: dict[tuple[bytes, int, int, bytes | None], tuple[list[Any], list[Any]]] = {}
        for r in records:
            key = (r.root, r.epoch, r.nbytes, r.schema)
            donors, partial = groups.setdefault(key, ([], []))
            (donors if r.complete else partial).append(r.peer)
        states = [
            AdvertisedState(root, epoch, nbytes, sorted(donors), sorted(partial), schema)
            for (root, epoch, nbytes, schema), (donors, partial) in groups.items()
            if donors
        ]
        states.sort(key=lambda s: (-s.epoch, -len(s.donors), s.root))
        return states

    @staticmethod
    def _of_schema(records: list[_Record], schema: bytes | None) -> list[_Record]:
        """``records`` without those announcing another schema than ``schema`` (another
        model under our prefix), unless that leaves no complete one: then all of them, so
        that the newest manifest is fetched and StateMismatchError names the difference."""
        if schema is None:
            return records
        ours = [r for r in records if r.schema is None or r.schema == schema]
        return ours if any(r.complete for r in ours) else records

    async def find_states(self, schema: bytes | None = None) -> list[AdvertisedState]:
        """States announced under our prefix, newest epoch first, then most donors; with
        ``schema`` (a :func:`state_schema_digest`), only those of that schema if any is."""
        return self._group(self._of_schema(await self._read_records(), schema))

    def _learn_addrs(self, record: _Record) -> None:
        from dht.p2p.multiaddr import Multiaddr

        parsed = []
        for a in record.addrs:
            try:
                parsed.append(Multiaddr(a).without_peer_id())
            except ValueError:
                continue
        if parsed:
            self.host.peerstore.add_addrs(record.peer, parsed)

    def _banned_now(self, peer: Any) -> bool:
        until = self._banned.get(peer)
        if until is None:
            return False
        if until <= trio.current_time():
            del self._banned[peer]
            return False
        return True

    def _ban(self, peer: Any, why: str, misbehaving: dict[Any, str]) -> None:
        logger.warning("banning %s for %.0fs: %s", _short(peer), self.ban_seconds, why)
        misbehaving.setdefault(peer, why)
        now = trio.current_time()
        if len(self._banned) >= MAX_RECORDS:  # bounded: forget expired bans first
            self._banned = {p: t for p, t in self._banned.items() if t > now}
        self._banned[peer] = now + self.ban_seconds

    # ------------------------------------------------------------------ downloading

    async def download(
        self,
        local_schema: Sequence[tuple[str, str, tuple[int, ...]]],
        *,
        timeout: float,  # noqa: ASYNC109 - the documented API takes a timeout
        sink: Any = None,
    ) -> DownloadResult:
        """Fetch the swarm's newest state (module doc); nothing is returned before every
        chunk verified. Raises NoDonorError, StateMismatchError, StateDownloadError."""
        deadline = trio.current_time() + timeout
        misbehaving: dict[Any, str] = {}
        with trio.move_on_at(deadline):
            return await self._download(local_schema, deadline, sink, misbehaving)
        raise StateDownloadError(
            f"the state download did not finish within {timeout:.1f}s"
            + (f"; misbehaving peers: {_describe(misbehaving)}" if misbehaving else "")
        )

    async def _download(
        self,
        local_schema: Sequence[tuple[str, str, tuple[int, ...]]],
        deadline: float,
        sink: Any,
        misbehaving: dict[Any, str],
    ) -> DownloadResult:
        """Download the newest state; one that holds NaN/Inf is refused (its donors banned:
        every donor of a root serves the same bytes) and the next newest is tried."""
        while True:
            result = await self._download_newest(local_schema, deadline, sink, misbehaving)
            names = [spec.name for spec in result.manifest.tensors]
            named = list(zip(names, result.tensors, strict=True))
            bad = await self._offload(
                functools.partial(first_non_finite, named), nbytes=result.manifest.total_bytes
            )
            if bad is None:
                return result
            for peer in result.donors_announcing:
                self._ban(
                    peer, f"served a state whose tensor {bad!r} holds NaN or Inf", misbehaving
                )

    async def _download_newest(
        self,
        local_schema: Sequence[tuple[str, str, tuple[int, ...]]],
        deadline: float,
        sink: Any,
        misbehaving: dict[Any, str],
    ) -> DownloadResult:
        records = await self._wait_for_records(deadline)
        # states of another model (another schema announced) are passed over unasked
        records = self._of_schema(records, state_schema_digest(local_schema))
        manifest, state = await self._fetch_manifest(records, misbehaving)
        manifest.check_fits(local_schema)  # StateMismatchError before any chunk is fetched
        dl = _Download(manifest, _Served.of(manifest))
        from_sink = await self._load_from_sink(dl, sink)
        logger.info(
            "downloading the state of epoch %d (%d bytes, %d chunks, %d already held) from %d "
            "donor(s)",
            manifest.epoch,
            manifest.total_bytes,
            len(dl.digests),
            from_sink,
            len(state.donors),
        )
        previous = self._downloading
        self._downloading = dl
        announced = False
        try:
            if dl.remaining:
                announced = True
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        self._refresh_holders, dl, records, sink, misbehaving, nursery
                    )
                    await dl.done.wait()
                    nursery.cancel_scope.cancel()
            tensors = await self._assemble(dl)
        finally:
            self._downloading = previous
            # run() re-announces our own state, or retracts the partial record (not here:
            # that would make download() overrun its timeout)
            self._retract_partial = self._retract_partial or announced
            self._wake.set()
        used = sorted(p for p, n in dl.bytes_by_peer.items() if n)
        logger.info(
            "state of epoch %d verified: %s",
            manifest.epoch,
            ", ".join(f"{dl.bytes_by_peer[p]} bytes from {_short(p)}" for p in used)
            or "every chunk was held already",
        )
        return DownloadResult(
            manifest,
            tensors,
            used,
            misbehaving,
            from_sink,
            dl.bytes_by_peer,
            [*state.donors, *state.partial],
        )

    async def _wait_for_records(self, deadline: float) -> list[_Record]:
        """Poll the DHT until some peer announces a complete state (NoDonorError at deadline)."""
        wait = min(0.5, self.refresh_interval)
        while True:
            found = await self._read_records()
            records = [r for r in found if not self._banned_now(r.peer)]
            if any(r.complete for r in records):
                return records
            if trio.current_time() + wait >= deadline:
                banned = len(found) - len(records)
                raise NoDonorError(
                    f"no peer announced a state under {self.key!r} in time"
                    + (f" (ignoring {banned} banned donor(s))" if banned else "")
                    + ": is the prefix right, and does some peer in the run have a checkpoint "
                    "to serve?"
                )
            await trio.sleep(wait)
            wait = min(wait * 2, 5.0)

    async def _fetch_manifest(
        self, records: list[_Record], misbehaving: dict[Any, str]
    ) -> tuple[Manifest, AdvertisedState]:
        """The newest state's manifest whose SHA-256 is the signed root (next state if none)."""
        by_peer = {r.peer: r for r in records}
        states = self._group(records)
        tried = 0
        for state in states:
            donors = list(state.donors)
            random.shuffle(donors)
            # donors we reach directly first: a relay may cut a manifest (and counts its bytes)
            donors.sort(key=lambda peer: self._path_rank(peer, by_peer[peer]))
            for peer in donors:
                if self._banned_now(peer):
                    continue
                tried += 1
                self._learn_addrs(by_peer[peer])
                try:
                    reply = await self._request(
                        peer, {"prefix": self.prefix, "op": "manifest", "root": state.root}
                    )
                except Exception as e:
                    if not _is_network_error(e):
                        raise
                    logger.info("manifest request to %s failed: %s", _short(peer), e)
                    continue
                packed = reply.get("manifest") if isinstance(reply, dict) else None
                if packed is None and isinstance(reply, dict) and "manifest" in reply:
                    logger.info("%s no longer serves the state it announced", _short(peer))
                    continue
                if not isinstance(packed, bytes) or hashlib.sha256(packed).digest() != state.root:
                    self._ban(
                        peer, "sent a manifest that does not hash to its signed root", misbehaving
                    )
                    continue
                try:
                    manifest = Manifest.from_bytes(packed)
                except ManifestError as e:  # a signed root over garbage: the donor's fault
                    self._ban(peer, f"announced an invalid manifest: {e}", misbehaving)
                    continue
                if manifest.epoch != state.epoch or manifest.total_bytes != state.bytes:
                    logger.warning(
                        "state %s announced as epoch %d / %d bytes is epoch %d / %d bytes",
                        state.root.hex()[:12],
                        state.epoch,
                        state.bytes,
                        manifest.epoch,
                        manifest.total_bytes,
                    )
                return manifest, state
        raise StateDownloadError(
            f"{len(states)} state(s) announced under {self.key!r} but no manifest could be "
            f"fetched from any of {tried} donor(s)"
            + (f"; misbehaving: {_describe(misbehaving)}" if misbehaving else "")
        )

    async def _load_from_sink(self, dl: _Download, sink: Any) -> int:
        """Chunks a previous (interrupted) download already put into ``sink``."""
        if sink is None:
            return 0
        digests = dl.digests

        def read() -> list[bytes | None]:
            return [sink.read_chunk(d) if sink.has_chunk(d) else None for d in digests]

        found = await self._offload(read, nbytes=dl.manifest.total_bytes)
        count = 0
        for i, data in enumerate(found):
            if data is not None and len(data) == dl.sizes[i]:
                dl.data[i] = bytes(data)
                dl.remaining.discard(i)
                count += 1
        return count

    async def _refresh_holders(
        self,
        dl: _Download,
        records: list[_Record],
        sink: Any,
        misbehaving: dict[Any, str],
        nursery: trio.Nursery,
    ) -> None:
        """Keep the set of holders current: new donors and partial holders from the DHT (each
        gets its workers), and the ``have`` bitmaps of partial holders."""
        root = dl.manifest.root
        announced_at = -math.inf
        while True:
            if trio.current_time() - announced_at >= self.announce_ttl / 3:
                announced_at = trio.current_time()
                record = self._record_value(dl.manifest, complete=False)
                nursery.start_soon(self._store_record, record)
            for r in records:
                if r.root != root or self._banned_now(r.peer):
                    continue
                h = dl.holders.get(r.peer)
                if h is None or (h.gone and trio.current_time() >= h.retry_at):
                    self._learn_addrs(r)
                    h = dl.holders[r.peer] = _Holder(r.peer, r.complete)
                elif r.complete and not h.complete:
                    h.complete = True
                    h.missing.clear()
                if not h.complete and not h.gone:
                    nursery.start_soon(self._poll_have, dl, h)
                while not h.gone and h.workers < self.max_in_flight_per_donor:
                    h.workers += 1
                    nursery.start_soon(self._worker, dl, h, sink, misbehaving)
            dl.notify()
            if not any(not h.gone for h in dl.holders.values()):
                logger.info("no live holder of the state left; looking for more")
            await trio.sleep(self.refresh_interval)
            records = await self._read_records()

    async def _poll_have(self, dl: _Download, h: _Holder) -> None:
        try:
            reply = await self._request(
                h.peer, {"prefix": self.prefix, "op": "have", "root": dl.manifest.root}
            )
        except Exception as e:
            if not _is_network_error(e):
                raise
            return
        if isinstance(reply, dict):
            self._update_have(dl, h, reply)

    @staticmethod
    def _update_have(dl: _Download, h: _Holder, reply: dict) -> None:
        """Take a partial holder's ``have``/``pending`` bitmaps from an answer (if valid)."""
        bitmap = reply.get("have")
        n = len(dl.digests)
        if not h.complete and isinstance(bitmap, bytes) and len(bitmap) == (n + 7) // 8:
            h.have = _from_bitmap(bitmap, n)
            h.missing.difference_update(h.have)
            pending = reply.get("pending")
            if isinstance(pending, bytes) and len(pending) == len(bitmap):
                h.pending = _from_bitmap(pending, n) - h.have
            dl.notify()

    async def _worker(
        self, dl: _Download, h: _Holder, sink: Any, misbehaving: dict[Any, str]
    ) -> None:
        """One request in flight to ``h`` at a time; ``max_in_flight_per_donor`` of these."""
        channel = _Channel()
        try:
            while dl.remaining and not h.gone:
                if self._banned_now(h.peer):
                    h.gone = True
                    return
                now = trio.current_time()
                if h.busy_until > now:
                    await trio.sleep_until(h.busy_until)
                    continue
                if not await self._may_fetch(dl, h):
                    with trio.move_on_after(self.refresh_interval):
                        await dl.changed.wait()
                    continue
                batch = dl.pick(h, self.batch_bytes, MAX_DIGESTS_PER_REQUEST)
                if not batch:
                    with trio.move_on_after(self.refresh_interval):
                        await dl.changed.wait()
                    continue
                h.in_flight += 1
                try:
                    pause = await self._fetch_batch(dl, h, batch, sink, misbehaving, channel)
                finally:
                    h.in_flight -= 1
                    dl.release(h, batch)
                if pause:
                    await trio.sleep(pause)
        finally:
            h.workers -= 1
            await channel.aclose()

    async def _fetch_batch(
        self,
        dl: _Download,
        h: _Holder,
        batch: list[int],
        sink: Any,
        misbehaving: dict[Any, str],
        channel: _Channel,
    ) -> float:
        """One request; returns how long the worker should pause (after a failure)."""
        request = {"prefix": self.prefix, "op": "chunks", "digests": [dl.digests[i] for i in batch]}
        try:
            # what we asked this peer for before this batch comes first on the same link
            expect = sum(dl.sizes[i] for i in batch)
            h.in_flight_bytes += expect
            started = trio.current_time()
            try:
                reply = await self._request(h.peer, request, h.in_flight_bytes, channel)
            finally:
                h.in_flight_bytes -= expect
        except Exception as e:
            if not _is_network_error(e):
                raise
            return self._failed(h, "chunk request", e)
        if not isinstance(reply, dict):
            self._drop_bad(h, "sent a malformed chunk response", misbehaving)
            return 0.0
        if reply.get("busy") is not True:
            dl.took(trio.current_time() - started)
        if reply.get("busy") is True:
            h.busy_until = trio.current_time() + h.busy_wait * (0.5 + random.random())
            h.busy_wait = min(h.busy_wait * 2, BUSY_BACKOFF[1])
            return 0.0
        chunks = reply.get("chunks")
        if not isinstance(chunks, list) or not 0 < len(chunks) <= len(batch):
            self._drop_bad(h, "sent a malformed chunk response", misbehaving)
            return 0.0
        h.failures = 0
        h.busy_wait = BUSY_BACKOFF[0]
        got: list[tuple[int, bytes]] = []
        for i, data in zip(batch, chunks, strict=False):
            if data is None:
                h.missing.add(i)
            elif not isinstance(data, bytes) or len(data) != dl.sizes[i]:
                self._drop_bad(
                    h, f"sent chunk {dl.digests[i].hex()[:16]} with the wrong size", misbehaving
                )
                return 0.0
            elif dl.data[i] is None and i not in dl.verifying:  # else: an endgame duplicate
                got.append((i, data))
        if not got:
            return 0.0
        digests = dl.digests
        claimed = [i for i, _ in got]
        dl.verifying.update(claimed)

        def verify_and_keep() -> int | None:
            """Index into ``got`` of the first bad chunk; good ones before it go to the sink."""
            for n, (i, data) in enumerate(got):
                if hashlib.sha256(data).digest() != digests[i]:
                    return n
                if sink is not None:
                    sink.put_chunk(digests[i], data)
            return None

        try:
            bad = await self._offload(verify_and_keep, nbytes=sum(len(d) for _, d in got))
        finally:
            dl.verifying.difference_update(claimed)
        for i, data in got[: len(got) if bad is None else bad]:
            if dl.data[i] is None:
                dl.data[i] = data
                dl.remaining.discard(i)
                dl.bytes_by_peer[h.peer] = dl.bytes_by_peer.get(h.peer, 0) + len(data)
        if bad is not None:
            i = got[bad][0]
            self._drop_bad(
                h, f"sent chunk {digests[i].hex()[:16]} whose SHA-256 does not match", misbehaving
            )
        if not dl.remaining:
            dl.done.set()
        return 0.0

    def _failed(self, h: _Holder, what: str, e: BaseException) -> float:
        """A network failure with ``h`` (no misbehaviour: a dead peer, a relay's cut): after
        ``MAX_FAILURES`` in a row it is dropped for ``request_timeout`` s. Returns how long
        its worker should pause."""
        h.failures += 1
        logger.info("%s to %s failed (%d in a row): %s", what, _short(h.peer), h.failures, e)
        if h.failures >= MAX_FAILURES:
            h.gone = True
            h.retry_at = trio.current_time() + self.request_timeout
            logger.warning(
                "dropping %s from this download for %.0fs: %s",
                _short(h.peer),
                self.request_timeout,
                e,
            )
            return 0.0
        return min(0.1 * 2**h.failures, 2.0)

    # -- which way a holder is reached (module doc, "Relays")

    def _relay_room(self, peer: Any) -> int | None:
        """None unless we reach ``peer`` only through a relay; then the bytes one connection
        may carry per direction (0: the relay set no data limit)."""
        network = getattr(self.node, "network", None)
        relayed_only = getattr(network, "relayed_only", None)
        if relayed_only is None or not relayed_only(peer):
            return None
        limit = network.relay_limit(peer)
        return int(getattr(limit, "data", 0) or 0)

    @staticmethod
    def _fits(dl: _Download, room: int | None) -> bool:
        """Does what is left of ``dl`` fit one connection that may carry ``room`` bytes?"""
        return not room or dl.bytes_left() + RELAY_HEADROOM <= room

    def _connected(self, peer: Any) -> bool:
        is_connected = getattr(self.host, "is_connected", None)
        return bool(is_connected(peer)) if is_connected is not None else True

    def _path_rank(self, peer: Any, record: _Record) -> int:
        """0: reached directly now; 1: not connected, a direct address announced; 2: reached
        only through a relay (so connected, or announcing circuit addresses only)."""
        if self._connected(peer):
            return 0 if self._relay_room(peer) is None else 2
        return 1 if any("/p2p-circuit" not in a for a in record.addrs) else 2

    async def _may_fetch(self, dl: _Download, h: _Holder) -> bool:
        """May ``h`` be asked for chunks now? Connects first (the connection tells how we
        reach it). Not when we reach it only through a relay that cannot carry what is left
        while a complete holder we reach otherwise is there."""
        if not self._connected(h.peer):
            try:
                await self.host.connect(
                    self.host.peerstore.get_addrs(h.peer),
                    peer_id=h.peer,
                    timeout=self.request_timeout,
                )
            except Exception as e:
                if not _is_network_error(e):
                    raise
                pause = self._failed(h, "connecting", e)
                if pause:
                    await trio.sleep(pause)
                return False
        room = self._relay_room(h.peer)
        if self._fits(dl, room):
            return True
        others = [
            o
            for o in dl.holders.values()
            if o is not h and o.complete and not o.gone and self._fits(dl, self._relay_room(o.peer))
        ]
        note = "wait" if others else "alone"
        if h.relay_note != note:
            h.relay_note = note
            logger.info(
                "%s reaches us only through a relay passing %d bytes per connection, less than "
                "the %d bytes left to fetch: %s",
                _short(h.peer),
                room,
                dl.bytes_left(),
                f"fetching from {len(others)} other donor(s) instead"
                if others
                else "fetching from it anyway, no other donor is reachable otherwise",
            )
        return not others

    def _drop_bad(self, h: _Holder, why: str, misbehaving: dict[Any, str]) -> None:
        h.gone = True
        self._ban(h.peer, why, misbehaving)

    async def _assemble(self, dl: _Download) -> list[torch.Tensor]:
        index = {d: i for i, d in enumerate(dl.digests)}
        data = dl.data
        specs = dl.manifest.tensors

        def build() -> list[torch.Tensor]:
            return [
                tensor_from_chunks(spec, [data[index[c.digest]] for c in spec.chunks])
                for spec in specs
            ]

        return await self._offload(build, nbytes=dl.manifest.total_bytes)


def _describe(misbehaving: dict[Any, str]) -> str:
    return "; ".join(f"{_short(p)}: {why}" for p, why in misbehaving.items())
