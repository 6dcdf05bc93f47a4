"""The training modes' knobs as values (``SyncOptions``, ``LocalOptions``, ``DiLoCoOptions``):
the keyword arguments users pass keep working, and either way a bad knob fails when the
Optimizer is made, with its name."""

from __future__ import annotations

import itertools

import pytest
import torch

import moshpit
from moshpit.training.modes.options import options_for

FAST = dict(min_matchmaking_time=1.0, request_timeout=1.0)


_runs = itertools.count()


def _opt(dht, **kwargs):
    model = torch.nn.Linear(2, 1)
    settings = dict(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dht=dht,
        run_id=f"options-test-{next(_runs)}",  # one averager per prefix and host
        batch_size_per_step=8,
        target_group_size=2,
        averager_options=FAST,
        load_state_timeout=1.0,
    )
    settings.update(kwargs)
    return moshpit.Optimizer(**settings)


@pytest.mark.parametrize(
    "mode, options, error, match",
    [
        ("diloco", dict(inner_steps=0), ValueError, "inner_steps must be an integer >= 1"),
        ("diloco", dict(outer_lr=0.0), ValueError, "outer_lr must be positive"),
        ("diloco", dict(outer_momentum=1.0), ValueError, r"outer_momentum must be in \[0, 1\)"),
        ("diloco", dict(fragments=0), ValueError, "fragments must be an integer >= 1"),
        ("diloco", dict(overlap_steps=-1), ValueError, "overlap_steps must be an integer >= 0"),
        ("diloco", dict(round_timeout=0), ValueError, "round_timeout"),
        ("local", dict(average_every=0), ValueError, "average_every must be an integer >= 1"),
        ("local", dict(checkpoint_every_epochs=0), ValueError, "checkpoint_every_epochs"),
        ("sync", dict(dgc=True, compression="8bit"), ValueError, "dgc=True chooses its own"),
        ("sync", dict(dgc_options={"momentum": 0.9}), ValueError, "dgc_options need dgc=True"),
        ("sync", dict(refresh_period=-1), ValueError, "refresh_period"),
        ("local", dict(inner_steps=5), TypeError, r"mode='local'.*inner_steps.*average_every"),
        ("tree", {}, ValueError, "mode must be one of 'sync', 'local', 'diloco'"),
    ],
)
def test_a_bad_knob_fails_with_its_name(mode, options, error, match):
    with pytest.raises(error, match=match):
        options_for(mode, **options)


def test_options_as_mode_equal_the_keyword_arguments(make_dhts):
    (dht,) = make_dhts(1)
    by_keywords = _opt(dht, mode="diloco", inner_steps=7, outer_lr=0.5, fragments=2)
    by_value = _opt(dht, mode=moshpit.DiLoCoOptions(inner_steps=7, outer_lr=0.5, fragments=2))
    # a value with keyword arguments on top (the value itself is left as it was)
    base = moshpit.DiLoCoOptions(inner_steps=3, outer_lr=0.5)
    on_top = _opt(dht, mode=base, inner_steps=7, fragments=2)
    try:
        for opt in (by_keywords, by_value, on_top):
            assert opt.mode_name == "diloco" and opt.mode_options == by_keywords.mode_options
            mode = opt.mode
            assert mode.inner_steps == 7 and mode.period == 3 and len(mode.fragments) == 2
            assert mode.outer.param_groups[0]["lr"] == 0.5
        assert base.inner_steps == 3
    finally:
        for opt in (by_keywords, by_value, on_top):
            opt.shutdown()


def test_each_mode_takes_its_options_value(make_dhts):
    (dht,) = make_dhts(1)
    local = _opt(dht, mode=moshpit.LocalOptions(average_every=6, adaptive_period=False))
    sync = _opt(dht, mode=moshpit.SyncOptions(delay_averaging=True), target_batch_size=16)
    try:
        assert local.mode_name == "local" and local.mode.period.period == 6
        assert not local.mode.period.adaptive
        assert sync.mode_name == "sync" and sync.mode.delay_averaging
    finally:
        local.shutdown()
        sync.shutdown()


def test_a_typo_in_averager_options_fails_when_the_optimizer_is_made(make_dhts):
    (dht,) = make_dhts(1)
    with pytest.raises(TypeError, match="request_timout"):
        _opt(dht, averager_options={"request_timout": 2.0})
    opt = _opt(dht, averager_options=moshpit.AveragerConfig(request_timeout=1.5))
    try:
        assert opt.averager_config.request_timeout == 1.5
        assert opt.state.averager.request_timeout == 1.5  # what the state averager got
    finally:
        opt.shutdown()
