"""Optimizer statistics keep their domain whatever a background round's timing.

A round snapshots the state, averages the snapshot while training goes on, then corrects the
live state with what the round changed. Adam's ``exp_avg_sq`` and its kin must stay
non-negative: the live value decays while the round is in flight, and ``live + averaged -
snapshot`` can then fall below zero, after which ``sqrt`` gives NaN parameters (issue: a
volunteer whose rounds were slow went NaN at its first round).

Real ``moshpit.DHT`` peers over loopback TCP; the decay during the round is applied by hand
right after ``step(wait=False)`` returned (the snapshot is taken before it returns), so the
test is deterministic however fast the round is.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from dht import DHT
from moshpit.training.state_averager import TrainingStateAverager

FAST = dict(
    target_group_size=2,
    min_matchmaking_time=1.0,
    request_timeout=2.0,
    allreduce_timeout=10.0,
    initial_group_bits="",
    join_timeout=5.0,
    sync_on_start=False,
)


class LambLike(torch.optim.Optimizer):
    """A user optimizer with a non-negative state under a name moshpit cannot know ("v")."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.99, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, beta=beta, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["v"].mul_(group["beta"]).addcmul_(p.grad, p.grad, value=1 - group["beta"])
                update = state["m"] / (state["v"].sqrt() + group["eps"])
                trust = p.norm() / update.norm().clamp_min(1e-12)
                p.sub_(update * trust.clamp(max=10.0), alpha=group["lr"])


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "lamb-like": lambda ps: LambLike(ps),
}


@pytest.fixture(scope="module")
def dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, scale: float, steps: int) -> None:
    gen = torch.Generator().manual_seed(int(scale * 1000))
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        loss = (model(x) * scale).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _stats(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every floating-point per-parameter statistic, by a stable name."""
    out = {}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                out[f"{i}.{key}"] = value
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_statistics_stay_in_domain_when_they_decay_during_a_round(dhts, name):
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [OPTIMIZERS[name](m.parameters()) for m in models]
    # peer a trained with large gradients (large second moments), peer b barely (a newcomer)
    _train(models[0], opts[0], scale=30.0, steps=20)
    _train(models[1], opts[1], scale=0.01, steps=2)
    prefix = f"domain-{name}"
    a, b = (
        TrainingStateAverager(dht=d, optimizer=o, prefix=prefix, **FAST)
        for d, o in zip(dhts, opts, strict=True)
    )
    try:
        nonnegative = {k for k, v in _stats(opts[0]).items() if bool((v >= 0).all())}
        nonnegative &= {k for k, v in _stats(opts[1]).items() if bool((v >= 0).all())}
        if name != "sgd-momentum":
            assert nonnegative, "the optimizer should have a non-negative statistic"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            handle = a.step(wait=False)  # the snapshot is taken before this returns
            other = pool.submit(b.step)
            # while the round runs, peer a keeps training: near-zero gradients, so its
            # second moments decay far below what they were at the snapshot
            with torch.no_grad():
                for value in _stats(opts[0]).values():
                    value.mul_(0.001)
            result = handle.wait(timeout=60)
            assert other.result(timeout=60).succeeded
        assert result.succeeded
        for opt in opts:
            for key, value in _stats(opt).items():
                assert bool(torch.isfinite(value).all()), (name, key)
                if key in nonnegative:
                    assert bool((value >= 0).all()), (name, key, value.min().item())
        # and training goes on with finite parameters
        for model, opt in zip(models, opts, strict=True):
            _train(model, opt, scale=1.0, steps=3)
            assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), name
    finally:
        a.shutdown()
        b.shutdown()


def test_integer_counters_are_untouched(dhts):
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    _train(models[0], opts[0], scale=1.0, steps=7)
    _train(models[1], opts[1], scale=1.0, steps=3)
    a, b = (
        TrainingStateAverager(dht=d, optimizer=o, prefix="domain-counters", **FAST)
        for d, o in zip(dhts, opts, strict=True)
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(b.step)
            assert a.step().succeeded
            assert other.result(timeout=60).succeeded
        for opt, steps in zip(opts, (7, 3), strict=True):
            for state in opt.state.values():
                assert state["step"].item() == steps
    finally:
        a.shutdown()
        b.shutdown()


def test_correction_rule_exactly():
    """Signed state: live + (averaged - snapshot). Non-negative state: the same where the
    live value did not fall below the snapshot; else live * averaged / snapshot (the round's
    change scaled by the decay the live value saw since the snapshot)."""
    from moshpit.training.state_averager import correct_after_round

    snapshot = torch.tensor([4.0, 4.0, 0.0, 2.0])
    averaged = torch.tensor([1.0, 6.0, 3.0, 1.0])
    live = torch.tensor([1.0, 1.0, 0.5, 3.0])
    signed = correct_after_round(live.clone(), averaged, snapshot, nonnegative=False)
    assert torch.equal(signed, torch.tensor([-2.0, 3.0, 3.5, 2.0]))
    kept = correct_after_round(live.clone(), averaged, snapshot, nonnegative=True)
    assert torch.equal(kept, torch.tensor([0.25, 1.5, 3.5, 2.0]))
    # bounded: never above max(live + averaged, averaged), never below zero
    assert bool((kept >= 0).all()) and bool(
        (kept <= torch.maximum(live + averaged, averaged)).all()
    )
    # a negative average (a peer sent garbage) cannot push a non-negative statistic below zero
    poisoned = correct_after_round(live.clone(), -averaged, snapshot, nonnegative=True)
    assert bool((poisoned >= 0).all())


def test_batchnorm_running_var_stays_non_negative(dhts):
    """Extra tensors follow the same rule: BatchNorm's running_var is a non-negative buffer."""
    models = [torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)]
    with torch.no_grad():
        models[0].running_var.fill_(100.0)
        models[1].running_var.fill_(0.01)
        models[0].running_mean.fill_(-2.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    a, b = (
        TrainingStateAverager(
            dht=d, optimizer=o, prefix="domain-bn", extra_tensors=m.buffers(), **FAST
        )
        for d, o, m in zip(dhts, opts, models, strict=True)
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            handle = a.step(wait=False)
            other = pool.submit(b.step)
            with torch.no_grad():  # batches of near-constant features during the round
                models[0].running_var.mul_(0.01)
                models[0].running_mean.add_(1.0)
            assert handle.wait(timeout=60).succeeded
            assert other.result(timeout=60).succeeded
        var = models[0].running_var
        assert bool((var >= 0).all()) and bool(torch.isfinite(var).all()), var
        # the signed buffer keeps the exact delta rule: -2 + 1 + (-1 - -2) = 0
        assert torch.equal(models[0].running_mean, torch.zeros(3))
    finally:
        a.shutdown()
        b.shutdown()
