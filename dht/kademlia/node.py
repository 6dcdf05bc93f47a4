"""DHTNode: one Kademlia peer (routing table, local storage, RPC server and iterative client)."""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from dht.kademlia.batching import FindBatcher
from dht.kademlia.clock import get_dht_time
from dht.kademlia.errors import BootstrapError, DHTProtocolError, RecordRejectedError
from dht.kademlia.ids import (
    id_from_bytes,
    id_to_bytes,
    node_id_of,
    random_id,
    serialize,
)
from dht.kademlia.merge import merge_records, unique_live_records
from dht.kademlia.network import HostNetwork, PeerUnreachableError, RPCNetwork
from dht.kademlia.protocol import (
    MAX_ADDRS_PER_PEER,
    MAX_RECORDS_PER_STORE,
    MAX_VALUE_RESPONSE_BYTES,
    FindRequest,
    FindResult,
    PingRequest,
    StoreRequest,
    encode_entries,
    parse_find_response,
    parse_ping_response,
    parse_request,
    parse_store_response,
    sender_info,
)
from dht.kademlia.records import DHTRecord, ValueWithExpiration
from dht.kademlia.routing import Blacklist, Contact, RoutingTable
from dht.kademlia.storage import LocalStorage, StorageLimits
from dht.kademlia.traverse import Lookup, LookupResult
from dht.kademlia.validation import RecordValidator, default_validators

if sys.version_info < (3, 11):  # pragma: no cover - trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

# every IPv4 interface, a free port: peers on other machines can reach us at the interface
# addresses announced for it (pass /ip4/127.0.0.1/tcp/0 to stay local to this machine)
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
SIGNATURES_ON_LOOP = 16  # default: more signed records than this are verified in a worker thread
StoreItem = tuple[Any, Any, Any, float]  # (key, subkey or None, value, expiration_time)


@dataclass(frozen=True)
class LookupStats:
    hops: int
    rounds: int
    messages: int


def check_address_args(
    initial_peers: Iterable[Any],
    host_maddrs: Sequence[Any] | None,
    announce_maddrs: Sequence[Any] | None,
    *,
    by_peer_id: bool = False,
) -> tuple[list[Any], list[Any] | None, list[Any] | None]:
    """Parse address arguments before anything starts, so a typo is one specific error.

    Raises ``TypeError`` for a single string where a list belongs and ``MultiaddrError``
    naming the bad entry. ``by_peer_id``: a custom ``network`` addresses initial peers by
    whatever it likes (e.g. PeerIDs on the loopback fabric); only the container is checked.
    """
    from dht.p2p.multiaddr import EXAMPLE_LISTEN_MADDR, MultiaddrError, parse_multiaddr_list

    if by_peer_id:
        if isinstance(initial_peers, str | bytes):
            raise TypeError("initial_peers must be a list, not a single str")
        peers: list[Any] = list(initial_peers)
    else:
        peers = parse_multiaddr_list(initial_peers, "initial_peers")
    listen = None
    if host_maddrs is not None:
        listen = parse_multiaddr_list(host_maddrs, "host_maddrs", example=EXAMPLE_LISTEN_MADDR)
    announce = None
    if announce_maddrs is not None:
        announce = parse_multiaddr_list(
            announce_maddrs, "announce_maddrs", example="/ip4/203.0.113.7/tcp/31337"
        )
        for maddr in announce:
            if maddr.is_tcp() and maddr.tcp_endpoint()[0] in ("0.0.0.0", "::"):
                raise MultiaddrError(
                    f"bad announce_maddrs: {str(maddr)!r} is a wildcard nobody can dial; "
                    "announce the public or interface address, e.g. /ip4/203.0.113.7/tcp/31337"
                )
        if len(announce) > MAX_ADDRS_PER_PEER:
            raise ValueError(
                f"announce_maddrs has {len(announce)} addresses; peers accept at most "
                f"{MAX_ADDRS_PER_PEER} per peer"
            )
    return peers, listen, announce


def _single_exception(group: BaseExceptionGroup) -> BaseException:
    """Unwrap the nursery groups around one exception, so callers can catch it by type."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


class _SharedSearch:
    """One lookup that concurrent callers for the same target wait on together."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: LookupResult | None = None


class DHTNode:
    """A Kademlia DHT peer. Create it with :meth:`DHTNode.open` (an async context manager)."""

    def __init__(
        self,
        network: RPCNetwork,
        *,
        identity: Any = None,
        client_mode: bool = False,
        num_replicas: int = 5,
        bucket_size: int = 20,
        alpha: int = 3,
        beam_size: int | None = None,
        rpc_timeout: float = 3.0,
        lookup_timeout: float = 30.0,
        refresh_period: float = 600.0,
        cache_on_get: bool = True,
        handover: bool = True,
        limits: StorageLimits | None = None,
        validators: Sequence[RecordValidator] = (),
        max_background_tasks: int = 64,
        max_parallel_lookups: int = 32,
        max_signatures_on_loop: int = SIGNATURES_ON_LOOP,
    ):
        self.network = network
        self.host = getattr(network, "host", None)
        self.peer_id = network.peer_id
        self.node_id = node_id_of(self.peer_id)
        self.identity = identity
        self.client_mode = client_mode
        self.num_replicas = num_replicas
        self.bucket_size = bucket_size
        self.alpha = alpha
        self.beam_size = beam_size if beam_size is not None else max(num_replicas, alpha)
        self.rpc_timeout = rpc_timeout
        self.lookup_timeout = lookup_timeout
        self.refresh_period = refresh_period
        self.cache_on_get = cache_on_get
        self.handover = handover
        self.routing_table = RoutingTable(self.node_id, bucket_size)
        self.blacklist = Blacklist()
        self.storage = LocalStorage(limits)
        self.validators = default_validators(identity, validators)
        self.lookup_stats: deque[LookupStats] = deque(maxlen=100_000)
        self.max_background_tasks = max_background_tasks
        self._lookup_limiter = trio.CapacityLimiter(max_parallel_lookups)
        self._background = 0
        self._pinging: set[Any] = set()
        self._searches: dict[tuple[int, str], _SharedSearch] = {}
        self._nursery: trio.Nursery | None = None
        self._own_addrs_cache: list[bytes] | None = None
        self._node_ids: dict[bytes, tuple[Any, int]] = {}  # PeerID bytes -> (PeerID, node ID)
        self._cpu_limiter = trio.CapacityLimiter(2)
        self._finds = FindBatcher(self._find_rpc)
        # under MockClock(autojump_threshold=0) a worker thread lets virtual time leap past
        # every timeout, so simulations raise this to keep verification on the loop
        self.max_signatures_on_loop = max_signatures_on_loop

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        host: Any = None,
        initial_peers: Iterable[Any] = (),
        host_maddrs: Sequence[Any] | None = None,
        announce_maddrs: Sequence[Any] | None = None,
        *,
        identity: Any = None,
        transport: Any = None,
        network: RPCNetwork | None = None,
        client_mode: bool = False,
        bootstrap_timeout: float = 10.0,
        **kwargs: Any,
    ) -> AsyncIterator[DHTNode]:
        """Start a node, join through any live ``initial_peers``, and stop it on exit.

        Without ``host`` (and without an explicit ``network``) the node opens its own
        ``dht.p2p.Host`` on ``transport`` (TCP by default) with ``identity`` and listens on
        ``host_maddrs`` (default: every IPv4 interface, a free port); client-mode nodes listen
        only if ``host_maddrs`` is given. Address arguments are checked first
        (:func:`check_address_args`). Raises :class:`BootstrapError` if initial peers were
        given and none answered.
        """
        initial_peers, host_maddrs, announce_maddrs = check_address_args(
            initial_peers, host_maddrs, announce_maddrs, by_peer_id=network is not None
        )
        try:
            async with AsyncExitStack() as stack:
                if network is None:
                    if host is None:
                        from dht.p2p import Host, Identity, TCPTransport

                        identity = identity if identity is not None else Identity.generate()
                        transport = transport if transport is not None else TCPTransport()
                        host = await stack.enter_async_context(
                            Host.open(identity=identity, transport=transport)
                        )
                        if host_maddrs or not client_mode:
                            await host.listen(
                                [str(a) for a in (host_maddrs or DEFAULT_HOST_MADDRS)]
                            )
                    elif identity is None:
                        identity = getattr(host, "identity", None)
                    network = HostNetwork(host, announce_maddrs)
                node = cls(network, identity=identity, client_mode=client_mode, **kwargs)
                visible = [] if client_mode else node.get_visible_maddrs()
                if visible:
                    logger.info(
                        "announcing %d address(es): %s", len(visible), " ".join(map(str, visible))
                    )
                async with trio.open_nursery() as nursery:
                    node._nursery = nursery
                    network.set_handler(node._handle_rpc)
                    try:
                        await node._bootstrap(initial_peers, bootstrap_timeout)
                        nursery.start_soon(node._maintenance_loop)
                        yield node
                    finally:
                        network.set_handler(None)
                        nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _single_exception(group) from None

    def get_visible_maddrs(self) -> list[Any]:
        """Multiaddrs (with ``/p2p/<PeerID>``) other peers can pass as ``initial_peers``."""
        visible = getattr(self.network, "visible_maddrs", None)
        return visible() if visible is not None else []

    async def _bootstrap(self, initial_peers: list[Any], time_limit: float) -> None:
        if not initial_peers:
            return
        joined: list[Any] = []
        errors: list[str] = []

        async def try_peer(address: Any) -> None:
            try:
                peer_id, addrs = await self.network.connect(address, time_limit)
            except PeerUnreachableError as e:
                errors.append(str(e))
                return
            if peer_id == self.peer_id:
                return
            if await self.ping(peer_id, fallback_addrs=addrs):
                joined.append(peer_id)
            else:
                errors.append(f"{address} did not answer a DHT ping")

        async with trio.open_nursery() as nursery:
            for address in initial_peers:
                nursery.start_soon(try_peer, address)
        if not joined:
            raise BootstrapError(
                f"could not join the DHT: none of the {len(initial_peers)} initial peers answered "
                f"({'; '.join(errors[:3]) or 'they are this node itself'}); check the addresses "
                "and that at least one of those peers is running"
            )
        # Kademlia's join: look up our own ID for the k (not beam) nearest peers. Every peer
        # asked learns us (and hands over the records we are now closer to), and we learn our
        # whole neighbourhood; with only beam_size, neighbours ranked 5-10 from a key often
        # never met, so later lookups could stop short of the nearest replicas (issue 3).
        await self.find_nearest_peers(self.node_id, self.bucket_size)
        logger.info(
            "joined the DHT through %d initial peer(s); %d contacts",
            len(joined),
            len(self.routing_table),
        )

    async def _maintenance_loop(self) -> None:
        """Prune expired records; refresh buckets that saw no traffic for refresh_period."""
        period = min(self.refresh_period / 2, 60.0)
        while True:
            await trio.sleep(period)
            self.storage.prune(get_dht_time())
            stale = self.routing_table.stale_buckets(get_dht_time(), self.refresh_period)
            for bucket in stale[:16]:
                await self.find_nearest_peers(random_id(bucket.lower, bucket.upper), self.beam_size)
                bucket.last_updated = get_dht_time()

    # ------------------------------------------------------------------ background helpers

    def _spawn(self, async_fn: Any, *args: Any) -> bool:
        """Run a best-effort task in the node's nursery; refuse beyond the cap (no unbounded work)."""
        if self._nursery is None or self._background >= self.max_background_tasks:
            return False
        self._background += 1

        async def wrapper() -> None:
            try:
                await async_fn(*args)
            finally:
                self._background -= 1

        self._nursery.start_soon(wrapper)
        return True

    def _own_addrs(self) -> list[bytes]:
        if self._own_addrs_cache is None:
            self._own_addrs_cache = [] if self.client_mode else self.network.own_addrs()
        return self._own_addrs_cache

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "from": sender_info(self._own_addrs(), self.client_mode), **fields}

    def _seen_alive(self, contact: Contact) -> None:
        """A server peer proved alive: update routing; ping an evictable oldest; hand over keys."""
        if contact.peer_id == self.peer_id:
            return
        is_new = contact.peer_id not in self.routing_table
        oldest = self.routing_table.add_or_update(contact, get_dht_time())
        if oldest is not None and oldest.peer_id not in self._pinging:
            self._pinging.add(oldest.peer_id)
            if not self._spawn(self._check_oldest, oldest):
                self._pinging.discard(oldest.peer_id)
        if is_new and self.handover and len(self.storage) and contact.peer_id in self.routing_table:
            self._spawn(self._handover, contact)

    async def _check_oldest(self, oldest: Contact) -> None:
        try:
            if not await self.ping(oldest.peer_id):
                self.routing_table.remove(oldest.peer_id)
        finally:
            self._pinging.discard(oldest.peer_id)

    async def _handover(self, contact: Contact) -> None:
        """Give a newly met peer the records it is closer to than we are (Kademlia's join rule)."""
        now = get_dht_time()
        records: list[DHTRecord] = []
        for key_id in self.storage.key_ids():
            if contact.node_id ^ key_id < self.node_id ^ key_id:
                stored = self.storage.get(key_id, now)
                if isinstance(stored, DHTRecord):
                    records.append(stored)
                elif stored:
                    records.extend(stored.values())
        for start in range(0, min(len(records), 4 * MAX_RECORDS_PER_STORE), MAX_RECORDS_PER_STORE):
            await self._store_rpc(contact.peer_id, records[start : start + MAX_RECORDS_PER_STORE])

    # ------------------------------------------------------------------ outgoing RPCs

    async def _rpc(self, peer_id: Any, request: dict[str, Any]) -> Any:
        if self.blacklist.is_banned(peer_id, get_dht_time()):
            return None
        try:
            response = await self.network.call(peer_id, request, self.rpc_timeout)
        except PeerUnreachableError as e:
            if not e.answered:
                delay = self.blacklist.register_failure(peer_id, get_dht_time())
                self.routing_table.remove(peer_id)
                logger.debug("%s unreachable, banned for %.0fs: %s", peer_id, delay, e)
            else:
                logger.debug("%s answered with an error: %s", peer_id, e)
            return None
        self.blacklist.register_success(peer_id)
        return response

    async def ping(self, peer_id: Any, fallback_addrs: Sequence[bytes] = ()) -> bool:
        """DHT-level ping; on success the peer (unless in client mode) enters the routing table."""
        response = await self._rpc(peer_id, self._request("ping"))
        if response is None:
            return False
        try:
            info = parse_ping_response(response)
        except DHTProtocolError as e:
            logger.debug("bad ping response from %s: %s", peer_id, e)
            return False
        if not info.client:
            addrs = info.addrs or tuple(fallback_addrs)
            self.network.remember_addrs(peer_id, addrs)
            self._seen_alive(Contact(peer_id, node_id_of(peer_id), addrs))
        return True

    async def _find_rpc(
        self, contact: Contact, key_ids: list[int], count: int
    ) -> list[FindResult] | None:
        request = self._request("find", keys=[id_to_bytes(k) for k in key_ids], count=count)
        response = await self._rpc(contact.peer_id, request)
        if response is None:
            return None
        try:
            results = parse_find_response(response, len(key_ids), self._peer_from_bytes)
        except DHTProtocolError as e:
            logger.warning("bad find response from %s: %s", contact.peer_id, e)
            return None
        self._seen_alive(contact)
        converted = []
        for result in results:
            peers = []
            for peer_id, addrs in result.peers:
                if peer_id == self.peer_id:
                    continue
                self.network.remember_addrs(peer_id, addrs)
                peers.append(Contact(peer_id, self._node_ids[peer_id.to_bytes()][1], addrs))
            converted.append(FindResult(result.entries, peers))
        return converted

    async def _store_rpc(
        self, peer_id: Any, records: list[DHTRecord]
    ) -> list[tuple[bool, str | None]]:
        request = self._request("store", records=[r.to_wire() for r in records])
        response = await self._rpc(peer_id, request)
        if response is None:
            return [(False, "peer unreachable")] * len(records)
        try:
            return parse_store_response(response, len(records))
        except DHTProtocolError as e:
            logger.warning("bad store response from %s: %s", peer_id, e)
            return [(False, "bad response")] * len(records)

    # ------------------------------------------------------------------ lookups

    async def find_nearest_peers(self, target_id: int, count: int | None = None) -> list[Contact]:
        """The ``count`` (default k) nearest reachable peers to a 256-bit ID, by iterative lookup."""
        result = await self._lookup(target_id, beam_size=count or self.bucket_size, mode="nearest")
        return result.nearest

    async def _lookup(self, target_id: int, beam_size: int, mode: str) -> LookupResult:
        """Run (or join) the lookup of ``target_id``; concurrent identical lookups share one."""
        tag = (target_id, f"{mode}:{beam_size}")
        search = self._searches.get(tag)
        if search is None:
            search = self._searches[tag] = _SharedSearch()
            assert self._nursery is not None, "the node is not running"
            self._nursery.start_soon(self._run_search, tag, search, target_id, beam_size, mode)
        await search.done.wait()
        assert search.result is not None
        return search.result

    async def _run_search(
        self, tag: Any, search: _SharedSearch, target_id: int, beam_size: int, mode: str
    ) -> None:
        stop_when = self._has_plain_value if mode == "first-value" else None

        async def find(contact: Contact) -> FindResult | None:
            assert self._nursery is not None
            count = max(2 * beam_size, self.alpha)
            if len(self._searches) > 1:  # other lookups are running: share RPCs with them
                return await self._finds.find(self._nursery, contact, target_id, count)
            # a lone lookup calls directly: no extra scheduling tick, and cancellable
            results = await self._find_rpc(contact, [target_id], count)
            return results[0] if results else None

        initial = self.routing_table.nearest(target_id, max(beam_size, self.bucket_size))
        lookup = Lookup(
            target_id,
            initial,
            find,
            beam_size=beam_size,
            alpha=self.alpha,
            exclude=self.peer_id,
            is_banned=lambda peer: self.blacklist.is_banned(peer, get_dht_time()),
            stop_when=stop_when,
        )
        try:
            async with self._lookup_limiter:
                with trio.move_on_after(self.lookup_timeout):
                    await lookup.run()
        finally:
            search.result = lookup.snapshot()
            self._searches.pop(tag, None)
            search.done.set()
        self.lookup_stats.append(
            LookupStats(lookup.result.hops, lookup.result.rounds, lookup.result.messages)
        )

    def _peer_from_bytes(self, raw: bytes) -> Any:
        """Parse a PeerID from a find response, caching it with its node ID (bounded)."""
        cached = self._node_ids.get(raw)
        if cached is None:
            if len(self._node_ids) >= 50_000:
                self._node_ids.clear()
            peer_id = self.network.peer_from_bytes(raw)
            cached = self._node_ids[raw] = (peer_id, node_id_of(peer_id))
        return cached[0]

    @staticmethod
    def _has_plain_value(result: FindResult) -> bool:
        return bool(result.entries) and any(entry[0] is None for entry in result.entries)

    # ------------------------------------------------------------------ store

    def _make_record(
        self, key: Any, subkey: Any, value: Any, expiration_time: float
    ) -> tuple[int, DHTRecord]:
        key_bytes = serialize(key)
        record = DHTRecord(
            key=key_bytes,
            subkey=None if subkey is None else serialize(subkey),
            value=serialize(value),
            expiration_time=float(expiration_time),
        )
        return id_from_bytes(key_bytes), self.validators.sign(record)

    def _check_record(self, record: DHTRecord) -> str | None:
        return self.storage.check_limits(record, get_dht_time()) or self.validators.validate(record)

    async def _validate_many(self, records: list[DHTRecord]) -> list[str | None]:
        """Validate records; large signed batches are verified in a worker thread so that
        Ed25519 checks (~0.1 ms each) never stall the event loop."""
        if sum(1 for r in records if r.signature is not None) <= self.max_signatures_on_loop:
            return [self.validators.validate(r) for r in records]
        return await trio.to_thread.run_sync(
            lambda: [self.validators.validate(r) for r in records], limiter=self._cpu_limiter
        )

    async def _store_incoming(
        self, records: list[DHTRecord], sender: Any
    ) -> list[tuple[bool, str | None]]:
        if self.client_mode:
            return [(False, "client-mode peers do not store records for others")] * len(records)
        now = get_dht_time()
        results: list[tuple[bool, str | None]] = [(False, None)] * len(records)
        pending = []
        for i, record in enumerate(records):
            reason = self.storage.check_limits(record, now)
            if reason is not None:
                results[i] = (False, reason)
            else:
                pending.append(i)
        reasons = await self._validate_many([records[i] for i in pending])
        now = get_dht_time()
        for i, reason in zip(pending, reasons, strict=True):
            if reason is not None:
                results[i] = (False, reason)
            else:
                key_id = id_from_bytes(records[i].key)
                results[i] = self.storage.store(key_id, records[i], now, origin=sender)
        return results

    def _store_local(self, record: DHTRecord) -> tuple[bool, str | None]:
        if self.client_mode:
            return False, "client-mode peers do not store records for others"
        reason = self._check_record(record)
        if reason is not None:
            return False, reason
        return self.storage.store(id_from_bytes(record.key), record, get_dht_time())

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store ``value`` under ``key`` (or ``key[subkey]``) on the num_replicas nearest peers.

        Returns True if at least one replica accepted it. Raises :class:`RecordRejectedError`
        if the record is invalid before it leaves this node (too large, expired, unsigned
        owner key, ...), and TypeError if it is not msgpack-serializable.
        """
        key_id, record = self._make_record(key, subkey, value, expiration_time)
        reason = self._check_record(record)
        if reason is not None:
            raise RecordRejectedError(reason)
        results = await self._store_records({key_id: [((key, subkey), record)]})
        return results[(key, subkey)]

    async def store_many(self, items: Iterable[StoreItem]) -> dict[tuple[Any, Any], bool]:
        """Store many ``(key, subkey, value, expiration_time)`` items with batched RPCs.

        Returns ``{(key, subkey): accepted_by_any_replica}``. Invalid items are not sent;
        they map to False and the reason is logged.
        """
        outcome: dict[tuple[Any, Any], bool] = {}
        by_key: dict[int, list[tuple[tuple[Any, Any], DHTRecord]]] = {}
        for key, subkey, value, expiration_time in items:
            key_id, record = self._make_record(key, subkey, value, expiration_time)
            reason = self._check_record(record)
            outcome[(key, subkey)] = False
            if reason is not None:
                logger.warning("not storing %r/%r: %s", key, subkey, reason)
                continue
            by_key.setdefault(key_id, []).append(((key, subkey), record))
        outcome.update(await self._store_records(by_key))
        return outcome

    async def _store_records(
        self, by_key: dict[int, list[tuple[tuple[Any, Any], DHTRecord]]]
    ) -> dict[tuple[Any, Any], bool]:
        """Place valid records on their replicas: one lookup per key, one batched RPC per peer."""
        outcome = {name: False for entries in by_key.values() for name, _ in entries}
        plan: dict[Any, list[tuple[tuple[Any, Any], DHTRecord]]] = {}
        local: list[tuple[tuple[Any, Any], DHTRecord]] = []

        async def place(key_id: int, entries: list[tuple[tuple[Any, Any], DHTRecord]]) -> None:
            result = await self._lookup(key_id, beam_size=self.beam_size, mode="nearest")
            replicas = result.nearest[: self.num_replicas]
            if not self.client_mode:
                worst = (
                    replicas[-1].node_id ^ key_id
                    if len(replicas) >= self.num_replicas
                    else math.inf
                )
                if self.node_id ^ key_id < worst:
                    replicas = replicas[: self.num_replicas - 1]
                    local.extend(entries)
            for contact in replicas:
                plan.setdefault(contact.peer_id, []).extend(entries)

        async with trio.open_nursery() as nursery:
            for key_id, entries in by_key.items():
                nursery.start_soon(place, key_id, entries)

        for name, record in local:
            accepted, reason = self._store_local(record)
            outcome[name] = outcome[name] or accepted
            if not accepted:
                logger.debug("local replica refused %r: %s", name, reason)

        async def send(peer_id: Any, entries: list[tuple[tuple[Any, Any], DHTRecord]]) -> None:
            for start in range(0, len(entries), MAX_RECORDS_PER_STORE):
                chunk = entries[start : start + MAX_RECORDS_PER_STORE]
                results = await self._store_rpc(peer_id, [record for _, record in chunk])
                for (name, _), (accepted, reason) in zip(chunk, results, strict=True):
                    outcome[name] = outcome[name] or accepted
                    if not accepted and reason != "peer unreachable":
                        logger.debug("%s refused %r: %s", peer_id, name, reason)

        async with trio.open_nursery() as nursery:
            for peer_id, entries in plan.items():
                nursery.start_soon(send, peer_id, entries)
        return outcome

    # ------------------------------------------------------------------ get

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration | None:
        """Find the value of ``key``; None if no live record exists.

        ``latest=False`` returns as soon as any valid plain value is found; ``latest=True``
        asks every replica in the beam and returns the newest. Dictionary values are always
        merged across all replicas found (each subkey's newest record wins).
        """
        key_bytes = serialize(key)
        key_id = id_from_bytes(key_bytes)
        stored = None if self.client_mode else self.storage.get(key_id, get_dht_time())
        if not latest and isinstance(stored, DHTRecord):  # a replica ourselves: no lookup needed
            value, _ = merge_records([stored])
            if value is not None:
                return value
        mode = "all-values" if latest else "first-value"
        result = await self._lookup(key_id, beam_size=self.beam_size, mode=mode)
        entry_lists: list[tuple[Any, list[Any]]] = [
            (c, r.entries) for c, r in result.responses if r.entries
        ]
        if not self.client_mode:
            local = encode_entries(self.storage.get(key_id, get_dht_time()))
            if local:
                entry_lists.append((None, [tuple(e) for e in local]))
        value, best = await self._merge(key_bytes, [entries for _, entries in entry_lists])
        if value is not None and isinstance(best, DHTRecord) and self.cache_on_get:
            holders = {c.peer_id for c, _ in entry_lists if c is not None}
            for contact in result.nearest:
                if contact.peer_id not in holders:
                    self._spawn(self._store_rpc, contact.peer_id, [best])
                    break
        return value

    async def get_many(
        self, keys: Iterable[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration | None]:
        keys = list(keys)
        results: dict[Any, ValueWithExpiration | None] = {}

        async def one(key: Any) -> None:
            results[key] = await self.get(key, latest=latest)

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(one, key)
        return results

    async def _merge(
        self, key_bytes: bytes, entry_lists: list[list[Any]]
    ) -> tuple[ValueWithExpiration | None, Any]:
        """Validate (untrusted replicas!) and merge what several replicas returned."""
        limit = self.storage.limits.max_record_bytes
        candidates = unique_live_records(key_bytes, entry_lists, get_dht_time(), limit)
        reasons = await self._validate_many(candidates)
        return merge_records(
            r for r, reason in zip(candidates, reasons, strict=True) if reason is None
        )

    # ------------------------------------------------------------------ incoming RPCs

    async def _handle_rpc(self, peer_id: Any, raw_request: Any) -> Any:
        """Serve one DHT RPC. Malformed requests raise DHTProtocolError (an error reply)."""
        request = parse_request(raw_request)
        if not request.sender.client and request.sender.addrs and peer_id != self.peer_id:
            self.network.remember_addrs(peer_id, request.sender.addrs)
            self._seen_alive(Contact(peer_id, node_id_of(peer_id), request.sender.addrs))
        if isinstance(request, PingRequest):
            return {"from": sender_info(self._own_addrs(), self.client_mode)}
        if isinstance(request, StoreRequest):
            return {
                "results": [
                    list(result) for result in await self._store_incoming(request.records, peer_id)
                ]
            }
        if isinstance(request, FindRequest):
            now = get_dht_time()
            results = []
            for key_id in request.key_ids:
                stored = None if self.client_mode else self.storage.get(key_id, now)
                nearest = self.routing_table.nearest(key_id, request.count, exclude=peer_id)
                peers = [[c.peer_id.to_bytes(), list(c.addrs)] for c in nearest]
                budget = MAX_VALUE_RESPONSE_BYTES // len(request.key_ids)
                results.append([encode_entries(stored, budget), peers])
            return {"results": results}
        raise DHTProtocolError(f"unsupported request {type(request).__name__}")
