"""DHTNode: one Kademlia peer (routing table, local storage, RPC server and iterative client).

This module is the node itself: its state, start-up and shutdown, its outgoing RPCs and
lookups, and the public calls. Jobs with their own logic live beside it, each reading the
node's state: joining through the initial peers (``join.py``), answering other peers' RPCs
(``serving.py``), placing and republishing records (``placement.py``), handing records over
on routing changes (``handover.py``), and what a node does about NATs (relay service, relay
reservations, the DHT role that follows reachability: ``roles.py``, one :class:`NatRoles`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia import placement, serving
from dht.kademlia.batching import FindBatcher
from dht.kademlia.clock import get_dht_time
from dht.kademlia.errors import DHTProtocolError, RecordRejectedError
from dht.kademlia.handover import Handover
from dht.kademlia.handover import MaintenanceStats as MaintenanceStats
from dht.kademlia.ids import id_from_bytes, id_to_bytes, node_id_of, random_id, serialize
from dht.kademlia.join import BOOTSTRAP_REFUSED_GRACE as BOOTSTRAP_REFUSED_GRACE
from dht.kademlia.join import BOOTSTRAP_RETRY_FIRST as BOOTSTRAP_RETRY_FIRST
from dht.kademlia.join import BOOTSTRAP_RETRY_MAX as BOOTSTRAP_RETRY_MAX
from dht.kademlia.join import check_address_args as check_address_args
from dht.kademlia.join import reach_initial_peers
from dht.kademlia.merge import merge_records, unique_live_records
from dht.kademlia.network import HostNetwork, PeerUnreachableError, RPCNetwork
from dht.kademlia.placement import Named
from dht.kademlia.protocol import (
    FindResult,
    encode_entries,
    parse_find_response,
    parse_ping_response,
    parse_store_response,
    sender_info,
)
from dht.kademlia.records import DHTRecord, ValueWithExpiration
from dht.kademlia.rejoin import Rejoin
from dht.kademlia.roles import NatRoles, RoleDecision, check_relay_setting, start_autonat
from dht.kademlia.routing import (
    Blacklist,
    BusyPeers,
    Contact,
    KBucket,
    OutageGuard,
    RoutingTable,
)
from dht.kademlia.search import LookupStats as LookupStats
from dht.kademlia.search import SharedLookups
from dht.kademlia.storage import LocalStorage, OwnedRecords, StorageLimits
from dht.kademlia.validation import RecordValidator, default_validators

if TYPE_CHECKING:
    from dht.p2p.autonat import AutoNAT
    from dht.p2p.host import Host
    from dht.p2p.relay import RelayClient, RelayService
    from dht.p2p.relay_messages import Limit

if sys.version_info < (3, 11):  # pragma: no cover - trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

# every IPv4 interface, a free port: peers on other machines can reach us at the interface
# addresses announced for it (pass /ip4/127.0.0.1/tcp/0 to stay local to this machine)
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
SIGNATURES_ON_LOOP = 16  # default: more signed records than this are verified in a worker thread
# Bucket refreshes: at most this many per maintenance pass (the rest wait for the next), and
# this many lookups in flight together, so one slow lookup does not delay the others' refresh.
MAX_REFRESHES_PER_PASS = 16
REFRESH_LOOKUPS_AT_ONCE = 4
# (under MockClock(autojump_threshold=0) a worker thread lets virtual time leap past every
# timeout, so simulations raise max_signatures_on_loop to keep verification on the loop)
StoreItem = tuple[Any, Any, Any, float]  # (key, subkey or None, value, expiration_time)
# the nodes of this process between DHTNode.open's start and end, held weakly: monitoring
# (moshpit.metrics) reads their counters from here when scraped
open_nodes: weakref.WeakSet[DHTNode] = weakref.WeakSet()


def _single_exception(group: BaseExceptionGroup) -> BaseException:
    """Unwrap the nursery groups around one exception, so callers can catch it by type."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


class DHTNode:
    """A Kademlia DHT peer. Create it with :meth:`DHTNode.open` (an async context manager)."""

    def __init__(
        self,
        network: RPCNetwork,
        *,
        identity: Any = None,
        client_mode: bool | None = False,
        num_replicas: int = 5,
        bucket_size: int = 20,
        alpha: int = 3,
        beam_size: int | None = None,
        rpc_timeout: float = 3.0,
        lookup_timeout: float = 30.0,
        refresh_period: float = 600.0,
        cache_on_get: bool = True,
        handover: bool = True,
        handover_delay: float = 0.5,
        republish_interval: float | None = 60.0,
        max_republish_records: int = 10_000,
        max_republish_bytes: int = 16 * 1024 * 1024,
        limits: StorageLimits | None = None,
        validators: Sequence[RecordValidator] = (),
        max_background_tasks: int = 64,
        max_parallel_lookups: int = 32,
        max_signatures_on_loop: int = SIGNATURES_ON_LOOP,
        max_relays: int = 2,
        relay_failover_after: float = 10.0,
        relay_check_interval: float = 5.0,
    ):
        self.network = network
        self.host: Host | None = getattr(network, "host", None)  # None: no dht.p2p Host
        self.peer_id = network.peer_id
        self.node_id = node_id_of(self.peer_id)
        self.identity = identity
        # None: the role follows reachability (see open()); True/False: the caller's choice
        self.client_mode_setting = client_mode
        self.client_mode = bool(client_mode)  # the role now
        self.autonat: AutoNAT | None = None  # when open() started one
        # what the node does about NATs (open() runs it on a real Host; see roles.py)
        self.roles = NatRoles(
            self,
            max_relays=max_relays,
            failover_after=relay_failover_after,
            check_interval=relay_check_interval,
            on_addrs_changed=self._forget_own_addrs,
            on_role=self._take_role,
        )
        self.num_replicas = num_replicas
        self.bucket_size = bucket_size
        self.alpha = alpha
        self.beam_size = beam_size if beam_size is not None else max(num_replicas, alpha)
        self.rpc_timeout = rpc_timeout
        self.lookup_timeout = lookup_timeout
        self.refresh_period = refresh_period
        self.cache_on_get = cache_on_get
        self.handover = handover
        self.handover_delay = handover_delay
        self.republish_interval = placement.check_republish_interval(republish_interval)
        self.owned = OwnedRecords(max_republish_records, max_republish_bytes)
        self.maintenance = MaintenanceStats()
        self.requests_served = {"ping": 0, "store": 0, "find": 0}  # answered; never reset
        self.routing_table = RoutingTable(self.node_id, bucket_size, self._refresh_far_bucket)
        self._handover = Handover(self)
        if handover and not client_mode:
            self.routing_table.on_change = self._handover.on_routing_change
        self.blacklist = Blacklist()
        self.outage, self.busy = OutageGuard(), BusyPeers()  # our link down, or theirs full
        self.rejoin = Rejoin(self)  # the way back once every contact stopped answering
        self.storage = LocalStorage(limits)
        self.validators = default_validators(identity, validators)
        self.max_background_tasks = max_background_tasks
        self._lookups = SharedLookups(self, max_parallel_lookups)
        self.lookup_stats = self._lookups.stats  # hops, rounds and messages of recent lookups
        self._background = 0
        self._pinging: set[Any] = set()
        self._nursery: trio.Nursery | None = None
        self._own_addrs_cache: list[bytes] | None = None
        self._node_ids: dict[bytes, tuple[Any, int]] = {}  # PeerID bytes -> (PeerID, node ID)
        self._cpu_limiter = trio.CapacityLimiter(2)
        self._finds = FindBatcher(self._find_rpc)
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
        client_mode: bool | None = None,
        bootstrap_timeout: float = 10.0,
        autonat: Any = None,
        relay: Any = None,
        public_by_configuration: bool | str = False,
        **kwargs: Any,
    ) -> AsyncIterator[DHTNode]:
        """Start a node, join through any live ``initial_peers``, and stop it on exit.

        (Over 80 lines: the start-up order, address checks, host, network, AutoNAT, roles,
        bootstrap and the shutdown that undoes them, reads top to bottom in one place, each
        step using the one before; the options' documentation below is most of it.)

        Without ``host`` (and without an explicit ``network``) the node opens its own
        ``dht.p2p.Host`` on ``transport`` (TCP by default) with ``identity`` and listens on
        ``host_maddrs`` (default: every IPv4 interface, a free port); client-mode nodes listen
        only if ``host_maddrs`` is given. Address arguments are checked first
        (:func:`check_address_args`). Raises :class:`BootstrapError` if initial peers were
        given and none answered.

        ``autonat``: check whether peers can connect to this one (AutoNAT, see
        ``dht.p2p.autonat``; the answer is ``node.host.reachability``) and answer their
        checks unless in client mode. ``None`` (default): on over TCP, off on other
        transports; ``True`` / ``False``; or an ``AutoNATConfig``.

        **Roles follow reachability** (``client_mode=None``, the default). The node starts
        as a DHT server; once AutoNAT has decided:

        * *public*: it stays a server and serves circuit relay v2 for peers behind NAT
          (``relay``: ``None``/``True`` with the spec's default limits, a ``RelayLimits``,
          or ``False`` for never). Relays are found through identify: the Host lists the
          hop protocol among its protocols as soon as the service runs, and a private peer
          simply asks the peers it holds direct connections to (then its DHT contacts) for
          a reservation; a peer that runs no relay answers ``na`` at once. Nothing has to
          be published or trusted: a relay is a peer we reached and that said yes.
        * *private*: its own listen addresses are no longer announced (nobody outside can
          dial them). It reserves slots on up to ``max_relays`` relays
          (``RelayClient.keep_reservation`` refreshes them; a relay whose slot stays void
          for ``relay_failover_after`` seconds is replaced by another) and announces its
          ``/p2p-circuit`` addresses in everything it publishes. With such a path it
          remains a normal DHT server: other peers dial it through the relay and its DHT,
          matchmaking and state RPCs run over the relayed connection (end-to-end
          encrypted; the relay bounds each connection's bytes and lifetime, so bulk data
          should not flow that way: an averager reachable only through a relay that cannot
          carry its tensors averages as a client, see ``moshpit.Averager``). *Without any
          relay it falls back to client mode* (no records stored for others, not added to
          routing tables) until a relay takes it.

        ``client_mode=True`` / ``False`` overrides this: True never serves nor reserves;
        False stays a server announcing its own addresses whatever AutoNAT says (and adds
        circuit addresses when private). ``announce_maddrs`` are announced in any case
        (the caller knows where the node is reachable: it is never switched to client
        mode). ``node.role`` is the last :class:`RoleDecision`; ``add_role_observer``
        reports each new one. ``relay=True`` (or limits) on a network without AutoNAT
        (e.g. the in-memory one) serves at once; the default never does there.

        ``public_by_configuration``: the caller knows peers can dial this node (True, or
        why, e.g. ``roles.public_by_configuration(host_maddrs, announce_maddrs)``, which
        ``moshpit dht`` passes): it serves relays from the start instead of after AutoNAT's
        verdict (unless ``relay=False`` or ``client_mode=True``), so the volunteers of a
        young swarm find a relay in their first bootstrap node at once.
        """
        initial_peers, host_maddrs, announce_maddrs = check_address_args(
            initial_peers, host_maddrs, announce_maddrs, by_peer_id=network is not None
        )
        relay = check_relay_setting(relay)
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
                node.autonat = start_autonat(node, autonat)
                node.roles.relay_setting = relay
                if public_by_configuration:
                    node.roles.public_by_configuration = (
                        public_by_configuration
                        if isinstance(public_by_configuration, str)
                        else "the caller says so"
                    )
                open_nodes.add(node)
                visible = [] if client_mode else node.get_visible_maddrs()
                if visible:
                    logger.info(
                        "announcing %d address(es): %s", len(visible), " ".join(map(str, visible))
                    )
                async with trio.open_nursery() as nursery:
                    node._nursery = nursery
                    network.set_handler(node._handle_rpc)
                    try:
                        if node.handover and not client_mode:
                            nursery.start_soon(node._handover.run, nursery)
                        await node._bootstrap(initial_peers, bootstrap_timeout)
                        node.rejoin.initial_peers = initial_peers
                        nursery.start_soon(node.rejoin.run)
                        nursery.start_soon(node._maintenance_loop)
                        if node.autonat is not None:
                            nursery.start_soon(node.autonat.run)
                        if node.roles.enabled():
                            nursery.start_soon(node.roles.run)
                        if node.republish_interval is not None:
                            nursery.start_soon(placement.republish_loop, node)
                        yield node
                    finally:
                        open_nodes.discard(node)
                        network.set_handler(None)
                        nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _single_exception(group) from None

    # ------------------------------------------------------------------ roles (roles.py)

    @property
    def role(self) -> RoleDecision | None:
        """The last :class:`RoleDecision` (None: nothing decided yet)."""
        return self.roles.role

    @property
    def relay_service(self) -> RelayService | None:
        """The ``dht.p2p.relay.RelayService`` while this node serves as a relay, else None."""
        return self.roles.relay_service

    @property
    def _relay_client(self) -> RelayClient | None:  # the name tests use
        return self.roles.relay_client

    def _roles_enabled(self) -> bool:  # the name tests use
        return self.roles.enabled()

    def add_role_observer(self, on_change: Any) -> None:
        """Call ``on_change(decision)`` with each new :class:`RoleDecision` (and at once with
        the current one, if any)."""
        self.roles.add_observer(on_change)

    def remove_role_observer(self, on_change: Any) -> None:
        self.roles.remove_observer(on_change)

    @property
    def relay_limit(self) -> Limit | None:
        """How much one inbound connection of another peer may carry, when that connection
        can only come through a relay: the most restrictive ``Limit`` (``.data`` bytes per
        direction, ``.duration`` seconds; 0 = none) among the relays holding a slot for this
        node. None while peers dial this node directly (or it has no slot at all).
        Read-only; averaging uses it to keep such a peer from reducing more than that."""
        return self.roles.relay_limit

    def _forget_own_addrs(self) -> None:
        """What we announce may have changed (a relay slot, the role): recompute it."""
        self._own_addrs_cache = None

    def _take_role(self, decision: RoleDecision) -> None:
        self.client_mode = decision.client_mode
        if not decision.client_mode:
            # tell our neighbourhood where we are now (our requests carry our addresses)
            self._spawn(self.find_nearest_peers, self.node_id, self.bucket_size)

    def get_visible_maddrs(self) -> list[Any]:
        """Multiaddrs (with ``/p2p/<PeerID>``) other peers can pass as ``initial_peers``."""
        visible = getattr(self.network, "visible_maddrs", None)
        return visible() if visible is not None else []

    async def _bootstrap(self, initial_peers: list[Any], time_limit: float) -> None:
        """Join through the initial peers (join.py), then Kademlia's join proper."""
        if not initial_peers:
            return
        joined = await reach_initial_peers(self.network, self.ping, initial_peers, time_limit)
        await self.join_neighbourhood()
        logger.info(
            "joined the DHT through %d initial peer(s); %d contacts",
            len(joined),
            len(self.routing_table),
        )

    async def join_neighbourhood(self) -> None:
        """Kademlia's join, once a peer answered (at start-up, or rejoining: rejoin.py)."""
        # look up our own ID for the k (not beam) nearest peers. Every peer asked learns us
        # (and hands over the records we are now closer to), and we learn our whole
        # neighbourhood; with only beam_size, neighbours ranked 5-10 from a key often never
        # met, so later lookups could stop short of the nearest replicas (issue 3).
        await self.find_nearest_peers(self.node_id, self.bucket_size)
        # ... then refresh every farther bucket (the join's second half), in the background:
        # the self-lookup meets only peers near us, and the buckets it split off were refreshed
        # with what the table knew then (docs/dht.md, "Fix found by this simulation").
        for bucket in [b for b in self.routing_table.buckets if not b.covers(self.node_id)]:
            self._refresh_far_bucket(bucket)

    async def _maintenance_loop(self) -> None:
        """Prune expired records; refresh buckets that saw no traffic for refresh_period.

        Passes run on a fixed beat, and each refreshes the buckets that would go stale before
        the next one: checking only for buckets already stale let one wait a whole extra pass
        (up to 1.5 refresh periods plus the lookups queued before it).
        """
        period = min(self.refresh_period / 2, 60.0)
        next_pass = trio.current_time()
        while True:
            next_pass += period
            await trio.sleep_until(next_pass)
            self.storage.prune(get_dht_time())
            self.owned.prune(get_dht_time())
            due = self.routing_table.stale_buckets(get_dht_time(), self.refresh_period - period)
            limiter = trio.CapacityLimiter(REFRESH_LOOKUPS_AT_ONCE)
            async with trio.open_nursery() as nursery:
                for bucket in due[:MAX_REFRESHES_PER_PASS]:
                    nursery.start_soon(self._refresh_bucket, bucket, limiter)
            next_pass = max(next_pass, trio.current_time())

    async def _refresh_bucket(self, bucket: KBucket, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
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
        oldest = self.routing_table.add_or_update(contact, get_dht_time())
        if oldest is not None and oldest.peer_id not in self._pinging:
            self._pinging.add(oldest.peer_id)
            if not self._spawn(self._check_oldest, oldest):
                self._pinging.discard(oldest.peer_id)

    def _refresh_far_bucket(self, far: KBucket) -> None:
        """Look up a random ID in a bucket not covering our ID unless it is full: at the join
        and whenever a split makes one (docs/dht.md, "Second fix"); ~log2 N lookups in all."""
        if len(far.contacts) < far.size:
            self._spawn(self.find_nearest_peers, random_id(far.lower, far.upper), self.beam_size)

    async def _check_oldest(self, oldest: Contact) -> None:
        try:
            if not await self.ping(oldest.peer_id):
                self.routing_table.remove(oldest.peer_id)
        finally:
            self._pinging.discard(oldest.peer_id)

    # ------------------------------------------------------------------ keeping records alive

    async def republish(self) -> int:
        """Re-store the records this node is the origin of on their current nearest replicas.

        A record is due once it was published at least ``republish_interval / 2`` ago (so a
        fresh ``store`` is not repeated at once) and lives at least another tenth of the
        interval. Each goes out unchanged (same expiration and signature) through the normal
        store path: one lookup per key, one batched ``store`` RPC per replica. Returns how many
        records were sent.
        """
        return await placement.republish(self)

    # ------------------------------------------------------------------ outgoing RPCs

    async def _rpc(
        self, peer_id: Any, request: dict[str, Any], even_if_banned: bool = False
    ) -> Any:
        if not even_if_banned and self.blacklist.is_banned(peer_id, get_dht_time()):
            return None
        try:
            response = await self.network.call(peer_id, request, self.rpc_timeout)
        except PeerUnreachableError as e:
            if not e.answered:
                self._unanswered(peer_id, e)
            else:
                self.reachable()
                logger.debug("%s answered with an error: %s", peer_id, e)
            return None
        self.blacklist.register_success(peer_id)
        self.busy.answered(peer_id)
        self.reachable()
        return response

    def _unanswered(self, peer_id: Any, error: Exception) -> None:
        """An RPC got no answer: ban the peer and drop it, unless our own links look down,
        or its connection kept delivering meanwhile (a busy peer: see BusyPeers)."""
        if self.outage.suspected:
            logger.debug("%s unreachable, not banned (no peer answers us): %s", peer_id, error)
            return
        if self.busy.tolerate(peer_id, getattr(error, "busy", False)):
            logger.debug("%s slow to answer (its connection is busy), kept: %s", peer_id, error)
            return
        delay = self.blacklist.register_failure(peer_id, get_dht_time())
        dropped = self.routing_table.remove(peer_id)
        self.outage.failed(peer_id, dropped)
        self.rejoin.dropped_contact(dropped)
        logger.debug("%s unreachable, banned for %.0fs: %s", peer_id, delay, error)

    def reachable(self) -> None:
        """A peer answered us or asked us something: if every peer had failed us before,
        the outage was ours, and the peers it cost are unbanned and back in the table."""
        back = self.outage.recovered()
        if not back:
            return
        now = get_dht_time()
        for peer_id, contact in back:
            self.blacklist.register_success(peer_id)
            if contact is not None:
                self.routing_table.add_or_update(contact, now)
        logger.info("back from a network outage: %d peers unbanned", len(back))

    async def ping(
        self, peer_id: Any, fallback_addrs: Sequence[bytes] = (), *, even_if_banned: bool = False
    ) -> bool:
        """DHT-level ping; on success the peer (unless in client mode) enters the routing table.
        ``even_if_banned``: ask a peer banned for not answering anyway (rejoin.py)."""
        response = await self._rpc(peer_id, self._request("ping"), even_if_banned)
        if response is None:
            return False
        try:
            info = parse_ping_response(response)
        except DHTProtocolError as e:
            logger.debug("bad ping response from %s: %s", peer_id, e)
            return False
        if not info.client:
            addrs = self.network.usable_addrs(info.addrs, peer_id) or tuple(fallback_addrs)
            self.network.remember_addrs(peer_id, addrs)
            self._seen_alive(Contact(peer_id, node_id_of(peer_id), addrs))
        return True

    async def _find_rpc(
        self, contact: Contact, key_ids: list[int], count: int, values: bool = True
    ) -> list[FindResult[Contact]] | None:
        """``values=False``: the nearest peers only (a store's lookup, a join); the replies
        leave out the stored entries, which for a busy dictionary key (every peer's progress
        record) are most of a reply's bytes. Peers that predate the flag send them anyway."""
        fields: dict[str, Any] = {} if values else {"values": False}
        keys = [id_to_bytes(k) for k in key_ids]
        request = self._request("find", keys=keys, count=count, **fields)
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
            for peer_id, announced in result.peers:
                if peer_id == self.peer_id:
                    continue
                # never keep (nor pass on) another machine's loopback or link-local address
                addrs = self.network.usable_addrs(announced, contact.peer_id)
                if self.network.remember_addrs(peer_id, addrs):
                    # a new way in (e.g. it is behind a relay now): worth another try
                    self.blacklist.register_success(peer_id)
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
        result = await self._lookups.lookup(
            target_id, beam_size=count or self.bucket_size, mode="nearest"
        )
        return result.nearest

    def _peer_from_bytes(self, raw: bytes) -> Any:
        """Parse a PeerID from a find response, caching it with its node ID (bounded)."""
        cached = self._node_ids.get(raw)
        if cached is None:
            if len(self._node_ids) >= 50_000:
                self._node_ids.clear()
            peer_id = self.network.peer_from_bytes(raw)
            cached = self._node_ids[raw] = (peer_id, node_id_of(peer_id))
        return cached[0]

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

    def _store_local(self, record: DHTRecord) -> tuple[bool, str | None]:
        if self.client_mode:
            return False, "client-mode peers do not store records for others"
        reason = self._check_record(record)
        if reason is not None:
            return False, reason
        return self.storage.store(id_from_bytes(record.key), record, get_dht_time())

    async def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        *,
        patience: float | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (or ``key[subkey]``) on the num_replicas nearest peers.

        Returns True if at least one replica accepted it. This node then republishes the record
        every ``republish_interval`` until it expires or a newer one supersedes it. Raises
        :class:`RecordRejectedError` if the record is invalid before it leaves this node (too
        large, expired, unsigned owner key, ...), and TypeError if it is not
        msgpack-serializable.

        ``patience`` (seconds): store on the nearest peers that answered the lookup by then.
        One peer on the way that stalls otherwise holds the store for ``rpc_timeout``, and a
        caller with a shorter deadline of its own cancels it before any replica has it.
        """
        key_id, record = self._make_record(key, subkey, value, expiration_time)
        reason = self._check_record(record)
        if reason is not None:
            raise RecordRejectedError(reason)
        results = await placement.store_records(self, {key_id: [((key, subkey), record)]}, patience)
        return results[(key, subkey)]

    def store_in_background(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = None, *, timeout: float
    ) -> bool:
        """Start :meth:`store` without waiting for it; False if the node cannot take more
        background work right now (or is not running).

        For records whose loss costs little but whose delay would hold the caller up, such
        as a matchmaking declaration withdrawn once its group formed: the caller goes on at
        once. The store gives up after ``timeout`` seconds; its failure is only logged.
        """

        async def store() -> None:
            with trio.move_on_after(timeout):
                try:
                    await self.store(key, value, expiration_time, subkey=subkey)
                except (RecordRejectedError, TypeError) as e:
                    logger.warning("background store of %r/%r failed: %s", key, subkey, e)

        return self._spawn(store)

    async def store_many(self, items: Iterable[StoreItem]) -> dict[tuple[Any, Any], bool]:
        """Store many ``(key, subkey, value, expiration_time)`` items with batched RPCs.

        Returns ``{(key, subkey): accepted_by_any_replica}``. Invalid items are not sent;
        they map to False and the reason is logged. Stored items are republished like
        :meth:`store`'s.
        """
        outcome: dict[tuple[Any, Any], bool] = {}
        by_key: dict[int, list[Named]] = {}
        for key, subkey, value, expiration_time in items:
            key_id, record = self._make_record(key, subkey, value, expiration_time)
            reason = self._check_record(record)
            outcome[(key, subkey)] = False
            if reason is not None:
                logger.warning("not storing %r/%r: %s", key, subkey, reason)
                continue
            by_key.setdefault(key_id, []).append(((key, subkey), record))
        outcome.update(await placement.store_records(self, by_key))
        return outcome

    # ------------------------------------------------------------------ get

    async def get(
        self, key: Any, latest: bool = False, *, patience: float | None = None
    ) -> ValueWithExpiration[Any] | None:
        """Find the value of ``key``; None if no live record exists.

        ``latest=False`` returns as soon as any valid plain value is found; ``latest=True``
        asks every replica in the beam and returns the newest. Dictionary values are always
        merged across all replicas found (each subkey's newest record wins).

        ``patience`` (seconds): merge what the replicas answered by then instead of waiting
        for every one. One replica that stalls (no answer, no refusal) otherwise holds the
        read for ``rpc_timeout``; a caller with a deadline of its own would get nothing.
        """
        key_bytes = serialize(key)
        key_id = id_from_bytes(key_bytes)
        stored = None if self.client_mode else self.storage.get(key_id, get_dht_time())
        if not latest and isinstance(stored, DHTRecord):  # a replica ourselves: no lookup needed
            value, _ = merge_records([stored])
            if value is not None:
                return value
        mode = "all-values" if latest else "first-value"
        result = await self._lookups.lookup(
            key_id, beam_size=self.beam_size, mode=mode, patience=patience
        )
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
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        keys = list(keys)
        results: dict[Any, ValueWithExpiration[Any] | None] = {}

        async def one(key: Any) -> None:
            results[key] = await self.get(key, latest=latest)

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(one, key)
        return results

    async def _merge(
        self, key_bytes: bytes, entry_lists: list[list[Any]]
    ) -> tuple[ValueWithExpiration[Any] | None, Any]:
        """Validate (untrusted replicas!) and merge what several replicas returned."""
        limit = self.storage.limits.max_record_bytes
        candidates = unique_live_records(key_bytes, entry_lists, get_dht_time(), limit)
        reasons = await self._validate_many(candidates)
        return merge_records(
            r for r, reason in zip(candidates, reasons, strict=True) if reason is None
        )

    # ------------------------------------------------------------------ incoming RPCs

    async def _handle_rpc(self, peer_id: Any, raw_request: Any) -> dict[str, Any]:
        """Serve one DHT RPC (serving.py). Malformed requests raise DHTProtocolError."""
        return await serving.handle_rpc(self, peer_id, raw_request)
