"""Chunk payload handling: the NaN/Inf check, zero-copy float32 chunks, other codecs."""

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import CompressedTensor, Float16, NoCompression
from moshpit.averaging.allreduce_protocol import (
    ProtocolError,
    all_finite,
    decode_chunk,
    decode_cost,
    is_raw_float32,
    parse_chunk,
    raw_float32,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    data=st.data(),
    bad=st.sampled_from([math.nan, math.inf, -math.inf, None]),
)
def test_all_finite_agrees_with_isfinite(dtype, n, data, bad):
    t = (torch.randn(n, dtype=torch.float64) * 1e3).to(dtype)
    if bad is not None:
        t[data.draw(st.integers(0, n - 1))] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t) == (bad is None)


def test_all_finite_edge_cases():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.tensor([3.4e38, -3.4e38]))  # huge but finite: no overflow
    assert not all_finite(torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]))
    assert not all_finite(torch.full((1 << 18,), math.inf)[::2])  # non-contiguous view
    # the fast path (a finite sum) must not be fooled by a sum that overflows ...
    assert all_finite(torch.full((1000,), 3e38))
    # ... nor by +Inf and -Inf together (their sum is NaN, never finite)
    assert not all_finite(torch.tensor([math.inf, -math.inf, 1.0]))
    assert not all_finite(torch.cat([torch.full((999,), 3e38), torch.tensor([math.nan])]))


def _wire(ct):
    """What the receiver gets: the message through msgpack (payload becomes bytes)."""
    return msgpack.unpackb(msgpack.packb(ct.to_msg(), use_bin_type=True), raw=False)


def test_raw_float32_is_the_no_compression_message_without_a_copy():
    values = torch.randn(1000)
    ct = raw_float32(values)
    ref = NoCompression().compress(values)
    assert _wire(ct) == _wire(ref)
    assert bytes(ct.payload) == values.numpy().tobytes()
    values[0] = 42.0  # the payload aliases the values (callers keep them unmodified)
    assert torch.frombuffer(bytearray(ct.payload), dtype=torch.float32)[0] == 42.0


def test_decode_raw_float32_views_the_payload_and_still_validates():
    values = torch.randn(300)
    ct = parse_chunk({"t": "chunk", "k": 0, "ct": _wire(raw_float32(values))}, 0, 300)
    assert is_raw_float32(ct) and decode_cost(ct) < 300
    got = decode_chunk(ct, 300)
    assert torch.equal(got, values)
    assert got.data_ptr() == torch.frombuffer(ct.payload, dtype=torch.uint8).data_ptr()
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = values.clone()
        poisoned[123] = bad
        ct = parse_chunk({"t": "chunk", "k": 0, "ct": _wire(raw_float32(poisoned))}, 0, 300)
        with pytest.raises(ProtocolError, match="NaN or Inf"):
            decode_chunk(ct, 300)
    with pytest.raises(ProtocolError, match="elements"):
        parse_chunk({"t": "chunk", "k": 0, "ct": _wire(raw_float32(values))}, 0, 299)
    short = CompressedTensor(0, "float32", (300,), bytes(1196), {})
    with pytest.raises(ProtocolError):
        decode_chunk(short, 300)


def test_other_codecs_still_decode_into_new_tensors():
    values = torch.randn(500)
    ct = CompressedTensor.from_msg(_wire(Float16().compress(values)), max_numel=500)
    assert not is_raw_float32(ct) and decode_cost(ct) >= 500
    got = decode_chunk(ct, 500)
    assert got.dtype == torch.float32 and torch.allclose(got, values, atol=1e-2)
    ct64 = CompressedTensor.from_msg(_wire(NoCompression().compress(values.double())), 500)
    assert not is_raw_float32(ct64)
    assert torch.equal(decode_chunk(ct64, 500), values)
