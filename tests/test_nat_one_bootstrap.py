"""The swarm people actually start, end to end in the NAT test bed: ONE public peer running
``moshpit dht`` (on an address that looks globally routable, no flag but its port) and
volunteers at home, each behind its own NAT, with default settings and nothing about NATs.

A young swarm like this has a single AutoNAT server, so the volunteers must decide they are
private on the evidence one server gives, reserve a slot on the bootstrap (which must relay
from the start), and average through it; where both NATs keep ports (``eim``), hole punching
must take the averaging bytes off the bootstrap. Each volunteer is a ``moshpit.Averager
(target_group_size=2)`` (benchmarks/bench_nat.py's ``volunteer`` program) whose values make
every group's mean an exact float32 value; one test runs ``moshpit train`` instead.

Needs root, ``ip`` and ``nft`` (skips saying which is missing, ``pytest -rs``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.timing import patience

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_nat import one_bootstrap  # noqa: E402
from nat_testbed import GLOBAL_SUBNET, NatTestbed, unavailable_reason  # noqa: E402

from tests.test_nat_volunteer import (  # noqa: E402
    Proc,
    _dht,
    _private_with_relay,
    _progress,
    _train,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        unavailable_reason() is not None,
        reason=f"NAT test bed unavailable: {unavailable_reason()}",
    ),
]

FIRST_ROUND_S = 60.0  # the target, from the start of the bootstrap node
MAX_RELAYED_SHARE = 0.10  # with port-preserving NATs: of the bytes the volunteers averaged


@pytest.mark.parametrize(
    ("volunteers", "nat", "numel"),
    [
        # 64 KiB per peer and round: more than a spec-sized relay (128 KiB per connection)
        # lets a relayed peer reduce, so the bootstrap's circuits must be sized for
        # averaging; and with eim NATs the share measures the averaging bytes, not the few kB
        # a new pair spends on its relayed connection and the punch
        (2, "eim", 16384),
        (4, "eim", 16384),
        # symmetric: every byte crosses the relay (two volunteers: the moshpit train test)
        (4, "symmetric", 16384),
    ],
)
def test_one_bootstrap_and_volunteers_behind_nats_average_the_exact_mean(
    volunteers: int, nat: str, numel: int
):
    result = one_bootstrap(volunteers, nat, group=2, numel=numel, rounds=3, timeout=patience(90))
    summary = {k: v for k, v in result.items() if k != "roles"}
    # every volunteer found it is private with one server, and holds a slot on the bootstrap
    for line in result["roles"].values():
        assert line is not None and line.startswith("Reachability: private"), result["roles"]
        assert f"reachable via relay /ip4/{GLOBAL_SUBNET}.1/" in line, line
    # every good round averaged exactly its group's values, groups of the target size
    assert result["inexact_rounds"] == 0, summary
    assert result["group_sizes"] == [2], summary
    assert result["first_averaged_round_s"] <= patience(FIRST_ROUND_S), summary
    averaged = result["averaging_bytes"]
    relayed = result["relayed_bytes_while_averaging"]
    assert averaged >= volunteers * 2 * numel * 4, summary  # each sent at least its share
    if nat == "eim":
        # hole punching carried the averaging: direct connections, the bootstrap out of it
        assert result["paths"] == ["hole-punched"], summary
        # a pair's first round may begin over the relay while its punch is under way (one
        # run of four: 28% of that round's bytes); the rounds after it must not use it
        later = result["averaging_bytes_after_first_round"]
        assert later >= volunteers * 2 * numel * 4, summary
        assert result["relayed_bytes_after_first_round"] < MAX_RELAYED_SHARE * later, summary
    else:
        # no way to punch a symmetric NAT: the bootstrap relays every averaging byte
        assert result["paths"] == ["relayed"], summary
        assert relayed >= averaged, summary


def test_moshpit_train_volunteers_behind_nats_with_one_bootstrap(tmp_path: Path):
    """Two ``moshpit train`` volunteers, one behind each NAT kind (so they reach each other
    through the relay), and one bootstrap: they average rounds together within a minute."""
    procs: list[Proc] = []
    started = time.monotonic()
    with NatTestbed(
        public_hosts=1, nats=("eim", "symmetric"), inbound="drop", public_subnet=GLOBAL_SUBNET
    ) as tb:
        try:
            boot_proc = _dht(tb, "pub0", tmp_path)
            procs.append(boot_proc)
            line = boot_proc.text("--initial-peers ", timeout=20)
            boot = next(a for a in line.split()[1:] if f"/ip4/{tb.addr('pub0')}/" in a)
            vols = [_train(tb, f"home{i}", f"V{i}", tmp_path, boot) for i in range(2)]
            procs += vols
            for vol in vols:
                reach = vol.wait_for(
                    "private verdict with a relay slot",
                    _private_with_relay,
                    timeout=FIRST_ROUND_S,
                )
                assert f"reachable via relay /ip4/{GLOBAL_SUBNET}.1/" in reach["line"], reach
            for vol in vols:  # epoch = completed averaging rounds, here with each other
                vol.wait_for("an averaged round with the other volunteer", _progress(1, 2), 60)
            assert time.monotonic() - started <= patience(FIRST_ROUND_S)
            assert "serving as a relay" in boot_proc.text("Reachability: public", timeout=1)
            for proc in reversed(procs):
                assert proc.stop() == 0, f"{proc.name} did not exit 0"
        except BaseException:
            for proc in procs:
                if proc.proc.poll() is None:
                    proc.proc.kill()
            for proc in procs:
                print(proc.report(), file=sys.stderr)
            raise
