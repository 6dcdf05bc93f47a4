"""Exception types of the network layer. Every error a caller can act on has its own class."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error raised by dht.p2p."""


class MultiaddrError(P2PError, ValueError):
    """A multiaddr string or byte string is malformed or uses an unsupported protocol."""


class IdentityError(P2PError):
    """A key file or an encoded public key / PeerID is invalid."""


class IdentityInUseError(IdentityError):
    """Another live peer holds this key file: two peers must not share one PeerID.

    ``path`` is the key file, ``pid`` the holder's process id (None if it could not be read).
    """

    def __init__(self, message: str, *, path: object = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


class DialError(P2PError):
    """Could not open a connection to a peer at any of its known addresses."""


class DialRefusedError(DialError):
    """Every address of the peer refused the connection: its host answered, but nothing
    listens on that port (a mistyped port, or the peer is not running)."""


class HandshakeError(P2PError):
    """The security handshake (Noise) failed: bad frames, bad signature, timeout, ..."""


class PeerIDMismatchError(HandshakeError):
    """The remote proved an identity different from the PeerID we dialed (possible MITM)."""


class ProtocolNegotiationError(P2PError):
    """multistream-select failed: the remote does not speak the protocol or sent garbage."""


class MessageTooLargeError(P2PError):
    """A framed message (or a frame) is larger than the configured cap."""


class StreamClosedError(P2PError):
    """The stream or connection was closed (cleanly) before the expected data arrived."""


class StreamResetError(StreamClosedError):
    """The stream or connection was reset / broken abruptly."""


class ProtocolViolationError(P2PError):
    """The remote broke the wire protocol (bad yamux frame, bad msgpack, ...)."""


class ResourceLimitError(P2PError):
    """A configured limit (connections, streams, buffered bytes) would be exceeded."""


class RemoteError(P2PError):
    """The remote's RPC handler failed; the message is the remote's reason."""


class P2PTimeoutError(P2PError, TimeoutError):
    """A network operation did not finish within its timeout."""


class RelayError(DialError):
    """A circuit relay refused or failed a request (``status`` is the relay's status code,
    ``None`` where it sent none): no reservation, a refused reservation, limits reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def error_reason(e: BaseException) -> str:
    """How a caught error reads in a log line or a refusal: our own errors by their message
    (they are worded for it), anything else prefixed with its type (``OSError: ...``)."""
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if not isinstance(e, P2PError) else text
