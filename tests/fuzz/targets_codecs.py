"""Fuzz targets of the codecs' wire format: one per registered codec id.

The input is the msgpack body of a ``CompressedTensor`` message (what all-reduce and state
averaging put on the wire). Contract: ``CompressedTensor.from_msg`` and ``decompress`` /
``decompress_into`` either give a tensor of the declared shape and dtype or raise a
``CompressionError``; a message that decodes once decodes the same way after a msgpack round
trip, and NoCompression is lossless.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from compression import (
    BFloat16,
    Blockwise4Bit,
    Blockwise8Bit,
    CompressedTensor,
    CompressionError,
    Float16,
    NoCompression,
    Quantile8Bit,
    RandomK,
    ScaledFloat16,
    ScaledSign,
    TopK,
    TopK2Bit,
    Uniform8Bit,
    decompress,
    decompress_into,
)
from compression.base import _REGISTRY, EXACT_DTYPES
from dht.p2p.errors import ProtocolViolationError
from dht.p2p.messages import unpack_body

from ._harness import Target, body, register, tweaked

MAX_NUMEL = 4096  # the receiver's cap (all-reduce passes its chunk size)


def codecs() -> list:
    """A configured instance of every wire codec, some in two configurations."""
    return [
        NoCompression(),
        Float16(),
        BFloat16(),
        ScaledFloat16(),
        Uniform8Bit(),
        Uniform8Bit(range_sigmas=None),
        Quantile8Bit(seed=1),
        Blockwise8Bit(block_size=7),
        TopK(0.25, seed=1),
        TopK(0.25, value_dtype=torch.float32, exact=True),
        RandomK(0.25, seed=5),
        ScaledSign(),
        Blockwise4Bit(block_size=7),
        TopK2Bit(0.25, chunk=8),
        TopK2Bit(0.5, chunk=16),  # some messages with a bitmap index
    ]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    outliers = torch.randn(64, generator=gen)
    outliers[[3, 40]] = torch.tensor([80.0, -120.0])
    return {
        "f32": torch.randn(24, generator=gen),
        "2d": torch.randn(3, 5, generator=gen),
        "f16": torch.randn(10, generator=gen).half(),
        "outliers": outliers,
        "zeros": torch.zeros(9),
        "empty": torch.zeros(0),
    }


def _message(codec, tensor: torch.Tensor) -> dict:
    return codec.compress(tensor).to_msg()


def _seeds(codec_id: int) -> dict[str, bytes]:
    seeds = {}
    for index, codec in enumerate(codecs()):
        if codec.codec_id != codec_id:
            continue
        for name, tensor in _tensors().items():
            seeds[f"{index}-{name}"] = body(_message(codec, tensor))
    if codec_id == NoCompression.codec_id:
        seeds["int64"] = body(_message(NoCompression(), torch.arange(6)))
        seeds["bool"] = body(_message(NoCompression(), torch.tensor([True, False, True])))
    return seeds


def _valid(codec_id: int) -> st.SearchStrategy[bytes]:
    # codecs are rebuilt per example: TopK and Uniform8Bit draw from a generator of their own,
    # which would make hypothesis' replays differ from the first run
    mine = [i for i, c in enumerate(codecs()) if c.codec_id == codec_id]
    values = st.lists(st.floats(-1e4, 1e4, width=32), max_size=40)
    messages = st.builds(
        lambda i, vals: _message(codecs()[i], torch.tensor(vals, dtype=torch.float32)),
        st.sampled_from(mine),
        values,
    )
    return st.one_of(messages.map(body), tweaked(messages))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def check_codec(data: bytes) -> None:
    try:
        msg = unpack_body(data)
    except ProtocolViolationError:
        return
    try:
        ct = CompressedTensor.from_msg(msg, max_numel=MAX_NUMEL)
    except CompressionError:
        return
    assert ct.numel <= MAX_NUMEL
    again = CompressedTensor.from_msg(unpack_body(body(ct.to_msg())), max_numel=MAX_NUMEL)
    assert again.to_msg().keys() == ct.to_msg().keys() and bytes(again.payload) == bytes(ct.payload)
    try:
        values = decompress(ct)
    except CompressionError:
        values = None
    else:
        assert tuple(values.shape) == ct.shape and values.dtype == EXACT_DTYPES[ct.dtype]
    out = torch.empty(ct.numel, dtype=torch.float32)
    try:
        decompress_into(ct, out)
    except CompressionError:
        assert values is None, "decompress accepted what decompress_into refused"
    else:
        assert values is not None, "decompress_into accepted what decompress refused"
        # the same values, up to the rounding of the cast into ``out``
        flat = values.reshape(-1)
        assert _same_values(flat.to(torch.float32), out.to(flat.dtype).to(torch.float32))
    if values is not None and ct.codec_id == NoCompression.codec_id:
        assert bytes(NoCompression().compress(values).payload) == bytes(ct.payload)


for _codec_id, _cls in sorted(_REGISTRY.items()):
    register(
        Target(
            f"codec_{_cls.__name__}",
            "codecs",
            check_codec,
            seeds=lambda cid=_codec_id: _seeds(cid),
            valid=lambda cid=_codec_id: _valid(cid),
        )
    )
