"""One hypothesis test per decoder target, and a replay of each target's corpus.

``-k <target>`` picks one (``pytest tests/fuzz -k manifest``); ``MOSHPIT_FUZZ_SECONDS=60``
fuzzes every target for a minute instead of the CI's few dozen examples.
"""

from __future__ import annotations

import pytest

from ._harness import load_all, names, replay_corpus, run_target

TARGETS = load_all()
ALL = sorted(TARGETS)


@pytest.mark.parametrize("name", ALL)
def test_fuzz(name: str) -> None:
    run_target(TARGETS[name])


@pytest.mark.parametrize("name", ALL)
def test_corpus(name: str) -> None:
    replay_corpus(TARGETS[name])


def test_every_area_has_targets() -> None:
    for area in ("p2p", "dht", "moshpit", "codecs"):
        assert names(area), area
