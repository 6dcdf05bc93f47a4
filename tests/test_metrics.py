"""Prometheus metrics (``moshpit.serve_metrics``, ``--metrics-port``), scraped over real HTTP
from real peers on loopback, parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import moshpit  # noqa: E402
import moshpit.metrics as metrics  # noqa: E402
from dht import DHT  # noqa: E402
from moshpit.averaging.averager import Averager, StepResult  # noqa: E402
from moshpit.training.state_averager import TrainingStateAverager  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
FAST = dict(
    min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)
# a libp2p PeerID as text (base58 multihash), an address, or a long hex string
PEER_ID_LIKE = re.compile(
    r"^(12D3Koo|Qm|16Uiu2)[1-9A-HJ-NP-Za-km-z]{20,}$|/ip[46]/|^[0-9a-f]{32,}$"
)
# every label a moshpit series may carry (python_info's come from prometheus_client)
ALLOWED_LABELS = {
    "outcome",
    "codec",
    "rpc",
    "kind",
    "signal",
    "version",
    "le",
    "implementation",
    "major",
    "minor",
    "patchlevel",
}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape over HTTP."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server():
    with moshpit.serve_metrics(0) as srv:
        yield srv


@pytest.fixture
def dhts():
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    made = [first]
    try:
        for _ in range(2):
            made.append(
                DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            )
        yield made
    finally:
        for dht in reversed(made):
            dht.shutdown()


def test_public_api_and_defaults(server):
    assert moshpit.serve_metrics is metrics.serve_metrics
    assert server.addr == "127.0.0.1" and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    with pytest.raises(ValueError, match="port"):
        moshpit.serve_metrics(70000)
    with pytest.raises(urllib.error.HTTPError):  # only /metrics (and /) is served
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/secrets", timeout=5)


def test_averaging_rounds_bytes_and_dht_over_http(server, dhts):
    """Three averagers (one compressing with Float16) run two rounds: the counters move."""
    import compression

    before = scrape(server.url)
    averagers = [
        Averager(
            [torch.full((4096,), float(i))],
            dht,
            "metrics-test",
            target_group_size=3,
            compression=compression.Float16() if i == 0 else None,
            **FAST,
        )
        for i, dht in enumerate(dhts)
    ]
    try:
        for _ in range(2):
            futures = [av.step(wait=False, timeout=30) for av in averagers]
            assert all(f.result(timeout=60).succeeded for f in futures)
    finally:
        for av in averagers:
            av.shutdown()
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("moshpit_averaging_rounds_total", outcome="succeeded") == 6
    assert delta("moshpit_averaging_rounds_total", outcome="failed") == 0
    assert delta("moshpit_averaging_matchmaking_seconds_count") == 6
    assert delta("moshpit_averaging_allreduce_seconds_count") == 6
    assert delta("moshpit_averaging_allreduce_seconds_sum") > 0
    assert delta("moshpit_averaging_group_size_sum") == 18  # 6 steps in groups of 3
    assert delta("moshpit_averaging_group_size_bucket", le="3.0") == 6
    for codec in ("none", "Float16"):
        assert delta("moshpit_averaging_sent_bytes_total", codec=codec) > 0
        assert delta("moshpit_averaging_received_bytes_total", codec=codec) > 0
    # the Float16 peer sent half the bytes of each of the two uncompressed ones
    half = delta("moshpit_averaging_sent_bytes_total", codec="none") / 2 / 2
    assert delta("moshpit_averaging_sent_bytes_total", codec="Float16") == pytest.approx(half, 0.01)
    # the DHT side, read at scrape time
    assert value(after, "moshpit_dht_nodes") >= 3
    assert value(after, "moshpit_dht_records_stored") > 0
    assert value(after, "moshpit_dht_routing_table_peers") >= 2
    assert delta("moshpit_dht_requests_served_total", rpc="find") > 0
    assert delta("moshpit_dht_requests_served_total", rpc="store") > 0
    assert value(after, "moshpit_connections", kind="direct") >= 2
    assert ("moshpit_connections", (("kind", "relayed"),)) in after
    assert value(after, "process_resident_memory_bytes") > 0


def test_state_download_epoch_and_checkpoint_age(server, dhts, tmp_path):
    """A donor checkpoints epoch 3, a newcomer downloads it: download, epoch, age."""
    before = scrape(server.url)

    def state(dht, **kwargs):
        model = torch.nn.Linear(3, 2)
        return TrainingStateAverager(
            dht=dht,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            prefix="metrics-state",
            target_group_size=2,
            join_timeout=5.0,
            **FAST,
            **kwargs,
        )

    donor = state(dhts[0], checkpoint_dir=tmp_path / "donor", sync_on_start=False)
    newcomer = state(dhts[1])
    try:
        donor.epoch = 3
        donor.save_checkpoint()
        assert newcomer.load_state_from_peers(timeout=10) == 3
        after = scrape(server.url)
    finally:
        newcomer.shutdown()
        donor.shutdown()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("moshpit_state_downloads_total", outcome="succeeded") == 1
    assert delta("moshpit_state_download_seconds_count") == 1
    assert delta("moshpit_state_download_bytes_total") > 0
    assert value(after, "moshpit_epoch") == 3
    assert 0 <= value(after, "moshpit_checkpoint_age_seconds") < 30
    assert delta("moshpit_checkpoint_failures_total") == 0


async def test_a_ban_is_counted(server):
    """A peer that failed twice in a row with us is avoided: one ban."""
    before = value(scrape(server.url), "moshpit_averaging_banned_peers_total")
    av = Averager([torch.zeros(1)], dht=None, prefix="ban", target_group_size=2, start=False)
    for _ in range(av.ban_after_failures):
        av._record_round(["me", "bad"], {"bad"}, "me")
    assert av._is_banned("bad")
    assert value(scrape(server.url), "moshpit_averaging_banned_peers_total") == before + 1


def test_preemption_is_counted(server):
    from moshpit.training.preemption import PreemptionHandler

    before = value(scrape(server.url), "moshpit_preemptions_total", signal="SIGTERM")
    handler = PreemptionHandler(deadline=30.0, signals=(signal.SIGUSR1,))
    try:
        with pytest.raises(moshpit.Preempted):
            handler._on_signal(signal.SIGTERM, None)  # what a SIGTERM runs: no components
    finally:
        handler.cancel_watchdog()
        handler.uninstall()
    assert value(scrape(server.url), "moshpit_preemptions_total", signal="SIGTERM") == before + 1


@pytest.mark.parametrize(
    "result, outcome",
    [
        (StepResult(True, "k", group_id=b"g", members=(1, 2)), "succeeded"),
        (StepResult(True, "k", group_id=b"g", members=(1, 2, 3), failed={3}), "partial"),
        (StepResult(False, "k", group_id=b"g", members=(1, 2), reason="x"), "failed"),
        (
            StepResult(False, "k", reason="none", matchmaking_seconds=1.5, timed_out=True),
            "no_group",
        ),
        (StepResult(False, "k", reason="cancelled: the averager was shut down"), "skipped"),
    ],
)
def test_round_outcomes_are_a_fixed_set(result, outcome):
    assert metrics._round_outcome(result) == outcome
    assert outcome in metrics.ROUND_OUTCOMES


def test_labels_are_bounded_and_never_name_a_peer(server, dhts):
    """After the rounds above (and a few codecs more), no label value is a PeerID, an
    address or a key, label names come from a fixed list, and no family grows a label set
    per peer."""
    known = set(metrics._metrics._codec_labels)
    try:
        for i in range(40):  # many made-up codec classes still give a bounded set of labels
            codec = type(f"Codec{i}", (), {})()
            averager = type("A", (), {"compression": codec})()
            metrics._metrics.on_averager("step", averager, StepResult(True, "k", bytes_sent=1))
        samples = scrape(server.url)
    finally:  # later tests in this process see their real codecs' names again
        metrics._metrics._codec_labels.intersection_update(known)
    per_family: dict[str, set] = defaultdict(set)
    for name, labels in samples:
        for label, label_value in labels:
            assert label in ALLOWED_LABELS, (name, label)
            assert not PEER_ID_LIKE.search(label_value), (name, label, label_value)
            assert len(label_value) <= 40, (name, label, label_value)
        per_family[re.sub(r"_(bucket|count|sum|total|created)$", "", name)].add(
            tuple(kv for kv in labels if kv[0] != "le")
        )
    for family, label_sets in per_family.items():
        assert len(label_sets) <= metrics.MAX_CODEC_LABELS + 1, family
    codecs = {dict(labels).get("codec") for name, labels in samples if "codec" in dict(labels)}
    assert "other" in codecs and len(codecs) <= metrics.MAX_CODEC_LABELS + 1


def test_a_missing_prometheus_client_is_one_clear_error(monkeypatch):
    for name in list(sys.modules):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            monkeypatch.setitem(sys.modules, name, None)  # `import` now raises ImportError
    with pytest.raises(metrics.MetricsUnavailableError, match=r"pip install '.*\[metrics\]'"):
        moshpit.serve_metrics(0)
    assert issubclass(metrics.MetricsUnavailableError, ImportError)


def test_cli_without_prometheus_client_says_how_to_install(tmp_path):
    """`moshpit dht --metrics-port` where prometheus_client cannot be imported: one line."""
    fake = tmp_path / "prometheus_client"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV['PYTHONPATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "moshpit", "dht", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'moshpit-train[metrics]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nothing_imports_prometheus_client_until_asked_and_dht_metrics_stay_torch_free():
    code = """
import sys, urllib.request
import moshpit, moshpit.metrics, dht
from dht import DHT
assert "prometheus_client" not in sys.modules
d = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
server = moshpit.serve_metrics(0)
text = urllib.request.urlopen(server.url, timeout=10).read().decode()
assert "moshpit_dht_nodes 1.0" in text, text
assert "torch" not in sys.modules, "metrics of a DHT-only process imported torch"
server.close(); d.shutdown()
import moshpit.averaging.averager, moshpit.training.optimizer, moshpit.training.state_averager
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_moshpit_train_serves_metrics_while_it_runs(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moshpit",
            "train",
            "--json",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "0.5",
            "--max-rate",
            "2000",
            "--report-every",
            "0.2",
            "--max-steps",
            "100000",
            "--metrics-port",
            "0",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        url = None
        progress = 0
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "metrics":
                url = event["url"]
            elif event["event"] == "progress" and event["steps"] >= 60:
                progress += 1
                if progress >= 3:
                    break
        assert url is not None and url.startswith("http://127.0.0.1:"), "".join(stderr)
        samples = scrape(url)
        assert value(samples, "moshpit_local_steps_total") >= 60
        assert value(samples, "moshpit_samples_processed_total") >= 60 * 32
        assert value(samples, "moshpit_samples_per_second") > 0
        assert ("moshpit_epoch", ()) in samples
        assert value(samples, "moshpit_dht_nodes") == 1
        # alone: its rounds find no group, and say so
        rounds = sum(v for (n, _), v in samples.items() if n == "moshpit_averaging_rounds_total")
        assert rounds == value(samples, "moshpit_averaging_rounds_total", outcome="no_group")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
