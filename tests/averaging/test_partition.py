"""Flat-range gather/scatter over tensor lists, part sizes from GroupInfo, chunking, GroupInfo."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.p2p import Identity
from moshpit.averaging.group_info import GroupInfo, GroupInfoError
from moshpit.averaging.partition import (
    CHUNKS_PER_PEER,
    MAX_CHUNKS_PER_PEER,
    MIN_CHUNK_NUMEL,
    TensorLayout,
    chunk_bounds,
    chunk_numel_for,
    chunks_per_pair,
    copy_range,
    empty_like_all,
    gather,
    gather_copies,
    part_bounds,
    part_sizes,
    round_link_seconds,
    scatter,
)

PEERS = [Identity.generate().peer_id for _ in range(6)]


def group(modes=None, bandwidths=None, n=None) -> GroupInfo:
    n = n or len(modes or bandwidths)
    return GroupInfo(
        b"g", tuple(PEERS[:n]), tuple(modes or ["node"] * n), tuple(bandwidths or [None] * n)
    )


def flat(ts):
    return torch.cat([t.float().reshape(-1) for t in ts])


@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_gather_scatter_any_range(sizes, data):
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    tensors = [
        torch.randn(s)
        .to(data.draw(st.sampled_from(dtypes)))
        .reshape(data.draw(st.sampled_from([(s,), (1, s)])))
        for s in sizes
    ]
    layout = TensorLayout.from_tensors(tensors)
    total = layout.numel
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    got = gather(tensors, layout, start, end)
    assert got.dtype == torch.float32
    assert torch.equal(got, flat(tensors)[start:end])
    pieces = list(layout._pieces(start, end))
    in_one_float32 = len(pieces) == 1 and tensors[pieces[0][0]].dtype == torch.float32
    assert gather_copies(tensors, layout, start, end) == (end > start and not in_one_float32)
    if end > start and in_one_float32:  # a view of the caller's tensor, not a copy
        assert got.data_ptr() == tensors[pieces[0][0]].reshape(-1)[pieces[0][1] :].data_ptr()
    outputs = empty_like_all(tensors)
    copy_range(tensors, outputs, layout, 0, total)
    scatter(torch.full((end - start,), 0.5), outputs, layout, start)
    expected = flat(tensors).clone()
    expected[start:end] = 0.5
    assert torch.equal(flat(outputs), expected)
    assert [o.dtype for o in outputs] == [t.dtype for t in tensors]
    assert [o.shape for o in outputs] == [t.shape for t in tensors]


def test_layout_rejects_non_float_and_non_tensors():
    with pytest.raises(ValueError, match="floating"):
        TensorLayout.from_tensors([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError):
        TensorLayout.from_tensors([[1.0, 2.0]])
    with pytest.raises(IndexError):
        gather([torch.zeros(3)], TensorLayout.from_tensors([torch.zeros(3)]), 2, 4)


def test_equal_parts_when_bandwidth_unknown():
    assert part_sizes(group(n=3), 10) == [4, 3, 3]
    assert part_sizes(group(n=4), 0) == [0, 0, 0, 0]
    assert part_sizes(group(n=2), 1) == [1, 0]


def test_parts_proportional_to_bandwidth():
    assert part_sizes(group(bandwidths=[1.0, 2.0, 1.0]), 100) == [25, 50, 25]
    # unknown = mean of the known ones
    assert part_sizes(group(bandwidths=[100.0, None, 300.0]), 60) == [10, 20, 30]


def test_clients_reduce_nothing_and_aux_reduce():
    g = group(modes=["node", "client", "aux", "client"])
    assert part_sizes(g, 9) == [5, 0, 4, 0]
    assert g.reducer_indices == (0, 2) and g.sender_indices == (0, 1, 3)
    with pytest.raises(GroupInfoError, match="no member that can reduce"):
        part_sizes(group(modes=["client", "client"]), 5)


@given(
    bws=st.lists(st.one_of(st.none(), st.floats(1.0, 1e9)), min_size=1, max_size=6),
    total=st.integers(0, 10**7),
)
@settings(max_examples=100, deadline=None)
def test_part_sizes_sum_and_are_contiguous(bws, total):
    g = group(bandwidths=bws)
    sizes = part_sizes(g, total)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    assert part_sizes(g, total) == sizes  # deterministic
    bounds = part_bounds(g, total)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    # faster members never get (more than rounding) less
    filled = [b if b is not None else None for b in bws]
    known = [b for b in filled if b is not None]
    mean = sum(known) / len(known) if known else 1.0
    eff = [b if b is not None else mean for b in filled]
    for i in range(len(eff)):
        for j in range(len(eff)):
            if eff[i] > eff[j]:
                assert sizes[i] >= sizes[j] - 1


def test_chunk_numel_for_small_and_large_vectors():
    assert chunk_numel_for(10**9, 4, 1 << 18) == 1 << 18  # big: the configured maximum
    assert chunk_numel_for(4 * 10**6, 5, 1 << 18) == 125000  # 8 chunks per sender pair
    assert chunk_numel_for(1000, 3, 1 << 18) == MIN_CHUNK_NUMEL  # tiny: not below 64 KiB
    assert chunk_numel_for(1000, 3, 8) == 8  # an explicit small maximum wins
    assert chunk_numel_for(0, 1, 1 << 18) == MIN_CHUNK_NUMEL


def test_a_round_that_keeps_the_links_busy_gets_more_chunks():
    assert chunk_numel_for(4 << 20, 4, 1 << 18) == 174763  # 8 per sender pair
    # 4 x 4M float32 at 100 Mbit/s: ~2 s on the wire -> sqrt(2 / (2 * 3 * 0.5 ms)) = 26 per pair
    assert chunks_per_pair(2.0, 4) == 26
    assert chunk_numel_for(4 << 20, 4, 1 << 18, link_seconds=2.0) == 53774
    assert chunks_per_pair(0.5, 4) == 13  # 8-bit at 100 Mbit/s
    assert chunks_per_pair(0.59, 8) == 9  # 8 senders pay 7 messages per chunk
    # bound by CPU (top-k anywhere, small vectors at 1 Gbit/s): the default stays
    for short in (0.015, 0.2, None, 0.0, -1.0, float("nan"), float("inf")):
        assert chunks_per_pair(short, 4) == CHUNKS_PER_PEER
        assert chunk_numel_for(4 << 20, 4, 1 << 18, link_seconds=short) == 174763
    assert chunks_per_pair(1e6, 4) == MAX_CHUNKS_PER_PEER
    # big vectors keep the configured maximum either way
    assert chunk_numel_for(10**9, 4, 1 << 18, link_seconds=100.0) == 1 << 18


def test_round_link_seconds_uses_the_slowest_link_and_the_densest_codec():
    n = 4 << 20
    assert round_link_seconds(group(bandwidths=[None] * 4), n) is None
    stated = group(bandwidths=[12.5e6, None, 125e6, 125e6])
    assert round_link_seconds(stated, n) is None  # nobody reported a codec density yet
    dense = dataclasses.replace(stated, bytes_per_value=(4.0, None, 1.0, 0.03))
    # each member sends 2 * 3/4 of the vector; at 4 bytes a value over 12.5 MB/s
    assert round_link_seconds(dense, n) == pytest.approx(2 * n * 0.75 * 4 / 12.5e6)
    sparse = dataclasses.replace(stated, bytes_per_value=(0.03, 0.03, 0.03, 0.03))
    assert round_link_seconds(sparse, n) == pytest.approx(0.015, rel=0.01)
    assert round_link_seconds(dataclasses.replace(dense, modes=("node",) + ("aux",) * 3), n) is None


def test_chunk_bounds():
    assert chunk_bounds(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(5, 5, 4) == []
    with pytest.raises(ValueError):
        chunk_bounds(0, 4, 0)


def test_group_info_validation():
    with pytest.raises(GroupInfoError, match="distinct"):
        GroupInfo(b"g", (PEERS[0], PEERS[0]), ("node", "node"), (None, None))
    with pytest.raises(GroupInfoError, match="mode"):
        GroupInfo(b"g", (PEERS[0],), ("boss",), (None,))
    with pytest.raises(GroupInfoError, match="bandwidth"):
        GroupInfo(b"g", (PEERS[0],), ("node",), (float("nan"),))
    with pytest.raises(GroupInfoError, match="same length"):
        GroupInfo(b"g", (PEERS[0],), ("node", "node"), (None,))
    with pytest.raises(GroupInfoError, match="group_id"):
        GroupInfo(b"", (PEERS[0],), ("node",), (None,))
    with pytest.raises(GroupInfoError, match="not a member"):
        group(n=2).index_of(PEERS[5])


def test_group_info_wire_roundtrip_and_bad_input():
    g = GroupInfo(
        b"gid", tuple(PEERS[:3]), ("node", "client", "aux"), (1e6, None, 3), ({"x": 1}, None, 2)
    )
    assert GroupInfo.from_msg(g.to_msg()) == g
    dense = dataclasses.replace(g, bytes_per_value=(4.0, None, 0.03))
    assert GroupInfo.from_msg(dense.to_msg()) == dense
    no_bpv = {k: v for k, v in dense.to_msg().items() if k != "bpv"}  # from an older leader
    assert GroupInfo.from_msg(no_bpv).bytes_per_value == ()
    for bad in [
        {**g.to_msg(), "bpv": [1.0, 2.0]},
        {**g.to_msg(), "bpv": [0.0, None, None]},
        {**g.to_msg(), "bpv": [1e9, None, None]},
        {**g.to_msg(), "bpv": [float("nan"), None, None]},
        {**g.to_msg(), "bpv": [True, None, None]},
        {**g.to_msg(), "bpv": ["4", None, None]},
        {**g.to_msg(), "bpv": "abc"},
        None,
        {},
        {**g.to_msg(), "members": [b"junk"] * 3},
        {**g.to_msg(), "members": "abc"},
        {**g.to_msg(), "modes": [1, 2, 3]},
        {**g.to_msg(), "bw": [1, 2]},
        {**g.to_msg(), "bw": [True, None, None]},
        {**g.to_msg(), "members": [PEERS[0].to_bytes()] * 300},
    ]:
        with pytest.raises(GroupInfoError):
            GroupInfo.from_msg(bad)


def test_round_link_seconds_assumes_the_given_density_before_any_member_reported_one():
    two = dataclasses.replace(group(bandwidths=[1e6, None]), bytes_per_value=(None, None))
    assert round_link_seconds(two, 1000) is None  # nobody knows the codec yet
    # 2 * (2-1)/2 * 1000 values * 4 bytes over the one stated link, 1 MB/s
    assert round_link_seconds(two, 1000, unknown_bytes_per_value=4.0) == pytest.approx(4e-3)
    reported = dataclasses.replace(two, bytes_per_value=(0.5, None))
    assert round_link_seconds(reported, 1000, unknown_bytes_per_value=4.0) == pytest.approx(5e-4)
