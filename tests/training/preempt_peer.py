"""A training peer for the SIGTERM tests: trains a tiny model, averages, checkpoints.

Prints one JSON object per line on stdout: ``ready`` (peer id, address, restored epoch),
``round`` (epoch, succeeded, seconds) and ``exit`` never (a clean exit is the exit status).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dht import DHT
from moshpit.training.preemption import handle_preemption
from moshpit.training.state_averager import TrainingStateAverager


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--identity", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--prefix", default="preempt")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=25.0)
    parser.add_argument("--no-handler", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=2)
    args = parser.parse_args()

    dht = DHT(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=args.identity,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = TrainingStateAverager(
        dht=dht,
        optimizer=opt,
        prefix=args.prefix,
        target_group_size=args.group_size,
        checkpoint_dir=args.checkpoint_dir,
        min_matchmaking_time=1.0,
        request_timeout=1.0,
        allreduce_timeout=5.0,
        join_timeout=5.0,
    )
    emit(
        event="ready",
        peer=str(dht.peer_id),
        addr=str(dht.get_visible_maddrs()[0]),
        epoch=state.epoch,
    )
    handler = None if args.no_handler else handle_preemption(state, dht, deadline=args.deadline)
    x = torch.randn(64, 32)
    while True:
        for _ in range(5):
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        started = time.monotonic()
        result = state.step(wait=True)
        state.epoch += 1
        emit(
            event="round",
            epoch=state.epoch,
            succeeded=result.succeeded,
            seconds=time.monotonic() - started,
            group=len(result.members),
        )
        if state.epoch % args.checkpoint_every == 0:
            state.save_checkpoint()
    del handler


if __name__ == "__main__":
    sys.exit(main())
