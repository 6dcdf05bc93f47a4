"""Message framing: varint + msgpack, caps checked before allocation, zero-copy payloads."""

from __future__ import annotations

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.p2p.errors import MessageTooLargeError, ProtocolViolationError, StreamClosedError
from dht.p2p.messages import (
    ZERO_COPY_MIN,
    MessageReader,
    pack_message,
    send_msg,
    unpack_body,
)
from dht.p2p.varint import encode_uvarint

from .conftest import socket_stream_pair

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=50)
    | st.binary(max_size=200),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


def body_of(segments) -> bytes:
    data = b"".join(bytes(s) for s in segments)
    length_len = 1
    while data[length_len - 1] & 0x80:
        length_len += 1
    return data[length_len:]


@given(msgpack_values)
@settings(max_examples=200, deadline=None)
def test_roundtrip_matches_msgpack(value):
    body = body_of(pack_message(value))
    assert body == msgpack.packb(value, use_bin_type=True)
    expected = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
    assert unpack_body(body) == expected


def test_large_bytes_are_not_copied():
    payload = b"\x07" * (ZERO_COPY_MIN * 4)
    message = {"part": 3, "meta": {"payload": payload, "shape": [4, 5]}, "tail": "t"}
    segments = pack_message(message)
    assert any(seg is payload for seg in segments), "the payload object itself must be a segment"
    body = body_of(segments)
    assert body == msgpack.packb(message, use_bin_type=True)
    assert unpack_body(body) == message


def test_send_cap_is_enforced():
    with pytest.raises(MessageTooLargeError):
        pack_message(b"x" * 1000, max_size=999)
    with pytest.raises(MessageTooLargeError):
        pack_message({"a": b"x" * (ZERO_COPY_MIN + 10)}, max_size=ZERO_COPY_MIN)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # array of 2 with 1 element (truncated)
        b"\x01\x02",  # extra data
        b"\xd4\x01\x00",  # ext type (not allowed)
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
    ],
)
def test_malformed_msgpack_is_a_protocol_violation(body):
    with pytest.raises(ProtocolViolationError):
        unpack_body(body)


async def test_receive_over_socket_roundtrip_and_eof():
    a, b = socket_stream_pair()
    reader = MessageReader(b)
    big = bytes(range(256)) * 4096
    async with trio.open_nursery() as nursery:

        async def sender():
            await send_msg(a, {"x": 1})
            await send_msg(a, [big, "after"])
            await send_msg(a, "last")
            await a.send_all(b"raw tail")
            await a.send_eof()

        nursery.start_soon(sender)
        assert await reader.receive_msg() == {"x": 1}
        assert await reader.receive_msg() == [big, "after"]
        assert await reader.receive_msg() == "last"
        assert await reader.receive_exactly(3) == b"raw"
        assert await reader.receive_some() == b" tail"
        with pytest.raises(StreamClosedError):
            await reader.receive_msg()


async def test_oversized_length_is_refused_before_reading_the_body():
    send, recv = trio.testing.memory_stream_pair()
    reader = MessageReader(recv)
    # Only the length prefix is sent: if the reader waited for the body it would hang.
    await send.send_all(encode_uvarint(2**40))
    with trio.fail_after(1):
        with pytest.raises(MessageTooLargeError):
            await reader.receive_msg(max_size=1024)


async def test_truncated_message_and_bad_prefix():
    send, recv = trio.testing.memory_stream_pair()
    await send.send_all(encode_uvarint(10) + b"abc")
    await send.send_eof()
    with pytest.raises(StreamClosedError, match="3 of 10"):
        await MessageReader(recv).receive_msg()

    send, recv = trio.testing.memory_stream_pair()
    await send.send_all(b"\xff" * 12)
    with pytest.raises(ProtocolViolationError):
        await MessageReader(recv).receive_msg()


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_decode_or_raise_protocol_violation(body):
    try:
        unpack_body(body)
    except ProtocolViolationError:
        pass


@given(st.binary(max_size=64))
@settings(max_examples=200, deadline=None)
def test_arbitrary_stream_bytes_never_escape_the_documented_errors(data):
    async def scenario():
        send, recv = trio.testing.memory_stream_pair()
        await send.send_all(data)
        await send.send_eof()
        reader = MessageReader(recv)
        try:
            while True:
                await reader.receive_msg(max_size=32)
        except (StreamClosedError, MessageTooLargeError, ProtocolViolationError):
            pass

    trio.run(scenario)
