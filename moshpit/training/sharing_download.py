"""One download of the swarm's newest state, run over the network (see ``sharing``'s module doc).

:class:`DownloadRun` waits for an announced state, fetches its manifest from the donor reached
best, then runs the chunk transfers: one task keeps the set of holders current (new donors
and partial holders from the DHT, the ``have`` bitmaps of partial holders) and every holder
gets ``max_in_flight_per_donor`` workers, each with one request in flight on its own stream.
Which chunk a worker asks for, and whether it may ask at all, is ``sharing_plan``'s decision;
what it sends and accepts, ``sharing_protocol``'s. The DHT, the streams, the ban list and the
serving side are the :class:`StateSharing` it belongs to.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

import torch
import trio

from moshpit.netutil import is_network_error, short
from moshpit.training.errors import NoDonorError, StateDownloadError
from moshpit.training.manifest import Manifest, tensor_from_chunks
from moshpit.training.sharing_plan import (
    AdvertisedState,
    DownloadPlan,
    Holder,
    advertised_states,
    note_answer,
    note_busy,
    note_failure,
    path_rank,
    records_of_schema,
    relay_alternatives,
)
from moshpit.training.sharing_protocol import (
    MAX_DIGESTS_PER_REQUEST,
    BadReply,
    Record,
    ServedState,
    chunks_request,
    have_request,
    manifest_request,
    read_chunks_reply,
    read_have_reply,
    read_manifest_reply,
    state_schema_digest,
)
from moshpit.training.sharing_streams import Channel

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID
    from moshpit.training.sharing import StateSharing

__all__ = [
    "ChunkSink",
    "Download",
    "DownloadResult",
    "DownloadRun",
    "describe",
    "update_have",
]

logger = logging.getLogger("moshpit.training.sharing")  # one logger for state sharing

T = TypeVar("T")

# times the records are read again when no donor gave a manifest and one of them answered
# that it serves a newer state than the one it announced (a peer in training publishes
# every epoch or checkpoint, maybe since we read its record)
MOVED_ON_REREADS = 3


class _DonorsMovedOn(StateDownloadError):
    """No manifest, and some donor answered that it no longer serves the state we read."""


class ChunkSink(Protocol):
    """Where a joiner keeps verified chunks, so that a restarted download skips them (a
    :class:`StateStore`)."""

    def has_chunk(self, digest: bytes) -> bool: ...

    def read_chunk(self, digest: bytes) -> bytes | None: ...

    def put_chunk(self, digest: bytes, data: bytes) -> None: ...


@dataclass
class DownloadResult:
    manifest: Manifest
    tensors: list[torch.Tensor]  # in manifest order
    donors_used: list[PeerID]  # peers that sent at least one verified chunk
    misbehaving: dict[PeerID, str]  # peer -> what it did (bad chunk, bad manifest, ...)
    chunks_from_sink: int = 0  # chunks the sink already held (a restarted joiner)
    bytes_by_peer: dict[PeerID, int] = field(default_factory=dict)
    donors_announcing: list[PeerID] = field(default_factory=list)  # every holder of this root


class Download(DownloadPlan):
    """A download under way: its plan, the chunks received so far (which this peer serves
    meanwhile), and the events its workers wait on."""

    def __init__(self, manifest: Manifest, served: ServedState) -> None:
        refs = manifest.chunk_refs()
        super().__init__(list(refs.values()))
        self.manifest = manifest
        self.served = served
        self.digests = list(refs)
        self.data: list[bytes | None] = [None] * len(self.digests)
        self.changed = trio.Event()  # set (and replaced) whenever workers may find new work
        self.done = trio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def release(self, h: Holder, indices: Sequence[int]) -> None:
        super().release(h, indices)
        self.notify()


def update_have(dl: Download, h: Holder, reply: dict[str, Any]) -> None:
    """Take a partial holder's ``have``/``pending`` bitmaps from an answer (if valid)."""
    read = read_have_reply(reply, len(dl.digests))
    if read is not None and dl.update_have(h, *read):
        dl.notify()


def describe(misbehaving: dict[PeerID, str]) -> str:
    return "; ".join(f"{short(p)}: {why}" for p, why in misbehaving.items())


class DownloadRun:
    """Downloads the newest state announced, for :meth:`StateSharing.download`. Verified
    chunks go to ``sink``; peers caught misbehaving are banned and added to
    ``misbehaving`` (kept across runs of one download)."""

    def __init__(
        self,
        sharing: StateSharing,
        sink: ChunkSink | None,
        misbehaving: dict[PeerID, str],
    ) -> None:
        self.sharing = sharing
        self.sink = sink
        self.misbehaving = misbehaving
        # called with the bytes of each batch of chunks that verified (a download making
        # progress is given more time: see StateSharing.download)
        self.on_progress: Callable[[int], None] | None = None

    async def newest(
        self, local_schema: Sequence[tuple[str, str, tuple[int, ...]]], deadline: float
    ) -> DownloadResult:
        """The newest state that fits ``local_schema``, every chunk verified (NoDonorError
        when nobody announces one by ``deadline``, StateMismatchError when it does not fit).
        Donors that moved on to a newer state send us back to the records
        (``MOVED_ON_REREADS`` times)."""
        rereads = 0
        while True:
            records = await self._wait_for_records(deadline)
            # states of another model (another schema announced) are passed over unasked
            records = records_of_schema(records, state_schema_digest(local_schema))
            try:
                manifest, state = await self._fetch_manifest(records)
                break
            except _DonorsMovedOn as e:
                if rereads >= MOVED_ON_REREADS:
                    raise StateDownloadError(str(e)) from None
                rereads += 1
                # the donor announces its new state as it publishes it: read once more. A
                # donor that answered is no stall: the re-read gets the whole timeout again
                # (a first request that waited for a hole punch may have used most of it)
                if self.on_progress is not None:
                    self.on_progress(0)
                logger.info("the donors moved on to a newer state: reading the records again")
                await trio.sleep(min(1.0, self.sharing.refresh_interval))
        manifest.check_fits(local_schema)  # StateMismatchError before any chunk is fetched
        dl = Download(manifest, ServedState.of(manifest))
        from_sink = await self._load_from_sink(dl)
        logger.info(
            "downloading the state of epoch %d (%d bytes, %d chunks, %d already held) from %d "
            "donor(s)",
            manifest.epoch,
            manifest.total_bytes,
            len(dl.digests),
            from_sink,
            len(state.donors),
        )
        tensors = await self._fetch_and_assemble(dl, records)
        used = sorted(p for p, n in dl.bytes_by_peer.items() if n)
        logger.info(
            "state of epoch %d verified: %s",
            manifest.epoch,
            ", ".join(f"{dl.bytes_by_peer[p]} bytes from {short(p)}" for p in used)
            or "every chunk was held already",
        )
        return DownloadResult(
            manifest,
            tensors,
            used,
            self.misbehaving,
            from_sink,
            dl.bytes_by_peer,
            [*state.donors, *state.partial],
        )

    async def _wait_for_records(self, deadline: float) -> list[Record]:
        """Poll the DHT until some peer announces a complete state (NoDonorError at deadline)."""
        sharing = self.sharing
        wait = min(0.5, sharing.refresh_interval)
        while True:
            found = await sharing._read_records()
            records = [r for r in found if not sharing._banned_now(r.peer)]
            if any(r.complete for r in records):
                return records
            if trio.current_time() + wait >= deadline:
                banned = len(found) - len(records)
                raise NoDonorError(
                    f"no peer announced a state under {sharing.key!r} in time"
                    + (f" (ignoring {banned} banned donor(s))" if banned else "")
                    + ": is the prefix right, and does some peer of the run serve its state "
                    "(a checkpoint_dir, or serve_from_memory) and has it stepped yet?"
                )
            await trio.sleep(wait)
            wait = min(wait * 2, 5.0)

    # ------------------------------------------------------------------ the manifest

    async def _fetch_manifest(self, records: list[Record]) -> tuple[Manifest, AdvertisedState]:
        """The newest state's manifest whose SHA-256 is the signed root (next state if none)."""
        by_peer = {r.peer: r for r in records}
        states = advertised_states(records)
        tried = moved_on = 0
        for state in states:
            donors = list(state.donors)
            random.shuffle(donors)
            # donors we reach directly first: a relay may cut a manifest (and counts its bytes)
            donors.sort(key=lambda peer: self._path_rank(peer, by_peer[peer]))
            for peer in donors:
                if self.sharing._banned_now(peer):
                    continue
                tried += 1
                self.sharing._learn_addrs(by_peer[peer])
                manifest = await self._ask_manifest(peer, state)
                if isinstance(manifest, Manifest):
                    return manifest, state
                moved_on += manifest == "moved on"
        error = _DonorsMovedOn if moved_on else StateDownloadError
        raise error(
            f"{len(states)} state(s) announced under {self.sharing.key!r} but no manifest "
            f"could be fetched from any of {tried} donor(s)"
            + (f" ({moved_on} serve a newer state now)" if moved_on else "")
            + (f"; misbehaving: {describe(self.misbehaving)}" if self.misbehaving else "")
        )

    async def _ask_manifest(
        self, peer: PeerID, state: AdvertisedState
    ) -> Manifest | Literal["moved on"] | None:
        """``state``'s manifest from ``peer``; "moved on" if it serves another state now;
        None if it failed or lied (then it is banned)."""
        try:
            reply = await self.sharing._request(
                peer, manifest_request(self.sharing.prefix, state.root)
            )
        except Exception as e:
            if not is_network_error(e):
                raise
            logger.info("manifest request to %s failed: %s", short(peer), e)
            return None
        try:
            manifest = read_manifest_reply(reply, state.root)
        except BadReply as e:
            self.sharing._ban(peer, str(e), self.misbehaving)
            return None
        if manifest is None:
            logger.info("%s no longer serves the state it announced", short(peer))
            return "moved on"
        if manifest.epoch != state.epoch or manifest.total_bytes != state.bytes:
            logger.warning(
                "state %s announced as epoch %d / %d bytes is epoch %d / %d bytes",
                state.root.hex()[:12],
                state.epoch,
                state.bytes,
                manifest.epoch,
                manifest.total_bytes,
            )
        return manifest

    # ------------------------------------------------------------------ the chunks

    async def _load_from_sink(self, dl: Download) -> int:
        """Chunks a previous (interrupted) download already put into the sink."""
        sink = self.sink
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

    async def _fetch_and_assemble(self, dl: Download, records: list[Record]) -> list[torch.Tensor]:
        """Fetch every chunk ``dl`` lacks and build its tensors, serving the chunks in to
        other joiners until the tensors are built."""
        with self.sharing._serving_download(dl):
            if dl.remaining:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._refresh_holders, dl, records, nursery)
                    await dl.done.wait()
                    nursery.cancel_scope.cancel()
            return await self._assemble(dl)

    async def _refresh_holders(
        self, dl: Download, records: list[Record], nursery: trio.Nursery
    ) -> None:
        """Keep the set of holders current: new donors and partial holders from the DHT (each
        gets its workers), and the ``have`` bitmaps of partial holders."""
        sharing = self.sharing
        root = dl.manifest.root
        announced_at = -math.inf
        while True:
            if trio.current_time() - announced_at >= sharing.announce_ttl / 3:
                announced_at = trio.current_time()
                record = sharing._record_value(dl.manifest, complete=False)
                nursery.start_soon(sharing._store_record, record)
            for r in records:
                if r.root != root or sharing._banned_now(r.peer):
                    continue
                h, new = dl.admit(r.peer, r.complete, trio.current_time())
                if new:
                    sharing._learn_addrs(r)
                if not h.complete and not h.gone:
                    nursery.start_soon(self._poll_have, dl, h)
                while not h.gone and h.workers < sharing.max_in_flight_per_donor:
                    h.workers += 1
                    nursery.start_soon(self._worker, dl, h)
            dl.notify()
            if not any(not h.gone for h in dl.holders.values()):
                logger.info("no live holder of the state left; looking for more")
            await trio.sleep(sharing.refresh_interval)
            records = await sharing._read_records()

    async def _poll_have(self, dl: Download, h: Holder) -> None:
        try:
            reply = await self.sharing._request(
                h.peer, have_request(self.sharing.prefix, dl.manifest.root)
            )
        except Exception as e:
            if not is_network_error(e):
                raise
            return
        if isinstance(reply, dict):
            update_have(dl, h, reply)

    async def _worker(self, dl: Download, h: Holder) -> None:
        """One request in flight to ``h`` at a time; ``max_in_flight_per_donor`` of these."""
        channel = Channel()
        try:
            while dl.remaining and not h.gone:
                if self.sharing._banned_now(h.peer):
                    h.gone = True
                    return
                now = trio.current_time()
                if h.busy_until > now:
                    await trio.sleep_until(h.busy_until)
                    continue
                if not await self._may_fetch(dl, h):
                    with trio.move_on_after(self.sharing.refresh_interval):
                        await dl.changed.wait()
                    continue
                batch = dl.pick(
                    h, self.sharing.batch_bytes, MAX_DIGESTS_PER_REQUEST, trio.current_time()
                )
                if not batch:
                    with trio.move_on_after(self.sharing.refresh_interval):
                        await dl.changed.wait()
                    continue
                h.in_flight += 1
                try:
                    pause = await self._fetch_batch(dl, h, batch, channel)
                finally:
                    h.in_flight -= 1
                    dl.release(h, batch)
                if pause:
                    await trio.sleep(pause)
        finally:
            h.workers -= 1
            await channel.aclose()

    async def _fetch_batch(
        self, dl: Download, h: Holder, batch: list[int], channel: Channel
    ) -> float:
        """One request; returns how long the worker should pause (after a failure)."""
        wanted = [(dl.digests[i], dl.sizes[i]) for i in batch]
        request = chunks_request(self.sharing.prefix, [digest for digest, _ in wanted])
        # what we asked this peer for before this batch comes first on the same link
        expect = sum(size for _, size in wanted)
        h.in_flight_bytes += expect
        started = trio.current_time()
        try:
            reply = await self.sharing._request(h.peer, request, h.in_flight_bytes, channel)
        except Exception as e:
            if not is_network_error(e):
                raise
            return self._failed(h, "chunk request", e)
        finally:
            h.in_flight_bytes -= expect
        try:
            answer = read_chunks_reply(reply, wanted)
        except BadReply as e:
            if isinstance(reply, dict):  # a bad answer, but it still timed a request
                dl.took(trio.current_time() - started)
            self._drop_bad(h, str(e))
            return 0.0
        if answer.busy:
            note_busy(h, trio.current_time(), random.random())
            return 0.0
        dl.took(trio.current_time() - started)
        note_answer(h)
        got: list[tuple[int, bytes]] = []
        for i, data in zip(batch, answer.chunks, strict=False):
            if data is None:
                h.missing.add(i)
            elif dl.data[i] is None and i not in dl.verifying:  # else: an endgame duplicate
                got.append((i, data))
        if got:
            await self._keep_verified(dl, h, got)
        return 0.0

    async def _keep_verified(self, dl: Download, h: Holder, got: list[tuple[int, bytes]]) -> None:
        """Check the chunks ``h`` sent against their digests (off the event loop when big),
        keep those before the first bad one, and drop ``h`` if one was bad."""
        digests, sink = dl.digests, self.sink
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
        kept = 0
        for i, data in got[: len(got) if bad is None else bad]:
            if dl.data[i] is None:
                dl.data[i] = data
                dl.received(i, h.peer)
                kept += len(data)
        if kept and self.on_progress is not None:
            self.on_progress(kept)
        if bad is not None:
            i = got[bad][0]
            self._drop_bad(h, f"sent chunk {digests[i].hex()[:16]} whose SHA-256 does not match")
        if not dl.remaining:
            dl.done.set()

    def _failed(self, h: Holder, what: str, e: BaseException) -> float:
        """A network failure with ``h`` (no misbehaviour: a dead peer, a relay's cut): after
        ``MAX_FAILURES`` in a row it is dropped for ``request_timeout`` s. Returns how long
        its worker should pause."""
        drop_for = self.sharing.request_timeout
        pause = note_failure(h, trio.current_time(), drop_for)
        logger.info("%s to %s failed (%d in a row): %s", what, short(h.peer), h.failures, e)
        if pause is None:
            logger.warning(
                "dropping %s from this download for %.0fs: %s", short(h.peer), drop_for, e
            )
            return 0.0
        return pause

    def _drop_bad(self, h: Holder, why: str) -> None:
        h.gone = True
        self.sharing._ban(h.peer, why, self.misbehaving)

    # ------------------------------------------------------------------ which way a holder is
    # reached (sharing's module doc, "Relays")

    def _relay_room(self, peer: PeerID) -> int | None:
        """None unless we reach ``peer`` only through a relay; then the bytes that connection
        may still carry per direction (0: the relay set no data limit, or none of it is
        left: -1 then, which nothing fits). What earlier transfers on it spent is gone."""
        network = getattr(self.sharing.node, "network", None)
        relayed_only = getattr(network, "relayed_only", None)
        if network is None or relayed_only is None or not relayed_only(peer):
            return None
        relay_room = getattr(network, "relay_room", None)
        if relay_room is not None:
            room = relay_room(peer)
            if room is None:
                return 0
            return room if room > 0 else -1
        limit = network.relay_limit(peer)
        return int(getattr(limit, "data", 0) or 0)

    def _connected(self, peer: PeerID) -> bool:
        is_connected = getattr(self.sharing.host, "is_connected", None)
        return bool(is_connected(peer)) if is_connected is not None else True

    def _path_rank(self, peer: PeerID, record: Record) -> int:
        connected = self._connected(peer)
        relayed_only = connected and self._relay_room(peer) is not None
        return path_rank(connected, relayed_only, record.addrs)

    async def _may_fetch(self, dl: Download, h: Holder) -> bool:
        """May ``h`` be asked for chunks now? Connects first (the connection tells how we
        reach it). Not when we reach it only through a relay that cannot carry what is left
        while a complete holder we reach otherwise is there."""
        if not self._connected(h.peer):
            host = self.sharing.host
            try:
                await host.connect(
                    host.peerstore.get_addrs(h.peer),
                    peer_id=h.peer,
                    timeout=self.sharing.request_timeout,
                )
            except Exception as e:
                if not is_network_error(e):
                    raise
                pause = self._failed(h, "connecting", e)
                if pause:
                    await trio.sleep(pause)
                return False
        others = relay_alternatives(dl, h, self._relay_room)
        if others is None:
            return True
        note = "wait" if others else "alone"
        if h.relay_note != note:
            h.relay_note = note
            logger.info(
                "%s reaches us only through a relay connection that may still pass %d bytes, "
                "less than the %d bytes left to fetch: %s",
                short(h.peer),
                max(0, self._relay_room(h.peer) or 0),
                dl.bytes_left(),
                f"fetching from {len(others)} other donor(s) instead"
                if others
                else "fetching from it anyway, no other donor is reachable otherwise",
            )
        return not others

    # ------------------------------------------------------------------ the tensors

    async def _assemble(self, dl: Download) -> list[torch.Tensor]:
        index = {d: i for i, d in enumerate(dl.digests)}
        data = cast("list[bytes]", dl.data)  # assembled once every chunk is in
        specs = dl.manifest.tensors

        def build() -> list[torch.Tensor]:
            return [
                tensor_from_chunks(spec, [data[index[c.digest]] for c in spec.chunks])
                for spec in specs
            ]

        return await self._offload(build, nbytes=dl.manifest.total_bytes)

    async def _offload(self, fn: Callable[[], T], *, nbytes: int) -> T:
        return await self.sharing._offload(fn, nbytes=nbytes)
