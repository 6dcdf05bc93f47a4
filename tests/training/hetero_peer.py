"""One peer of tests/training/test_heterogeneous_processes.py: a toy model whose every step is
known exactly, trained at a stated speed.

Usage: python hetero_peer.py MODE RANK STEP_SECONDS TARGET EPOCHS [INITIAL_PEER ...]

The model is one parameter vector ``p`` (8 values) and the loss ``(p * c).sum()`` with
``c = 2**-(RANK + 3)``: every gradient is ``c``, so a plain SGD step moves ``p`` by exactly
``-lr * c`` (dyadic numbers: no rounding). In ``sync`` the swarm's step is then
``-lr * (sum of samples_i * c_i) / (sum of samples_i)``, and in ``diloco`` (outer SGD, lr 1,
no momentum) the outer step is ``-(sum of samples_i * Δ_i) / (sum of samples_i)`` with
``Δ_i = steps_i * lr * c_i``: the test recomputes both from what the members declared.

Waits until 4 peers report progress, then steps every STEP_SECONDS until its epoch reaches
EPOCHS (or 150 s passed). Prints ``MADDR <addr>`` once up, one JSON line per epoch it enters
(the value of ``p`` after the epoch's step, the round's members with their declared samples),
and a final line with its counters.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import moshpit

PEERS = 4
BATCH = 8
LR = 0.5


def main() -> None:
    mode, rank, step_seconds, target, epochs = (
        sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    )  # fmt: skip
    initial_peers = sys.argv[6:]
    torch.set_num_threads(1)
    c = 2.0 ** -(rank + 3)
    p = torch.nn.Parameter(torch.zeros(8))
    dht = moshpit.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print("MADDR " + str(dht.get_visible_maddrs()[0]), flush=True)
    options = dict(outer_lr=1.0, outer_momentum=0.0) if mode == "diloco" else {}
    opt = moshpit.Optimizer(
        optimizer=torch.optim.SGD([p], lr=LR),
        dht=dht,
        run_id=f"hetero-{mode}",
        batch_size_per_step=BATCH,
        mode=mode,
        target_batch_size=target,
        target_group_size=PEERS,
        averager_options=dict(min_matchmaking_time=1.0, request_timeout=2.0),
        load_state_timeout=10.0,
        **options,
    )
    opt.tracker.report(0, 0)  # everyone is live before anyone trains
    deadline = time.monotonic() + 90
    while opt.tracker.refresh(timeout=10).num_peers < PEERS and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = opt.epoch
    steps = 0
    started = time.monotonic()
    while opt.epoch < epochs and time.monotonic() - started < 150:
        began = time.monotonic()
        loss = (p * c).sum()
        loss.backward()
        left = step_seconds - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)
        opt.step()
        opt.zero_grad()
        steps += 1
        if opt.epoch != seen:
            seen = opt.epoch
            state = opt.mode
            value = (state.theta[0] if mode == "diloco" else p.detach())[0].item()
            result = state.last_result
            members = {}
            if result is not None and result.succeeded:
                for peer, claim in result.gathered.items():
                    members[str(peer)] = claim.get("samples") if isinstance(claim, dict) else None
            print(json.dumps({"epoch": seen, "value": value, "members": members}), flush=True)
    state = opt.mode
    print(
        json.dumps(
            {
                "final": True,
                "peer": str(dht.peer_id),
                "rank": rank,
                "c": c,
                "epoch": opt.epoch,
                "steps": steps,
                "solo": state.solo_steps,
                "loads": state.state_loads,
                "failed": state.rounds_failed,
            }
        ),
        flush=True,
    )
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
