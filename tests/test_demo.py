"""`moshpit demo` end to end, with real peer processes.

The default demo trains a small MLP on the 8x8 digits while peers are preempted (SIGTERM and
kill -9) and restarted; it ends with a verdict against a single-process baseline, a PNG plot and
(with --json) a summary as its last line. The averaging demo (`moshpit demo averaging`) still
converges and survives --kill.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_demo(*args: str, cwd: Path = ROOT, timeout: float = 280) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moshpit", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=cwd,
    )


# ------------------------------------------------------------------ the training demo


def test_training_demo_survives_preemptions_and_reports_a_verdict(tmp_path: Path):
    plot = tmp_path / "demo.png"
    proc = run_demo(
        "--peers", "3", "--samples", "40000", "--preemptions", "2", "--max-rate", "800",
        "--restart-delay", "1", "--json", "--plot", str(plot), cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode in (0, 1), out + proc.stderr
    assert "Traceback" not in out + proc.stderr
    summary = json.loads(out.strip().splitlines()[-1])  # the LAST line is the JSON summary
    for key in ("final_accuracy", "baseline_accuracy", "preemptions", "restarts",
                "stuck_peers", "wall_s"):  # fmt: skip
        assert key in summary, summary
    # one SIGTERM and one kill -9, both peers came back, nobody hung
    assert summary["preemptions"] == 2 and summary["sigterm"] == 1 and summary["kill9"] == 1
    assert summary["restarts"] == 2
    assert summary["stuck_peers"] == 0
    assert summary["unclean_exits"] == 0  # the SIGTERMed peer left with exit status 0
    assert summary["peers_at_end"] == 3
    assert summary["samples"] >= 40000
    # a real model was trained: far above chance (0.1), near the single-process baseline
    assert summary["baseline_accuracy"] > 0.9
    assert summary["final_accuracy"] > summary["baseline_accuracy"] - 0.05, summary
    # the verdict line matches the JSON, and the exit status matches the verdict
    verdict = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert verdict and verdict[0].startswith(f"verdict: {summary['verdict']} "), out
    assert proc.returncode == (0 if summary["verdict"] == "OK" else 1)
    assert "preempted peer" in out and "restarted (same identity and checkpoint dir)" in out
    # the SIGTERMed peer resumed from the checkpoint it wrote on its way out
    assert "resumed from its checkpoint of epoch" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["plot"] == str(plot)


def test_replaced_peer_starts_without_a_checkpoint_and_loads_the_swarms_state(tmp_path: Path):
    proc = run_demo(
        "--peers", "2", "--samples", "24000", "--preemptions", "1", "--max-rate", "600",
        "--restart-delay", "0.5", "--replace", "--json", "--no-plot", cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["preemptions"] == 1 and summary["sigterm"] == 1
    assert summary["restarts"] == 1 and summary["stuck_peers"] == 0
    assert "replaced by a fresh peer" in out
    assert "came back without a checkpoint; it loads the swarm's state" in out
    assert "resumed from its checkpoint" not in out
    assert summary["baseline_accuracy"] > 0.9
    assert summary["final_accuracy"] > summary["baseline_accuracy"] - 0.05, summary


def test_training_demo_without_scikit_learn_says_how_to_get_it(tmp_path: Path):
    # a sitecustomize that hides sklearn, as on a machine without the [demo] extra
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['sklearn'] = None\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path) + os.pathsep + ENV["PYTHONPATH"]}
    proc = subprocess.run(
        [sys.executable, "-m", "moshpit", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "pip install 'moshpit-train[demo]'" in out
    assert "Traceback" not in out


def test_training_demo_without_matplotlib_skips_the_plot_and_says_how_to_get_it(tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path) + os.pathsep + ENV["PYTHONPATH"]}
    proc = subprocess.run(
        [sys.executable, "-m", "moshpit", "demo", "--peers", "2", "--samples", "6000",
         "--preemptions", "0", "--json"],
        capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert "no plot: matplotlib is not installed (pip install 'moshpit-train[demo]'" in out
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["plot"] is None and summary["preemptions"] == 0
    assert not (tmp_path / "moshpit-demo.png").exists()


def test_averaging_options_do_not_mix_with_the_training_demo():
    proc = run_demo("train", "--rounds", "3", timeout=60)
    assert proc.returncode == 2
    assert "moshpit demo averaging" in proc.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_ctrl_c_in_the_training_demo_stops_cleanly_with_the_table_and_a_summary(tmp_path: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "moshpit", "demo", "--peers", "2", "--samples", "10000000",
         "--preemptions", "0", "--no-plot"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:  # wait until both peers train (a status line every 5 s)
            line = lines.get(timeout=120)
            if "peers training 2" in line:
                break
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(output)
    assert status == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    summaries = [line for line in text.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(summaries) == 1, text
    assert "samples" in summaries[0] and "all peers stopped" in summaries[0]
    assert "moshpit demo: 2 peers" in text  # the table so far
    assert not any(_running(pid) for pid in workers), "a peer process was left running"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_frozen_peer_counts_as_stuck_and_fails_the_verdict(tmp_path: Path):
    # SIGSTOP one peer for 8 s: alive, but its samples stop moving (a hung peer)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moshpit", "demo", "--peers", "2", "--samples", "16000",
         "--max-rate", "400", "--preemptions", "0", "--stuck-after", "4", "--no-plot", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path,
    )  # fmt: skip
    output: list[str] = []
    trained = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            output.append(line)
            if "peers training 2" in line:
                trained.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert trained.wait(120), "".join(output)
        victim = _children(proc.pid)[0]
        os.kill(victim, signal.SIGSTOP)
        try:
            threading.Event().wait(8.0)
        finally:
            os.kill(victim, signal.SIGCONT)
        status = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    text = "".join(output)
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["stuck_peers"] == 1, text
    assert summary["verdict"] == "NOT OK" and status == 1
    assert "is stuck: no progress for" in text


# ------------------------------------------------------------------ the averaging demo


def test_averaging_demo_converges_exactly_on_a_full_grid():
    # 4 peers, groups of 2: a 2x2 grid, exact after 2 rounds
    proc = run_demo("averaging", "--peers", "4", "--rounds", "2", "--size", "2000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: CONVERGED" in proc.stdout
    assert "4/4 peers alive" in proc.stdout


def test_averaging_demo_survives_a_killed_peer():
    proc = run_demo("--averaging", "--peers", "4", "--rounds", "4", "--size", "500", "--kill")
    assert "killed peer 3" in proc.stdout, proc.stdout + proc.stderr
    assert "3/4 peers alive" in proc.stdout
    assert "verdict:" in proc.stdout  # a verdict line, whatever the luck of the grid
