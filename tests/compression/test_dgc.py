"""DGC momentum correction, factor masking, clipping and the density warm-up."""

import pytest
import torch

from compression import DGCMomentum, decompress, dgc_density_schedule


def grads(steps, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16])
def test_sent_plus_accumulation_equals_pushed_velocity(masking, value_dtype):
    dgc = DGCMomentum(momentum=0.9, density=0.01, masking=masking, value_dtype=value_dtype, seed=0)
    pushed = torch.zeros(20_000, dtype=torch.float64)
    sent = torch.zeros(20_000, dtype=torch.float64)
    for g in grads(25, 20_000):
        u_prev = dgc.velocity("w")
        u_prev = torch.zeros(20_000) if u_prev is None else u_prev.clone()
        pushed += (0.9 * u_prev + g).double()
        ct = dgc.compress(g, "w")
        sent += decompress(ct).double()
        assert 160 <= ct.meta["k"] <= 260
    v = dgc.accumulation("w").double()
    assert torch.allclose(sent + v, pushed, atol=1e-3)


def test_density_one_without_masking_is_dense_momentum_sgd():
    dgc = DGCMomentum(momentum=0.8, density=1.0, masking=False)
    u = torch.zeros(300)
    for g in grads(10, 300, seed=4):
        u = 0.8 * u + g
        out = decompress(dgc.compress(g.view(3, 100), "p"))
        assert out.shape == (3, 100)
        assert torch.allclose(out.view(-1), u, atol=1e-6)


def test_masking_clears_velocity_of_sent_entries():
    dgc = DGCMomentum(momentum=0.9, density=0.1, masking=True, seed=0)
    ct = dgc.compress(torch.randn(1000), "m")
    mask = decompress(ct) != 0
    assert torch.count_nonzero(dgc.velocity("m")[mask]) == 0
    assert torch.count_nonzero(dgc.accumulation("m")[mask]) == 0


def test_local_clipping_scales_by_sqrt_workers():
    dgc = DGCMomentum(momentum=0.0, density=1.0, clip_norm=2.0, num_workers=4, masking=False)
    out = decompress(dgc.compress(torch.full((100,), 10.0), "c"))
    assert float(out.norm()) == pytest.approx(1.0, rel=1e-5)


def test_warmup_schedule():
    expected = [0.25, 0.0625, 0.015625, 0.0039, 0.001]
    got = [dgc_density_schedule(e) for e in range(5)]
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=0.03)
    assert dgc_density_schedule(100) == 0.001
    assert dgc_density_schedule(0.5) == 0.25


def test_state_round_trip():
    dgc = DGCMomentum(density=0.05, seed=0)
    for g in grads(3, 500):
        dgc.compress(g, "x")
    other = DGCMomentum(density=0.5)
    other.load_state_dict(dgc.state_dict())
    assert other.density == 0.05
    assert torch.equal(other.velocity("x"), dgc.velocity("x"))
