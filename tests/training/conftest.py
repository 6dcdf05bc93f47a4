"""Fixtures shared by the training-layer tests."""

from __future__ import annotations

import pytest

from dht import DHT


@pytest.fixture
def make_dhts():
    """``make(n)``: n more real DHTs on loopback TCP, all joined through the first one made."""
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        first = made[0] if made else None
        for _ in range(n):
            peers = first.get_visible_maddrs() if first is not None else []
            dht = DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            made.append(dht)
            first = first or dht
        return made[-n:]

    yield make
    for dht in reversed(made):
        dht.shutdown()
