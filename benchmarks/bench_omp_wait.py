"""What OpenMP's idle spinning costs a torch process on a machine that runs other work too.

A probe process runs small torch operations (a multiply of 200,000 floats, which torch splits
over its threads) with short pauses between them, as a training loop that waits on data or on
the network does, while ``--busy`` other processes keep the cores busy. It runs once with
OpenMP's default wait policy (an idle thread spins on its core for a while before sleeping) and
once with ``OMP_WAIT_POLICY=PASSIVE`` (an idle thread sleeps at once), in the same run. One JSON
object per policy: the probe's CPU seconds and wall seconds for the same work; then a summary
with the ratio.

    python benchmarks/bench_omp_wait.py            # 3 busy processes, 3000 operations
    python benchmarks/bench_omp_wait.py --busy 0   # an idle machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROBE = """
import sys, time
import torch
x = torch.randn(200_000)
ops = int(sys.argv[1])
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(ops):
    x.mul(2.0)
    time.sleep(0.0005)
print(time.process_time() - cpu, time.perf_counter() - wall, torch.get_num_threads())
"""


def probe(policy: str | None, ops: int) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(ops)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    cpu, wall, threads = float(out[0]), float(out[1]), int(out[2])
    return {"kind": "omp_wait", "policy": policy or "default", "ops": ops, "threads": threads,
            "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=3, help="busy processes beside the probe")
    parser.add_argument("--ops", type=int, default=3000)
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        default = probe(None, args.ops)
        passive = probe("PASSIVE", args.ops)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for row in (default, passive):
        print(json.dumps({**row, "busy": args.busy, "cores": os.cpu_count()}), flush=True)
    summary = {
        "kind": "omp_wait_summary",
        "busy": args.busy,
        "cores": os.cpu_count(),
        "cpu_default_vs_passive": round(default["cpu_s"] / passive["cpu_s"], 1),
        "wall_default_vs_passive": round(default["wall_s"] / passive["wall_s"], 2),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
