"""Round trips of every codec: shape/dtype exact, error bounds, NaN/Inf policy."""

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import (
    BFloat16,
    Blockwise8Bit,
    CompressedTensor,
    Float16,
    NoCompression,
    NonFiniteInputError,
    Quantile8Bit,
    ScaledFloat16,
    Uniform8Bit,
    decompress,
)

from .conftest import DEVICES, all_codecs

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple),
    st.tuples(st.integers(1, 2), st.integers(1000, 5000)),  # long last dim
)
fill = st.sampled_from(["gauss", "zeros", "const", "tiny", "huge"])


def make(shape, kind, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(shape, generator=gen)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "const":
        x = torch.full(shape, -3.25)
    elif kind == "tiny":
        x = torch.randn(shape, generator=gen) * 1e-7
    else:
        x = torch.randn(shape, generator=gen) * 1e4
    return x.to(dtype).to(device)


def wire(ct, max_numel):
    """Through msgpack and the validating parser, as a peer would receive it."""
    return CompressedTensor.from_msg(msgpack.unpackb(msgpack.packb(ct.to_msg())), max_numel)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes,
    kind=fill,
    dtype=st.sampled_from(FLOATS),
    device=st.sampled_from(DEVICES),
    which=st.integers(0, len(all_codecs()) - 1),
)
def test_round_trip_shape_dtype_exact(shape, kind, dtype, device, which):
    codec = all_codecs()[which]
    x = make(shape, kind, dtype, device)
    ct = codec.compress(x)
    y = decompress(wire(ct, max(1, x.numel())), device=device)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == device
    assert bool(torch.isfinite(y).all())
    if x.numel() and kind in ("zeros", "const") and codec.codec_id not in (7, 8, 11):
        # zeros and constants are represented exactly by every dense codec
        assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_no_compression_is_bit_exact(dtype, device):
    x = (torch.randn(33, 5) * 50).to(dtype).to(device)
    y = decompress(wire(NoCompression().compress(x), x.numel()), device=device)
    assert y.dtype == dtype and torch.equal(y, x)


def rel_err(x, y):
    return float((x.double() - y.double()).norm() / x.double().norm())


# Relative L2 error bounds on Gaussian data (n = 2**16).
BOUNDS = [
    (Float16(), 1e-3),
    (ScaledFloat16(), 1e-3),
    (BFloat16(), 5e-3),
    (Uniform8Bit(), 1e-2),
    (Uniform8Bit(range_sigmas=None), 2e-2),
    (Uniform8Bit(outliers=False), 1e-2),
    (Quantile8Bit(), 1e-2),
    (Blockwise8Bit(), 1e-2),
]


@pytest.mark.parametrize("codec,bound", BOUNDS, ids=[repr(c) for c, _ in BOUNDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_bounds_on_gaussian(codec, bound, dtype, device):
    x = torch.randn(2**16, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    y = decompress(codec.compress(x), device=device)
    assert rel_err(x, y) <= bound


def test_blockwise_beats_uniform_on_gaussian_and_heavy_tails():
    gen = torch.Generator().manual_seed(0)
    for x in [torch.randn(2**16, generator=gen), torch.randn(2**16, generator=gen) ** 3]:
        bw = rel_err(x, decompress(Blockwise8Bit().compress(x)))
        for uniform in (Uniform8Bit(), Uniform8Bit(range_sigmas=None)):
            assert bw < rel_err(x, decompress(uniform.compress(x)))


def test_scaled_fp16_keeps_tiny_and_huge_values():
    x = torch.randn(1000) * 1e-7
    assert rel_err(x, decompress(ScaledFloat16().compress(x))) < 1e-3
    assert rel_err(x, decompress(Float16().compress(x))) > 1e-2  # plain fp16 flushes them
    x = torch.randn(1000) * 1e6
    assert rel_err(x, decompress(ScaledFloat16().compress(x))) < 1e-3


def test_bits_per_value_of_8bit_codecs():
    x = torch.randn(2**20)
    for codec in [Uniform8Bit(), Quantile8Bit(), Blockwise8Bit()]:
        assert 8 * codec.compress(x).nbytes / x.numel() <= 8.25


# NaN/Inf policy (docs/compression.md): casts keep NaN; Float16 saturates Inf; BFloat16
# and NoCompression keep Inf; every quantizer/sparsifier raises NonFiniteInputError.
SPECIAL = torch.tensor([1.0, math.inf, -math.inf, math.nan, 1e30, -2.0])


def test_nan_inf_policy_of_casts():
    y = decompress(Float16().compress(SPECIAL))
    assert y[1] == 65504 and y[2] == -65504 and math.isnan(y[3]) and y[4] == 65504
    for codec in (NoCompression(), BFloat16()):
        y = decompress(codec.compress(SPECIAL))
        assert y[1] == math.inf and y[2] == -math.inf and math.isnan(y[3])


REJECTING = [c for c in all_codecs() if c.codec_id not in (0, 1, 2)]  # all but the casts


@pytest.mark.parametrize("codec", REJECTING, ids=[repr(c) for c in REJECTING])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_lossy_codecs_reject_non_finite(codec, special, device):
    for n in (1, 300, 5000):
        x = torch.randn(n)
        x[n // 2] = special
        with pytest.raises(NonFiniteInputError):
            codec.compress(x.to(device))


@pytest.mark.parametrize("which", range(len(all_codecs())))
def test_sliced_processing_matches_single_pass(which, monkeypatch):
    """Big CPU tensors stream through CHUNK-sized slices; the bytes must not depend on it."""
    import compression._bytes as b

    x = torch.randn(3 * 4096 + 1000, generator=torch.Generator().manual_seed(9)) ** 3
    monkeypatch.setattr(b, "slice_elems", lambda device: 4096)  # slices plus a ragged tail
    sliced = all_codecs()[which].compress(x, **_seed(which))
    y_sliced = decompress(sliced)
    monkeypatch.setattr(b, "slice_elems", lambda device: 1 << 30)
    whole = all_codecs()[which].compress(x, **_seed(which))
    assert bytes(sliced.payload) == bytes(whole.payload)
    if sliced.codec_id == 9:  # ScaledSign's L1 is summed per slice: float rounding differs
        assert sliced.meta["scale"] == pytest.approx(whole.meta["scale"], rel=1e-6)
        assert torch.allclose(y_sliced, decompress(whole), rtol=1e-6)
    else:
        assert sliced.meta == whole.meta and torch.equal(y_sliced, decompress(whole))


def _seed(which):
    return {"seed": 7} if all_codecs()[which].codec_id == 8 else {}


def test_quantile_lookup_table_matches_binary_search():
    gen = torch.Generator().manual_seed(4)
    for x in [torch.randn(300_000, generator=gen), torch.randn(300_000, generator=gen) ** 3]:
        ct = Quantile8Bit().compress(x)
        levels = torch.frombuffer(bytearray(ct.payload[:1024]), dtype=torch.float32)
        exact = levels[torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)]
        y = decompress(ct)
        assert float((y != exact).float().mean()) <= 1e-4
        assert rel_err(x, y) <= rel_err(x, exact) * 1.001


def test_float64_beyond_float32_range_is_rejected_by_lossy_codecs():
    x = torch.tensor([1.0, 1e300, -2.0], dtype=torch.float64)
    for codec in REJECTING:
        with pytest.raises(NonFiniteInputError):
            codec.compress(x)
    assert decompress(Float16().compress(x))[1] == 65504  # saturates, per its policy


def test_codecs_are_safe_to_share_between_threads():
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(20_000, generator=gen) for _ in range(16)]
    for codec in all_codecs():
        expected = [decompress(codec.compress(x, **_seed_for(codec))) for x in inputs]
        with ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(lambda x, c=codec: decompress(c.compress(x, **_seed_for(c))), inputs)
            )
        for x, e, g in zip(inputs, expected, got, strict=True):
            if codec.codec_id == 5 or getattr(codec, "range_sigmas", None):
                # sampled codebook or range: same quality, not the same bytes
                assert rel_err(x, g) <= 1.05 * rel_err(x, e) + 1e-3
            elif codec.codec_id == 7 and not codec.exact:  # sampled threshold: DGC bounds
                kept = g != 0
                assert 1600 <= int(kept.sum()) <= 2600
                assert torch.allclose(g[kept], x[kept], rtol=1e-3)
            else:
                assert torch.equal(e, g)


def _seed_for(codec):
    return {"seed": 11} if codec.codec_id == 8 else {}


@pytest.mark.parametrize("range_sigmas", [None, 4.0])
@pytest.mark.parametrize("offset", [0.0, -3.0, 1e4])
def test_uniform_rounds_to_nearest_level_everywhere(offset, range_sigmas):
    """Per element |error| <= step/2 (outliers exact), on the fused and large-offset paths."""
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(5)) + offset
    ct = Uniform8Bit(range_sigmas=range_sigmas).compress(x)
    step, lo = ct.meta["step"], ct.meta["lo"]
    y = decompress(ct)
    assert float((y.double() - x.double()).abs().max()) <= step / 2 * 1.001 + 1e-6 * abs(lo)
    assert float(y.min()) == pytest.approx(float(x.min()), abs=1e-6 * (1 + abs(offset)))


def test_blockwise_error_within_half_step_per_block():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(300_001, generator=gen) * torch.rand(300_001, generator=gen).pow(4) * 100
    y = decompress(Blockwise8Bit(block_size=64).compress(x))
    pad = (-x.numel()) % 64
    xb = torch.cat([x, x.new_zeros(pad)]).view(-1, 64)
    yb = torch.cat([y, y.new_zeros(pad)]).view(-1, 64)
    half_step = xb.abs().amax(dim=1, keepdim=True) / 127 / 2
    assert bool(((yb - xb).abs() <= half_step * 1.0001 + 1e-30).all())


@pytest.mark.parametrize("which", range(len(all_codecs())))
def test_non_contiguous_input_equals_contiguous(which):
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(8)).t()[::2]
    a = all_codecs()[which].compress(x, **_seed(which))
    b = all_codecs()[which].compress(x.contiguous(), **_seed(which))
    assert a.shape == (25, 64) and bytes(a.payload) == bytes(b.payload) and a.meta == b.meta
    assert torch.equal(decompress(a), decompress(b))


def test_uniform_sends_outliers_exactly_and_falls_back_on_heavy_tails():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(300_000, generator=gen)
    x[torch.randint(300_000, (40,), generator=gen)] = 1e3
    ct = Uniform8Bit().compress(x)
    assert 40 <= ct.meta["m"] <= 300 and 8 * ct.nbytes / x.numel() <= 8.02
    y = decompress(wire(ct, x.numel()))
    big = x.abs() > 100
    assert torch.equal(y[big], x[big]) and rel_err(x, y) < 1e-2
    assert ct.meta["step"] < 9.0 / 255  # the bulk kept a fine step
    clipped = decompress(Uniform8Bit(outliers=False).compress(x))
    assert float(clipped.max()) < 10  # clipped to mean + 4 std
    heavy = torch.randn(300_000, generator=gen) ** 5  # far more than 1/64 beyond 4 std
    ct = Uniform8Bit().compress(heavy)
    assert ct.meta["m"] == 0 and ct.meta["lo"] == float(heavy.min())
