"""One ``mode="diloco"`` peer process for tests/training/test_diloco_processes.py.

Usage: python diloco_peer.py WORKDIR NAME STEP_SECONDS OUTER_EPOCHS [INITIAL_PEER ...]

Waits until all 4 peers report progress, then trains a small regression model with
``inner_steps`` = 20 until its outer epoch reaches
OUTER_EPOCHS, sleeping STEP_SECONDS per inner step (a slower machine), then leaves. Prints
``MADDR <addr>`` once up, then one JSON line per outer epoch it reaches (epoch, a digest of
θ, the last round's group size, counters), and a final line.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

import moshpit

INNER_STEPS = 20
PEERS = 4
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])


def main() -> None:
    workdir, name, step_seconds, epochs = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(
        sys.argv[4]
    )
    initial_peers = sys.argv[5:]
    torch.manual_seed(0)  # every peer starts from the same weights
    model = torch.nn.Linear(4, 1)
    dht = moshpit.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print("MADDR " + str(dht.get_visible_maddrs()[0]), flush=True)
    opt = moshpit.Optimizer(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        dht=dht,
        run_id="diloco-procs",
        batch_size_per_step=8,
        mode="diloco",
        inner_steps=INNER_STEPS,
        target_group_size=4,
        checkpoint_dir=f"{workdir}/{name}",
        averager_options=dict(min_matchmaking_time=1.0, request_timeout=2.0),
        load_state_timeout=10.0,
        progress_ttl=10.0,
    )
    # every peer is live before anyone trains: "every live peer in every outer round" (a
    # peer still importing torch when the first round forms joins later, by loading state)
    opt.tracker.report(0, 0)
    deadline = time.monotonic() + 90
    while opt.tracker.refresh(timeout=10).num_peers < PEERS and time.monotonic() < deadline:
        time.sleep(0.2)
    gen = torch.Generator().manual_seed(sum(name.encode()))
    seen = opt.epoch
    started = time.monotonic()
    while opt.epoch < epochs and time.monotonic() - started < 150:
        x = torch.randn(8, 4, generator=gen)
        y = x @ W_TRUE
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        opt.step(loss=loss.detach())
        opt.zero_grad()
        time.sleep(step_seconds)
        if opt.epoch != seen:
            seen = opt.epoch
            mode = opt.mode
            theta = hashlib.sha256(b"".join(t.numpy().tobytes() for t in mode.theta)).hexdigest()
            result = mode.last_result
            print(
                json.dumps(
                    {
                        "epoch": seen,
                        "theta": theta[:16],
                        "group": result.group_size if result is not None else 0,
                        "solo": mode.solo_steps,
                        "loads": mode.state_loads,
                        "failed": mode.rounds_failed,
                    }
                ),
                flush=True,
            )
    print(json.dumps({"final": True, "epoch": opt.epoch}), flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
