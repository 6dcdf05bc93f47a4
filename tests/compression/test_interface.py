"""The fixed interface from docs/internal-api.md: names, msgpack round trip, dispatch."""

import msgpack
import pytest
import torch

import compression
from compression import CompressedTensor, codec_from_id, decompress

API = [
    "Codec", "CompressedTensor", "CompressionError", "decompress", "codec_from_id",
    "NoCompression", "Float16", "BFloat16", "ScaledFloat16", "ErrorFeedback",
    "TwoWayCompression",
]  # fmt: skip


def test_api_names_exported():
    for name in API:
        assert hasattr(compression, name), name


@pytest.mark.parametrize("codec_id", [0, 1, 2, 3])
def test_msgpack_round_trip_and_dispatch(codec_id):
    codec = codec_from_id(codec_id)
    x = torch.randn(7, 3)
    ct = codec.compress(x)
    wire = msgpack.packb(ct.to_msg())
    ct2 = CompressedTensor.from_msg(msgpack.unpackb(wire), max_numel=21)
    y = decompress(ct2)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y, x, rtol=1e-2, atol=1e-2)
