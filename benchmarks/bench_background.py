"""Background averaging overhead: a CPU training loop's step rate with and without rounds.

A trainer (this process) runs a TrainingStateAverager over an MLP and trains it on random data;
a partner process holding the same model averages with it back to back. The trainer
alternates two phases of equal length, several times, so drift in machine load hits both:

- ``baseline``: training steps only (the partner waits in matchmaking alone);
- ``background``: after every training step ``apply_pending()``, and a new ``step(wait=False)``
  as soon as the previous round was applied, so a round is always running.

One JSON object per line; the summary has the median step rates and ``slowdown`` =
1 - background / baseline (target <= 0.10), plus ``during_round_ratio``: the step rate while a
round was actually in flight over the baseline rate (target >= 0.8). Both processes use
``torch.set_num_threads(1)``: on the 2-core box the trainer keeps one core, the partner and
the network threads share the other.

    python benchmarks/bench_background.py [--params 4000000] [--phases 6] [--phase-seconds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PREFIX = "bench-background"


def _model(params: int):
    import torch

    width = max(16, int((params / 3) ** 0.5))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ), width


def _state(dht, model, lr: float = 0.01):
    import torch

    from moshpit.training.state_averager import TrainingStateAverager

    return TrainingStateAverager(
        dht=dht,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        prefix=PREFIX,
        target_group_size=2,
        initial_group_bits="",
        min_matchmaking_time=0.5,
        request_timeout=2.0,
        allreduce_timeout=30.0,
        sync_on_start=False,
    )


def partner(bootstrap: str, params: int) -> int:
    import torch

    from dht import DHT

    torch.set_num_threads(1)
    dht = DHT(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    model, _ = _model(params)
    state = _state(dht, model)
    print("ready", flush=True)
    try:
        while True:
            state.step(wait=True, timeout=30.0)
    finally:
        state.shutdown()
        dht.shutdown()


def trainer(args: argparse.Namespace) -> int:
    import torch

    from dht import DHT

    torch.set_num_threads(1)
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    bootstrap = str(dht.get_visible_maddrs()[0])
    proc = subprocess.Popen(
        [sys.executable, __file__, "--partner", bootstrap, "--params", str(args.params)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        model, width = _model(args.params)
        state = _state(dht, model)
        opt = state.optimizer
        x = torch.randn(args.batch, width)
        n_params = sum(p.numel() for p in model.parameters())

        def train_step() -> None:
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        for _ in range(5):  # warm-up (allocations, first round's dials)
            train_step()
        state.step(wait=True, timeout=60.0)

        rates = {"baseline": [], "background": []}
        during: list[float] = []
        rounds = 0
        round_seconds: list[float] = []
        for phase in range(args.phases * 2):
            kind = "baseline" if phase % 2 == 0 else "background"
            steps = 0
            started = time.perf_counter()
            running = None
            running_since = 0.0
            steps_in_round = 0
            while time.perf_counter() - started < args.phase_seconds:
                train_step()
                steps += 1
                if kind == "background":
                    steps_in_round += 1
                    if running is not None and running.done():
                        running.wait()  # applies the delta on this (training) thread
                        elapsed = time.perf_counter() - running_since
                        round_seconds.append(elapsed)
                        during.append(steps_in_round / elapsed)
                        rounds += 1
                        running = None
                    if running is None:
                        running = state.step(wait=False, timeout=30.0)
                        running_since = time.perf_counter()
                        steps_in_round = 0
            rates[kind].append(steps / (time.perf_counter() - started))
            if running is not None:
                running.wait(timeout=60.0)
            print(json.dumps({"kind": "phase", "phase": kind, "steps_per_s": rates[kind][-1]}))
        base = statistics.median(rates["baseline"])
        back = statistics.median(rates["background"])
        print(
            json.dumps(
                {
                    "kind": "background_averaging",
                    "params": n_params,
                    "state_mib": n_params * 4 / 2**20,
                    "batch": args.batch,
                    "baseline_steps_per_s": round(base, 2),
                    "background_steps_per_s": round(back, 2),
                    "slowdown": round(1 - back / base, 4),
                    "during_round_ratio": round(statistics.median(during) / base, 4)
                    if during
                    else None,
                    "rounds": rounds,
                    "round_s_median": round(statistics.median(round_seconds), 3)
                    if round_seconds
                    else None,
                    "target_slowdown": 0.10,
                }
            )
        )
        state.shutdown()
    finally:
        proc.kill()
        proc.wait()
        dht.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=4.0)
    parser.add_argument("--partner", metavar="BOOTSTRAP")
    args = parser.parse_args()
    if args.partner:
        return partner(args.partner, args.params)
    return trainer(args)


if __name__ == "__main__":
    sys.exit(main())
