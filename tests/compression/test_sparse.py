"""TopK (DGC selection), RandomK (shared seed), ScaledSign (L1), bit packing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import RandomK, ScaledSign, TopK, decompress, dgc_select, random_k_indices
from compression._bytes import (
    _pack_uint_torch,
    _unpack_uint_torch,
    pack_bits,
    pack_uint,
    unpack_bits,
    unpack_uint,
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(0, 32))
def test_pack_uint_round_trip(values, width):
    t = torch.tensor(values, dtype=torch.int64) & ((1 << width) - 1)
    packed = pack_uint(t, width)
    assert packed.numel() == math.ceil(len(values) * width / 8)
    assert torch.equal(unpack_uint(packed, len(values), width), t)
    # the CPU (numpy) and any-device (torch) packings write the same wire bytes
    assert torch.equal(packed, _pack_uint_torch(t, width))
    assert torch.equal(_unpack_uint_torch(packed, len(values), width), t)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), max_size=100))
def test_pack_bits_round_trip(bits):
    t = torch.tensor(bits, dtype=torch.bool)
    assert torch.equal(unpack_bits(pack_bits(t), len(bits)).bool(), t)


@pytest.mark.parametrize("n", [5000, 300_007])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("dist", ["gauss", "heavy", "ties"])
def test_topk_count_within_dgc_bounds(n, density, dist, device):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    if dist == "heavy":
        x = x**3
    elif dist == "ties":
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    k = max(1, round(density * n))
    codec = TopK(density, seed=1)
    for _ in range(3):
        ct = codec.compress(x.to(device))
        kept = ct.meta["k"]
        assert math.ceil(0.8 * k) <= kept <= math.floor(1.3 * k)
        y = decompress(ct, device=device)
        assert torch.count_nonzero(y) <= kept
        # kept entries are the largest ones: everything dropped is not larger than anything kept
        mask = y != 0
        if mask.any() and (~mask).any():
            assert x.abs()[~mask.cpu()].max() <= x.abs()[mask.cpu()].min() + 1e-2


def test_topk_values_and_exact_mode():
    x = torch.randn(10_000)
    y = decompress(TopK(0.01, exact=True, value_dtype=torch.float32).compress(x))
    idx = torch.topk(x.abs(), 100).indices
    expected = torch.zeros_like(x)
    expected[idx] = x[idx]
    assert torch.equal(y, expected)
    y16 = decompress(TopK(0.01, exact=True).compress(x))
    assert torch.allclose(y16, expected, rtol=1e-3, atol=0)


def test_topk_wire_size_is_compact():
    x = torch.randn(2**20)
    ct = TopK(0.001, seed=0).compress(x)
    k = ct.meta["k"]
    assert ct.meta["width"] <= 16  # gaps of ~1000 need ~10-14 bits, never 32/64
    assert ct.nbytes == 2 * k + math.ceil(k * ct.meta["width"] / 8)


def test_dgc_select_handles_zeros_and_constants():
    z = torch.zeros(50_000)
    assert dgc_select(z, 50).numel() == 50
    c = torch.ones(50_000)
    assert 40 <= dgc_select(c, 50).numel() <= 65


def test_random_k_same_seed_same_indices_on_two_peers():
    a, b = RandomK(0.01), RandomK(0.01)
    xa, xb = torch.randn(10_007), torch.randn(10_007)
    ca, cb = a.compress(xa, seed=123), b.compress(xb, seed=123)
    ya, yb = decompress(ca), decompress(cb)
    assert torch.equal(ya != 0, yb != 0)
    assert ca.meta["k"] == 100 and len(ca.payload) == 200  # values only, no indices
    cc = a.compress(xa, seed=124)
    assert not torch.equal(decompress(cc) != 0, ya != 0)


def test_random_k_indices_distinct_sorted_and_uniform():
    idx = random_k_indices(1000, 1000, seed=3)
    assert torch.equal(idx, torch.arange(1000))
    counts = torch.zeros(100)
    for seed in range(400):
        idx = random_k_indices(100, 10, seed)
        assert torch.all(idx[1:] > idx[:-1]) and idx.max() < 100
        counts[idx] += 1
    assert counts.min() > 15 and counts.max() < 70  # expectation 40 per index


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 65_537])
def test_scaled_sign_preserves_l1_and_signs(n, device):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
    y = decompress(ScaledSign().compress(x), device=device)
    assert math.isclose(float(y.abs().sum()), float(x.abs().sum()), rel_tol=1e-5)
    assert torch.equal(torch.sign(y), torch.where(x < 0, -1.0, 1.0).to(device))
    assert ScaledSign().compress(x).nbytes == math.ceil(n / 8)


def test_random_k_indices_identical_in_another_process():
    """Two peers are two processes: the indices must come from the seed alone."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    code = (
        "import json, torch; torch.manual_seed(999)\n"
        "from compression import RandomK, decompress\n"
        "ct = RandomK(0.01).compress(torch.randn(10_007), seed=2**40 + 3)\n"
        "print(json.dumps(torch.nonzero(decompress(ct)).flatten().tolist()))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    theirs = json.loads(out.stdout)
    mine = random_k_indices(10_007, 100, 2**40 + 3).tolist()
    assert theirs == mine and len(mine) == 100


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5000), st.floats(0, 1), st.integers(0, 16), st.integers(0, 2**31))
def test_sparse_nonzero_matches_nonzero(n, density, offset, seed):
    from compression.indices import sparse_nonzero

    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(n + offset, generator=gen) < density * density  # mostly sparse
    mask = base[offset:]  # also unaligned views
    assert torch.equal(sparse_nonzero(mask), torch.nonzero(mask).squeeze(1))
