"""The language-model race's read-outs (benchmarks/bench_lm.py): what a summary says must follow
from the curves, or the race's verdicts mean nothing."""

from __future__ import annotations

from benchmarks.bench_lm import link_bits_per_second, max_rise, summarize_race, time_to


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
