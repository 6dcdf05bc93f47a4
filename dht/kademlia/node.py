"""DHTNode: one Kademlia peer (routing table, local storage, RPC server and iterative client).

What a node does about NATs (relay service, relay reservations, the DHT role that follows
reachability) lives in ``roles.py``; the node owns one :class:`NatRoles` and delegates to it.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import sys
import time
import weakref
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
from dht.kademlia.roles import NatRoles, RoleDecision, check_relay_setting, start_autonat
from dht.kademlia.routing import Blacklist, Contact, KBucket, RoutingTable
from dht.kademlia.storage import LocalStorage, OwnedRecords, StorageLimits
from dht.kademlia.traverse import Lookup, LookupResult
from dht.kademlia.validation import RecordValidator, default_validators

if sys.version_info < (3, 11):  # pragma: no cover - trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger(__name__)

# every IPv4 interface, a free port: peers on other machines can reach us at the interface
# addresses announced for it (pass /ip4/127.0.0.1/tcp/0 to stay local to this machine)
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
# A joiner retries its initial peers until bootstrap_timeout: a peer still starting, a reset
# under load or a bootstrap node busy with a connection flood is worth another try.
BOOTSTRAP_RETRY_FIRST = 0.25  # seconds before the second attempt, doubling up to the next
BOOTSTRAP_RETRY_MAX = 2.0
# ... but when every initial peer refuses the connection (its host says nothing listens on that
# port: a mistyped port, or a peer that is not running), only this long: enough for a peer that
# is binding its port right now, not the 30 s a volunteer would otherwise wait for a typo
BOOTSTRAP_REFUSED_GRACE = 5.0
SIGNATURES_ON_LOOP = 16  # default: more signed records than this are verified in a worker thread
StoreItem = tuple[Any, Any, Any, float]  # (key, subkey or None, value, expiration_time)
Named = tuple[Any, DHTRecord]  # (caller's name for a record, the record)
REPUBLISH_KEYS_PER_BATCH = 256  # keys looked up together in one republish batch
HANDOVER_MAX_PENDING = 4096  # routing changes remembered between hand-over passes
HANDOVER_PARALLEL_RPCS = 8
# the nodes of this process between DHTNode.open's start and end, held weakly: monitoring
# (moshpit.metrics) reads their counters from here when scraped
open_nodes: weakref.WeakSet[DHTNode] = weakref.WeakSet()


@dataclass(frozen=True)
class LookupStats:
    hops: int
    rounds: int
    messages: int


@dataclass
class MaintenanceStats:
    """Counters of the background work that keeps records alive (read by tests/benchmarks)."""

    republish_passes: int = 0
    republished_records: int = 0
    superseded_records: int = 0  # dropped from the republish set: a newer record won
    handover_passes: int = 0
    handover_rpcs: int = 0
    handover_records: int = 0


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
        self.lookup: Lookup | None = None  # set once it runs: impatient callers read it early


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
        self.host = getattr(network, "host", None)
        self.peer_id = network.peer_id
        self.node_id = node_id_of(self.peer_id)
        self.identity = identity
        # None: the role follows reachability (see open()); True/False: the caller's choice
        self.client_mode_setting = client_mode
        self.client_mode = bool(client_mode)  # the role now
        self.autonat: Any = None  # dht.p2p.autonat.AutoNAT when open() started one
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
        if republish_interval is not None and not republish_interval > 0:
            raise ValueError(
                f"republish_interval must be positive seconds or None, not {republish_interval!r}"
            )
        self.republish_interval = republish_interval
        self.owned = OwnedRecords(max_republish_records, max_republish_bytes)
        self.maintenance = MaintenanceStats()
        # RPCs this node answered, by type (monitoring reads it; never reset)
        self.requests_served = {"ping": 0, "store": 0, "find": 0}
        self.routing_table = RoutingTable(self.node_id, bucket_size, self._refresh_far_bucket)
        # peer -> (was it a contact before the first change since the last hand-over pass)
        self._routing_changes: dict[Any, tuple[bool, Contact]] = {}
        self._routing_changed = trio.Event()
        if handover and not client_mode:
            self.routing_table.on_change = self._on_routing_change
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
                            nursery.start_soon(node._handover_loop)
                        await node._bootstrap(initial_peers, bootstrap_timeout)
                        nursery.start_soon(node._maintenance_loop)
                        if node.autonat is not None:
                            nursery.start_soon(node.autonat.run)
                        if node.roles.enabled():
                            nursery.start_soon(node.roles.run)
                        if node.republish_interval is not None:
                            nursery.start_soon(node._republish_loop)
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
    def relay_service(self) -> Any:
        """The ``dht.p2p.relay.RelayService`` while this node serves as a relay, else None."""
        return self.roles.relay_service

    @property
    def _relay_client(self) -> Any:  # the name tests use
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
    def relay_limit(self) -> Any:
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
        if not initial_peers:
            return
        joined: list[Any] = []
        errors: dict[str, str] = {}  # the last failure of each initial peer
        refused: set[str] = set()  # initial peers whose last attempt was refused
        own = f"/p2p/{self.peer_id}"
        pending = [a for a in initial_peers if a != self.peer_id and not str(a).endswith(own)]
        deadline = trio.current_time() + time_limit
        refused_since: float | None = None  # since when every initial peer refuses

        async def try_peer(address: Any) -> None:
            refused.discard(str(address))
            try:
                peer_id, addrs = await self.network.connect(
                    address, max(0.0, deadline - trio.current_time())
                )
            except PeerUnreachableError as e:
                errors[str(address)] = str(e)
                if e.refused:
                    refused.add(str(address))
                return
            if peer_id == self.peer_id:
                pending.remove(address)  # ourselves: nothing to retry
                return
            if await self.ping(peer_id, fallback_addrs=addrs):
                joined.append(peer_id)
            else:
                errors[str(address)] = f"{address} did not answer a DHT ping"

        delay = BOOTSTRAP_RETRY_FIRST
        for attempt in range(1, sys.maxsize):
            async with trio.open_nursery() as nursery:
                for address in list(pending):
                    nursery.start_soon(try_peer, address)
            remaining = deadline - trio.current_time()
            if joined or not pending or remaining < 2 * BOOTSTRAP_RETRY_FIRST:
                break
            if len(refused) < len(pending):
                refused_since = None
            elif refused_since is None:
                refused_since = trio.current_time()
                logger.info(
                    "every initial peer refused the connection (%s): nothing listens there; "
                    "retrying for %gs in case it is starting",
                    ", ".join(sorted(refused)[:3]),
                    BOOTSTRAP_REFUSED_GRACE,
                )
            elif trio.current_time() - refused_since >= BOOTSTRAP_REFUSED_GRACE:
                raise BootstrapError(
                    f"could not join the DHT: nothing listens at {', '.join(sorted(refused)[:3])} "
                    f"(every initial peer refused the connection for {BOOTSTRAP_REFUSED_GRACE:g}s)"
                    ". Check the port in the address, and that the peer is running"
                )
            # jitter, so that joiners do not retry in step; the last try keeps some time
            wait = min(delay * random.uniform(0.75, 1.25), remaining - BOOTSTRAP_RETRY_FIRST)
            logger.info(
                "no initial peer answered yet (attempt %d: %s); retrying in %.1fs",
                attempt,
                next(iter(errors.values()), "no answer"),
                wait,
            )
            await trio.sleep(wait)
            delay = min(2 * delay, BOOTSTRAP_RETRY_MAX)
        if not joined:
            reasons = "; ".join(list(errors.values())[:3]) or "they are this node itself"
            raise BootstrapError(
                f"could not join the DHT: none of the {len(initial_peers)} initial peers answered "
                f"within {time_limit:g}s ({reasons}); check the addresses "
                "and that at least one of those peers is running"
            )
        # Kademlia's join: look up our own ID for the k (not beam) nearest peers. Every peer
        # asked learns us (and hands over the records we are now closer to), and we learn our
        # whole neighbourhood; with only beam_size, neighbours ranked 5-10 from a key often
        # never met, so later lookups could stop short of the nearest replicas (issue 3).
        await self.find_nearest_peers(self.node_id, self.bucket_size)
        # ... then refresh every farther bucket (the join's second half), in the background:
        # the self-lookup meets only peers near us, and the buckets it split off were refreshed
        # with what the table knew then (docs/dht.md, "Fix found by this simulation").
        for bucket in [b for b in self.routing_table.buckets if not b.covers(self.node_id)]:
            self._refresh_far_bucket(bucket)
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
            self.owned.prune(get_dht_time())
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

    def _on_routing_change(self, added: Contact | None, removed: Contact | None) -> None:
        """Remember which contacts came or went; the hand-over pass compares before and after."""
        contact = added if added is not None else removed
        assert contact is not None
        if contact.peer_id not in self._routing_changes:
            if len(self._routing_changes) >= HANDOVER_MAX_PENDING:
                logger.debug("hand-over backlog full; not tracking %s", contact.peer_id)
                return
            self._routing_changes[contact.peer_id] = (removed is not None, contact)
        self._routing_changed.set()

    async def _handover_loop(self) -> None:
        """Batch routing changes for ``handover_delay`` seconds, then hand records over.

        A pass over a large store costs CPU (a few microseconds per key and change), so the
        next batch waits at least ten times as long as the last pass took: at most ~10 % of
        a core goes to hand-over however fast the routing table changes.
        """
        cost = 0.0
        while True:
            await self._routing_changed.wait()
            await trio.sleep(max(self.handover_delay, 10 * cost))
            self._routing_changed = trio.Event()
            changes, self._routing_changes = self._routing_changes, {}
            if len(self.storage):
                started = time.perf_counter()
                plan = await self._handover_plan(changes)
                cost = time.perf_counter() - started
                if plan:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._handover_send, plan)

    async def _handover_plan(
        self, changes: dict[Any, tuple[bool, Contact]]
    ) -> dict[Any, list[DHTRecord]]:
        """Which stored records go to which peers: to each peer that routing changes made one
        of a key's ``num_replicas`` nearest (as far as this node knows), i.e. newly met peers
        closer than the furthest known replica, and the next peer in line when one left.

        For every key the old and new replica sets are computed over the same pool (the
        contacts plus this node, with departed contacts added back for the old set); keys
        whose nearest ``num_replicas`` members are all closer than every changed peer are
        skipped after two bisections, so a pass costs O(keys x changes) plus the few keys
        near a change."""
        table = {c.peer_id: c for c in self.routing_table}
        changed: dict[int, tuple[bool, Contact]] = {}  # node ID -> (joined the pool, contact)
        for peer_id, (was_in, contact) in changes.items():
            now_in = peer_id in table
            if was_in != now_in:
                changed[contact.node_id] = (now_in, contact)
        if not changed:
            return {}
        members: dict[int, Contact | None] = {c.node_id: c for c in table.values()}
        for node_id, (joined, contact) in changed.items():
            if not joined:
                members[node_id] = contact
        members[self.node_id] = None
        ids = sorted(members)
        joined_ids = {i for i, (joined, _) in changed.items() if joined}
        left_ids = {i for i, (joined, _) in changed.items() if not joined}
        replicas, needed = self.num_replicas, self.num_replicas + len(changed)

        def window(key_id: int, bits: int) -> tuple[int, int]:
            lower = (key_id >> bits) << bits
            return bisect.bisect_left(ids, lower), bisect.bisect_left(ids, lower + (1 << bits))

        now = get_dht_time()
        plan: dict[Any, list[DHTRecord]] = {}
        for count, key_id in enumerate(self.storage.key_ids()):
            if count % 256 == 255:
                await trio.lowlevel.checkpoint()
            bits = min((i ^ key_id).bit_length() for i in changed)
            # members at XOR distance < 2**(bits-1) are closer than every changed peer
            start, stop = window(key_id, max(bits - 1, 0))
            if bits > 0 and stop - start >= replicas:
                continue
            while stop - start < needed and bits < 256:
                bits += 1
                start, stop = window(key_id, bits)
            nearest = sorted(ids[start:stop], key=lambda i: i ^ key_id)
            before = [i for i in nearest if i not in joined_ids][:replicas]
            after = [i for i in nearest if i not in left_ids][:replicas]
            targets = set(after) - set(before) - {self.node_id}
            if not targets:
                continue
            stored = self.storage.get(key_id, now)
            records = [stored] if isinstance(stored, DHTRecord) else list((stored or {}).values())
            for target in targets:
                contact = members[target]
                assert contact is not None
                plan.setdefault(contact.peer_id, []).extend(records)
        return plan

    async def _handover_send(self, plan: dict[Any, list[DHTRecord]]) -> None:
        """One batched store RPC per peer (at most 4 x MAX_RECORDS_PER_STORE records each)."""
        self.maintenance.handover_passes += 1
        limiter = trio.CapacityLimiter(HANDOVER_PARALLEL_RPCS)

        async def send(peer_id: Any, records: list[DHTRecord]) -> None:
            async with limiter:
                for start in range(
                    0, min(len(records), 4 * MAX_RECORDS_PER_STORE), MAX_RECORDS_PER_STORE
                ):
                    chunk = records[start : start + MAX_RECORDS_PER_STORE]
                    self.maintenance.handover_rpcs += 1
                    self.maintenance.handover_records += len(chunk)
                    await self._store_rpc(peer_id, chunk)

        async with trio.open_nursery() as nursery:
            for peer_id, records in plan.items():
                nursery.start_soon(send, peer_id, records)

    async def _republish_loop(self) -> None:
        """Every ``republish_interval`` (+-10 % jitter, so peers do not act in lockstep)."""
        assert self.republish_interval is not None
        while True:
            await trio.sleep(self.republish_interval * random.uniform(0.9, 1.1))
            await self.republish()

    async def republish(self) -> int:
        """Re-store the records this node is the origin of on their current nearest replicas.

        A record is due once it was published at least ``republish_interval / 2`` ago (so a
        fresh ``store`` is not repeated at once) and lives at least another tenth of the
        interval. Each goes out unchanged (same expiration and signature) through the normal
        store path: one lookup per key, one batched ``store`` RPC per replica. Returns how many
        records were sent.
        """
        interval = self.republish_interval or 60.0
        due = self.owned.due(get_dht_time(), interval / 2, interval / 10)
        if not due:
            return 0
        self.maintenance.republish_passes += 1
        self.maintenance.republished_records += len(due)
        by_key: dict[int, list[Named]] = {}
        for key_id, record in due:
            by_key.setdefault(key_id, []).append(((key_id, record.subkey), record))
        keys = list(by_key)
        for start in range(0, len(keys), REPUBLISH_KEYS_PER_BATCH):
            batch = {k: by_key[k] for k in keys[start : start + REPUBLISH_KEYS_PER_BATCH]}
            tally = await self._place_records(batch)
            self._forget_superseded(batch, tally)
        return len(due)

    def _forget_superseded(
        self, by_key: dict[int, list[Named]], tally: dict[Any, list[int]]
    ) -> None:
        """Stop republishing records most answering replicas call outdated: a newer record
        for the same key/subkey exists (written by us or anyone else)."""
        for key_id, entries in by_key.items():
            for name, record in entries:
                accepted, outdated = tally[name]
                if outdated > accepted and self.owned.discard(key_id, record):
                    self.maintenance.superseded_records += 1
                    logger.debug("no longer republishing %r: superseded", name)

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
            addrs = self.network.usable_addrs(info.addrs, peer_id) or tuple(fallback_addrs)
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
        result = await self._lookup(target_id, beam_size=count or self.bucket_size, mode="nearest")
        return result.nearest

    async def _lookup(
        self, target_id: int, beam_size: int, mode: str, patience: float | None = None
    ) -> LookupResult:
        """Run (or join) the lookup of ``target_id``; concurrent identical lookups share one.

        ``patience``: return the responses so far after this many seconds; the lookup itself
        goes on for the callers that wait for all of it.
        """
        tag = (target_id, f"{mode}:{beam_size}")
        search = self._searches.get(tag)
        if search is None:
            search = self._searches[tag] = _SharedSearch()
            assert self._nursery is not None, "the node is not running"
            self._nursery.start_soon(self._run_search, tag, search, target_id, beam_size, mode)
        with trio.move_on_after(math.inf if patience is None else patience):
            await search.done.wait()
        if search.result is not None:
            return search.result
        if search.lookup is None:  # not started yet: nobody answered
            return LookupResult(nearest=[])
        return search.lookup.snapshot()

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
        search.lookup = lookup
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
            elif self.storage.holds(id_from_bytes(record.key), record):
                results[i] = (True, None)  # republished/handed-over copy: verified when stored
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
        results = await self._store_records({key_id: [((key, subkey), record)]}, patience)
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
        outcome.update(await self._store_records(by_key))
        return outcome

    async def _store_records(
        self, by_key: dict[int, list[Named]], patience: float | None = None
    ) -> dict[Any, bool]:
        """Store records written by this node (their origin) and remember them to republish."""
        if self.republish_interval is not None:
            now = get_dht_time()
            for key_id, entries in by_key.items():
                for _, record in entries:
                    self.owned.add(key_id, record, now)
        tally = await self._place_records(by_key, patience)
        if self.republish_interval is not None:
            self._forget_superseded(by_key, tally)
        return {name: counts[0] > 0 for name, counts in tally.items()}

    async def _place_records(
        self, by_key: dict[int, list[Named]], patience: float | None = None
    ) -> dict[Any, list[int]]:
        """Place valid records on their replicas: one lookup per key, one batched RPC per peer.

        Returns ``{name: [replicas that accepted, replicas that called it outdated]}``.
        """
        tally = {name: [0, 0] for entries in by_key.values() for name, _ in entries}
        plan: dict[Any, list[Named]] = {}
        local: list[Named] = []

        def count(name: Any, accepted: bool, reason: str | None) -> None:
            if accepted:
                tally[name][0] += 1
            elif reason is not None and reason.startswith("outdated"):
                tally[name][1] += 1

        async def place(key_id: int, entries: list[Named]) -> None:
            result = await self._lookup(
                key_id, beam_size=self.beam_size, mode="nearest", patience=patience
            )
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
            count(name, accepted, reason)
            if not accepted:
                logger.debug("local replica refused %r: %s", name, reason)

        async def send(peer_id: Any, entries: list[Named]) -> None:
            for start in range(0, len(entries), MAX_RECORDS_PER_STORE):
                chunk = entries[start : start + MAX_RECORDS_PER_STORE]
                results = await self._store_rpc(peer_id, [record for _, record in chunk])
                for (name, _), (accepted, reason) in zip(chunk, results, strict=True):
                    count(name, accepted, reason)
                    if not accepted and reason != "peer unreachable":
                        logger.debug("%s refused %r: %s", peer_id, name, reason)

        async with trio.open_nursery() as nursery:
            for peer_id, entries in plan.items():
                nursery.start_soon(send, peer_id, entries)
        return tally

    # ------------------------------------------------------------------ get

    async def get(
        self, key: Any, latest: bool = False, *, patience: float | None = None
    ) -> ValueWithExpiration | None:
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
        result = await self._lookup(key_id, beam_size=self.beam_size, mode=mode, patience=patience)
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
        sender_addrs = request.sender.addrs
        if not request.sender.client and sender_addrs and peer_id != self.peer_id:
            sender_addrs = self.network.usable_addrs(sender_addrs, peer_id)
        if not request.sender.client and sender_addrs and peer_id != self.peer_id:
            if self.network.remember_addrs(peer_id, sender_addrs):
                self.blacklist.register_success(peer_id)  # alive, and reachable anew
            self._seen_alive(Contact(peer_id, node_id_of(peer_id), sender_addrs))
        if isinstance(request, PingRequest):
            self.requests_served["ping"] += 1
            return {"from": sender_info(self._own_addrs(), self.client_mode)}
        if isinstance(request, StoreRequest):
            self.requests_served["store"] += 1
            return {
                "results": [
                    list(result) for result in await self._store_incoming(request.records, peer_id)
                ]
            }
        if isinstance(request, FindRequest):
            self.requests_served["find"] += 1
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
