"""A donor process for tests/training/test_sharing_processes.py and benchmarks/bench_state.py.

Builds a deterministic state (``--seed``, ``--mib``), keeps its chunks in memory, serves it
with StateSharing on a real DHT over loopback TCP, prints one JSON line
``{"peer_id", "maddrs", "root"}`` and serves until killed or stdin closes.

``--read-delay S``: each chunk read takes S seconds (a slow disk).
``--corrupt``: every chunk it serves has its first byte flipped (a malicious donor).
``--die-after N``: SIGKILL itself on its (N+1)-th chunk read (a donor that loses power
mid-download, after serving about N chunks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch


def make_state(seed: int, mib: float) -> list[tuple[str, torch.Tensor]]:
    """The run's state: a few float32/float16/int64 tensors totalling about ``mib`` MiB."""
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // 4
    big = n * 3 // 4
    return [
        ("model.weight", torch.randn(big // 1024, 1024, generator=g)),
        ("model.bias", torch.randn(1024, generator=g)),
        ("opt.exp_avg", torch.randn((n - big) * 2, generator=g).to(torch.float16)),
        ("opt.step", torch.tensor([seed], dtype=torch.int64)),
    ]


class MemoryStore:
    def __init__(self, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks

    def has_chunk(self, digest: bytes) -> bool:
        return digest in self.chunks

    def read_chunk(self, digest: bytes) -> bytes | None:
        return self.chunks.get(digest)

    def put_chunk(self, digest: bytes, data: bytes) -> None:
        if hashlib.sha256(data).digest() != digest:
            raise ValueError("chunk does not match its digest")
        self.chunks[digest] = bytes(data)


class SlowStore(MemoryStore):
    """Reads take ``delay`` seconds (a slow disk), so a test can act mid-download."""

    def __init__(self, chunks: dict[bytes, bytes], delay: float) -> None:
        super().__init__(chunks)
        self.delay = delay

    def read_chunk(self, digest: bytes) -> bytes | None:
        time.sleep(self.delay)  # called in StateSharing's worker thread, not on the loop
        return self.chunks.get(digest)


class CorruptStore(MemoryStore):
    def read_chunk(self, digest: bytes) -> bytes | None:
        data = self.chunks.get(digest)
        return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]


class DyingStore(MemoryStore):
    def __init__(self, chunks: dict[bytes, bytes], reads: int) -> None:
        super().__init__(chunks)
        self.left = reads

    def read_chunk(self, digest: bytes) -> bytes | None:
        if self.left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self.left -= 1
        return self.chunks.get(digest)


def main() -> None:
    from dht import DHT
    from moshpit.training.manifest import build_manifest
    from moshpit.training.sharing import StateSharing

    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--prefix", default="run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--die-after", type=int, default=None, help="chunk reads, then SIGKILL")
    parser.add_argument("--max-uploads", type=int, default=8)
    parser.add_argument("--read-delay", type=float, default=0.0, help="seconds per chunk read")
    args = parser.parse_args()

    named = make_state(args.seed, args.mib)
    manifest, views = build_manifest(named, args.epoch, chunk_bytes=int(args.chunk_mib * (1 << 20)))
    chunks = {d: bytes(v) for d, v in views.items()}
    if args.corrupt:
        store: MemoryStore = CorruptStore(chunks)
    elif args.die_after is not None:
        store = DyingStore(chunks, args.die_after)
    elif args.read_delay:
        store = SlowStore(chunks, args.read_delay)
    else:
        store = MemoryStore(chunks)
    dht = DHT(initial_peers=args.initial_peer, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def create(_dht, node):
        sharing = StateSharing(
            node, args.prefix, store, max_concurrent_uploads=args.max_uploads, announce_ttl=30.0
        )
        sharing.publish(manifest)
        return sharing

    sharing = dht.run_coroutine(create)
    dht.start_service(sharing.run)
    print(
        json.dumps(
            {
                "peer_id": dht.peer_id.to_base58(),
                "maddrs": [str(a) for a in dht.get_visible_maddrs()],
                "root": manifest.root.hex(),
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
    dht.shutdown()


if __name__ == "__main__":
    main()
