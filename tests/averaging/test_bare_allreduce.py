"""The floor that bench_averaging.py measures moshpit against must compute the same sum.

Four ranks in threads of this process, over real loopback TCP: every rank ends with the same
bits, the sum of the inputs, round after round (a rank's reads may already hold the start of
its peer's next transfer).
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
from cryptography.exceptions import InvalidTag

from benchmarks.bare_allreduce import Link, Mesh


def _in_threads(jobs):
    errors = []

    def run(job):
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank hung"
    return errors


@pytest.fixture
def meshes():
    ranks = [Mesh(rank) for rank in range(4)]
    addrs = [("127.0.0.1", m.port) for m in ranks]
    key = os.urandom(32)
    assert _in_threads([lambda m=m: m.connect(addrs, key) for m in ranks]) == []
    yield ranks
    for m in ranks:
        m.close()


@pytest.mark.parametrize("numel", [5, 1_000_003])  # fewer values than ranks; many frames each
def test_every_rank_ends_with_the_same_sum_round_after_round(meshes, numel):
    gen = torch.Generator().manual_seed(numel)
    for _ in range(3):
        tensors = [torch.randn(numel, generator=gen) for _ in meshes]
        expected = torch.stack(tensors).sum(0)
        jobs = [lambda m=m, t=t: m.allreduce(t) for m, t in zip(meshes, tensors, strict=True)]
        assert _in_threads(jobs) == []
        for t in tensors:
            assert torch.equal(t, tensors[0])
        torch.testing.assert_close(tensors[0], expected)


def test_a_flipped_byte_fails_authentication():
    key = os.urandom(32)
    wire = bytearray()
    Link(_Collect(wire), key, key).send(memoryview(os.urandom(100_000)))  # type: ignore[arg-type]
    wire[70_000] ^= 1
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire)
        with pytest.raises(InvalidTag):
            Link(b, key, key).receive_into(memoryview(bytearray(100_000)))


class _Collect:
    def __init__(self, into: bytearray) -> None:
        self.into = into

    def sendall(self, data) -> None:
        self.into += data
