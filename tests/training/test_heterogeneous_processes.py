"""Volunteers of unequal speed: 4 real peer processes whose steps take 1x, 2x, 4x and 8x as
long, in ``sync`` and in ``diloco`` with swarm-wide epochs (``target_batch_size``).

Each epoch's step must hold the whole swarm's samples, however they were split: every peer
takes steps at its own pace (the fast one many more than the slow one), nobody loads state or
steps alone, every round holds all four, the samples per epoch stay near the target, and the
update equals the sample-weighted mean of the members' contributions, recomputed here from
what each member declared (tests/training/hetero_peer.py's toy model makes every step exact).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PEER = Path(__file__).with_name("hetero_peer.py")
REPO = Path(__file__).resolve().parents[2]
FACTORS = (1, 2, 4, 8)
BASE_STEP = 0.02  # s per step of the fastest peer
TARGET = 1024  # ~1.4 s of the swarm's compute (8 samples per step)
BATCH = 8
LR = 0.5
EPOCHS = 8


def run_swarm(mode: str) -> tuple[list[list[dict]], dict[str, dict]]:
    procs: list[subprocess.Popen] = []

    def start(rank: int, initial: list[str]) -> subprocess.Popen:
        argv = [sys.executable, str(PEER), mode, str(rank), str(BASE_STEP * FACTORS[rank]),
                str(TARGET), str(EPOCHS), *initial]  # fmt: skip
        return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip

    try:
        procs.append(start(0, []))
        line = procs[0].stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("MADDR "), line + procs[0].stderr.read()  # type: ignore[union-attr]
        for rank in range(1, len(FACTORS)):
            procs.append(start(rank, [line.split()[1]]))
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            outputs.append([json.loads(x) for x in out.splitlines() if x.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    finals = {rows[-1]["peer"]: rows[-1] for rows in outputs}
    return outputs, finals


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_peers_of_unequal_speed_share_every_epoch_by_their_samples(mode):
    outputs, finals = run_swarm(mode)
    by_rank = sorted(finals.values(), key=lambda f: f["rank"])
    steps = [f["steps"] for f in by_rank]
    # every peer stepped at its own pace: the fast ones many more steps than the slow ones
    assert steps == sorted(steps, reverse=True) and steps[0] >= 3 * steps[-1], steps
    for f in by_rank:  # every epoch averaged, none stepped alone or caught up by loading
        assert f["epoch"] == EPOCHS and f["solo"] == 0 and f["loads"] == 0, by_rank
    c_of = {peer: f["c"] for peer, f in finals.items()}
    values: dict[int, set[float]] = {}
    members: dict[int, dict[str, int]] = {}
    for rows in outputs:
        epochs = [r["epoch"] for r in rows if "value" in r]
        assert epochs == list(range(1, EPOCHS + 1)), epochs  # every epoch, in order
        for r in rows:
            if "value" in r:
                values.setdefault(r["epoch"], set()).add(r["value"])
                members.setdefault(r["epoch"], r["members"])
                assert r["members"] == members[r["epoch"]], (r, members[r["epoch"]])
    # one model: the same value on every peer after every epoch
    assert all(len(v) == 1 for v in values.values()), values
    previous = 0.0
    per_epoch = []
    for epoch in range(1, EPOCHS + 1):
        claims = members[epoch]
        assert set(claims) == set(finals), (epoch, claims)  # all four in every round
        total = sum(claims.values())
        per_epoch.append(total)
        if mode == "sync":  # mean gradient weighted by samples, one SGD step
            expected = previous - LR * sum(s * c_of[p] for p, s in claims.items()) / total
        else:  # Δ_i = steps_i * lr * c_i, weighted by samples, outer SGD with lr 1
            deltas = {p: (s / BATCH) * LR * c_of[p] for p, s in claims.items()}
            expected = previous - sum(s * deltas[p] for p, s in claims.items()) / total
        (value,) = values[epoch]
        assert value == pytest.approx(expected, rel=1e-5, abs=1e-7), (epoch, value, expected)
        previous = value
    # the swarm's samples per epoch: the target, plus at most about a step of every peer
    # (the first epoch also holds the steps taken while the others were still joining).
    # Each peer projects the others' counts from their throughput (docs/training.md, "When
    # the target is reached"): a peer slowed after its last report (a loaded machine) can
    # leave an epoch up to about a step of each other peer short, never more, and not on
    # average (full runs saw 1016 of 1024 in a first epoch, and a later epoch under 1024)
    assert all(total >= TARGET - BATCH * (len(FACTORS) - 1) for total in per_epoch), f"{per_epoch}"
    later = per_epoch[1:]
    assert TARGET <= sum(later) / len(later) <= 1.25 * TARGET + len(FACTORS) * BATCH, f"{per_epoch}"
