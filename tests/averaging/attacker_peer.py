"""A hostile averaging peer for the real-process tests: ``python -m tests.averaging.attacker_peer``.

It speaks the demo worker's line protocol (one JSON object per line on stdout: ``ready``,
then ``round`` after each step started by a ``go`` line on stdin) and joins the demo
workers' averaging, but holds ``--value`` everywhere and steps with ``--weight`` (default: the
largest weight the API accepts). Everything it sends is valid: the attack is in the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="attacker-peer")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--value", type=float, default=1e30)
    p.add_argument("--weight", type=float, default=None)
    p.add_argument("--min-matchmaking-time", type=float, default=1.5)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from dht import DHT
    from moshpit.averaging.allreduce_protocol import MAX_WEIGHT
    from moshpit.averaging.averager import Averager

    torch.set_num_threads(1)
    weight = MAX_WEIGHT if args.weight is None else args.weight
    tensor = torch.full((args.size,), args.value)
    dht = DHT(initial_peers=[args.bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    # the same settings as the demo workers (moshpit.cli.demo_cmd), so that they group with it
    averager = Averager(
        [tensor],
        dht,
        prefix="demo",
        target_group_size=args.group_size,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=3.0,
        allreduce_timeout=6.0,
        initial_group_bits="",
        matchmaking_timeout=args.min_matchmaking_time + 2.0,
    )

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    emit({"event": "ready", "index": -1, "peer": str(dht.peer_id)})
    for r in range(args.rounds):
        if not sys.stdin.readline():
            break
        res = averager.step(weight=weight, gather={"index": -1})  # as the demo workers do
        emit({"event": "round", "round": r, "ok": res.succeeded, "reason": res.reason,
              "members": [str(m) for m in res.members]})  # fmt: skip
    averager.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
