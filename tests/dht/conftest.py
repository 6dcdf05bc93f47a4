"""Shared fixtures of the DHT tests."""

import pytest

try:
    from dht.p2p import Identity, PeerID
except ImportError:  # the package exports may land after the identity module
    from dht.p2p.identity import Identity, PeerID

from dht.kademlia.clock import dht_clock, trio_clock

__all__ = ["Identity", "PeerID"]


@pytest.fixture
def virtual_dht_time():
    """Make get_dht_time() follow trio's (mock) clock for the duration of the test."""
    with dht_clock(trio_clock):
        yield
