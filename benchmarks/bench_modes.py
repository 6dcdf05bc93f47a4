"""The science of ``mode="local"`` (ADPSGD) and ``mode="diloco"``, baselines in the same run.

Task: the 8x8 digits of scikit-learn (1797 images, 10 classes; a fixed 80/20 split), a small
MLP (64-64-10), every peer starting from the same initial weights and drawing its own batches
of 32 from the whole training set. Peers are threads of this process, each with its own
``moshpit.DHT`` on loopback TCP and a real ``moshpit.Optimizer``.

Experiments (one JSON object per line; ``--only adpsgd|diloco`` runs one):

- ``adpsgd``: ``mode="local"`` with a fixed period of 1 vs ``adaptive_period=True`` starting
  from 1 (``wait_for_rounds=True`` in both, so a round happens exactly when the period says;
  the background default changes when rounds land, not how many the rule asks for). Claim:
  the period grows, and at equal final accuracy (within 1 point) the adaptive run needs
  <= 50% of the averaging rounds.
- ``diloco``: ``mode="sync"`` (global batch = peers x 32, one gradient round per step, AdamW)
  vs ``mode="diloco"`` with H = 50 (AdamW inner, Nesterov outer lr 0.7, momentum 0.9), both on
  the same number of samples. Claim: within 2 points of ``sync`` while sending >= 50x fewer
  bytes (``StepResult.bytes_sent`` summed over rounds and peers); also with ``fp16``.

Accuracy is that of the peers' parameter average on the held-out 20% (what one would deploy;
every peer's own accuracy is in the line too). Several seeds: ``--seeds 0 1 2``.

    python benchmarks/bench_modes.py [--peers 2] [--seeds 0 1 2] [--only adpsgd] [--background]
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

BATCH = 32
FAST = dict(
    min_matchmaking_time=3.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): a fixed 80/20 split of the 8x8 digits."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )  # fmt: skip


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean()) * 100


def average_model(models: list[torch.nn.Module], seed: int) -> torch.nn.Module:
    mean = mlp(seed)
    with torch.no_grad():
        for i, p in enumerate(mean.parameters()):
            p.copy_(torch.stack([list(m.parameters())[i] for m in models]).mean(0))
    return mean


def make_dhts(n: int) -> list[Any]:
    from dht import DHT

    dhts = [DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    for _ in range(n - 1):
        dhts.append(
            DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        )
    return dhts


def run_swarm(
    mode: str,
    *,
    peers: int = 2,
    steps: int = 300,
    seed: int = 0,
    inner: str = "sgd",
    lr: float = 0.05,
    run_id: str = "bench-modes",
    averager_options: dict[str, Any] | None = None,
    step_seconds: float = 0.0,
    **mode_options: Any,
) -> dict[str, Any]:
    """Train ``peers`` threads for ``steps`` local steps each (``sync``: global steps).

    Returns accuracy of the peers' average and of each peer, rounds, bytes sent (all peers),
    and the mode's own counters (the local mode's period history).
    """
    import tempfile

    import moshpit

    x_train, y_train, x_test, y_test = digits()
    # donors: a peer that fell behind (sync: a round ran without it) loads their state
    workdir = tempfile.TemporaryDirectory(prefix="bench-modes-")
    done = threading.Event()
    dhts = make_dhts(peers)
    models = [mlp(seed) for _ in range(peers)]
    opts = []
    bytes_sent = [0] * peers
    try:
        for dht, model in zip(dhts, models, strict=True):
            if inner == "sgd":
                inner_opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            else:
                inner_opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            extra: dict[str, Any] = {}
            if mode == "sync":
                extra["target_batch_size"] = peers * BATCH
                extra["checkpoint_dir"] = Path(workdir.name) / f"peer{len(opts)}"
            opts.append(
                moshpit.Optimizer(
                    optimizer=inner_opt,
                    dht=dht,
                    run_id=run_id,
                    batch_size_per_step=BATCH,
                    mode=mode,
                    target_group_size=peers,
                    averager_options=dict(averager_options or FAST),
                    load_state_timeout=15.0,
                    progress_ttl=10.0,
                    **extra,
                    **mode_options,
                )
            )

        def train(i: int) -> None:
            gen = torch.Generator().manual_seed(10_000 * seed + i)
            model, opt = models[i], opts[i]
            local_steps = 0
            # sync: everyone stops once one peer made `steps` global steps (a peer one round
            # behind would otherwise wait for rounds nobody runs any more)
            while (not done.is_set()) if mode == "sync" else (local_steps < steps):
                idx = torch.randint(0, len(x_train), (BATCH,), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                epoch = opt.epoch
                opt.step()
                opt.zero_grad()
                local_steps += 1
                if step_seconds:
                    threading.Event().wait(step_seconds)  # stands for a bigger model's compute
                if mode == "sync" and opt.epoch != epoch and opt.mode.last_result is not None:
                    bytes_sent[i] += opt.mode.last_result.bytes_sent
                if mode == "sync" and opt.epoch >= steps:
                    done.set()
                if local_steps > 50 * steps:
                    raise RuntimeError(f"peer {i} made no progress in {local_steps} steps")

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(peers) as pool:
            for future in [pool.submit(train, i) for i in range(peers)]:
                future.result()
        seconds = time.monotonic() - started
        result: dict[str, Any] = {
            "mode": mode,
            "peers": peers,
            "steps": steps,
            "seed": seed,
            "inner": inner,
            "lr": lr,
            "seconds": round(seconds, 2),
            "accuracy": round(accuracy(average_model(models, seed), x_test, y_test), 2),
            "peer_accuracy": [round(accuracy(m, x_test, y_test), 2) for m in models],
            "max_param_gap": max(
                float((p - q).detach().abs().max())
                for m in models[1:]
                for p, q in zip(models[0].parameters(), m.parameters(), strict=True)
            )
            if peers > 1
            else 0.0,
        }
        result.update({k: v for k, v in mode_options.items() if isinstance(v, (int, float, str))})
        modes = [o.mode for o in opts]
        if mode == "local":
            result["rounds"] = [m.rounds_succeeded for m in modes]
            result["rounds_started"] = [m.rounds_started for m in modes]
            result["failure_reasons"] = [list(m.failure_reasons) for m in modes]
            result["bytes_sent"] = sum(m.bytes_sent for m in modes)
            result["period_history"] = modes[0].period.history
            result["period_histories"] = [m.period.history for m in modes]
        elif mode == "diloco":
            result["rounds"] = [m.rounds_succeeded for m in modes]
            result["solo_steps"] = [m.solo_steps for m in modes]
            result["bytes_sent"] = sum(m.bytes_sent for m in modes)
        else:
            result["rounds"] = [m.rounds_succeeded for m in modes]
            result["solo_steps"] = [m.solo_steps for m in modes]
            result["state_loads"] = [m.state_loads for m in modes]
            result["global_steps"] = max(o.epoch for o in opts)
            result["bytes_sent"] = sum(bytes_sent)
        return result
    finally:
        for opt in opts:
            opt.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
        workdir.cleanup()


def adpsgd(
    peers: int, seed: int, steps: int = 400, wait_for_rounds: bool = True, step_seconds: float = 0.0
) -> list[dict[str, Any]]:
    """Fixed period 1 vs the adaptive period, same everything else.

    ``wait_for_rounds=False`` runs the rounds in the background (the default of the mode): a
    new round starts only once the previous one was applied, so "period 1" then means "as
    often as rounds complete", and counts depend on the machine's speed.
    """
    common = dict(
        peers=peers,
        steps=steps,
        seed=seed,
        wait_for_rounds=wait_for_rounds,
        average_every=1,
        step_seconds=step_seconds,
    )
    fixed = run_swarm("local", run_id=f"adpsgd-fixed-{seed}", adaptive_period=False, **common)
    fixed["experiment"] = "adpsgd-fixed-1"
    adaptive = run_swarm("local", run_id=f"adpsgd-adaptive-{seed}", **common)
    adaptive["experiment"] = "adpsgd-adaptive"
    summary = {
        "experiment": "adpsgd-summary",
        "wait_for_rounds": wait_for_rounds,
        "seed": seed,
        "peers": peers,
        "accuracy_fixed": fixed["accuracy"],
        "accuracy_adaptive": adaptive["accuracy"],
        "accuracy_gap": round(fixed["accuracy"] - adaptive["accuracy"], 2),
        "rounds_fixed": max(fixed["rounds"]),
        "rounds_adaptive": max(adaptive["rounds"]),
        "rounds_ratio": round(max(adaptive["rounds"]) / max(1, max(fixed["rounds"])), 3),
        "final_period": adaptive["period_history"][-1],
    }
    summary["claim_holds"] = (
        summary["rounds_ratio"] <= 0.5
        and abs(summary["accuracy_gap"]) <= 1.0
        and summary["final_period"] > 1
    )
    return [fixed, adaptive, summary]


def diloco(peers: int, seed: int, steps: int = 500, inner_steps: int = 50) -> list[dict[str, Any]]:
    """``sync`` vs DiLoCo H = ``inner_steps`` (uncompressed and fp16) on the same samples."""
    common = dict(peers=peers, steps=steps, seed=seed, inner="adamw", lr=1e-3)
    sync = run_swarm("sync", run_id=f"sync-{seed}", **common)
    sync["experiment"] = "sync"
    lines = [sync]
    for compression in (None, "fp16"):
        run = run_swarm(
            "diloco",
            run_id=f"diloco-{compression}-{seed}",
            inner_steps=inner_steps,
            compression=compression,
            **common,
        )
        run["experiment"] = f"diloco-H{inner_steps}" + (f"-{compression}" if compression else "")
        summary = {
            "experiment": run["experiment"] + "-vs-sync",
            "seed": seed,
            "peers": peers,
            "accuracy_sync": sync["accuracy"],
            "accuracy_diloco": run["accuracy"],
            "accuracy_gap": round(sync["accuracy"] - run["accuracy"], 2),
            "bytes_sync": sync["bytes_sent"],
            "bytes_diloco": run["bytes_sent"],
            "bytes_ratio": round(sync["bytes_sent"] / max(1, run["bytes_sent"]), 1),
        }
        summary["claim_holds"] = summary["accuracy_gap"] <= 2.0 and summary["bytes_ratio"] >= 50
        lines += [run, summary]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", choices=("adpsgd", "diloco"))
    parser.add_argument("--adpsgd-steps", type=int, default=400)
    parser.add_argument(
        "--background", action="store_true", help="ADPSGD with background (non-blocking) rounds"
    )
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="ADPSGD: compute time added per step"
    )
    parser.add_argument("--diloco-steps", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lock = threading.Lock()

    def emit(line: dict[str, Any]) -> None:
        with lock:
            print(json.dumps(line), flush=True)

    for seed in args.seeds:
        if args.only in (None, "adpsgd"):
            for line in adpsgd(
                args.peers, seed, args.adpsgd_steps, not args.background, args.step_seconds
            ):
                emit(line)
        if args.only in (None, "diloco"):
            for line in diloco(args.peers, seed, args.diloco_steps):
                emit(line)


if __name__ == "__main__":
    main()
