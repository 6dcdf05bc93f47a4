"""SizeAdaptive / RoleAdaptive selection and the GraVAC controller."""

import pytest
import torch

from compression import (
    Blockwise8Bit,
    ErrorFeedback,
    Float16,
    GraVAC,
    NoCompression,
    RoleAdaptive,
    SizeAdaptive,
    TopK,
    compression_gain,
    decompress,
    exponential_factors,
)


def test_size_adaptive_picks_by_numel_and_works_under_error_feedback():
    codec = SizeAdaptive(small=NoCompression(), large=TopK(0.01), threshold_numel=1000)
    assert codec.compress(torch.randn(999)).codec_id == NoCompression.codec_id
    assert codec.compress(torch.randn(1000)).codec_id == TopK.codec_id
    ef = ErrorFeedback(codec)
    ef.compress(torch.randn(10), "bias")
    ef.compress(torch.randn(5000), "weight")
    assert torch.count_nonzero(ef.residual("bias")) == 0
    assert torch.count_nonzero(ef.residual("weight")) > 0


def test_role_adaptive():
    codec = RoleAdaptive(Float16(), gradient=TopK(0.1), optimizer=Blockwise8Bit())
    x = torch.randn(100)
    assert codec.compress(x, role="gradient").codec_id == TopK.codec_id
    assert codec.compress(x, role="optimizer").codec_id == Blockwise8Bit.codec_id
    assert codec.compress(x, role="other").codec_id == Float16.codec_id
    assert codec.compress(x).codec_id == Float16.codec_id


def test_gain_is_one_for_dense_and_non_increasing_in_factor():
    gen = torch.Generator().manual_seed(0)
    for x in [torch.randn(20_000, generator=gen), torch.randn(20_000, generator=gen) ** 3]:
        assert compression_gain(x, decompress(NoCompression().compress(x))) == 1.0
        gains = []
        for factor in [1, 2, 10, 20, 100, 1000]:
            y = decompress(TopK(1 / factor, exact=True, value_dtype=torch.float32).compress(x))
            gains.append(compression_gain(x, y))
        assert gains[0] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(gains, gains[1:], strict=False))
    assert compression_gain(torch.zeros(5), torch.zeros(5)) == 1.0


def test_multilevel_topk_equals_direct_topk_at_product_factor():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    first = TopK(1 / 10, seed=0)  # DGC selection at 10x
    idx1 = first.select(x)
    k2 = 50_000 // 200
    idx2 = idx1[torch.topk(x.abs()[idx1], k2).indices].sort().values  # 20x more on top of it
    direct = torch.topk(x.abs(), k2).indices.sort().values  # 200x directly
    assert torch.equal(idx2, direct)


def test_exponential_factors():
    assert exponential_factors(10, 1000) == [10, 20, 40, 80, 160, 320, 640, 1000]
    assert exponential_factors(4, 4) == [4]


def sparse_stream(n, gen):
    g = torch.randn(n, generator=gen) * 1e-3
    g[torch.randint(n, (5,), generator=gen)] = 100.0
    return g


def dense_stream(n, gen):
    return torch.randn(n, generator=gen)


def test_gravac_raises_factor_while_gain_is_high_and_falls_back_when_it_drops():
    gen = torch.Generator().manual_seed(0)
    ctl = GraVAC(theta_min=10, theta_max=1000, window=4, epsilon=0.9, ema=0.5, seed=0)
    n = 10_000
    seen = []
    for _ in range(60):
        ct = ctl.compress(sparse_stream(n, gen), key="w")
        seen.append(ctl.theta_c)
        assert ct.codec_id == TopK.codec_id
    assert ctl.theta_c == 1000 and ctl.theta_min > 10
    assert seen == sorted(seen)  # only ever went up on this stream
    assert ctl.compress(sparse_stream(n, gen), key="w").meta["k"] <= n // 1000

    choices = []
    for _ in range(80):  # dense Gaussian: top-k keeps far less than 90% of the energy
        ctl.compress(dense_stream(n, gen), key="w")
        choices.append(ctl.last_choice)
    assert ctl.theta_min == 10 and ctl.theta_c <= 20
    assert choices[-1] == "dense"
    # dense sends everything: the residual is cleared
    assert torch.count_nonzero(ctl._residuals["w"]) == 0


def test_gravac_error_feedback_invariant_and_state():
    gen = torch.Generator().manual_seed(2)
    ctl = GraVAC(theta_min=4, theta_max=64, window=3, epsilon=0.5, ema=0.5, seed=1)
    total_in = torch.zeros(4000, dtype=torch.float64)
    total_out = torch.zeros(4000, dtype=torch.float64)
    for i in range(20):
        x = sparse_stream(4000, gen) if i % 2 else dense_stream(4000, gen)
        total_in += x.double()
        total_out += decompress(ctl.compress(x, key=1)).double()
    assert torch.allclose(total_out + ctl._residuals[1].double(), total_in, atol=1e-3)
    clone = GraVAC(theta_min=4, theta_max=64, window=3, epsilon=0.5, ema=0.5)
    clone.load_state_dict(ctl.state_dict())
    assert (clone.theta_min, clone.theta_c, clone.calls) == (ctl.theta_min, ctl.theta_c, ctl.calls)


def test_gravac_as_codec_under_outer_error_feedback():
    """The averager applies error feedback itself: GraVAC as a plain codec inside it."""
    from compression import TwoWayCompression

    gen = torch.Generator().manual_seed(3)
    ctl = GraVAC(theta_min=10, theta_max=1000, window=4, epsilon=0.9, ema=0.5, seed=0)
    two_way = TwoWayCompression(ctl.as_codec(), Float16())
    total_in = torch.zeros(10_000, dtype=torch.float64)
    total_out = torch.zeros(10_000, dtype=torch.float64)
    for _ in range(40):
        x = sparse_stream(10_000, gen)
        total_in += x.double()
        total_out += decompress(two_way.compress_send(x, key=(0, 0))).double()
    assert ctl.theta_c == 1000 and ctl.calls == 40  # the shared controller moved up
    residual = two_way.sender.residual((0, 0)).double()
    assert torch.allclose(total_out + residual, total_in, atol=1e-3)
    assert len(ctl._residuals) == 0  # no second residual inside the codec
