"""Deep Gradient Compression in ``mode="sync"``: the DGC invariants and DGC on real DHTs."""

from __future__ import annotations

import concurrent.futures
import math
import threading

import pytest
import torch

import moshpit
from dht import DHT
from moshpit.training.dgc import DGC, dgc_compression

FAST = dict(
    min_matchmaking_time=1.5, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)
BATCH = 8


def _grads(seed: int, shapes=((5, 7), (13,))) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def test_sent_plus_accumulation_equals_every_velocity_pushed_in():
    """sum(sent) + v == sum(u pushed into v): nothing is lost or made up, masking or not."""
    for masking in (True, False):
        dgc = DGC(
            momentum=0.9, final_density=0.05, initial_density=0.5, warmup_epochs=3, masking=masking
        )
        shapes = ((5, 7), (13,))
        pushed = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        sent = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        for step in range(30):
            grads = _grads(step, shapes)
            for i, g in enumerate(grads):
                u = dgc.core.velocity(i)
                u = torch.zeros(g.numel()) if u is None else u.clone()
                pushed[i] += (0.9 * u + g.reshape(-1)).view(g.shape).double()
            for i, update in enumerate(dgc.compress(grads, step)):
                sent[i] += update.double()
        for i, shape in enumerate(shapes):
            v = dgc.core.accumulation(i).view(shape).double()
            torch.testing.assert_close(sent[i] + v, pushed[i], rtol=1e-5, atol=1e-4)
        assert dgc.values_sent < dgc.values_total / 4  # it did sparsify


def test_density_warms_up_per_data_epoch():
    dgc = DGC(steps_per_epoch=2)
    densities = [dgc.density(step) for step in range(10)]
    # 25% -> ~6.3% -> ~1.6% -> ~0.4% -> 0.1%: exponential steps from 0.25 to 0.001
    expected = [0.25 * (0.001 / 0.25) ** (stage / 4) for stage in range(4)] + [0.001]
    for step, density in enumerate(densities):
        assert math.isclose(density, expected[min(step // 2, 4)], rel_tol=1e-9)


def test_local_clipping_scales_with_the_number_of_workers():
    dgc = DGC(momentum=0.0, final_density=1.0, initial_density=1.0, clip_norm=1.0, masking=False)
    g = torch.full((100,), 1.0)  # norm 10
    (update,) = dgc.compress([g], 0, num_workers=4)
    assert math.isclose(float(update.norm()), 0.5, rel_tol=1e-5)  # 1 / sqrt(4)
    (small,) = dgc.compress([g * 0.001], 1, num_workers=4)  # below the threshold: untouched
    torch.testing.assert_close(small, g * 0.001)


def test_masking_zeroes_the_velocity_of_sent_entries():
    dgc = DGC(momentum=0.9, final_density=0.1, initial_density=0.1)
    g = torch.arange(1.0, 21.0)
    (update,) = dgc.compress([g], 0)
    sent = update != 0
    assert int(sent.sum()) >= 1
    u = dgc.core.velocity(0)
    assert bool((u[sent] == 0).all()) and bool((u[~sent] == g[~sent]).all())


def test_dgc_compression_is_two_way_topk_with_error_feedback():
    codec = dgc_compression(0.001, 4)
    assert codec.sender.codec.density == 0.001 and codec.reducer.codec.density == 0.004
    dense = dgc_compression(1.0, 4)
    assert type(dense.sender.codec).__name__ == "NoCompression"


# ------------------------------------------------------------------ through moshpit.Optimizer

X = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
Y = X @ torch.arange(1.0, 7.0) - 1.0


def _batch(peer: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, len(X), (BATCH,), generator=torch.Generator().manual_seed(97 * peer + step)
    )


def _loss(model, idx):
    return torch.nn.functional.mse_loss(model(X[idx]).squeeze(-1), Y[idx])


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(6, 1)
    with torch.no_grad():
        model.weight.fill_(0.1)
        model.bias.zero_()
    return model


@pytest.fixture
def dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def _opt(dht, model, **kwargs):
    settings = dict(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.02),
        dht=dht,
        run_id="dgc-test",
        batch_size_per_step=BATCH,
        target_batch_size=2 * BATCH,
        mode="sync",
        target_group_size=2,
        averager_options=FAST,
        load_state_timeout=3.0,
        dgc=True,
    )
    settings.update(kwargs)
    return moshpit.Optimizer(**settings)


def test_dgc_needs_a_momentum_free_inner_optimizer(dhts):
    model = _model()
    with pytest.raises(ValueError, match="momentum-free"):
        _opt(dhts[0], model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="dgc=True chooses its own compression"):
        _opt(dhts[0], model, compression=dgc_compression(0.1, 2))


def test_density_one_without_masking_is_dense_momentum_sgd_exactly(dhts):
    """A lone sync peer with DGC at density 1, masking off == torch SGD(momentum) bit for bit."""
    model = _model()
    dense = dict(final_density=1.0, initial_density=1.0, masking=False, momentum=0.9)
    opt = _opt(dhts[0], model, dgc_options=dense)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    try:
        for step in range(12):  # 6 global steps of 2 local batches
            _loss(model, _batch(0, step)).backward()
            opt.step()
            opt.zero_grad()
        assert opt.epoch == 6 and opt.mode.solo_steps == 6
        for epoch in range(6):  # the same mean gradient, computed the same way
            sums = [torch.zeros_like(p) for p in reference.parameters()]
            for step in (2 * epoch, 2 * epoch + 1):
                ref_opt.zero_grad()
                _loss(reference, _batch(0, step)).backward()
                for total, p in zip(sums, reference.parameters(), strict=True):
                    total.add_(p.grad, alpha=float(BATCH))
            for total, p in zip(sums, reference.parameters(), strict=True):
                p.grad = total * (1.0 / (2 * BATCH))
            ref_opt.step()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.detach(), want.detach())
    finally:
        opt.shutdown()


def test_two_peers_with_dgc_stay_identical_and_learn(dhts):
    models = [_model() for _ in dhts]
    sparse = dict(final_density=0.2, initial_density=0.5, warmup_epochs=2, clip_norm=50.0)
    opts = [
        _opt(d, m, dgc_options=sparse, optimizer=torch.optim.SGD(m.parameters(), lr=0.05))
        for d, m in zip(dhts, models, strict=True)
    ]
    params_at: list[dict[int, list[torch.Tensor]]] = [{}, {}]
    eval_idx = torch.arange(len(X))
    first_loss = _loss(models[0], eval_idx).item()

    def train(i: int) -> None:
        step = 0
        while opts[i].epoch < 8 and step < 1000:
            epoch = opts[i].epoch
            _loss(models[i], _batch(i, step)).backward()
            opts[i].step()
            opts[i].zero_grad()
            step += 1
            if opts[i].epoch != epoch:
                params_at[i][opts[i].epoch] = [p.detach().clone() for p in models[i].parameters()]
            threading.Event().wait(0.01)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(train, i) for i in range(2)]:
                future.result(timeout=120)
        for opt in opts:
            assert opt.mode.rounds_succeeded == 8 and opt.mode.solo_steps == 0
            assert opt.mode.dgc.values_sent < opt.mode.dgc.values_total / 2
        for epoch in range(1, 9):
            assert all(
                torch.equal(a, b)
                for a, b in zip(params_at[0][epoch], params_at[1][epoch], strict=True)
            )
        assert _loss(models[0], eval_idx).item() < first_loss / 2
    finally:
        for opt in opts:
            opt.shutdown()
