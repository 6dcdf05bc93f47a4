"""Codec speed, size and error on 16M float32 values, as ratios to a same-run baseline.

Baselines measured in the same run, interleaved with every codec's repeats so that load
from other processes affects both alike: ``tensor.clone()`` for every codec, and
``torch.topk(x.abs(), k)`` for TopK. Ratios are medians of per-repeat ratios. Prints one
JSON object per line.

    PYTHONPATH=. python benchmarks/bench_compression.py [--numel 16777216] [--repeats 5]
        [--threads 1] [--data gaussian|heavy|both] [--only SUBSTRING[,SUBSTRING...]]

The home-uplink comparison (docs/compression.md): 2.2M values, TopK2Bit at densities
0.01/0.02/0.03 beside Blockwise4Bit and TopK at the same densities:

    PYTHONPATH=. python benchmarks/bench_compression.py --numel 2200000 --repeats 9 \
        --only Blockwise4Bit,TopK
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from compression import (
    BFloat16,
    Blockwise4Bit,
    Blockwise8Bit,
    Float16,
    NoCompression,
    Quantile8Bit,
    RandomK,
    ScaledFloat16,
    ScaledSign,
    TopK,
    TopK2Bit,
    Uniform8Bit,
    decompress,
)

# (codec, target description, max round-trip time / clone time, max bits/value, max rel err)
CODECS = [
    (NoCompression(), None, None, None, None),
    (Float16(), "round trip <= 2x clone", 2.0, None, None),
    (BFloat16(), "round trip <= 2x clone", 2.0, None, None),
    (ScaledFloat16(), None, None, None, None),
    (Uniform8Bit(), "<= 4x clone, <= 8.25 bits, rel err <= 1e-2 (gaussian)", 4.0, 8.25, 1e-2),
    (
        Uniform8Bit(range_sigmas=None),
        "<= 4x clone, <= 8.25 bits, rel err <= 1e-2 (gaussian)",
        4.0,
        8.25,
        1e-2,
    ),
    (
        Uniform8Bit(outliers=False),
        "<= 4x clone, <= 8.25 bits, rel err <= 1e-2 (gaussian)",
        4.0,
        8.25,
        1e-2,
    ),
    (Quantile8Bit(), "<= 4x clone, <= 8.25 bits, rel err <= 1e-2 (gaussian)", 4.0, 8.25, 1e-2),
    (Blockwise8Bit(), "<= 4x clone, <= 8.25 bits, rel err <= 1e-2 (gaussian)", 4.0, 8.25, 1e-2),
    (TopK(0.001, seed=0), "compress >= 3x faster than torch.topk", None, None, None),
    (TopK(0.01, seed=0), None, None, None, None),
    (RandomK(0.01, seed=0), None, None, None, None),
    (ScaledSign(), None, None, None, None),
    # home uplinks: DiLoCo's "4bit" and "sparse2bit", with TopK at the same densities
    (Blockwise4Bit(), None, None, None, None),
    (TopK(0.02, seed=0), None, None, None, None),
    (TopK(0.03, seed=0), None, None, None, None),
    (TopK2Bit(0.01), None, None, None, None),
    (TopK2Bit(0.02), None, None, None, None),
    (TopK2Bit(0.03), None, None, None, None),
]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def make_data(kind: str, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    if kind == "heavy":
        # gradient-like: Gaussian times a log-normal scale per entry (heavy tails, most
        # entries tiny, a few large), plus a handful of extreme outliers
        x.mul_(torch.randn(n, generator=gen).mul_(1.5).exp_()).mul_(1e-3)
        x[torch.randint(n, (n // 100_000 + 1,), generator=gen)] *= 100
    return x


def bench(codec, x: torch.Tensor, repeats: int) -> dict:
    comp, decomp, clones, topks = [], [], [], []
    k = max(1, round(getattr(codec, "density", 0) * x.numel()))
    ct = y = None
    for _ in range(repeats):
        clones.append(timed(x.clone)[0])
        t, ct = timed(lambda: codec.compress(x))
        comp.append(t)
        t, y = timed(lambda ct=ct: decompress(ct))
        decomp.append(t)
        if isinstance(codec, TopK):
            topks.append(timed(lambda: torch.topk(x.abs(), k, sorted=False))[0])
    med = statistics.median
    rel = float((y.double() - x.double()).norm() / x.double().norm())
    row = {
        "codec": repr(codec),
        "compress_s": round(med(comp), 5),
        "decompress_s": round(med(decomp), 5),
        "total_s": round(med(c + d for c, d in zip(comp, decomp, strict=True)), 5),
        "clone_s": round(med(clones), 5),
        "bytes": ct.nbytes,
        "bits_per_value": round(8 * ct.nbytes / x.numel(), 4),
        "compression_ratio": round(4 * x.numel() / max(ct.nbytes, 1), 2),
        "rel_error": round(rel, 6),
    }
    if hasattr(codec, "density"):  # sparse: what one kept value costs, indices included
        kept = int(torch.count_nonzero(y))
        row["kept"] = kept
        row["bits_per_kept"] = round(8 * ct.nbytes / max(kept, 1), 2)
    # paired: each repeat's round trip over the clone measured right before it, then the
    # median, so that load changes during the run cancel out
    paired = [(c + d) / b for c, d, b in zip(comp, decomp, clones, strict=True)]
    row["time_vs_clone"] = round(med(paired), 3)
    if topks:
        row["torch_topk_s"] = round(med(topks), 5)
        speedups = [t / c for t, c in zip(topks, comp, strict=True)]
        row["speedup_vs_torch_topk"] = round(med(speedups), 2)
    return row


def check(row, target, max_time, max_bits, max_err, kind):
    if target is None:
        return None
    if "torch.topk" in target:
        return row["speedup_vs_torch_topk"] >= 3.0
    ok = max_time is None or row["time_vs_clone"] <= max_time
    if max_bits is not None:
        ok = ok and row["bits_per_value"] <= max_bits
    if max_err is not None and kind == "gaussian":
        ok = ok and row["rel_error"] <= max_err
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine, multi-threaded kernels "
        "stall on busy cores; 0 keeps torch's default)",
    )
    parser.add_argument("--data", choices=["gaussian", "heavy", "both"], default="both")
    parser.add_argument(
        "--only", default=None, help="comma-separated substrings of the codec reprs to run"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ["gaussian", "heavy"] if args.data == "both" else [args.data]
    for kind in kinds:
        x = make_data(kind, args.numel)
        for codec, target, max_time, max_bits, max_err in CODECS:
            if args.only and not any(part in repr(codec) for part in args.only.split(",")):
                continue
            row = {"bench": "compression", "data": kind, "numel": args.numel}
            row["threads"] = torch.get_num_threads()
            row.update(bench(codec, x, args.repeats))
            row["target"] = target
            row["target_met"] = check(row, target, max_time, max_bits, max_err, kind)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
