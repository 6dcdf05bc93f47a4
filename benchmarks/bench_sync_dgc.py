"""The science of ``mode="sync"`` and of DGC in it, baselines in the same run.

Task: the 8x8 digits of scikit-learn (1797 images, 10 classes, a fixed 80/20 split), an MLP
64-128-10, every run starting from the same initial weights (per seed). One JSON object per
line; ``--only sync|dgc`` runs one experiment.

- ``sync``: N peers (threads of this process, each with its own ``moshpit.DHT`` on loopback
  TCP and a real ``moshpit.Optimizer(mode="sync")``), each contributing ``global_batch / N``
  samples per global step and then waiting for the swarm (``opt.mode.poll()``), vs one process
  with the same global batch, the same optimizer and the same number of global steps. Claim:
  accuracy within 1 point. The line also has the global batch actually used per step.
- ``dgc``: N workers running exactly the per-peer code of ``sync`` + ``dgc=True``
  (``moshpit.training.dgc.DGC`` on each worker's mean gradient, sample-weighted mean of the
  sparse updates, inner SGD without momentum), in one process so that many epochs are cheap;
  the network codec is not in this loop (the ``sync`` experiment and the tests cover it).
  Variants: dense momentum SGD (baseline), DGC (momentum correction + factor masking +
  local clipping + warm-up, 0.1% final density), DGC without masking, and DGC without
  momentum correction and masking (gradient dropping; momentum in the inner optimizer).
  Claim: DGC within 1 point of dense at 1000x fewer values; the line has the values sent.
- ``sync_dgc``: the ``sync`` experiment with ``dgc=True`` through the real swarm (the sparse
  updates cross the network as two-way top-k with error feedback); the line has the bytes
  each peer sent vs dense float32.

    python benchmarks/bench_sync_dgc.py [--peers 4] [--seeds 0 1 2] [--only dgc]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FAST = dict(
    min_matchmaking_time=3.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): a fixed 80/20 split of the 8x8 digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean()) * 100


def epoch_batches(n: int, batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The global batches of one data epoch (a fixed permutation per seed and epoch)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [perm[i : i + batch] for i in range(0, n - batch + 1, batch)]


def loss_fn(model, x, y, idx):
    return torch.nn.functional.cross_entropy(model(x[idx]), y[idx])


# ---------------------------------------------------------------------- dgc (in process)


def run_dgc(variant: str, seed: int, peers: int, epochs: int, batch: int, lr: float) -> dict:
    from moshpit.training.dgc import DGC

    xtr, ytr, xte, yte = digits()
    model = make_model(seed)
    params = list(model.parameters())
    momentum = 0.9
    if variant == "dense":
        inner = torch.optim.SGD(params, lr=lr, momentum=momentum)
        workers = None
    else:
        correction = variant != "no_correction_no_masking"
        masking = variant == "dgc"
        inner = torch.optim.SGD(params, lr=lr, momentum=0.0 if correction else momentum)
        steps_per_epoch = len(xtr) // batch
        workers = [
            DGC(
                momentum=momentum,
                final_density=0.001,
                warmup_epochs=4,
                steps_per_epoch=steps_per_epoch,
                clip_norm=5.0,
                masking=masking,
                momentum_correction=correction,
                seed=seed * 100 + w,
            )
            for w in range(peers)
        ]
    step = 0
    started = time.perf_counter()
    for epoch in range(epochs):
        for idx in epoch_batches(len(xtr), batch, seed, epoch):
            shards = idx.chunk(peers)
            updates = []
            for w, shard in enumerate(shards):
                inner.zero_grad()
                loss_fn(model, xtr, ytr, shard).backward()
                grads = [p.grad.detach().clone() for p in params]
                if workers is not None:
                    grads = workers[w].compress(grads, step, num_workers=peers)
                updates.append((len(shard), grads))
            total = sum(n for n, _ in updates)
            for i, p in enumerate(params):  # the sample-weighted mean, as the all-reduce does
                p.grad = sum(n * g[i] for n, g in updates) / total
            inner.step()
            step += 1
    line: dict[str, Any] = {
        "experiment": "dgc",
        "variant": variant,
        "seed": seed,
        "peers": peers,
        "epochs": epochs,
        "global_batch": batch,
        "global_steps": step,
        "lr": lr,
        "accuracy": round(accuracy(model, xte, yte), 2),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if workers is not None:
        sent = sum(w.values_sent for w in workers)
        dense = sum(w.values_total for w in workers)
        line["values_sent_fraction"] = sent / dense
        line["final_density"] = workers[0].density(step)
    return line


# ---------------------------------------------------------------------- sync (real swarm)


def run_sync(
    seed: int, peers: int, steps: int, batch: int, lr: float, dgc: bool = False
) -> list[dict]:
    import moshpit
    from dht import DHT

    xtr, ytr, xte, yte = digits()
    share = batch // peers
    # the baseline: one process, the same global batches (concatenated shares), same steps
    base = make_model(seed)
    base_opt = torch.optim.SGD(base.parameters(), lr=lr, momentum=0.9)
    order = [b for e in range(10_000) for b in epoch_batches(len(xtr), batch, seed, e)]
    for k in range(steps):
        base_opt.zero_grad()
        loss_fn(base, xtr, ytr, order[k]).backward()
        base_opt.step()
    baseline = accuracy(base, xte, yte)

    dhts = [DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    for _ in range(peers - 1):
        dhts.append(
            DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        )
    models = [make_model(seed) for _ in range(peers)]
    extra: dict[str, Any] = {}
    if dgc:  # the momentum moves into DGC (momentum correction); 0.1% after 4 data epochs
        extra = dict(
            dgc=True,
            dgc_options=dict(momentum=0.9, steps_per_epoch=len(xtr) // batch, clip_norm=5.0),
        )
    opts = [
        moshpit.Optimizer(
            optimizer=torch.optim.SGD(m.parameters(), lr=lr, momentum=0.0 if dgc else 0.9),
            dht=d,
            run_id=f"bench-sync-{seed}",
            batch_size_per_step=share,
            target_batch_size=batch,
            mode="sync",
            target_group_size=peers,
            averager_options=FAST,
            load_state_timeout=5.0,
            refresh_period=0.05,
            **extra,
        )
        for d, m in zip(dhts, models, strict=True)
    ]
    for opt in opts:  # publish progress quickly: a global step waits for every peer's report
        opt.tracker.min_refresh_period = 0.05
    used: dict[int, int] = {}
    lock = threading.Lock()

    def train(i: int) -> None:
        opt, model = opts[i], models[i]
        while opt.epoch < steps:
            epoch = opt.epoch
            # this peer's share of the global batch the single process uses at this step
            idx = order[epoch].chunk(peers)[i]
            opt.zero_grad()
            loss_fn(model, xtr, ytr, idx).backward()
            opt.step(batch_size=len(idx))
            with lock:
                used[epoch] = used.get(epoch, 0) + len(idx)
            deadline = time.monotonic() + 30
            while opt.epoch == epoch and time.monotonic() < deadline:
                if opt.mode.poll():
                    break
                threading.Event().wait(0.02)

    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(peers) as pool:
            for future in [pool.submit(train, i) for i in range(peers)]:
                future.result()
        identical = all(
            all(
                torch.equal(a, b)
                for a, b in zip(models[0].parameters(), m.parameters(), strict=True)
            )
            for m in models[1:]
        )
        modes = [opt.mode for opt in opts]
        line = {
            "experiment": "sync_dgc" if dgc else "sync",
            "seed": seed,
            "peers": peers,
            "global_steps": steps,
            "target_batch": batch,
            "mean_global_batch_used": sum(used.values()) / max(1, len(used)),
            "lr": lr,
            "accuracy_sync": round(accuracy(models[0], xte, yte), 2),
            "accuracy_single_process": round(baseline, 2),
            "peers_bit_identical": identical,
            "rounds_succeeded": [m.rounds_succeeded for m in modes],
            "rounds_failed": [m.rounds_failed for m in modes],
            "state_loads": [m.state_loads for m in modes],
            "bytes_sent_per_peer": sum(m.bytes_sent for m in modes) // peers,
            "dense_bytes_per_peer_per_round": 4 * sum(p.numel() for p in models[0].parameters()),
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        for opt in opts:
            opt.shutdown()
        for d in reversed(dhts):
            d.shutdown()
    return [line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=["sync", "dgc", "sync_dgc"])
    parser.add_argument("--epochs", type=int, default=30, help="data epochs of the dgc runs")
    parser.add_argument("--sync-steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny model: more threads only contend with each other
    for seed in args.seeds:
        if args.only in (None, "dgc"):
            for variant in ("dense", "dgc", "no_masking", "no_correction_no_masking"):
                line = run_dgc(variant, seed, args.peers, args.epochs, args.batch, args.lr)
                print(json.dumps(line), flush=True)
        if args.only in (None, "sync"):
            for line in run_sync(seed, args.peers, args.sync_steps, args.batch, args.lr):
                print(json.dumps(line), flush=True)
        if args.only in (None, "sync_dgc"):
            for line in run_sync(seed, args.peers, args.sync_steps, args.batch, args.lr, dgc=True):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
