"""Preemption science: does a swarm where 30% of peers are preempted and restarted reach the
same final accuracy as an undisturbed one?

Runs ``moshpit demo --json`` (the training demo: real peer processes, the 8x8 digits, a small
MLP, mode local) with and without preemptions, seed by seed, on the same sample budget, and
prints one JSON object per run plus one per seed (the accuracy gap in points) and a final one
with the mean gap and the claim's result: within 1 point and no stuck peer.

    python benchmarks/bench_preemption.py                  # 10 peers, 3 preempted, 3 seeds
    python benchmarks/bench_preemption.py --peers 4 --preemptions 1 --seeds 1   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile


def run_demo(args: argparse.Namespace, seed: int, preemptions: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "moshpit", "demo", "--json", "--no-plot",
            "--peers", str(args.peers), "--samples", str(args.samples),
            "--max-rate", str(args.max_rate), "--preemptions", str(preemptions),
            "--seed", str(seed), "--mode", args.mode,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=args.timeout)
    lines = proc.stdout.strip().splitlines()
    try:
        summary = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-2000:]}
    summary["exit"] = proc.returncode
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=10)
    p.add_argument("--preemptions", type=int, default=3, help="default 3 (30%% of 10 peers)")
    p.add_argument("--samples", type=int, default=150_000)
    p.add_argument("--max-rate", type=float, default=250.0, help="samples/s per peer")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--mode", default="local")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    gaps, stuck, ok = [], 0, True
    for seed in range(args.seeds):
        results = {}
        for label, n in (("undisturbed", 0), ("preempted", args.preemptions)):
            res = run_demo(args, seed, n)
            results[label] = res
            print(
                json.dumps({"bench": "preemption", "seed": seed, "run": label, **res}), flush=True
            )
        a, b = results["undisturbed"], results["preempted"]
        if "error" in a or "error" in b:
            ok = False
            continue
        gap = (b["final_accuracy"] - a["final_accuracy"]) * 100
        gaps.append(gap)
        stuck += a["stuck_peers"] + b["stuck_peers"]
        print(
            json.dumps(
                {
                    "bench": "preemption",
                    "seed": seed,
                    "undisturbed_accuracy": a["final_accuracy"],
                    "preempted_accuracy": b["final_accuracy"],
                    "gap_points": round(gap, 2),
                    "preemptions": b["preemptions"],
                    "restarts": b["restarts"],
                    "stuck_peers": a["stuck_peers"] + b["stuck_peers"],
                    "wall_s": [a["wall_s"], b["wall_s"]],
                }
            ),
            flush=True,
        )
    within = bool(gaps) and all(abs(g) <= 1.0 or g > 0 for g in gaps)
    print(
        json.dumps(
            {
                "bench": "preemption",
                "summary": True,
                "peers": args.peers,
                "preempted_fraction": round(args.preemptions / args.peers, 2),
                "seeds": len(gaps),
                "mean_gap_points": round(statistics.mean(gaps), 2) if gaps else None,
                "worst_gap_points": round(min(gaps), 2) if gaps else None,
                "stuck_peers": stuck,
                "claim_holds": ok and within and stuck == 0,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
