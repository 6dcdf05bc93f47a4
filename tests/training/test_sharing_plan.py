"""The download plan without a network: which state, which chunk from whom, relays.

Peers are plain strings here; times are numbers passed in. Every decision the joiner makes
about the swarm is checked on small hand-built swarms, and the assignment rules on random
ones (hypothesis)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from moshpit.training.sharing_plan import (
    BUSY_BACKOFF,
    MAX_FAILURES,
    RELAY_HEADROOM,
    DownloadPlan,
    Holder,
    advertised_states,
    fits,
    note_answer,
    note_busy,
    note_failure,
    path_rank,
    records_of_schema,
    relay_alternatives,
)
from moshpit.training.sharing_protocol import REQUEST_BYTES, Record

BIG = 1 << 40  # a batch limit that never cuts


def plan_of(n: int, size: int = 100) -> DownloadPlan:
    return DownloadPlan([size] * n, order=range(n))


def add(plan: DownloadPlan, peer: str, complete: bool = True, workers: int = 1, **kw) -> Holder:
    h = Holder(peer, complete, workers=workers, **kw)
    plan.holders[peer] = h
    return h


def record(peer: str, root: bytes, epoch: int, complete: bool = True, **kw) -> Record:
    return Record(peer, root, epoch, 1000, complete, kw.pop("addrs", ()), **kw)


# ---------------------------------------------------------------------------------------------
# rarest first


def test_a_donor_is_asked_first_for_what_fewest_joiners_hold_or_fetch():
    plan = plan_of(5)
    donor = add(plan, "donor")
    add(plan, "j1", complete=False, workers=0, have={0, 1})
    add(plan, "j2", complete=False, workers=0, have={0}, pending={2})
    # held or fetched by: chunk 0 two joiners, 1 and 2 one each, 3 and 4 nobody
    assert plan.pick(donor, BIG, 100, now=0.0) == [3, 4, 1, 2, 0]


def test_rarity_ignores_gone_joiners_and_does_not_apply_to_joiners():
    plan = plan_of(3)
    donor = add(plan, "donor")
    add(plan, "gone", complete=False, workers=0, have={0}, gone=True)
    add(plan, "j", complete=False, workers=0, have={0, 1, 2})
    assert plan.pick(donor, BIG, 100, now=0.0) == [0, 1, 2]  # as rare as the others
    plan = plan_of(3)
    joiner = add(plan, "j", complete=False, have={0, 1, 2})
    add(plan, "other", complete=False, workers=0, have={0})
    # a joiner asked by us sends what it has in our order: rarity is for donors' upload
    assert plan.pick(joiner, BIG, 100, now=0.0) == [0, 1, 2]


def test_a_holder_is_asked_only_for_chunks_it_holds():
    plan = plan_of(4)
    joiner = add(plan, "j", complete=False, have={1, 3})
    donor = add(plan, "donor", missing={0})  # said it lacks chunk 0
    assert plan.pick(joiner, BIG, 100, now=0.0) == [1, 3]  # its share: 400 // 2 workers
    assert plan.pick(donor, BIG, 100, now=0.0) == [2]
    assert plan.pick(donor, BIG, 100, now=0.0) == []  # chunk 0: only the donor, which lacks it


# ---------------------------------------------------------------------------------------------
# equal share


def test_a_batch_is_an_equal_share_of_the_unrequested_bytes():
    plan = plan_of(8)
    a = add(plan, "a", workers=2)
    b = add(plan, "b", workers=2)
    assert plan.pick(a, BIG, 100, now=0.0) == [0, 1]  # 800 bytes // 4 workers
    assert plan.pick(b, BIG, 100, now=0.0) == [2]  # 600 // 4 = 150: one chunk
    assert plan.pick(a, BIG, 100, now=0.0) == [3]  # 500 // 4 = 125
    assert sorted(plan.in_flight) == [0, 1, 2, 3]
    assert a.asked == {0, 1, 3} and b.asked == {2}


def test_a_batch_holds_one_chunk_at_least_and_respects_the_limits():
    plan = DownloadPlan([1000, 10, 10, 10, 10], order=range(5))
    a = add(plan, "a", workers=100)
    assert plan.pick(a, 1, 100, now=0.0) == [0]  # bigger than both limits: still sent
    plan = plan_of(6)
    a = add(plan, "a")
    assert plan.pick(a, 250, 100, now=0.0) == [0, 1]  # batch_bytes
    assert plan.pick(a, BIG, 3, now=0.0) == [2, 3, 4]  # max_count


def test_gone_holders_workers_do_not_shrink_the_share():
    plan = plan_of(4)
    a = add(plan, "a")
    add(plan, "gone", workers=3, gone=True)
    assert plan.pick(a, BIG, 100, now=0.0) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# the endgame


def test_endgame_asks_a_second_holder_for_an_overdue_chunk_once():
    plan = plan_of(2)
    a, b, c = add(plan, "a"), add(plan, "b"), add(plan, "c")
    plan.holders.pop("b"), plan.holders.pop("c")  # a alone takes both chunks
    assert plan.pick(a, BIG, 100, now=10.0) == [0, 1]
    plan.holders.update(b=b, c=c)
    assert plan.pick(b, BIG, 100, now=100.0) == []  # no request time known yet: never overdue
    plan.took(4.0)
    assert plan.typical == 4.0
    assert plan.pick(b, BIG, 100, now=17.0) == []  # asked 7 s ago, not yet 2 x 4 s
    assert plan.pick(b, BIG, 100, now=18.5) == [0]  # overdue: one chunk, asked again
    assert plan.in_flight == {0: 2, 1: 1}
    assert plan.pick(a, BIG, 100, now=18.5) == []  # chunk 1 is overdue, but a was asked it
    assert plan.pick(c, BIG, 100, now=18.5) == [1]  # chunk 0 is asked twice already
    assert plan.in_flight == {0: 2, 1: 2}
    plan.release(b, [0])  # b's copy failed; a's request, out since t=10, still runs
    assert plan.pick(c, BIG, 100, now=20.0) == [0]  # overdue counts from the first request
    plan.release(c, [0])
    plan.verifying.add(0)  # a's copy arrived and is being checked
    assert plan.pick(b, BIG, 100, now=50.0) == []


def test_typical_request_time_is_a_moving_average():
    plan = plan_of(1)
    assert plan.typical == math.inf
    plan.took(10.0)
    plan.took(20.0)
    assert plan.typical == 0.8 * 10.0 + 0.2 * 20.0


# ---------------------------------------------------------------------------------------------
# holders that fail, go, come back


def test_a_failing_holders_chunks_go_to_the_others():
    plan = plan_of(4)
    a, b = add(plan, "a"), add(plan, "b")
    batch = plan.pick(a, BIG, 100, now=0.0)
    assert batch == [0, 1]
    pauses = [note_failure(a, now=5.0, drop_for=10.0) for _ in range(MAX_FAILURES)]
    assert pauses == [0.2, 0.4, None] and a.gone and a.retry_at == 15.0
    plan.release(a, batch)  # its worker gives the request up
    assert plan.in_flight == {} and a.asked == set()
    assert plan.pick(b, BIG, 100, now=6.0) == [0, 1, 2, 3]  # b's share alone now


def test_received_chunks_are_not_asked_for_again():
    plan = plan_of(3)
    a, b = add(plan, "a"), add(plan, "b")
    assert plan.pick(a, BIG, 100, now=0.0) == [0]
    plan.received(0, "a")
    plan.release(a, [0])
    assert plan.remaining == {1, 2} and plan.bytes_by_peer == {"a": 100}
    assert plan.pick(b, BIG, 100, now=0.0) == [1]
    assert plan.pick(a, BIG, 100, now=0.0) == [2]
    assert plan.pick(b, BIG, 100, now=0.0) == []


def test_admit_new_returning_and_upgraded_holders():
    plan = plan_of(3)
    h, new = plan.admit("p", complete=False, now=0.0)
    assert new and not h.complete
    h.missing.add(2)
    same, new = plan.admit("p", complete=True, now=1.0)
    assert same is h and not new and h.complete and h.missing == set()
    h.gone, h.retry_at = True, 10.0
    assert plan.admit("p", complete=True, now=9.0) == (h, False)  # dropped: not yet again
    fresh, new = plan.admit("p", complete=True, now=10.0)
    assert new and fresh is not h and not fresh.gone and plan.holders["p"] is fresh


def test_have_bitmaps_update_partial_holders_only():
    plan = plan_of(4)
    joiner = add(plan, "j", complete=False, missing={1, 3})
    assert plan.update_have(joiner, {1, 2}, {2, 3})
    assert joiner.have == {1, 2} and joiner.missing == {3} and joiner.pending == {3}
    assert plan.update_have(joiner, {0}, None)
    assert joiner.pending == {3}  # no valid pending bitmap: the last one stands
    donor = add(plan, "d")
    assert not plan.update_have(donor, {0}, {1}) and donor.have == set()


def test_busy_answers_back_off_until_a_real_answer():
    h = Holder("p", True)
    note_busy(h, now=100.0, jitter=0.5)
    assert h.busy_until == 100.0 + BUSY_BACKOFF[0] and h.busy_wait == 2 * BUSY_BACKOFF[0]
    for _ in range(20):
        note_busy(h, now=100.0, jitter=0.0)
    assert h.busy_wait == BUSY_BACKOFF[1]
    h.failures = 2
    note_answer(h)
    assert h.busy_wait == BUSY_BACKOFF[0] and h.failures == 0


# ---------------------------------------------------------------------------------------------
# relays


def test_what_is_left_counts_the_requests_too():
    plan = DownloadPlan([1000, 2000, 3000], order=range(3))
    plan.remaining.discard(1)
    assert plan.bytes_left() == 4000 + 2 * REQUEST_BYTES


def test_a_transfer_fits_a_relay_with_headroom_to_spare():
    assert fits(10**9, None) and fits(10**9, 0)  # not relayed; a relay without a data limit
    assert fits(1000, 1000 + RELAY_HEADROOM)
    assert not fits(1001, 1000 + RELAY_HEADROOM)


def test_a_relayed_holder_waits_while_a_holder_reached_otherwise_can_serve():
    plan = plan_of(10)  # 1000 bytes + requests
    relayed, direct = add(plan, "relayed"), add(plan, "direct")
    small = RELAY_HEADROOM  # less than what is left plus headroom
    rooms = {"relayed": small, "direct": None}
    assert relay_alternatives(plan, relayed, rooms.get) == [direct]
    assert relay_alternatives(plan, direct, rooms.get) is None
    direct.complete = False  # a partial holder cannot serve it all
    assert relay_alternatives(plan, relayed, rooms.get) == []
    direct.complete, direct.gone = True, True
    assert relay_alternatives(plan, relayed, rooms.get) == []  # alone: asked anyway
    rooms["relayed"] = plan.bytes_left() + RELAY_HEADROOM
    assert relay_alternatives(plan, relayed, rooms.get) is None  # what is left fits now


def test_a_relayed_holder_is_no_alternative_for_another():
    plan = plan_of(10)
    a, b = add(plan, "a"), add(plan, "b")
    rooms = {"a": 1024, "b": 1024}
    assert relay_alternatives(plan, a, rooms.get) == []
    rooms["b"] = 0  # b's relay sets no data limit
    assert relay_alternatives(plan, a, rooms.get) == [b]


def test_donors_reached_directly_rank_first():
    direct, circuit = "/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2/p2p/QmRelay/p2p-circuit"
    assert path_rank(True, False, [circuit]) == 0
    assert path_rank(False, False, [circuit, direct]) == 1
    assert path_rank(True, True, [direct]) == 2
    assert path_rank(False, False, [circuit]) == 2
    assert path_rank(False, False, []) == 2


# ---------------------------------------------------------------------------------------------
# which state


def test_newest_epoch_first_then_most_donors_and_partial_only_states_skipped():
    r1, r2, r3 = b"1" * 32, b"2" * 32, b"3" * 32
    records = [
        record("a", r1, 5),
        record("b", r2, 5),
        record("c", r2, 5),
        record("d", r3, 9, complete=False),  # nobody announces epoch 9 complete
        record("e", r1, 5, complete=False),
        record("f", r3, 4),
    ]
    states = advertised_states(records)
    assert [(s.root, s.donors) for s in states] == [(r2, ["b", "c"]), (r1, ["a"]), (r3, ["f"])]
    assert states[1].partial == ["e"]
    assert states[2].partial == []  # d announced another epoch: another state


def test_states_of_another_schema_are_passed_over_unless_none_of_ours_is_complete():
    ours, theirs = b"o" * 32, b"t" * 32
    mine = record("a", b"1" * 32, 3, schema=ours)
    unknown = record("b", b"2" * 32, 3)  # no schema announced: may be ours
    other = record("c", b"3" * 32, 9, schema=theirs)
    assert records_of_schema([mine, unknown, other], ours) == [mine, unknown]
    assert records_of_schema([mine, other], None) == [mine, other]
    partial = record("d", b"1" * 32, 3, complete=False, schema=ours)
    assert records_of_schema([partial, other], ours) == [partial, other]


# ---------------------------------------------------------------------------------------------
# properties on random swarms


@st.composite
def swarms(draw: st.DrawFn) -> tuple[DownloadPlan, list[Holder]]:
    n = draw(st.integers(1, 24))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    plan = DownloadPlan(sizes, order=order)
    plan.remaining -= draw(st.sets(st.integers(0, n - 1)))  # some held already
    holders = []
    for k in range(draw(st.integers(1, 5))):
        complete = draw(st.booleans())
        h = add(
            plan,
            f"p{k}",
            complete=complete,
            workers=draw(st.integers(1, 4)),
            have=set() if complete else draw(st.sets(st.integers(0, n - 1))),
            missing=draw(st.sets(st.integers(0, n - 1), max_size=2)),
            pending=draw(st.sets(st.integers(0, n - 1), max_size=3)),
        )
        holders.append(h)
    return plan, holders


def drain(plan: DownloadPlan, holders: list[Holder], data, now: float) -> dict[int, list[str]]:
    """Let holders, in an order hypothesis draws, pick until none gets anything more."""
    assigned: dict[int, list[str]] = {}
    while True:
        live = [h for h in holders if not h.gone]
        hungry = []
        for h in data.draw(st.permutations(live)):
            batch = plan.pick(h, data.draw(st.integers(1, 20000)), 1024, now=now)
            for i in batch:
                assert plan.holds(h, i), "a chunk was asked of a holder without it"
                assert i in plan.remaining, "a chunk already held was asked for"
                assigned.setdefault(i, []).append(h.peer)
            hungry += batch
        if not hungry:
            return assigned


@settings(max_examples=150, deadline=None)
@given(swarms(), st.data())
def test_every_needed_chunk_goes_to_one_live_holder_that_has_it(swarm, data):
    plan, holders = swarm
    assigned = drain(plan, holders, data, now=0.0)  # no request time known: no endgame
    available = {i for i in plan.remaining for h in holders if plan.holds(h, i)}
    assert set(assigned) == available
    assert all(len(peers) == 1 for peers in assigned.values()), assigned
    # one holder goes: what it was asked for is planned again, on the others only
    gone = data.draw(st.sampled_from(holders))
    gone.gone = True
    mine = [i for i, peers in assigned.items() if peers == [gone.peer]]
    plan.release(gone, mine)
    again = drain(plan, holders, data, now=0.0)
    still = {i for i in mine for h in holders if not h.gone and plan.holds(h, i)}
    assert set(again) == still
    assert all(gone.peer not in peers for peers in again.values())


@settings(max_examples=100, deadline=None)
@given(swarms(), st.data())
def test_the_endgame_asks_at_most_one_other_holder_per_chunk(swarm, data):
    plan, holders = swarm
    first = drain(plan, holders, data, now=0.0)
    plan.took(1.0)
    later = drain(plan, holders, data, now=10.0)  # every request is overdue now
    for i, peers in later.items():
        assert len(peers) == 1 and peers[0] not in first[i]
    assert all(count <= 2 for count in plan.in_flight.values())
    for i, count in plan.in_flight.items():
        assert count == 1 + (i in later)
