"""The dashboard's web app: a minimal ASGI application (no framework), served by hypercorn.

Routes (GET and HEAD only):

- ``/``: the page (``static/index.html``), which loads ``/dashboard.js`` and
  ``/dashboard.css`` and polls ``/api/run.json``;
- ``/api/run.json``: the run as JSON (:meth:`RunHistory.to_json`); ``?since=T`` sends only
  the history points after DHT time ``T``.

Every asset ships in the package (``moshpit/dashboard/static``), read once at start. Every
answer carries a Content-Security-Policy that allows only this server's own script, style and
fetches (no inline script, nothing from elsewhere), ``nosniff``, and no framing. When the
server listens on a loopback address, requests must name a loopback host (``Host:``), so a
web page elsewhere cannot read the dashboard through DNS rebinding.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from moshpit.dashboard.history import RunHistory

__all__ = ["DashboardApp", "load_assets"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
API_PATH = "/api/run.json"
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def load_assets() -> dict[str, tuple[bytes, str]]:
    """The page's files, from the installed package: {path: (bytes, content type)}."""
    static = resources.files("moshpit.dashboard") / "static"
    return {path: ((static / name).read_bytes(), kind) for path, (name, kind) in ASSETS.items()}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class DashboardApp:
    """The ASGI callable. ``loopback_only``: answer only requests addressed to a loopback
    host name (set when the server listens on a loopback address)."""

    def __init__(self, history: RunHistory, *, loopback_only: bool = True) -> None:
        self.history = history
        self.loopback_only = loopback_only
        self.assets = load_assets()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._http(scope, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, send: Send) -> None:
        method = scope.get("method", "GET")
        path = scope.get("path", "/")
        if self.loopback_only and not is_loopback(_host(scope)):
            await _respond(send, 421, b"this dashboard answers only to localhost\n", method)
            return
        if method not in ("GET", "HEAD"):
            await _respond(send, 405, b"only GET and HEAD\n", method, [(b"allow", b"GET, HEAD")])
            return
        if path == API_PATH:
            since = _since(scope.get("query_string", b""))
            if since is False:
                await _respond(send, 400, b"since must be a finite number\n", method)
                return
            body = self.history.json_bytes(since)
            await _respond(
                send,
                200,
                body,
                method,
                [(b"content-type", b"application/json"), (b"cache-control", b"no-store")],
            )
            return
        asset = self.assets.get(path)
        if asset is None:
            await _respond(send, 404, b"not found\n", method)
            return
        body, content_type = asset
        await _respond(
            send,
            200,
            body,
            method,
            [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache")],
        )


def _host(scope: Scope) -> str:
    """The host name a request was sent to, without the port ('' when absent)."""
    for name, value in scope.get("headers", []):
        if name == b"host":
            host: str = value.decode("latin-1").strip().lower()
            if host.startswith("["):  # [::1]:8080
                return host[: host.find("]") + 1]
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""


def _since(query: bytes) -> float | None | bool:
    """``since`` from the query string: a number, None when absent, False when malformed."""
    values = parse_qs(query.decode("latin-1")).get("since")
    if not values:
        return None
    try:
        since = float(values[0])
    except ValueError:
        return False
    return since if math.isfinite(since) else False


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    method: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = list(headers or [(b"content-type", b"text/plain; charset=utf-8")])
    headers += SECURITY_HEADERS
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
