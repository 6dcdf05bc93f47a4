"""The averager tells the truth and never deadlocks (issue 12, items 8, 9 and 10).

- item 8: ``step()`` inside ``with get_tensors():`` raises at once; ``timeout=`` bounds the
  whole step, including the wait for the tensor lock (real ``moshpit.DHT`` facades, threads);
- item 9: peers whose tensors have another schema are never grouped together, and a peer with
  nobody of its schema around gets ``succeeded=False`` with the reason;
- item 10: a (re)joining peer that steps with ``weight=0`` receives the mean without moving it.

Every wait in these tests has its own bound, so a regression fails instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import trio

import moshpit
from dht.kademlia.clock import dht_clock, trio_clock
from dht.kademlia.simulation import open_swarm
from dht.p2p import MemoryNetwork
from moshpit.averaging.averager import Averager, AveragerLockError, tensor_schema
from moshpit.averaging.matchmaking import JoinRequest, MatchmakingError

FAST = dict(min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0)
BOUND = 60.0  # seconds any single wait in the threaded tests may take before the test fails


@pytest.fixture
def two_dhts():
    first = moshpit.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = moshpit.DHT(
        initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


@pytest.fixture
def virtual_dht_time():
    with dht_clock(trio_clock):
        yield


def in_thread(fn) -> dict:
    """Run ``fn`` in a thread, wait at most BOUND seconds; {'value'|'error': ...}."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"{fn} did not return within {BOUND}s (deadlock?)"
    return out


# ------------------------------------------------------------------ item 8: no deadlocks


def test_step_inside_get_tensors_raises_at_once(two_dhts):
    av = Averager([torch.ones(3)], two_dhts[0], "reenter", target_group_size=2, **FAST)
    try:

        def misuse():
            with av.get_tensors():
                av.step(timeout=20)

        out = in_thread(misuse)
        assert isinstance(out.get("error"), AveragerLockError), out
        assert isinstance(out["error"], RuntimeError)
        assert "after the `with` block" in str(out["error"])
        # nothing was started and the lock is free again
        assert av.matchmaker._round is None

        def nested():
            with av.get_tensors(), av.get_tensors():
                pass

        out = in_thread(nested)
        assert isinstance(out.get("error"), AveragerLockError), out
        with av.get_tensors() as (t,):  # released after both errors
            assert torch.equal(t, torch.ones(3))
    finally:
        av.shutdown()


def test_timeout_bounds_the_wait_for_the_tensor_lock(two_dhts):
    """Another thread holds get_tensors() for longer than the step's timeout: the step returns
    succeeded=False, timed_out=True with the reason instead of waiting for the lock."""
    a = Averager([torch.zeros(3)], two_dhts[0], "held", 2, initial_group_bits="", **FAST)
    b = Averager([torch.ones(3) * 4], two_dhts[1], "held", 2, initial_group_bits="", **FAST)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with a.get_tensors():
            holding.set()
            release.wait(BOUND)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(BOUND)
        future_a = a.step(timeout=4.0, wait=False)
        future_b = b.step(timeout=8.0, wait=False)
        res_a = future_a.result(timeout=BOUND)
        assert not res_a.succeeded and res_a.timed_out
        assert "tensor lock" in res_a.reason
        assert res_a.group_id is not None and res_a.group_size == 2  # a group had formed
        future_b.result(timeout=BOUND)  # the partner finishes too (without us)
        release.set()
        holder.join(BOUND)
        with a.get_tensors() as (t,):
            assert torch.equal(t, torch.zeros(3))  # untouched: we never took part
    finally:
        release.set()
        a.shutdown()
        b.shutdown()


def test_timeout_bounds_the_wait_for_a_previous_step(two_dhts):
    av = Averager([torch.ones(2)], two_dhts[0], "busy", target_group_size=2, **FAST)
    try:
        first = av.step(timeout=5.0, wait=False)  # alone: looks for a group for 5 s
        deadline = time.monotonic() + BOUND
        while av.matchmaker._round is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the first step is looking for a group
        second = av.step(timeout=0.5, wait=False)
        res = second.result(timeout=BOUND)
        assert not res.succeeded and res.timed_out and "previous step" in res.reason
        assert not first.result(timeout=BOUND).succeeded
    finally:
        av.shutdown()


# ------------------------------------------------------------------ in-memory swarms


async def run_swarm(tensors: list[list[torch.Tensor]], rounds: int, weights=None, **kwargs):
    """Averagers on real DHT nodes over the in-memory network; returns per-round results."""
    params = dict(
        prefix="mix",
        target_group_size=4,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=10.0,
        initial_group_bits="",
    )
    params.update(kwargs)
    net = MemoryNetwork(latency=0.002)
    history = []
    async with open_swarm(len(tensors), memory_network=net, seed=11, rpc_timeout=1.0) as swarm:
        averagers = [
            Averager(ts, dht=node, **params) for ts, node in zip(tensors, swarm.nodes, strict=True)
        ]
        try:

            async def one(i: int, results: list) -> None:
                w = 1.0 if weights is None else weights[i]
                results[i] = await averagers[i].astep(weight=w)

            for _ in range(rounds):
                results: list = [None] * len(averagers)
                async with trio.open_nursery() as nursery:
                    for i in range(len(averagers)):
                        nursery.start_soon(one, i, results)
                history.append(results)
            return history, averagers
        finally:
            for av in averagers:
                av.shutdown()


# ------------------------------------------------------------------ item 9: schema


def test_schema_hash_covers_shapes_not_dtypes():
    a, _ = tensor_schema([torch.zeros(2, 3), torch.zeros(4)])
    assert a == tensor_schema([torch.zeros(2, 3, dtype=torch.float16), torch.zeros(4)])[0]
    assert a != tensor_schema([torch.zeros(3, 2), torch.zeros(4)])[0]  # same numel
    assert a != tensor_schema([torch.zeros(4), torch.zeros(2, 3)])[0]  # order matters
    assert a != tensor_schema([torch.zeros(10)])[0]
    assert len(a) == 16


def test_join_request_schema_is_validated():
    base = {"prefix": "p", "key": "p.0b", "x": 1.0, "dl": 1.0, "m": "node"}
    assert JoinRequest.from_msg(base).schema is None
    assert JoinRequest.from_msg({**base, "s": b"\x01" * 16}).schema == b"\x01" * 16
    for bad in ("text", b"", b"x" * 65, 5):
        with pytest.raises(MatchmakingError):
            JoinRequest.from_msg({**base, "s": bad})


SCHEMA_A = [torch.zeros(10)]  # 10 values
SCHEMA_B = [torch.zeros(3, 4)]  # 12 values: the 'flat size 12 != ours 10'


def filled(schema: list[torch.Tensor], value: float) -> list[torch.Tensor]:
    return [torch.full_like(t, value) for t in schema]


async def test_groups_never_mix_schemas(autojump_clock, virtual_dht_time):
    tensors = [filled(SCHEMA_A, 0.0), filled(SCHEMA_B, 10.0), filled(SCHEMA_A, 2.0),
               filled(SCHEMA_B, 20.0)]  # fmt: skip
    schemas = [tensor_schema(ts)[0] for ts in tensors]
    history, averagers = await run_swarm(tensors, rounds=6)
    peers = [av._host.peer_id for av in averagers]
    for results in history:
        for i, res in enumerate(results):
            # both pairs find each other at once; nobody is excluded for a size mismatch
            assert res.succeeded and res.group_size == 2, (i, res.reason)
            assert {schemas[peers.index(p)] for p in res.members} == {schemas[i]}
            assert not res.excluded and not res.failed
    assert torch.allclose(averagers[0]._tensors[0], torch.full((10,), 1.0))
    assert torch.allclose(averagers[1]._tensors[0], torch.full((3, 4), 15.0))


async def test_lone_mismatched_peer_is_told_why(autojump_clock, virtual_dht_time, caplog):
    tensors = [filled(SCHEMA_A, 0.0), filled(SCHEMA_A, 2.0), filled(SCHEMA_B, 7.0)]
    with caplog.at_level(logging.WARNING, logger="moshpit.averaging.averager"):
        history, averagers = await run_swarm(tensors, rounds=2)
    for results in history:
        a0, a1, lone = results
        assert a0.succeeded and a1.succeeded and a0.group_size == 2
        assert not lone.succeeded and "schema" in lone.reason, lone.reason
        assert "3 tensors" not in lone.reason and "1 tensors, 12 values" in lone.reason
    assert torch.equal(averagers[2]._tensors[0], torch.full((3, 4), 7.0))
    assert any("schema" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


async def test_a_mismatched_peer_is_avoided_cheaply_round_after_round(
    autojump_clock, virtual_dht_time, caplog
):
    """The mismatched peer stays for many rounds: the others group at once every round
    (target 4 never fills, but they do not wait min_matchmaking_time for it), nobody sends it
    a join request, and its WARNING is logged once, not every round."""
    tensors = [filled(SCHEMA_A, 0.0), filled(SCHEMA_A, 2.0), filled(SCHEMA_B, 7.0)]
    with caplog.at_level(logging.DEBUG, logger="moshpit.averaging.averager"):
        history, averagers = await run_swarm(tensors, rounds=4)
    for results in history:
        a0, a1, lone = results
        assert a0.succeeded and a1.succeeded and a0.group_size == 2
        assert a0.matchmaking_seconds < 2.0 and a1.matchmaking_seconds < 2.0
        assert not lone.succeeded and "schema" in lone.reason  # every result says why
    warnings = [
        r for r in caplog.records if r.levelname == "WARNING" and "schema" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert all(av.matchmaker.schema_refusals == 0 for av in averagers)  # nobody was asked
    lone_peer = averagers[2]._host.peer_id
    assert lone_peer in averagers[0].matchmaker.schema_memory


# ------------------------------------------------------------------ item 10: weight=0 joiner


async def test_weight_zero_joiner_receives_the_mean_without_moving_it(
    autojump_clock, virtual_dht_time
):
    tensors = [[torch.zeros(6)], [torch.ones(6)], [torch.full((6,), 9.0)]]  # newcomer holds 9
    history, averagers = await run_swarm(tensors, rounds=1, weights=[1.0, 1.0, 0.0])
    assert all(res.succeeded and res.group_size == 3 for res in history[0])
    for av in averagers:  # everyone, the newcomer included, holds the old mean 0.5
        assert torch.allclose(av._tensors[0], torch.full((6,), 0.5))


async def test_full_weight_joiner_moves_the_mean(autojump_clock, virtual_dht_time):
    """Why the docs say to join with weight=0: at full weight the newcomer's fresh values are
    averaged in (the issue's 0.5 -> 3.33)."""
    tensors = [[torch.zeros(6)], [torch.ones(6)], [torch.full((6,), 9.0)]]
    history, averagers = await run_swarm(tensors, rounds=1)
    assert all(res.succeeded and res.group_size == 3 for res in history[0])
    assert torch.allclose(averagers[0]._tensors[0], torch.full((6,), 10.0 / 3))


async def test_dtypes_may_differ_within_a_schema(autojump_clock, virtual_dht_time):
    """The schema leaves dtypes out: a bfloat16 peer and a float32 peer average together."""
    tensors = [[torch.zeros(8)], [torch.ones(8, dtype=torch.bfloat16)]]
    history, averagers = await run_swarm(tensors, rounds=1)
    assert all(res.succeeded and res.group_size == 2 for res in history[0])
    assert averagers[1]._tensors[0].dtype == torch.bfloat16
    for av in averagers:
        assert torch.allclose(av._tensors[0].float(), torch.full((8,), 0.5))


async def test_astep_inside_get_tensors_on_the_loop_raises(autojump_clock, virtual_dht_time):
    """Trio code: `with get_tensors(): await astep()` would wait for its own lock."""
    net = MemoryNetwork(latency=0.002)
    async with open_swarm(1, memory_network=net, seed=2, rpc_timeout=1.0) as swarm:
        av = Averager([torch.ones(2)], dht=swarm.nodes[0], prefix="loop", target_group_size=2)
        try:
            with av.get_tensors():
                with pytest.raises(AveragerLockError):
                    await av.astep(timeout=5.0)
            assert not av._lock.locked()
        finally:
            av.shutdown()
