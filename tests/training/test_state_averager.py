"""TrainingStateAverager on real ``moshpit.DHT`` facades over loopback TCP (one process)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import pytest
import torch

import moshpit
from dht import DHT
from moshpit.training.errors import (
    CheckpointDirInUseError,
    NoCheckpointError,
    StateDownloadError,
    StateMismatchError,
)
from moshpit.training.state_averager import AveragingRound, TrainingStateAverager

FAST = dict(
    target_group_size=2,
    min_matchmaking_time=1.0,
    request_timeout=2.0,
    allreduce_timeout=10.0,
    initial_group_bits="",
    join_timeout=5.0,
)


@pytest.fixture
def dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    others = [
        DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for _ in range(2)
    ]
    try:
        yield [first, *others]
    finally:
        for dht in [*others, first]:
            dht.shutdown()


def _model(value: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _state(dht, model, opt_cls=torch.optim.SGD, **kwargs):
    opt = opt_cls(model.parameters(), lr=0.5)
    return TrainingStateAverager(
        dht=dht, optimizer=opt, prefix="tsa", extra_tensors=model.buffers(), **{**FAST, **kwargs}
    )


def _step_both(a, b, **kwargs):
    """Run a.step(**kwargs) in a thread and b.step() here; return both results."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(a.step, **kwargs)
        res_b = b.step()
        return future.result(timeout=60), res_b


def test_public_name():
    assert moshpit.TrainingStateAverager is TrainingStateAverager


def test_background_round_keeps_local_progress_exactly(dhts):
    """live = averaged + (updates made during the round): dyadic values, exact equality."""
    model_a, model_b = _model(1.0), _model(3.0)
    a, b = _state(dhts[0], model_a), _state(dhts[1], model_b)
    try:
        handle = a.step(wait=False)
        assert isinstance(handle, AveragingRound)
        # the training thread keeps stepping while the round runs: +0.25 per local step
        local_steps = 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            res_b = pool.submit(b.step)
            while not handle.done():
                with torch.no_grad():
                    for p in model_a.parameters():
                        p.add_(0.25)
                local_steps += 1
                concurrent.futures.wait([handle.future], timeout=0.01)
            assert res_b.result(timeout=60).succeeded
        result = handle.wait()
        assert result.succeeded
        assert local_steps >= 1
        for p in model_a.parameters():
            assert torch.equal(p, torch.full_like(p, 2.0 + 0.25 * local_steps))
        for p in model_b.parameters():
            assert torch.equal(p, torch.full_like(p, 2.0))
    finally:
        a.shutdown()
        b.shutdown()


def test_optimizer_statistics_averaged_counters_kept(dhts):
    model_a, model_b = _model(1.0), _model(1.0)
    a = _state(dhts[0], model_a, torch.optim.Adam)
    b = _state(dhts[1], model_b, torch.optim.Adam)
    try:
        for state, fill in ((a, 2.0), (b, 4.0)):
            for p in state.optimizer.state:
                state.optimizer.state[p]["exp_avg"].fill_(fill)
                state.optimizer.state[p]["step"].fill_(fill)
        res_a, res_b = _step_both(a, b)
        assert res_a.succeeded and res_b.succeeded
        for state, fill in ((a, 2.0), (b, 4.0)):
            for p in state.optimizer.state:
                assert torch.equal(state.optimizer.state[p]["exp_avg"], torch.full_like(p, 3.0))
                assert state.optimizer.state[p]["step"].item() == fill  # a counter: not averaged
        # the schema lists params, optimizer state (incl. counters) and buffers, in order
        names = [name for name, _, _ in a.schema()]
        assert names[:4] == ["params.0", "params.1", "params.2", "params.3"]
        assert "optimizer.0.exp_avg" in names and "optimizer.0.step" in names
        assert names[-3:] == ["extra.0", "extra.1", "extra.2"]  # BatchNorm mean, var, count
    finally:
        a.shutdown()
        b.shutdown()


def test_lazy_optimizer_state_created_without_touching_params(dhts):
    model = _model(1.5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    state = TrainingStateAverager(dht=dhts[0], optimizer=opt, prefix="lazy", **FAST)
    try:
        for p in model.parameters():
            assert torch.equal(p, torch.full_like(p, 1.5))  # weight decay did not run
            assert opt.state[p]["step"].item() == 0
            assert torch.count_nonzero(opt.state[p]["exp_avg"]) == 0
    finally:
        state.shutdown()


def test_checkpoint_roundtrip_and_restore_on_start(dhts, tmp_path):
    model = _model(1.0)
    state = _state(dhts[0], model, torch.optim.Adam, checkpoint_dir=tmp_path)
    try:
        with pytest.raises(NoCheckpointError):
            state.load_checkpoint()
        state.epoch = 7
        for p in model.parameters():
            with torch.no_grad():
                p.fill_(0.75)
        state.optimizer.param_groups[0]["lr"] = 0.125
        state.save_checkpoint()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)
        state.epoch = 9
        assert state.load_checkpoint() == 7
        assert state.epoch == 7
        assert all(torch.equal(p, torch.full_like(p, 0.75)) for p in model.parameters())
        assert state.optimizer.param_groups[0]["lr"] == 0.125
    finally:
        state.shutdown()
    # a new averager on the same directory continues from the checkpoint
    model2 = _model(5.0)
    restored = _state(dhts[1], model2, torch.optim.Adam, checkpoint_dir=tmp_path)
    try:
        assert restored.epoch == 7
        assert all(torch.equal(p, torch.full_like(p, 0.75)) for p in model2.parameters())
    finally:
        restored.shutdown()


def test_one_checkpoint_directory_serves_one_peer_at_a_time(dhts, tmp_path):
    """Two peers writing one directory would overwrite each other's state: the second one is
    refused with one clear error naming the holder, in this process and from another one;
    the directory is free again once the first shuts down (or dies: the kernel drops the lock)."""
    first = _state(dhts[0], _model(1.0), checkpoint_dir=tmp_path)
    try:
        with pytest.raises(CheckpointDirInUseError) as info:
            _state(dhts[1], _model(2.0), checkpoint_dir=tmp_path)
        assert str(info.value).startswith(
            f"checkpoint directory {tmp_path} is in use by a peer in this process (pid "
            f"{os.getpid()}): shut it down first, or give this peer a directory of its own"
        )
        assert info.value.pid == os.getpid() and info.value.path == tmp_path
        other = subprocess.run(
            [sys.executable, "-c",
             "import sys\nfrom moshpit.training.dirlock import CheckpointDirLock\n"
             "from moshpit.training.errors import CheckpointDirInUseError\n"
             f"try:\n    CheckpointDirLock({str(tmp_path)!r}).acquire()\n"
             "except CheckpointDirInUseError as e:\n    sys.exit(str(e))\n"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert other.stderr.strip().startswith(
            f"checkpoint directory {tmp_path} is in use by another running process (pid "
            f"{os.getpid()}): stop it, or give this peer"
        ), other.stderr
    finally:
        first.shutdown()
    second = _state(dhts[1], _model(2.0), checkpoint_dir=tmp_path)  # free again
    second.shutdown()


def test_checkpoint_of_another_model_is_refused_by_name(dhts, tmp_path):
    state = _state(dhts[0], _model(1.0), checkpoint_dir=tmp_path)
    state.save_checkpoint()
    state.shutdown()
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    bigger = _state(
        dhts[1], other, checkpoint_dir=tmp_path, restore_checkpoint=False, sync_on_start=False
    )
    try:
        before = [p.detach().clone() for p in other.parameters()]
        with pytest.raises(StateMismatchError, match=r"params\.0.*shape"):
            bigger.load_checkpoint()
        assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before, strict=True))
    finally:
        bigger.shutdown()


def test_fresh_peer_loads_swarm_state_instead_of_averaging_it_in(dhts, tmp_path):
    """A newcomer with fresh weights must not drag the swarm (issue 12 item 10)."""
    donor_model = _model(0.5)
    donor = _state(dhts[0], donor_model, checkpoint_dir=tmp_path / "donor", sync_on_start=False)
    newcomer_model = _model(9.0)
    newcomer = _state(dhts[1], newcomer_model)
    try:
        donor.epoch = 3
        donor.save_checkpoint()  # now serves epoch 3
        res_new, res_donor = _step_both(newcomer, donor)
        assert newcomer.epoch == 3
        assert res_new.succeeded and res_donor.succeeded
        # both held 0.5 when they averaged: the swarm's value did not move
        for p in [*donor_model.parameters(), *newcomer_model.parameters()]:
            assert torch.equal(p, torch.full_like(p, 0.5))
    finally:
        newcomer.shutdown()
        donor.shutdown()


def test_constructor_errors(dhts):
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        TrainingStateAverager(dht=dhts[0], optimizer=object(), prefix="x", target_group_size=2)
    opt = torch.optim.SGD(_model(1.0).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="moshpit.DHT"):
        TrainingStateAverager(dht=object(), optimizer=opt, prefix="x", target_group_size=2)


def test_failed_catch_up_skips_the_round_instead_of_averaging_fresh_weights(
    dhts, tmp_path, monkeypatch
):
    donor_model = _model(0.5)
    donor = _state(dhts[0], donor_model, checkpoint_dir=tmp_path / "donor", sync_on_start=False)
    newcomer_model = _model(9.0)
    newcomer = _state(dhts[1], newcomer_model)
    try:
        donor.epoch = 3
        donor.save_checkpoint()

        async def broken_download(*args, **kwargs):
            raise StateDownloadError("every donor failed (test)")

        monkeypatch.setattr(newcomer._sharing, "download", broken_download)
        result = newcomer.step(timeout=5.0)
        assert not result.succeeded and "could not load the swarm's state" in result.reason
        assert newcomer.epoch == 0
        assert all(torch.equal(p, torch.full_like(p, 9.0)) for p in newcomer_model.parameters())
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in donor_model.parameters())
        monkeypatch.undo()  # donors work again: the next step catches up, then averages
        res_new, res_donor = _step_both(newcomer, donor)
        assert newcomer.epoch == 3 and res_new.succeeded and res_donor.succeeded
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in newcomer_model.parameters())
    finally:
        newcomer.shutdown()
        donor.shutdown()


def test_a_running_peer_does_not_stop_because_another_models_state_is_newer(dhts, tmp_path):
    """Only another model's state (another shape) is announced, and it is newer: a newcomer
    is told at once (StateMismatchError names the tensor), while a peer that trains already
    and looks for a newer state keeps its own and goes on."""
    other = _state(
        dhts[0],
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)),
        checkpoint_dir=tmp_path / "other",
        sync_on_start=False,
    )
    mine = _model(1.0)
    running = _state(dhts[1], mine, sync_on_start=False)
    newcomer = _state(dhts[2], _model(2.0))
    try:
        other.epoch = 7
        other.save_checkpoint()
        with pytest.raises(StateMismatchError, match=r"params\.0.*shape"):
            newcomer.synchronize()
        running.synchronize(again=True)  # a warning, not an error
        assert running.epoch == 0
        assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in mine.parameters())
    finally:
        newcomer.shutdown()
        running.shutdown()
        other.shutdown()


def test_leaving_abandons_a_round_still_looking_for_a_group_at_once(dhts, tmp_path, caplog):
    """A round with no group yet has nobody counting on us: SIGTERM handling must not spend a
    third of its deadline waiting for a group that may never form (it used to)."""
    state = _state(dhts[0], _model(1.0), checkpoint_dir=tmp_path, min_matchmaking_time=30.0)
    handle = state.step(wait=False)  # alone: the round can only look for partners
    assert isinstance(handle, AveragingRound) and not handle.done()
    assert not state.averager.in_group
    with caplog.at_level("INFO", logger="moshpit.training.state_averager"):
        state.leave_swarm(deadline=60.0)
    messages = [r.getMessage() for r in caplog.records]
    assert "abandoning the running averaging round: it had no group yet" in messages
    assert not any("to leave in time" in m for m in messages)
    assert handle.future.done() and state.newest_checkpoint_epoch == 0


def test_leaving_waits_for_a_round_whose_group_formed(dhts, tmp_path):
    """A round in its all-reduce is useful work that others count on: leaving finishes it."""
    a = _state(dhts[0], _model(1.0), checkpoint_dir=tmp_path)
    b = _state(dhts[1], _model(3.0))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            res_b = pool.submit(b.step)
            handle = a.step(wait=False)
            deadline = time.monotonic() + 30
            while not a.averager.in_group and not handle.done():
                assert time.monotonic() < deadline, "no group formed"
                time.sleep(0.005)
            a.leave_swarm(deadline=60.0)
            assert handle.result is not None and handle.result.succeeded
            assert res_b.result(timeout=60).succeeded
        assert not a.averager.in_group
    finally:
        b.shutdown()


def test_options_take_keywords_on_top_and_leave_the_averagers_alone() -> None:
    """``options=`` and keyword arguments of the same names build the same thing; the other
    keywords are the inner Averager's, untouched."""
    from moshpit.training.state_options import StateAveragerOptions

    base = StateAveragerOptions(keep_checkpoints=3, sync_on_start=False)
    options, rest = StateAveragerOptions.split(
        base, {"keep_checkpoints": 5, "request_timeout": 2.0, "config": None}
    )
    assert options == StateAveragerOptions(keep_checkpoints=5, sync_on_start=False)
    assert rest == {"request_timeout": 2.0, "config": None}
    assert StateAveragerOptions.split(None, {})[0] == StateAveragerOptions()
    with pytest.raises(TypeError, match="StateAveragerOptions"):
        StateAveragerOptions.split({"keep_checkpoints": 3}, {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, value",
    [
        ("join_timeout", -1.0),
        ("checkpoint_every_seconds", float("nan")),
        ("checkpoint_every_epochs", 0),
        ("keep_checkpoints", 0),
    ],
)
def test_a_bad_option_is_named_where_it_is_given(name: str, value: object) -> None:
    from moshpit.training.state_options import StateAveragerOptions

    with pytest.raises(ValueError, match=name):
        StateAveragerOptions(**{name: value})  # type: ignore[arg-type]


def test_an_options_object_works_like_its_keywords(dhts, tmp_path) -> None:
    from moshpit.training.state_options import StateAveragerOptions

    model = torch.nn.Linear(3, 2)
    state = TrainingStateAverager(
        dht=dhts[0],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        prefix="options-object",
        target_group_size=2,
        options=StateAveragerOptions(checkpoint_dir=tmp_path, sync_on_start=False),
        keep_checkpoints=1,
        request_timeout=2.0,
    )
    try:
        assert state._store is not None and state._store.keep == 1
        assert not state.sync_on_start
        state.save_checkpoint()
        assert state.newest_checkpoint_epoch == 0
    finally:
        state.shutdown()
