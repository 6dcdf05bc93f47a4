"""A ``moshpit train`` volunteer behind a real NAT, started like any other volunteer (no NAT
flag), end to end in the NAT test bed (``benchmarks/nat_testbed.py``).

The "Internet": three ``moshpit dht`` peers (bootstrap nodes: AutoNAT servers and relays, no
state of their own) and one public ``moshpit train`` peer P. The volunteer V sits behind an
endpoint-independent NAT and joins through the first bootstrap node. It must find out that
it is private (the reachability line), reserve a relay slot, train and average with P. Then P
leaves (SIGTERM: it withdraws its state announcement and exits), so that V is the only peer
in the swarm that serves the run's state, and a newcomer N behind a second NAT joins: it must
load that state, which can only come from V (through a relay, or a hole-punched connection).
Finally V gets SIGTERM: it leaves cleanly and exits 0.

Needs root, ``ip`` and ``nft`` (skips saying which is missing, ``pytest -rs``). Every wait has
a timeout; on failure the output of every process is printed.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.timing import patience

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from nat_testbed import NatTestbed, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.slow

_REASON = unavailable_reason()
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "PYTHONUNBUFFERED": "1",
}
PORT = 4001


class Proc:
    """A process in a namespace: stdout lines as events (JSON objects, or ``{"event":
    "text", "line": ...}``), stderr kept for the failure report."""

    def __init__(self, tb: NatTestbed, host: str, name: str, argv: list[str], cwd: Path):
        self.name = f"{name}@{host}"
        self.proc = tb.popen(
            host,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=cwd,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.stdout.append(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                event = {"event": "text", "line": line.rstrip("\n")}
            self.events.put(event)

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr.append(line)

    def wait_for(
        self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """The first event (seen before or arriving within ``timeout``, stretched by the
        machine's load: see tests/timing.py) that matches."""
        for event in self.seen:
            if predicate(event):
                return event
        timeout = patience(timeout)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                event = self.events.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {what} within {timeout:.0f}s (exit code {self.proc.poll()})"
                ) from None
            self.seen.append(event)
            if predicate(event):
                return event

    def drain(self) -> list[dict[str, Any]]:
        """Every event so far (arrived events are moved into ``seen``)."""
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                return self.seen

    def text(self, prefix: str, timeout: float) -> str:
        event = self.wait_for(
            f"line {prefix!r}",
            lambda e: e["event"] == "text" and e["line"].startswith(prefix),
            timeout,
        )
        return event["line"]

    def log(self) -> str:
        return "".join(self.stderr)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then the exit code (SIGKILL and an error if it does not exit in time).

        The time stretches with the machine's load, past the peer's own 25-s watchdog when
        it is busy: a peer that hangs on its way out then exits with the watchdog's status
        and a dump of its threads, instead of being killed without one (a loaded replica:
        P logged "left the swarm cleanly; exiting" 1.4 s after SIGTERM and was still there
        at 20 s; most likely Python's teardown of torch's modules, 4-5.5 s under load, which
        a moshpit process now skips: moshpit/cli/process_exit.py)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        timeout = patience(timeout)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"{self.name} did not exit within {timeout:.0f}s of SIGTERM"
            ) from None

    def report(self) -> str:
        return (
            f"===== {self.name} (exit code {self.proc.poll()}) =====\n"
            f"--- stdout ---\n{''.join(self.stdout)[-6000:]}"
            f"--- stderr ---\n{''.join(self.stderr)[-10000:]}"
        )


def _dht(tb: NatTestbed, host: str, tmp: Path, *initial: str) -> Proc:
    argv = [sys.executable, "-m", "moshpit", "dht", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}"]
    if initial:
        argv += ["--initial-peers", *initial]
    return Proc(tb, host, "dht", argv, tmp)


def _train(tb: NatTestbed, host: str, name: str, tmp: Path, boot: str) -> Proc:
    """``moshpit train`` as a volunteer runs it: its initial peer and where to keep its
    files; cheap settings (one thread, a capped pace), nothing about NATs."""
    argv = [
        sys.executable, "-m", "moshpit", "-v", "train", "--json",
        "--initial-peers", boot,
        "--identity", str(tmp / f"{name}.key"),
        "--checkpoint-dir", str(tmp / name),
        "--threads", "1",
        "--max-rate", "800",
        "--report-every", "0.3",
        "--seed", str(len(name)),
    ]  # fmt: skip
    return Proc(tb, host, name, argv, tmp)


def _progress(min_epoch: int, peers: int | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda e: (
        e["event"] == "progress"
        and e["epoch"] >= min_epoch
        and (peers is None or e["peers"] == peers)
    )


def _private_with_relay(e: dict[str, Any]) -> bool:
    """A reachability event: private, with a relay slot reserved."""
    return e["event"] == "reachability" and e["status"] == "private" and bool(e["relay_addrs"])


@pytest.mark.skipif(_REASON is not None, reason=f"NAT test bed unavailable: {_REASON}")
def test_volunteer_behind_nat_trains_serves_its_state_to_a_newcomer_and_leaves(tmp_path: Path):
    procs: list[Proc] = []
    started = time.monotonic()
    # "reject": a dial-back to a NAT'ed peer fails at once (a router that drops would make
    # AutoNAT wait out its 15 s dial timeout); hole punching is not needed here
    with NatTestbed(public_hosts=4, nats=("eim", "eim"), inbound="reject") as tb:
        try:
            # -- the Internet: three bootstrap nodes, one public trainer -----------------------
            first = _dht(tb, "pub0", tmp_path)
            procs.append(first)
            line = first.text("--initial-peers ", timeout=20)
            boot = next(a for a in line.split()[1:] if f"/ip4/{tb.addr('pub0')}/" in a)
            procs += [_dht(tb, host, tmp_path, boot) for host in ("pub1", "pub2")]
            public = _train(tb, "pub3", "P", tmp_path, boot)
            procs.append(public)
            # -- the volunteer behind a NAT, no NAT-related flag ---------------------------------
            vol = _train(tb, "home0", "V", tmp_path, boot)
            procs.append(vol)
            joined = vol.wait_for("joined", lambda e: e["event"] == "joined", timeout=40)
            # AutoNAT: three peers could not dial it back -> private, then a relay slot
            reach = vol.wait_for(
                "private verdict with a relay slot",
                _private_with_relay,
                timeout=40,
            )
            assert not reach["client_mode"], reach
            assert "could not dial this peer back" in reach["line"], reach
            public_net = tb.addr("pub0").rsplit(".", 1)[0]  # the relays are public peers
            assert f"reachable via relay /ip4/{public_net}." in reach["line"], reach
            assert reach["line"].endswith("acting as a DHT server reached through the relay")
            assert all("/p2p-circuit/p2p/" + joined["peer"] in a for a in reach["relay_addrs"])
            for other in procs[:3] + [public]:  # the bootstrap nodes and P found they are public
                if other is public:
                    verdict = public.wait_for(
                        "public verdict",
                        lambda e: e["event"] == "reachability" and e["status"] == "public",
                        timeout=30,
                    )
                    assert verdict["serving_relay"], verdict
                else:
                    assert "serving as a relay" in other.text("Reachability: public", timeout=30)
            # -- it trains, averaging with P (epoch = completed averaging rounds) ----------------
            progress = vol.wait_for("averaging rounds with P", _progress(2, peers=2), timeout=40)
            assert progress["samples"] > 0
            public.wait_for("P averaging", _progress(2), timeout=20)
            # -- P leaves: V is now the only peer serving the run's state ------------------------
            assert public.stop() == 0, "P did not exit 0"
            public.wait_for("P's preempted event", lambda e: e["event"] == "preempted", 1)
            assert "left the swarm in" in public.log()  # its state announcement withdrawn
            vol.wait_for("V's progress", _progress(2), timeout=5)
            # if P held one of V's relay slots, V moves it to another public peer (and says
            # so) before a newcomer could reach it through P's dead address
            p_prefix = f"/ip4/{tb.addr('pub3')}/"
            deadline = time.monotonic() + 40
            while True:
                slots = [e for e in vol.drain() if e["event"] == "reachability"][-1]["relay_addrs"]
                if slots and not any(a.startswith(p_prefix) for a in slots):
                    break
                assert time.monotonic() < deadline, f"V kept its relay slot on P: {slots}"
                time.sleep(0.2)
            served = max(e["epoch"] for e in vol.drain() if e["event"] == "progress")
            # -- a newcomer behind another NAT loads the state from V ----------------------------
            new = _train(tb, "home1", "N", tmp_path, boot)
            procs.append(new)
            new_peer = new.wait_for("joined", lambda e: e["event"] == "joined", timeout=40)
            assert (
                new.wait_for("started", lambda e: e["event"] == "started", 20)["restored_epoch"]
                == 0
            )  # nothing on its disk: whatever epoch it gets comes from the swarm
            loaded = new.wait_for("progress", _progress(0), timeout=30)
            # the download, as N logged it: every verified byte came from V, the only donor
            log = new.log()
            short = joined["peer"][-6:]  # PeerID.short(), as the logs print it
            verified = re.findall(r"state of epoch (\d+) verified: (.*)$", log, re.MULTILINE)
            assert len(verified) == 1, log[-3000:]
            assert loaded["epoch"] >= int(verified[0][0]) >= served >= 2, (verified, served)
            assert re.fullmatch(rf"\d+ bytes from {short}", verified[0][1]), verified
            assert f"loaded the state of epoch {verified[0][0]} from 1 donor(s)" in log
            assert new_peer["peer"] != joined["peer"]
            # -- V leaves cleanly on SIGTERM -----------------------------------------------------
            assert vol.stop() == 0, "V did not exit 0"
            left = vol.wait_for("V's preempted event", lambda e: e["event"] == "preempted", 1)
            assert left["epoch"] >= served
            assert "left the swarm in" in vol.log()
            assert "Traceback" not in vol.log()
            for proc in procs:
                if proc.proc.poll() is None:
                    assert proc.stop() == 0, f"{proc.name} did not exit 0"
        except BaseException:
            for proc in procs:
                if proc.proc.poll() is None:
                    proc.proc.kill()
            for proc in procs:
                try:
                    proc.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                print(proc.report(), file=sys.stderr)
            raise
    assert time.monotonic() - started < patience(90)  # no wait ran out its full timeout
