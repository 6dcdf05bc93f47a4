"""A joiner retries its initial peers with backoff until bootstrap_timeout (issue 19 item 4).

Real TCP on loopback. Before, a joiner gave up after one attempt per initial peer: a peer that
was still starting (or that dropped the first connection under a flood) made it fail in
milliseconds with ``BootstrapError``.
"""

from __future__ import annotations

import logging
import socket

import pytest
import trio

from dht import BootstrapError, DHTNode
from dht.kademlia import join as join_module  # the retries and their logs
from dht.p2p import Identity


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_joiner_waits_for_an_initial_peer_that_comes_up_later(caplog):
    identity = Identity.generate()
    port = _free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}"
    joined = trio.Event()
    contacts: list[int] = []

    async def joiner() -> None:
        async with DHTNode.open(
            initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=10
        ) as node:
            contacts.append(len(node.routing_table))
            joined.set()

    with caplog.at_level(logging.INFO, logger=join_module.__name__):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(joiner)
            await trio.sleep(1.0)  # connection refused, several times
            assert not joined.is_set()
            async with DHTNode.open(
                identity=identity, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]
            ) as bootstrap:
                with trio.fail_after(10):
                    await joined.wait()
                assert len(bootstrap.routing_table) >= 1
    assert contacts == [1]
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert 1 <= len(retries) <= 6, retries  # backoff: a few attempts, not a busy loop


async def test_joiner_gives_up_after_bootstrap_timeout_with_the_reason(caplog):
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{Identity.generate().peer_id}"
    started = trio.current_time()
    with caplog.at_level(logging.INFO, logger=join_module.__name__):
        with pytest.raises(BootstrapError, match=r"within 2s .*cannot reach initial peer"):
            async with DHTNode.open(
                initial_peers=[dead], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=2
            ):
                pass
    elapsed = trio.current_time() - started
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert 2 <= len(retries) <= 5  # it kept trying (refused at once each time), with backoff
    assert 1.0 <= elapsed <= 15.0, elapsed  # then stopped near its time limit


async def test_a_port_where_nothing_listens_fails_in_seconds_not_the_whole_timeout(caplog):
    """A mistyped port: the host refuses at once. The joiner notes it at once (INFO), gives a
    peer that is still starting a few seconds, then stops with an error naming the address,
    instead of retrying for its whole 30 s."""
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{Identity.generate().peer_id}"
    started = trio.current_time()
    with caplog.at_level(logging.INFO, logger=join_module.__name__):
        with pytest.raises(BootstrapError, match=f"nothing listens at {dead}.* Check the port"):
            async with DHTNode.open(
                initial_peers=[dead], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=30
            ):
                pass
    elapsed = trio.current_time() - started
    assert join_module.BOOTSTRAP_REFUSED_GRACE <= elapsed < 15.0, elapsed
    [warning] = [
        r.getMessage() for r in caplog.records if "refused the connection" in r.getMessage()
    ]
    assert "nothing listens there" in warning


async def test_a_node_given_only_itself_does_not_retry():
    identity = Identity.generate()
    port = _free_port()
    own = f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}"
    started = trio.current_time()
    with pytest.raises(BootstrapError, match="this node itself"):
        async with DHTNode.open(
            initial_peers=[own],
            identity=identity,
            host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
            bootstrap_timeout=10,
        ):
            pass
    assert trio.current_time() - started < 2.0
