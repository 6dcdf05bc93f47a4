"""Training-state benchmarks, one JSON object per line, baselines measured in the same run.

Section ``checkpoint``: StateStore save/restore (``save_state`` / ``load_state``) against
``torch.save`` / ``torch.load`` of the same state dict, in the same directory, repeats
interleaved so that load from other processes hits both alike. ``torch.save`` does not fsync;
it is measured both as is and followed by an fsync of the file and its directory. Our save is
measured durable (fsync of every file and directory, the default) and with ``durable=False``.
Restores read from the page cache in both cases (the files were just written), and ours
verifies the SHA-256 of every chunk. Ratios are medians of per-repeat ratios (ours / torch);
below 1 means faster than torch. CPU seconds (all threads) are reported next to wall seconds.

    PYTHONPATH=. python benchmarks/bench_state.py [--only checkpoint] [--repeats 5]
        [--dirs /tmp,/work] [--cases large,small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from moshpit.training.store import StateStore, load_state, save_state

# ---------------------------------------------------------------------- checkpoint


def checkpoint_state(case: str) -> dict[str, torch.Tensor]:
    """``large``: 256 MiB in 50 float32 tensors; ``small``: 32 MiB in 2048 tensors of 16 KiB."""
    gen = torch.Generator().manual_seed(0)
    if case == "large":
        count, numel = 50, (256 << 20) // 4 // 50
    elif case == "small":
        count, numel = 2048, (16 << 10) // 4
    else:
        raise ValueError(f"unknown case {case!r}")
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _measure(out: dict[str, float], key: str, fn: Callable[[], object]) -> None:
    """Wall seconds under ``key``, CPU seconds of the whole process (all threads) under
    ``key_cpu``: on a shared machine the CPU time shows the work regardless of scheduling."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    out[key] = time.perf_counter() - wall
    out[f"{key}_cpu"] = time.process_time() - cpu


def checkpoint_repeat(state: dict[str, torch.Tensor], base: str) -> dict[str, float]:
    """One interleaved repeat of every measurement, each on fresh files under ``base``."""
    named = list(state.items())
    changed = [(n, t.clone() if i % 10 == 0 else t) for i, (n, t) in enumerate(named)]
    for i, (_, t) in enumerate(changed):
        if i % 10 == 0:
            t.add_(1.0)
    out: dict[str, float] = {}
    work = tempfile.mkdtemp(prefix="bench-state-", dir=base)
    try:
        pt = os.path.join(work, "state.pt")

        def torch_save_fsync() -> None:
            torch.save(state, pt)
            _fsync_path(pt)
            _fsync_path(work, directory=True)

        _measure(out, "torch_save", lambda: torch.save(state, pt))
        os.unlink(pt)
        _measure(out, "torch_save_fsync", torch_save_fsync)
        _measure(out, "torch_load", lambda: torch.load(pt))
        os.unlink(pt)

        durable = StateStore(os.path.join(work, "durable"))
        _measure(out, "save_durable", lambda: save_state(durable, named, 1))
        _measure(out, "load", lambda: load_state(durable))
        # a tenth of the tensors changed: only their chunks are written
        _measure(out, "save_incremental", lambda: save_state(durable, changed, 2))
        shutil.rmtree(durable.directory)

        fast = StateStore(os.path.join(work, "nodurable"), durable=False)
        _measure(out, "save_nodurable", lambda: save_state(fast, named, 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def bench_checkpoint(args: argparse.Namespace) -> None:
    for base in args.dirs.split(","):
        for case in args.cases.split(","):
            state = checkpoint_state(case)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            checkpoint_repeat(state, base)  # warm-up: page cache, thread pool, allocator
            runs = [checkpoint_repeat(state, base) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

            def ratio(ours: str, theirs: str, runs: list[dict[str, float]] = runs) -> float:
                return round(statistics.median(r[ours] / r[theirs] for r in runs), 3)

            print(
                json.dumps(
                    {
                        "bench": "checkpoint",
                        "case": case,
                        "dir": base,
                        "tensors": len(state),
                        "mib": round(nbytes / (1 << 20), 1),
                        "repeats": args.repeats,
                        "loadavg_1m": round(os.getloadavg()[0], 2),
                        "seconds": {
                            k: round(v, 4) for k, v in med.items() if not k.endswith("_cpu")
                        },
                        "cpu_seconds": {
                            k[:-4]: round(v, 4) for k, v in med.items() if k.endswith("_cpu")
                        },
                        "save_durable/torch_save_fsync": ratio("save_durable", "torch_save_fsync"),
                        "save_durable/torch_save": ratio("save_durable", "torch_save"),
                        "save_nodurable/torch_save": ratio("save_nodurable", "torch_save"),
                        "save_incremental/torch_save_fsync": ratio(
                            "save_incremental", "torch_save_fsync"
                        ),
                        "load/torch_load": ratio("load", "torch_load"),
                        "cpu: save_durable/torch_save_fsync": ratio(
                            "save_durable_cpu", "torch_save_fsync_cpu"
                        ),
                        "cpu: load/torch_load": ratio("load_cpu", "torch_load_cpu"),
                        "target": "save and load <= 1.0x torch.save(+fsync) / torch.load",
                    }
                ),
                flush=True,
            )


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {"checkpoint": bench_checkpoint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run one section")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dirs", default="/tmp", help="comma-separated directories to write in")
    parser.add_argument("--cases", default="large,small", help="checkpoint cases: large,small")
    args = parser.parse_args()
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            section(args)


if __name__ == "__main__":
    main()
