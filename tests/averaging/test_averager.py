"""The synchronous Averager API on real ``dht.DHT`` facades over loopback TCP (one process)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

import moshpit
from dht import DHT
from moshpit.averaging.averager import Averager, StepResult

FAST = dict(min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0)


@pytest.fixture
def two_dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def test_public_names():
    assert moshpit.Averager is Averager
    assert moshpit.StepResult is StepResult


def test_sync_step_future_and_get_tensors(two_dhts):
    a = [torch.full((5,), 1.0), torch.zeros(2, 2)]
    b = [torch.full((5,), 3.0), torch.ones(2, 2) * 4]
    av_a = Averager(a, two_dhts[0], "sync", target_group_size=2, initial_group_bits="", **FAST)
    av_b = Averager(b, two_dhts[1], "sync", target_group_size=2, initial_group_bits="", **FAST)
    try:
        # one blocking step from another thread, one future from here
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", av_a.step(gather="A")))
        t.start()
        future = av_b.step(gather="B", wait=False)
        assert isinstance(future, concurrent.futures.Future)
        res_b = future.result(timeout=30)
        t.join(timeout=30)
        res_a = out["a"]
        for res in (res_a, res_b):
            assert res.succeeded and res.group_size == 2 and not res.failed
            assert sorted(res.gathered.values()) == ["A", "B"]
            assert res.matchmaking_seconds < 1.0  # a full group does not wait
        assert res_a.group_id == res_b.group_id
        for av in (av_a, av_b):
            with av.get_tensors() as ts:
                assert torch.allclose(ts[0], torch.full((5,), 2.0))
                assert torch.allclose(ts[1], torch.full((2, 2), 2.0))
        # the caller's tensor objects are the ones updated in place
        assert torch.allclose(a[0], torch.full((5,), 2.0))
        # a second round writes into the same output buffers and averages the new values
        outputs = [list(av._out) for av in (av_a, av_b)]
        with av_a.get_tensors() as ts:
            ts[0].fill_(10.0)
        t = threading.Thread(target=lambda: out.__setitem__("a2", av_a.step()))
        t.start()
        res_b2 = av_b.step()
        t.join(timeout=30)
        assert out["a2"].succeeded and res_b2.succeeded and not res_b2.failed
        for ts in (a, b):
            assert torch.allclose(ts[0], torch.full((5,), 6.0))
            assert torch.allclose(ts[1], torch.full((2, 2), 2.0))
        for av, before in zip((av_a, av_b), outputs, strict=True):
            assert all(x is y for x, y in zip(av._out, before, strict=True))
            assert all(
                x.data_ptr() != t.data_ptr() for x, t in zip(av._out, av._tensors, strict=True)
            )
    finally:
        av_a.shutdown()
        av_b.shutdown()
        av_a.shutdown()  # idempotent


def test_alone_sync_step_times_out_cleanly(two_dhts):
    av = Averager([torch.ones(3)], two_dhts[0], "lonely", target_group_size=2, **FAST)
    try:
        res = av.step(timeout=1.5)
        assert not res.succeeded and "no group" in res.reason
        assert res.matchmaking_seconds == pytest.approx(1.5, abs=0.5)
    finally:
        av.shutdown()
    with pytest.raises(RuntimeError):
        av.step()


def test_two_averagers_share_one_host_by_prefix(two_dhts):
    x = [
        Averager([torch.zeros(4) + i], two_dhts[i], "px", 2, initial_group_bits="", **FAST)
        for i in (0, 1)
    ]
    y = [
        Averager([torch.zeros(2) + 10 * i], two_dhts[i], "py", 2, initial_group_bits="", **FAST)
        for i in (0, 1)
    ]
    try:
        futures = [av.step(wait=False) for av in x + y]
        results = [f.result(timeout=30) for f in futures]
        assert all(r.succeeded for r in results)
        with x[0].get_tensors() as ts:
            assert torch.allclose(ts[0], torch.full((4,), 0.5))
        with y[1].get_tensors() as ts:
            assert torch.allclose(ts[0], torch.full((2,), 5.0))
        with pytest.raises(ValueError, match="already runs"):
            Averager([torch.zeros(1)], two_dhts[0], "px", 2)
    finally:
        for av in x + y:
            av.shutdown()


def test_invalid_arguments(two_dhts):
    dht = two_dhts[0]
    with pytest.raises(ValueError):
        Averager([], dht, "p", 2)
    with pytest.raises(TypeError):
        Averager([torch.zeros(2, dtype=torch.int64)], dht, "p", 2)
    with pytest.raises(ValueError):
        Averager([torch.zeros(1)], dht, "p", 2, min_group_size=3)
    with pytest.raises(ValueError):
        Averager([torch.zeros(1)], dht, "p", 2, client_mode=True, auxiliary=True)
    with pytest.raises(ValueError):
        Averager([torch.zeros(1)], dht, "p", 2, allreduce_timeout=float("inf"))
    with pytest.raises(ValueError):
        Averager([torch.zeros(1)], dht, "bad.0bprefix", 2)
    for bad_bandwidth in (0, -1e6, float("nan"), True, "100mbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            Averager([torch.zeros(1)], dht, "p", 2, bandwidth=bad_bandwidth)
    av = Averager([torch.zeros(1)], dht, "p", 2, **FAST)
    try:
        with pytest.raises(ValueError):
            av.step(weight=-1)
        with pytest.raises(ValueError):
            av.step(weight=float("nan"))
        with pytest.raises(ValueError):
            av.step(gather=object())
        with pytest.raises(ValueError):
            av.step(gather="x" * 100_000)
    finally:
        av.shutdown()


async def test_repeat_offenders_are_avoided_for_a_while(autojump_clock):
    import trio

    av = Averager([torch.zeros(1)], dht=None, prefix="ban", target_group_size=2, start=False,
                  ban_after_failures=2, ban_seconds=30.0)  # fmt: skip
    me, good, bad = "me", "good", "bad"
    av._record_round([me, good, bad], {bad}, me)
    assert not av._is_banned(bad)  # one failure is forgiven
    av._record_round([me, good, bad], {bad}, me)
    assert av._is_banned(bad) and not av._is_banned(good)
    await trio.sleep(31.0)
    assert not av._is_banned(bad)  # only for a while
    av._record_round([me, bad], {bad}, me)
    av._record_round([me, bad], set(), me)  # a good round resets the count
    av._record_round([me, bad], {bad}, me)
    assert not av._is_banned(bad)


def test_shutdown_from_the_dht_thread_does_not_deadlock(two_dhts):
    av = Averager([torch.ones(2)], two_dhts[0], "self-stop", target_group_size=2, **FAST)
    future = av.step(wait=False)
    deadline = time.monotonic() + 10
    while av.matchmaker._round is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until the step is looking for a group
    assert av.matchmaker._round is not None

    async def stop(_dht, _node):
        av.shutdown()  # on the DHT's own trio thread

    two_dhts[0].run_coroutine(stop)
    result = future.result(timeout=10)
    assert not result.succeeded and "shut down" in result.reason
    with pytest.raises(RuntimeError):
        av.step()
