"""One peer of the live swarm that tests/training/test_status_cli.py inspects with `moshpit status`.

Usage: python3 status_swarm_peer.py SPEC [SPEC ...] -- [INITIAL_PEER ...]

Each SPEC is ``prefix:epoch[:donor_epoch][:frozen][:nan]``: run a ProgressTracker under
``prefix`` reporting ``epoch`` with growing samples every 0.1 s and a loss of 0.5 (``frozen``:
report once, then only republish; ``nan``: report a NaN loss, as a diverged peer would), and,
with ``donor_epoch``, announce a complete state record under ``{prefix}.state`` as a donor
would. Prints ``MADDRS <addr> ...`` once ready; exits when stdin
closes.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time

import moshpit
from dht import get_dht_time
from moshpit.training.progress import ProgressTracker, owner_subkey

TTL = 30.0


def main() -> None:
    split = sys.argv.index("--")
    specs, initial_peers = sys.argv[1:split], sys.argv[split + 1 :]
    dht = moshpit.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    trackers: list[tuple[ProgressTracker, int, bool]] = []
    donors: list[tuple[str, int]] = []
    for spec in specs:
        prefix, epoch, *rest = spec.split(":")
        frozen = "frozen" in rest
        donor = [r for r in rest if r not in ("frozen", "nan")]
        tracker = ProgressTracker(dht, prefix, ttl=TTL, min_refresh_period=0.05)
        tracker.report_health(loss=0.5, finite="nan" not in rest)
        trackers.append((tracker, int(epoch), frozen))
        if donor:
            donors.append((prefix, int(donor[0])))

    def announce() -> None:
        for prefix, epoch in donors:
            root = hashlib.sha256(f"{prefix}/{epoch}".encode()).digest()
            value = {"root": root, "epoch": epoch, "bytes": 12345, "complete": True, "addrs": []}
            dht.store(
                f"{prefix}.state", value, get_dht_time() + TTL, subkey=owner_subkey(dht.peer_id)
            )

    announce()
    for tracker, epoch, _ in trackers:
        tracker.report(epoch, 0)
    print("MADDRS " + " ".join(str(m) for m in dht.get_visible_maddrs()), flush=True)

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    samples, last_announce = 0, time.monotonic()
    while not stop.wait(0.1):
        samples += 8
        for tracker, epoch, frozen in trackers:
            if not frozen:
                tracker.report(epoch, samples)
        if time.monotonic() - last_announce > TTL / 3:
            announce()
            last_announce = time.monotonic()
    for tracker, _, _ in trackers:
        tracker.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
