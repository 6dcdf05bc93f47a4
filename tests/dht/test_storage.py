"""LocalStorage: expiration, newest-wins, dictionary values, and hard limits."""

from dht.kademlia.ids import id_from_bytes, serialize
from dht.kademlia.records import DHTRecord
from dht.kademlia.storage import LocalStorage, StorageLimits


def rec(key, value, exp, subkey=None):
    return DHTRecord(
        serialize(key), None if subkey is None else serialize(subkey), serialize(value), exp
    )


def kid(key):
    return id_from_bytes(serialize(key))


def test_newest_expiration_wins_and_expired_never_returned():
    s = LocalStorage()
    assert s.store(kid("a"), rec("a", 1, 10.0), now=0.0) == (True, None)
    ok, reason = s.store(kid("a"), rec("a", 2, 5.0), now=0.0)
    assert not ok and "outdated" in reason
    assert s.store(kid("a"), rec("a", 3, 20.0), now=0.0)[0]
    assert s.get(kid("a"), now=19.999).value == serialize(3)
    assert s.get(kid("a"), now=20.0) is None  # expiration is exclusive
    assert s.prune(now=20.0) == 1
    assert len(s) == 0 and s.num_bytes == 0


def test_dictionary_values_expire_per_subkey():
    s = LocalStorage()
    assert s.store(kid("d"), rec("d", "x", 10.0, subkey="s1"), now=0.0)[0]
    assert s.store(kid("d"), rec("d", "y", 20.0, subkey="s2"), now=0.0)[0]
    assert not s.store(kid("d"), rec("d", "old", 5.0, subkey="s1"), now=0.0)[0]
    live = s.get(kid("d"), now=15.0)
    assert set(live) == {serialize("s2")}
    assert len(s.get(kid("d"), now=5.0)) == 2


def test_plain_and_dictionary_replace_each_other_by_expiration():
    s = LocalStorage()
    assert s.store(kid("k"), rec("k", "plain", 10.0), now=0.0)[0]
    assert not s.store(kid("k"), rec("k", "sub", 9.0, subkey=1), now=0.0)[0]
    assert s.store(kid("k"), rec("k", "sub", 11.0, subkey=1), now=0.0)[0]
    assert isinstance(s.get(kid("k"), now=0.0), dict)
    assert not s.store(kid("k"), rec("k", "plain2", 11.0), now=0.0)[0]
    assert s.store(kid("k"), rec("k", "plain2", 12.0), now=0.0)[0]
    assert s.get(kid("k"), now=0.0).value == serialize("plain2")
    assert len(s) == 1


def test_limits_refuse_with_reasons():
    limits = StorageLimits(
        max_record_bytes=1024, max_records=10, max_total_bytes=4000, max_expiration_horizon=100.0
    )
    s = LocalStorage(limits)
    ok, reason = s.store(kid("big"), rec("big", b"x" * 2000, 10.0), now=0.0)
    assert not ok and "too large" in reason
    ok, reason = s.store(kid("late"), rec("late", 1, 1000.0), now=0.0)
    assert not ok and "future" in reason
    ok, reason = s.store(kid("old"), rec("old", 1, 1.0), now=2.0)
    assert not ok and "expired" in reason


def test_flood_cannot_grow_past_limits():
    limits = StorageLimits(max_record_bytes=2048, max_records=50, max_total_bytes=20_000)
    s = LocalStorage(limits)
    refusals = set()
    for i in range(1000):
        ok, reason = s.store(kid(i), rec(i, b"v" * 500, 50.0 + i), now=0.0)
        if not ok:
            refusals.add(reason.split(":")[0])
        assert s.num_records <= 50 and s.num_bytes <= 20_000
    assert refusals == {"storage full"}
    # expired records make room again
    assert s.store(kid("new"), rec("new", 1, 5000.0), now=4000.0)[0]


def test_replacing_records_keeps_accounting_and_heap_bounded():
    s = LocalStorage()
    for i in range(10_000):
        assert s.store(kid("k"), rec("k", i, 1.0 + i), now=0.0)[0]
    assert len(s) == 1 and s.num_bytes == rec("k", 9999, 1.0).size
    assert len(s._heap) <= 4 * 1024 + 1


def test_reader_merge_rules_match_storage():
    from dht.kademlia.merge import merge_records, unique_live_records

    k = serialize("k")
    entries_a = [
        (serialize("s1"), serialize("old"), 10.0, None),
        (None, serialize("plain"), 12.0, None),
    ]
    entries_b = [
        (serialize("s1"), serialize("new"), 20.0, None),
        (serialize("s2"), b"\xc1", 30.0, None),
    ]
    records = unique_live_records(
        k, [entries_a, entries_b, entries_a], now=0.0, max_record_bytes=1024
    )
    assert len(records) == 4  # duplicates dropped
    value, _ = merge_records(records)
    # s2's value is not valid msgpack (0xc1): skipped; s1's newest record wins over the plain value
    assert value.value == {"s1": ("new", 20.0)} and value.expiration_time == 20.0
    value, best = merge_records(
        r for r in records if r.subkey != serialize("s1") or r.expiration_time < 15
    )
    assert value == ("plain", 12.0) and best.subkey is None
    assert unique_live_records(k, [entries_a], now=11.0, max_record_bytes=1024)[0].subkey is None


def test_per_origin_quota_is_accounted_through_replace_and_prune():
    limits = StorageLimits(max_records=20, max_origin_fraction=0.25)  # 5 records per sender
    s = LocalStorage(limits)
    for i in range(5):
        assert s.store(kid(i), rec(i, i, 10.0), now=0.0, origin="mallory")[0]
    ok, reason = s.store(kid(99), rec(99, 1, 10.0), now=0.0, origin="mallory")
    assert not ok and reason.startswith("per-peer quota exceeded")
    # replacing one's own record stays within the quota; others are unaffected
    assert s.store(kid(0), rec(0, "newer", 11.0), now=0.0, origin="mallory")[0]
    assert s.store(kid(99), rec(99, 1, 10.0), now=0.0, origin="alice")[0]
    # dictionary subkeys count one by one; local writes (origin None) have no quota
    for i in range(10):
        assert s.store(kid("d"), rec("d", i, 50.0, subkey=i), now=0.0)[0]
    assert s._usage == {
        "mallory": (
            5,
            sum(r.size for r in [rec(0, "newer", 11.0)] + [rec(i, i, 10.0) for i in range(1, 5)]),
        ),
        "alice": (1, rec(99, 1, 10.0).size),
    }
    s.prune(now=10.5)  # mallory's four older records expire
    assert s._usage["mallory"][0] == 1
    assert s.store(kid(98), rec(98, 1, 20.0), now=10.5, origin="mallory")[0]
    s.prune(now=100.0)
    assert s._usage == {} and s.num_records == 0 and s.num_bytes == 0
