"""Fuzz every wire decoder for a fixed time each; one JSON object per target.

The targets, their contracts and corpora are those of ``tests/fuzz`` (see its ``_harness``):
hypothesis feeds each decoder raw bytes and mutations of valid encodings in batches until the
time is up. ``executions`` counts decoder calls; ``failures`` counts failing batches (each
one shrunk failure), and ``found`` names every distinct failure with its shrunk input.

    python benchmarks/fuzz_decoders.py              # 10 s per target
    python benchmarks/fuzz_decoders.py 20 -k noise  # 20 s per target named like *noise*
    python benchmarks/fuzz_decoders.py --list
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz._harness import load_all, run_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=float, default=10.0, help="per target")
    parser.add_argument("-k", "--select", default="", help="only targets whose name has this")
    parser.add_argument("--list", action="store_true", help="print the target names and exit")
    args = parser.parse_args()
    # decoders log what they refuse (yamux: "protocol violation ..."); thousands of lines here
    logging.disable(logging.CRITICAL)
    targets = {n: t for n, t in sorted(load_all().items()) if args.select in n}
    if args.list:
        print("\n".join(targets))
        return 0
    total_runs = total_failures = 0
    total_seconds = 0.0
    for name, target in targets.items():
        stats = run_for(target, args.seconds)
        total_runs += stats.executions
        total_failures += stats.failures
        total_seconds += stats.seconds
        line = {
            "target": name,
            "seconds": round(stats.seconds, 1),
            "executions": stats.executions,
            "failures": stats.failures,
        }
        if stats.found:
            line["found"] = [{"error": sig, "input": ex} for sig, ex in stats.found.items()]
        print(json.dumps(line), flush=True)
    print(
        json.dumps(
            {
                "target": "all",
                "targets": len(targets),
                "seconds": round(total_seconds, 1),
                "executions": total_runs,
                "failures": total_failures,
            }
        )
    )
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
