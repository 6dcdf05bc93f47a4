"""``DHT``: a synchronous facade over :class:`DHTNode` for plain (non-async) Python code.

One daemon thread runs ``trio.run``; the node, its host and every service started through
:meth:`DHT.start_service` live on that loop. Synchronous methods submit coroutines to it with
the loop's trio token and wait on a ``concurrent.futures.Future``; ``return_future=True`` gives
the future back instead of waiting. ``shutdown()`` (also on ``with`` exit and at interpreter
exit) cancels the loop and joins the thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from dht.kademlia.join import check_address_args
from dht.kademlia.node import DHTNode, StoreItem
from dht.kademlia.records import ValueWithExpiration

logger = logging.getLogger(__name__)

_live_instances: weakref.WeakSet[DHT] = weakref.WeakSet()

# Entered around every hand-off of work to the loop (trio's ``run_sync_soon``), which holds a
# lock that the loop and every other thread handing work over need. A program whose signal
# handlers wait for other threads installs a section here during which they only defer their
# work: run inside the lock, such a handler waits for a thread that waits for the lock.
# ``moshpit.critical`` installs its ``critical_section``.
handoff_section: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext


def _hand_off(token: trio.lowlevel.TrioToken, fn: Callable[[], object]) -> None:
    """``token.run_sync_soon(fn)`` inside :data:`handoff_section`."""
    with handoff_section():
        token.run_sync_soon(fn)


@atexit.register
def _shutdown_all() -> None:
    for instance in list(_live_instances):
        instance.shutdown()


class DHT:
    """A DHT peer usable from synchronous code (see module docstring).

    ``identity_path`` keeps the PeerID across restarts (created if missing); the file is locked
    while this DHT runs, so a second live user of it gets ``IdentityInUseError``. Extra keyword
    arguments go to :meth:`DHTNode.open` (``num_replicas``, ``limits``, ``validators``, ...).
    Without ``host_maddrs`` it listens on every IPv4 interface; a malformed address raises
    ``MultiaddrError`` (a single string instead of a list, ``TypeError``) before starting.

    ``client_mode=None`` (default): the role follows reachability (a peer behind NAT is
    reached through a relay, or becomes a client; a public one relays for others; see
    :meth:`DHTNode.open`); True / False override it. ``relay=`` (True, False or a
    ``RelayLimits``) goes to :meth:`DHTNode.open` like the other keyword arguments.
    """

    def __init__(
        self,
        initial_peers: Iterable[Any] = (),
        host_maddrs: Sequence[Any] | None = None,
        announce_maddrs: Sequence[Any] | None = None,
        identity_path: str | None = None,
        client_mode: bool | None = None,
        start: bool = True,
        startup_timeout: float = 60.0,
        **node_kwargs: Any,
    ):
        # malformed addresses fail here, in the caller's thread, as one specific error
        self.initial_peers, self.host_maddrs, self.announce_maddrs = check_address_args(
            initial_peers,
            host_maddrs,
            announce_maddrs,
            by_peer_id=node_kwargs.get("network") is not None,
        )
        self.identity_path = identity_path
        self.client_mode = client_mode
        self.startup_timeout = startup_timeout
        self.node_kwargs = node_kwargs
        self._node: DHTNode | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._services: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._pending: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        if start:
            self.run_in_background()

    # ------------------------------------------------------------------ lifecycle

    def run_in_background(self, await_ready: bool = True) -> None:
        """Start the DHT thread; with ``await_ready`` block until the node joined (or failed)."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("this DHT was already started")
            self._thread = threading.Thread(
                target=self._thread_main, name="moshpit-dht", daemon=True
            )
            self._thread.start()
            _live_instances.add(self)
        if await_ready:
            self.wait_until_ready()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(self.startup_timeout if timeout is None else timeout):
            self.shutdown()
            raise TimeoutError(f"the DHT did not start within {self.startup_timeout}s")
        if self._startup_error is not None:
            self.shutdown()
            raise self._startup_error

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            if not self._ready.is_set():
                self._startup_error = e
            else:
                logger.exception("the DHT loop crashed")
        finally:
            self._ready.set()

    def _identity(self) -> contextlib.AbstractContextManager[Any]:
        """The key at ``identity_path``, locked while the node runs (one key file, one peer)."""
        if self.identity_path is None:
            return contextlib.nullcontext(None)
        from dht.p2p import Identity

        return Identity.locked(self.identity_path)

    async def _main(self) -> None:
        # IdentityInUseError and other key-file errors surface as they are, before any nursery
        with self._identity() as identity:
            self._stop = trio.Event()
            async with DHTNode.open(
                initial_peers=self.initial_peers,
                host_maddrs=self.host_maddrs,
                announce_maddrs=self.announce_maddrs,
                identity=identity,
                client_mode=self.client_mode,
                **self.node_kwargs,
            ) as node:
                async with trio.open_nursery() as services:
                    with self._lock:  # shutdown() may have been called while we were starting
                        self._node, self._services = node, services
                        self._token = trio.lowlevel.current_trio_token()
                        if self._stopped:
                            self._stop.set()
                    self._ready.set()
                    await self._stop.wait()
                    services.cancel_scope.cancel()

    def shutdown(self) -> None:
        """Stop every service and the node, then join the thread. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            token, stop = self._token, self._stop
        _live_instances.discard(self)
        if token is not None and stop is not None:
            try:
                _hand_off(token, stop.set)
            except trio.RunFinishedError:
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            for future in list(self._pending):  # work that never got to run on the loop
                if not future.done():
                    future.set_exception(RuntimeError("the DHT shut down before this call ran"))

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # ------------------------------------------------------------------ running work on the loop

    def _require_running(self) -> tuple[trio.lowlevel.TrioToken, trio.Nursery]:
        if self._token is None or self._services is None or not self.is_alive:
            raise RuntimeError("the DHT is not running (not started, or shut down)")
        return self._token, self._services

    def _submit(
        self, async_fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``await async_fn(*args)`` as a task in the services nursery; a future for its result."""
        token, services = self._require_running()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pending.add(future)

        async def runner() -> None:
            if future.cancelled():
                return
            with trio.CancelScope() as scope:
                future.add_done_callback(
                    lambda f: _cancel_from_anywhere(token, scope) if f.cancelled() else None
                )
                try:
                    result = await async_fn(*args)
                except BaseException as e:
                    if not future.done():
                        if isinstance(e, trio.Cancelled):
                            future.cancel()
                        else:
                            future.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    return
                if not future.done():
                    future.set_result(result)
            if scope.cancelled_caught and not future.done():
                future.cancel()

        def spawn() -> None:  # runs on the trio thread; must never raise there
            try:
                services.start_soon(runner)
            except RuntimeError as e:  # the services nursery already closed (shutdown race)
                if not future.done():
                    future.set_exception(RuntimeError(f"the DHT is shutting down: {e}"))

        try:
            _hand_off(token, spawn)
        except trio.RunFinishedError as e:
            raise RuntimeError("the DHT is shutting down") from e
        return future

    def run_coroutine(
        self, async_fn: Callable[[DHT, DHTNode], Awaitable[Any]], return_future: bool = False
    ) -> Any:
        """Run ``await async_fn(self, node)`` on the DHT's loop (for custom async work)."""
        future = self._submit(async_fn, self, self._node)
        return future if return_future else future.result()

    def start_service(
        self, async_fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``await async_fn(*args)`` as a long-lived task on the DHT's loop.

        The returned future resolves with its result or exception; it is cancelled if the
        task is cancelled (at :meth:`shutdown`), and cancelling the future cancels the task.
        """
        return self._submit(async_fn, *args)

    # ------------------------------------------------------------------ DHT operations

    @property
    def node(self) -> DHTNode:
        if self._node is None:
            raise RuntimeError("the DHT is not running")
        return self._node

    @property
    def peer_id(self) -> Any:
        return self.node.peer_id

    @property
    def reachability(self) -> Any:
        """Can other peers connect to this one? A ``dht.p2p.autonat.Reachability``:
        ``.status`` (``public`` / ``private`` / ``unknown``) and ``.reason`` (one line).
        Checked with AutoNAT a few seconds after start and then periodically (TCP only)."""
        host = self.node.host
        if host is None or not hasattr(host, "reachability"):
            from dht.p2p.autonat import Reachability

            return Reachability(reason="this DHT runs on a network without AutoNAT")
        return host.reachability

    @property
    def role(self) -> Any:
        """The node's last ``RoleDecision`` (None until AutoNAT decided): its
        ``.describe()`` is one line saying what was decided, why, and what the node does."""
        return self.node.role

    def add_role_observer(self, on_change: Callable[[Any], None]) -> None:
        """Call ``on_change(decision)`` (on the DHT's thread) with each new ``RoleDecision``,
        and at once with the current one if there is one."""

        async def register(_dht: DHT, node: DHTNode) -> None:
            node.add_role_observer(on_change)

        self.run_coroutine(register)

    def get_visible_maddrs(self) -> list[Any]:
        """Full multiaddrs (``.../p2p/<PeerID>``) other peers can use as initial peers."""
        return self.node.get_visible_maddrs()

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
    ) -> bool | concurrent.futures.Future[Any]:
        future = self._submit(self.node.store, key, value, expiration_time, subkey)
        return future if return_future else future.result()

    def store_many(self, items: Iterable[StoreItem], return_future: bool = False) -> Any:
        future = self._submit(self.node.store_many, list(items))
        return future if return_future else future.result()

    def get(
        self, key: Any, latest: bool = False, return_future: bool = False
    ) -> ValueWithExpiration[Any] | None | concurrent.futures.Future[Any]:
        future = self._submit(self.node.get, key, latest)
        return future if return_future else future.result()

    def get_many(
        self, keys: Iterable[Any], latest: bool = False, return_future: bool = False
    ) -> Any:
        future = self._submit(self.node.get_many, list(keys), latest)
        return future if return_future else future.result()


def _cancel_from_anywhere(token: trio.lowlevel.TrioToken, scope: trio.CancelScope) -> None:
    try:
        _hand_off(token, scope.cancel)
    except trio.RunFinishedError:
        pass
