"""Averagers in separate OS processes over loopback TCP: kill -9 mid-round, a peer joining late.

Workers are ``python -m moshpit.cli.demo_cmd worker`` processes (the demo's peers); they find
each other only through a bootstrap DHT peer running in this test process.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from dht import DHT
from moshpit.cli.demo_cmd import Worker, decode_tensor, worker_command

pytestmark = pytest.mark.slow


def _args(**kw) -> argparse.Namespace:
    base = dict(
        size=1000, group_size=4, rounds=1, compression="none", seed=5, min_matchmaking_time=1.5
    )
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture
def bootstrap():
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield str(dht.get_visible_maddrs()[0])
    finally:
        dht.shutdown()


def _start(index, maddr, args, extra=()) -> Worker:
    return Worker(index, worker_command(index, maddr, "", args, extra))


def _ready(w: Worker) -> torch.Tensor:
    ready = w.wait_for(lambda o: o["event"] == "ready", 90)
    assert ready is not None, "".join(w.stderr_tail)
    return decode_tensor(ready["tensor"])


def _round(w: Worker, r: int, timeout=60) -> dict:
    rep = w.wait_for(lambda o: o["event"] == "round" and o["round"] == r, timeout)
    assert rep is not None, "".join(w.stderr_tail)
    return rep


def test_kill_9_mid_round_survivors_average_without_the_dead_peer(bootstrap):
    args = _args(rounds=1)
    workers = [
        _start(i, bootstrap, args, ["--report-parts"] + (["--die-at-round", "0"] if i == 3 else []))
        for i in range(4)
    ]
    try:
        initial = [_ready(w) for w in workers]
        for w in workers:
            w.send_go()
        reports = [_round(w, 0) for w in workers[:3]]
        assert workers[3].proc.wait(timeout=30) == -9  # it really died by SIGKILL mid-round
        for rep in reports:
            assert rep["ok"] and len(rep["members"]) == 4, rep["reason"]
            assert rep["allreduce_s"] < 10.0  # finished within its timeouts
        ids = [w.wait_for(lambda o: o["event"] == "ready", 1)["peer"] for w in workers]
        dead = ids[3]
        survivors_mean = torch.stack(initial[:3]).mean(0)
        for i, rep in enumerate(reports):
            assert dead in rep["failed"]
            got = decode_tensor(rep["tensor"])
            for owner, (start, end) in zip(rep["members"], rep["parts"], strict=True):
                if owner == dead:  # nobody reduced this part: everyone keeps its own values
                    assert torch.allclose(got[start:end], initial[i][start:end])
                else:
                    assert torch.allclose(got[start:end], survivors_mean[start:end], atol=1e-5)
    finally:
        for w in workers:
            w.stop()


def test_peer_joining_mid_run_takes_part_in_later_rounds(bootstrap):
    args = _args(rounds=3, group_size=4)
    workers = [_start(i, bootstrap, args) for i in range(3)]
    late = None
    try:
        for w in workers:
            _ready(w)
        for r in range(2):
            for w in workers:
                w.send_go()
            for w in workers:
                rep = _round(w, r)
                assert rep["ok"] and len(rep["members"]) == 3
        late = _start(3, bootstrap, _args(rounds=1, group_size=4))
        late_initial = _ready(late)
        for w in workers + [late]:
            w.send_go()
        reps = [_round(w, 2) for w in workers] + [_round(late, 0)]
        for rep in reps:
            assert rep["ok"] and len(rep["members"]) == 4, rep["reason"]
        before = [decode_tensor(_round(w, 1)["tensor"]) for w in workers] + [late_initial]
        want = torch.stack(before).mean(0)
        for rep in reps:
            assert torch.allclose(decode_tensor(rep["tensor"]), want, atol=1e-5)
    finally:
        for w in workers + ([late] if late else []):
            w.stop()


def test_sigterm_mid_round_leaves_cleanly(bootstrap):
    args = _args(rounds=1, group_size=3)
    workers = [
        _start(i, bootstrap, args, ["--sigterm-at-round", "0"] if i == 2 else []) for i in range(3)
    ]
    try:
        initial = [_ready(w) for w in workers]
        ids = [w.wait_for(lambda o: o["event"] == "ready", 1)["peer"] for w in workers]
        for w in workers:
            w.send_go()
        assert workers[2].proc.wait(timeout=30) == 0  # left cleanly via its SIGTERM handler
        reports = [_round(w, 0) for w in workers[:2]]
        mean01 = torch.stack(initial[:2]).mean(0)
        for i, rep in enumerate(reports):
            assert rep["ok"] and len(rep["members"]) == 3 and ids[2] in rep["failed"]
            assert rep["allreduce_s"] < 10.0
            got = decode_tensor(rep["tensor"])
            # every value is either this peer's own (the leaver's part) or the two survivors' mean
            own = torch.isclose(got, initial[i], atol=1e-5)
            averaged = torch.isclose(got, mean01, atol=1e-5)
            assert bool((own | averaged).all())
            assert averaged.float().mean() > 0.5  # the survivors' two parts were averaged
    finally:
        for w in workers:
            w.stop()


def test_weight_bomb_from_another_process_leaves_honest_peers_finite(bootstrap):
    """An attacker process holds 1e30 and steps with weight 1e9 (the largest accepted) in a
    group with four honest demo workers; then the honest ones average twice without it.
    Before the fix the float32 sum overflowed: every honest tensor became Inf and every
    later step raised."""
    import math
    import sys

    args = _args(rounds=3, group_size=5)
    honest = [_start(i, bootstrap, args) for i in range(4)]
    attacker = Worker(
        -1,
        [sys.executable, "-m", "tests.averaging.attacker_peer", "--bootstrap", bootstrap,
         "--size", str(args.size), "--group-size", "5", "--rounds", "1"],
    )  # fmt: skip
    try:
        initial = [_ready(w) for w in honest]
        assert attacker.wait_for(lambda o: o["event"] == "ready", 90), attacker.stderr_tail
        for w in [*honest, attacker]:
            w.send_go()
        reports = [_round(w, 0) for w in honest]
        bomb = attacker.wait_for(lambda o: o["event"] == "round", 60)
        assert bomb is not None and bomb["ok"] and len(bomb["members"]) == 5, bomb
        # the attacker's weight counts as 100 x the median weight (1): its share is 100/104
        want = (torch.stack(initial).double().sum(0) + 100 * 1e30) / 104
        for rep in reports:
            assert rep["ok"] and len(rep["members"]) == 5 and not rep["failed"], rep["reason"]
            got = decode_tensor(rep["tensor"])
            assert bool(torch.isfinite(got).all())
            assert torch.allclose(got.double(), want, rtol=1e-5)
        assert attacker.proc.wait(timeout=30) == 0
        for r in (1, 2):
            for w in honest:
                w.send_go()
            for w in honest:
                rep = _round(w, r)
                assert rep["ok"] and len(rep["members"]) == 4 and not rep["failed"], rep["reason"]
                got = decode_tensor(rep["tensor"])
                assert bool(torch.isfinite(got).all()) and math.isfinite(float(got.abs().max()))
    finally:
        for w in [*honest, attacker]:
            w.stop()
