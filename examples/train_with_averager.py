"""Plain PyTorch training loops that average their parameters with moshpit.Averager.

Starts two peers in this one process, each with its own ``moshpit.DHT`` (they find each other
through the first one's multiaddr, over loopback TCP) and its own copy of a small linear
regression model trained on its own data shard with SGD. Every ``--average-every`` steps
both call ``averager.step()``; afterwards their parameters are identical, and both end up
fitting the shared target better than training alone would.

In a real run each peer is its own process or machine: replace the second DHT's
``initial_peers`` with a multiaddr printed by ``moshpit dht`` or by another peer.

    python examples/train_with_averager.py --steps 60 --average-every 10
"""

from __future__ import annotations

import argparse
import threading

import torch

import moshpit


def make_peer(initial_peers: list[str], seed: int, true_w: torch.Tensor):
    dht = moshpit.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    torch.manual_seed(seed)
    model = torch.nn.Linear(true_w.numel(), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = moshpit.Averager(
        model.parameters(),
        dht=dht,
        prefix="example-linear",
        target_group_size=2,
        min_matchmaking_time=1.0,
        request_timeout=2.0,
        allreduce_timeout=10.0,
    )
    # this peer's data shard: a slice of the input space only it sees
    x = torch.randn(256, true_w.numel()) + seed
    y = x @ true_w + 0.5
    return dht, model, opt, averager, (x, y)


def train(peer, steps: int, average_every: int, log: list) -> None:
    dht, model, opt, averager, (x, y) = peer
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x), (32,))
        with averager.get_tensors():  # the averager writes parameters under this lock
            loss = torch.nn.functional.mse_loss(model(x[idx]).squeeze(-1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if step % average_every == 0:
            result = averager.step(timeout=15.0)
            log.append((step, result.succeeded, result.group_size, loss.item()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--average-every", type=int, default=10)
    args = parser.parse_args()

    true_w = torch.tensor([1.0, -2.0, 3.0])
    first = make_peer([], seed=0, true_w=true_w)
    second = make_peer([str(a) for a in first[0].get_visible_maddrs()], seed=1, true_w=true_w)
    peers = [first, second]
    logs: list[list] = [[], []]
    try:
        threads = [
            threading.Thread(target=train, args=(p, args.steps, args.average_every, log))
            for p, log in zip(peers, logs, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, log in enumerate(logs):
            for step, ok, size, loss in log:
                print(f"peer {i} step {step:3d}: loss {loss:8.4f}, averaged={ok} (group of {size})")
        params = [
            torch.cat([p.detach().reshape(-1) for p in peer[1].parameters()]) for peer in peers
        ]
        same = torch.allclose(params[0], params[1], atol=1e-5)
        rounds = sum(ok for _, ok, _, _ in logs[0])
        print(f"parameters identical after the last averaging: {same}; averaged rounds: {rounds}")
        print(
            f"learned weights: {[round(v, 3) for v in params[0][:3].tolist()]} (true {true_w.tolist()})"
        )
        return 0 if same and rounds == args.steps // args.average_every else 1
    finally:
        for dht, _, _, averager, _ in peers:
            averager.shutdown()
            dht.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
