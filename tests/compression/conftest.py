"""Shared fixtures: every wire codec, the devices available on this machine."""

import pytest
import torch

from compression import (
    BFloat16,
    Blockwise4Bit,
    Blockwise8Bit,
    Float16,
    NoCompression,
    Quantile8Bit,
    RandomK,
    ScaledFloat16,
    ScaledSign,
    TopK,
    TopK2Bit,
    Uniform8Bit,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def all_codecs():
    """One configured instance of every wire codec (fresh per call: some have state)."""
    return [
        NoCompression(),
        Float16(),
        BFloat16(),
        ScaledFloat16(),
        Uniform8Bit(),
        Uniform8Bit(range_sigmas=None),
        Uniform8Bit(outliers=False),
        Quantile8Bit(seed=1),
        Blockwise8Bit(),
        Blockwise8Bit(block_size=7),
        Blockwise4Bit(),
        Blockwise4Bit(block_size=7),
        TopK(0.1, seed=1),
        TopK(0.1, value_dtype=torch.float32, exact=True),
        RandomK(0.1, seed=5),
        ScaledSign(),
        TopK2Bit(),  # 4096-value chunks: the tests' small tensors are one short chunk
        TopK2Bit(0.1, chunk=64),
        TopK2Bit(0.5, chunk=16),  # dense enough that the bitmap is the smaller index
    ]


CODEC_IDS = [repr(c) for c in all_codecs()]


@pytest.fixture(params=range(len(CODEC_IDS)), ids=CODEC_IDS)
def codec(request):
    return all_codecs()[request.param]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
