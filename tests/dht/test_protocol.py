"""Wire parsing edge cases and reply size caps."""

import pytest

from dht.kademlia.errors import DHTProtocolError
from dht.kademlia.ids import serialize
from dht.kademlia.protocol import (
    MAX_VALUE_RESPONSE_BYTES,
    encode_entries,
    parse_find_response,
    parse_request,
)
from dht.kademlia.records import DHTRecord


def test_huge_dictionary_values_are_capped_in_find_replies():
    records = {
        serialize(i): DHTRecord(serialize("k"), serialize(i), b"x" * 60_000, 1000.0 + i)
        for i in range(200)
    }
    entries = encode_entries(records)
    assert sum(len(e[1]) for e in entries) <= MAX_VALUE_RESPONSE_BYTES
    assert entries[0][2] == 1199.0  # the latest entries are kept


def test_requests_and_responses_are_validated():
    assert parse_request({"op": "find", "keys": [b"\x01" * 32], "count": 10**9}).count == 64
    with pytest.raises(DHTProtocolError, match="bool"):
        parse_request({"op": "ping", "from": {"client": "yes"}})
    # a find may ask for the nearest peers only; an old peer's request (no flag) wants values
    assert parse_request({"op": "find", "keys": [b"\x01" * 32], "values": False}).values is False
    assert parse_request({"op": "find", "keys": [b"\x01" * 32]}).values is True
    for bad in ("no", 0, None, [False]):
        with pytest.raises(DHTProtocolError, match="'values' must be a bool"):
            parse_request({"op": "find", "keys": [b"\x01" * 32], "values": bad})
    with pytest.raises(DHTProtocolError, match="wrong number"):
        parse_find_response({"results": []}, 1, bytes)
    with pytest.raises(DHTProtocolError, match="bad peer ID"):
        parse_find_response({"results": [[None, [[b"junk", []]]]]}, 1, lambda b: int("x"))
