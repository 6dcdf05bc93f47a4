"""``mode="diloco"`` on real ``moshpit.DHT`` facades over loopback TCP (one process, threads).

Each peer's loop records which batches it used at which outer epoch and its parameters after
every outer step, so the tests can compare peers bit for bit and replay the run in a single
process.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

import moshpit
from compression import Float16, GraVAC, TwoWayCompression
from dht import DHT
from moshpit.training.modes.diloco import _RegroupingFeedback, make_compression, outer_prefix

FAST = dict(
    min_matchmaking_time=3.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)
BATCH = 8
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])


def _data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return x, x @ W_TRUE + 0.1 * torch.randn(n, generator=gen)


X, Y = _data()


@pytest.fixture
def make_dhts():
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        first = made[0] if made else None
        for _ in range(n):
            peers = first.get_visible_maddrs() if first is not None else []
            dht = DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            made.append(dht)
            first = first or dht
        return made[-n:]

    yield make
    for dht in reversed(made):
        dht.shutdown()


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.25)
        model.bias.fill_(-0.5)
    return model


def _opt(dht, model, tmp_path=None, name="p", inner=None, **kwargs):
    settings = dict(
        optimizer=inner or torch.optim.SGD(model.parameters(), lr=0.05),
        dht=dht,
        run_id="diloco-test",
        batch_size_per_step=BATCH,
        mode="diloco",
        target_group_size=2,
        averager_options=FAST,
        load_state_timeout=5.0,
        checkpoint_dir=None if tmp_path is None else tmp_path / name,
        progress_ttl=6.0,
        inner_steps=3,
    )
    settings.update(kwargs)
    return moshpit.Optimizer(**settings)


def _same(xs, ys) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(xs, ys, strict=True))


def _loss(model, idx):
    return torch.nn.functional.mse_loss(model(X[idx]).squeeze(-1), Y[idx])


class Peer:
    """One training loop: batches chosen by (peer, step), θ recorded after every outer step."""

    def __init__(self, index: int, model: torch.nn.Module, opt: moshpit.Optimizer):
        self.index, self.model, self.opt = index, model, opt
        self.consumed: list[tuple[int, torch.Tensor]] = []
        self.theta_at: dict[int, list[torch.Tensor]] = {}
        self.momentum_at: dict[int, list[torch.Tensor]] = {}
        self.steps = 0

    def batch(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.index + self.steps)
        return torch.randint(0, len(X), (BATCH,), generator=gen)

    def train(self, until_epoch: int, pause: float = 0.01, max_steps: int = 2000) -> None:
        while self.opt.epoch < until_epoch and self.steps < max_steps:
            idx = self.batch()
            epoch = self.opt.epoch
            _loss(self.model, idx).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.steps += 1
            self.consumed.append((epoch, idx))
            if self.opt.epoch != epoch:
                mode = self.opt.mode
                self.theta_at[self.opt.epoch] = [t.clone() for t in mode.theta]
                self.momentum_at[self.opt.epoch] = [
                    mode.outer.state[t]["momentum_buffer"].clone()
                    for t in mode.theta
                    if "momentum_buffer" in mode.outer.state.get(t, {})
                ]
                # the model restarts its inner loop from θ
                assert _same(self.model.parameters(), mode.theta)
            threading.Event().wait(pause)  # stands for a real model's compute time


def _train_all(peers: list[Peer], until_epoch: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
        for future in [pool.submit(p.train, until_epoch) for p in peers]:
            future.result(timeout=120)


def _shutdown(peers) -> None:
    for p in peers:
        if p is not None:
            p.opt.shutdown()


def test_h1_outer_sgd_lr1_equals_synchronous_data_parallel_sgd(make_dhts):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = [
        Peer(i, m, _opt(d, m, inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    epochs = 4
    try:
        _train_all(peers, epochs)
        for p in peers:
            mode = p.opt.mode
            assert mode.rounds_succeeded == epochs and mode.rounds_failed == 0
            assert mode.solo_steps == mode.state_loads == 0
        for epoch in range(1, epochs + 1):
            assert _same(peers[0].theta_at[epoch], peers[1].theta_at[epoch])
        # one process, plain SGD on the union of each epoch's batches
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        for epoch in range(epochs):
            batches = [idx for p in peers for e, idx in p.consumed if e == epoch]
            assert len(batches) == 2
            sgd.zero_grad()
            _loss(model, torch.cat(batches)).backward()
            sgd.step()
        for got, want in zip(models[0].parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    finally:
        _shutdown(peers)


@pytest.mark.parametrize("compression", [None, "fp16", "8bit", "topk", "gravac"])
def test_peers_end_every_outer_step_bit_identical(make_dhts, compression):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]  # the same θ to start with
    if compression == "gravac":
        compression = GraVAC(theta_min=2, theta_max=4, window=2, epsilon=0.5)
    peers = []
    try:
        for i, (d, m) in enumerate(zip(dhts, models, strict=True)):
            inner = torch.optim.Adam(m.parameters(), lr=0.02)
            # the paper's outer defaults: Nesterov, lr 0.7, momentum 0.9
            opt = _opt(d, m, inner=inner, compression=compression, topk_density=0.5)
            peers.append(Peer(i, m, opt))
        _train_all(peers, 3)
        for p in peers:
            assert p.opt.mode.rounds_succeeded == 3
            assert p.opt.mode.outer.param_groups[0]["nesterov"] is True
        for epoch in (1, 2, 3):
            assert _same(peers[0].theta_at[epoch], peers[1].theta_at[epoch])
            assert _same(peers[0].momentum_at[epoch], peers[1].momentum_at[epoch])
            assert len(peers[0].momentum_at[epoch]) == 2
        # the inner optimizers' statistics stayed local (different batches, different moments)
        a, b = (p.opt.inner.state[p.opt.params[0]]["exp_avg"] for p in peers)
        assert not torch.equal(a, b)
        if isinstance(compression, GraVAC):
            assert compression.calls > 0
    finally:
        _shutdown(peers)
