"""Blockwise4Bit: half a 4-bit step of error per block, 4.5 bits per value, strict payloads."""

import pytest
import torch

from compression import (
    Blockwise4Bit,
    CompressedTensor,
    ErrorFeedback,
    NonFiniteInputError,
    PayloadSizeError,
    PayloadValueError,
    decompress,
)


def _blocks(t: torch.Tensor, bs: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((-t.numel()) % bs)]).view(-1, bs)


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 10_001])
def test_error_within_half_a_step_of_each_block(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(3) * 50
    y = decompress(Blockwise4Bit(block_size=64).compress(x))
    xb, yb = _blocks(x, 64), _blocks(y, 64)
    half_step = xb.abs().amax(dim=1, keepdim=True) / 7 / 2
    assert bool(((yb - xb).abs() <= half_step * 1.0001 + 1e-30).all())
    # the extremes of every block come back exactly (codes +-7 are +-absmax)
    top = xb.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(yb.gather(1, top), xb.gather(1, top))


def test_four_and_a_half_bits_per_value():
    x = torch.randn(2**20)
    assert 8 * Blockwise4Bit().compress(x).nbytes / x.numel() == 4.5


def test_error_feedback_carries_what_4_bits_dropped():
    """sum(decoded) + residual == sum(pushed in): over rounds nothing is lost."""
    feedback = ErrorFeedback(Blockwise4Bit())
    pushed, received = torch.zeros(1000), torch.zeros(1000)
    for step in range(20):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        pushed += g
        _, decoded = feedback.compress_with_decoded(g, "k")
        received += decoded
    torch.testing.assert_close(received + feedback.residual("k"), pushed, rtol=0, atol=1e-4)


def test_nan_input_is_refused():
    with pytest.raises(NonFiniteInputError):
        Blockwise4Bit().compress(torch.tensor([1.0, float("nan")]))


def _wire(msg: dict) -> torch.Tensor:
    return decompress(CompressedTensor.from_msg(msg, max_numel=10_000))


def test_bad_payloads_are_specific_errors():
    msg = Blockwise4Bit(block_size=16).compress(torch.randn(33)).to_msg()
    payload = bytes(msg["payload"])
    assert len(payload) == 3 * 4 + 17
    with pytest.raises(PayloadSizeError):
        _wire({**msg, "payload": payload[:-1]})
    nan_scale = torch.tensor([float("nan")]).numpy().tobytes() + payload[4:]
    with pytest.raises(PayloadValueError, match="scales"):
        _wire({**msg, "payload": nan_scale})
    for bad in (0x0F, 0xF0):  # nibble 15 is no code (codes are 0..14)
        with pytest.raises(PayloadValueError, match="4-bit codes"):
            _wire({**msg, "payload": payload[:12] + bytes([bad]) + payload[13:]})
