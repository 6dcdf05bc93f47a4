"""Two helpers every networked part of moshpit needs: telling a peer's fault from a bug,
and naming a peer in a log line.

They live here, once, so that matchmaking and state sharing agree on both: a failure they
treat as "that peer or the network went away" (retry elsewhere, never crash) must be the same
set of exceptions, and a peer must read the same in every log line so that one can grep for it.
"""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["aclose_quietly", "is_network_error", "short"]

_NETWORK_ERRORS = (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError)


def is_network_error(e: BaseException) -> bool:
    """Was ``e`` caused by the other peer or the network (as opposed to a bug here)?

    Callers swallow these (the peer is dropped or retried) and let everything else raise.
    """
    if isinstance(e, _NETWORK_ERRORS):
        return True
    # imported here: dht.p2p loads the whole transport stack, and importing this module (and
    # those using it) must stay cheap for processes that never open a connection
    from dht.p2p.errors import P2PError

    return isinstance(e, P2PError)


def short(peer: object) -> str:
    """A peer as log lines show it: ``PeerID.short()`` (the last 6 base58 characters), or the
    last 6 characters of ``str(peer)`` for anything else (a test's stand-in)."""
    method = getattr(peer, "short", None)
    return method() if callable(method) else str(peer)[-6:]


async def aclose_quietly(stream: Any, grace: float = 1.0) -> None:
    """Close ``stream`` even inside a cancelled scope, for at most ``grace`` seconds; a peer
    or network that is already gone is no error here (anything else still raises)."""
    with trio.CancelScope(shield=True), trio.move_on_after(grace):
        try:
            await stream.aclose()
        except Exception as e:
            if not is_network_error(e):
                raise
