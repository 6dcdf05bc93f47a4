"""Uplink pacing: the pacer's shares, and a paced all-reduce round over real TCP."""

from __future__ import annotations

import dataclasses
import socket
import struct

import pytest
import torch

from dht.p2p import P2PStream
from dht.p2p.transport import SO_MAX_PACING_RATE
from moshpit.averaging.allreduce import AllReduceService
from moshpit.averaging.averager import Averager
from moshpit.averaging.pacing import UplinkPacer
from tests.averaging.test_allreduce import make_group, run_all, swarm, weighted_mean
from tests.averaging.test_averager import FAST, two_dhts  # noqa: F401 - fixture

UNLIMITED = 0xFFFFFFFF


class FakeStream:
    def __init__(self, paceable: bool = True) -> None:
        self.caps: list[float | None] = []
        self.paceable = paceable

    def set_max_send_rate(self, rate: float | None) -> bool:
        self.caps.append(rate)
        return self.paceable

    @property
    def cap(self) -> float | None:
        return self.caps[-1] if self.caps else None


def test_caps_are_shares_of_the_rate_by_what_is_left():
    pacer = UplinkPacer().round("r", 12e6)
    streams = {d: FakeStream() for d in (1, 2, 3)}
    for d in (1, 2, 3):
        pacer.plan(d, "chunks", 100)
        pacer.plan(d, "results", 100)
    pacer.attach(1, "chunks", streams[1])
    assert streams[1].cap == 12e6  # alone: the whole uplink
    pacer.attach(2, "chunks", streams[2])
    pacer.attach(3, "chunks", streams[3])
    assert [streams[d].cap for d in (1, 2, 3)] == [4e6, 4e6, 4e6]
    # a second flow to the same member (its results) doubles that member's share
    pacer.attach(1, "results", streams[1])
    assert streams[1].cap == pytest.approx(6e6) and streams[2].cap == pytest.approx(3e6)
    # whoever is behind gets more: 2 has sent half of its chunks
    pacer.sent(2, "chunks", 50)
    caps = {d: streams[d].cap for d in (1, 2, 3)}
    assert caps[1] == pytest.approx(12e6 * 200 / 350)
    assert caps[2] == pytest.approx(12e6 * 50 / 350)
    assert caps[3] == pytest.approx(12e6 * 100 / 350)
    assert sum(caps.values()) == pytest.approx(12e6)


def test_finished_or_failed_flows_give_their_share_back_and_close_lifts_all():
    pacer = UplinkPacer().round("r", 9e6)
    streams = {d: FakeStream() for d in (1, 2, 3)}
    for d in (1, 2, 3):
        pacer.plan(d, "chunks", 10)
        pacer.attach(d, "chunks", streams[d])
    pacer.sent(1, "chunks", 10)  # done: its connection is uncapped
    assert streams[1].cap is None
    assert streams[2].cap == pytest.approx(4.5e6) and streams[3].cap == pytest.approx(4.5e6)
    pacer.ended(2, "chunks")  # failed midway
    assert streams[2].cap is None and streams[3].cap == pytest.approx(9e6)
    pacer.close()
    assert all(s.cap is None for s in streams.values())
    late = FakeStream()
    pacer.plan(1, "results", 5)  # after close: nothing happens
    pacer.attach(1, "results", late)
    pacer.sent(3, "chunks", 1)
    assert late.caps == [] and streams[3].caps[-1] is None


def test_a_flow_that_never_starts_takes_no_share_and_small_changes_are_not_applied():
    pacer = UplinkPacer().round("r", 1e6)
    a, b = FakeStream(), FakeStream()
    pacer.plan(1, "chunks", 1000)
    pacer.plan(2, "chunks", 1000)
    pacer.plan(3, "chunks", 1000)  # member 3 never connects
    pacer.attach(1, "chunks", a)
    pacer.attach(2, "chunks", b)
    assert a.cap == pytest.approx(5e5) and b.cap == pytest.approx(5e5)
    calls = len(a.caps)
    pacer.sent(1, "chunks", 10)  # a 0.5% shift: not worth a system call
    assert len(a.caps) == calls
    pacer.sent(1, "chunks", 200)
    assert len(a.caps) == calls + 1 and a.cap < 5e5


def test_concurrent_rounds_share_one_uplink_and_keep_a_shared_connection_capped():
    """Two averagers on one Host: their rounds' caps together stay within the uplink, and the
    first round to end does not leave the other's connection uncapped."""
    shared = UplinkPacer()
    first, second = shared.round("a", 10e6), shared.round("b", 10e6)
    conn_x = FakeStream()  # both rounds send to peer "x" over the same connection
    conn_y = FakeStream()
    first.plan("x", "chunks", 100)
    second.plan("x", "chunks", 100)
    second.plan("y", "chunks", 200)
    first.attach("x", "chunks", conn_x)
    second.attach("x", "chunks", conn_x)
    second.attach("y", "chunks", conn_y)
    assert conn_x.cap == pytest.approx(5e6) and conn_y.cap == pytest.approx(5e6)
    first.close()
    assert conn_x.caps[-1] == pytest.approx(10e6 / 3)  # lifted, then capped for round b
    assert conn_y.cap == pytest.approx(20e6 / 3)
    second.close()
    assert conn_x.cap is None and conn_y.cap is None
    shared.round("c", 1e6)
    with pytest.raises(ValueError, match="already paced"):
        shared.round("c", 1e6)


def test_bad_rates_are_refused():
    for bad in (0, -1.0, float("inf"), float("nan"), "fast", True):
        with pytest.raises(ValueError, match="positive number of bytes/s"):
            UplinkPacer().round("r", bad)


def connection_pacing_rate(host, peer) -> int:
    """The SO_MAX_PACING_RATE of the (one) TCP connection from ``host`` to ``peer``."""
    caps = set()
    for conn in host._conns.get(peer, ()):
        raw = conn.session.conn.raw
        value = raw.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 4)
        caps.add(struct.unpack("=I", value)[0])
    (cap,) = caps
    return cap


async def test_a_paced_round_over_tcp_sends_at_the_stated_rate_and_lifts_its_caps(monkeypatch):
    """3 members each state a 1 MB/s uplink: the round is exact, takes about as long as its
    bytes at that rate (uncapped loopback: milliseconds), and leaves no cap behind."""
    seen: list[float | None] = []
    real = P2PStream.set_max_send_rate

    def spy(self, rate):
        seen.append(rate)
        return real(self, rate)

    monkeypatch.setattr(P2PStream, "set_max_send_rate", spy)
    rate = 1e6
    async with swarm(3, tcp=True) as services:
        group = make_group(services)
        tensors = [[torch.randn(200_000)] for _ in range(3)]
        results = await run_all(services, group, tensors, timeout=60, uplink_rate=rate)
        want = weighted_mean(tensors, [1.0] * 3, [0, 1, 2])
        for r in results:
            assert not r.failed_peers
            assert torch.allclose(r.averaged[0].double(), want[0], atol=1e-5)
        caps = [c for c in seen if c is not None]
        assert caps and max(caps) <= rate * (1 + 1e-9)
        slowest = max(r.seconds for r in results)
        sent = max(r.bytes_sent for r in results)  # ~1.07 MB per member
        # a few hundred KB per connection leave before pacing starts (the initial window)
        assert slowest > 0.4 * sent / rate, (slowest, sent)
        for s in services:
            for other in services:
                if other is not s:
                    assert connection_pacing_rate(s.host, other.host.peer_id) == UNLIMITED


async def test_memory_network_rounds_ignore_the_rate():
    async with swarm(3) as services:
        group = make_group(services)
        tensors = [[torch.randn(1000)] for _ in range(3)]
        results = await run_all(services, group, tensors, timeout=20, uplink_rate=1.0)
        assert all(not r.failed_peers for r in results)


async def test_bad_uplink_rate_is_refused():
    async with swarm(2) as services:
        group = make_group(services)
        for bad in (-1.0, 0, float("nan"), True, "1e6"):
            with pytest.raises(ValueError, match="uplink_rate"):
                await services[0].run(group, [torch.zeros(3)], uplink_rate=bad)


@pytest.mark.parametrize("pace", [True, False])
def test_averager_paces_at_its_bandwidth_and_reports_its_codec_density(two_dhts, monkeypatch, pace):  # noqa: F811
    rates: list[float | None] = []
    densities: list[tuple] = []
    real = AllReduceService.run

    async def spy(self, group, *args, **kwargs):
        rates.append(kwargs.get("uplink_rate"))
        densities.append(group.bytes_per_value)
        return await real(self, group, *args, **kwargs)

    monkeypatch.setattr(AllReduceService, "run", spy)
    # What this test checks is what a formed group runs, not how fast it forms: a full group
    # of two starts at once, so a long matchmaking window costs nothing when the box is idle,
    # and keeps a burst of load from the other test worker from leaving both peers alone.
    common = dict(target_group_size=2, initial_group_bits="", pace_uplink=pace, **FAST)
    common["matchmaking_timeout"] = 20.0
    avs = [
        Averager([torch.full((4,), float(i))], dht, "paced", bandwidth=5e6, **common)
        for i, dht in enumerate(two_dhts)
    ]
    try:
        for _ in range(2):
            futures = [av.step(wait=False) for av in avs]
            results = [f.result(timeout=60) for f in futures]
            assert all(r.succeeded for r in results), [r.reason for r in results]
    finally:
        for av in avs:
            av.shutdown()
    assert rates == [5e6 if pace else None] * 4
    # the first groups know nothing of the codecs; the next ones carry what each member sent
    # per value (uncompressed: 4 bytes), so that every member sizes chunks alike
    assert densities[:2] == [(None, None)] * 2
    assert densities[2:] == [(4.0, 4.0)] * 2


async def test_members_stating_different_links_and_codecs_still_chunk_alike(monkeypatch):
    """The chunk size follows the GroupInfo (slowest stated link, densest reported codec),
    which every member has: a member that used its own would be refused by the others."""
    import moshpit.averaging.allreduce_round as round_module

    sizes: list[int] = []
    real = round_module.chunk_numel_for

    def spy(*args, **kwargs):
        sizes.append(real(*args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(round_module, "chunk_numel_for", spy)
    async with swarm(3) as services:
        group = dataclasses.replace(
            make_group(services, bandwidths=[2e6, None, 5e6]), bytes_per_value=(4.0, None, 1.0)
        )
        tensors = [[torch.randn(1 << 20)] for _ in range(3)]
        results = await run_all(services, group, tensors, timeout=60)
        want = weighted_mean(tensors, [1.0] * 3, [0, 1, 2])
        for r in results:
            assert not r.failed_peers
            assert torch.allclose(r.averaged[0].double(), want[0], atol=1e-5)
            # uncompressed: 4 payload bytes per value sent, which the next group learns
            assert r.wire_bytes_per_value == 4.0
    # 2 * 2/3 * 4 MiB over 2 MB/s is ~2.8 s of link time: sqrt(2.8 / (2 * 2 * 0.5 ms)) = 37,
    # so the most, 32 chunks per sender pair (16,384 values), instead of 8 (65,536)
    assert sizes == [16384] * 3


@pytest.mark.parametrize("density, paced", [(0.03, False), (4.0, True)])
async def test_rounds_bound_by_cpu_are_not_paced(density, paced):
    """With the members' codec densities known, a round that keeps the links busy only briefly
    (sparse codecs, fast links) is not paced: there pacing only costs CPU."""
    async with swarm(3, tcp=True) as services:
        # 2 * 2/3 * 1M values over 5 MB/s: 0.009 s sparse, 1.1 s dense (PACE_MIN_LINK_SECONDS 0.15)
        group = dataclasses.replace(
            make_group(services, bandwidths=[5e6] * 3), bytes_per_value=(density,) * 3
        )
        tensors = [[torch.randn(1 << 20)] for _ in range(3)]
        results = await run_all(services, group, tensors, timeout=60, uplink_rate=20e6)
        assert all(not r.failed_peers for r in results)
        assert (sum(s.pacer.capped for s in services) > 0) is paced


def test_a_round_longer_than_allreduce_timeout_on_stated_slow_links_still_succeeds(two_dhts):  # noqa: F811
    """Both peers state a 500 kB/s uplink (paced, so the link really is that slow) and a
    2-s all-reduce timeout, for a round whose bytes take ~4.8 s at that rate. The budget
    adds twice the stated links' time (the first round assumes float32 on the wire, its
    codec's density being unknown yet), so the round completes; a fixed allreduce_timeout
    failed it every time, however well the links were stated."""
    rate, numel = 500e3, 600_000
    options = {**FAST, "allreduce_timeout": 2.0}
    common = dict(target_group_size=2, initial_group_bits="", bandwidth=rate, **options)
    avs = [
        Averager([torch.full((numel,), float(i))], dht, "slow-links", **common)
        for i, dht in enumerate(two_dhts)
    ]
    try:
        futures = [av.step(wait=False) for av in avs]
        results = [f.result(timeout=60) for f in futures]
        for av in avs:
            with av.get_tensors() as (tensor,):
                assert torch.all(tensor == 0.5)
    finally:
        for av in avs:
            av.shutdown()
    for r in results:
        assert r.succeeded and r.averaged_fraction == 1.0, r.reason
        assert r.allreduce_seconds > options["allreduce_timeout"], r.allreduce_seconds
