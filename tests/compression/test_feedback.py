"""Error feedback: the sum invariant for every codec, state handling, two-way compression."""

import io

import pytest
import torch

from compression import (
    CompressionError,
    ErrorFeedback,
    Float16,
    NoCompression,
    RandomK,
    TopK,
    TwoWayCompression,
    decompress,
)

from .conftest import all_codecs


def stream(steps, shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * (1 + i % 3)).to(dtype) for i in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_decoded_plus_residual_equals_sum_of_inputs(codec, dtype, device):
    ef = ErrorFeedback(codec)
    inputs = stream(30, (17, 29), dtype=dtype)
    total_in = torch.zeros(17, 29, dtype=torch.float64)
    total_out = torch.zeros(17, 29, dtype=torch.float64)
    for x in inputs:
        ct = ef.compress(x.to(device), key="w")
        total_in += x.double()
        total_out += decompress(ct).double()  # what a receiver decodes (any device)
    residual = ef.residual("w")
    assert residual.dtype == torch.float32 and residual.device.type == device
    err = (total_out + residual.cpu().double() - total_in).abs().max()
    assert err <= 1e-4 * total_in.abs().max()


def test_lossless_codec_leaves_no_residual():
    ef = ErrorFeedback(NoCompression())
    x = torch.randn(100)
    ct = ef.compress(x, 0)
    assert torch.equal(decompress(ct), x) and torch.count_nonzero(ef.residual(0)) == 0


def test_error_feedback_resends_what_topk_dropped():
    ef = ErrorFeedback(TopK(0.5, exact=True, value_dtype=torch.float32))
    x = torch.tensor([4.0, 3.0, 2.0, 1.0])
    first = decompress(ef.compress(x, "k"))
    assert torch.equal(first, torch.tensor([4.0, 3.0, 0.0, 0.0]))
    second = decompress(ef.compress(torch.zeros(4), "k"))
    assert torch.equal(second, torch.tensor([0.0, 0.0, 2.0, 1.0]))
    assert torch.count_nonzero(ef.residual("k")) == 0


def test_a_decaying_residual_is_the_decayed_sum_of_what_was_not_sent():
    """decay=β (SparseLoCo): e <- β e + x; sent = C(e); e <- e - sent. Over steps the
    residual is then sum over t of β^(T-t) (x_t - sent_t): what was dropped fades by β a
    round instead of landing in full, however late. A snapshot keeps the residual it saw."""
    beta = 0.5
    ef = ErrorFeedback(TopK(0.25, exact=True, value_dtype=torch.float32), decay=beta)
    inputs = stream(12, (64,), seed=3)
    expected = torch.zeros(64, dtype=torch.float64)
    for x in inputs:
        snapshot = ef.snapshot()
        kept = {k: v.clone() for k, v in snapshot.items()}
        sent = decompress(ef.compress(x, "w")).double()
        expected = beta * expected + x.double() - sent
        assert all(torch.equal(snapshot[k], v) for k, v in kept.items())  # not in place
    assert torch.allclose(ef.residual("w").double(), expected, atol=1e-5)
    # with β = 1 the same stream leaves the plain sum of what was dropped
    plain = ErrorFeedback(TopK(0.25, exact=True, value_dtype=torch.float32))
    sent_total = sum(decompress(plain.compress(x, "w")).double() for x in inputs)
    assert torch.allclose(
        plain.residual("w").double(), sum(x.double() for x in inputs) - sent_total, atol=1e-5
    )
    assert not torch.allclose(ef.residual("w"), plain.residual("w"), atol=1e-2)


@pytest.mark.parametrize("decay", [-0.1, 1.5, float("nan"), True, "0.9"])
def test_a_decay_outside_zero_to_one_is_refused(decay):
    with pytest.raises(ValueError, match="decay must be in"):
        ErrorFeedback(TopK(0.5), decay=decay)
    ef = ErrorFeedback(TopK(0.5), decay=0.9)
    with pytest.raises(ValueError, match="decay must be in"):
        ef.decay = decay  # set later (as DiLoCo does on a codec's sender): checked as well
    assert ef.decay == 0.9


def test_keys_are_independent_and_shape_change_is_an_error():
    ef = ErrorFeedback(TopK(0.25, exact=True))
    ef.compress(torch.randn(8), (0, 0))
    ef.compress(torch.randn(16), (0, 1))
    assert ef.residual((0, 0)).shape == (8,) and ef.residual((0, 1)).shape == (16,)
    with pytest.raises(CompressionError):
        ef.compress(torch.randn(9), (0, 0))
    ef.reset((0, 0))
    ef.compress(torch.randn(9), (0, 0))
    ef.reset()
    assert len(ef) == 0


def test_state_dict_round_trip_through_torch_save():
    ef = ErrorFeedback(TopK(0.1, exact=True))
    for x in stream(3, (50,)):
        ef.compress(x, ("part", 3))
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    restored = ErrorFeedback(TopK(0.1, exact=True))
    restored.load_state_dict(torch.load(buf))
    assert torch.equal(restored.residual(("part", 3)), ef.residual(("part", 3)))
    x = torch.randn(50)
    assert torch.equal(
        decompress(restored.compress(x, ("part", 3))), decompress(ef.compress(x, ("part", 3)))
    )
    with pytest.raises(CompressionError):
        restored.load_state_dict({"residuals": {"a": torch.zeros(3, dtype=torch.int64)}})


def test_random_k_seed_is_forwarded():
    ef = ErrorFeedback(RandomK(0.1))
    a = ef.compress(torch.randn(1000), "a", seed=42)
    assert a.meta["seed"] == 42


@pytest.mark.parametrize("which", range(len(all_codecs())))
def test_two_way_invariant_on_both_sides(which):
    """Simulated butterfly part: 3 senders -> reducer (mean) -> back, many rounds."""
    back = TopK(0.1, seed=1)
    two_way = [TwoWayCompression(all_codecs()[which], back) for _ in range(3)]
    reducer_side = TwoWayCompression(all_codecs()[which], all_codecs()[which])
    inputs = [stream(12, (64,), seed=p) for p in range(3)]
    sent_sum = [torch.zeros(64, dtype=torch.float64) for _ in range(3)]
    reduced_in = torch.zeros(64, dtype=torch.float64)
    returned = torch.zeros(64, dtype=torch.float64)
    for step in range(12):
        parts = []
        for p in range(3):
            ct = two_way[p].compress_send(inputs[p][step], key=(0, 0))
            decoded = decompress(ct)
            sent_sum[p] += decoded.double()
            parts.append(decoded)
        mean = torch.stack(parts).mean(0)
        reduced_in += mean.double()
        returned += decompress(reducer_side.compress_reduced(mean, key=(0, 0))).double()
    for p in range(3):
        total = sum(x.double() for x in inputs[p])
        assert torch.allclose(
            sent_sum[p] + two_way[p].sender.residual((0, 0)).double(), total, atol=1e-4
        )
    residual = reducer_side.reducer.residual((0, 0)).double()
    assert torch.allclose(returned + residual, reduced_in, atol=1e-4)


def test_lr_rescale_of_sender_residuals():
    tw = TwoWayCompression(TopK(0.1, exact=True), Float16(), rescale_by_lr=True)
    tw.set_lr(0.1)
    tw.compress_send(torch.randn(100), "p")
    before = tw.sender.residual("p").clone()
    tw.set_lr(0.05)  # lr halves: the old residual must count twice as much
    assert torch.allclose(tw.sender.residual("p"), before * 2)
    tw.set_lr(0.05)
    assert torch.allclose(tw.sender.residual("p"), before * 2)
    plain = TwoWayCompression(TopK(0.1), Float16())
    plain.set_lr(0.1)
    plain.compress_send(torch.randn(100), "p")
    r = plain.sender.residual("p").clone()
    plain.set_lr(1.0)
    assert torch.equal(plain.sender.residual("p"), r)
    state = tw.state_dict()
    fresh = TwoWayCompression(TopK(0.1), Float16(), rescale_by_lr=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.sender.residual("p"), tw.sender.residual("p"))


def test_snapshot_and_restore_undo_what_was_compressed_since():
    """A round that fails after sending: restoring the snapshot makes its messages count as
    never sent, on both sides; a later rescale does not reach into the snapshot."""
    spec = TwoWayCompression(TopK(0.25, exact=True), TopK(0.25, exact=True))
    spec.compress_send(torch.tensor([1.0, 2.0, 3.0, 4.0]), "a")
    spec.reducer.compress(torch.tensor([5.0, 6.0, 7.0, 8.0]), "a")
    saved = spec.snapshot()
    kept = {
        side: {k: v.clone() for k, v in residuals.items()}
        for side, residuals in zip(("sender", "reducer"), saved, strict=True)
    }
    spec.compress_send(torch.tensor([40.0, 30.0, 20.0, 10.0]), "a")
    spec.compress_send(torch.ones(2), "b")
    spec.reducer.compress(torch.tensor([1.0, 1.0, 1.0, 1.0]), "a")
    spec.sender.rescale(10.0)
    spec.restore(saved)
    assert set(spec.sender._residuals) == {"a"} and set(spec.reducer._residuals) == {"a"}
    assert torch.equal(spec.sender.residual("a"), kept["sender"]["a"])
    assert torch.equal(spec.reducer.residual("a"), kept["reducer"]["a"])
    assert torch.equal(spec.sender.residual("a"), torch.tensor([1.0, 2.0, 3.0, 0.0]))
