"""All-reduce under failures and attacks: stalled senders, dead reducers, timeouts,
cancellation, malicious members (NaN, wrong sizes, huge or garbage messages, bad results),
and robust aggregation bounding an outlier. Real Hosts on the in-memory network (MockClock
with autojump, so the timeouts cost no wall time) and TCP loopback.
"""

from __future__ import annotations

import math

import pytest
import torch
import trio

from compression import NoCompression
from dht.p2p import MemoryNetwork, P2PError
from moshpit.averaging.aggregation import CenteredClip, ClippedMean
from moshpit.averaging.allreduce import ALLREDUCE_PROTOCOL, AllReduceService
from moshpit.averaging.allreduce_protocol import (
    chunk_msg,
    hello_msg,
    receive_with_payload,
    result_msg,
    send_with_payload,
)
from moshpit.averaging.partition import chunk_bounds, chunk_numel_for, part_bounds
from tests.averaging.test_allreduce import make_group, run_all, swarm, weighted_mean
from tests.averaging.test_pacing import UNLIMITED, connection_pacing_rate

# ---------------------------------------------------------------- a hand-driven member


async def drive_sender(
    service: AllReduceService,
    group,
    reducer: int,
    total: int,
    messages,
    *,
    read_replies=True,
    chunk: int | None = None,
) -> list:
    """Open a stream to ``reducer`` as member ``service`` and send ``messages`` (after hello,
    unless the first message is a hello itself); returns the replies until the stream ends."""
    stream = await service.host.new_stream(group.members[reducer], ALLREDUCE_PROTOCOL)
    replies = []
    try:
        if not (messages and isinstance(messages[0], dict) and messages[0].get("t") == "hello"):
            await stream.send_msg(
                hello_msg(
                    group.group_id, reducer, total, chunk or _chunk(service, group, total), 1.0
                )
            )
        for m in messages:
            await send_wire(stream, m)
        while read_replies:
            replies.append(await receive_with_payload(stream, 1 << 24))
    except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.move_on_after(1):
            try:
                await stream.aclose()
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
    return replies


class AsIs(dict):
    """A message sent exactly as given (no payload moved behind it): a broken sender."""


async def send_wire(stream, m) -> None:
    """Send ``m`` as the protocol does: chunk/result payloads after the message, raw."""
    if isinstance(m, AsIs):
        await stream.send_msg(dict(m))
        return
    is_map = isinstance(m, dict)
    ct = m.get("ct", 0) if is_map else 0
    if is_map and m.get("t") in ("chunk", "result") and (ct is None or isinstance(ct, dict)):
        await send_with_payload(stream, m)
    else:
        await stream.send_msg(m)


def _chunk(service: AllReduceService, group, total: int) -> int:
    return chunk_numel_for(total, len(group.sender_indices), service.chunk_numel)


def chunk_of(values: torch.Tensor, k: int = 0) -> dict:
    return chunk_msg(k, NoCompression().compress(values))


# ---------------------------------------------------------------- stalls, deaths, timeouts


async def test_stalled_client_is_left_out_and_weights_renormalize(autojump_clock):
    async with swarm(4, chunk_numel=8) as services:
        group = make_group(services, ["node", "node", "node", "client"])
        tensors = [[torch.randn(30)] for _ in range(4)]
        weights = [1.0, 2.0, 3.0, 4.0]
        start = trio.current_time()
        results = await run_all(
            services, group, tensors, weights, skip=[3], timeout=30, sender_timeout=2
        )
        assert trio.current_time() - start < 5  # sender_timeout, not the round timeout
        want = weighted_mean(tensors, weights, [0, 1, 2])
        for r in results[:3]:
            assert torch.allclose(r.averaged[0].double(), want[0], atol=1e-5)
            assert r.failed_senders == {group.members[3]}
            assert not r.failed_reducers and not r.timed_out
            assert "stalled: chunk 0 not received" in r.failure_reasons[group.members[3]]


async def test_sender_stalling_mid_part_is_left_out_of_later_chunks(autojump_clock):
    """Per-chunk semantics: a sender stays in the chunks it completed before it stalled."""
    async with swarm(3, chunk_numel=4) as services:
        group = make_group(services, ["node", "node", "client"])
        tensors = [[torch.randn(16)] for _ in range(3)]
        total = 16
        (a0, b0), (a1, b1), _ = part_bounds(group, total)
        chunks = chunk_bounds(a0, b0, 4)
        bad = tensors[2][0]

        async def staller():
            # member 2 sends chunk 0 of part 0 and then nothing; part 1 it never sends
            await drive_sender(
                services[2], group, 0, total, [chunk_of(bad[chunks[0][0] : chunks[0][1]])]
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(staller)
            results = await run_all(
                services, group, tensors, skip=[2], timeout=30, sender_timeout=2
            )
            nursery.cancel_scope.cancel()
        all3 = weighted_mean(tensors, [1.0] * 3, [0, 1, 2])[0]
        two = weighted_mean(tensors, [1.0] * 3, [0, 1])[0]
        for r in results[:2]:
            out = r.averaged[0].double()
            c0 = slice(*chunks[0])
            assert torch.allclose(out[c0], all3[c0], atol=1e-5)  # chunk 0 included member 2
            assert torch.allclose(out[chunks[1][0] : b1], two[chunks[1][0] : b1], atol=1e-5)
        assert group.members[2] in results[0].failed_senders
        assert group.members[2] in results[1].failed_senders


async def test_absent_node_keeps_its_part_local_and_nobody_hangs(autojump_clock):
    async with swarm(4, chunk_numel=8) as services:
        group = make_group(services)
        tensors = [[torch.randn(40)] for _ in range(4)]
        start = trio.current_time()
        results = await run_all(
            services, group, tensors, skip=[3], timeout=20, sender_timeout=2, reducer_timeout=3
        )
        assert trio.current_time() - start < 10
        bounds = part_bounds(group, 40)
        want = weighted_mean(tensors, [1.0] * 4, [0, 1, 2])[0]
        for i, r in enumerate(results[:3]):
            out = r.averaged[0]
            a3, b3 = bounds[3]
            assert torch.equal(out[a3:b3], tensors[i][0][a3:b3])  # dead reducer: local values
            assert torch.allclose(out[:a3].double(), want[:a3], atol=1e-5)
            assert r.failed_reducers == {group.members[3]}
            assert group.members[3] in r.failed_senders
            reason = r.failure_reasons[group.members[3]]
            assert "as sender: stalled" in reason and "as reducer:" in reason, reason


async def test_reducer_killed_mid_round(autojump_clock):
    net = MemoryNetwork(bandwidth=2_000)  # bytes/s: the round takes seconds of (mock) time
    async with swarm(4, net=net, chunk_numel=64) as services:
        group = make_group(services, ["node", "node", "node", "aux"])
        tensors = [[torch.randn(3000)] for _ in range(3)] + [None]
        aux_addr = services[3].host.listen_addrs[0]
        killed_at = []

        async def killer():
            await trio.sleep(2.0)  # connection set-up takes ~1 s at this bandwidth
            (aux_round,) = services[3]._rounds.values()
            # mid-round: the aux reducer has returned some chunks of its part, not all
            assert 0 < aux_round.reducer.next_emit < len(aux_round.chunks[3])
            killed_at.append(trio.current_time())
            net.kill(aux_addr)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(killer)
            results = await run_all(
                services,
                group,
                tensors,
                per_member={3: {"numel": 3000}},
                timeout=60,
                sender_timeout=5,
                reducer_timeout=5,
            )
        assert killed_at
        bounds = part_bounds(group, 3000)
        want = weighted_mean(tensors, [1.0] * 3, [0, 1, 2])[0]
        a3, b3 = bounds[3]
        for i, r in enumerate(results[:3]):
            out = r.averaged[0]
            assert r.failed_reducers == {group.members[3]}, r
            assert torch.equal(out[a3:b3], tensors[i][0][a3:b3])  # whole part local, not partial
            assert torch.allclose(out[:a3].double(), want[:a3], atol=1e-5)
            assert not r.timed_out


async def test_overall_timeout_bounds_the_round(autojump_clock):
    async with swarm(3) as services:
        group = make_group(services)
        tensors = [[torch.randn(12)] for _ in range(3)]
        start = trio.current_time()
        results = await run_all(
            services, group, tensors, skip=[2], timeout=7, sender_timeout=100, reducer_timeout=100
        )
        assert trio.current_time() - start == pytest.approx(7, abs=0.5)
        for i, r in enumerate(results[:2]):
            assert r.timed_out
            # nothing could complete (member 2 never sent): every value is local
            assert torch.equal(r.averaged[0], tensors[i][0])
        assert not services[0]._rounds and not services[1]._rounds


async def test_cancelled_run_cleans_up_and_others_finish(autojump_clock):
    async with swarm(3, chunk_numel=8) as services:
        group = make_group(services, ["node", "node", "client"])
        tensors = [[torch.randn(24)] for _ in range(3)]
        results = [None] * 3

        async def one(i):
            results[i] = await services[i].run(group, tensors[i], timeout=30, sender_timeout=2)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
            with trio.CancelScope() as cs:
                cs.cancel()  # member 2 is cancelled before it sends anything
                await services[2].run(group, tensors[2], timeout=30)
        assert not services[2]._rounds
        want = weighted_mean(tensors, [1.0] * 3, [0, 1])[0]
        for r in results[:2]:
            assert torch.allclose(r.averaged[0].double(), want, atol=1e-5)
            assert r.failed_senders == {group.members[2]}


async def test_stalled_sender_on_tcp_loopback():
    async with swarm(3, tcp=True, chunk_numel=8) as services:
        group = make_group(services, ["node", "node", "client"])
        tensors = [[torch.randn(20)] for _ in range(3)]
        results = await run_all(services, group, tensors, skip=[2], timeout=10, sender_timeout=0.5)
        want = weighted_mean(tensors, [1.0] * 3, [0, 1])[0]
        for r in results[:2]:
            assert torch.allclose(r.averaged[0].double(), want, atol=1e-5)
            assert r.failed_senders == {group.members[2]}


# ---------------------------------------------------------------- malicious senders

N = 12  # flat size in the attack tests; 3 honest nodes + 1 attacker in client mode


def _attacks(part_len: int):
    good = NoCompression().compress(torch.ones(part_len)).to_msg()
    return {
        "nan": ([chunk_of(torch.full((part_len,), math.nan))], "NaN"),
        "inf": ([chunk_of(torch.full((part_len,), math.inf))], "NaN or Inf"),
        "wrong_size": ([chunk_of(torch.ones(part_len + 1))], "elements"),
        "wrong_chunk_index": (
            [chunk_msg(5, NoCompression().compress(torch.ones(part_len)))],
            "expected chunk 0",
        ),
        "unknown_codec": ([{"t": "chunk", "k": 0, "ct": {**good, "codec": 999}}], "unknown codec"),
        "bad_payload": ([{"t": "chunk", "k": 0, "ct": {**good, "payload": b"xx"}}], "payload"),
        "not_a_map": ([[1, 2, 3]], "expected a 'chunk' message"),
        "wrong_type": ([{"t": "result", "k": 0, "ct": good, "dev": 0.0}], "expected a 'chunk'"),
        "huge": (
            [{"t": "chunk", "k": 0, "ct": {**good, "payload": b"\0" * 2_000_000}}],
            "MessageTooLarge",
        ),
        # protocol v2 framing (payload inside the message) or a missing/negative length
        "inline_payload": ([AsIs(chunk_of(torch.ones(part_len)))], "payload length"),
        "negative_len": ([AsIs({"t": "chunk", "k": 0, "ct": good, "len": -1})], "payload length"),
        "payload_and_len": (
            [AsIs({"t": "chunk", "k": 0, "ct": good, "len": 4 * part_len})],
            "must follow the message",
        ),
        "huge_len": (
            [AsIs({"t": "chunk", "k": 0, "ct": {**good, "payload": b""}, "len": 1 << 30})],
            "MessageTooLarge",
        ),
        "wrong_total": ([], "flat size"),  # hello patched below
        "nan_weight": ([], "weight"),
        "wrong_chunking": ([], "chunk size"),  # hello patched below
    }


@pytest.mark.parametrize(
    "attack",
    [
        "nan",
        "inf",
        "wrong_size",
        "wrong_chunk_index",
        "unknown_codec",
        "bad_payload",
        "not_a_map",
        "wrong_type",
        "huge",
        "inline_payload",
        "negative_len",
        "payload_and_len",
        "huge_len",
        "wrong_total",
        "nan_weight",
        "wrong_chunking",
    ],
)
async def test_malicious_sender_is_excluded_with_a_reason(attack, autojump_clock):
    async with swarm(4, chunk_numel=1000) as services:
        group = make_group(services, ["node", "node", "node", "client"])
        tensors = [[torch.randn(N)] for _ in range(4)]
        bounds = part_bounds(group, N)
        replies = {}

        async def attacker():
            async with trio.open_nursery() as nursery:
                for j in range(3):
                    a, b = bounds[j]
                    msgs, _ = _attacks(b - a)[attack]
                    if attack == "wrong_total":
                        msgs = [hello_msg(group.group_id, j, N + 1, 1000, 1.0)]
                    elif attack == "nan_weight":
                        msgs = [{**hello_msg(group.group_id, j, N, 1000, 1.0), "w": math.nan}]
                    elif attack == "wrong_chunking":
                        msgs = [hello_msg(group.group_id, j, N, 3, 1.0)]

                    async def one(j=j, msgs=msgs):
                        replies[j] = await drive_sender(services[3], group, j, N, msgs)

                    nursery.start_soon(one)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attacker)
            results = await run_all(
                services, group, tensors, skip=[3], timeout=30, sender_timeout=3
            )
        _, reason = _attacks(1)[attack]
        want = weighted_mean(tensors, [1.0] * 4, [0, 1, 2])[0]
        for r in results[:3]:
            assert torch.allclose(r.averaged[0].double(), want, atol=1e-5)
            assert not r.timed_out
            bad = group.members[3]
            assert bad in r.excluded, (attack, r)
            assert reason in r.excluded[bad], (attack, r.excluded[bad])
        # the attacker was told why (except when the stream was reset for an oversized frame)
        if attack != "huge":
            assert all(rep and rep[-1].get("t") == "error" for rep in replies.values()), replies


async def test_garbage_from_a_non_member_is_refused(autojump_clock):
    async with swarm(3) as services:
        group = make_group(services[:2])
        tensors = [[torch.randn(6)] for _ in range(2)]
        outsider = services[2]
        async with trio.open_nursery() as nursery:

            async def intruder():
                await trio.sleep(0.01)
                replies = await drive_sender(outsider, group, 0, 6, [chunk_of(torch.ones(3))])
                assert replies and replies[-1]["t"] == "error"

            nursery.start_soon(intruder)
            results = await run_all(services[:2], group, tensors, timeout=10)
        for r in results:
            assert not r.failed_peers
            assert torch.allclose(r.averaged[0], (tensors[0][0] + tensors[1][0]) / 2)


async def test_unknown_group_is_refused_after_accept_timeout(autojump_clock):
    async with swarm(2, accept_timeout=1.5) as services:
        group = make_group(services)
        start = trio.current_time()
        replies = await drive_sender(services[1], group, 0, 4, [])
        assert trio.current_time() - start == pytest.approx(1.5, abs=0.2)
        assert replies[-1] == {"t": "error", "reason": "unknown group (or no hello in time)"}


async def test_malicious_reducer_results_are_rejected(autojump_clock):
    """A reducer that returns NaN: everyone keeps local values for its part and excludes it."""
    async with swarm(3, chunk_numel=100) as services:
        group = make_group(services)
        tensors = [[torch.randn(30)] for _ in range(3)]
        bounds = part_bounds(group, 30)
        a2, b2 = bounds[2]

        async def evil_handler(stream):
            await stream.receive_msg()  # hello
            await receive_with_payload(stream, 1 << 20)  # chunk 0
            await send_with_payload(
                stream,
                result_msg(0, NoCompression().compress(torch.full((b2 - a2,), math.nan)), 0.0, 3),
            )
            with trio.move_on_after(5):
                await stream.receive_msg()

        services[2].host.set_stream_handler(ALLREDUCE_PROTOCOL, evil_handler)
        results = await run_all(services, group, tensors, skip=[2], timeout=30, sender_timeout=2)
        want = weighted_mean(tensors, [1.0] * 3, [0, 1])[0]
        for i, r in enumerate(results[:2]):
            out = r.averaged[0]
            assert torch.equal(out[a2:b2], tensors[i][0][a2:b2])
            assert torch.allclose(out[:a2].double(), want[:a2], atol=1e-5)
            assert "NaN" in r.excluded[group.members[2]]
            assert group.members[2] in r.failed_reducers


# ---------------------------------------------------------------- robust aggregation


async def _outlier_round(aggregation, n_honest=4, numel=40, outlier=1e6):
    """n_honest nodes + one client that sends a huge (finite) outlier as a valid chunk."""
    async with swarm(n_honest + 1, chunk_numel=numel) as services:
        modes = ["node"] * n_honest + ["client"]
        group = make_group(services, modes)
        tensors = [[torch.randn(numel)] for _ in range(n_honest + 1)]
        tensors[-1] = [torch.full((numel,), outlier)]
        results = await run_all(services, group, tensors, timeout=30, aggregation=aggregation)
        return group, tensors, results


@pytest.mark.parametrize("tau", [0.1, 1.0])
async def test_clipped_mean_bounds_an_outlier(tau):
    group, tensors, results = await _outlier_round(ClippedMean(tau))
    honest = torch.stack([t[0] for t in tensors[:-1]])
    lo, hi = honest.min(dim=0).values - tau, honest.max(dim=0).values + tau
    for r in results:
        out = r.averaged[0]
        assert not r.failed_peers
        assert bool(((out >= lo - 1e-5) & (out <= hi + 1e-5)).all())


async def test_centered_clip_bounds_an_outlier_and_plain_mean_does_not():
    tau, iters = 1.0, 5
    group, tensors, results = await _outlier_round(CenteredClip(tau, iters))
    honest = torch.stack([t[0] for t in tensors[:-1]]).double()
    center = honest.mean(dim=0)
    n_senders = honest.shape[0] + 1
    for r in results:
        out = r.averaged[0].double()
        for a, b in part_bounds(group, out.numel()):
            if a == b:
                continue
            sl = slice(a, b)
            box = (
                (honest[:, sl] - center[sl]).abs().max(dim=0).values.norm()
            )  # bounds the median start
            radius = (honest[:, sl] - center[sl]).norm(dim=1).max()
            bound = max(box, radius) + iters * tau / n_senders
            assert (out[sl] - center[sl]).norm() <= bound + 1e-4
    # the same attack against the plain mean moves the result by ~outlier / n
    _, tensors, plain = await _outlier_round(None)
    honest_mean = torch.stack([t[0] for t in tensors[:-1]]).mean(dim=0)
    assert float((plain[0].averaged[0] - honest_mean).abs().min()) > 1e5 - 10


@pytest.mark.parametrize("uplink_rate", [None, 20e6])
async def test_reducer_quitting_mid_round_on_tcp(uplink_rate):
    """TCP loopback: the aux reducer's round is cancelled after it returned some chunks.
    Paced (``uplink_rate``): the failed flows give their shares back, and when the round is
    over no socket stays capped and no pacer state is left."""
    async with swarm(3, tcp=True, chunk_numel=1 << 12, window=1) as services:
        group = make_group(services, ["node", "node", "aux"])
        total = 400_000
        tensors = [[torch.randn(total)] for _ in range(2)] + [None]
        results = [None] * 3
        emitted = []

        async def node(i):
            results[i] = await services[i].run(
                group,
                tensors[i],
                timeout=60,
                sender_timeout=10,
                reducer_timeout=10,
                uplink_rate=uplink_rate,
            )

        async def aux():
            with trio.CancelScope() as cs:

                async def quit_after_first_chunks():
                    if not services[2]._rounds:
                        await services[2]._round_added.wait()
                    (aux_round,) = services[2]._rounds.values()
                    await aux_round.reducer.wait_finalized(1)  # chunks 0 and 1 are out
                    emitted.append((aux_round.reducer.next_emit, len(aux_round.chunks[2])))
                    cs.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(quit_after_first_chunks)
                    await services[2].run(
                        group, None, numel=total, timeout=60, uplink_rate=uplink_rate
                    )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(node, 0)
            nursery.start_soon(node, 1)
            nursery.start_soon(aux)
        assert emitted and emitted[0][0] < emitted[0][1], emitted  # really mid-part
        a2, b2 = part_bounds(group, total)[2]
        want = weighted_mean(tensors, [1.0, 1.0, 0.0], [0, 1])[0]
        for i in (0, 1):
            r = results[i]
            assert r.failed_reducers == {group.members[2]}
            assert torch.equal(r.averaged[0][a2:b2], tensors[i][0][a2:b2])
            assert torch.allclose(r.averaged[0][:a2].double(), want[:a2], atol=1e-5)
        if uplink_rate is not None:
            assert sum(s.pacer.capped for s in services) > 0
            for s in services:
                assert s.pacer._left == {} and s.pacer._rates == {}  # nothing left behind
                for other in services:
                    if other is not s and s.host.is_connected(other.host.peer_id):
                        assert connection_pacing_rate(s.host, other.host.peer_id) == UNLIMITED


async def test_a_hello_slower_than_accept_timeout_is_served_while_its_round_runs(autojump_clock):
    """Over a saturated home uplink a sender's first message can take seconds. While a round
    runs, an incoming stream may take that round's sender stall limit to bring its hello, as
    the chunks after it may; accept_timeout alone (1 s here) refused it at the reducer, and
    its contribution was lost. With no round running, accept_timeout still applies."""
    async with swarm(2, accept_timeout=1.0, chunk_numel=100) as services:
        group = make_group(services)
        ours, theirs = torch.randn(30), torch.randn(30)
        a, b = part_bounds(group, 30)[0]

        async def slow_sender() -> list:
            stream = await services[1].host.new_stream(group.members[0], ALLREDUCE_PROTOCOL)
            await trio.sleep(3.0)  # past accept_timeout, within the round's sender_timeout
            await stream.send_msg(hello_msg(group.group_id, 0, 30, 100, 1.0))
            await send_with_payload(stream, chunk_of(theirs[a:b]))
            return [await receive_with_payload(stream, 1 << 20)]

        async with trio.open_nursery() as nursery:
            replies: list = []

            async def drive() -> None:
                replies.extend(await slow_sender())

            nursery.start_soon(drive)
            result = await services[0].run(group, [ours], timeout=30, sender_timeout=6)
        assert group.members[1] not in result.failed_senders, result.failure_reasons
        want = (ours[a:b].double() + theirs[a:b].double()) / 2
        assert torch.allclose(result.averaged[0][a:b].double(), want, atol=1e-6)
        assert replies and replies[0]["t"] == "result"


# ---------------------------------------------------------------- slow is not stalled


async def test_a_wait_gives_up_only_once_its_link_stops_moving_data(autojump_clock):
    """``unless_silent``: a message whose link keeps moving data past the limit is waited
    for (a full uplink); once the data stops, or only pings trickle, it gives up at the
    next look (every ``limit`` s)."""
    from moshpit.averaging.allreduce_round import unless_silent

    moved = [0]

    async def trickle(seconds: float, per_second: int) -> str:
        for _ in range(int(seconds)):
            await trio.sleep(1.0)
            moved[0] += per_second
        return "sent"

    start = trio.current_time()  # 10 s to send at 40 kB/s, a 2-s limit: waited for
    assert await unless_silent(lambda: trickle(10, 40_000), lambda: moved[0], 2.0) == "sent"
    assert trio.current_time() - start == pytest.approx(10.0)

    async def goes_quiet() -> None:
        await trickle(3, 40_000)  # data for 3 s, then nothing
        await trio.sleep_forever()

    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await unless_silent(goes_quiet, lambda: moved[0], 2.0)
    assert trio.current_time() - start == pytest.approx(6.0)  # looks at 2 and 4 s saw data

    async def pings_only() -> None:
        await trickle(100, 100)  # a keepalive and a few RPCs: not round data

    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await unless_silent(pings_only, lambda: moved[0], 2.0)
    assert trio.current_time() - start == pytest.approx(2.0)
    with pytest.raises(trio.TooSlowError):  # no connection to tell: the plain limit
        await unless_silent(trio.sleep_forever, lambda: None, 2.0)
    with pytest.raises(ValueError, match="bad"):  # fn's own errors come through as they are

        async def fails() -> None:
            raise ValueError("bad")

        await unless_silent(fails, lambda: None, 2.0)


async def test_a_sender_moving_data_is_waited_for_and_a_silent_one_left_out(autojump_clock):
    """The reducer leaves out a sender missing chunk k once ``sender_timeout`` passed with
    no data from it: a sender whose connection keeps delivering data (its chunk is on its
    way over a full uplink) stays in the part."""
    from moshpit.averaging.aggregation import WeightedMean
    from moshpit.averaging.allreduce_reducer import PartReducer

    start = trio.current_time()
    moved = {0: 0, 1: 0, 2: 0}
    finalized: list[tuple[int, tuple[int, ...]]] = []

    async def finalize(k, values, dev, n, missing):
        finalized.append((k, missing))
        return {"k": k, "n": n}, values

    async def run_cpu(fn, *args, numel=0):
        return fn(*args)

    reducer = PartReducer(
        [0, 1, 2], [(0, 4), (4, 8)], WeightedMean(), finalize, run_cpu,
        sender_timeout=2.0, window=2, local=None, moved_from=moved.get,
    )  # fmt: skip
    for s in (0, 1, 2):
        reducer.declare(s, 1.0)

    async def sender_0() -> None:
        for k in (0, 1):
            await reducer.contribute(0, k, torch.ones(4))

    async def slow_sender_1() -> None:  # its chunks take 7 s each, its data keeps coming
        for k in (0, 1):
            for _ in range(7):
                await trio.sleep(1.0)
                moved[1] += 40_000
            await reducer.contribute(1, k, torch.ones(4))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender_0)
        nursery.start_soon(slow_sender_1)  # sender 2 never sends: only pings arrive
        for _ in range(3):
            moved[2] += 12
        await reducer.run()
    assert reducer.active == {0, 1}
    assert "stalled: chunk 0" in reducer.failed[2]
    assert finalized == [(0, (2,)), (1, (2,))]
    assert trio.current_time() - start == pytest.approx(14.0)


async def test_a_round_over_links_slower_than_its_stall_limits_completes(autojump_clock):
    """Three members on 100 kB/s links (the in-memory network times every byte) and a 1-s
    ``sender_timeout``: each 100-kB chunk shares its link with results and takes ~2 s, so
    fixed per-message limits left senders out of parts they were still sending. Every wait
    now looks at the data its link moved, and the round completes for everyone."""
    net = MemoryNetwork(latency=0.01, bandwidth=100_000)
    async with swarm(3, net=net, chunk_numel=25_000) as services:
        group = make_group(services)
        tensors = [[torch.randn(300_000)] for _ in range(3)]
        start = trio.current_time()
        results = await run_all(
            services, group, tensors, timeout=120, sender_timeout=1.0, reducer_timeout=1.5
        )
        assert trio.current_time() - start > 5  # the links, not the limits, set the pace
    want = weighted_mean(tensors, [1.0] * 3, [0, 1, 2])[0]
    for r in results:
        assert not r.failed_senders and not r.failed_reducers and not r.timed_out, r
        assert torch.allclose(r.averaged[0].double(), want, atol=1e-5)
