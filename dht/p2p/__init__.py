"""libp2p-compatible transport stack: identity, multiaddr, multistream-select, Noise, yamux, Host."""

from .dcutr import HolePunchConfig, HolePuncher
from .errors import (
    DialError,
    DialRefusedError,
    HandshakeError,
    IdentityError,
    IdentityInUseError,
    MessageTooLargeError,
    MultiaddrError,
    P2PError,
    P2PTimeoutError,
    PeerIDMismatchError,
    ProtocolNegotiationError,
    ProtocolViolationError,
    RelayError,
    RemoteError,
    ResourceLimitError,
    StreamClosedError,
    StreamResetError,
)
from .host import Host, HostLimits, P2PStream
from .identity import Identity, PeerID
from .memory import MemoryNetwork
from .multiaddr import Multiaddr
from .peerstore import PeerStore
from .transport import TCPTransport

__all__ = [
    "DialError",
    "DialRefusedError",
    "HandshakeError",
    "HolePunchConfig",
    "HolePuncher",
    "Host",
    "HostLimits",
    "Identity",
    "IdentityError",
    "IdentityInUseError",
    "MemoryNetwork",
    "MessageTooLargeError",
    "Multiaddr",
    "MultiaddrError",
    "P2PError",
    "P2PStream",
    "P2PTimeoutError",
    "PeerID",
    "PeerIDMismatchError",
    "PeerStore",
    "ProtocolNegotiationError",
    "ProtocolViolationError",
    "RelayError",
    "RemoteError",
    "ResourceLimitError",
    "StreamClosedError",
    "StreamResetError",
    "TCPTransport",
]
