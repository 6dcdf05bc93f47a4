"""``mode="diloco"`` on real ``moshpit.DHT`` facades over loopback TCP (one process, threads).

Each peer's loop records which batches it used at which outer epoch and its parameters after
every outer step, so the tests can compare peers bit for bit and replay the run in a single
process.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch
import trio

import moshpit
from compression import Float16, GraVAC, TopK, TopK2Bit, TwoWayCompression
from compression import decompress as moshpit_decompress
from moshpit.training.modes.diloco import _RegroupingFeedback, make_compression, outer_prefix
from tests.training.saturated_uplink import first_rounds_run_out, forced_views_come_back_empty

_spec = importlib.util.spec_from_file_location(
    "bench_modes", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_modes.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

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
        self.restart_at: dict[int, list[torch.Tensor]] = {}
        self.steps = 0

    def batch(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.index + self.steps)
        return torch.randint(0, len(X), (BATCH,), generator=gen)

    def train(
        self, until_epoch: int, pause: float = 0.01, max_steps: int = 2000, from_theta: bool = True
    ) -> None:
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
                self.restart_at[self.opt.epoch] = [
                    p.detach().clone() for p in self.model.parameters()
                ]
                # the model restarts its inner loop from θ (local error feedback: from θ minus
                # this peer's unsent residual)
                assert _same(self.model.parameters(), mode.theta) == from_theta
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
            assert p.opt.mode.theta_mismatches == 0
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


def test_bytes_sent_per_inner_step_fall_with_h(make_dhts):
    dhts = make_dhts(2)
    per_step = {}
    per_round = {}
    for h in (1, 4):
        models = [_model() for _ in dhts]
        peers = [
            Peer(i, m, _opt(d, m, run_id=f"bytes-{h}", inner_steps=h))
            for i, (d, m) in enumerate(zip(dhts, models, strict=True))
        ]
        try:
            _train_all(peers, 8 // h)
            modes = [p.opt.mode for p in peers]
            assert all(m.rounds_succeeded == 8 // h and m.rounds_failed == 0 for m in modes)
            assert all(p.steps == 8 for p in peers)
            sent = sum(m.bytes_sent for m in modes)
            assert sent > 0
            per_step[h] = sent / 16
            per_round[h] = sent / sum(m.rounds_succeeded for m in modes)
        finally:
            _shutdown(peers)
    assert per_round[1] == per_round[4]  # a round costs the same whatever H
    assert per_step[1] == 4 * per_step[4]


def test_lone_peer_applies_its_own_pseudo_gradient(make_dhts):
    (dht,) = make_dhts(1)
    model = _model()
    peer = Peer(0, model, _opt(dht, model, inner_steps=2))
    try:
        peer.train(until_epoch=2, pause=0.0)
        mode = peer.opt.mode
        assert mode.solo_steps == 2 and mode.rounds_succeeded == 0 and peer.steps == 4
        # the same in one process: 2 inner SGD steps, then Nesterov SGD on θ - θ_local
        ref = _model()
        theta = [p.detach().clone() for p in ref.parameters()]
        outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
        inner = torch.optim.SGD(ref.parameters(), lr=0.05)
        for epoch in range(2):
            for e, idx in peer.consumed:
                if e == epoch:
                    inner.zero_grad()
                    _loss(ref, idx).backward()
                    inner.step()
            for t, p in zip(theta, ref.parameters(), strict=True):
                t.grad = t - p.detach()
            outer.step()
            with torch.no_grad():
                for t, p in zip(theta, ref.parameters(), strict=True):
                    p.copy_(t)
        for got, want in zip(mode.theta, theta, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    finally:
        peer.opt.shutdown()


def test_joiner_and_laggard_load_theta_and_momentum(make_dhts, tmp_path):
    dhts = make_dhts(3)
    models = [_model() for _ in dhts]
    peers = [
        Peer(i, m, _opt(d, m, tmp_path, name=f"p{i}", target_group_size=3))
        for i, (d, m) in enumerate(zip(dhts[:2], models[:2], strict=True))
    ]
    late = None
    try:
        _train_all(peers, 2)
        for p in peers:
            p.opt.state.save_checkpoint(wait=True)  # what donors serve: their newest epoch
        with torch.no_grad():
            models[2].weight.fill_(7.0)  # a newcomer's own weights never reach the swarm
        opt = _opt(dhts[2], models[2], tmp_path, name="p2", target_group_size=3)
        late = Peer(2, models[2], opt)
        _loss(models[2], late.batch()).backward()
        opt.step()
        opt.zero_grad()
        assert opt.epoch == 2
        assert _same(opt.mode.theta, peers[0].theta_at[2])
        momentum = [opt.mode.outer.state[t]["momentum_buffer"] for t in opt.mode.theta]
        assert _same(momentum, peers[0].momentum_at[2])
        late.steps = 1
        # the joiner's rounds must hold all three: were it left out of one (it starts a step
        # behind; on a loaded machine the pair sometimes went on without it, ~1 run in 12),
        # it would catch up by loading state, which the count below is not about
        all_three = dict(FAST, min_group_size=3)
        for p in [*peers, late]:
            p.opt.mode.averager_config = moshpit.AveragerConfig(**all_three)
        _train_all([*peers, late], 4)
        for p in [*peers, late]:
            assert p.opt.epoch == 4
            assert p.opt.mode.rounds_succeeded >= 2, p.opt.mode.last_result
        assert late.opt.mode.state_loads == 0
        assert _same(peers[0].theta_at[4], late.theta_at[4])
        # the late peer pauses while the other two go on without it
        fast = dict(FAST, min_matchmaking_time=1.0)
        for p in [*peers, late]:
            p.opt.mode.averager_config = moshpit.AveragerConfig(**fast)
        for p in peers:
            p.opt.target_group_size = 2
        _train_all(peers, 6)
        for p in peers:
            p.opt.state.save_checkpoint(wait=True)  # what donors serve: their newest epoch
        outer_steps = late.opt.mode.outer_steps
        late.train(until_epoch=6, max_steps=late.steps + 3)
        assert late.opt.mode.state_loads == 1
        assert late.opt.mode.outer_steps == outer_steps  # no stale pseudo-gradient applied
        assert late.opt.epoch == 6
        assert _same(late.opt.mode.theta, peers[0].theta_at[6])
        assert _same(models[2].parameters(), peers[0].theta_at[6])
    finally:
        _shutdown([*peers, late])


def test_outer_epochs_never_share_an_averaging_key():
    assert outer_prefix("run", 3) != outer_prefix("run", 4)
    assert outer_prefix("run", 3) == "run.outer.3"


def test_compression_names_and_errors():
    assert make_compression(None, 0.01) == (None, None)
    codec, _ = make_compression("fp16", 0.01)
    assert isinstance(codec, Float16)
    for name in ("8bit", "topk", "sparse2bit"):
        spec, gravac = make_compression(name, 0.1)
        assert isinstance(spec, TwoWayCompression) and gravac is None
        assert isinstance(spec.sender, _RegroupingFeedback)
        assert isinstance(spec.reducer, _RegroupingFeedback)
    spec, _ = make_compression("sparse2bit", 0.02)
    for side in (spec.sender, spec.reducer):  # both directions: top 2% of 4096, 2 bits each
        assert isinstance(side.codec, TopK2Bit) and side.codec.k == 82
    controller = GraVAC()
    spec, gravac = make_compression(controller, 0.1)
    assert gravac is controller and isinstance(spec, TwoWayCompression)
    with pytest.raises(ValueError, match="compression must be one of"):
        make_compression("zip", 0.1)
    for name in ("topk", "sparse2bit"):
        with pytest.raises(ValueError, match="topk_density"):
            make_compression(name, 0.0)
        with pytest.raises(ValueError, match="reducer_density"):
            make_compression(name, 0.01, 1.5)
    # the reducer may send back more of the summed part than each member sent of its own
    spec, _ = make_compression("sparse2bit", 0.02, 0.08)
    assert spec.sender.codec.k == 82 and spec.reducer.codec.k == 328


def test_error_feedback_decay_reaches_the_members_own_residuals_only():
    """SparseLoCo's β decays what a member has not sent; the reducer's residual (of the mean
    it sends back) is not a momentum of anyone's progress and stays whole."""
    spec, _ = make_compression("sparse2bit", 0.02, 0.08, error_decay=0.95)
    assert spec.sender.decay == 0.95 and spec.reducer.decay == 1.0
    own = TwoWayCompression(TopK(0.5), TopK(0.5))
    same, _ = make_compression(own, 0.01, error_decay=0.9)
    assert same is own and own.sender.decay == 0.9 and isinstance(own.sender, _RegroupingFeedback)
    assert make_compression("4bit", 0.01)[0].sender.decay == 1.0
    with pytest.raises(ValueError, match="needs a compression with error feedback"):
        make_compression("fp16", 0.01, error_decay=0.9)
    with pytest.raises(ValueError, match="needs a compression with error feedback"):
        make_compression(None, 0.01, error_decay=0.9)
    for bad in (-0.5, 1.01, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match="error_feedback_decay"):
            moshpit.training.modes.options.DiLoCoOptions(error_feedback_decay=bad)
    preset = moshpit.DiLoCoOptions.sparseloco(16, inner_steps=50)
    assert (preset.compression, preset.topk_density, preset.reducer_density) == (
        "sparse2bit",
        0.01,
        0.16,
    )
    assert (preset.error_feedback_decay, preset.outer_momentum, preset.nesterov) == (
        0.95,
        0.0,
        False,
    )
    assert preset.outer_lr == 1.0 and preset.inner_steps == 50
    assert moshpit.DiLoCoOptions.sparseloco(200).reducer_density == 1.0
    with pytest.raises(ValueError, match="group_size"):
        moshpit.DiLoCoOptions.sparseloco(0)
    with pytest.raises(ValueError, match="choose one"):
        moshpit.training.modes.options.DiLoCoOptions(
            error_feedback_decay=0.95, local_error_feedback=True
        )
    with pytest.raises(ValueError, match="reducer_density"):
        moshpit.training.modes.options.DiLoCoOptions(reducer_density=0)
    with pytest.raises(TypeError, match="compression must be"):
        make_compression(3, 0.1)


def test_a_checkpoint_from_before_fragment_scopes_keeps_its_residuals():
    """Residual keys were ``(start, end)`` before streaming fragments got scopes; such a
    checkpoint's residuals must still meet their ranges (scope 0), not sit unmatched."""
    spec, _ = make_compression("topk", 0.5)
    old = {"residuals": {(0, 4): torch.tensor([1.0, 0.0, 0.0, 0.0])}}
    spec.sender.load_state_dict(old)
    assert torch.equal(spec.sender.residual((0, 4)), old["residuals"][(0, 4)])
    # the next message of that range carries it: top 2 of [1, 0.1, 0.2, 0.3] + residual
    sent = moshpit_decompress(spec.compress_send(torch.tensor([1.0, 0.1, 0.2, 0.3]), (0, 4)))
    assert sent[0] == 2.0
    spec.sender.load_state_dict(spec.sender.state_dict())  # scoped keys load as they are
    assert spec.sender.residual((0, 4)) is not None


def test_a_users_own_two_way_compression_gets_fragment_scopes_and_keeps_its_residuals():
    spec = TwoWayCompression(TopK(0.5), TopK(0.5))
    spec.compress_send(torch.tensor([1.0, 2.0, 0.0, 3.0]), (0, 4))  # residual [1, 0, 0, 0]
    same, gravac = make_compression(spec, 0.01)
    assert same is spec and gravac is None
    assert isinstance(spec.sender, _RegroupingFeedback)
    assert isinstance(spec.reducer, _RegroupingFeedback)
    assert torch.equal(spec.sender.residual((0, 4)), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    spec.sender.scope = 1  # another fragment's range (0, 4) starts without that residual
    assert spec.sender.residual((0, 4)) is None


def test_error_feedback_survives_a_new_group_size():
    spec, _ = make_compression("topk", 0.5)
    spec.compress_send(torch.arange(8.0), (0, 0))
    assert spec.sender.residual((0, 0)).shape == (8,)
    spec.compress_send(torch.arange(6.0), (0, 0))  # the group grew: parts are shorter
    assert spec.sender.residual((0, 0)).shape == (6,)


def _mlp(hidden: int = 3072) -> torch.nn.Module:
    """The same weights on every peer (a fixed generator); 6 * hidden + 1 parameters, so
    each member's third of the all-reduce is a full 4096-value codec chunk and a tail."""
    model = torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    return model


def _mlp_peers(dhts, **knobs) -> tuple[list[torch.nn.Module], list[Peer]]:
    """One ``_mlp`` and Adam-inside DiLoCo peer per DHT, all in one group of three."""
    models = [_mlp() for _ in dhts]
    peers: list[Peer] = []
    try:
        for i, (d, m) in enumerate(zip(dhts, models, strict=True)):
            inner = torch.optim.Adam(m.parameters(), lr=0.003)
            three = dict(FAST, min_group_size=3)
            opt = _opt(d, m, inner=inner, target_group_size=3, averager_options=three, **knobs)
            peers.append(Peer(i, m, opt))
    except BaseException:
        _shutdown(peers)  # the ones already made
        raise
    return models, peers


def _loss_at(model: torch.nn.Module, theta: list[torch.Tensor]) -> float:
    """The whole data set's loss of ``model`` with its parameters set to ``theta``."""
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        params = dict(zip(names, theta, strict=True))
        pred = torch.func.functional_call(model, params, (X,)).squeeze(-1)
        return float(torch.nn.functional.mse_loss(pred, Y))


def _every_round_lands_alike(peers: list[Peer], epochs: int) -> float:
    """Train until ``epochs``: every outer step lands on every peer, none alone, with one θ
    after each. Returns the loss of peer 0's model before training."""
    model = peers[0].model
    start = _loss_at(model, [p.detach().clone() for p in model.parameters()])
    _train_all(peers, epochs)
    for p in peers:
        mode = p.opt.mode
        assert mode.rounds_succeeded == epochs and mode.theta_mismatches == 0
        assert mode.solo_steps == mode.state_loads == 0
    for epoch in range(1, epochs + 1):
        for p in peers[1:]:
            assert _same(peers[0].theta_at[epoch], p.theta_at[epoch])
    return start


def test_sparseloco_settings_keep_theta_bit_identical_and_learn(make_dhts):
    """SparseLoCo: sparse2bit with the members' residuals decayed by β = 0.95 a round, no
    outer momentum (the decayed residual stands in for it), outer lr 1, and reducers that send
    back all that three members' top 2% can sum to. Every outer step ends with one θ."""
    epochs = 10
    models, peers = _mlp_peers(
        make_dhts(3), mode=moshpit.DiLoCoOptions.sparseloco(3, topk_density=0.02)
    )
    try:
        spec = peers[0].opt.mode.compression
        assert spec.sender.decay == 0.95 and spec.reducer.decay == 1.0
        assert spec.sender.codec.k == 82 and spec.reducer.codec.k == 246  # 2% and 3 x 2%
        assert peers[0].opt.mode_options.inner_steps == 3  # _opt's knobs go on top
        start = _every_round_lands_alike(peers, epochs)
        assert all(peers[0].momentum_at[e] == [] for e in range(1, epochs + 1))  # none kept
        end = _loss_at(models[0], peers[0].theta_at[epochs])
        # measured: 13.6 -> 0.50-0.56 after 10 steps (defaults with momentum 0.5: 0.71)
        assert end < 0.2 * start, (start, end)
    finally:
        _shutdown(peers)


def test_sparse2bit_three_peers_end_every_outer_step_bit_identical_and_learn(make_dhts):
    """compression='sparse2bit': each member sends the top 2% of every 4096 values of its
    pseudo-gradient at 2 bits, each reducer sums the decoded parts and sends the mean back
    re-sparsified, with error feedback on both sides.

    20 outer steps: with chunks of consecutive values (before chunks were interleaved), the
    loss fell to ~0.6-1.0 by step 8 and then climbed back to 2-5 by step 20 in every run, as
    the chunks that fell on the output layer held its update back in their residuals and
    released it late. Interleaved, it ends low (11 runs: 0.20-1.11 at step 20)."""
    epochs = 20
    # with H = 3 on this toy problem, momentum 0.9 overshoots and oscillates even
    # uncompressed (measured: dense, 4bit, topk and sparse2bit alike)
    knobs = dict(compression="sparse2bit", topk_density=0.02, outer_momentum=0.5)
    models, peers = _mlp_peers(make_dhts(3), **knobs)
    numel = sum(p.numel() for p in models[0].parameters())
    try:
        spec = peers[0].opt.mode.compression
        assert isinstance(spec.sender.codec, TopK2Bit) and isinstance(spec.reducer.codec, TopK2Bit)
        start = _every_round_lands_alike(peers, epochs)
        for p in peers:
            # ~0.26 bits per value each way plus framing, against 32 for float32: ~740 bytes
            # a round per peer measured, 100x less than float32 (4bit: ~14x less)
            assert p.opt.mode.bytes_sent / epochs < 4 * numel / 40, p.opt.mode.bytes_sent
        losses = []
        for epoch in range(1, epochs + 1):
            for p in peers[1:]:
                assert _same(peers[0].momentum_at[epoch], p.momentum_at[epoch])
            assert len(peers[0].momentum_at[epoch]) == 4
            losses.append(_loss_at(models[0], peers[0].theta_at[epoch]))
        # the loss falls (11 runs: 13.6 -> 12.2-13.4 -> ... -> 0.20-1.11 at step 20). A step
        # may push it up: the group's order, hence which reducer's residual a part meets,
        # changes from round to round (one full-suite run went 1.18 -> 2.72 at steps 6-9,
        # then fell to 1.11). It must not drift back as consecutive chunks made it (7 of 7
        # runs: 0.6-1.0 by step 8, then 2-5 in the last steps): the last five steps stay
        # below the worst of steps 6-10, and the last one below a tenth of the start
        trace = f"start {start:.3f}, losses {[round(x, 3) for x in losses]}"
        assert all(b < a for a, b in zip([start, *losses[:5]], losses[:5], strict=False)), trace
        assert max(losses[-5:]) < max(losses[5:10]), trace
        assert losses[-1] < 0.1 * start, trace
    finally:
        _shutdown(peers)


def _residuals(spec: TwoWayCompression) -> dict:
    state = spec.state_dict()
    return {side: state[side]["residuals"] for side in ("sender", "reducer")}


def test_a_failed_round_leaves_the_error_feedback_as_it_found_it(make_dhts, monkeypatch):
    """A round that fails after it began sending was never applied, and its Δ is taken again
    at the retry; the residuals it left would count that Δ twice (with top-k at 25%, three
    quarters of it). They are restored to what they were before the round."""
    (dht,) = make_dhts(1)
    model = _model()
    opt = _opt(dht, model, compression="topk", topk_density=0.25, inner_steps=2)
    try:
        mode, spec = opt.mode, opt.mode.compression
        _loss(model, torch.arange(BATCH)).backward()
        opt.step()  # the first step starts the mode (its state, hence its residuals, reset)
        opt.zero_grad()
        spec.compress_send(torch.arange(5.0), (0, 5))  # left by an earlier round
        before = _residuals(spec)
        assert before["sender"]

        def failing_average(epoch, expected):
            flat = torch.cat([d.reshape(-1) for d in mode.deltas])
            assert flat.abs().sum() > 0
            spec.compress_send(flat, (0, flat.numel()))  # sent, then a member left
            return moshpit.StepResult(False, "k", reason="a member left mid-round")

        monkeypatch.setattr(mode, "_average", failing_average)
        # another peer is at our epoch, so a failed round is retried at the next step
        monkeypatch.setattr(mode.rounds, "others", lambda view, epoch: (["another"], []))
        monkeypatch.setattr(mode.rounds, "expected", lambda view, epoch: 2)
        mode._alone = False
        _loss(model, torch.arange(BATCH)).backward()
        opt.step()
        assert mode.rounds_failed == 1 and mode.state.epoch == 0  # retried at the next step
        after = _residuals(spec)
        for side in ("sender", "reducer"):
            assert before[side].keys() == after[side].keys()
            assert all(torch.equal(before[side][k], after[side][k]) for k in before[side])
    finally:
        opt.shutdown()


def test_local_error_feedback_restarts_from_theta_minus_what_was_not_sent(make_dhts):
    """local_error_feedback=True: after each round the codec's sender residual moves into the
    model (θ minus it) and out of the codec, so the next Δ carries it once; θ stays
    bit-identical across peers. With 2 peers each sends one part (its own part is reduced
    uncompressed): the restart differs from θ by that part's residual, and nowhere else."""
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = []
    try:
        for i, (d, m) in enumerate(zip(dhts, models, strict=True)):
            opt = _opt(d, m, compression="topk", topk_density=0.25, local_error_feedback=True)
            peers.append(Peer(i, m, opt))
        seen: list[list[tuple]] = [[] for _ in peers]
        for peer, log in zip(peers, seen, strict=True):
            mode = peer.opt.mode
            original = mode._keep_unsent_local

            def keep(indices, fragment, mode=mode, original=original, log=log):
                log.append(list(mode.compression.sender.items()))
                original(indices, fragment)
                assert mode.compression.sender.items() == []  # now in the model

            mode._keep_unsent_local = keep
        with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
            jobs = [pool.submit(p.train, 4, from_theta=False) for p in peers]
            for job in jobs:
                job.result(timeout=120)
        for peer, log in zip(peers, seen, strict=True):
            mode = peer.opt.mode
            assert mode.rounds_succeeded == 4 and len(log) == 4
            for epoch, residuals in enumerate(log, start=1):
                ((key, residual),) = residuals  # the part sent to the other reducer
                (_, (start, end)) = key
                theta = torch.cat([t.reshape(-1) for t in peer.theta_at[epoch]])
                restart = torch.cat([t.reshape(-1) for t in peer.restart_at[epoch]])
                gap = theta - restart
                assert torch.allclose(gap[start:end], residual, atol=1e-6)
                assert float(residual.abs().sum()) > 0
                assert not bool(gap[:start].any()) and not bool(gap[end:].any())
        for epoch in range(1, 5):
            assert _same(peers[0].theta_at[epoch], peers[1].theta_at[epoch])
    finally:
        _shutdown(peers)


def test_fragments_keep_their_error_feedback_apart(make_dhts):
    """Streaming: each fragment's round keys its residuals by flat ranges of its own tensors,
    so two fragments' ranges coincide; sharing a residual would send one fragment's unsent
    values as the other's. Fragment 0 compresses [1, 2, 3, 4], fragment 1 [10, 20, 30, 40]
    under the same range; fragment 0's next message holds only its own leftovers."""
    (dht,) = make_dhts(1)
    model = _model()
    opt = _opt(dht, model, compression="topk", topk_density=0.25, fragments=2)
    try:
        mode, spec = opt.mode, opt.mode.compression
        mode._feedback_snapshot(0)
        spec.compress_send(torch.tensor([1.0, 2.0, 3.0, 4.0]), (0, 4))
        mode._feedback_snapshot(1)
        spec.compress_send(torch.tensor([10.0, 20.0, 30.0, 40.0]), (0, 4))
        mode._feedback_snapshot(0)
        sent = spec.compress_send(torch.zeros(4), (0, 4))
        values = moshpit_decompress(sent)
        assert 0 < float(values.abs().max()) <= 3.0, values
    finally:
        opt.shutdown()


def test_bad_knobs_and_state_dict_round_trip(make_dhts):
    (dht,) = make_dhts(1)
    model = _model()
    with pytest.raises(ValueError, match="inner_steps"):
        _opt(dht, model, inner_steps=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        _opt(dht, model, outer_momentum=1.0)
    opt = _opt(dht, model, inner_steps=2)
    try:
        for _ in range(5):
            _loss(model, torch.arange(BATCH)).backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()
        assert state["epoch"] == 2 and state["mode_state"]["local_steps"] == 1
        other_model = _model()
        other = _opt(dht, other_model, run_id="other-run", inner_steps=2)
        try:
            other.load_state_dict(state)
            assert other.epoch == 2 and other.mode.local_steps == 1
            assert _same(other.mode.theta, opt.mode.theta)
            momentum = [other.mode.outer.state[t]["momentum_buffer"] for t in other.mode.theta]
            assert _same(
                momentum, [opt.mode.outer.state[t]["momentum_buffer"] for t in opt.mode.theta]
            )
        finally:
            other.shutdown()
    finally:
        opt.shutdown()


def _check_diloco_claim(lines: list[dict], peers: int) -> None:
    sync = lines[0]
    assert sync["mode"] == "sync" and sync["global_steps"] >= sync["steps"]
    assert sync["accuracy"] >= 90.0  # the task was actually learned
    for run, summary in zip(lines[1::2], lines[2::2], strict=True):
        assert run["rounds"] == [run["steps"] // 50] * peers and run["solo_steps"] == [0] * peers
        assert run["max_param_gap"] == 0.0  # every peer ends on the same θ
        assert summary["accuracy_gap"] <= 2.0
        assert summary["bytes_ratio"] >= 50
        assert summary["claim_holds"]
    assert lines[-1]["bytes_ratio"] >= 100  # fp16 halves it again


def test_h50_lands_within_two_points_of_sync_sending_50x_less():
    _check_diloco_claim(bench.diloco(peers=2, seed=0, steps=300), peers=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1])  # seed 2 passed too; dropped to keep the suite in budget
def test_h50_claim_on_other_seeds_and_longer_training(seed):
    # two peers: with three, sync-mode laggards load state mid-run, and a failed download
    # there (StateDownloadError under load) ends the baseline run
    _check_diloco_claim(bench.diloco(peers=2, seed=seed, steps=500), peers=2)


def test_sigterm_leave_checkpoints_and_a_restart_resumes_from_it(make_dhts, tmp_path):
    (dht,) = make_dhts(1)
    quick = dict(FAST, min_matchmaking_time=0.5, request_timeout=0.5)
    model = _model()
    peer = Peer(0, model, _opt(dht, model, tmp_path, name="me", averager_options=quick))
    peer.train(until_epoch=2, pause=0.0)
    theta = [t.clone() for t in peer.opt.mode.theta]
    outer = peer.opt.mode.outer
    momentum = [outer.state[t]["momentum_buffer"].clone() for t in peer.opt.mode.theta]
    _loss(model, peer.batch()).backward()
    peer.opt.step()  # one inner step into epoch 2's round: not part of the shared state
    peer.opt.leave_swarm(deadline=10.0)  # what the SIGTERM handler calls
    fresh = _model()
    with torch.no_grad():
        fresh.weight.fill_(5.0)
    opt = _opt(dht, fresh, tmp_path, name="me", averager_options=quick)
    try:
        assert opt.epoch == 2  # restored from the checkpoint when built
        _loss(fresh, torch.arange(BATCH)).backward()
        opt.step()
        assert _same(opt.mode.theta, theta)
        assert _same([opt.mode.outer.state[t]["momentum_buffer"] for t in opt.mode.theta], momentum)
        assert opt.mode.local_steps == 1  # the inner loop restarted from θ
        assert not torch.equal(fresh.weight.detach(), torch.full_like(fresh.weight, 5.0))
    finally:
        opt.shutdown()


def _laggard_left_behind(make_dhts, serve_from_memory: bool) -> list[Peer]:
    """Three peers without a checkpoint_dir average epoch 1 together; two go on to epoch 2
    without the third, which then tries to follow."""
    dhts = make_dhts(3)
    quick = dict(FAST, min_matchmaking_time=1.0, request_timeout=1.0)
    # the first round must hold all three: were one left out (a slow start on a loaded
    # machine), it would wait load_state_timeout for a donor that never comes
    all_three = dict(quick, min_group_size=3)
    models = [_model() for _ in dhts]
    peers = [
        Peer(
            i,
            m,
            _opt(
                d,
                m,
                averager_options=all_three,
                target_group_size=3,
                load_state_timeout=60,
                serve_from_memory=serve_from_memory,
            ),
        )
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 1)
        for p in peers:
            assert p.opt.epoch == 1 and p.opt.mode.rounds_succeeded == 1, p.opt.mode.last_result
        *others, _laggard = peers
        for p in others:  # the other two go on without the laggard
            p.opt.target_group_size = 2
            p.opt.mode.averager_config = moshpit.AveragerConfig(**quick)
        _train_all(others, 2)
        others[0].opt.tracker.refresh(timeout=5)
    except BaseException:
        _shutdown(peers)
        raise
    return peers


def _wait_until_served(peer: Peer, epoch: int) -> None:
    """The state is hashed and served in the background after the outer step."""
    deadline = time.monotonic() + 10
    while peer.opt.state.served_epoch != epoch and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert peer.opt.state.served_epoch == epoch


def test_a_laggard_catches_up_from_peers_that_serve_their_state_from_memory(make_dhts):
    """No peer has a checkpoint_dir (an averager embedded in a training loop, the LM race):
    the two that stepped serve epoch 2 from memory, and the laggard loads it instead of
    stepping alone with θ split from theirs for good (the old behaviour: no donor at all)."""
    peers = []
    try:
        peers = _laggard_left_behind(make_dhts, serve_from_memory=True)
        *others, laggard = peers
        for p in others:
            _wait_until_served(p, 2)
        mode = laggard.opt.mode
        laggard.train(until_epoch=2, max_steps=laggard.steps + 20)
        assert laggard.opt.epoch == 2 and mode.state_loads == 1 and mode.solo_steps == 0
        for p in others:
            assert _same(p.opt.mode.theta, mode.theta)
            assert _same(p.momentum_at[2], laggard.momentum_at[2])
        _wait_until_served(laggard, 2)  # what it loaded it serves in turn: the same root
        newest = [st for st in others[0].opt.state._find_states() if st.epoch == 2]
        assert len(newest) == 1 and laggard.opt.dht.peer_id in newest[0].donors, newest
    finally:
        _shutdown(peers)


def test_laggard_without_donors_waits_then_goes_on_alone(make_dhts):
    peers = []
    try:
        peers = _laggard_left_behind(make_dhts, serve_from_memory=False)
        laggard = peers[-1]
        mode = laggard.opt.mode
        laggard.train(until_epoch=2, max_steps=laggard.steps + 3)
        # nobody serves epoch 2 (no checkpoint_dir, nothing served from memory): no stale
        # outer step, it keeps training
        assert laggard.opt.epoch == 1 and mode.outer_steps == 1 and mode._behind_since is not None
        assert mode.local_steps == 3  # (its first look may try a round: the view can be stale)
        assert laggard.opt.state.served_epoch is None
        laggard.opt.load_state_timeout = 0.0  # the wait for a donor is over
        mode._next_catch_up = -float("inf")
        laggard.train(until_epoch=2, max_steps=laggard.steps + 1)
        assert laggard.opt.epoch == 2 and mode.solo_steps == 1 and mode.state_loads == 0
    finally:
        _shutdown(peers)


def test_peers_that_start_from_different_weights_are_told(make_dhts):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    with torch.no_grad():
        models[1].weight.add_(1.0)  # another seed: θ differs from the first step on
    peers = [
        Peer(i, m, _opt(d, m, inner_steps=1))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 2)
        for p in peers:
            assert p.opt.mode.rounds_succeeded == 2
            assert p.opt.mode.theta_mismatches == 2
    finally:
        _shutdown(peers)


def test_each_epochs_averager_tells_the_group_the_codec_density_of_the_last(make_dhts, monkeypatch):
    """Every outer epoch has a new averager; the density our codec put on the wire last round
    goes to the next, so from the second round on the GroupInfo carries it (chunk sizes and
    the all-reduce's time on stated links follow it) instead of nobody knowing it."""
    from moshpit.averaging.allreduce import AllReduceService

    densities: list[tuple] = []
    real = AllReduceService.run

    async def spy(self, group, *args, **kwargs):
        densities.append(group.bytes_per_value)
        return await real(self, group, *args, **kwargs)

    monkeypatch.setattr(AllReduceService, "run", spy)
    dhts = make_dhts(2)
    peers = []
    try:
        for i, (d, m) in enumerate(zip(dhts, [_model() for _ in dhts], strict=True)):
            inner = torch.optim.Adam(m.parameters(), lr=0.02)
            peers.append(Peer(i, m, _opt(d, m, inner=inner, compression="8bit")))
        _train_all(peers, 3)
        assert all(p.opt.mode.rounds_succeeded == 3 for p in peers)
    finally:
        _shutdown(peers)
    assert len(densities) == 6
    assert densities[:2] == [(None, None)] * 2
    for later in densities[2:]:
        # 8-bit: one byte per value plus each chunk's scale and header
        assert all(b is not None and 1.0 <= b < 1.5 for b in later), later


def test_a_member_still_finishing_its_round_is_not_left_behind_by_the_members_done_first(
    make_dhts, monkeypatch
):
    """On a slow link the members of one round finish it seconds apart: the first to finish
    report the next epoch while the last are still taking in their results. The last must
    finish the round they are in, not take the others' new epoch for a swarm that moved on
    without them (they abandoned it, then waited for donors, then stepped alone: a split)."""
    from moshpit.averaging.averager import Averager

    dhts = make_dhts(3)  # the swarm's epoch is the second highest: two must finish first
    slow_node = dhts[2].peer_id
    real_write = Averager._write

    async def late_write(self, averaged):
        if self._host.peer_id == slow_node:  # its results arrive seconds after the other's
            await trio.sleep(3.0)
        await real_write(self, averaged)

    monkeypatch.setattr(Averager, "_write", late_write)
    models = [_model() for _ in dhts]
    peers = [
        Peer(i, m, _opt(d, m, inner=torch.optim.Adam(m.parameters(), lr=0.02), target_group_size=3))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 2)
        for p in peers:
            mode = p.opt.mode
            # (a busy machine may retry a round that started without one peer: not applied)
            assert mode.rounds_succeeded == 2
            assert mode.solo_steps == mode.state_loads == mode.theta_mismatches == 0
        for epoch in (1, 2):
            assert all(_same(peers[0].theta_at[epoch], p.theta_at[epoch]) for p in peers[1:])
    finally:
        _shutdown(peers)


def test_a_round_that_ran_out_of_time_is_retried_even_when_the_view_comes_back_empty(
    make_dhts, monkeypatch
):
    """Over a saturated home uplink the first outer round runs out of time (nobody knew the
    link), and the DHT read after it times out too: the view lists nobody at our epoch. The
    round's own group says otherwise (its members were under this epoch's key a moment ago).
    Before, every member of the 200 kbit/s race then went on alone, each on its own θ, and
    never shared one model again; now they retry, and the retry averages."""
    ran_out = first_rounds_run_out(monkeypatch)
    dhts = _two_peers_retry_then_agree(
        make_dhts, lambda peers: forced_views_come_back_empty(monkeypatch, peers)
    )
    assert ran_out == {d.peer_id for d in dhts}


def _two_peers_retry_then_agree(make_dhts, stage=None) -> list:
    """Two peers train two outer steps after a first round that went wrong (``stage`` gets
    their modes first): at least one round failed, both outer steps averaged, nobody stepped
    alone or loaded state, and θ is bit-identical after each. Returns the DHTs."""
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = [Peer(i, m, _opt(d, m)) for i, (d, m) in enumerate(zip(dhts, models, strict=True))]
    if stage is not None:
        stage([p.opt.mode for p in peers])
    try:
        _train_all(peers, 2)
        for p in peers:
            mode = p.opt.mode
            assert mode.rounds_failed >= 1 and mode.rounds_succeeded == 2
            assert mode.solo_steps == mode.state_loads == mode.theta_mismatches == 0
        for epoch in (1, 2):
            assert _same(peers[0].theta_at[epoch], peers[1].theta_at[epoch])
    finally:
        _shutdown(peers)
    return dhts


def test_a_round_that_averaged_only_part_of_the_pseudo_gradient_is_retried(make_dhts, monkeypatch):
    """Each peer's first round averages only the second half of Δ: the first half's reducer
    failed, and that half keeps each member's own values. Applied, it left every member on
    its own θ for good (the 200 kbit/s race: one member stepped with 17% averaged while the
    others retried). It is retried instead, as sync mode retries a partial gradient round,
    and every outer step after it is bit-identical."""
    from moshpit.averaging.allreduce import AllReduceService

    real_run = AllReduceService.run
    partial: set = set()

    async def first_round_half_averaged(self, group, tensors, *args, **kwargs):
        result = await real_run(self, group, tensors, *args, **kwargs)
        me = self.host.peer_id
        if me not in partial and result.averaged is not None:
            partial.add(me)
            flat_out = torch.cat([t.reshape(-1) for t in result.averaged])
            flat_own = torch.cat([t.reshape(-1) for t in tensors])
            half = flat_out.numel() // 2
            flat_out[:half] = flat_own[:half]  # the failed part kept our own values
            offset = 0
            for t in result.averaged:
                t.copy_(flat_out[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            result.averaged_numel = result.numel - half
            result.complete_numel = min(result.complete_numel, result.averaged_numel)
        return result

    monkeypatch.setattr(AllReduceService, "run", first_round_half_averaged)
    dhts = _two_peers_retry_then_agree(make_dhts)
    assert partial == {d.peer_id for d in dhts}
