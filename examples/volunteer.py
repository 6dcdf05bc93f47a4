"""A volunteer peer: run this on each (preemptible) VM that should help train.

    python examples/volunteer.py --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... \\
        --identity volunteer.key --checkpoint-dir ckpt

It joins the swarm, restores its own checkpoint (if ``--checkpoint-dir`` holds one), catches up
with the swarm if the swarm is ahead, trains (8x8 digits, a small MLP), checkpoints every 10 s,
shows a live row (epoch, loss, test accuracy, samples/s, peers), and on SIGTERM (the notice a
preemptible VM gets) or Ctrl-C leaves cleanly: checkpoint, withdraw, exit 0. Restart it with the
same ``--identity`` and ``--checkpoint-dir`` and it resumes as the same peer. Torch gets all cores
but one (``--threads N`` to change), and it trains as fast as that allows (``--max-rate`` caps
the samples/s). The same program is installed as ``moshpit train``; ``--help`` lists the
options and their defaults. The heart of it is::

    dht = moshpit.DHT(initial_peers=[...], identity_path="volunteer.key")
    opt = moshpit.Optimizer(optimizer=torch.optim.Adam(model.parameters(), lr=3e-3), dht=dht,
                            run_id="digits", batch_size_per_step=32, mode="local",
                            checkpoint_dir="ckpt", checkpoint_every_seconds=10)
    moshpit.handle_preemption(opt, dht)          # SIGTERM: checkpoint, leave, exit 0
    for x, y in batches:
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

With no arguments it runs a short self-contained session (a swarm of its own, 150 steps,
checkpoints in a temporary directory) and exits 0, so you can try it anywhere.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from moshpit.cli import train_cmd


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volunteer.py", description="a volunteer peer of a moshpit training run"
    )
    train_cmd.configure_parser(parser)
    if not argv:
        with tempfile.TemporaryDirectory(prefix="moshpit-volunteer-") as tmp:
            print(
                "no arguments: a short standalone session (its own swarm, 150 steps); "
                "pass --initial-peers ADDR to join a swarm",
                flush=True,
            )
            args = parser.parse_args(
                ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", tmp,
                 "--max-steps", "150"]
            )  # fmt: skip
            return train_cmd.run(args)
    return train_cmd.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
