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
every peer announcing that root is banned and the next newest state is fetched); then it
fetches chunks in parallel from every peer that holds them, a bounded number of requests in
flight per peer. Every chunk is checked against its digest; a peer that sends a bad chunk is
banned for ``ban_seconds`` and the chunk is fetched elsewhere; a peer that fails (died, timed
out) has its chunks re-queued. Verified chunks go to ``sink`` (the joiner's store) so a
restarted joiner skips them. While downloading, a joiner announces itself as a partial holder
(``complete=False``) and serves the chunks it already holds (swarming): other joiners poll its
``have`` bitmap and fetch from it like from a donor, and ask complete donors first for the
chunks fewest joiners hold or are fetching (rarest first).

**Relays.** A donor behind a NAT may be reachable only through a circuit relay, whose every
connection carries a bounded number of bytes (``RelayLimits.circuit_data``, 128 KiB by the
spec): a state bigger than that would be cut off mid-transfer. So a joiner asks donors it
reaches directly (or over a hole-punched connection) first, for the manifest as for chunks,
and fetches from a donor it reaches only through a relay when what is left to fetch (and the
requests for it: some relays count both directions in one budget) fits the relay's limit with
``RELAY_HEADROOM`` to spare, or when no complete holder it reaches otherwise is left. A relay
cutting a transfer is a network failure like any other (the chunks go back to the queue and
other holders serve them; no ban), and a relayed donor that gets hole-punched meanwhile counts
as direct from then on.

Layers, each its own module: ``sharing_protocol`` holds the messages, limits and strict
parsers (everything that arrives is untrusted); ``sharing_plan`` decides which state to fetch
and which chunk to ask whom for, from explicit inputs, with no I/O; ``sharing_streams`` is the
request server every donor runs and the requester's reused stream; ``sharing_download`` runs
one download's tasks. This module is :class:`StateSharing`, which serves, announces, keeps
the ban list and starts downloads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from dht.p2p.dcutr import BULK_DIRECT_WAIT
from moshpit.netutil import short
from moshpit.training.errors import StateDownloadError
from moshpit.training.health import first_non_finite
from moshpit.training.manifest import Manifest
from moshpit.training.sharing_download import (
    ChunkSink,
    Download,
    DownloadResult,
    DownloadRun,
    describe,
    update_have,
)
from moshpit.training.sharing_plan import (
    AdvertisedState,
    Holder,
    advertised_states,
    records_of_schema,
)
from moshpit.training.sharing_protocol import (
    MAX_PREFIX_CHARS,
    MAX_RECORD_NUMBER,
    MAX_RECORDS,
    REUSE_STREAM_SECONDS,
    STATE_PROTOCOL,
    ChunksRequest,
    ManifestRequest,
    Record,
    ServedState,
    announcement,
    answer_length,
    bitmap,
    busy_reply,
    chunks_reply,
    have_reply,
    manifest_reply,
    parse_record,
    parse_request,
    refusal,
    state_schema_digest,
)
from moshpit.training.sharing_streams import Channel, service_for

if TYPE_CHECKING:
    from dht.kademlia.records import ValueWithExpiration
    from dht.p2p.host import Host, P2PStream
    from dht.p2p.identity import PeerID

__all__ = [
    "MAX_RECORD_NUMBER",
    "STATE_PROTOCOL",
    "AdvertisedState",
    "ChunkSink",
    "ChunkSource",
    "DownloadResult",
    "SharingNode",
    "StateSharing",
    "state_schema_digest",
]

logger = logging.getLogger(__name__)

SENDING_AT_ONCE = 2  # answers being transmitted at once (more wait their turn)
# a download that keeps receiving verified chunks may run this many times its timeout in all
MAX_DOWNLOAD_STRETCH = 30

T = TypeVar("T")


class ChunkSource(Protocol):
    """Where a donor reads the chunks it serves (a :class:`StateStore`)."""

    def read_chunk(self, digest: bytes) -> bytes | None: ...


class SharingNode(Protocol):
    """The DHT node sharing runs on (a ``DHTNode``): its host serves and opens streams, its
    DHT holds the announcements. Its optional ``network`` (which peers we reach only through
    a relay) and ``get_visible_maddrs`` (the addresses to announce) are used where present."""

    @property
    def host(self) -> Host | None: ...

    @property
    def peer_id(self) -> PeerID: ...

    async def store(
        self, key: str, value: dict[str, Any] | None, expiration_time: float, subkey: str
    ) -> bool: ...

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration[Any] | None: ...


# ---------------------------------------------------------------------------------------------


class StateSharing:
    """Serves this peer's committed state and downloads the swarm's newest one (module doc).

    Runs on the DHT node's trio loop. ``store`` (a :class:`StateStore`, or None for a peer
    that never serves) must hold every chunk of each manifest passed to :meth:`publish`.
    """

    def __init__(
        self,
        node: SharingNode,
        prefix: str,
        store: ChunkSource | None,
        *,
        announce_ttl: float = 60.0,
        max_concurrent_uploads: int = 8,
        max_in_flight_per_donor: int = 4,
        ban_seconds: float = 60.0,
        request_timeout: float = 10.0,
        batch_bytes: int = 4 << 20,
        refresh_interval: float = 1.0,
        thread_min_bytes: int = 1 << 16,
        min_rate: float = 16 * 1024,
    ) -> None:
        if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_CHARS:
            raise ValueError(f"prefix must be a string of 1..{MAX_PREFIX_CHARS} characters")
        if max_concurrent_uploads < 1 or max_in_flight_per_donor < 1:
            raise ValueError("max_concurrent_uploads and max_in_flight_per_donor must be >= 1")
        if not announce_ttl > 0 or not request_timeout > 0 or not refresh_interval > 0:
            raise ValueError("announce_ttl, request_timeout and refresh_interval must be > 0")
        from dht.p2p.identity import PeerID

        self._PeerID = PeerID
        if node.host is None:  # a node on the in-process loopback fabric has no streams
            raise ValueError("state sharing needs a DHT node with a Host (it serves streams)")
        self.node = node
        self.host: Host = node.host
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
        # bytes/s below which a transfer counts as stalled: 128 kbit/s, under the slowest home
        # uplink worth training from (64 KiB/s cut every state download over 200 kbit/s)
        self.min_rate = min_rate
        # CPU work on at least this many bytes (hashing, store reads) goes to a worker thread;
        # tests under an autojumping MockClock set it to infinity (a thread would let the
        # clock jump over timeouts)
        self.thread_min_bytes = thread_min_bytes
        self.subkey = f"[owner:{node.peer_id.to_base58()}]"
        self._published: ServedState | None = None
        # the state published before: its chunks (not its manifest) are still served, so a
        # joiner that chose it before we moved on can finish (see publish)
        self._previous: ServedState | None = None
        self._downloading: Download | None = None
        self._uploads = 0
        self._senders = trio.Semaphore(SENDING_AT_ONCE)
        self._banned: dict[PeerID, float] = {}
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
        service = service_for(self.host, self.request_timeout)
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
        """Serve this committed state (replacing the previous one) and announce it soon.

        The previous state's chunks stay served, its manifest does not: a joiner that
        fetched that manifest just before we committed this one can finish its download
        (our store keeps the last checkpoints; a chunk it dropped is answered as not held),
        and a joiner that asks for the manifest now reads our record again and gets this
        state. One state back only: a download slower than two of our checkpoints fails
        over to other holders as before."""
        if self.store is None:
            raise ValueError("cannot publish a state without a store to serve its chunks from")
        served = ServedState.of(manifest)
        current = self._published
        if current is not None and current.manifest.root != served.manifest.root:
            self._previous = current
        self._published = served
        self._withdrawn = False
        self._wake.set()

    async def withdraw(self) -> None:
        """Stop serving and tombstone our announcement now."""
        self._published = self._previous = None
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
        visible = getattr(self.node, "get_visible_maddrs", None)
        addrs = (visible() if visible is not None else []) or self.host.listen_addrs
        return announcement(manifest, complete, addrs)

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

    async def _serve(self, stream: P2PStream, request: dict[str, Any]) -> None:
        """Answer one request (BadRequest if it is malformed); a chunk upload holds one of
        ``max_concurrent_uploads`` slots until its answer is sent (bounded by its size)."""
        self.stats["requests"] += 1
        parsed = parse_request(request)
        if isinstance(parsed, ChunksRequest):
            if self._uploads < self.max_concurrent_uploads:
                await self._upload(stream, parsed.digests)
                return
            self.stats["busy"] += 1
            reply = busy_reply()
        elif isinstance(parsed, ManifestRequest):
            served = self._served_by_root(parsed.root)
            reply = manifest_reply(served.packed if served is not None else None)
        else:
            reply = self._have_reply(parsed.root)
        with trio.move_on_after(self.request_timeout):
            await stream.send_msg(reply)

    async def _upload(self, stream: P2PStream, wanted: list[bytes]) -> None:
        self._uploads += 1
        try:
            chunks = await self._read_chunks(wanted)
            nbytes = sum(len(c) for c in chunks if c is not None)
            # answers go out a few at a time, not all interleaved: each finishes sooner, so
            # joiners can pass its chunks on sooner (the queue is bounded by
            # max_concurrent_uploads, the wait by the transfer time of all of it)
            with trio.move_on_after(self._transfer_time(nbytes * self._uploads)):
                async with self._senders:
                    await stream.send_msg(chunks_reply(chunks))
        finally:
            self._uploads -= 1

    def _have_reply(self, root: bytes) -> dict[str, Any]:
        """What we hold of ``root``: while downloading it, the chunks in and those being
        fetched; all of it if we publish it (or published it last); None (no bitmap)
        otherwise."""
        dl = self._downloading
        if dl is not None and dl.manifest.root == root:
            return have_reply(
                bitmap([d is not None for d in dl.data]),
                bitmap([i in dl.in_flight for i in range(len(dl.data))]),
            )
        for served in (self._published, self._previous):
            if served is not None and served.manifest.root == root:
                return have_reply(bitmap([True] * len(served.index)))
        return have_reply(None)

    def _transfer_time(self, nbytes: int) -> float:
        """How long moving ``nbytes`` may take at worst: ``request_timeout`` + bytes at
        ``min_rate`` (a slow link is fine; a peer trickling bytes is cut off)."""
        return self.request_timeout + nbytes / self.min_rate

    async def _request(
        self,
        peer: PeerID,
        request: dict[str, Any],
        expect_bytes: int = 0,
        channel: Channel | None = None,
    ) -> Any:
        """One request/answer exchange (P2PError/OSError on failure): on ``channel``'s
        stream, kept open between requests, or else on a stream of its own.

        The answer may take :meth:`_transfer_time` in all, but must keep moving: no byte for
        ``request_timeout`` fails it (several answers share one slow link, so a fixed total
        timeout would fail the later ones on a link that works)."""
        from dht.p2p.errors import P2PTimeoutError, RemoteError

        own = channel is None
        channel = Channel() if channel is None else channel
        with trio.move_on_after(self._transfer_time(expect_bytes)):
            now = trio.current_time()
            if channel.stream is not None and now - channel.last_used > REUSE_STREAM_SECONDS:
                channel.close()  # the server may be about to drop it: start afresh
            if channel.stream is None:
                # lazy: the protocol's answer comes with the reply (which may queue behind
                # others), so it gets the same time as the reply
                stream = await self.host.new_stream(
                    peer,
                    STATE_PROTOCOL,
                    timeout=self._transfer_time(expect_bytes),
                    lazy=True,
                    # a state is bulk: wait for a punch under way, within half the timeout
                    direct_wait=min(BULK_DIRECT_WAIT, self.request_timeout / 2),
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
            reason = refusal(reply)
            if reason is not None:
                raise RemoteError(f"{short(peer)} refused: {reason}")
            return reply
        raise P2PTimeoutError(f"state request to {short(peer)} timed out")

    def _served_by_root(self, root: bytes) -> ServedState | None:
        downloading = self._downloading.served if self._downloading is not None else None
        for served in (self._published, downloading):
            if served is not None and served.manifest.root == root:
                return served
        return None

    async def _read_chunks(self, wanted: list[bytes]) -> list[bytes | None]:
        """Up to ``batch_bytes`` of the requested chunks (at least one), None where not held."""
        dl = self._downloading
        committed = [s for s in (self._published, self._previous) if s is not None]
        out: list[bytes | None] = []
        from_store: list[tuple[int, bytes, int]] = []  # (position, digest, size)
        for digest in wanted:
            if dl is not None and (i := dl.served.index.get(digest)) is not None:
                data = dl.data[i]
                if data is not None:
                    out.append(data)
                    continue
            size = next((s.sizes[digest] for s in committed if digest in s.index), None)
            if size is not None:
                from_store.append((len(out), digest, size))
            out.append(None)
        if from_store:
            assert self.store is not None  # publish() checked it
            store = self.store

            def read() -> list[bytes | None]:
                # None for a chunk of the previous state our store has since dropped
                return [store.read_chunk(d) for _, d, _ in from_store]

            nbytes = sum(size for _, _, size in from_store)
            found = await self._offload(read, nbytes=nbytes)
            for (pos, _, _), data in zip(from_store, found, strict=True):
                out[pos] = data
        answer = out[: answer_length(out, self.batch_bytes)]
        served = [d for d in answer if d is not None]
        self.stats["chunks_served"] += len(served)
        self.stats["bytes_served"] += sum(len(d) for d in served)
        return answer

    async def _offload(self, fn: Callable[[], T], *, nbytes: int) -> T:
        if nbytes >= self.thread_min_bytes:
            return await trio.to_thread.run_sync(fn)
        return fn()

    def progress(self) -> dict[PeerID, int] | None:
        """Verified bytes received per peer in the download under way (None if none runs)."""
        dl = self._downloading
        return dict(dl.bytes_by_peer) if dl is not None else None

    # ------------------------------------------------------------------ finding states

    async def _read_records(self) -> list[Record]:
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
                record = parse_record(subkey, value, self._PeerID.from_base58)
            except Exception as e:  # noqa: BLE001 - one bad record must not hide the rest
                logger.debug("ignoring a bad state record %r under %s: %s", subkey, self.key, e)
                continue
            if record.peer != self.node.peer_id:
                records.append(record)
        return records

    async def find_states(self, schema: bytes | None = None) -> list[AdvertisedState]:
        """States announced under our prefix, newest epoch first, then most donors; with
        ``schema`` (a :func:`state_schema_digest`), only those of that schema if any is."""
        return advertised_states(records_of_schema(await self._read_records(), schema))

    def _learn_addrs(self, record: Record) -> None:
        from dht.p2p.multiaddr import Multiaddr

        parsed = []
        for a in record.addrs:
            try:
                parsed.append(Multiaddr(a).without_peer_id())
            except ValueError:
                continue
        if parsed:
            self.host.peerstore.add_addrs(record.peer, parsed)

    def _banned_now(self, peer: PeerID) -> bool:
        until = self._banned.get(peer)
        if until is None:
            return False
        if until <= trio.current_time():
            del self._banned[peer]
            return False
        return True

    def _ban(self, peer: PeerID, why: str, misbehaving: dict[PeerID, str]) -> None:
        logger.warning("banning %s for %.0fs: %s", short(peer), self.ban_seconds, why)
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
        sink: ChunkSink | None = None,
    ) -> DownloadResult:
        """Fetch the swarm's newest state (module doc); nothing is returned before every
        chunk verified. Raises NoDonorError, StateMismatchError, StateDownloadError.

        ``timeout`` bounds finding donors and any stretch without progress, not a transfer
        that keeps going: every verified chunk, and every donor's answer that it moved on to
        a newer state (the records are read again), gives the download ``timeout`` more seconds,
        up to ``MAX_DOWNLOAD_STRETCH`` times ``timeout`` in all. A fixed limit sized for a
        fast link cut every download of a slow one (26 MB of state at 10 Mbit/s take 21 s:
        a 20 s limit left a laggard behind for good, retrying)."""
        started = trio.current_time()
        misbehaving: dict[PeerID, str] = {}
        received = 0
        with trio.CancelScope(deadline=started + timeout) as scope:

            def progress(nbytes: int) -> None:
                nonlocal received
                received += nbytes
                scope.deadline = min(
                    max(scope.deadline, trio.current_time() + timeout),
                    started + MAX_DOWNLOAD_STRETCH * timeout,
                )

            return await self._download(local_schema, scope, sink, misbehaving, progress)
        raise StateDownloadError(
            f"the state download stopped after {trio.current_time() - started:.1f}s "
            f"({received / 1e6:.1f} MB received; it may take {timeout:.1f}s without progress, "
            f"{MAX_DOWNLOAD_STRETCH * timeout:.0f}s in all)"
            + (f"; misbehaving peers: {describe(misbehaving)}" if misbehaving else "")
        )

    async def _download(
        self,
        local_schema: Sequence[tuple[str, str, tuple[int, ...]]],
        scope: trio.CancelScope,
        sink: ChunkSink | None,
        misbehaving: dict[PeerID, str],
        progress: Callable[[int], None],
    ) -> DownloadResult:
        """Download the newest state; one that holds NaN/Inf is refused (its donors banned:
        every donor of a root serves the same bytes) and the next newest is tried. Waits for
        donors until ``scope``'s deadline (which progress moves)."""
        while True:
            run = DownloadRun(self, sink, misbehaving)
            run.on_progress = progress
            result = await run.newest(local_schema, scope.deadline)
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

    @contextlib.contextmanager
    def _serving_download(self, dl: Download) -> Iterator[None]:
        """While ``dl`` runs, serve its chunks as they come in (it announces us as a partial
        holder when chunks are missing); then serve what we served before."""
        previous = self._downloading
        self._downloading = dl
        announced = bool(dl.remaining)
        try:
            yield
        finally:
            self._downloading = previous
            # run() re-announces our own state, or retracts the partial record (not here:
            # that would make download() overrun its timeout)
            self._retract_partial = self._retract_partial or announced
            self._wake.set()

    @staticmethod
    def _update_have(dl: Download, h: Holder, reply: dict[str, Any]) -> None:
        """Take a partial holder's ``have``/``pending`` bitmaps from an answer (if valid)."""
        update_have(dl, h, reply)
