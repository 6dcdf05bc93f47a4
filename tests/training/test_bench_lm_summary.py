"""The language-model race's read-outs (benchmarks/bench_lm.py): what a summary says must follow
from the curves, or the race's verdicts mean nothing."""

from __future__ import annotations

import argparse

from benchmarks.bench_lm import (
    ddp_step_too_slow,
    link_bits_per_second,
    max_rise,
    summarize,
    summarize_race,
    time_to,
)


def _row(link: str, method: str, final: float) -> dict:
    return {"link": link, "method": method, "final_bpb_worker0": final, "numel": 2_000_000}


def test_a_spike_is_the_rise_above_the_best_loss_so_far():
    assert max_rise([[0, 5.0], [3, 4.0], [6, 3.5]]) == 0.0
    # a failed fragment applied alone: +0.5 over the best so far, not over the last point
    assert max_rise([[0, 5.0], [3, 4.0], [6, 4.2], [9, 4.5], [12, 3.9]]) == 0.5


def test_time_to_a_loss_interpolates_between_snapshots():
    assert time_to([[0, 5.0], [10, 3.0]], 4.0) == 5.0
    assert time_to([[0, 5.0], [10, 4.5]], 4.0) is None


def test_link_rates_parse_and_loopback_has_none():
    assert link_bits_per_second("200kbit") == 2e5
    assert link_bits_per_second("100mbit") == 1e8
    assert link_bits_per_second("1gbit") == 1e9
    assert link_bits_per_second("loopback") is None


def test_the_race_compares_every_link_with_4bit_diloco_on_the_fastest():
    rows = [
        _row("100mbit", "ddp", 3.50),
        _row("100mbit", "diloco_4bit", 3.30),
        _row("100mbit", "diloco_sparse2bit", 3.32),
        _row("1mbit", "ddp", 6.00),
        _row("1mbit", "diloco_4bit", 3.46),
        _row("1mbit", "diloco_sparse2bit", 3.31),
    ]
    race = summarize_race(rows)
    assert race["reference_link"] == "100mbit" and race["reference_diloco_4bit_bpb"] == 3.30
    slow = race["1mbit"]
    assert slow["best_method"] == "diloco_sparse2bit" and slow["best_bpb"] == 3.31
    assert slow["best_vs_reference_best"] == 0.01
    assert slow["vs_reference_diloco_4bit"] == {
        "ddp": 2.7,
        "diloco_4bit": 0.16,
        "diloco_sparse2bit": 0.01,
    }
    # 2M parameters on 1 Mbit/s weigh what 90M do on a 45 Mbit/s uplink
    assert slow["equivalent_params_on_45mbit_uplink"] == 90_000_000


def test_a_link_without_ddp_still_summarizes_every_method():
    """DDP cannot start on 1 Mbit/s (its weight broadcast outlasts gloo's timeout): the link's
    summary still gives each method's loss and bytes, without ratios to a missing DDP."""
    row = _row("1mbit", "diloco_sparse2bit", 3.31)
    row.update(curve_worker0=[[0, 5.0], [60, 3.31]], payload_bytes_sent_per_peer=250_000)
    row["bytes_per_outer_step_per_peer"] = 62_500
    summary = summarize([row])
    assert summary["diloco_sparse2bit"] == {
        "final_bpb": 3.31,
        "bytes_per_outer_step_per_peer": 62_500,
    }
    assert "ddp_final_bpb" not in summary


def test_ddp_is_skipped_only_where_one_step_or_its_start_outlasts_what_it_has():
    args = argparse.Namespace(peers=4, budget=60.0)
    assert ddp_step_too_slow(args, "loopback") is None
    assert ddp_step_too_slow(args, "10mbit") is None  # ~11 s a step: slow, but it runs
    assert "109 s" in ddp_step_too_slow(args, "1mbit")
    # a 180-s budget fits one 109-s step, but not the start's broadcast of the weights to 3
    # ranks over one 1 Mbit/s uplink (217 s; gloo gives up after 120 s)
    longer = argparse.Namespace(peers=4, budget=180.0)
    assert "start would take 217 s" in ddp_step_too_slow(longer, "1mbit")
    assert ddp_step_too_slow(longer, "10mbit") is None
