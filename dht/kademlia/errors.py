"""Exception types of the Kademlia DHT. Each names a situation a caller can act on."""

from __future__ import annotations


class DHTError(Exception):
    """Base class of every error raised by dht.kademlia."""


class DHTProtocolError(DHTError):
    """A DHT RPC message is malformed (wrong type, size or field); the sender is at fault."""


class BootstrapError(DHTError):
    """None of the initial peers could be reached, so the node could not join the swarm."""


class RecordRejectedError(DHTError):
    """A record failed validation (bad signature, over a limit, ...); ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
