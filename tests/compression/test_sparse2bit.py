"""TopK2Bit (codec 11): per-chunk top-k, 2-bit values, exact decoding, strict payloads,
error feedback on both sides of a butterfly."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import (
    CompressedTensor,
    ErrorFeedback,
    MalformedMessageError,
    NonFiniteInputError,
    PayloadSizeError,
    PayloadValueError,
    TopK2Bit,
    TwoWayCompression,
    codec_from_id,
    decompress,
)
from compression._bytes import pack_uint
from compression.sparse2bit import tail_count

from .conftest import DEVICES


def _wire(ct: CompressedTensor, max_numel: int | None = None) -> CompressedTensor:
    """Through msgpack and the validating parser, as a peer receives it."""
    msg = msgpack.unpackb(msgpack.packb(ct.to_msg()))
    return CompressedTensor.from_msg(msg, max_numel=max_numel or max(1, ct.numel))


def _chunk_indices(n: int, chunk: int, interleave: bool) -> list[torch.Tensor]:
    """The tensor positions of each chunk, in order: consecutive runs of ``chunk``, or
    ``C = ceil(n / chunk)`` interleaved chunks (chunk j: j, j + C, ...) when n > chunk."""
    if not interleave or n <= chunk:
        return list(torch.arange(n).split(chunk))
    count = -(-n // chunk)
    return [torch.arange(j, n, count) for j in range(count)]


def _kept_counts(n: int, chunk: int, k: int, interleave: bool) -> list[int]:
    return [
        k if idx.numel() == chunk else tail_count(k, chunk, idx.numel())
        for idx in _chunk_indices(n, chunk, interleave)
    ]


def _sse(mags: list[float], j: int) -> float:
    """Squared error of replacing the j largest by their mean and the rest by theirs."""
    hi, lo = mags[:j], mags[j:]
    err = sum((v - sum(hi) / len(hi)) ** 2 for v in hi)
    return err + (sum((v - sum(lo) / len(lo)) ** 2 for v in lo) if lo else 0.0)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 1000])
@pytest.mark.parametrize("chunk,density", [(64, 0.1), (16, 0.5), (4096, 0.02), (1, 1.0)])
def test_keeps_the_top_k_of_every_chunk_as_sign_and_two_magnitudes(n, chunk, density, interleave):
    """Reference check, one chunk at a time in Python: the kept set is the chunk's top k, each
    kept value decodes to exactly +-lo or +-hi of its chunk with its own sign, the hi group is
    the largest magnitudes, and (lo, hi) is the best 2-level split of the kept magnitudes."""
    gen = torch.Generator().manual_seed(n + chunk)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(3) * 10
    codec = TopK2Bit(density, chunk=chunk, interleave=interleave)
    ct = codec.compress(x)
    y = decompress(_wire(ct))
    positions, _, scales = TopK2Bit.parse(ct)
    k = min(chunk, max(1, round(density * chunk)))
    assert ct.meta["k"] == k and ct.meta["chunk"] == chunk
    assert ct.meta["interleave"] == int(interleave)
    indices = _chunk_indices(n, chunk, interleave)
    assert len(scales) == len(indices)
    first = 0
    for i, idx in enumerate(indices):
        xc, yc = x[idx], y[idx]
        kept_here = k if xc.numel() == chunk else tail_count(k, chunk, xc.numel())
        # parse lists the kept positions chunk after chunk, ascending inside each
        in_chunk = positions[first : first + kept_here]
        first += kept_here
        assert bool(torch.isin(in_chunk, idx).all()) and bool((in_chunk.diff() > 0).all())
        mine = torch.isin(idx, in_chunk).nonzero().squeeze(1)  # offsets inside the chunk
        assert mine.numel() == kept_here
        # the kept magnitudes are the chunk's largest (ties aside: compare the values)
        top = torch.topk(xc.abs(), kept_here).values
        assert torch.equal(xc.abs()[mine].sort(descending=True).values, top)
        outside = torch.ones(xc.numel(), dtype=torch.bool)
        outside[mine] = False
        assert bool((yc[outside] == 0).all())
        lo, hi = float(scales[i, 0]), float(scales[i, 1])
        assert 0 <= lo <= hi
        for p in mine.tolist():
            assert float(yc[p]) in (lo, hi, -lo, -hi)
            assert (yc[p] < 0) == (xc[p] < 0) or yc[p] == 0
        mags = sorted((float(v) for v in xc.abs()[mine]), reverse=True)
        is_hi = [abs(float(yc[p])) == hi for p in mine.tolist()]
        nhi = sum(is_hi)
        if lo < hi:  # the hi group is a prefix of the sorted magnitudes
            assert sorted((float(v) for v in xc.abs()[mine][torch.tensor(is_hi)]), reverse=True) == mags[:nhi]
        best = min(_sse(mags, j) for j in range(1, len(mags) + 1))
        assert _sse(mags, max(nhi, 1)) <= best * (1 + 1e-9) + 1e-12
        assert hi == pytest.approx(sum(mags[:nhi]) / nhi, rel=1e-6)
        if nhi < len(mags):
            assert lo == pytest.approx(sum(mags[nhi:]) / (len(mags) - nhi), rel=1e-6)
    assert first == positions.numel()


@pytest.mark.parametrize("interleave", [True, False])
def test_decoding_is_exact_and_matches_what_error_feedback_sees(device, interleave):
    x = torch.randn(3 * 4096 + 77, generator=torch.Generator().manual_seed(2))
    x[12288:] *= 1e-3  # a tail of tiny values
    # an outlier in each of three chunks, both layouts (interleaved: 4 chunks, j = i mod 4,
    # each a sample of the whole tensor: the third outlier must stand out of plain values)
    outliers = torch.tensor([50.0, -80.0, 30.0 if interleave else 7e-3])
    x[[100, 5001, 12302]] = outliers
    ct, decoded = TopK2Bit(0.02, interleave=interleave).roundtrip(x.to(device))
    for target in ("cpu", device):
        assert torch.equal(decompress(_wire(ct), device=target).cpu(), decoded.cpu())
    # an outlier is a group of its own (the best split): it comes back exactly
    assert torch.equal(decoded.cpu()[[100, 5001, 12302]], outliers)


def test_cuda_and_cpu_encode_to_the_same_bytes(device):
    x = torch.randn(5 * 4096 + 123, generator=torch.Generator().manual_seed(3))
    for codec in (TopK2Bit(0.02), TopK2Bit(0.5, chunk=16)):
        here, cpu = codec.compress(x.to(device)), codec.compress(x)
        assert bytes(here.payload) == bytes(cpu.payload) and here.meta == cpu.meta


def test_bits_per_value_and_layout():
    x = torch.randn(2**20, generator=torch.Generator().manual_seed(4))
    for density, limit in ((0.01, 0.15), (0.02, 0.27), (0.03, 0.37)):
        ct = TopK2Bit(density).compress(x)
        k = ct.meta["k"]
        nchunks, m, width = 256, 256 * k, ct.meta["width"]
        assert ct.meta["bitmap"] == 0 and width <= 12  # never more than the offsets' 12 bits
        assert ct.nbytes == 8 * nchunks + math.ceil(m / 4) + math.ceil(m * width / 8)
        assert 8 * ct.nbytes / x.numel() <= limit
    # SparseLoCo's claim: > 146x smaller than dense float32 at 1% (4-bit blockwise: 7.1x)
    assert 4 * x.numel() / TopK2Bit(0.01).compress(x).nbytes > 146


def test_bitmap_when_it_is_smaller():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    dense = TopK2Bit(0.5, chunk=256, interleave=False).compress(x)
    assert dense.meta["bitmap"] == 1 and dense.meta["width"] == 0
    m = 39 * 128 + tail_count(128, 256, 10_000 - 39 * 256)
    assert dense.nbytes == 8 * 40 + math.ceil(m / 4) + math.ceil(10_000 / 8)
    positions, _, _ = TopK2Bit.parse(dense)
    assert positions.numel() == m and bool((positions.diff() > 0).all())
    sparse = TopK2Bit(0.05, chunk=256).compress(x)
    assert sparse.meta["bitmap"] == 0
    # interleaved: 40 chunks of exactly 250 values, 125 kept each, the bitmap chunk by chunk
    woven = TopK2Bit(0.5, chunk=256).compress(x)
    assert woven.meta["bitmap"] == 1
    positions, _, _ = TopK2Bit.parse(woven)
    assert positions.numel() == 40 * 125 and positions.unique().numel() == 40 * 125
    assert (positions.view(40, 125) % 40 == torch.arange(40).unsqueeze(1)).all()
    assert torch.equal(decompress(_wire(woven)), TopK2Bit(0.5, chunk=256).roundtrip(x)[1])


def test_density_and_chunk_are_checked():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            TopK2Bit(bad)
    for bad in (0, 3, 100, 1 << 21):
        with pytest.raises(ValueError, match="chunk"):
            TopK2Bit(0.1, chunk=bad)
    assert isinstance(codec_from_id(11), TopK2Bit)


def test_non_finite_input_is_refused():
    for special in (math.nan, math.inf, -math.inf):
        x = torch.randn(9000)
        x[5000] = special
        with pytest.raises(NonFiniteInputError):
            TopK2Bit().compress(x)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 700),
    log_chunk=st.integers(0, 8),
    density=st.floats(0.001, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
    interleave=st.booleans(),
)
def test_round_trip_property(n, log_chunk, density, dtype, seed, interleave):
    """Any tensor: shape and dtype back, at most one kept value per position, exactly the
    per-chunk counts, every decoded value one of its chunk's four levels."""
    chunk = 1 << log_chunk
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    ct = TopK2Bit(density, chunk=chunk, interleave=interleave).compress(x)
    y = decompress(_wire(ct))
    assert y.shape == x.shape and y.dtype == dtype
    positions, codes, scales = TopK2Bit.parse(ct)
    counts = _kept_counts(n, chunk, ct.meta["k"], interleave)
    assert positions.numel() == sum(counts) == codes.numel()
    assert positions.unique().numel() == positions.numel()
    assert n == 0 or (0 <= int(positions.min()) and int(positions.max()) < n)
    chunk_of = torch.empty(n, dtype=torch.int64)
    for j, idx in enumerate(_chunk_indices(n, chunk, interleave)):
        chunk_of[idx] = j
    owner = chunk_of[positions]  # chunk after chunk, ascending inside each
    assert bool((owner.diff() >= 0).all()) and bool((positions.diff()[owner.diff() == 0] > 0).all())
    assert torch.bincount(owner, minlength=len(counts)).tolist() == counts
    level = scales[owner, (codes >> 1).long()]
    decoded = TopK2Bit.decode(ct, torch.device("cpu"))  # float32, before the cast to dtype
    assert torch.equal(decoded[positions].abs(), level)
    assert torch.equal(decoded.to(dtype), y)


# ------------------------------------------------------------------------------------------
# untrusted payloads: actual bad bytes


def _msg(codec: TopK2Bit, n: int, seed: int = 1) -> dict:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return codec.compress(x).to_msg()


def _refused(msg: dict, exc: type[Exception], match: str) -> None:
    """Refused by the parser and, for a locally built message, by the decoder too."""
    with pytest.raises(exc, match=match):
        CompressedTensor.from_msg(msg, max_numel=10**6)
    ct = CompressedTensor(msg["codec"], msg["dtype"], tuple(msg["shape"]), msg["payload"], msg["meta"])
    with pytest.raises(exc, match=match):
        decompress(ct)


def _with_gaps(msg: dict, gaps: torch.Tensor, width: int) -> dict:
    """``msg`` with its index section replaced by ``gaps`` packed at ``width`` bits."""
    meta = msg["meta"]
    n = math.prod(msg["shape"])
    chunk, k = meta["chunk"], meta["k"]
    nfull, tail = divmod(n, chunk)
    m = nfull * k + tail_count(k, chunk, tail)
    head = 8 * (nfull + (tail > 0)) + math.ceil(m / 4)
    payload = bytes(msg["payload"][:head]) + bytes(pack_uint(gaps, width).numpy())
    return {**msg, "payload": payload, "meta": {**meta, "width": width}}


def test_positions_past_their_chunk_are_refused():
    msg = _msg(TopK2Bit(0.1, chunk=64, interleave=False), 64 * 3 + 20)  # k = 6, tail of 20 keeps 2
    assert msg["meta"]["k"] == 6 and msg["meta"]["bitmap"] == 0
    m = 3 * 6 + 2
    good = torch.zeros(m, dtype=torch.int64)  # positions 0..5 of each chunk: valid
    parsed = CompressedTensor.from_msg(_with_gaps(msg, good, 6), max_numel=10**6)
    assert TopK2Bit.parse(parsed)[0][:6].tolist() == [0, 1, 2, 3, 4, 5]
    over = good.clone()
    over[6 + 5] = 63 - 5 + 1  # chunk 1's last position becomes 64: outside its chunk
    _refused(_with_gaps(msg, over, 6), PayloadValueError, r"chunk 1: position 64 .*index 128")
    tail = good.clone()
    tail[-1] = 19  # the tail's positions 0 and 20, but the tail has 20 values
    _refused(_with_gaps(msg, tail, 6), PayloadValueError, r"chunk 3: position 20 .*out of range")
    # a full-width encoding (width = log2(chunk)) of the largest gaps cannot stay inside
    _refused(
        _with_gaps(msg, torch.full((m,), 63, dtype=torch.int64), 6),
        PayloadValueError,
        "chunk 0",
    )


def test_interleaved_offsets_past_their_chunk_are_refused():
    """212 values, chunk 64: 4 interleaved chunks of 53 values (positions j, j + 4, ...), 5
    kept each. An offset of 53 in chunk 1 would be position 213: refused, named."""
    msg = _msg(TopK2Bit(0.1, chunk=64), 212)
    meta = msg["meta"]
    assert meta["interleave"] == 1 and meta["k"] == 6 and meta["bitmap"] == 0
    head = 8 * 4 + math.ceil(20 / 4)

    def with_gaps(gaps: torch.Tensor) -> dict:
        payload = bytes(msg["payload"][:head]) + bytes(pack_uint(gaps, 6).numpy())
        return {**msg, "payload": payload, "meta": {**meta, "width": 6}}

    good = torch.zeros(20, dtype=torch.int64)  # offsets 0..4 of each chunk
    positions = TopK2Bit.parse(CompressedTensor.from_msg(with_gaps(good), max_numel=212))[0]
    assert positions.tolist() == [j + 4 * i for j in range(4) for i in range(5)]
    over = good.clone()
    over[5 + 4] = 53 - 4  # chunk 1's last offset becomes 53
    _refused(with_gaps(over), PayloadValueError, r"chunk 1: position 53 .*index 213 out of range")


def test_duplicate_or_unsorted_positions_cannot_be_expressed():
    """Gaps add at least 1: whatever the index bytes, positions come out strictly increasing
    inside their chunk, or the message is refused (what duplicates or a descending order
    would need is not representable)."""
    msg = _msg(TopK2Bit(0.1, chunk=64, interleave=False), 200)
    meta = msg["meta"]
    m = 3 * 6 + 1
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        width = int(torch.randint(0, 7, (1,), generator=gen))
        gaps = torch.randint(0, 1 << width, (m,), generator=gen) if width else torch.zeros(m)
        bad = _with_gaps(msg, gaps.long(), width)
        try:
            ct = CompressedTensor.from_msg(bad, max_numel=200)
        except PayloadValueError as e:
            assert "chunk" in str(e)
            continue
        positions = TopK2Bit.parse(ct)[0]
        assert bool((positions.diff() > 0).all()) and int(positions[-1]) < 200
        assert torch.bincount(positions // meta["chunk"]).tolist() == [6, 6, 6, 1]


def test_bitmap_counts_must_match():
    msg = _msg(TopK2Bit(0.5, chunk=32, interleave=False), 32 * 4 + 6)  # k = 16; the tail of 6 keeps 3
    assert msg["meta"]["bitmap"] == 1
    payload = bytearray(msg["payload"])
    bitmap_at = len(payload) - math.ceil(134 / 8)
    # chunk 2 is bits 64-95, bytes 8-11 of the bitmap: mark one more position there
    byte, bit = next(
        (bitmap_at + i, b) for i in range(8, 12) for b in range(8) if not payload[bitmap_at + i] >> b & 1
    )
    extra = bytearray(payload)
    extra[byte] |= 1 << bit
    _refused({**msg, "payload": bytes(extra)}, PayloadValueError, "chunk 2 marks 17 positions, expected 16")
    fewer = bytearray(payload)
    fewer[-1] = 0  # the tail (bits 128-133) loses its positions
    _refused({**msg, "payload": bytes(fewer)}, PayloadValueError, "chunk 4 marks 0 positions, expected 3")


@pytest.mark.parametrize("lo,hi", [(math.nan, 1.0), (0.5, math.inf), (-0.5, 1.0), (2.0, 1.0)])
def test_bad_magnitudes_are_refused(lo, hi):
    msg = _msg(TopK2Bit(0.1, chunk=64), 300)
    payload = bytearray(msg["payload"])
    payload[8 * 2 : 8 * 3] = torch.tensor([lo, hi], dtype=torch.float32).numpy().tobytes()
    rule = r"chunk 2: magnitudes .* must be finite with 0 <= lo <= hi"
    _refused({**msg, "payload": bytes(payload)}, PayloadValueError, rule)


def test_bad_meta_and_lengths_are_refused_before_decoding():
    msg = _msg(TopK2Bit(0.1, chunk=64), 300)
    meta = msg["meta"]
    for key, value in [
        ("chunk", 48),  # not a power of two
        ("chunk", 1 << 21),
        ("k", 0),
        ("k", 65),  # more than the chunk
        ("width", 7),  # more than log2(chunk)
        ("bitmap", 2),
        ("bitmap", True),
        ("k", 6.0),
        ("interleave", 2),
        ("interleave", None),  # absent
    ]:
        with pytest.raises(MalformedMessageError):
            CompressedTensor.from_msg({**msg, "meta": {**meta, key: value}}, max_numel=300)
    with pytest.raises(MalformedMessageError, match="bitmap"):
        CompressedTensor.from_msg({**msg, "meta": {**meta, "bitmap": 1}}, max_numel=300)
    for payload in (msg["payload"][:-1], bytes(msg["payload"]) + b"\0", b""):
        with pytest.raises(PayloadSizeError):
            CompressedTensor.from_msg({**msg, "payload": payload}, max_numel=300)
    # a huge shape with a tiny payload fails on length, before anything is allocated
    with pytest.raises(PayloadSizeError):
        CompressedTensor.from_msg({**msg, "shape": [2**27]}, max_numel=2**27)


# ------------------------------------------------------------------------------------------
# error feedback, both sides


def test_error_feedback_invariant_over_rounds():
    """sum(decoded) + residual == sum(pushed in) for a sparse 2-bit stream."""
    feedback = ErrorFeedback(TopK2Bit(0.02, chunk=256))
    pushed, received = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000, dtype=torch.float64)
    for step in range(40):
        g = torch.randn(5000, generator=torch.Generator().manual_seed(step))
        pushed += g.double()
        ct, decoded = feedback.compress_with_decoded(g, "k")
        assert torch.equal(decompress(_wire(ct)), decoded)
        received += decoded.double()
    err = (received + feedback.residual("k").double() - pushed).abs().max()
    assert float(err) <= 1e-4 * float(pushed.abs().max())
    # the residual stops growing (what is held back gets sent) while the sum keeps growing
    before = float(feedback.residual("k").norm())
    for step in range(40, 120):
        feedback.compress(torch.randn(5000, generator=torch.Generator().manual_seed(step)), "k")
    assert float(feedback.residual("k").norm()) <= 1.25 * before


def test_three_member_butterfly_aggregation():
    """Three members, three parts: member p reduces part p. Every member sends its part p to
    reducer p as TopK2Bit (sender-side error feedback), the reducer sums the decoded sparse
    vectors into a dense mean and sends it back re-sparsified (reducer-side error feedback).
    Every member ends each round with the same bytes, and nothing is lost on either side."""
    members, part_len, rounds = 3, 3000, 15
    codec = TopK2Bit(0.03, chunk=512)
    spec = [TwoWayCompression(codec, codec) for _ in range(members)]
    gen = torch.Generator().manual_seed(6)
    pushed = [[torch.zeros(part_len, dtype=torch.float64) for _ in range(members)] for _ in range(members)]
    sent = [[torch.zeros(part_len, dtype=torch.float64) for _ in range(members)] for _ in range(members)]
    means = [torch.zeros(part_len, dtype=torch.float64) for _ in range(members)]
    returned = [torch.zeros(part_len, dtype=torch.float64) for _ in range(members)]
    true_mean = torch.zeros(members * part_len, dtype=torch.float64)
    m = sum(_kept_counts(part_len, 512, codec.k, interleave=True))  # 6 chunks of 500: 15 each
    for _ in range(rounds):
        grads = [torch.randn(members * part_len, generator=gen) * (i + 1) for i in range(members)]
        true_mean += torch.stack(grads).double().mean(0)
        results = []
        for p in range(members):  # reducer p
            decoded = []
            for i in range(members):
                part = grads[i][p * part_len : (p + 1) * part_len]
                pushed[i][p] += part.double()
                msg = msgpack.packb(spec[i].compress_send(part, key=(p, 0)).to_msg())
                ct = CompressedTensor.from_msg(msgpack.unpackb(msg), max_numel=part_len)
                assert TopK2Bit.parse(ct)[0].numel() == m
                values = decompress(ct)
                sent[i][p] += values.double()
                decoded.append(values)
            dense = torch.stack(decoded).mean(0)  # up to 3m non-zeros
            assert int((dense != 0).sum()) > m
            means[p] += dense.double()
            back, mine = spec[p].reducer.compress_with_decoded(dense, key=(p, 0))
            assert TopK2Bit.parse(back)[0].numel() == m  # re-sparsified on the way back
            returned[p] += mine.double()
            wire = msgpack.packb(back.to_msg())
            got = [decompress(CompressedTensor.from_msg(msgpack.unpackb(wire), part_len)) for _ in range(members)]
            assert all(torch.equal(g, mine) for g in got)  # every member decodes the same
            results.append(mine)
        assert torch.cat(results).shape == (members * part_len,)
    tol = 1e-4 * rounds * 3
    for p in range(members):
        for i in range(members):  # sender side: sent + residual == pushed
            residual = spec[i].sender.residual((p, 0)).double()
            assert torch.allclose(sent[i][p] + residual, pushed[i][p], atol=tol)
        # reducer side: returned + residual == the means it was given
        residual = spec[p].reducer.residual((p, 0)).double()
        assert torch.allclose(returned[p] + residual, means[p], atol=tol)
        # end to end: what came back, plus what both sides still hold, is the true mean sum
        senders = torch.stack([spec[i].sender.residual((p, 0)).double() for i in range(members)])
        whole = returned[p] + residual + senders.mean(0)
        assert torch.allclose(whole, true_mean[p * part_len : (p + 1) * part_len], atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_error_feedback_on_device(device):
    feedback = ErrorFeedback(TopK2Bit(0.05, chunk=128))
    total = torch.zeros(1000, device=device)
    received = torch.zeros(1000, device=device)
    for step in range(10):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step)).to(device)
        total += g
        _, decoded = feedback.compress_with_decoded(g, 0)
        assert decoded.device.type == device
        received += decoded
    torch.testing.assert_close(received + feedback.residual(0), total, rtol=0, atol=1e-4)
