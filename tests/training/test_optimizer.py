"""moshpit.Optimizer: argument errors, the NaN guard, and local mode (ADPSGD) on real DHTs."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

import moshpit
from dht import DHT
from moshpit.training.adaptive_period import AdaptivePeriod

FAST = dict(
    min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)


@pytest.fixture
def dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def _opt(dht, model, **kwargs):
    settings = dict(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dht=dht,
        run_id="opt-test",
        batch_size_per_step=8,
        target_group_size=2,
        averager_options=FAST,
        load_state_timeout=3.0,
    )
    settings.update(kwargs)
    return moshpit.Optimizer(**settings)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(mode="async"), ValueError, "mode must be one of 'sync', 'local', 'diloco'"),
        (dict(mode="sync"), ValueError, "needs target_batch_size"),
        (dict(mode="sync", target_batch_size=4), ValueError, "smaller than batch_size_per_step"),
        (dict(mode="local", batch_size_per_step=0), ValueError, "positive integer"),
        (dict(mode="local", run_id="has space"), ValueError, "run_id"),
        (dict(mode="local", optimizer="sgd"), TypeError, "torch.optim.Optimizer"),
        (dict(mode="local", no_such_knob=1), TypeError, "unknown option.*no_such_knob"),
    ],
)
def test_errors_a_user_can_act_on(dhts, kwargs, error, match):
    with pytest.raises(error, match=match):
        _opt(dhts[0], torch.nn.Linear(2, 1), **kwargs)


def test_without_a_mode_it_trains_locally_or_in_sync_when_given_a_target_batch(dhts):
    """The docs say to start with `local`: it is the default. A target batch without a mode
    keeps meaning sync, as it did when sync was the default."""
    opts = [
        _opt(dhts[0], torch.nn.Linear(2, 1)),
        _opt(dhts[1], torch.nn.Linear(2, 1), target_batch_size=64),
    ]
    try:
        assert [opt.mode_name for opt in opts] == ["local", "sync"]
    finally:
        for opt in opts:
            opt.shutdown()


def test_non_finite_gradients_are_dropped_not_applied(dhts):
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = _opt(dhts[0], model, mode="local", average_every=1000)
    try:
        model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
        opt.step()
        assert opt.skipped_steps == 1
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert all(p.grad is None for p in model.parameters())
    finally:
        opt.shutdown()


def test_adaptive_period_grows_as_deviation_falls_and_resets_on_lr_drop():
    period = AdaptivePeriod(1, calibration_rounds=3, max_period=16)
    for deviation in (1.0, 1.2, 0.8):  # calibration at period 1: target 1.0
        assert period.update(deviation) == 1
    for deviation in (0.5, 0.4, 0.3, 0.2):  # training settles: the period doubles each round
        period.update(deviation)
    assert period.history == [1, 2, 4, 8, 16]
    period.update(0.01)
    assert period.period == 16  # capped
    period.on_lr_drop()
    assert period.period == 1 and period.target is None
    constant = AdaptivePeriod(3, adaptive=False)
    for _ in range(10):
        constant.update(0.0)
    assert constant.period == 3 and constant.rounds == 10


def test_adaptive_period_holds_while_peers_drift():
    period = AdaptivePeriod(2, calibration_rounds=2)
    period.update(1.0)
    period.update(1.0)
    for _ in range(20):
        period.update(3.0)  # drifting apart more than at calibration: never lengthen
    assert period.period == 2


def test_local_mode_averages_in_the_background(dhts):
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    with torch.no_grad():
        models[1].weight.add_(3.0)  # start far apart
    opts = [
        _opt(dht, m, mode="local", average_every=2) for dht, m in zip(dhts, models, strict=True)
    ]
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1

    def train(i: int) -> None:
        for _ in range(100):
            idx = torch.randint(0, 64, (8,))
            loss = torch.nn.functional.mse_loss(models[i](x[idx]).squeeze(-1), y[idx])
            loss.backward()
            opts[i].step()
            opts[i].zero_grad()
            threading.Event().wait(0.05)  # stands for a real model's compute time

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(train, range(2)))
        for opt in opts:
            assert opt.mode.rounds_succeeded >= 2
            assert opt.epoch == opt.mode.rounds_succeeded
        gap = (models[0].weight - models[1].weight).abs().max().item()
        assert gap < 1.0  # started 3.0 apart: averaging pulled them together
    finally:
        for opt in opts:
            opt.shutdown()


def test_local_mode_counts_failed_rounds_and_says_why(dhts, caplog):
    """A round that finds no group keeps the local values; the mode counts it and keeps the
    reason (and logs it), so a run that averages less often than its period says can tell why."""
    model = torch.nn.Linear(4, 1)
    opt = _opt(dhts[0], model, mode="local", average_every=1, wait_for_rounds=True)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        with caplog.at_level("INFO", logger="moshpit.training.modes.local"):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()  # the other DHT runs no optimizer: no group can form
        mode = opt.mode
        assert (mode.rounds_started, mode.rounds_succeeded, mode.rounds_failed) == (1, 0, 1)
        assert "no group" in mode.failure_reasons[-1]
        assert opt.epoch == 0  # nothing was averaged
        assert any("averaging round 1 failed" in r.getMessage() for r in caplog.records)
        trained = zip(model.parameters(), before, strict=True)
        assert not all(torch.equal(p, q) for p, q in trained)  # the local step still applied
    finally:
        opt.shutdown()
