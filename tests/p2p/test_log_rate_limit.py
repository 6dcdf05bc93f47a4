"""Repetitive WARNINGs are rate limited: one record per category and interval, with a count
(issue 12, item 15)."""

from __future__ import annotations

import logging
import re
import resource

import pytest
import trio

from dht._logging import RateLimitedLogger
from dht.p2p import Host, HostLimits

from .conftest import wait_until

HOST_LOGGER = "dht.p2p.host"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limited(caplog, interval: float = 10.0) -> tuple[RateLimitedLogger, FakeClock]:
    caplog.set_level(logging.INFO, logger="test.ratelimit")
    clock = FakeClock()
    return RateLimitedLogger(logging.getLogger("test.ratelimit"), interval, clock=clock), clock


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.ratelimit"]


def test_first_record_then_a_count_per_interval(caplog):
    log, clock = _limited(caplog)
    for i in range(1000):
        log.warning("refused", "refusing connection %d", i)
    assert _messages(caplog) == ["refusing connection 0"]
    assert log.suppressed("refused") == 999
    clock.now += 10.0
    log.warning("refused", "refusing connection %d", 1000)
    assert _messages(caplog)[1] == "refusing connection 1000 (999 more like this in the last 10.0s)"
    assert log.suppressed("refused") == 0


def test_flush_reports_a_count_nobody_followed_up(caplog):
    log, clock = _limited(caplog)
    for i in range(50):
        log.warning("evicted", "evicting %s", f"10.0.0.{i}")
    clock.now += 3.0
    assert log.flush() == 0  # the window is still open
    clock.now += 7.5
    assert log.flush() == 1
    assert _messages(caplog)[-1] == (
        "49 more like this in the last 10.5s; the last one: evicting 10.0.0.49"
    )
    assert len(log) == 0  # a flushed window is forgotten
    # a window without repeats is forgotten silently
    log.warning("evicted", "evicting once")
    clock.now += 10.0
    assert log.flush() == 0
    assert len(log) == 0
    assert len(_messages(caplog)) == 3


def test_forced_flush_at_shutdown(caplog):
    log, clock = _limited(caplog)
    log.info("a", "a")
    log.info("a", "a")
    clock.now += 1.0
    assert log.flush(force=True) == 1
    assert _messages(caplog)[-1] == "1 more like this in the last 1.0s; the last one: a"


def test_categories_are_independent_and_bounded(caplog):
    caplog.set_level(logging.INFO, logger="test.ratelimit")
    clock = FakeClock()
    log = RateLimitedLogger(logging.getLogger("test.ratelimit"), 10.0, clock=clock, max_keys=4)
    log.warning("x", "x")
    log.warning("x", "x again")
    log.warning("y", "y")
    assert _messages(caplog) == ["x", "y"]
    for i in range(100):  # unbounded keys cannot grow the table past max_keys
        log.warning(("peer", i), "peer %d", i)
        assert len(log) <= 4
    # the oldest window ("x", with one suppressed record) was reported when it was pushed out
    assert "1 more like this in the last 0.0s; the last one: x again" in _messages(caplog)


def test_levels_below_the_loggers_are_free(caplog):
    caplog.set_level(logging.WARNING, logger="test.ratelimit")
    log = RateLimitedLogger(logging.getLogger("test.ratelimit"), 10.0, clock=FakeClock())
    assert not log.info("quiet", "not logged")
    assert len(log) == 0


def test_bad_parameters():
    with pytest.raises(ValueError, match="interval"):
        RateLimitedLogger(logging.getLogger("x"), 0)
    with pytest.raises(ValueError, match="max_keys"):
        RateLimitedLogger(logging.getLogger("x"), 1.0, max_keys=0)


def test_dht_does_not_need_torch():
    import subprocess
    import sys

    code = "import sys, dht._logging, dht.p2p.host; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


async def test_host_logs_1000_dropped_connections_in_a_few_records(caplog):
    """A real Host over TCP: 1000 connections, each evicting the previous one's pending
    handshake (per-source cap 1), leave a bounded number of WARNING records that carry the
    count, instead of one line per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 and (hard == resource.RLIM_INFINITY or hard > soft):
        wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    limits = HostLimits(max_pending_handshakes_per_source=1, log_interval=3600.0)
    clients: list[trio.SocketStream] = []
    try:
        with caplog.at_level(logging.WARNING, logger=HOST_LOGGER):
            async with Host.open(limits=limits) as host:
                (addr,) = await host.listen(["/ip4/127.0.0.1/tcp/0"])
                ip, port = addr.tcp_endpoint()
                for _ in range(1000):
                    clients.append(await trio.open_tcp_stream(ip, port))
                # 999 evictions: the first one logged, the others counted
                await wait_until(lambda: host._log.suppressed("evicted") == 998)
    finally:
        for stream in clients:
            await stream.aclose()
    records = [r.getMessage() for r in caplog.records if r.name == HOST_LOGGER]
    assert len(records) == 2, records
    assert records[0].startswith("dropping inbound connection from 127.0.0.1:")
    assert "to admit" in records[0]
    # the count comes out when the host closes (or after log_interval, whichever is first)
    assert re.match(r"998 more like this in the last \d+\.\ds; the last one: dropping", records[1])


async def test_host_reports_counts_periodically_while_running(caplog):
    limits = HostLimits(max_pending_handshakes_per_source=1, log_interval=0.5)
    clients: list[trio.SocketStream] = []
    try:
        with caplog.at_level(logging.WARNING, logger=HOST_LOGGER):
            async with Host.open(limits=limits) as host:
                (addr,) = await host.listen(["/ip4/127.0.0.1/tcp/0"])
                ip, port = addr.tcp_endpoint()
                for _ in range(20):
                    clients.append(await trio.open_tcp_stream(ip, port))
                # no further connection arrives: the host's own timer reports the count
                await wait_until(
                    lambda: any("more like this" in r.getMessage() for r in caplog.records)
                )
                assert host._log.suppressed("evicted") == 0
    finally:
        for stream in clients:
            await stream.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == HOST_LOGGER]
    logged = [m for m in messages if m.startswith("dropping inbound connection")]
    counted = [int(n) for m in messages for n in re.findall(r"^(\d+) more like this", m)]
    assert len(logged) + sum(counted) == 19  # every eviction is either logged or counted
    assert len(logged) < 19
