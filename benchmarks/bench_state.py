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

Section ``download`` (see the comment above ``_Uplink``): state download from 1 vs 4 donors
and 8 joiners at once on the in-memory network with a per-peer upload cap (virtual time), and
over loopback TCP against raw TCP copying the same bytes.

    PYTHONPATH=. python benchmarks/bench_state.py --only download [--download-mib 256]
        [--download-parts memory,loopback] [--uplink-mib 4] [--loopback-donors 1] [--repeats 3]

Section ``background`` (``benchmarks/bench_background.py``): a CPU training loop's step rate
with background averaging rounds always running vs none, phases interleaved.

    PYTHONPATH=. python benchmarks/bench_state.py --only background [--background-params 4000000]
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
from typing import Any

import torch
import trio
import trio.testing

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


# ---------------------------------------------------------------------- download
#
# (a) 1 joiner from 1 vs 4 donors and (b) 8 joiners at once from 4 donors: in-memory network
#     under MockClock, each peer's *upload* capped at --uplink-mib MiB/s (virtual time; the
#     memory network's own bandwidth model is per link, so the cap is a transport wrapper
#     shared by all of a peer's connections). CPU costs no virtual time here: these numbers
#     measure the protocol's scheduling (parallel donors, busy answers, swarming).
# (c) loopback TCP: a donor process serves the state, this process downloads it (Noise, yamux,
#     SHA-256 of every chunk, tensors rebuilt) vs raw TCP copying the same bytes between two
#     processes. Wall-clock time.


class _Uplink:
    """One peer's upload capacity, shared by all its connections (FIFO by 64 KiB piece)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0


class _CappedStream(trio.abc.HalfCloseableStream):
    PIECE = 64 << 10

    def __init__(self, inner: Any, uplink: _Uplink) -> None:
        self.inner = inner
        self.uplink = uplink
        self.remote_addr = getattr(inner, "remote_addr", "")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), self.PIECE):
            piece = view[start : start + self.PIECE]
            now = trio.current_time()
            self.uplink.free_at = max(now, self.uplink.free_at) + len(piece) / self.uplink.rate
            await trio.sleep_until(self.uplink.free_at)
            await self.inner.send_all(piece)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _CappedListener:
    def __init__(self, inner: Any, uplink: _Uplink) -> None:
        self.inner = inner
        self.uplink = uplink
        self.multiaddr = inner.multiaddr

    async def accept(self) -> tuple[_CappedStream, str]:
        stream, remote = await self.inner.accept()
        return _CappedStream(stream, self.uplink), remote

    async def aclose(self) -> None:
        await self.inner.aclose()


class CappedTransport:
    """A MemoryNetwork transport whose peer uploads at most ``rate`` bytes/s in all."""

    def __init__(self, inner: Any, rate: float) -> None:
        self.inner = inner
        self.uplink = _Uplink(rate)

    def can_dial(self, maddr: Any) -> bool:
        return self.inner.can_dial(maddr)

    async def listen(self, maddr: Any) -> list[_CappedListener]:
        return [_CappedListener(x, self.uplink) for x in await self.inner.listen(maddr)]

    async def dial(self, maddr: Any, timeout: float = 10.0) -> _CappedStream:  # noqa: ASYNC109
        return _CappedStream(await self.inner.dial(maddr, timeout=timeout), self.uplink)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ChunkDict:
    def __init__(self, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks

    def has_chunk(self, digest: bytes) -> bool:
        return digest in self.chunks

    def read_chunk(self, digest: bytes) -> bytes | None:
        return self.chunks.get(digest)

    def put_chunk(self, digest: bytes, data: bytes) -> None:
        self.chunks[digest] = data  # verified by StateSharing already


def download_state(mib: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    numel = (mib << 20) // 4 // 8
    return [(f"layer{i}.weight", torch.randn(numel, generator=gen)) for i in range(8)]


async def _memory_run(
    named: list[tuple[str, torch.Tensor]],
    chunks: dict[bytes, bytes],
    manifest: Any,
    donors: int,
    joiners: int,
    rate: float,
    served: dict[str, float],
    max_uploads: int,
    extra: dict[str, Any],
) -> list[float]:
    """Virtual seconds each joiner took to download the state from ``donors`` donors."""
    from dht import DHTNode
    from dht.p2p import Identity, MemoryNetwork
    from moshpit.training.sharing import StateSharing

    net = MemoryNetwork(latency=0.005)
    schema = manifest.schema()
    times: list[float] = []
    params = dict(
        thread_min_bytes=float("inf"),
        announce_ttl=600.0,
        request_timeout=30.0,
        max_concurrent_uploads=max_uploads,
        **extra,
    )
    async with trio.open_nursery() as nursery:
        nodes: list[Any] = []
        first: list[Any] = []

        async def run_node(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            transport = CappedTransport(net.transport(), rate)
            async with DHTNode.open(
                identity=Identity.generate(),
                transport=transport,
                host_maddrs=["/memory/0"],
                initial_peers=list(first),
                max_signatures_on_loop=10**6,
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

        for _ in range(donors + joiners):
            node = await nursery.start(run_node)
            nodes.append(node)
            if not first:
                first.append(node.get_visible_maddrs()[0])
        stores = [_ChunkDict(chunks) for _ in range(donors)]
        stores += [_ChunkDict({}) for _ in range(joiners)]
        sharings = [
            StateSharing(n, "bench", st, **params) for n, st in zip(nodes, stores, strict=True)
        ]
        for sharing in sharings:
            nursery.start_soon(sharing.run)
        for sharing in sharings[:donors]:
            sharing.publish(manifest)
        await trio.sleep(5.0)

        async def join(sharing: StateSharing) -> None:
            start = trio.current_time()
            result = await sharing.download(schema, timeout=3600.0, sink=sharing.store)
            times.append(trio.current_time() - start)
            assert result.manifest.root == manifest.root and not result.misbehaving
            # as TrainingStateAverager.load_state_from_peers does: serve the adopted state
            sharing.publish(result.manifest)

        async with trio.open_nursery() as joining:
            for sharing in sharings[donors:]:
                joining.start_soon(join, sharing)
        nursery.cancel_scope.cancel()
    served["donors"] = sum(x.stats["bytes_served"] for x in sharings[:donors]) / (1 << 20)
    served["joiners"] = sum(x.stats["bytes_served"] for x in sharings[donors:]) / (1 << 20)
    served["busy"] = sum(x.stats["busy"] for x in sharings)
    return sorted(times)


def bench_download_memory(args: argparse.Namespace) -> None:
    from dht.kademlia.clock import dht_clock, trio_clock
    from moshpit.training.manifest import build_manifest

    named = download_state(args.download_mib)
    manifest, views = build_manifest(named, 1, chunk_bytes=args.chunk_kib << 10)
    chunks = {d: bytes(v) for d, v in views.items()}
    rate = args.uplink_mib * (1 << 20)
    results: dict[tuple[int, int], list[float]] = {}
    for donors, joiners in ((1, 1), (4, 1), (4, 8)):
        wall = time.perf_counter()
        served: dict[str, float] = {}
        with dht_clock(trio_clock):
            times = trio.run(
                _memory_run,
                named,
                chunks,
                manifest,
                donors,
                joiners,
                rate,
                served,
                args.max_uploads,
                json.loads(args.sharing_params),
                clock=trio.testing.MockClock(autojump_threshold=0),
            )
        results[(donors, joiners)] = times
        print(
            json.dumps(
                {
                    "bench": "download-memory",
                    "mib": args.download_mib,
                    "uplink_mib_s": args.uplink_mib,
                    "donors": donors,
                    "joiners": joiners,
                    "chunk_kib": args.chunk_kib,
                    "max_concurrent_uploads": args.max_uploads,
                    "virtual_seconds": [round(t, 2) for t in times],
                    "ideal_seconds_one_joiner": round(manifest.total_bytes / (rate * donors), 2),
                    "mib_served_by_donors": round(served["donors"], 1),
                    "mib_served_by_joiners": round(served["joiners"], 1),
                    "busy_answers": served["busy"],
                    "wall_seconds": round(time.perf_counter() - wall, 1),
                }
            ),
            flush=True,
        )
    one, four = results[(1, 1)][0], results[(4, 1)][0]
    last8 = results[(4, 8)][-1]
    print(
        json.dumps(
            {
                "bench": "download-memory-summary",
                "speedup_4_donors_vs_1": round(one / four, 2),
                "target_speedup": ">= 3",
                "last_of_8_joiners_vs_single": round(last8 / four, 2),
                "target_last_of_8": "<= 3",
            }
        ),
        flush=True,
    )


def _raw_tcp_sender(port: int, nbytes: int) -> None:
    """Child process: connect to ``port`` and send ``nbytes`` (1 MiB writes)."""
    import socket

    block = os.urandom(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        left = nbytes
        while left:
            n = min(left, len(block))
            sock.sendall(block[:n])
            left -= n


def _raw_tcp_seconds(nbytes: int) -> float:
    """Copy ``nbytes`` from a child process over loopback TCP into one buffer, as a joiner
    would (received into memory); seconds from the connect to the last byte."""
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, __file__, "--raw-send", str(port), str(nbytes)],
        )
        conn, _ = server.accept()
        start = time.perf_counter()
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        got = 0
        with conn:
            while got < nbytes:
                n = conn.recv_into(view[got:], min(1 << 20, nbytes - got))
                if not n:
                    raise RuntimeError("raw TCP sender stopped early")
                got += n
        seconds = time.perf_counter() - start
        child.wait()
    return seconds


def bench_download_loopback(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    from dht import DHT
    from moshpit.training.sharing import StateSharing

    helper = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "training", "sharing_donor.py"
    )
    mib = args.download_mib
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    procs = []
    try:
        bootstrap = str(dht.get_visible_maddrs()[0])
        for _ in range(args.loopback_donors):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    helper,
                    "--initial-peer",
                    bootstrap,
                    "--seed",
                    "3",
                    "--mib",
                    str(mib),
                    "--prefix",
                    "bench",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            info = json.loads(proc.stdout.readline())

        async def create(_dht: Any, node: Any) -> StateSharing:
            return StateSharing(node, "bench", None, announce_ttl=600.0)

        sharing = dht.run_coroutine(create)

        async def find(_dht: Any, _node: Any) -> Any:
            return await sharing.find_states()

        for _ in range(50):
            states = dht.run_coroutine(find)
            if states and len(states[0].donors) == args.loopback_donors:
                break
            time.sleep(0.2)
        assert states[0].root.hex() == info["root"], "donors did not announce in time"
        nbytes = states[0].bytes

        # the joiner knows its own model: the same tensors as the donors' (their values differ
        # in a real run; here they are equal so the expected root is known)
        sys.path.insert(0, os.path.dirname(helper))
        from sharing_donor import make_state

        from moshpit.training.manifest import build_manifest

        expected, _ = build_manifest(make_state(3, mib), 1)
        schema = expected.schema()
        assert expected.root == states[0].root

        async def download(_dht: Any, _node: Any) -> Any:
            return await sharing.download(schema, timeout=600.0)

        for repeat in range(args.repeats):
            raw = _raw_tcp_seconds(nbytes)
            start = time.perf_counter()
            result = dht.run_coroutine(download)
            ours = time.perf_counter() - start
            assert result.manifest.root == states[0].root
            del result
            print(
                json.dumps(
                    {
                        "bench": "download-loopback",
                        "repeat": repeat,
                        "mib": round(nbytes / (1 << 20), 1),
                        "donors": args.loopback_donors,
                        "seconds": round(ours, 3),
                        "mb_s": round(nbytes / ours / 1e6, 1),
                        "raw_tcp_seconds": round(raw, 3),
                        "raw_tcp_mb_s": round(nbytes / raw / 1e6, 1),
                        "throughput_vs_raw_tcp": round(raw / ours, 3),
                        "target": ">= 0.5",
                    }
                ),
                flush=True,
            )
    finally:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        dht.shutdown()


def bench_download(args: argparse.Namespace) -> None:
    parts = args.download_parts.split(",")
    if "memory" in parts:
        bench_download_memory(args)
    if "loopback" in parts:
        bench_download_loopback(args)


def bench_background(args: argparse.Namespace) -> None:
    """Training step rate with and without background rounds (``bench_background.py``)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_background.py")
    subprocess.run(
        [sys.executable, script, "--params", str(args.background_params),
         "--phases", str(args.repeats)],
        check=True,
    )  # fmt: skip


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "checkpoint": bench_checkpoint,
    "download": bench_download,
    "background": bench_background,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run one section")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dirs", default="/tmp", help="comma-separated directories to write in")
    parser.add_argument("--cases", default="large,small", help="checkpoint cases: large,small")
    parser.add_argument("--download-mib", type=int, default=256, help="download: state size")
    parser.add_argument(
        "--download-parts", default="memory,loopback", help="download: memory,loopback"
    )
    parser.add_argument("--uplink-mib", type=float, default=4.0, help="memory: upload cap/peer")
    parser.add_argument("--loopback-donors", type=int, default=1)
    parser.add_argument("--chunk-kib", type=int, default=1024, help="memory: manifest chunks")
    parser.add_argument("--max-uploads", type=int, default=8, help="memory: per peer")
    parser.add_argument("--sharing-params", default="{}", help="memory: StateSharing kwargs")
    parser.add_argument(
        "--background-params", type=int, default=4_000_000, help="background: model size"
    )
    parser.add_argument("--raw-send", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_send:
        _raw_tcp_sender(*args.raw_send)
        return
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            section(args)


if __name__ == "__main__":
    main()
