"""Codecs and the memory they reuse or leave uninitialized: the 8-bit codecs' per-thread
scratch buffers never change a result, and no payload byte comes from uninitialized memory
(a payload goes to other peers: stale heap bytes there would leak this process's data)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import compression
from compression import Blockwise8Bit, Quantile8Bit, Uniform8Bit, _bytes, decompress
from compression.quantization import _not_equal, _scratch


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    heavy = torch.randn(300_000, generator=gen)
    heavy[::997] *= 50  # outliers beyond 4 sigma: Uniform8Bit's outlier path
    return [heavy, torch.randn(70_001, generator=gen) * 3 + 1, torch.rand(1 << 18, generator=gen)]


def _payloads(codec_type, tensors) -> list[bytes]:
    return [bytes(codec_type().compress(t).payload) for t in tensors]


def test_interleaved_calls_in_threads_give_the_serial_results():
    tensors = _tensors()
    for codec_type in (Uniform8Bit, Quantile8Bit, Blockwise8Bit):
        expected = _payloads(codec_type, tensors)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            runs = [pool.submit(_payloads, codec_type, tensors[::-1]) for _ in range(8)]
            for run in runs:
                assert run.result() == expected[::-1], codec_type.__name__
        # and decoding (which also uses scratch) round-trips each of them the same way
        for t in tensors:
            ct = codec_type().compress(t)
            assert torch.equal(decompress(ct), decompress(codec_type().compress(t)))


def test_scratch_is_per_thread_and_per_slot():
    cpu = torch.device("cpu")
    a, b = _scratch(1000, cpu), _scratch(1000, cpu, slot=1)
    assert a.data_ptr() != b.data_ptr()
    assert _scratch(500, cpu).data_ptr() == a.data_ptr()  # reused, not reallocated
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: _scratch(1000, cpu).data_ptr()).result()
    assert other != a.data_ptr()


def test_not_equal_matches_torch_ne():
    x = torch.tensor([0.0, 1.0, float("nan"), -0.0, 255.999, 3.0])
    y = torch.tensor([0.0, 2.0, float("nan"), 0.0, 255.999, float("inf")])
    out = torch.empty(6, dtype=torch.bool)
    assert torch.equal(_not_equal(x, y, out), torch.ne(x, y))


@pytest.mark.parametrize(
    "make",
    [
        Uniform8Bit,
        Quantile8Bit,
        Blockwise8Bit,
        compression.Float16,
        compression.BFloat16,
        compression.ScaledFloat16,
        lambda: compression.TopK(0.01, seed=3),
        lambda: compression.RandomK(0.01, seed=3),
        compression.ScaledSign,
        lambda: compression.TopK2Bit(0.01),
        lambda: compression.TopK2Bit(0.4, chunk=32),  # bitmap index
    ],
)
def test_no_payload_byte_is_left_uninitialized(make, monkeypatch):
    """Payload buffers come from ``_bytes.alloc`` (uninitialized): filled with two different
    patterns first, every codec must still produce the same bytes."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70_001, generator=gen)  # odd length: Uniform8Bit pads before outliers
    x[::997] *= 50
    payloads = []
    for pattern in (0xAA, 0x55):

        def alloc(nbytes: int, pattern: int = pattern) -> torch.Tensor:
            return torch.full((nbytes,), pattern, dtype=torch.uint8)

        monkeypatch.setattr(_bytes, "alloc", alloc)
        payloads.append(bytes(make().compress(x).payload))
    assert payloads[0] == payloads[1]
