"""Inbound admission (dht/p2p/admission.py) driven directly: no sockets, no trio, no clock.

``tests/p2p/test_slowloris.py`` checks the same rules end to end with real TCP floods; here
each rule is one small scenario, and a property test checks that the tables stay consistent
and within their caps whatever sequence of events arrives.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.p2p.admission import Admission, Handshake


class Clock:
    """Admission takes times from its caller; a counter is enough to order arrivals."""

    def __init__(self) -> None:
        self.now = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now


def arrive(admission: Admission, clock: Clock, source: str, *, spoke: bool = False) -> Handshake:
    """A socket from ``source`` is accepted (and its dialer speaks, if ``spoke``)."""
    handshake = Handshake(source, f"{source}:{int(clock.now)}", clock.tick())
    assert admission.admit(handshake) == []
    if spoke:
        assert admission.spoke(handshake) == []
    return handshake


def test_per_source_cap_drops_the_stalest_handshake_of_that_source():
    admission, clock = Admission(max_spoken=8, max_silent=64, max_per_source=3), Clock()
    first, second, third = (arrive(admission, clock, "10.0.0.1") for _ in range(3))
    other = arrive(admission, clock, "10.0.0.2")

    newcomer = Handshake("10.0.0.1", "10.0.0.1:9", clock.tick())
    (eviction,) = admission.admit(newcomer)

    assert eviction.victim is first and first.evicted
    assert eviction.why == "3 pending handshakes from 10.0.0.1"
    assert list(admission.by_source["10.0.0.1"]) == [second, third, newcomer]
    assert list(admission.by_source["10.0.0.2"]) == [other]  # other sources untouched
    assert first not in admission.handshakes


def test_per_source_cap_spares_a_dialer_that_spoke_while_silent_ones_remain():
    admission, clock = Admission(max_spoken=8, max_silent=64, max_per_source=3), Clock()
    talker = arrive(admission, clock, "10.0.0.1", spoke=True)  # the oldest, but it spoke
    silent = [arrive(admission, clock, "10.0.0.1") for _ in range(2)]

    (eviction,) = admission.admit(Handshake("10.0.0.1", "x", clock.tick()))
    assert eviction.victim is silent[0]
    assert not talker.evicted and talker in admission.spoken

    # once every handshake of the source has spoken, the oldest of them goes
    for handshake in list(admission.by_source["10.0.0.1"]):
        admission.spoke(handshake)
    (eviction,) = admission.admit(Handshake("10.0.0.1", "y", clock.tick()))
    assert eviction.victim is talker


def test_silent_cap_takes_the_oldest_socket_of_the_source_holding_the_most():
    """Fair share: the oldest silent socket overall belongs to a source with one; the
    source with three loses one of its own instead."""
    admission, clock = Admission(max_spoken=8, max_silent=4, max_per_source=8), Clock()
    lone = arrive(admission, clock, "10.0.0.3")
    crowd = [arrive(admission, clock, "10.0.0.2") for _ in range(3)]

    newcomer = Handshake("10.0.0.4", "10.0.0.4:1", clock.tick())
    (eviction,) = admission.admit(newcomer)

    assert eviction.victim is crowd[0]
    assert eviction.why == "4 silent connections in all"
    assert not lone.evicted and newcomer in admission.handshakes
    assert admission.silent_count == 4
    assert {s: len(g) for s, g in admission.silent_by_source.items()} == {
        "10.0.0.3": 1,
        "10.0.0.2": 2,
        "10.0.0.4": 1,
    }
    assert {n: list(sources) for n, sources in admission.sources_by_silent_count.items()} == {
        1: ["10.0.0.3", "10.0.0.4"],
        2: ["10.0.0.2"],
    }


def test_a_flood_from_one_source_displaces_itself_and_not_a_newcomer():
    admission, clock = Admission(max_spoken=8, max_silent=16, max_per_source=1000), Clock()
    newcomer = arrive(admission, clock, "192.0.2.1")
    for _ in range(200):
        admission.admit(Handshake("203.0.113.9", "flood", clock.tick()))
    assert not newcomer.evicted
    assert admission.silent_count == 16
    assert len(admission.silent_by_source["203.0.113.9"]) == 15


def test_a_dialer_that_spoke_ranks_ahead_of_sockets_that_sent_nothing():
    """It leaves the silent table: a full silent table never evicts it, and it does not
    count against that table's cap."""
    admission, clock = Admission(max_spoken=4, max_silent=2, max_per_source=8), Clock()
    talker = arrive(admission, clock, "10.0.0.1", spoke=True)  # the oldest of all
    quiet = [arrive(admission, clock, "10.0.0.2"), arrive(admission, clock, "10.0.0.3")]
    assert admission.silent_count == 2 and admission.pending_count == 3

    (eviction,) = admission.admit(Handshake("10.0.0.4", "z", clock.tick()))

    assert eviction.victim is quiet[0]
    assert not talker.evicted and talker.negotiated
    assert list(admission.spoken) == [talker]


def test_spoken_cap_drops_the_oldest_dialer_that_spoke():
    admission, clock = Admission(max_spoken=2, max_silent=64, max_per_source=8), Clock()
    first = arrive(admission, clock, "10.0.0.1", spoke=True)
    second = arrive(admission, clock, "10.0.0.2", spoke=True)
    third = arrive(admission, clock, "10.0.0.3")

    (eviction,) = admission.spoke(third)

    assert eviction.victim is first and eviction.why == "2 handshakes in progress"
    assert list(admission.spoken) == [second, third]
    assert admission.silent_count == 0


def test_an_evicted_handshake_that_speaks_late_changes_nothing():
    admission, clock = Admission(max_spoken=8, max_silent=1, max_per_source=8), Clock()
    old = arrive(admission, clock, "10.0.0.1")
    (eviction,) = admission.admit(Handshake("10.0.0.2", "b", clock.tick()))  # holds one
    assert eviction.victim is old and old.evicted
    assert admission.spoke(old) == []
    assert not old.negotiated and old not in admission.spoken


def test_forget_frees_every_table_and_is_idempotent():
    admission, clock = Admission(max_spoken=8, max_silent=64, max_per_source=8), Clock()
    talker = arrive(admission, clock, "10.0.0.1", spoke=True)
    quiet = arrive(admission, clock, "10.0.0.1")
    for handshake in (talker, quiet, quiet):
        admission.forget(handshake)
    assert admission.handshakes == {} and admission.spoken == {}
    assert admission.by_source == {} and admission.silent_by_source == {}
    assert admission.sources_by_silent_count == {}  # no bucket left behind


def test_caps_must_be_positive():
    with pytest.raises(ValueError, match="max_silent"):
        Admission(max_spoken=1, max_silent=0, max_per_source=1)


def _check_consistent(admission: Admission) -> None:
    handshakes = set(admission.handshakes)
    assert set().union(*map(set, admission.by_source.values())) == handshakes
    silent = set().union(*map(set, admission.silent_by_source.values()))
    spoken = set(admission.spoken)
    assert silent | spoken == handshakes and not silent & spoken
    assert all(not h.negotiated for h in silent) and all(h.negotiated for h in spoken)
    assert all(not h.evicted for h in handshakes)
    assert all(group for group in admission.by_source.values())  # no empty entries
    assert all(group for group in admission.silent_by_source.values())
    buckets = {
        source: count
        for count, sources in admission.sources_by_silent_count.items()
        for source in sources
    }
    assert buckets == {s: len(g) for s, g in admission.silent_by_source.items()}
    assert admission.silent_count <= admission.max_silent
    assert len(admission.spoken) <= admission.max_spoken
    assert all(len(g) <= admission.max_per_source for g in admission.by_source.values())


events = st.lists(
    st.tuples(st.sampled_from(["admit", "spoke", "forget"]), st.integers(0, 4), st.integers(0)),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(events, st.integers(1, 4), st.integers(1, 6), st.integers(1, 3))
def test_tables_stay_consistent_and_within_caps(ops, max_spoken, max_silent, max_per_source):
    admission = Admission(max_spoken, max_silent, max_per_source)
    clock = Clock()
    seen: list[Handshake] = []
    for op, source, pick in ops:
        if op == "admit":
            handshake = Handshake(f"10.0.0.{source}", "r", clock.tick())
            evicted = admission.admit(handshake)
            assert len(evicted) <= 2 and handshake not in [e.victim for e in evicted]
            seen.append(handshake)
        elif seen:
            handshake = seen[pick % len(seen)]
            if op == "spoke":
                evicted = admission.spoke(handshake)
                assert len(evicted) <= 1
            else:
                admission.forget(handshake)
                evicted = []
        else:
            continue
        for eviction in evicted:
            assert eviction.victim.evicted and eviction.victim not in admission.handshakes
        _check_consistent(admission)
