"""``AveragerConfig``: the averager's knobs as one value, checked where the user wrote them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moshpit
from moshpit.averaging.averager import Averager
from moshpit.averaging.config import AveragerConfig


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(request_timeout=0), "request_timeout must be a positive number of seconds"),
        (dict(allreduce_timeout=float("nan")), "allreduce_timeout"),
        (dict(min_matchmaking_time=-1), "min_matchmaking_time must be a finite"),
        (dict(matchmaking_timeout=0), "matchmaking_timeout"),
        (dict(sender_timeout=-2.0), "sender_timeout"),
        (dict(bandwidth=0), "bandwidth must be a positive number of bytes/s"),
        (dict(bandwidth=True), "bandwidth"),
        (dict(min_group_size=0), "min_group_size must be an integer >= 1"),
        (dict(expected_num_peers=0), "expected_num_peers"),
        (dict(ban_after_failures=0), "ban_after_failures"),
        (dict(ban_seconds=0), "ban_seconds"),
        (dict(initial_group_bits="012"), "initial_group_bits must be a string of 0s and 1s"),
        (dict(client_mode=True, auxiliary=True), "both client_mode and auxiliary"),
    ],
)
def test_a_bad_value_fails_with_its_name(options, match):
    with pytest.raises(ValueError, match=match):
        AveragerConfig(**options)
    with pytest.raises(ValueError, match=match):  # the same through the Averager's kwargs
        Averager([torch.zeros(2)], None, "p", 4, start=False, **options)


def test_an_unknown_name_is_a_type_error_listing_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown averager option\(s\) 'request_timout'.*"):
        AveragerConfig.build({"request_timout": 2.0})
    with pytest.raises(TypeError, match="request_timeout"):  # the list names the right one
        Averager([torch.zeros(2)], None, "p", 4, start=False, request_timout=2.0)
    with pytest.raises(TypeError, match="AveragerConfig or a dict"):
        AveragerConfig.build(["request_timeout"])  # type: ignore[arg-type]


def test_config_and_keywords_are_the_same_averager_and_keywords_go_on_top():
    config = moshpit.AveragerConfig(request_timeout=2.0, min_matchmaking_time=1.0, bandwidth=1e6)
    by_config = Averager([torch.zeros(2)], None, "p", 4, start=False, config=config)
    by_keywords = Averager(
        [torch.zeros(2)], None, "p", 4, start=False,
        request_timeout=2.0, min_matchmaking_time=1.0, bandwidth=1e6,
    )  # fmt: skip
    assert by_config.config == by_keywords.config == config
    for name in ("request_timeout", "min_matchmaking_time", "bandwidth", "matchmaking_timeout"):
        assert getattr(by_config, name) == getattr(by_keywords, name)
    assert by_config.matchmaking_timeout == 3.0  # the default window for these timings
    both = Averager([torch.zeros(2)], None, "p", 4, start=False, config=config, bandwidth=5e5)
    assert both.bandwidth == 5e5 and both.request_timeout == 2.0
    assert config.bandwidth == 1e6  # frozen: the caller's value is never edited
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bandwidth = 1.0  # type: ignore[misc]


def test_build_merges_a_dict_with_keywords_on_top():
    config = AveragerConfig.build({"request_timeout": 2.0, "bandwidth": 1e6}, bandwidth=2e6)
    assert config == AveragerConfig(request_timeout=2.0, bandwidth=2e6)
    assert AveragerConfig.build(None) == AveragerConfig()
    assert AveragerConfig.build(config) is config
