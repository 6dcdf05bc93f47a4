"""State download from donor processes over loopback TCP (real DHT, Noise, yamux, SIGKILL).

Three donors (``tests/training/sharing_donor.py``) serve the same state; one is SIGKILLed
mid-download (once it has delivered chunks), one flips a byte in every chunk it serves.
Donors read chunks slowly (a slow disk) so the download lasts long enough to kill one. The joiner (this process) must end
with the one advertised state, bit for bit, and name the corrupt donor.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dht import DHT
from moshpit.training.manifest import build_manifest
from moshpit.training.sharing import StateSharing

sys.path.insert(0, str(Path(__file__).parent))
from sharing_donor import make_state  # noqa: E402

pytestmark = pytest.mark.slow

HELPER = Path(__file__).parent / "sharing_donor.py"
SEED, MIB = 7, 32.0


class CountingSink:
    """The joiner's chunk store: counts every verified chunk it is given."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, bytes] = {}
        self.puts = 0
        self.lock = threading.Lock()

    def has_chunk(self, digest: bytes) -> bool:
        return digest in self.chunks

    def read_chunk(self, digest: bytes) -> bytes | None:
        return self.chunks.get(digest)

    def put_chunk(self, digest: bytes, data: bytes) -> None:
        assert hashlib.sha256(data).digest() == digest
        with self.lock:
            self.puts += 1
            self.chunks[digest] = bytes(data)


def start_donor(bootstrap: str, *extra: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HELPER),
            "--initial-peer",
            bootstrap,
            "--seed",
            str(SEED),
            "--mib",
            str(MIB),
            "--chunk-mib",
            "0.5",
            *extra,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"donor did not start: {proc.stderr.read()[-3000:]}")
    return proc, json.loads(line)


def test_joiner_survives_a_killed_and_a_corrupt_donor():
    expected = make_state(SEED, MIB)
    manifest, _ = build_manifest(expected, 1, chunk_bytes=1 << 19)
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    procs: list[subprocess.Popen] = []
    try:
        bootstrap = str(dht.get_visible_maddrs()[0])

        async def create(_dht, node):
            return StateSharing(node, "run", None, request_timeout=5.0, ban_seconds=300.0)

        sharing = dht.run_coroutine(create)
        dht.start_service(sharing.run)
        good, good_info = start_donor(bootstrap, "--read-delay", "0.05")
        dying, dying_info = start_donor(bootstrap, "--read-delay", "0.05")
        corrupt, corrupt_info = start_donor(bootstrap, "--corrupt")
        procs = [good, dying, corrupt]
        assert {i["root"] for i in (good_info, dying_info, corrupt_info)} == {manifest.root.hex()}

        async def find(_dht, _node):
            return await sharing.find_states()

        for _ in range(100):
            states = dht.run_coroutine(find)
            if states and len(states[0].donors) == 3:
                break
        # exactly one state is advertised, by all three donors
        assert len(states) == 1 and states[0].root == manifest.root
        assert {p.to_base58() for p in states[0].donors} == {
            i["peer_id"] for i in (good_info, dying_info, corrupt_info)
        }

        sink = CountingSink()
        schema = [(s.name, s.dtype, s.shape) for s in manifest.tensors]

        async def download(_dht, _node):
            return await sharing.download(schema, timeout=120.0, sink=sink)

        async def progress(_dht, _node):
            return sharing.progress()

        future = dht.run_coroutine(download, return_future=True)
        dying_id = dying_info["peer_id"]
        while not future.done():
            got = {p.to_base58(): n for p, n in (dht.run_coroutine(progress) or {}).items()}
            if got.get(dying_id):  # it delivered chunks: now it loses power
                dying.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        assert got.get(dying_id) and sum(got.values()) < manifest.total_bytes, got
        result = future.result(timeout=120)
        assert dying.wait(timeout=10) == -signal.SIGKILL
        assert result.manifest.root == manifest.root
        by_name = {p.to_base58(): why for p, why in result.misbehaving.items()}
        assert list(by_name) == [corrupt_info["peer_id"]]
        assert "SHA-256 does not match" in by_name[corrupt_info["peer_id"]]
        assert corrupt_info["peer_id"] not in {p.to_base58() for p in result.donors_used}
        used = {p.to_base58() for p in result.donors_used}
        assert used == {good_info["peer_id"], dying_id}
        # every chunk verified and kept once: the dead donor's chunks were not fetched again
        assert sink.puts == len(manifest.chunk_refs()) == len(sink.chunks)
        for tensor, (name, want) in zip(result.tensors, expected, strict=True):
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), name
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dht.shutdown()
