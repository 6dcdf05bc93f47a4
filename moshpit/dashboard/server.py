"""Running the dashboard: a DHT client that reads the run every few seconds, and hypercorn
serving :class:`~moshpit.dashboard.app.DashboardApp`, both in one trio loop.

hypercorn is imported only here, and only when a dashboard starts (:func:`require_hypercorn`
says how to install it when it is missing). Nothing here imports torch.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover - trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

from moshpit.dashboard.app import DashboardApp, is_loopback
from moshpit.dashboard.history import DEFAULT_HISTORY, RunHistory

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode

__all__ = [
    "INSTALL_HINT",
    "DashboardThread",
    "MissingDashboardDependency",
    "bind_socket",
    "poll_run",
    "require_hypercorn",
    "run_dashboard",
    "single_exception",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'moshpit-train[dashboard]'"
DEFAULT_INTERVAL = 2.0


class MissingDashboardDependency(RuntimeError):
    """hypercorn (the ``dashboard`` extra) is not installed."""


def require_hypercorn() -> Any:
    """``hypercorn.trio.serve``; raises :class:`MissingDashboardDependency` without it."""
    try:
        from hypercorn.trio import serve
    except ImportError as e:
        raise MissingDashboardDependency(
            f"the dashboard needs hypercorn, which is not installed ({INSTALL_HINT})"
        ) from e
    return serve


def single_exception(error: BaseException) -> BaseException:
    """The one exception inside nested nursery groups (so callers can catch it by type)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def bind_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``addr:port`` (not listening yet). Raises ``OSError`` with a
    one-line message when the address is unknown or the port taken."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {addr!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {addr} port {port}: {e.strerror}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


async def poll_run(
    node: DHTNode, history: RunHistory, *, interval: float, read_timeout: float | None = None
) -> None:
    """Read the run into ``history`` every ``interval`` s, forever. A read that fails or takes
    longer than ``read_timeout`` (default: 5 intervals, at least 10 s) is noted in the history (the
    page shows it) and retried at the next interval."""
    from dht.kademlia.clock import get_dht_time
    from moshpit.training.run_records import read_run

    timeout = read_timeout if read_timeout is not None else max(10.0, 5 * interval)
    while True:
        began = trio.current_time()
        with trio.move_on_after(timeout) as scope:
            try:
                history.update(await read_run(node, history.prefix))
            except Exception as e:  # noqa: BLE001 - the loop outlives network trouble
                logger.info("dashboard: reading the run failed: %r", e)
                history.note_error(get_dht_time(), f"reading the DHT failed: {e}")
        if scope.cancelled_caught:
            history.note_error(get_dht_time(), f"no answer from the DHT within {timeout:.0f}s")
        await trio.sleep_until(began + interval)


async def serve_http(
    app: DashboardApp, sock: socket.socket, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` with hypercorn on ``sock`` (bound; hypercorn owns it from here on)."""
    from hypercorn.config import Config

    serve = require_hypercorn()
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("moshpit.dashboard.http")
    config.include_server_header = False
    config.graceful_timeout = 1.0
    await serve(app, config, task_status=task_status)


async def run_dashboard(
    initial_peers: Sequence[Any],
    prefix: str,
    *,
    sock: socket.socket,
    interval: float = DEFAULT_INTERVAL,
    history: int = DEFAULT_HISTORY,
    bootstrap_timeout: float = 20.0,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Join the DHT as a client, serve the page on ``sock`` (see :func:`bind_socket`) and keep
    reading run ``prefix``, until cancelled. ``task_status.started(url)`` once it serves.

    Raises ``dht.BootstrapError`` when no initial peer answers within ``bootstrap_timeout``.
    """
    from dht.kademlia.node import DHTNode

    require_hypercorn()  # before joining: a missing extra is one line, not a half-started run
    runs = RunHistory(prefix, interval=interval, history=history)
    address = sock.getsockname()[0]
    app = DashboardApp(runs, loopback_only=is_loopback(address))
    url = url_of(sock)
    async with DHTNode.open(
        initial_peers=list(initial_peers), client_mode=True, bootstrap_timeout=bootstrap_timeout
    ) as node:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_http, app, sock)
            nursery.start_soon(lambda: poll_run(node, runs, interval=interval))
            task_status.started(url)


class DashboardThread:
    """A dashboard on a thread of its own (its own trio loop), for ``moshpit demo``.

    ``start()`` returns the URL once it serves (or raises what stopped it); ``stop()`` ends
    it. Ctrl-C stays with the main thread: trio does not take signals on other threads.
    """

    def __init__(
        self,
        initial_peers: Sequence[Any],
        prefix: str,
        sock: socket.socket,
        **options: Any,
    ) -> None:
        self._args = (list(initial_peers), prefix)
        self._sock = sock
        self._options = options
        self._ready = threading.Event()
        self._url: str | None = None
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._main, name="moshpit-dashboard", daemon=True)

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the dashboard did not start within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        assert self._url is not None
        return self._url

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as nursery:
                    self._url = await nursery.start(
                        lambda task_status: run_dashboard(
                            *self._args, sock=self._sock, task_status=task_status, **self._options
                        )
                    )
                    self._ready.set()

        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 - handed to start() or logged
            self._error = single_exception(e)
            if self._ready.is_set():
                logger.warning("the dashboard stopped: %r", e)
        finally:
            self._ready.set()

    def stop(self, timeout: float = 5.0) -> None:
        token, scope = self._token, self._scope
        if token is not None and scope is not None:
            try:
                token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)
