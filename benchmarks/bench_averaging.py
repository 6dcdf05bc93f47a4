"""Averaging benchmark: Averager.step() across peer processes on loopback vs torch.distributed gloo.

For each peer count P, P worker processes are started once (each: a ``moshpit.DHT`` joined
through a bootstrap peer in this process, plus a gloo process group for the baseline). For
each tensor size and codec the parent starts every round at once (all peers call ``step()``
together) and collects, per round, the slowest peer's step / matchmaking / all-reduce time.
One JSON object per line:

- ``{"kind": "gloo", ...}``: ``torch.distributed.all_reduce`` (gloo, SUM, unencrypted) of the
  same size with the same processes, median of repeats: the baseline.
- ``{"kind": "bare_python", ...}``: the floor of any all-reduce written in Python with our
  encryption: ``bare_allreduce.py``'s butterfly (AES-256-GCM in Noise-sized frames over plain
  TCP, threads and blocking sockets, nothing else) in the same processes, timed as gloo is;
  ``vs_gloo`` is what encryption and Python's per-frame work cost before any protocol.
  Averaging rows add ``allreduce_vs_bare_python`` and ``step_cpu_vs_bare_python_cpu``.
- one warm-up ``step()`` per configuration is not counted (first-use allocations, dials).
- ``{"kind": "averaging", ...}``: medians over rounds, ``allreduce_vs_gloo`` (ratio),
  ``matchmaking_s`` (slowest peer: includes the skew between peers' step() calls) and
  ``matchmaking_last_peer_s`` (the last peer to arrive: the pure matchmaking overhead),
  ``bytes_sent_per_peer`` (tensor payload bytes, mean over peers), ``peak_extra_mem_bytes``
  (max over peers of VmHWM - VmRSS measured around the rounds, /proc peak reset before) and its
  ratio to the tensor bytes. Our all-reduce always runs over Noise-encrypted connections.
- CPU seconds per peer (``time.process_time``, all threads of the worker): ``step_cpu_s_per_peer``
  (median over rounds of the mean over peers, whole ``step()``) and the gloo all-reduce's
  (``gloo_cpu_s_per_peer``): less sensitive than wall time to other load on a shared machine.
- ``step_sys_cpu_s_per_peer`` / ``gloo_sys_cpu_s_per_peer``: the kernel's share of those
  (``os.times().system``: socket copies and syscalls), which no Python-side work removes.
- ``cipher_floor_cpu_s_per_peer``: payload bytes sent x AES-256-GCM seal cost + bytes received x
  open cost, both measured in the same run (``{"kind": "cipher"}`` line): what encryption
  alone must cost; ``step_cpu_vs_cipher_floor`` is how far above it the whole step is.
- workers run with ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads(1)``), gloo included.

    python benchmarks/bench_averaging.py --quick      # 4 peers, 1M floats, 2 codecs
    python benchmarks/bench_averaging.py              # 4 and 8 peers, 1M and 16M, 4 codecs
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODECS = ("none", "float16", "uint8", "topk")


# ---------------------------------------------------------------------------------------------
# worker


def _mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _codec(name: str):
    import compression

    return {
        "none": None,
        "float16": compression.Float16(),
        "uint8": compression.Uniform8Bit(),
        "topk": compression.TopK(density=0.01),
    }[name]


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", default=None, help="maddr to join; none: be the first peer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--gloo-port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (DHT, averaging)")
    p.add_argument("--gloo-addr", default="127.0.0.1", help="address of rank 0's gloo store")
    args = p.parse_args(argv)
    # P processes share the machine's cores: one OpenMP thread per torch op in every thread
    # (torch.set_num_threads alone does not reach the DHT's trio thread, where the all-reduce
    # runs small reductions inline; oversubscribed OpenMP teams made rounds ~6x slower)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    from bare_allreduce import Mesh

    from dht import DHT
    from moshpit.averaging.averager import Averager

    torch.set_num_threads(1)

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    dht = DHT(
        initial_peers=[args.bootstrap] if args.bootstrap else [],
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        startup_timeout=120,
    )
    # the first peer of a namespace testbed is also the others' bootstrap peer
    emit({"event": "dht", "maddr": str(dht.get_visible_maddrs()[0])})
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.gloo_addr}:{args.gloo_port}",
        rank=args.rank,
        world_size=args.world,
    )
    mesh = Mesh(args.rank, host=args.host)
    emit({"event": "ready", "bare_addr": [args.host, mesh.port]})
    averager = None
    tensor = None

    def timed(all_reduce, numel: int, reps: int) -> dict[str, float]:
        """Median wall, CPU and kernel CPU of ``all_reduce`` on one tensor, after a warm-up."""
        t = torch.randn(numel)
        all_reduce(t)
        times, cpu, sys_cpu = [], [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            c0, s0 = time.process_time(), os.times().system
            all_reduce(t)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            sys_cpu.append(os.times().system - s0)
        return {
            "seconds": statistics.median(times),
            "cpu_s": statistics.median(cpu),
            "sys_s": statistics.median(sys_cpu),
        }

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "gloo":
            emit({"event": "gloo", **timed(dist.all_reduce, cmd["numel"], cmd["reps"])})
        elif cmd["cmd"] == "bare":
            if not mesh.links:
                mesh.connect([tuple(a) for a in cmd["addrs"]], bytes.fromhex(cmd["key"]))
            emit({"event": "bare", **timed(mesh.allreduce, cmd["numel"], cmd["reps"])})
        elif cmd["cmd"] == "setup":
            tensor = torch.randn(cmd["numel"])
            averager = Averager(
                [tensor],
                dht,
                prefix=cmd["prefix"],
                target_group_size=args.world,
                min_group_size=args.world,
                min_matchmaking_time=30.0,
                request_timeout=10.0,
                allreduce_timeout=600.0,
                matchmaking_timeout=60.0,
                compression=_codec(cmd["codec"]),
                bandwidth=cmd.get("bandwidth"),  # set: the round paces its connections to it
                initial_group_bits="",
            )
            emit({"event": "setup"})
        elif cmd["cmd"] == "step":
            before = _mem()
            peak_ok = _reset_peak()
            t0 = time.perf_counter()
            c0, s0 = time.process_time(), os.times().system
            res = averager.step()
            step_s = time.perf_counter() - t0
            cpu_s = time.process_time() - c0
            sys_s = os.times().system - s0
            after = _mem()
            emit(
                {
                    "event": "step",
                    "ok": res.succeeded and not res.failed,
                    "group": res.group_size,
                    "step_s": step_s,
                    "cpu_s": cpu_s,
                    "sys_s": sys_s,
                    "matchmaking_s": res.matchmaking_seconds,
                    "allreduce_s": res.allreduce_seconds,
                    "bytes_sent": res.bytes_sent,
                    "bytes_received": res.bytes_received,
                    "peak_extra": after["VmHWM"] - before["VmRSS"] if peak_ok else None,
                }
            )
        elif cmd["cmd"] == "teardown":
            averager.shutdown()
            averager = tensor = None
            emit({"event": "teardown"})
        elif cmd["cmd"] == "exit":
            break
    mesh.close()
    dist.destroy_process_group()
    dht.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# parent


def worker_env(**extra: str) -> dict[str, str]:
    """Environment for worker processes: the checkout on PYTHONPATH, one OpenMP thread."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


class Proc:
    def __init__(self, cmd: list[str], popen=subprocess.Popen, **env: str):
        """``popen`` lets a caller start the worker elsewhere (e.g. in a network namespace)."""
        self.p = popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=worker_env(**env)
        )

    def send(self, obj: dict) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, event: str) -> dict:
        for line in self.p.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("event") == event:
                if event == "ready":
                    self.ready = obj
                return obj
        raise RuntimeError(f"worker exited while waiting for {event!r} (rc={self.p.wait()})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all(procs: list[Proc], cmd: dict, event: str) -> list[dict]:
    for p in procs:
        p.send(cmd)
    out: list[dict | None] = [None] * len(procs)

    def get(i: int) -> None:
        out[i] = procs[i].recv(event)

    threads = [threading.Thread(target=get, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def run_peers(
    num_peers: int, sizes: list[int], codecs: list[str], rounds: int, gloo_reps: int
) -> None:
    from dht import DHT

    bootstrap = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(bootstrap.get_visible_maddrs()[0])
    port = _free_port()
    procs = [
        Proc([sys.executable, __file__, "--worker", "--bootstrap", maddr, "--rank", str(r),
              "--world", str(num_peers), "--gloo-port", str(port)])
        for r in range(num_peers)
    ]  # fmt: skip
    try:
        for p in procs:
            p.recv("ready")
        run_configs(procs, num_peers, sizes, codecs, rounds, gloo_reps)
        for p in procs:
            p.send({"cmd": "exit"})
        for p in procs:
            p.p.wait(timeout=60)
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait()
        bootstrap.shutdown()


def cipher_cost_per_byte(total: int = 64 << 20) -> dict[str, float]:
    """CPU seconds per byte to seal and to open 64 KiB Noise frames with AES-256-GCM here.

    The floor under our all-reduce's CPU: every payload byte is encrypted once by its sender
    and decrypted once by its receiver (measured in the same run as the benchmark, on the same
    loaded machine, so the comparison is fair).
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    frame = 65535 - 16
    aead = AESGCM(os.urandom(32))
    plain = bytearray(os.urandom(frame))
    sealed = bytearray(frame + 16)
    opened = bytearray(frame)
    nonce = bytes(12)
    reps = max(1, total // frame)
    into = hasattr(aead, "encrypt_into")
    c0 = time.process_time()
    for _ in range(reps):
        if into:
            aead.encrypt_into(nonce, plain, None, sealed)
        else:
            sealed[:] = aead.encrypt(nonce, bytes(plain), None)
    c1 = time.process_time()
    for _ in range(reps):
        if into:
            aead.decrypt_into(nonce, sealed, None, opened)
        else:
            opened[:] = aead.decrypt(nonce, bytes(sealed), None)
    c2 = time.process_time()
    return {"seal": (c1 - c0) / (reps * frame), "open": (c2 - c1) / (reps * frame)}


def run_bare(procs: list[Proc], numel: int, reps: int) -> dict[str, float]:
    """The floor: the same tensor summed by ``bare_allreduce.Mesh`` in the same processes.

    Summarized as gloo's rows are: the median over peers of wall seconds, the mean of CPU.
    """
    addrs = [p.ready["bare_addr"] for p in procs]
    cmd = {"cmd": "bare", "numel": numel, "reps": reps, "addrs": addrs, "key": os.urandom(32).hex()}
    got = _all(procs, cmd, "bare")
    return {
        "seconds": statistics.median(r["seconds"] for r in got),
        "cpu_s": statistics.mean(r["cpu_s"] for r in got),
        "sys_s": statistics.mean(r["sys_s"] for r in got),
    }


def run_configs(
    procs: list[Proc],
    num_peers: int,
    sizes: list[int],
    codecs: list[str],
    rounds: int,
    gloo_reps: int,
    extra: dict | None = None,
    uplink_rate: float | None = None,
) -> list[dict]:
    """gloo baseline then every codec on each size; prints and returns the JSON rows.

    ``extra`` is merged into every row (e.g. the link rate of a WAN testbed run). With
    ``uplink_rate`` (bytes/s) every codec also runs with each peer's ``bandwidth`` set to it,
    which paces the round's connections (rows with ``"paced": true``).
    """
    extra = extra or {}
    rows: list[dict] = []
    cipher = cipher_cost_per_byte()
    print(json.dumps({"kind": "cipher", "aesgcm_seal_s_per_gb": round(cipher["seal"] * 1e9, 3),
                      "aesgcm_open_s_per_gb": round(cipher["open"] * 1e9, 3), **extra}),
          flush=True)  # fmt: skip
    for numel in sizes:
        gloo_rows = _all(procs, {"cmd": "gloo", "numel": numel, "reps": gloo_reps}, "gloo")
        gloo = statistics.median(r["seconds"] for r in gloo_rows)
        gloo_cpu = statistics.mean(r["cpu_s"] for r in gloo_rows)
        gloo_sys = statistics.mean(r["sys_s"] for r in gloo_rows)
        row = {"kind": "gloo", "peers": num_peers, "numel": numel, "seconds": gloo,
               "cpu_s_per_peer": round(gloo_cpu, 4), "sys_cpu_s_per_peer": round(gloo_sys, 4),
               **extra}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        bare = run_bare(procs, numel, gloo_reps)
        bare_row = {"kind": "bare_python", "peers": num_peers, "numel": numel,
                    "seconds": bare["seconds"], "vs_gloo": round(bare["seconds"] / gloo, 2),
                    "cpu_s_per_peer": round(bare["cpu_s"], 4),
                    "sys_cpu_s_per_peer": round(bare["sys_s"], 4), **extra}  # fmt: skip
        rows.append(bare_row)
        print(json.dumps(bare_row), flush=True)
        variants = [(c, None) for c in codecs]
        if uplink_rate is not None:
            variants = [(c, rate) for c in codecs for rate in (None, uplink_rate)]
        for codec, bandwidth in variants:
            prefix = f"bench-{num_peers}-{numel}-{codec}-{'paced' if bandwidth else 'tcp'}"
            setup = {"cmd": "setup", "numel": numel, "codec": codec, "prefix": prefix}
            _all(procs, {**setup, "bandwidth": bandwidth}, "setup")
            _all(procs, {"cmd": "step"}, "step")  # warm-up round (first-use allocations, dials)
            per_round = []
            for _ in range(rounds):
                per_round.append(_all(procs, {"cmd": "step"}, "step"))
            _all(procs, {"cmd": "teardown"}, "teardown")
            ok = all(s["ok"] and s["group"] == num_peers for rnd in per_round for s in rnd)
            step_s = statistics.median(max(s["step_s"] for s in rnd) for rnd in per_round)
            mm_s = statistics.median(max(s["matchmaking_s"] for s in rnd) for rnd in per_round)
            # the last peer to call step() waits only for the group to form: pure overhead
            mm_last_s = statistics.median(min(s["matchmaking_s"] for s in rnd) for rnd in per_round)
            ar_each = [round(max(s["allreduce_s"] for s in rnd), 3) for rnd in per_round]
            ar_s = statistics.median(max(s["allreduce_s"] for s in rnd) for rnd in per_round)
            cpu_s = statistics.median(statistics.mean(s["cpu_s"] for s in rnd) for rnd in per_round)
            sys_s = statistics.median(statistics.mean(s["sys_s"] for s in rnd) for rnd in per_round)
            sent = statistics.mean(s["bytes_sent"] for rnd in per_round for s in rnd)
            received = statistics.mean(s["bytes_received"] for rnd in per_round for s in rnd)
            # every payload byte sealed once by its sender and opened once by its receiver
            floor = sent * cipher["seal"] + received * cipher["open"]
            peaks = [
                s["peak_extra"] for rnd in per_round for s in rnd if s["peak_extra"] is not None
            ]
            peak = max(peaks) if peaks else None
            row = {
                "kind": "averaging",
                "peers": num_peers,
                "numel": numel,
                "codec": codec,
                "paced": bandwidth is not None,
                "rounds": rounds,
                "all_ok": ok,
                "step_s": round(step_s, 4),
                "matchmaking_s": round(mm_s, 4),
                "matchmaking_last_peer_s": round(mm_last_s, 4),
                "allreduce_s": round(ar_s, 4),
                "allreduce_s_per_round": ar_each,
                "step_cpu_s_per_peer": round(cpu_s, 4),
                "step_sys_cpu_s_per_peer": round(sys_s, 4),
                "gloo_cpu_s_per_peer": round(gloo_cpu, 4),
                "gloo_sys_cpu_s_per_peer": round(gloo_sys, 4),
                "cipher_floor_cpu_s_per_peer": round(floor, 4),
                "step_cpu_vs_cipher_floor": round(cpu_s / floor, 2) if floor > 0 else None,
                "step_cpu_vs_gloo_cpu": round(cpu_s / gloo_cpu, 2) if gloo_cpu > 0 else None,
                "gloo_s": round(gloo, 4),
                "allreduce_vs_gloo": round(ar_s / gloo, 2) if gloo > 0 else None,
                "bare_python_s": round(bare["seconds"], 4),
                "allreduce_vs_bare_python": round(ar_s / bare["seconds"], 2),
                "step_cpu_vs_bare_python_cpu": round(cpu_s / bare["cpu_s"], 2),
                "bytes_sent_per_peer": int(sent),
                "tensor_bytes": numel * 4,
                "peak_extra_mem_bytes": peak,
                "peak_extra_mem_vs_tensor": round(peak / (numel * 4), 2)
                if peak is not None
                else None,
                **extra,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 peers, 1M floats, none/float16")
    parser.add_argument("--peers", type=int, nargs="*", default=None)
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    parser.add_argument("--codecs", nargs="*", choices=CODECS, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        peers, sizes, codecs, rounds = [4], [1 << 20], ["none", "float16"], 2
    else:
        peers, sizes, codecs, rounds = [4, 8], [1 << 20, 1 << 24], list(CODECS), 3
    peers = args.peers or peers
    sizes = args.sizes or sizes
    codecs = args.codecs or codecs
    rounds = args.rounds or rounds
    sys.path.insert(0, str(ROOT))
    for n in peers:
        run_peers(n, sizes, codecs, rounds, gloo_reps=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
