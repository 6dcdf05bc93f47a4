"""The simulated volunteer run (benchmarks/sim_training.py) at test size.

A handful of real peers (DHT, averager, state sharing, progress records on the in-memory
network, virtual time) train a small MLP while being preempted far more often than the
benchmark's default (a lifetime of a minute or two instead of half an hour), so that a few
virtual minutes hold many deaths and returns. The properties the full-size run reports are
asserted here: the loss goes down, preempted peers come back with a state that a donor
published (hash-verified by the download, compared again here), and the swarm keeps training
while some of its peers are away.
"""

from __future__ import annotations

import torch

from benchmarks.sim_training import SimConfig, run_sim


def check_downloads(stats) -> list:
    """Every state a peer loaded is one a donor published, tensor for tensor, and current."""
    loaded = [d for d in stats.downloads if d.epoch is not None]
    for d in loaded:
        assert d.root in stats.published, "the loaded state was never published by a donor"
        epoch, tensors = stats.published[d.root]
        assert epoch == d.epoch
        assert len(tensors) == len(d.tensors)
        assert all(torch.equal(a, b) for a, b in zip(tensors, d.tensors, strict=True))
        # ... and the peer trains on from it (not from its fresh initial weights)
        assert all(torch.equal(a, b) for a, b in zip(tensors, d.adopted, strict=True))
        # the newest state: no live peer was more than one epoch ahead when it started
        assert d.epoch >= d.swarm_epoch - 1, (d.epoch, d.swarm_epoch)
    return loaded


def check_training_goes_on_while_peers_are_away(result: dict, epochs: bool = True) -> None:
    """Some ticks found peers away; the others processed samples (and, with ``epochs``,
    advanced the run's epoch) meanwhile."""
    rows = result["_stats"].timeline
    away = [i for i, row in enumerate(rows) if row["alive"] < result["peers"]]
    assert len(away) >= 2, [row["alive"] for row in rows]
    for i in away:
        if i > 0:
            assert rows[i]["samples"] > rows[i - 1]["samples"]
    if epochs:
        assert rows[away[-1]]["max_epoch"] > rows[away[0]]["max_epoch"]


def test_local_mode_converges_through_preemptions_and_returning_peers_load_state():
    cfg = SimConfig(
        peers=5,
        mode="local",
        minutes=2.5,
        lifetime=90.0,
        downtime=15.0,
        base_step_seconds=16.0,
        tick=15.0,
        seed=1,
        keep_published=True,
    )
    result = run_sim(cfg)
    stats = result["_stats"]
    # the failure process hit: peers died, came back, and loaded the swarm's state
    assert result["preemptions"] >= 4 and result["returns"] >= 3
    loaded = check_downloads(stats)
    assert len(loaded) >= 3 and all(d.reason == "join" for d in loaded)
    assert 0 < result["download_s_max"] < cfg.load_state_timeout
    # a preempted peer loses what it had not averaged yet, but not most of the run's work
    assert 0 < result["wasted_fraction"] < 0.5
    assert result["rounds_ok"] > 2 * result["rounds_failed"]
    # training converges: from 2.31 to below 1.9 (measured with seed 1: 1.61, with 8
    # preemptions, 8 state loads, 28% of the compute lost)
    losses = [row["loss"] for row in stats.timeline]
    assert result["final_loss"] < 1.9 and losses[-1] < losses[0] < result["initial_loss"], losses
    check_training_goes_on_while_peers_are_away(result)


def test_diloco_converges_and_laggards_catch_up_from_donors():
    cfg = SimConfig(
        peers=5,
        mode="diloco",
        minutes=3,
        lifetime=240.0,
        downtime=15.0,
        base_step_seconds=12.0,
        inner_steps=3,
        tick=15.0,
        seed=2,
        keep_published=True,
    )
    result = run_sim(cfg)
    stats = result["_stats"]
    # peer IDs are random (the DHT's identities), so runs differ; measured with seed 2:
    # 4 preemptions; 11 or 22 peer-rounds applied; 7-8 state loads (3 returning peers, the
    # rest laggards catching up); the loss from 2.32 to 1.81 (outer epoch 3) or 1.20 (epoch 6)
    assert result["preemptions"] >= 3
    assert result["rounds_ok"] >= 6
    loaded = check_downloads(stats)
    assert len(loaded) >= 4
    assert {d.reason for d in loaded} == {"join", "catch-up"}
    assert result["discarded_fraction"] > 0  # a laggard drops its stale inner steps
    losses = [row["loss"] for row in stats.timeline]
    assert result["final_loss"] < 0.85 * result["initial_loss"], losses
    assert result["max_epoch"] >= 3
    check_training_goes_on_while_peers_are_away(result, epochs=False)
