"""``mode="sync"`` on real ``moshpit.DHT`` facades over loopback TCP (one process, threads).

Each peer's loop records which batches it accumulated at which epoch, so the tests can replay
the same training in a single process and compare parameters: the swarm must equal one
process training on the same global batches.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import trio

import moshpit
from compression import GraVAC, TopK, TwoWayCompression
from moshpit.training.grad_averager import grads_prefix
from tests.timing import patience
from tests.training.saturated_uplink import first_rounds_run_out, forced_views_come_back_empty

# a full group proceeds at once; min_matchmaking_time only bounds how long a leader waits for
# a peer that noticed the target late (generous: the machine is shared)
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


def _opt(dht, model, tmp_path=None, name="p", **kwargs):
    settings = dict(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        dht=dht,
        run_id="sync-test",
        batch_size_per_step=BATCH,
        target_batch_size=3 * BATCH,
        mode="sync",
        target_group_size=3,
        averager_options=FAST,
        load_state_timeout=5.0,
        checkpoint_dir=None if tmp_path is None else tmp_path / name,
        progress_ttl=6.0,
    )
    settings.update(kwargs)
    return moshpit.Optimizer(**settings)


def _same(xs, ys) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(xs, ys, strict=True))


def _loss(model, idx):
    return torch.nn.functional.mse_loss(model(X[idx]).squeeze(-1), Y[idx])


class Peer:
    """One training loop: batches chosen by (peer, step), params recorded at every epoch."""

    def __init__(self, index: int, model: torch.nn.Module, opt: moshpit.Optimizer):
        self.index, self.model, self.opt = index, model, opt
        self.consumed: list[tuple[int, torch.Tensor]] = []  # (epoch, batch indices)
        self.params_at: dict[int, list[torch.Tensor]] = {}
        self.steps = 0
        self.excluded: set[str] = set()  # peers the rounds left out for bad input

    def batch(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.index + self.steps)
        return torch.randint(0, len(X), (BATCH,), generator=gen)

    def train(
        self,
        until_epoch: int,
        pause: float = 0.02,
        max_steps: int = 2000,
        started: threading.Barrier | None = None,
        lockstep: bool = False,
    ) -> None:
        """Steps until ``until_epoch``; ``lockstep``: one batch per epoch, then wait for the
        swarm (``opt.mode.poll()``) instead of computing more."""
        first = True
        while self.opt.epoch < until_epoch and self.steps < max_steps:
            if not first and started is not None:
                # every peer is up (DHT, donors looked up, first report) before anyone can
                # reach the target: a busy machine must not start one peer seconds late
                started.wait(timeout=120)
                started = None
            first = False
            idx = self.batch()
            epoch = self.opt.epoch
            _loss(self.model, idx).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.steps += 1
            self.consumed.append((epoch, idx))
            result = self.opt.mode.last_result
            if result is not None:
                self.excluded |= {str(peer) for peer in result.excluded}
            deadline = time.monotonic() + 60
            while lockstep and self.opt.epoch == epoch and time.monotonic() < deadline:
                stepped = self.opt.mode.poll()
                result = self.opt.mode.last_result
                if result is not None:
                    self.excluded |= {str(peer) for peer in result.excluded}
                if not stepped:
                    threading.Event().wait(pause)
            if self.opt.epoch != epoch:
                self.params_at[self.opt.epoch] = [
                    p.detach().clone() for p in self.model.parameters()
                ]
            threading.Event().wait(pause)  # stands for a real model's compute time


def _train_all(peers: list[Peer], until_epoch: int, lockstep: bool = False) -> None:
    started = threading.Barrier(len(peers))
    with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
        for future in [
            pool.submit(p.train, until_epoch, started=started, lockstep=lockstep) for p in peers
        ]:
            future.result(timeout=120)


def _replay(peers: list[Peer], epochs: int) -> list[torch.Tensor]:
    """Single-process SGD on the same global batches: mean gradient of all batches of epoch e."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        batches = [idx for p in peers for e, idx in p.consumed if e == epoch]
        opt.zero_grad()
        _loss(model, torch.cat(batches)).backward()  # equal batch sizes: mean of means
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_three_peers_take_identical_steps_equal_to_one_process(make_dhts):
    dhts = make_dhts(3)
    models = [_model() for _ in dhts]
    # a full group (all three) proceeds at once; a peer that notices the target late (a busy
    # machine) still makes it into the round instead of having to load state
    patient = dict(FAST, min_matchmaking_time=10.0)
    peers = [
        Peer(i, m, _opt(d, m, averager_options=patient))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    epochs = 4
    try:
        # one batch per peer and epoch, then wait for the swarm: every round starts only
        # once all three reported, so nobody is late for it (and each global batch is 24)
        _train_all(peers, epochs, lockstep=True)
        for p in peers:
            mode = p.opt.mode
            assert mode.rounds_succeeded == epochs, (p.index, mode.rounds_failed)
            assert mode.solo_steps == mode.state_loads == 0
            assert p.opt.epoch == epochs
            # where the rounds' time went: each part was measured, and the training thread
            # waited at least as long as the all-reduce inside the rounds took
            times = mode.round_seconds
            assert min(times.values()) > 0 and times["waited"] >= times["allreduce"]
        for epoch in range(1, epochs + 1):  # bit-identical after every epoch
            first = peers[0].params_at[epoch]
            for p in peers[1:]:
                assert _same(first, p.params_at[epoch])
        for epoch in range(epochs):  # the global batch is exactly the target
            assert sum(len(i) for p in peers for e, i in p.consumed if e == epoch) == 3 * BATCH
        expected = _replay(peers, epochs)
        for got, want in zip(peers[0].model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    finally:
        for p in peers:
            p.opt.shutdown()


def test_the_last_member_of_a_round_finishes_it_though_the_first_moved_on(make_dhts, monkeypatch):
    """One member takes its result 3 s after the others (a slow link): the others step and
    report the next epoch meanwhile, which the slow one's view shows as the swarm having
    moved on. It finishes the round it is in instead of abandoning it and loading state."""
    from moshpit.averaging.averager import Averager

    dhts = make_dhts(3)
    slow_node = dhts[2].peer_id
    real_write = Averager._write

    async def late_write(self, averaged):
        if self._host.peer_id == slow_node:
            await trio.sleep(3.0)
        await real_write(self, averaged)

    monkeypatch.setattr(Averager, "_write", late_write)
    models = [_model() for _ in dhts]
    patient = dict(FAST, min_matchmaking_time=10.0)
    peers = [
        Peer(i, m, _opt(d, m, averager_options=patient))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 2, lockstep=True)
        for p in peers:
            mode = p.opt.mode
            # (a busy machine may retry a round that started without one peer: not applied)
            assert mode.rounds_succeeded == 2, p.index
            assert mode.solo_steps == mode.state_loads == 0
        for epoch in (1, 2):
            assert all(_same(peers[0].params_at[epoch], p.params_at[epoch]) for p in peers[1:])
    finally:
        for p in peers:
            p.opt.shutdown()


def play_epochs(mode, compute: float, round_: float, epochs: int = 8) -> None:
    """Feed the mode's epoch timer: ``compute`` s before each round, the round ``round_`` s."""
    for _ in range(epochs):
        mode._round_began = time.monotonic() - round_
        mode._epoch_began = mode._round_began - compute
        mode._note_epoch_times()


def test_rounds_that_cost_more_than_the_epochs_compute_are_reported_once(make_dhts, caplog):
    """An epoch of 0.2 s of compute and 1 s rounds (a target of one batch per peer): said
    once, with both numbers and the target that would fix it; not once per epoch."""
    (dht,) = make_dhts(1)
    mode = _opt(dht, _model()).mode
    try:
        with caplog.at_level(logging.WARNING, logger="moshpit.training.modes.sync"):
            play_epochs(mode, compute=0.2, round_=1.0, epochs=12)
        warnings = [r.getMessage() for r in caplog.records if "rounds take" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert re.search(
            r"rounds take 1\.\d\d s \(median of the last 4 epochs\) while an epoch's compute "
            r"takes 0\.\d\d s: the swarm averages 8\d% of the time\. Raise target_batch_size "
            r"\(now 24\) to about 4\d\d ",
            warnings[0],
        ), warnings[0]
    finally:
        mode.opt.shutdown()


def test_rounds_cheaper_than_the_epochs_compute_are_not_reported(make_dhts, caplog):
    (dht,) = make_dhts(1)
    mode = _opt(dht, _model()).mode
    try:
        with caplog.at_level(logging.WARNING, logger="moshpit.training.modes.sync"):
            play_epochs(mode, compute=5.0, round_=1.0)
        assert len(mode.epoch_times) == 8 and all(c > r for c, r in mode.epoch_times)
        assert "rounds take" not in caplog.text
    finally:
        mode.opt.shutdown()


def test_each_epoch_records_its_compute_and_round_time(make_dhts):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = [
        Peer(i, m, _opt(d, m, target_batch_size=2 * BATCH, target_group_size=2))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 4, lockstep=True)
        for p in peers:
            times = list(p.opt.mode.epoch_times)
            assert len(times) == p.opt.mode.rounds_succeeded == 4, times
            assert all(compute >= 0 and round_ > 0 for compute, round_ in times), times
    finally:
        for p in peers:
            p.opt.shutdown()


def test_lone_peer_trains_alone_like_one_process(make_dhts):
    (dht,) = make_dhts(1)
    model = _model()
    peer = Peer(0, model, _opt(dht, model))
    try:
        peer.train(until_epoch=3, pause=0.0)
        mode = peer.opt.mode
        assert mode.solo_steps == 3 and mode.rounds_succeeded == 0
        assert peer.steps == 9  # 3 local batches of 8 per global batch of 24
        expected = _replay([peer], 3)
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    finally:
        peer.opt.shutdown()


def test_nan_gradients_publish_nothing(make_dhts):
    (dht,) = make_dhts(1)
    model = _model()
    opt = _opt(dht, model)
    try:
        _loss(model, torch.arange(BATCH)).backward()
        opt.step()
        assert opt.mode.grads.samples == BATCH
        reported = opt.tracker.local_progress()
        model(torch.full((2, 4), float("nan"))).sum().backward()
        opt.step()
        assert opt.skipped_steps == 1
        assert opt.mode.grads.samples == BATCH  # nothing accumulated
        assert all(bool(torch.isfinite(s).all()) for s in opt.mode.grads.sums)
        assert opt.tracker.local_progress().samples == reported.samples
    finally:
        opt.shutdown()


@pytest.mark.parametrize("donors", ["checkpoint_dir", "memory"])
def test_late_joiner_and_laggard_load_state_instead_of_stepping(make_dhts, tmp_path, donors):
    """With ``memory``, no peer has a checkpoint_dir: they serve their state from memory."""
    dhts = make_dhts(3)
    models = [_model() for _ in dhts]
    fast = dict(FAST, min_matchmaking_time=1.5)
    directory = tmp_path if donors == "checkpoint_dir" else None

    def serve(p: Peer) -> None:  # what donors serve: their newest epoch
        if directory is None:
            p.opt.state.serve_from_memory(wait=True)
        else:
            p.opt.state.save_checkpoint(wait=True)

    peers = [
        Peer(i, m, _opt(d, m, directory, name=f"p{i}", averager_options=fast))
        for i, (d, m) in enumerate(zip(dhts[:2], models[:2], strict=True))
    ]
    late = None
    try:
        _train_all(peers, 2)
        for p in peers:
            serve(p)
        # a newcomer with other weights: its first step loads the swarm's state, not ours
        with torch.no_grad():
            models[2].weight.fill_(7.0)
        late = Peer(2, models[2], _opt(dhts[2], models[2], directory, "p2", averager_options=fast))
        _loss(models[2], late.batch()).backward()
        late.opt.step()
        late.opt.zero_grad()
        assert late.opt.epoch == 2
        assert _same(models[2].parameters(), peers[0].params_at[2])
        _train_all([*peers, late], 4)
        for p in [*peers, late]:
            assert p.opt.epoch == 4
        assert _same(peers[0].params_at[4], late.params_at[4])
        # the late peer pauses while the other two go on: two peers are past it
        _train_all(peers, 6)
        for p in peers:  # a checkpoint skipped while the previous one was written: write it
            serve(p)
        before = late.opt.mode.global_steps
        late.train(until_epoch=6, max_steps=200)
        assert late.opt.mode.state_loads >= 1
        assert late.opt.mode.global_steps == before  # it never stepped on stale parameters
        assert late.opt.epoch == 6
        assert _same(models[2].parameters(), peers[0].params_at[6])
    finally:
        for p in [*peers, late]:
            if p is not None:
                p.opt.shutdown()


def test_gravac_and_two_way_compression_keep_peers_identical(make_dhts):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    controller = GraVAC(theta_min=2, theta_max=4, window=2, epsilon=0.5)
    options = [
        dict(compression=controller),
        dict(compression=TwoWayCompression(TopK(0.5, exact=True), TopK(0.5, exact=True))),
    ]
    for kwargs in options:
        peers = [
            Peer(i, m, _opt(d, m, target_batch_size=2 * BATCH, target_group_size=2, **kwargs))
            for i, (d, m) in enumerate(zip(dhts, models, strict=True))
        ]
        try:
            start = peers[0].opt.epoch
            _train_all(peers, start + 3)
            for p in peers:
                assert p.opt.mode.rounds_succeeded >= 2
            last = max(peers[0].params_at)
            assert _same(peers[0].params_at[last], peers[1].params_at[last])
        finally:
            for p in peers:
                p.opt.shutdown()
    assert controller.calls > 0


def test_delayed_averaging_applies_the_same_update_one_step_late(make_dhts):
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = [
        Peer(
            i, m, _opt(d, m, target_batch_size=2 * BATCH, target_group_size=2, delay_averaging=True)
        )
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    try:
        _train_all(peers, 3)
        for p in peers:
            p.opt.mode.flush()
            assert p.opt.mode.rounds_succeeded == 3
        assert _same(models[0].parameters(), models[1].parameters())
    finally:
        for p in peers:
            p.opt.shutdown()


def test_delayed_averaging_with_four_peers_one_slow_keeps_every_peer_in_every_round(make_dhts):
    """Found by bench_lm.py: with delayed averaging a peer enters epoch e + 1 when it starts
    round e, so two fast peers looked "ahead" to a slower one, which then loaded state
    instead of joining round e, and the round waited for it in vain. A peer now reports the
    epoch of its round in flight until that round is applied."""
    dhts = make_dhts(4)
    models = [_model() for _ in dhts]
    opts = [
        _opt(
            d,
            m,
            target_batch_size=4 * BATCH,
            target_group_size=4,
            delay_averaging=True,
            # four peers in one process: on a loaded machine (a replica beside two busy
            # processes) all four missed a 6-s matchmaking window together
            averager_options={**FAST, "request_timeout": patience(2.0)},
        )
        for d, m in zip(dhts, models, strict=True)
    ]
    peers = [Peer(i, m, o) for i, (m, o) in enumerate(zip(models, opts, strict=True))]
    pauses = [0.01, 0.01, 0.01, 0.15]  # the last peer computes a batch 15x slower
    try:
        started = threading.Barrier(4)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(p.train, 4, pause=pause, max_steps=200, started=started)
                for p, pause in zip(peers, pauses, strict=True)
            ]
            for future in futures:
                future.result(timeout=120)
        for p in peers:
            p.opt.mode.flush()
            assert p.opt.mode.state_loads == 0, p.index
            assert p.opt.mode.rounds_failed == 0 and p.opt.mode.rounds_succeeded == 4
        for m in models[1:]:
            assert _same(models[0].parameters(), m.parameters())
    finally:
        for p in peers:
            p.opt.shutdown()


def test_delayed_averaging_keeps_the_batch_whose_step_applies_the_previous_round(make_dhts):
    """Found by bench_lm.py (delayed sync learned far less per step than sync): the step() that
    applied the previous epoch's round wrote the round's mean into .grad before adding the
    user's fresh batch, so that batch was counted in the samples but its gradient was lost.
    Every batch must be in the sums: samples > 0 means sums == the batches' gradients."""
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    opts = [
        # two batches per peer and epoch: the round of e finishes during e + 1's first batch
        _opt(d, m, target_batch_size=4 * BATCH, target_group_size=2, delay_averaging=True)
        for d, m in zip(dhts, models, strict=True)
    ]
    lost: list[tuple[int, int]] = []

    def train(i: int) -> None:
        grads = opts[i].mode.grads
        expected = [torch.zeros_like(t) for t in grads.sums]
        for step in range(400):
            if opts[i].epoch >= 4:
                return
            idx = torch.randint(0, len(X), (BATCH,), generator=torch.Generator().manual_seed(step))
            _loss(models[i], idx).backward()
            batch = [p.grad.detach().clone() * BATCH for p in models[i].parameters()]
            samples_before = grads.samples
            opts[i].step()
            opts[i].zero_grad()
            if grads.samples == samples_before + BATCH:  # the batch went into this epoch's sums
                for total, g in zip(expected, batch, strict=True):
                    total.add_(g.reshape(total.shape))
                if not all(
                    torch.allclose(a, b, atol=1e-5)
                    for a, b in zip(grads.sums, expected, strict=True)
                ):
                    lost.append((i, step))
            else:  # the epoch moved on: its sums were used and reset
                for total in expected:
                    total.zero_()
                for total, g in zip(expected, grads.sums, strict=True):
                    total.copy_(g)
            threading.Event().wait(0.2)  # a slow batch: the round ends before the next step

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(train, i) for i in range(2)]:
                future.result(timeout=120)
        assert all(o.epoch >= 4 for o in opts)
        assert lost == [], f"batches lost (peer, step): {lost}"
    finally:
        for o in opts:
            o.shutdown()


def test_nan_gradients_from_the_network_move_nobody(make_dhts, monkeypatch):
    """An attacker joins every epoch's round with NaN gradients and a huge sample count: the
    honest peers exclude it (logged reason) and train exactly as if it were not there."""
    # the attacker shares this process: lift the sender's own refusal to send NaN (honest
    # peers' tensors are finite anyway); what is tested is the receivers' exclusion
    monkeypatch.setattr("moshpit.averaging.allreduce._all_finite", lambda tensors: True)
    dhts = make_dhts(3)
    models = [_model() for _ in dhts[:2]]
    fast = dict(FAST, min_matchmaking_time=4.0)
    peers = [
        Peer(i, m, _opt(d, m, averager_options=fast, target_batch_size=2 * BATCH))
        for i, (d, m) in enumerate(zip(dhts[:2], models, strict=True))
    ]
    stop = threading.Event()
    attacker_results = []

    def attack() -> None:
        poison = [torch.full(p.shape, float("nan")) for p in models[0].parameters()]
        while not stop.is_set():
            epoch = peers[0].opt.epoch
            averager = moshpit.Averager(
                poison, dhts[2], grads_prefix("sync-test", epoch), target_group_size=3, **fast
            )
            try:
                attacker_results.append(averager.step(weight=1e9, timeout=4.0))
            finally:
                averager.shutdown()

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            attacker = pool.submit(attack)
            _train_all(peers, 3, lockstep=True)
            stop.set()
            attacker.result(timeout=30)
        attacker_id = str(dhts[2].peer_id)
        assert any(len(r.members) >= 2 for r in attacker_results)  # it did get into rounds
        assert any(attacker_id in p.excluded for p in peers)
        for p in peers:
            assert p.opt.mode.rounds_succeeded == 3
        assert _same(peers[0].params_at[3], peers[1].params_at[3])
        expected = _replay(peers, 3)
        for got, want in zip(models[0].parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    finally:
        stop.set()
        for p in peers:
            p.opt.shutdown()


def test_a_round_missing_peers_its_members_know_is_not_applied(make_dhts):
    """Two groups formed under one key would each apply their own mean: a group smaller than
    what any member sees at the epoch (capped at the group size) is rejected, by every member
    alike (the declarations are shared)."""
    from moshpit.averaging.averager import StepResult

    (dht,) = make_dhts(1)
    model = _model()
    opt = _opt(dht, model, target_group_size=3)
    try:

        def result(size: int, *claims: object) -> StepResult:
            members = tuple(range(size))
            gathered = {i: c for i, c in zip(members, claims, strict=False)}
            return StepResult(True, "k", members=members, gathered=gathered, averaged_fraction=1)

        assert opt.mode.rounds.complete(result(2, {"peers": 2}, {"peers": 2}))
        assert not opt.mode.rounds.complete(result(2, {"peers": 2}, {"peers": 4}))
        assert opt.mode.rounds.complete(
            result(3, {"peers": 3}, {"peers": 10**9}, {"peers": 3})
        )  # cap
        assert opt.mode.rounds.complete(result(2, {"peers": "many"}, None))  # junk claims count 0
    finally:
        opt.shutdown()


def test_a_peer_training_another_model_is_neither_waited_for_nor_counted(make_dhts):
    """Two peers of one model and a third of another shape under the same run id (e.g. a
    different hidden size). The third can never join the pair's gradient rounds (its tensor
    schema differs), so the pair must not wait for it: each of their rounds forms at once,
    none fails, and the third's samples do not count toward their batch. (Before, its
    progress record made it an expected member of every round: every round of all three
    waited out the matchmaking timeout for a group of 3 that could never form.)"""
    dhts = make_dhts(3)
    models = [_model(), _model()]
    peers = [Peer(i, m, _opt(d, m)) for i, (d, m) in enumerate(zip(dhts[:2], models, strict=True))]
    other_model = torch.nn.Linear(4, 2)  # another shape
    other = _opt(dhts[2], other_model)
    stop = threading.Event()
    epochs = 3

    def train(peer: Peer) -> None:
        # until epoch 3, or the first failed round (on a broken build: instead of waiting
        # for a minute of failed rounds)
        while peer.opt.epoch < epochs and peer.opt.mode.rounds_failed == 0 and peer.steps < 500:
            if stop.is_set():
                return
            idx, epoch = peer.batch(), peer.opt.epoch
            _loss(peer.model, idx).backward()
            peer.opt.step()
            peer.opt.zero_grad()
            peer.steps += 1
            if peer.opt.epoch != epoch:
                peer.params_at[peer.opt.epoch] = [
                    q.detach().clone() for q in peer.model.parameters()
                ]
            threading.Event().wait(0.02)

    def train_other() -> None:
        while not stop.is_set():
            idx = torch.randint(0, len(X), (BATCH,))
            out = other_model(X[idx]).sum(-1)
            torch.nn.functional.mse_loss(out, Y[idx]).backward()
            other.step()
            other.zero_grad()
            threading.Event().wait(0.02)

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            background = pool.submit(train_other)
            for future in [pool.submit(train, p) for p in peers]:
                future.result(timeout=120)
            stop.set()
            background.result(timeout=60)
        other_peer = str(other.tracker.peer_id)
        for p in peers:
            mode = p.opt.mode
            assert mode.rounds_failed == 0, (p.index, mode.last_result)
            assert p.opt.epoch == epochs and mode.rounds_succeeded == epochs
            assert mode.solo_steps == mode.state_loads == 0
            view = p.opt.tracker.global_progress
            assert other_peer in view.other_schemas
            assert other_peer not in {q.peer_id for q in view.peers}
            assert mode.rounds.expected(view, p.opt.epoch) <= 2
            assert mode.last_group_size == 2
        for epoch in range(1, epochs + 1):  # the pair took identical steps
            assert _same(peers[0].params_at[epoch], peers[1].params_at[epoch])
        view = other.tracker.global_progress
        assert view.num_peers == 1 and len(view.other_schemas) == 2
    finally:
        stop.set()
        for p in peers:
            p.opt.shutdown()
        other.shutdown()


def test_next_round_does_not_wait_for_members_that_failed_or_were_excluded():
    """A peer that joined our round and then failed (or sent bad input) is not awaited in the
    next one: otherwise one misbehaving peer would hold every round until it times out."""
    from moshpit.training.modes.epoch_rounds import EpochRounds

    rounds = EpochRounds("me", target_group_size=8)
    result = SimpleNamespace(
        members=["me", "honest", "crashed", "poisoner"],
        failed={"crashed"},
        excluded={"poisoner": "non-finite values"},
    )
    rounds.stepped_with(result)
    assert rounds.last_members == {"honest"}
    view = SimpleNamespace(peers=[], epoch=1)
    assert rounds.awaited(view, 1) == {"honest"}


def test_peers_behind_are_awaited_for_a_while_not_forever():
    """Peers one epoch behind that keep reporting are on their way (stepping into our epoch
    or loading our state) and our round waits for them, but not forever: a chaos run sat
    90 s with three peers at 278 waiting for three at 277 that could not load 278."""
    from moshpit.training.modes.epoch_rounds import BEHIND_PATIENCE, EpochRounds
    from moshpit.training.progress import PeerProgress

    rounds = EpochRounds("me", target_group_size=8)
    rounds.stepped_with(SimpleNamespace(members=["me", "m1"], failed=set(), excluded={}))
    entered = rounds.epoch_started
    behind = [
        PeerProgress("m1", 277, 40, 10.0, entered),
        PeerProgress("n1", 277, 40, 10.0, entered),
    ]
    here = PeerProgress("h1", 278, 8, 10.0, entered)
    view = SimpleNamespace(peers=[*behind, here], epoch=278)
    # just entered 278: everyone reporting is awaited (reports 1 s old)
    assert rounds.awaited(view, 278, now=entered + 1.0) == {"m1", "n1", "h1"}
    # much later, still reporting (the reports are fresh), still behind: not any more
    fresh = [PeerProgress(p.peer_id, p.epoch, p.samples, 10.0, entered + 100.0) for p in behind]
    later = SimpleNamespace(peers=[*fresh, here], epoch=278)
    assert rounds.awaited(later, 278, now=entered + BEHIND_PATIENCE + 1.0) == {"h1"}
    # a peer loading the state of our epoch reports nothing while it downloads: awaited (for
    # as long), though its last report is old and its epoch far behind
    loading = PeerProgress("l1", 12, 0, 10.0, entered - 50.0, catching_up=278)
    view = SimpleNamespace(peers=[here, loading], epoch=278)
    assert "l1" in rounds.awaited(view, 278, now=entered + 10.0)
    assert "l1" not in rounds.awaited(view, 278, now=entered + BEHIND_PATIENCE + 1.0)
    # a peer with long steps gets its steps' worth more patience
    slow = [PeerProgress("n1", 277, 40, 1.0, entered + 100.0, step_seconds=20.0), fresh[0]]
    assert rounds.awaited(
        SimpleNamespace(peers=slow, epoch=278), 278, now=entered + BEHIND_PATIENCE + 10.0
    ) == {"n1"}


def test_a_round_with_its_group_is_waited_for_though_the_view_moved_on():
    """The view shows a later epoch: a round still matchmaking is abandoned, one whose group
    formed is waited for (its members done first are the later epoch), and one whose step
    just ended (the flag drops a moment before the result) is taken."""
    from moshpit.training.modes.epoch_rounds import wait_unless_left_behind

    ahead = SimpleNamespace(epoch=8)

    def run(in_group, resolve_after: float) -> tuple[bool, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        timer = threading.Timer(resolve_after, future.set_result, ("done",))
        timer.start()
        try:
            return wait_unless_left_behind(future, 7, 0.02, lambda: ahead, in_group), future
        finally:
            timer.cancel()

    kept, future = run(lambda: True, 0.3)  # several looks at the view while in the group
    assert kept and future.result() == "done"
    kept, future = run(lambda: False, 5.0)  # still looking for a group: left behind
    assert not kept and not future.done()
    flag = iter([True] * 5)  # in the group for five looks, then the step ends
    kept, future = run(lambda: next(flag, False), 0.12)
    assert kept and future.done()
    # the view at our epoch: waited for either way
    ahead = SimpleNamespace(epoch=7)
    assert run(lambda: False, 0.1)[0]


def test_epoch_rounds_use_their_own_prefix():
    assert grads_prefix("run", 3) != grads_prefix("run", 4)
    assert grads_prefix("run", 3).startswith("run.grads.")


@pytest.mark.parametrize("slow_peer", [False, True], ids=["equal", "one-2x-slower"])
def test_back_to_back_steps_honor_the_target_batch(make_dhts, slow_peer):
    """4 peers that step back to back (no waiting for the swarm): each global step holds at
    most 1.1 x target_batch_size + one local batch per peer. The swarm's view lags by a
    refresh, so a peer that waited for it (or for its own count) overshot ~3x."""
    dhts = make_dhts(4)
    models = [_model() for _ in dhts]
    target = 4 * BATCH
    patient = dict(FAST, min_matchmaking_time=10.0)
    peers = [
        Peer(
            i,
            m,
            _opt(d, m, target_batch_size=target, target_group_size=4, averager_options=patient),
        )
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    epochs = 8
    # a step's compute time: long enough that a parallel test on the other core does not
    # turn the peers' pace into noise
    pauses = [0.05, 0.05, 0.05, 0.1 if slow_peer else 0.05]
    try:
        started = threading.Barrier(len(peers))
        with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
            futures = [
                pool.submit(p.train, epochs, pause=pause, max_steps=400, started=started)
                for p, pause in zip(peers, pauses, strict=True)
            ]
            for future in futures:
                future.result(timeout=240)
        bound = 1.1 * target + len(peers) * BATCH
        per_epoch = {
            e: sum(len(i) for p in peers for ep, i in p.consumed if ep == e) for e in range(epochs)
        }
        # epoch 0 starts as the peers come up one by one, and until the peers' throughput
        # estimates settle (epochs 1-3) a peer starved of CPU (a parallel test run) may step
        # on its own count alone: up to 4x then, measured. From epoch 4 on, a step holds at
        # most the bound on average (the old code overshot ~3x, every step); a single step
        # may hold one more batch per peer when a peer was starved right when it should have
        # stopped.
        later = [per_epoch[e] for e in range(4, epochs)]
        assert sum(later) / len(later) <= bound, (per_epoch, bound)
        assert max(later) <= bound + len(peers) * BATCH, (per_epoch, bound)
        # what the code itself counted for each global step: the round members' samples
        for p in peers:
            counted = dict(p.opt.mode.step_samples)
            assert all(counted[e] == per_epoch[e] for e in range(4, epochs)), (counted, per_epoch)
        for p in peers:  # (a peer may load state once at the start: views are young)
            assert p.opt.mode.solo_steps == 0
        last = max(peers[0].params_at)
        for p in peers[1:]:
            assert _same(peers[0].params_at[last], p.params_at[last])
    finally:
        for p in peers:
            p.opt.shutdown()


def test_a_state_download_that_times_out_during_catch_up_does_not_stop_the_peer(
    make_dhts, monkeypatch
):
    """Found by bench_lm.py: a peer behind the swarm whose state download ran out of time
    raised StateDownloadError out of step() and died. It keeps its state, trains on and looks
    again later."""
    from moshpit.training.errors import StateDownloadError

    (dht,) = make_dhts(1)
    model = _model()
    opt = _opt(dht, model)
    try:
        _loss(model, torch.arange(BATCH)).backward()
        opt.step()  # starts the mode (its first synchronize finds nobody)
        mode = opt.mode
        ahead = type("View", (), {"epoch": mode.state.epoch + 3})()
        monkeypatch.setattr(mode, "_view", lambda force=False: ahead)

        def download_times_out(again: bool = False) -> None:
            raise StateDownloadError("the state download did not finish within 20.0s")

        monkeypatch.setattr(mode.state, "synchronize", download_times_out)
        before = time.monotonic()
        _loss(model, torch.arange(BATCH)).backward()
        opt.step()  # must not raise
        assert mode.state_loads == 0 and mode._next_catch_up > before
        assert all(p.isfinite().all() for p in model.parameters())
    finally:
        opt.shutdown()


def test_an_epoch_that_keeps_waiting_says_why_once_a_minute(make_dhts, caplog):
    """A stalled swarm once logged nothing at all: its peers kept stepping, retrying at INFO."""
    (dht,) = make_dhts(1)
    mode = _opt(dht, _model()).mode
    try:
        with caplog.at_level(logging.WARNING, logger="moshpit.training.modes.base"):
            mode.waiting("no donor served its newer state yet")  # the first wait: quiet
            assert "has not moved" not in caplog.text
            epoch, since = mode._waiting_since
            mode._waiting_since = (epoch, since - 31.0)  # 31 s of waiting in this epoch
            for _ in range(5):
                mode.waiting("no donor served its newer state yet")
        lines = [r.getMessage() for r in caplog.records if "has not moved" in r.getMessage()]
        assert lines == ["epoch 0 has not moved for 31 s: no donor served its newer state yet"]
        mode.state.epoch = 1  # a new epoch starts its own count
        mode.waiting("x")
        assert mode._waiting_since[0] == 1
    finally:
        mode.opt.shutdown()


def test_a_checkpoint_skipped_while_the_last_one_was_written_is_written_at_the_next_step(
    make_dhts, tmp_path, monkeypatch
):
    """The epoch moved while the previous checkpoint was still being written, so its own was
    skipped; if the epoch then stops moving (the swarm waits for peers that must load this
    very state), the next step must write it. A chaos run deadlocked so: three peers at 278
    waited for three at 277, which waited for a donor of 278 that nobody ever wrote."""
    from moshpit.training.state_averager import TrainingStateAverager

    write = TrainingStateAverager._write_checkpoint

    def slow_write(self, *args):
        time.sleep(0.5)  # a slow disk (in the writer thread)
        return write(self, *args)

    monkeypatch.setattr(TrainingStateAverager, "_write_checkpoint", slow_write)
    (dht,) = make_dhts(1)
    model = _model()
    quick = dict(FAST, min_matchmaking_time=0.5, request_timeout=0.5)  # alone: finds so fast
    peer = Peer(0, model, _opt(dht, model, tmp_path, averager_options=quick))
    state = peer.opt.mode.state
    try:
        peer.train(until_epoch=2, pause=0.0)  # epoch 1's write is still running at epoch 2
        assert peer.opt.epoch == 2 and state.newest_checkpoint_epoch != 2
        state._writing.result(timeout=10)
        idx = peer.batch()
        _loss(model, idx).backward()
        peer.opt.step()  # one batch: the epoch does not move
        peer.opt.zero_grad()
        assert peer.opt.epoch == 2
        state._writing.result(timeout=10)
        assert state.newest_checkpoint_epoch == 2
    finally:
        peer.opt.shutdown()


def test_a_round_that_ran_out_of_time_is_retried_even_when_the_view_comes_back_empty(
    make_dhts, monkeypatch
):
    """Sync mode's side of tests/training/test_diloco.py's test of the same name: the first
    gradient round runs out of time and the DHT read after it lists nobody; the round's own
    group shows the others were at the epoch, so the peers retry instead of stepping alone."""
    ran_out = first_rounds_run_out(monkeypatch)
    dhts = make_dhts(2)
    models = [_model() for _ in dhts]
    peers = [
        Peer(i, m, _opt(d, m, target_group_size=2, target_batch_size=2 * BATCH))
        for i, (d, m) in enumerate(zip(dhts, models, strict=True))
    ]
    forced_views_come_back_empty(monkeypatch, [p.opt.mode for p in peers])
    try:
        _train_all(peers, 2, lockstep=True)
        for p in peers:
            mode = p.opt.mode
            assert mode.rounds_failed >= 1 and mode.solo_steps == mode.state_loads == 0
        assert ran_out == {d.peer_id for d in dhts}
        for epoch in (1, 2):
            assert _same(peers[0].params_at[epoch], peers[1].params_at[epoch])
    finally:
        for p in peers:
            p.opt.shutdown()


def test_a_failed_round_with_company_is_retried_once():
    """After a round that held others and failed, an empty view does not make the peer go on
    alone: the round's members were at the epoch a moment ago. A retry that then finds
    nobody does (the others may have died with the round)."""
    from moshpit.training.modes.epoch_rounds import EpochRounds

    rounds = EpochRounds("me", target_group_size=4)
    empty = SimpleNamespace(peers=[], epoch=0)
    assert not rounds.with_us(empty, SimpleNamespace(members=()))  # found nobody: alone
    assert not rounds.with_us(empty, SimpleNamespace(members=("me",)))
    assert rounds.with_us(empty, SimpleNamespace(members=("me", "a", "b")))  # ran out of time
    assert not rounds.with_us(empty, SimpleNamespace(members=()))  # the retry found nobody
