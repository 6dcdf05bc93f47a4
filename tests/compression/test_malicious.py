"""Untrusted messages: every corruption is a specific CompressionError, never a crash."""

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import (
    CompressedTensor,
    CompressionError,
    MalformedMessageError,
    PayloadSizeError,
    PayloadValueError,
    SizeLimitError,
    TopK,
    UnknownCodecError,
    decompress,
)

from .conftest import all_codecs


def good_msg(codec, n=300):
    return codec.compress(torch.randn(n, generator=torch.Generator().manual_seed(1))).to_msg()


def parse_and_decode(msg, max_numel=10_000):
    return decompress(CompressedTensor.from_msg(msg, max_numel=max_numel))


def test_unknown_codec_and_bad_structure():
    msg = good_msg(all_codecs()[0])
    for bad, exc in [
        ({**msg, "codec": 999}, UnknownCodecError),
        ({**msg, "codec": "0"}, MalformedMessageError),
        ({**msg, "codec": True}, MalformedMessageError),
        ({**msg, "dtype": "complex64"}, MalformedMessageError),
        ({**msg, "dtype": 3}, MalformedMessageError),
        ({**msg, "shape": [-1]}, MalformedMessageError),
        ({**msg, "shape": [1.5]}, MalformedMessageError),
        ({**msg, "shape": "300"}, MalformedMessageError),
        ({**msg, "shape": [1] * 64}, MalformedMessageError),
        ({**msg, "shape": [2**62, 0]}, MalformedMessageError),
        ({**msg, "payload": "text"}, MalformedMessageError),
        ({**msg, "meta": []}, MalformedMessageError),
        ({**msg, "meta": {"x": [1]}}, MalformedMessageError),
        ({k: v for k, v in msg.items() if k != "meta"}, MalformedMessageError),
        ({**msg, "extra": 1}, MalformedMessageError),
        ([msg], MalformedMessageError),
    ]:
        with pytest.raises(exc):
            parse_and_decode(bad)


def test_shape_bomb_rejected_before_allocation(codec):
    msg = good_msg(codec)
    for shape in ([2**30, 2**30], [10**6, 10**6, 10**6], [2**31 - 1, 2]):
        with pytest.raises(SizeLimitError):
            parse_and_decode({**msg, "shape": shape})
    with pytest.raises(SizeLimitError):  # just over the caller's cap
        parse_and_decode(msg, max_numel=299)


def test_wrong_payload_lengths(codec):
    msg = good_msg(codec)
    for payload in (msg["payload"][:-1], bytes(msg["payload"]) + b"\0", b"", b"\0" * 10**5):
        if len(payload) == len(msg["payload"]):
            continue
        with pytest.raises(PayloadSizeError):
            parse_and_decode({**msg, "payload": payload})


def test_shape_payload_mismatch(codec):
    msg = good_msg(codec)
    # sparse messages are valid for any shape their indices fit in; the receiver checks
    # the shape it expects. A shape too small for them must still fail.
    shape = [10] if codec.codec_id in (7, 8) else [400]
    with pytest.raises(CompressionError):
        parse_and_decode({**msg, "shape": shape})


def test_bad_meta_values(codec):
    msg = good_msg(codec)
    for key in msg["meta"]:
        for value in (float("nan"), float("inf"), -1, "x", None, 2**70, True):
            bad = {**msg, "meta": {**msg["meta"], key: value}}
            try:
                parse_and_decode(bad)
            except CompressionError:
                continue
            # accepted: must still decode to something finite of the right shape
            y = parse_and_decode(bad)
            assert y.shape == (300,)


def test_topk_index_out_of_range():
    ct = TopK(0.01, seed=0).compress(torch.randn(1000))
    msg = ct.to_msg()
    # claim a much wider gap encoding: all-ones gaps of the full width push the last index out
    width = msg["meta"]["width"]
    k = msg["meta"]["k"]
    nvalue = 2 * k
    packed = bytes(msg["payload"][:nvalue]) + b"\xff" * (len(msg["payload"]) - nvalue)
    with pytest.raises(PayloadValueError):  # already in the parser, before any decoding
        CompressedTensor.from_msg({**msg, "payload": packed}, max_numel=1000)
    with pytest.raises(PayloadValueError):  # and again by the decoder for local messages
        decompress(CompressedTensor(ct.codec_id, ct.dtype, ct.shape, packed, ct.meta))
    # a huge declared width with a matching payload length must still be range-checked
    big = {**msg["meta"], "width": 32}
    payload = bytes(msg["payload"][:nvalue]) + b"\xff" * (4 * k)
    with pytest.raises(PayloadValueError):
        parse_and_decode({**msg, "meta": big, "payload": payload})
    assert width < 32


def test_non_finite_scales_in_payload_rejected():
    from compression import Blockwise8Bit, Quantile8Bit

    for codec in (Blockwise8Bit(), Quantile8Bit()):
        msg = good_msg(codec)
        payload = bytearray(msg["payload"])
        payload[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
        with pytest.raises(PayloadValueError):
            CompressedTensor.from_msg({**msg, "payload": bytes(payload)}, max_numel=300)


def test_a_raw_bool_payload_holds_only_0_and_1():
    """Found by the decoder fuzzer: byte 3 in a raw bool tensor decoded to a bool torch
    mishandles (it re-encodes as 1, so the message did not survive its own round trip)."""
    from compression import NoCompression

    msg = NoCompression().compress(torch.tensor([False, True, True])).to_msg()
    assert bytes(msg["payload"]) == b"\x00\x01\x01"
    assert parse_and_decode(msg).tolist() == [False, True, True]
    with pytest.raises(PayloadValueError, match="only 0 and 1"):
        parse_and_decode({**msg, "payload": b"\x00\x01\x03"})


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, len(all_codecs()) - 1), data=st.data())
def test_random_corruption_never_crashes(which, data):
    msg = good_msg(all_codecs()[which], n=64)
    payload = bytearray(msg["payload"])
    if payload:
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    payload = payload[:cut] if data.draw(st.booleans()) else payload
    meta = dict(msg["meta"])
    if meta and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(meta)))
        meta[key] = data.draw(st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.none()))
    raw = msgpack.packb({**msg, "payload": bytes(payload), "meta": meta})
    try:
        y = parse_and_decode(msgpack.unpackb(raw))
    except CompressionError:
        return
    assert y.shape == (64,) and y.dtype == torch.float32
